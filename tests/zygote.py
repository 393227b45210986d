"""Test daemons forked from a warm process instead of started afresh.

Starting ``python -m shmreplay.server.daemon`` costs ~1.1 s of CPU before
the daemon serves (~0.55 s of imports, numba's among them, and ~0.45 s
loading its kernels from numba's cache); the suite starts ~400 daemons,
which made that half the suite's CPU on a 2-core box.  So each pytest
worker keeps one *zygote*: this file run as a program, which imports the
daemon, loads every kernel once (the daemon's own ``compile_kernels``),
and then forks a daemon per request.  The child runs the daemon's real
``main()`` with the test's arguments, environment, working directory and
umask, its stdout and stderr on the test's log file: the same code as a
started daemon, in a process of its own, minus the interpreter start.

Daemons with a ``command`` of their own (fault injection, a cgroup or a
umask wrapper), ``shmreplay.Server``, the command line, the systemd unit
and the example programs still start the daemon the usual way, so the
cold start stays tested.  ``SHMREPLAY_TEST_ZYGOTE=0`` turns the zygote
off (every test daemon then starts afresh).

Protocol: JSON lines on the zygote's stdin (a request: argv, log, env,
cwd, umask) and stdout (``{"started": pid}`` in answer, and
``{"exited": pid, "code": c}`` whenever a child ends, ``c`` as
``Popen.returncode`` has it: negative for a signal).  The zygote reaps its
children; it ends, killing any left, when its stdin closes.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ZYGOTE_START_S = 300.0  # a hang guard: a fresh clone compiles every kernel first


def enabled() -> bool:
    return os.environ.get("SHMREPLAY_TEST_ZYGOTE", "1") != "0"


# ---- the test's side ----
class Zygote:
    """One per pytest worker: started at its first daemon, stopped at the
    end of the session (``close``)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1, cwd=HERE)
        self.exits: dict[int, int] = {}
        self._pending = ""
        self.lock = threading.Lock()  # a test's threads may poll while another starts a daemon
        try:
            msg = self._read(ZYGOTE_START_S)
            assert msg == {"ready": True}, f"the zygote did not start: {msg}"
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise

    def spawn(self, argv: list[str], log: str, env: dict | None = None) -> "Forked":
        req = {"argv": argv, "log": log, "env": dict(os.environ) if env is None else env,
               "cwd": os.getcwd(), "umask": _umask()}
        with self.lock:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            while True:
                msg = self._read(60.0)
                if "started" in msg:
                    # a notice of an earlier child with this pid came before (the zygote
                    # reaps and reports a child before the kernel can give its pid again)
                    self.exits.pop(msg["started"], None)
                    return Forked(self, msg["started"])

    def _read(self, timeout: float) -> dict:
        """The next message (exit notices are recorded on the way)."""
        deadline = time.monotonic() + timeout
        while True:
            line, sep, rest = self._pending.partition("\n")
            if sep:
                self._pending = rest
                msg = json.loads(line)
                if "exited" in msg:
                    self.exits[msg["exited"]] = msg["code"]
                return msg
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError(f"no word from the zygote within {timeout} s")
            chunk = os.read(self.proc.stdout.fileno(), 65536).decode()
            if not chunk:
                raise RuntimeError(f"the zygote ended (exit {self.proc.wait()})")
            self._pending += chunk

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """``pid``'s exit code, waiting up to ``timeout`` (None: still running)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while pid not in self.exits:
                try:  # a timeout of 0 still reads what has come
                    self._read(max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    return None
            return self.exits[pid]

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


class Forked:
    """What DaemonProcess uses of a ``Popen``, for a daemon the zygote forked."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, 0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, 1e9 if timeout is None else timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"daemon {self.pid}", timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


# ---- the zygote ----
def _exit_code(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def _child(req: dict, parent_fds: tuple[int, ...]) -> None:
    """In the forked child: become the daemon the request asks for, and
    never return into the zygote's loop, whatever fails."""
    code = 1
    try:
        code = _become_daemon(req, parent_fds)
    except BaseException:
        import traceback
        traceback.print_exc()  # onto the test's log once it is open, else the zygote's stderr
    finally:
        import logging
        logging.shutdown()  # flush the log, as the interpreter's exit would
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)  # never back into the zygote's loop, whatever is left running


def _become_daemon(req: dict, parent_fds: tuple[int, ...]) -> int:
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for fd in parent_fds:  # the protocol's pipes and the wake-up pipe: the zygote's, not the daemon's
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    log = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    for fd, target in ((null, 0), (log, 1), (log, 2)):
        os.dup2(fd, target)
    for fd in {null, log} - {0, 1, 2}:
        os.close(fd)
    os.chdir(req["cwd"])
    os.umask(req["umask"])
    os.environ.clear()
    os.environ.update(req["env"])
    from shmreplay.server import daemon
    try:
        return daemon.main(req["argv"])
    except SystemExit as exc:  # argparse's exits
        return exc.code if isinstance(exc.code, int) else 2


def _serve() -> None:
    sys.path.insert(0, os.path.dirname(HERE))  # the repository's package, not an installed copy
    from shmreplay.server import daemon
    daemon.compile_kernels()  # loaded (or compiled) once, in every child already
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nothing else may write into the protocol
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    children: set[int] = set()
    try:
        _loop(out, wake_r, wake_w, children)
    except BrokenPipeError:  # the test worker is gone
        pass
    finally:
        _end_children(children)


def _end_children(children: set[int]) -> None:
    """The worker is done (or gone): a daemon still running is a test's
    leftover; SIGTERM lets it remove its names, SIGKILL after a grace."""
    for pid in children:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 30.0
    while children and time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            children.discard(pid)
        else:
            time.sleep(0.05)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _loop(out, wake_r: int, wake_w: int, children: set[int]) -> None:
    out.write(json.dumps({"ready": True}) + "\n")
    inbox = ""
    while True:
        ready = select.select([0, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:  # reap whatever ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            children.discard(pid)
            out.write(json.dumps({"exited": pid, "code": _exit_code(status)}) + "\n")
        if 0 in ready:
            chunk = os.read(0, 65536).decode()
            if not chunk:  # the test worker is done
                return
            inbox += chunk
            while "\n" in inbox:
                line, inbox = inbox.split("\n", 1)
                req = json.loads(line)
                out.flush()
                pid = os.fork()
                if pid == 0:
                    _child(req, (out.fileno(), wake_r, wake_w))
                children.add(pid)
                out.write(json.dumps({"started": pid}) + "\n")


if __name__ == "__main__":
    _serve()
