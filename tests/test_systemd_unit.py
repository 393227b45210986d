"""The production systemd unit (issue 24, item 1): ``systemd/shmreplay@.service``
and the user it runs as, ``systemd/sysusers.d/shmreplay.conf``, checked with
systemd's own tools: ``systemd-analyze verify`` (the unit parses, every
setting is accepted, the daemon it starts is executable),
``systemd-analyze security --offline=true`` (exposure <= 4.0) and
``systemd-sysusers`` (the user and group it declares get made).

What systemd then does with the unit (start at READY=1, the user, the
sandbox's effect on the daemon, restarts, the watchdog, the directories) is
tested by running it under a real systemd: test_systemd_service.py.
``verify`` does not look up ``User=`` (it is resolved when the service
starts), so the user's existence is also checked here by running the
sysusers file into a scratch root.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UNIT = os.path.join(ROOT, "systemd", "shmreplay@.service")
SYSUSERS = os.path.join(ROOT, "systemd", "sysusers.d", "shmreplay.conf")
INSTALLED = "/opt/shmreplay/venv/bin/shmreplayd"  # where docs/operations.md installs it
MAX_EXPOSURE = 4.0

analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                             reason="systemd-analyze is not installed: the unit can only be "
                                    "verified with systemd's own tools")


def unit_text() -> str:
    with open(UNIT) as f:
        return f.read()


def directives(text: str) -> dict[str, list[str]]:
    """Every ``Key=value`` of the unit, values in order (comments and section
    headers left out; a key may repeat)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line[0] in "#;[":
            continue
        key, _, value = line.partition("=")
        out.setdefault(key.strip(), []).append(value.strip())
    return out


def daemon_executable(tmp_path) -> str:
    """The ``shmreplayd`` of the Python running the tests, else a wrapper
    script that runs the daemon module with it."""
    script = os.path.join(os.path.dirname(sys.executable), "shmreplayd")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return script
    wrapper = tmp_path / "shmreplayd"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m shmreplay.server.daemon "$@"\n')
    wrapper.chmod(0o755)
    return str(wrapper)


def render(tmp_path, text: str | None = None, name: str = "shmreplay@test.service") -> str:
    """The template with ExecStart pointed at this environment's daemon,
    written as an instance unit in ``tmp_path``."""
    text = unit_text() if text is None else text
    assert text.count(INSTALLED) == 1, f"the unit should start {INSTALLED} exactly once"
    exe = daemon_executable(tmp_path)
    assert not re.search(r"\s", exe), f"a path with whitespace would need quoting in ExecStart: {exe}"
    path = tmp_path / name
    path.write_text(text.replace(INSTALLED, exe))
    return str(path)


def run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


# ---- systemd-analyze ------------------------------------------------------

@analyze
def test_systemd_accepts_every_line_of_the_unit(tmp_path):
    p = run("systemd-analyze", "verify", render(tmp_path))
    out = p.stdout + p.stderr
    complaints = [line for line in out.splitlines() if "shmreplay" in line]
    assert p.returncode == 0 and not complaints, f"systemd-analyze verify:\n{out}"


@analyze
def test_verify_does_report_a_bad_line(tmp_path):
    """The test above means something: this systemd-analyze names a setting
    it ignores (it logs it and still exits 0, hence the check of the
    output there, not just the exit code)."""
    text = unit_text().replace("\nProtectHome=yes\n", "\nProtectHome=maybe\n")
    p = run("systemd-analyze", "verify", render(tmp_path, text))
    assert "protect home" in (p.stdout + p.stderr).lower(), p.stdout + p.stderr


@analyze
def test_exposure_is_at_most_4(tmp_path):
    p = run("systemd-analyze", "security", "--offline=true", "--no-pager", render(tmp_path))
    out = p.stdout + p.stderr
    m = re.search(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)", out)
    assert m, f"no exposure level in:\n{out}"
    assert float(m.group(1)) <= MAX_EXPOSURE, out


# ---- the user --------------------------------------------------------------

@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers is not installed")
def test_sysusers_makes_the_units_user_and_group(tmp_path):
    (tmp_path / "etc").mkdir()
    p = run("systemd-sysusers", f"--root={tmp_path}", SYSUSERS)
    assert p.returncode == 0, p.stdout + p.stderr
    units = directives(unit_text())
    user, group = units["User"][-1], units["Group"][-1]
    passwd = {f[0]: f for f in (line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines())}
    groups = {f[0]: f for f in (line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines())}
    assert user in passwd and group in groups, (passwd, groups)
    name, _, uid, gid, _, home, shell = passwd[user]
    assert int(uid) < 1000, "a system user (logind's RemoveIPC= spares system users)"
    assert gid == groups[group][2], "the group is the user's primary group"
    assert home == "/var/lib/shmreplay" and shell.endswith("nologin"), passwd[user]
