"""The engine thread's failure path and its thread rules, in-process."""

import os
import threading

import pytest

import shmreplay

from shmreplay.server.engine.engine import Engine
from waiting import HANG_S


def break_sleep(eng: Engine, broken: threading.Event) -> None:
    """The fault injected: once ``broken`` is set, the engine's sleep raises
    (outside every per-client guard, as a bug in the engine would)."""
    sleep = eng.idler.sleep

    def sleep_or_fail(*args, **kwargs):
        if broken.is_set():
            raise OSError("doorbell lost")
        sleep(*args, **kwargs)

    eng.idler.sleep = sleep_or_fail


def test_a_crashed_engine_reports_it_and_later_calls_fail_fast_touching_nothing():
    broken, crashed = threading.Event(), threading.Event()
    eng = Engine(spin_us=0, idle_timeout=0.05, on_crash=crashed.set)
    break_sleep(eng, broken)
    eng.start()
    assert eng.submit(lambda: 41 + 1).result(HANG_S) == 42   # served by the engine thread
    assert eng.submit(threading.get_ident).result(HANG_S) == eng.thread.ident
    broken.set()
    assert crashed.wait(HANG_S), "the crash must be reported (the daemon then exits non-zero)"
    eng.thread.join(HANG_S)
    assert not eng.thread.is_alive()
    # shutdown must not hang on calls, nor let them touch half-applied
    # state (the tables stay as they are for the next daemon): the call is
    # answered before submit returns, whatever the box's load
    touched = []
    fut = eng.submit(touched.append, 1)
    assert fut.done(), "a call to a failed engine must fail at once, not wait"
    with pytest.raises(shmreplay.DaemonUnavailable, match="engine failed"):
        fut.result(0)
    assert touched == []
    eng.stop()  # the daemon's shutdown still stops it: that closes its descriptors


def test_entry_points_run_only_on_the_engine_thread():
    """The control plane reaches engine state only through submit(); calling
    an entry point from another thread while the engine runs is a bug that
    debug mode (plain python, asserts on) catches at once."""
    fds = set(os.listdir("/proc/self/fd"))
    eng = Engine(spin_us=0, idle_timeout=0.05)
    try:
        eng.start()
        assert eng.submit(eng.table_names).result(HANG_S) == []
        # the engine's own (its epoll), not whatever else this worker
        # process opens or a collected object closes meanwhile
        made = {fd: _target(fd) for fd in set(os.listdir("/proc/self/fd")) - fds}
        made = {fd: t for fd, t in made.items() if t is not None and t.startswith("anon_inode:")}
        assert "anon_inode:[eventpoll]" in made.values(), made
        with pytest.raises(AssertionError, match="off the engine thread"):
            eng.table_names()
    finally:
        eng.stop()
    assert eng.table_names() == []  # stopped: the caller is the only one left
    assert not [fd for fd, t in made.items() if _target(fd) == t], "stop() closes the engine's epoll"


def _target(fd: str) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # closed meanwhile
        return None
