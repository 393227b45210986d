"""The engine thread's failure path, in-process with a real semaphore."""

import os
import threading

import posix_ipc
import pytest

import shmreplay

from shmreplay.server.engine import Engine


class BreakableBell:
    """A real doorbell semaphore whose waits start failing on demand (the
    fault injected: the engine's sleep raising)."""

    def __init__(self):
        self.sem = posix_ipc.Semaphore(f"/shmreplay.test{os.getpid()}.bell", posix_ipc.O_CREX, 0o600, 0)
        self.sem.unlink()
        self.broken = False

    def release(self):
        self.sem.release()

    def acquire(self, timeout):
        if self.broken:
            raise OSError("doorbell lost")
        self.sem.acquire(timeout)


def test_a_crashed_engine_reports_it_and_later_calls_fail_fast_touching_nothing():
    bell = BreakableBell()
    crashed = threading.Event()
    eng = Engine(bell, spin_us=0, idle_timeout=0.05, on_crash=crashed.set)
    eng.start()
    assert eng.submit(lambda: 41 + 1).result(5) == 42   # served by the engine thread
    assert eng.submit(threading.get_ident).result(5) == eng.thread.ident
    bell.broken = True
    assert crashed.wait(5), "the crash must be reported (the daemon then exits non-zero)"
    eng.thread.join(5)
    assert not eng.thread.is_alive()
    # shutdown must not hang on calls, nor let them touch half-applied
    # state (the tables stay as they are for the next daemon)
    touched = []
    with pytest.raises(shmreplay.DaemonUnavailable, match="engine failed"):
        eng.submit(touched.append, 1).result(1)
    assert touched == []
    bell.sem.close()


def test_entry_points_run_only_on_the_engine_thread():
    """The control plane reaches engine state only through submit(); calling
    an entry point from another thread while the engine runs is a bug that
    debug mode (plain python, asserts on) catches at once."""
    bell = BreakableBell()
    eng = Engine(bell, spin_us=0, idle_timeout=0.05)
    try:
        eng.start()
        assert eng.submit(eng.table_names).result(5) == []
        with pytest.raises(AssertionError, match="off the engine thread"):
            eng.table_names()
    finally:
        eng.stop()
        bell.sem.close()
    assert eng.table_names() == []  # stopped: the caller is the only one left
