"""Issue 33, item 3: ``shmreplay shutdown`` waits (``--wait``, 60 s) until
the daemon has exited, and says what it stopped (docs/operations.md, after
the exit codes; cli.py ``_shutdown``: "wait until its socket is gone").

The command is the real one, in a process of its own; the daemon is real,
held in its stop by fault injection (lingering_daemon.py): a plain daemon
exits faster than the command could notice returning too early.  The
command must not return while the daemon is held, and when it returns the
daemon's process has exited and its socket is gone.  A daemon that does
not exit within ``--wait`` makes it exit 1 saying so."""

import os
import subprocess
import sys

import pytest

from waiting import HANG_S, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))


def shutdown_command(sock: str, wait: float) -> list[str]:
    return [sys.executable, "-m", "shmreplay.cli", "--socket", sock, "shutdown", "--wait", str(wait)]


def lingering(start_daemon, tmp_path):
    """A daemon that, asked to stop, lingers until the test removes ``hold``."""
    pause = tmp_path / "pause"
    pause.mkdir()
    (pause / "hold").touch()
    d = start_daemon(command=[sys.executable, os.path.join(HERE, "lingering_daemon.py")],
                     env={"SHMREPLAY_TEST_PAUSE_DIR": str(pause)})
    return d, pause


def let_go(d, pause) -> None:
    """End the hold and wait for the daemon to finish the stop it was asked
    for (a SIGTERM from the fixture in the middle of it would kill it)."""
    (pause / "hold").unlink(missing_ok=True)
    if (pause / "stopping").exists():
        d.proc.wait(HANG_S)


def exited(d) -> bool:
    return d.proc.poll() is not None


def connected(pid: int) -> bool:
    """Whether process ``pid`` still has a socket open (False once it exited)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    links = []
    for fd in fds:
        try:
            links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            pass
    return any(x.startswith("socket:") for x in links)


def test_shutdown_keeps_waiting_while_the_daemon_has_not_exited(start_daemon, tmp_path):
    """A daemon held after it was asked to stop: the command, its answer in
    hand, does not return while the daemon runs; once let go, it returns
    with the daemon exited and its socket gone."""
    d, pause = lingering(start_daemon, tmp_path)
    cli = subprocess.Popen(shutdown_command(d.socket, 600), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (pause / "stopping").exists(), "the daemon to be asked to stop")
        # the command has its answer and closed its connection: from here on
        # it only waits for the daemon, which cannot exit while held
        wait_for(lambda: not connected(cli.pid), "the command to close its connection")
        with pytest.raises(subprocess.TimeoutExpired):
            cli.wait(1.0)  # returning now would be returning before the daemon exited
        assert not exited(d) and os.path.exists(d.socket)
        (pause / "hold").unlink()
        out, err = cli.communicate(timeout=HANG_S)  # a hang guard
        assert exited(d) and not os.path.exists(d.socket), (out, err, d.log())
        assert cli.returncode == 0 and f"shmreplayd pid {d.pid} (instance {d.instance}) stopped:" in out, (out, err)
        assert d.proc.returncode == 0
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.communicate()
        let_go(d, pause)


def test_shutdown_gives_up_after_wait_seconds_saying_so(start_daemon, tmp_path):
    """A daemon that will not exit within ``--wait``: the command exits 1
    saying it asked and the daemon still runs (docs/operations.md, exit
    code 1: "the daemon refused or failed the request")."""
    d, pause = lingering(start_daemon, tmp_path)
    try:
        run = subprocess.run(shutdown_command(d.socket, 0.5), capture_output=True, text=True,
                             timeout=HANG_S)  # a hang guard, not a speed requirement
        assert (pause / "stopping").exists()  # it was asked, and held: it cannot have exited
        assert run.returncode == 1, (run.stdout, run.stderr)
        assert (f"shmreplayd pid {d.pid} (instance {d.instance}) asked to stop "
                "(still running after 0.5 s)") in run.stdout, run.stdout
        assert not exited(d)
    finally:
        let_go(d, pause)
    assert d.proc.returncode == 0  # let go, it stopped cleanly
