"""Issue 13, item 4: the programs a user runs as they are (the quick
start's demo with the bundled config, which runs clients/actor.py and
clients/learner.py) run, report throughput and leave nothing behind."""

import ast
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

from shmreplay.wire.names import runtime_dir

from conftest import remove_entries
from daemons import checkout_env
from waiting import processes, wait_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _marked(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (the demo and every
    process it started inherit its TMPDIR)."""
    found = []
    for pid, _ in processes():
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue  # gone meanwhile
        if marker.encode() in env:
            found.append(pid)
    return found


def _objects(instance: str) -> list[str]:
    """The instance's names in /dev/shm and the runtime directory (its lock)."""
    mark = f".{instance}."
    rundir = os.listdir(runtime_dir()) if os.path.isdir(runtime_dir()) else []
    return sorted([n for n in os.listdir("/dev/shm") if mark in n]
                  + [n for n in rundir if instance in n])


def test_the_demo_runs_with_the_bundled_config_and_leaves_nothing():
    """README's quick start (``python3 clients/demo.py``) runs, reports
    throughput, and leaves nothing behind, checked from outside rather than
    trusted to the demo's own "left behind: none" line: its instance
    (``--instance``, named like every test object) has nothing in /dev/shm
    or the runtime directory, the temporary directory of its private
    daemon (``shmreplay.Server``; the demo runs with a TMPDIR of its own)
    is gone, and no process it started (all inherit that TMPDIR) is left."""
    instance = f"test{os.getpid()}xdemo"
    # short: the private daemon's socket goes in it (a Unix socket's path has 108 bytes)
    tmp = tempfile.mkdtemp(prefix=f"shmreplay-test{os.getpid()}demo", dir="/tmp")
    marker = f"TMPDIR={tmp}"
    assert _objects(instance) == [] and _marked(marker) == []
    try:
        run = subprocess.run([sys.executable, os.path.join(ROOT, "clients", "demo.py"), "--seconds", "2",
                              "--actors", "1", "--instance", instance], cwd=ROOT, capture_output=True,
                             text=True, timeout=300, env=checkout_env(TMPDIR=tmp))
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        m = re.search(r"result: (\d+) items inserted by 1 actor\(s\).*learner ([\d.]+) batches/s", run.stdout)
        assert m and int(m.group(1)) > 0 and float(m.group(2)) > 0, run.stdout[-2000:]
        left = _marked(marker)
        assert left == [], f"processes the demo started are still running: {left}"
        assert _objects(instance) == [], _objects(instance)
        assert os.listdir(tmp) == [], os.listdir(tmp)  # the private daemon's socket, log and config
    finally:  # what a failure left: ended and removed, so it does not outlive the test
        for pid in _marked(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_for(lambda: not _marked(marker), "the demo's processes to end")
        remove_entries(instance)
        shutil.rmtree(tmp, ignore_errors=True)


def test_the_bundled_config_loads_and_declares_the_demo_table():
    from shmreplay.server.control.config import load_config
    cfg = load_config(os.path.join(ROOT, "daemon", "shmreplayd.toml"))
    assert [t.name for t in cfg.tables] == ["demo"]
    assert cfg.hold_timeout_s > 0 and cfg.handshake_timeout_s > 0
    json.dumps(cfg.tables[0].to_wire())  # a spec the wire can carry


def _path_edits(source: str) -> list[int]:
    """Lines that change ``sys.path`` (a call on it, an assignment to it or
    to a slice of it); a mention in a string or a comment is none."""
    def is_path(node) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "path"
                and isinstance(node.value, ast.Name) and node.value.id == "sys")
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and is_path(node.func.value):
            lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_path(t) or (isinstance(t, ast.Subscript) and is_path(t.value)) for t in targets):
                lines.append(node.lineno)
    return lines


def test_the_programs_and_benchmarks_import_the_installed_package_without_sys_path_edits():
    """Issue 35, item 4: clients/ and benchmarks/ import the installed
    shmreplay (the quick start installs it) and share code as plain
    modules (a script's own folder is first on sys.path), so none edits
    sys.path; the tests that run them put the checkout on PYTHONPATH
    (daemons.checkout_env)."""
    assert _path_edits("import sys\nsys.path[:0] = ['x']\nsys.path.insert(0, 'y')\n'sys.path.append'\n") == [2, 3]
    edits = {}
    for folder in ("clients", "benchmarks"):
        for name in sorted(os.listdir(os.path.join(ROOT, folder))):
            if name.endswith(".py"):
                with open(os.path.join(ROOT, folder, name)) as f:
                    found = _path_edits(f.read())
                if found:
                    edits[f"{folder}/{name}"] = found
    assert edits == {}, f"sys.path edits (file: lines): {edits}"
