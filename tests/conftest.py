"""Fixtures: real daemons in subprocesses, and the leak checks; and
in-process tables over a real segment (``make_table``).

Every daemon a test starts gets its own socket and an instance name
beginning with ``test``, so every shared-memory object it makes is named
``/dev/shm/[sem.]shmreplay.test...``.  Each daemon fixture checks at
teardown that the daemon exited 0 and left none of its objects behind; the
session fixture checks the same for the whole suite.
"""

from __future__ import annotations

import compileall
import itertools
import json
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from hypothesis import settings as hypothesis_settings

import shmreplay
from shmreplay.wire.names import lock_path, runtime_dir
from waiting import processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest_plugins = ["strict_ci"]  # CI=true: a skip fails (strict_ci.py)

# Property tests (test_sumtree.py): the suite, CI's run included, draws the
# same examples every time ("derandomized": a seed fixed per test), so a
# submission's run fails only for a change in the code, never for an example
# nobody drew before.  New examples are drawn by benchmarks/fuzz_properties.py
# (the "random" profile, many rounds), which is where a kernel-twin mismatch
# should turn up first.  A failure prints the falsifying example and a
# ``@reproduce_failure`` blob that replays it; no example database is kept.
hypothesis_settings.register_profile("derandomized", derandomize=True, database=None,
                                     print_blob=True, deadline=None)
hypothesis_settings.register_profile("random", derandomize=False, database=None,
                                     print_blob=True, deadline=None)
hypothesis_settings.load_profile("derandomized")  # pytest --hypothesis-profile=random overrides
_counter = itertools.count()


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


def own_entries() -> set[str]:
    """What this run made, in /dev/shm and the runtime directory (instance
    locks): every name a test uses carries ``test<pid>`` followed by a
    non-digit, so runs side by side never see each other's."""
    mine = re.compile(rf"shmreplay\.test{os.getpid()}(?!\d)")
    rundir = os.listdir(runtime_dir()) if os.path.isdir(runtime_dir()) else []
    return {n for n in os.listdir("/dev/shm") + rundir if mine.search(n)}


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    """The suite runs on two pytest-xdist workers (pyproject's addopts:
    ``-n 2 --dist loadgroup``); tests that must not overlap share a group,
    which one worker runs in turn."""


ALONE_WAIT_S = 1200.0  # a hang guard for the lock below: longer than any test


@pytest.fixture(autouse=True)
def alone_or_shared(request, tmp_path_factory):
    """A test marked ``alone`` runs while no other worker runs a test (an
    exclusive flock on a file the workers share; every other test holds it
    shared): the 2 GiB cgroup test, whose daemon failed to stop in time
    beside other workers' tests.  Waited for in polls, with a deadline.
    Only under pytest-xdist: a serial run has nobody to wait for (and its
    base folder's parent is shared with other runs on the box)."""
    import fcntl
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    path = tmp_path_factory.getbasetemp().parent / "alone.lock"  # this run's, which its workers share
    mode = fcntl.LOCK_EX if request.node.get_closest_marker("alone") else fcntl.LOCK_SH
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + ALONE_WAIT_S
    try:
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"waited {ALONE_WAIT_S:.0f} s for the other workers' tests")
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


@pytest.fixture(scope="session", autouse=True)
def package_bytecode():
    """Every daemon and client process the suite starts (a few hundred)
    imports the package afresh.  Where PYTHONDONTWRITEBYTECODE is set, none
    of them may cache bytecode, and each compiles its ~10,000 lines again
    (~75 ms).  Compiled once here instead (into __pycache__, beside numba's
    cache); Python still checks each source's mtime against its .pyc."""
    if sys.dont_write_bytecode:
        compileall.compile_dir(os.path.join(ROOT, "shmreplay"), quiet=2)
    yield


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory():
    yield
    leaked = own_entries()
    assert not leaked, f"the suite left shared memory behind: {sorted(leaked)}"


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
            if k != "fields":
                lines.append(f"{k} = {toml_value(v)}")
        lines.append("[tables.fields]")
        for fname, (dtype, shape) in t["fields"].items():
            lines.append(f"{fname} = {{ dtype = {toml_value(dtype)}, shape = {toml_value(list(shape))} }}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return str(path)


class DaemonProcess:
    def __init__(self, tmp_path, tables=(), args=(), socket_dir=None, command=None, env=None,
                 **daemon_opts):
        n = next(_counter)
        # the program to run (a fault test may inject faults into a real daemon)
        self.command = command or [sys.executable, "-m", "shmreplay.server.daemon"]
        self.env = env
        self.instance = f"test{os.getpid()}x{n}"
        self.socket = str((socket_dir or tmp_path) / f"d{n}.sock")
        self.config = write_config(tmp_path / f"d{n}.toml", tables, instance=self.instance,
                                   socket=self.socket, **daemon_opts)
        self.log_path = tmp_path / f"d{n}.log"
        self._log = open(self.log_path, "wb")
        self.start(args)

    def start(self, args=()) -> None:
        """(Re)start the daemon process with this config; wait until it serves."""
        if self._log.closed:
            self._log = open(self.log_path, "ab")
        env = None if self.env is None else {**os.environ, **self.env}
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
            aside = c.stats()["set_aside"]
            assert list(aside) == [table] and table not in c.list_tables(), aside
            with pytest.raises(shmreplay.TableExists, match=f"table {table!r} is set aside"):
                c.create_table(table, capacity=8, fields={"x": ("float32", ())})
        assert self.stop() == 0
        return aside[table]

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
        deadline = time.monotonic() + 10.0  # a hang guard: faulthandler writes at once
        while "Thread 0x" not in self.log()[before:] and time.monotonic() < deadline:
            time.sleep(0.05)
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


@pytest.fixture
def start_daemon(tmp_path):
    started: list[DaemonProcess] = []

    def start(tables=(), **opts) -> DaemonProcess:
        d = DaemonProcess(tmp_path, tables, **opts)
        started.append(d)
        return d

    yield start
    # stop every daemon even when one of them failed, then report the first
    # failure: an assert on the first must not leave the rest running
    problems = []
    for d in started:
        killed = d.proc.poll() is not None and d.proc.returncode < 0
        code = d.stop()
        left = shm_entries(f"shmreplay.{d.instance}.")
        if killed or code < 0:
            remove_entries(d.instance)
            if not killed:
                problems.append(f"daemon {d.instance} did not stop on SIGTERM:\n{d.log()}\n{d.hang_dump}")
            continue
        if code != 0:
            problems.append(f"daemon exited with {code}:\n{d.log()}")
        if left:
            problems.append(f"daemon left {sorted(left)} in /dev/shm")
            remove_entries(d.instance)
    assert not problems, "\n".join(problems)


def _children() -> set[int]:
    """Live child processes of this one (multiprocessing's or not), and the
    workers its fork server started (waiting.worker_context: they are the
    server's children, and share its command line)."""
    me = str(os.getpid())
    live = [(pid, f[1]) for pid, f in processes() if f[0] != "Z"]
    helpers = {str(pid) for pid, parent in live if parent == me and _helper(pid)}
    return {pid for pid, parent in live if parent in helpers or (parent == me and str(pid) not in helpers)}


def _helper(pid: int) -> bool:
    """multiprocessing's own long-lived helpers (resource tracker,
    forkserver), started by the first test that needs them: not leftovers."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return b"multiprocessing.resource_tracker" in cmd or b"multiprocessing.forkserver" in cmd


@pytest.fixture(autouse=True)
def no_leftover_children():
    """A test whose assert fired before it stopped its workers must not
    leave them running into the next test (or the end of the run, where
    multiprocessing would join them for ever): kill what it left."""
    before = _children()
    yield
    left = _children() - before
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    multiprocessing.active_children()  # let multiprocessing reap its own


@pytest.fixture
def daemon(start_daemon, tmp_path):
    # SHMREPLAY_TEST_ROWS=file: every table these tests create keeps its rows
    # in a file (test_file_tables.py runs whole modules that way); no periodic
    # sync, so a full table evicts exactly as a /dev/shm one (a sync that
    # lists its items makes it evict ahead: server/tables/barrier.py)
    rows = ({"storage_dir": str(tmp_path / "tables"), "sync_interval_s": 0}
            if os.environ.get("SHMREPLAY_TEST_ROWS") == "file" else {})
    return start_daemon(seed=1234, **rows)


SMALL_FIELDS = {"obs": ("uint8", (4, 8, 8)), "action": ("int64", ()), "reward": ("float32", ())}


@pytest.fixture
def client(daemon):
    with daemon.connect() as c:
        yield c
        if os.environ.get("SHMREPLAY_TEST_ROWS") == "file" and not c._session.closed:
            tables = c.stats()["tables"]
            assert all(t["file_backed"] for t in tables.values()), "a table in /dev/shm in file mode"


@pytest.fixture
def make_table():
    """An in-process daemon-side ``Table`` over a real segment (unlinked at
    teardown): ``make_table(capacity=8, **limits)``, one field ``x``."""
    from shmreplay.schema import make_spec
    from shmreplay.server.tables.table import Table
    from shmreplay.wire.layout import TableMap
    made = []

    def make(capacity=8, **limits):
        spec = make_spec("unit", capacity, {"x": ("int64", ())}, **limits)
        tm = TableMap.create(f"/shmreplay.test{os.getpid()}.lim{len(made)}", spec)
        t = Table(1, spec, tm, seed=0)
        made.append(tm)
        return t

    yield make
    for tm in made:
        tm.unlink()
        tm.release()
