"""Issue 24, item 1: under systemd's watchdog the daemon pings WATCHDOG=1
(with a STATUS= line) only while both its event loop and its engine thread
make progress: a stalled engine stops the pings (so systemd restarts it),
and they come back when it goes on.  A real daemon, a real notify socket;
the stall is injected into the engine's serving pass (stalling_daemon.py)."""

import os
import signal
import socket
import subprocess
import sys

from conftest import remove_entries, write_config
from waiting import wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
TABLE = {"name": "t", "capacity": 64, "fields": {"x": ("float32", ())}}


def next_message(sink, want: str) -> str:
    """The next datagram that starts with ``want`` (others are skipped)."""
    while True:
        msg = sink.recv(4096).decode()
        if msg.startswith(want):
            return msg


def drain(sink) -> list[str]:
    sink.setblocking(False)
    got = []
    try:
        while True:
            got.append(sink.recv(4096).decode())
    except BlockingIOError:
        pass
    finally:
        sink.setblocking(True)
    return got


def test_watchdog_pings_stop_while_the_engine_stalls_and_resume(tmp_path):
    addr = str(tmp_path / "notify.sock")
    sink = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sink.bind(addr)
    sink.settimeout(120)
    pause = tmp_path / "pause"
    pause.mkdir()
    log_path = tmp_path / "d.log"
    cfg = write_config(tmp_path / "w.toml", [TABLE], instance=f"test{os.getpid()}wd",
                       socket=str(tmp_path / "w.sock"))
    env = dict(os.environ, NOTIFY_SOCKET=addr, WATCHDOG_USEC="200000",
               SHMREPLAY_TEST_PAUSE_DIR=str(pause))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(HERE, "stalling_daemon.py"), "--config", cfg],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        assert next_message(sink, "READY=1") == "READY=1"
        ping = next_message(sink, "WATCHDOG=1")
        assert ping == "WATCHDOG=1\nSTATUS=1 table, 0 items, 0 clients", ping
        # stall the engine; once it says it is stuck and the loop has missed
        # an answer, no ping can be on its way any more
        (pause / "stall").touch()
        wait_for(lambda: (pause / "stalled").exists(), "the engine to stall")
        wait_for(lambda: "did not answer" in log_path.read_text(errors="replace"), "a missed ping")
        drain(sink)
        missed_before = log_path.read_text(errors="replace").count("did not answer")
        wait_for(lambda: log_path.read_text(errors="replace").count("did not answer") >= missed_before + 3,
                 "three more missed pings")
        assert not [m for m in drain(sink) if m.startswith("WATCHDOG=1")], "pinged while the engine stalled"
        (pause / "stall").unlink()
        assert next_message(sink, "WATCHDOG=1").startswith("WATCHDOG=1\nSTATUS=")  # back
        proc.send_signal(signal.SIGTERM)
        assert next_message(sink, "STOPPING=1") == "STOPPING=1"
        assert proc.wait(60) == 0
    finally:
        if (pause / "stall").exists():
            (pause / "stall").unlink()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
            remove_entries(f"test{os.getpid()}wd")
        sink.close()
