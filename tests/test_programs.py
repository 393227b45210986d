"""Issue 13, item 4: the programs a user runs as they are (the quick
start's demo with the bundled config, which runs clients/actor.py and
clients/learner.py) run, report throughput and leave nothing behind."""

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
