"""Issue 13, item 1: a failing test fails fast and leaves nothing behind.

Runs the client-kill fault test (daemon, innocent actor and learner,
victims; all real processes) in its own pytest process, with a deliberate
failure in the middle of its kill loop, in a session of its own: the run
must fail with that assert, within a hang guard rather than a CI timeout,
and leave no process of that session and no shared object or lock of that
run behind."""

import os
import re
import signal
import subprocess
import sys
import time

from shmreplay.wire.names import runtime_dir
from conftest import nested_env
from waiting import processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HANG_S = 120.0


def session_members(sid: int) -> list[int]:
    return [pid for pid, f in processes() if int(f[3]) == sid and f[0] != "Z"]


def test_a_failure_mid_fault_test_ends_the_run_and_leaves_nothing(tmp_path):
    env = nested_env(SHMREPLAY_TEST_DELIBERATE_FAILURE="client_kills")
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-n", "0",
         "tests/fault/test_client_kills.py::test_clients_killed_at_every_step_cost_nobody_anything"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        out, _ = run.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        raise AssertionError("the failing run hung instead of failing")
    assert run.returncode == 1, out[-3000:]
    assert "deliberate failure" in out and "1 failed" in out, out[-3000:]
    # nothing of that run is left: no process of its session (daemon,
    # workers), no segment or lock named after its pid
    deadline = time.monotonic() + 30  # a hang guard: reaped processes leave /proc a moment later
    while session_members(run.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = session_members(run.pid)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"the failed run left processes {left}"
    mine = re.compile(rf"shmreplay\.test{run.pid}(?!\d)")
    rundir = os.listdir(runtime_dir()) if os.path.isdir(runtime_dir()) else []
    assert not [n for n in os.listdir("/dev/shm") + rundir if mine.search(n)]
