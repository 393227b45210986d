"""Real daemons in subprocesses for the tests (``DaemonProcess``, the
``start_daemon`` fixture's), their configs, and the names they make in
/dev/shm.  Every daemon gets its own socket and an instance name beginning
with ``test<pid>``, so every shared-memory object it makes is named
``/dev/shm/[sem.]shmreplay.test<pid>...`` and runs side by side never see
each other's."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import shmreplay
import zygote
from shmreplay.wire.names import lock_path

_counter = itertools.count()
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DAEMON_COMMAND = [sys.executable, "-m", "shmreplay.server.daemon"]
# how the last line of a faulthandler dump of a test daemon ends: its main
# thread's outermost frame, started (``-m``) or forked from the zygote
MAIN_THREAD_OUTERMOST = re.compile(
    r'( in _run_module_as_main|/' + re.escape(os.path.basename(zygote.__file__))
    + r'", line \d+ in <module>)\n\Z')
_zygote: zygote.Zygote | None = None


def the_zygote() -> zygote.Zygote:
    """This process's zygote, started at its first daemon."""
    global _zygote
    if _zygote is None:
        _zygote = zygote.Zygote()
    return _zygote


def close_zygote() -> None:
    global _zygote
    if _zygote is not None:
        _zygote.close()
        _zygote = None

def nested_env(**extra: str) -> dict[str, str]:
    """The environment for a pytest run a test starts: this one's, less what
    pytest and pytest-xdist set for their own processes (a nested run that
    inherits ``PYTEST_XDIST_WORKER`` takes itself for a worker of this run
    and locks files in the base folder every run on the box shares), plus
    ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("PYTEST_XDIST_") or k in ("PYTEST_CURRENT_TEST", "PYTEST_ADDOPTS"))}
    env.update(extra)
    return env


def checkout_env(**extra: str) -> dict[str, str]:
    """The environment for a program a test runs (clients/, a benchmark cell, a doc snippet):
    this one's, with this checkout first on ``PYTHONPATH``, plus ``extra``.
    The programs import the installed package, as a user's do; run from
    the suite they must import the code under test, whatever directory
    they start in and whatever copy is installed."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([CHECKOUT] + ([path] if path else [])), **extra}


def shm_entries(marker: str = "shmreplay.test") -> set[str]:
    return {n for n in os.listdir("/dev/shm") if marker in n}


def segment_of(instance: str, table: str, kind: str = "t") -> str:
    """The /dev/shm name of a table's meta (``kind`` "t") or rows ("r")
    segment: the daemon chose its token (wire/names.py); exactly one must exist."""
    pre = f"shmreplay.{instance}.{kind}.{table}."
    found = [n for n in os.listdir("/dev/shm")
             if n.startswith(pre) and re.fullmatch(r"[0-9a-f]{16}", n[len(pre):])]
    assert len(found) == 1, f"{len(found)} segments of table {table!r} ({kind}): {found}"
    return "/" + found[0]


def table_objects(instance: str) -> set[str]:
    """An instance's objects in /dev/shm as "<kind>.<table>", tokens left out."""
    pre = f"shmreplay.{instance}."
    return {re.sub(r"\.[0-9a-f]{16}$", "", n[len(pre):]) for n in shm_entries(pre)}


def remove_entries(instance: str) -> None:
    """Clean up after a daemon the test SIGKILLed on purpose."""
    for n in shm_entries(f"shmreplay.{instance}."):
        os.unlink(os.path.join("/dev/shm", n))
    try:
        os.unlink(lock_path(instance))
    except FileNotFoundError:
        pass


def toml_value(v) -> str:
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return repr(v)


def write_config(path, tables=(), **daemon) -> str:
    lines = ["[daemon]"] + [f"{k} = {toml_value(v)}" for k, v in daemon.items()]
    for t in tables:
        lines.append("[[tables]]")
        for k, v in t.items():
            if k not in ("fields", "frames"):
                lines.append(f"{k} = {toml_value(v)}")
        lines.append("[tables.fields]")
        for fname, (dtype, shape) in t["fields"].items():
            lines.append(f"{fname} = {{ dtype = {toml_value(dtype)}, shape = {toml_value(list(shape))} }}")
        if t.get("frames"):  # a frame table's [tables.frames]
            lines.append("[tables.frames]")
            lines += [f"{fname} = {toml_value(how)}" for fname, how in t["frames"].items()]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


class DaemonProcess:
    def __init__(self, tmp_path, tables=(), args=(), socket_dir=None, command=None, env=None,
                 **daemon_opts):
        n = next(_counter)
        # the program to run (a fault test may inject faults into a real daemon)
        self.command = command or DAEMON_COMMAND
        self.env = env
        self.instance = f"test{os.getpid()}x{n}"
        self.socket = str((socket_dir or tmp_path) / f"d{n}.sock")
        self.config = write_config(tmp_path / f"d{n}.toml", tables, instance=self.instance,
                                   socket=self.socket, **daemon_opts)
        self.log_path = tmp_path / f"d{n}.log"
        self._log = open(self.log_path, "wb")
        self.start(args)

    def start(self, args=()) -> None:
        """(Re)start the daemon process with this config; wait until it serves.
        The default command's daemon, with the test's environment, is forked
        from this worker's zygote (zygote.py: the same daemon, without the
        interpreter's start)."""
        if self._log.closed:
            self._log = open(self.log_path, "ab")
        env = None if self.env is None else {**os.environ, **self.env}
        # environment the interpreter reads at its start (numba's cache) is a
        # fresh start's to honour: a daemon given its own environment starts afresh
        if self.command == DAEMON_COMMAND and self.env is None and zygote.enabled():
            self._log.flush()
            self.proc = the_zygote().spawn(["--config", self.config, *args], str(self.log_path), env)
        else:
            self.proc = subprocess.Popen([*self.command, "--config", self.config, *args],
                                         stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.wait_ready()

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                shmreplay.connect(self.socket, timeout=30).close()  # a hang guard
                return
            except shmreplay.DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise
                # a failed connect costs microseconds: a short poll lets the
                # test go on as soon as the daemon serves (every test waits here)
                time.sleep(0.01)

    def start_set_aside(self, table: str, args=()) -> dict:
        """Start the daemon again: it serves, and sets ``table`` aside (its
        data kept, nothing made over it: issue 21, item 1); stop it cleanly,
        which leaves the table as it is.  Returns what status says of it."""
        self.start(args)
        with self.connect() as c:
            set_aside = c.stats()["set_aside"]
            assert list(set_aside) == [table] and table not in c.list_tables(), set_aside
            with pytest.raises(shmreplay.TableExists, match=f"table {table!r} is set aside"):
                c.create_table(table, capacity=8, fields={"x": ("float32", ())})
        assert self.stop() == 0
        return set_aside[table]

    def segment(self, table: str, kind: str = "t") -> str:
        """``segment_of`` this daemon's instance."""
        return segment_of(self.instance, table, kind)

    def connect(self, timeout: float = 20.0) -> shmreplay.Client:
        return shmreplay.connect(self.socket, timeout=timeout)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; a daemon that does not stop in ``timeout`` is
        SIGKILLed (and its objects removed) so no test leaves one running,
        and the hang is reported as the exit code -SIGKILL, with where each
        of its threads waited in ``hang_dump`` (read before the kill)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.hang_dump = self.dump_threads()
            self.kill()
            code = -signal.SIGKILL
        self._log.close()
        return code

    hang_dump = ""

    def dump_threads(self) -> str:
        """Where every thread of the running daemon is: its Python stacks
        (SIGUSR1: the daemon's faulthandler writes them to its log) and each
        thread's state, kernel wait channel and kernel stack from /proc (the
        kernel stack needs root)."""
        from waiting import thread_states
        logged = self.log()
        before = len(logged)
        out = [f"daemon {self.pid} did not stop; the end of its log:\n{logged[-3000:]}\nits threads:"]
        for tid, (state, wchan) in sorted(thread_states(self.pid).items()):
            try:
                with open(f"/proc/{self.pid}/task/{tid}/stack") as f:
                    stack = f.read().strip()
            except OSError as exc:
                stack = f"(no kernel stack: {exc.strerror})"
            out.append(f"thread {tid}: state {state}, waiting in {wchan or '-'}\n{stack}")
        try:
            os.kill(self.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return "\n".join(out)
        # faulthandler writes line by line from whichever thread took the
        # signal, and on a loaded machine that thread can be preempted
        # between two lines for longer than any quiet window: so the dump is
        # read once it is whole. It lists the main thread last, so the dump
        # ends with the main thread's outermost frame: runpy's for a daemon
        # started with ``python -m``, the zygote's ``<module>`` for a forked
        # one. A dump that never ends so (a daemon started another way) is
        # read after it stopped growing for a second; a hang guard bounds
        # the wait.
        deadline = time.monotonic() + 10.0
        size, quiet_since = -1, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            dump = self.log()[before:]
            if MAIN_THREAD_OUTERMOST.search(dump):
                break
            if len(dump) != size:
                size, quiet_since = len(dump), time.monotonic()
            elif "Thread 0x" in dump and time.monotonic() - quiet_since > 1.0:
                break
        out.append("Python stacks (SIGUSR1):\n" + self.log()[before:])
        return "\n".join(out)

    def crash(self) -> None:
        """SIGKILL: everything it made stays behind, as after a real crash."""
        self.proc.kill()
        self.proc.wait(10)

    def kill(self) -> None:
        self.crash()
        remove_entries(self.instance)
        try:
            os.unlink(self.socket)
        except FileNotFoundError:
            pass
