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
import multiprocessing
import os
import re
import signal
import sys

import pytest
from hypothesis import settings as hypothesis_settings

from benchmarks.harness.raycluster import token_auth
from shmreplay.wire.names import runtime_dir
from waiting import processes
# the daemon helpers, here too for tests that import them from conftest
from daemons import (DaemonProcess, close_zygote, nested_env, remove_entries, segment_of,  # noqa: F401
                     shm_entries, table_objects, toml_value, write_config)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytest_plugins = ["strict_ci"]  # CI=true: a skip fails (strict_ci.py)

# Every Ray cluster the suite starts (raycluster.py, the docs' snippets)
# demands this process's token: Ray listens on every interface whatever
# --node-ip-address says.  Set before any test module imports ray.
token_auth()

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
    close_zygote()  # its daemons are all stopped by now (a leftover one is killed with it)
    leaked = own_entries()
    assert not leaked, f"the suite left shared memory behind: {sorted(leaked)}"


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
    """Long-lived helpers started by the first test that needs them, not
    leftovers: multiprocessing's (resource tracker, forkserver) and the
    test daemons' zygote (zygote.py), whose children are the tests'."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
    except OSError:
        return False
    return (b"multiprocessing.resource_tracker" in cmd or b"multiprocessing.forkserver" in cmd
            or b"zygote.py" in cmd)  # the test daemons' parent (zygote.py)


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
    # lists its items makes it evict ahead: server/tables/slots/barrier.py)
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
