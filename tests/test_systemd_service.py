"""The production unit at work (issue 24, item 1; issue 33, item 3): the
repository's ``systemd/shmreplay@.service``, unchanged, run by a real
systemd (tests/systemdbox.py: PID 1 of its own namespaces), with its user
made by ``systemd-sysusers`` from ``systemd/sysusers.d/shmreplay.conf``.
What docs/operations.md ("Install as a service", "Hardening") says each
setting does, checked by what systemd and the daemon then do:

* ``Type=notify``: ``systemctl start`` returns once the daemon serves;
* ``User=``/``Group=``, the sandbox (``NoNewPrivileges=``, the empty
  capability sets, ``SystemCallFilter=`` with ``mincore``, no
  ``MemoryDenyWriteExecute=`` so numba can compile, ``ProtectSystem=strict``,
  ``ProtectHome=``, ``PrivateTmp=``): the daemon's own process and mount
  namespace, seen from outside;
* ``RuntimeDirectory=``/``StateDirectory=``/``CacheDirectory=``: made, owned
  by the user, with their modes; numba's cache where the unit says;
* ``Restart=on-failure``: a SIGKILLed daemon is started again and adopts its
  tables (``RemoveIPC=no``); ``WatchdogSec=``: armed, and pinged;
* a clean stop is not restarted, keeps ``/run/shmreplay``
  (``RuntimeDirectoryPreserve=``) and, with ``retain_tables``, the tables.

The tests of one module share one box and one service and run in order.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from conftest import shm_entries
from systemdbox import PACKAGE_PARENT, SystemdBox, usable
from waiting import HANG_S, wait_for

pytestmark = [pytest.mark.skipif(usable() is not None, reason=f"a systemd box {usable()}"),
              pytest.mark.xdist_group("systemd")]  # in order, on one worker

INSTANCE = f"test{os.getpid()}sd"
UNIT = f"shmreplay@{INSTANCE}.service"
CONFIG = """
[daemon]
retain_tables = true
storage_dirs = ["/var/lib/shmreplay/tables"]

[[tables]]
name = "ram"
capacity = 100
[tables.fields]
x = { dtype = "int64", shape = [] }

[[tables]]
name = "disk"
capacity = 100
storage_dir = "/var/lib/shmreplay/tables"
[tables.fields]
x = { dtype = "int64", shape = [] }
"""


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    b = SystemdBox(tmp_path_factory.mktemp("systemd-box"))
    try:
        os.makedirs(f"{b.root}/etc/shmreplay")
        with open(f"{b.root}/etc/shmreplay/{INSTANCE}.toml", "w") as f:
            f.write(CONFIG)
        yield b
    finally:
        try:
            if b.show(UNIT, "ActiveState")["ActiveState"] != "inactive":
                b.run("systemctl", "stop", UNIT, check=False)
        finally:
            b.close()
            for n in shm_entries(f"shmreplay.{INSTANCE}."):  # only after a failure: the tests drop theirs
                os.unlink(f"/dev/shm/{n}")


def client(box: SystemdBox, code: str) -> dict:
    """Run ``code`` (with ``c``, a client of the service) in the box as root
    and return the dict it leaves in ``out``."""
    prog = textwrap.dedent(f"""
        import json, numpy as np, shmreplay
        c = shmreplay.connect("/run/shmreplay/{INSTANCE}.sock", timeout=30)
        out = {{}}
    """) + textwrap.dedent(code) + "\nc.close()\nprint(json.dumps(out))\n"
    p = box.run(sys.executable, "-c", prog,
                env={"SHMREPLAY_DAEMON_USER": "shmreplay", "PYTHONPATH": PACKAGE_PARENT})
    return json.loads(p.stdout.strip().splitlines()[-1])


def passwd_entry(box: SystemdBox, name: str) -> list[str]:
    with open(f"{box.root}/etc/passwd") as f:
        return next(line.strip().split(":") for line in f if line.startswith(f"{name}:"))


def status_of(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, _, v in (line.partition(":") for line in f)}


def as_daemon(box: SystemdBox, pid: int, uid: str, *argv: str) -> subprocess.CompletedProcess:
    """A command in the daemon's own mount namespace, as its user."""
    return subprocess.run(["nsenter", "-t", str(pid), "-m", "-S", uid, "-G", uid, *argv],
                          capture_output=True, text=True, timeout=120)


def test_start_returns_once_the_daemon_serves_as_its_user_in_its_sandbox(box):
    box.run("systemctl", "start", UNIT)  # Type=notify: returns at READY=1
    # no wait, no retry: the socket serves the moment start returned
    got = client(box, """
        t = c.table("ram")
        t.insert_batch({"x": np.arange(10, dtype=np.int64)})
        c.table("disk").insert_batch({"x": np.arange(20, dtype=np.int64)})
        c.flush()
        out["sampled"] = sorted(set(t.sample(64).data["x"].tolist()))
        out["resident"] = c.stats()["tables"]["disk"]["resident_bytes"]
    """)
    assert got["sampled"] and set(got["sampled"]) <= set(range(10)), got  # numba compiled and ran in the sandbox
    assert isinstance(got["resident"], int), got  # mincore, let through the system call filter
    show = box.show(UNIT, "ActiveState", "SubState", "Type", "WatchdogUSec", "NRestarts")
    assert (show["ActiveState"], show["SubState"], show["Type"]) == ("active", "running", "notify"), show
    assert show["WatchdogUSec"] == "30s", show

    user = passwd_entry(box, "shmreplay")  # made by systemd-sysusers from the repository's file
    assert int(user[2]) < 1000 and user[5] == "/var/lib/shmreplay" and user[6].endswith("nologin"), user
    pid = box.host_pid(UNIT)
    st = status_of(pid)
    assert st["Uid"].split()[:2] == [user[2]] * 2 and st["Gid"].split()[:2] == [user[3]] * 2, st
    assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2", st  # NoNewPrivileges=, SystemCallFilter=
    assert int(st["CapEff"], 16) == 0 and int(st["CapBnd"], 16) == 0, st  # CapabilityBoundingSet= (empty)

    uid = user[2]
    home = as_daemon(box, pid, uid, "ls", "/root")
    assert home.returncode != 0 and "Permission denied" in home.stderr, home  # ProtectHome=yes
    usr = as_daemon(box, pid, uid, "sh", "-c", f"touch /var/lib/shmreplay/{INSTANCE}.probe && "
                    f"rm /var/lib/shmreplay/{INSTANCE}.probe && touch /var/{INSTANCE}.probe")
    assert usr.returncode != 0 and "Read-only file system" in usr.stderr, usr  # strict: only its directories
    with open(f"{box.root}/tmp/{INSTANCE}.seen", "w"):
        pass
    tmp = as_daemon(box, pid, uid, "ls", "/tmp")
    assert tmp.returncode == 0 and f"{INSTANCE}.seen" not in tmp.stdout, tmp  # PrivateTmp=yes

    for path, mode in (("run/shmreplay", 0o755), ("var/lib/shmreplay", 0o755), ("var/cache/shmreplay", 0o700)):
        s = os.stat(f"{box.root}/{path}")
        assert (s.st_uid, stat.S_IMODE(s.st_mode)) == (int(uid), mode), (path, s)
    cache = f"{box.root}/var/cache/shmreplay/numba"  # NUMBA_CACHE_DIR=
    files = [os.path.join(d, n) for d, _, ns in os.walk(cache) for n in ns]
    assert files and all(os.stat(f).st_uid == int(uid) for f in files), files


def test_a_crashed_daemon_is_restarted_and_adopts_its_tables_and_the_watchdog_is_pinged(box):
    before = box.host_pid(UNIT)
    os.kill(before, signal.SIGKILL)
    # Restart=on-failure, RestartSec=2: a new main process, serving again
    wait_for(lambda: box.show(UNIT, "NRestarts", "ActiveState", "SubState") ==
             {"NRestarts": "1", "ActiveState": "active", "SubState": "running"}, "systemd to restart the daemon")
    assert box.host_pid(UNIT) != before
    got = client(box, """
        out["ram"] = sorted(c.table("ram").sample(200).data["x"].tolist())
        out["sizes"] = [len(c.table("ram")), len(c.table("disk"))]
    """)
    assert got["sizes"] == [10, 20] and set(got["ram"]) == set(range(10)), got  # adopted from /dev/shm
    # WatchdogSec=30s: the daemon pings every 15 s while it makes progress (systemd stamps the
    # watchdog when it arms it at READY=1, and again at each ping)
    armed = int(box.show(UNIT, "WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"])
    wait_for(lambda: int(box.show(UNIT, "WatchdogTimestampMonotonic")["WatchdogTimestampMonotonic"]) > armed,
             "a watchdog ping", timeout=HANG_S)


def test_a_clean_exit_is_not_restarted_and_keeps_the_runtime_directory_and_retained_tables(box):
    kept = shm_entries(f"shmreplay.{INSTANCE}.")
    assert kept, "the tables are in /dev/shm"
    box.run(sys.executable, "-m", "shmreplay.cli", "--socket", f"/run/shmreplay/{INSTANCE}.sock", "shutdown",
            env={"SHMREPLAY_DAEMON_USER": "shmreplay", "PYTHONPATH": PACKAGE_PARENT})  # returns once it exited
    # the command returns once the socket is gone; systemd sees the process exit a moment later
    # (it is "deactivating" since the daemon's STOPPING=1). Restart=on-failure decides at that
    # exit: a restart would show as activating/auto-restart, a stop as inactive/dead
    show = wait_for(lambda: (s := box.show(UNIT, "ActiveState", "SubState", "Result", "ExecMainStatus"))[
        "ActiveState"] not in ("active", "deactivating") and s, "systemd to see the daemon exit")
    assert show == {"ActiveState": "inactive", "SubState": "dead", "Result": "success", "ExecMainStatus": "0"}, show
    assert os.path.isdir(f"{box.root}/run/shmreplay")  # RuntimeDirectoryPreserve=yes
    assert shm_entries(f"shmreplay.{INSTANCE}.") == kept  # retain_tables, and RemoveIPC=no left them
    box.run("systemctl", "start", UNIT)
    got = client(box, """
        out["sizes"] = [len(c.table("ram")), len(c.table("disk"))]
        c.drop_table("ram")
        c.drop_table("disk")
    """)
    assert got["sizes"] == [10, 20], got
    box.run("systemctl", "stop", UNIT)
    assert box.show(UNIT, "Result")["Result"] == "success"
    assert shm_entries(f"shmreplay.{INSTANCE}.") == set()
