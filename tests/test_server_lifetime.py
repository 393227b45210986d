"""Issue 33, item 2: ``shmreplay.Server``'s daemon does not outlive its
program.  docs/guide.md ("A daemon of the program's own: shmreplay.Server": "it
gets SIGTERM if the program dies") and
client/private_daemon.py ("a program killed with SIGKILL leaves no daemon
running behind it ... the daemon's own SIGTERM path removes them").

A real program (a subprocess) makes a Server with a table, and is
SIGKILLed, so none of its own cleanup runs; from outside, the daemon must
exit through its SIGTERM path and leave nothing in /dev/shm."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from conftest import remove_entries, shm_entries
from shmreplay.wire.names import lock_path
from waiting import HANG_S, proc_stat, wait_for

PROGRAM = """
import json, sys, time
import shmreplay
server = shmreplay.Server(tables=[dict(name="replay", capacity=100, fields={"x": ("float32", (4,))})],
                          instance=sys.argv[1])
with server.connect() as c:
    c.table("replay").insert(x=[1.0, 2.0, 3.0, 4.0])
    c.flush()
print(json.dumps({"pid": server.pid, "dir": server.dir, "socket": server.socket,
                  "log": server.log_path}), flush=True)
time.sleep(10 * 60)  # a hang guard: the test kills it long before
"""


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie its new parent has not reaped yet."""
    st = proc_stat(f"/proc/{pid}/stat")
    return st is None or st[0] == "Z"


def test_a_servers_daemon_exits_and_leaves_nothing_when_its_program_is_killed():
    instance = f"test{os.getpid()}life"
    program = subprocess.Popen([sys.executable, "-c", PROGRAM, instance], stdout=subprocess.PIPE, text=True)
    info = None
    try:
        info = json.loads(program.stdout.readline())  # the Server is up, its table made
        daemon = info["pid"]
        assert not gone(daemon)
        assert proc_stat(f"/proc/{daemon}/stat")[1] == str(program.pid)  # the program's child
        assert shm_entries(f"shmreplay.{instance}.")  # the table's segments
        program.send_signal(signal.SIGKILL)
        assert program.wait(HANG_S) == -signal.SIGKILL
        wait_for(lambda: gone(daemon), "the daemon to exit after its program died")
        with open(info["log"]) as f:
            log = f.read()
        assert "signal received; shutting down" in log and "stopped" in log, log  # its SIGTERM path
        assert not shm_entries(f"shmreplay.{instance}.")
        assert not os.path.exists(info["socket"])
        assert not os.path.exists(lock_path(instance))
    finally:
        leave_nothing(program, info, instance)


def leave_nothing(program, info, instance: str) -> None:
    """Whatever a failed promise left: the program, its daemon, its folder and objects."""
    if program.poll() is None:
        program.kill()
        program.wait(HANG_S)
    for stream in (program.stdout, program.stderr):
        if stream is not None:
            stream.close()
    if info is not None:
        if not gone(info["pid"]):  # the promise failed: leave nothing running for the next test
            os.kill(info["pid"], signal.SIGKILL)
            wait_for(lambda: gone(info["pid"]), "the leftover daemon to die")
        shutil.rmtree(info["dir"], ignore_errors=True)  # a killed program's: Server.stop removes it
    remove_entries(instance)



@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_program_stopped_by_sigterm_or_sigint_removes_its_servers_folder(sig):
    """Issue 38, item 5: the program's own cleanup runs on SIGTERM (it
    raises SystemExit(143) where the program has no handler) and on SIGINT
    (KeyboardInterrupt): the Server's folder, its daemon, its segments and
    its lock are gone once the program has exited."""
    instance = f"test{os.getpid()}sig{int(sig)}"
    program = subprocess.Popen([sys.executable, "-c", PROGRAM, instance], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    info = None
    try:
        info = json.loads(program.stdout.readline())
        assert os.path.isdir(info["dir"])
        program.send_signal(sig)
        code = program.wait(HANG_S)
        assert code == (143 if sig == signal.SIGTERM else -signal.SIGINT), (code, program.stderr.read()[-2000:])
        assert gone(info["pid"])
        assert not os.path.exists(info["dir"]), os.listdir(info["dir"])
        assert not shm_entries(f"shmreplay.{instance}.")
        assert not os.path.exists(lock_path(instance))
    finally:
        leave_nothing(program, info, instance)


FORKING = """
import json, os, sys
import shmreplay
with shmreplay.Server(tables=[dict(name="replay", capacity=100, fields={"x": ("float32", ())})],
                      instance=sys.argv[1]) as server:
    child = os.fork()
    if child == 0:
        sys.exit(0)  # a worker ending normally: its interpreter runs the atexit hooks
    _, status = os.waitpid(child, 0)
    with server.connect() as c:  # the parent's daemon still serves
        c.table("replay").insert(x=1.0)
        c.flush()
        print(json.dumps({"child": os.waitstatus_to_exitcode(status), "len": len(c.table("replay")),
                          "dir": os.path.isdir(server.dir)}), flush=True)
"""


def test_a_forked_child_ending_leaves_its_parents_server_running():
    """A TorchRL collector worker (a forked child) holds a copy of the
    program's Server: its exit must not stop the parent's daemon."""
    instance = f"test{os.getpid()}fork"
    try:
        out = subprocess.run([sys.executable, "-c", FORKING, instance], capture_output=True, text=True,
                             timeout=HANG_S)
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout) == {"child": 0, "len": 1, "dir": True}
    finally:
        remove_entries(instance)


def test_a_server_whose_daemon_was_killed_starts_it_again_with_its_items():
    """``Server.restart`` (what a shard host does when its daemon dies):
    the same socket and instance, the tables adopted with their items; a
    client with ``reconnect=True`` carries on; refused while it runs."""
    import numpy as np
    import shmreplay
    from shmreplay.errors import ReplayError
    with shmreplay.Server(tables=[dict(name="t", capacity=16, fields={"x": ("float32", ())})]) as server:
        c = server.connect(reconnect=True)
        t = c.table("t")
        t.insert_batch({"x": np.arange(5, dtype=np.float32)})
        c.flush()
        with pytest.raises(ReplayError, match="is running"):
            server.restart()
        first = server.pid
        os.kill(first, signal.SIGKILL)
        server.proc.wait()
        server.restart()
        assert server.pid != first and server.proc.poll() is None
        assert len(t) == 5 and sorted(t.sample(64).data["x"].tolist())[0] == 0.0
        t.insert(x=9.0)
        c.flush()
        assert len(t) == 6
    with pytest.raises(ReplayError, match="stopped"):
        server.restart()
