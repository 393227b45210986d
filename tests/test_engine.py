"""The engine thread's failure path and its thread rules, in-process."""

import os
import threading
import time

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


# ---- how far the engine stays up for a learner (idle.py) ----
def _idler(learner_spin_us=2000.0, learner_spin_max_us=10000.0):
    from shmreplay.server.engine.idle import Idler
    return Idler(os.eventfd(0), spin_us=250.0, idle_timeout=1.0,
                 learner_spin_us=learner_spin_us, learner_spin_max_us=learner_spin_max_us)


def _near(got, want) -> bool:
    """(until, watched) equal, the time to float rounding."""
    return got[1] == want[1] and got[0] == pytest.approx(want[0], abs=1e-9)


def test_a_slower_learner_keeps_the_engine_up_only_while_its_spin_costs_nobody_a_core():
    """Issue 36, item 1: the spin follows the learner's rhythm.  A learner
    sampling more often than ``learner_spin_us`` keeps the engine up as
    before; one sampling less often but more often than
    ``learner_spin_max_us`` does too, in a watched spin; once a watched spin
    was contended (``contended``), none starts for ``BACKOFF_S``, while the
    fast learner's spin is untouched; slower learners get none.  The clock
    is given, never read: nothing here depends on timing."""
    from shmreplay.server.engine.idle import BACKOFF_S
    idler = _idler()
    try:
        t = 100.0
        idler.sampled(t)
        idler.sampled(t + 0.001)                        # every 1 ms: under learner_spin_us
        assert _near(idler.learner_until(t + 0.0012), (t + 0.003, False))
        idler.sampled(t + 0.005)                        # every 4 ms: under learner_spin_max_us
        assert _near(idler.learner_until(t + 0.0052), (t + 0.013, True))
        idler.contended(t + 0.006)                      # that spin took someone's core
        idler.sampled(t + 0.009)                        # the same learner, within the back-off
        assert _near(idler.learner_until(t + 0.0092), (0.0, False))
        idler.sampled(t + 0.010)                        # a fast learner is not backed off
        assert _near(idler.learner_until(t + 0.0102), (t + 0.012, False))
        later = t + 0.006 + BACKOFF_S
        idler.sampled(later)
        idler.sampled(later + 0.004)                    # after the back-off: watched again
        assert _near(idler.learner_until(later + 0.0042), (later + 0.012, True))
        idler.sampled(later + 0.019)                    # every 15 ms: past learner_spin_max_us
        assert _near(idler.learner_until(later + 0.0192), (0.0, False))
        assert idler.stats["contended_spins"] == 1
    finally:
        idler.close()


def test_no_learner_spin_follows_a_wide_sample_until_a_plain_one():
    """A SAMPLE whose client copies the batch on every CPU (``records.WIDE``:
    a large batch on a 2-CPU box) is followed by no learner spin, fast or
    watched, however often its learner samples: the spin would take a core
    from that copy.  The next plain SAMPLE brings the spin back.  The
    clock is given, never read."""
    idler = _idler()
    try:
        idler.sampled(70.0)
        idler.sampled(70.001, wide=True)                # every 1 ms, wide
        assert _near(idler.learner_until(70.0012), (0.0, False))
        idler.sampled(70.005, wide=True)                # every 4 ms (a watched one), wide
        assert _near(idler.learner_until(70.0052), (0.0, False))
        idler.sampled(70.006)                           # plain, 1 ms later
        assert _near(idler.learner_until(70.0062), (70.008, False))
        assert idler.stats["wide_samples"] == 2
    finally:
        idler.close()


@pytest.mark.parametrize("spin, spin_max", [(0.0, 10000.0), (2000.0, 0.0)])
def test_learner_spins_turned_off_stay_off(spin, spin_max):
    """``learner_spin_us = 0`` turns both spins off (tests that need a
    sleeping daemon set only it); ``learner_spin_max_us = 0`` only the
    watched one."""
    idler = _idler(spin, spin_max)
    try:
        idler.sampled(50.0)
        idler.sampled(50.004)                           # every 4 ms
        assert _near(idler.learner_until(50.0042), (0.0, False))
        idler.sampled(50.005)                           # every 1 ms
        assert _near(idler.learner_until(50.0052), ((50.007, False) if spin else (0.0, False)))
    finally:
        idler.close()


def test_commits_left_waiting_neither_keep_the_engine_up_nor_keep_it_awake():
    """Lazy COMMITs (idle.py): a spin that finds only COMMITs, fewer than
    ``LAZY_MAX``, in a real command ring ends empty-handed, and the engine
    then sleeps (its timeout ends the sleep here) instead of serving them;
    with requests parked, or once a SAMPLE came, the same ring is work."""
    from shmreplay.server.engine.calls import Calls
    from shmreplay.server.engine.idle import Idler
    from shmreplay.wire.channel import Channel, ChannelLayout
    from shmreplay.wire.records import COMMIT, SAMPLE
    ch = Channel.create(ChannelLayout(64, 16, 4096, 4096), os.getpid(), os.getpid())
    bell = os.eventfd(0)
    idler = Idler(bell, spin_us=100.0, idle_timeout=0.01)
    try:
        ring, calls = ch.requests, Calls()
        for seq in (1, 2, 3):
            ring.put(COMMIT, 0, seq, 7, 1, seq, 0.0, 0, 0, 0)
        ring.publish()
        assert not idler.spin([ring], calls, worked=True)
        idler.sleep([ring], calls, None)
        assert idler.stats["sleeps"] == 1  # slept, with the three still there
        assert ring.pending() == 3
        assert idler.spin([ring], calls, worked=True, waiting=True)
        ring.put(SAMPLE, 0, 4, 1, 0, 0, 0.0, 0, 0, 0)
        ring.publish()
        assert idler.wanted([ring], calls, False) and idler.spin([ring], calls, worked=True)
        idler.sleep([ring], calls, None)
        assert idler.stats["sleeps"] == 1  # work came: it did not sleep
    finally:
        idler.close()
        os.close(bell)
        ch.release()


def test_the_run_queue_a_watched_spin_reads(tmp_path):
    """``runnable_threads`` counts the machine's runnable threads, the
    caller's among them (so at least 1), from /proc/loadavg; a file that
    does not read as one gives 0, which never ends a spin by itself."""
    from shmreplay.server.engine.idle import runnable_threads
    fd = os.open("/proc/loadavg", os.O_RDONLY)
    try:
        assert runnable_threads(fd) >= 1
    finally:
        os.close(fd)
    for text in (b"0.00 0.01 0.05 7/312 4242\n", b"garbage\n", b""):
        path = tmp_path / "loadavg"
        path.write_bytes(text)
        fd = os.open(path, os.O_RDONLY)
        try:
            assert runnable_threads(fd) == (7 if text.startswith(b"0.00") else 0)
        finally:
            os.close(fd)


def test_no_learner_spin_takes_a_core_a_runnable_thread_waits_for():
    """Issue 36, item 1: with more threads runnable than CPUs, the engine
    does not stay up for a learner, however often it samples: the spin is
    cut back to the plain budget (which follows the gaps between commands),
    and a watched learner spin backs off as a contended one does.
    Measured: a CleanRL loop sampling every ~1 ms (under
    ``learner_spin_us``) kept the daemon spinning on the core its torch
    update wanted (docs/performance.md, "A spin that takes nobody's
    core").  The machine is crowded for real: one busy process per CPU and
    one more, seen runnable before each spin (they never block, so they
    stay so)."""
    import subprocess
    import sys

    from shmreplay.server.engine.calls import Calls
    from shmreplay.server.engine.idle import runnable_threads
    from shmreplay.wire.channel import Channel, ChannelLayout
    cpus = os.cpu_count() or 1
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cpus + 1)]
    ch = Channel.create(ChannelLayout(64, 16, 4096, 4096), os.getpid(), os.getpid())
    idler = _idler()
    fd = os.open("/proc/loadavg", os.O_RDONLY)
    try:
        deadline = time.monotonic() + 30
        while runnable_threads(fd) <= cpus:  # the busy ones are up (bounded)
            assert time.monotonic() < deadline, "busy processes never showed as runnable"
            time.sleep(0.01)
        rings, calls = [ch.requests], Calls()
        # the spins start at pinned times: a preemption of this thread (the
        # machine is crowded on purpose) cannot turn them into other spins
        now = time.perf_counter()
        idler.sampled(now - 0.001)
        idler.sampled(now)                                       # a learner every 1 ms
        assert not idler.spin(rings, calls, start=now)
        assert idler.stats["learner_spins"] == 1
        assert idler.stats["crowded_spins"] == 1 and idler.stats["contended_spins"] == 0
        idler.sampled(now + 0.004)                               # every 4 ms: a watched spin
        assert not idler.spin(rings, calls, start=now + 0.004)
        assert idler.stats["watched_learner_spins"] == 1
        assert idler.stats["crowded_spins"] == 2 and idler.stats["contended_spins"] == 1
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.wait()
        os.close(fd)
        idler.close()
        ch.release()
