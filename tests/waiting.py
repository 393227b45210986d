"""Waiting in tests for a state, never for the clock.

CI runs on a loaded 2-core machine: no assertion may depend on how fast
anything runs.  A test arranges the state it checks, or waits for the daemon
(or the segment) to report it; the deadline only catches a hang.

Also the worker processes a test starts: their context, waiting for them
to exit 0 (stopping at once when one failed), and ending what is left.
"""

from __future__ import annotations

import os
import signal
import time

HANG_S = 60.0  # how long a wait may take before it counts as a hang


def wait_for(pred, what: str, timeout: float = HANG_S, poll: float = 0.02):
    """Poll ``pred()`` until it is true and return its value; fail only
    when it stays false for ``timeout`` seconds (a hang, not slowness)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(poll)


def reap(procs, grace: float = 5.0) -> None:
    """End worker processes in a ``finally``: join those that are ending,
    kill the rest, so a failed assert never leaves one running."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.join(grace)
        if p.pid is not None and p.is_alive():
            p.kill()
            p.join(10)


def proc_stat(path: str) -> list[str] | None:
    """The fields after the command name in a /proc/<pid>[/task/<tid>]/stat
    file: state, ppid, pgrp, session, ... (None: the process is gone)."""
    try:
        with open(path) as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def processes():
    """(pid, stat fields) of every process now."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and (fields := proc_stat(f"/proc/{pid}/stat")) is not None:
            yield int(pid), fields


def worker_context():
    """The multiprocessing context for client worker processes.

    Like "spawn", each worker starts clean: it inherits nothing of the
    test's process (its connections, mappings, threads), and its target and
    arguments are pickled.  But each is a fork of multiprocessing's fork
    server, which has imported shmreplay (numpy, numba) and pytest, what
    every worker imports first anyway: it starts ~0.8 s sooner than a fresh
    interpreter, and the suite starts a few dozen of them.  The server
    imports from the working directory, so it preloads only when that is
    where this run's shmreplay comes from (else each worker imports its own).
    """
    import multiprocessing as mp

    import shmreplay
    ctx = mp.get_context("forkserver")
    here = os.path.dirname(os.path.dirname(os.path.abspath(shmreplay.__file__)))
    ctx.set_forkserver_preload(["shmreplay", "pytest"] if os.path.samefile(here, os.getcwd()) else [])
    return ctx


def start_all(procs):
    for p in procs:
        p.start()


def no_worker_failed(procs):
    """True while none of procs has exited with an error (fails the test if one has)."""
    failed = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
    assert not failed, f"worker(s) failed: {failed}"
    return True


def wait_for_exit(procs, watch, what, probe=lambda: True):
    """Wait until every process in ``procs`` has exited 0; stop at once if any
    process in ``watch`` fails (the others may then wait for ever)."""
    wait_for(lambda: (no_worker_failed(watch) and probe()
                              and all(p.exitcode is not None for p in procs)), what, timeout=10 * HANG_S)
    no_worker_failed(procs)


def end_all(procs):
    """Kill whichever worker is still running (a failed assert must not hang the run)."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(10)


def thread_states(pid: int) -> dict[str, tuple[str, str]]:
    """Each thread of process ``pid``: its state letter (``/proc/.../stat``)
    and where in the kernel it waits (``wchan``)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                out[tid] = (state, f.read().strip())
        except OSError:  # a thread that just ended
            pass
    return out


def stop_asleep(pid: int, sleeping, tries: int = 20) -> None:
    """SIGSTOP the daemon ``pid`` while it sleeps: ``sleeping()`` (its
    sleeping word in a ring) is still set once every thread is stopped.
    Its monitor's once-a-second look may wake it between the look and the
    stop: then it runs on and is stopped again once it sleeps."""
    for _ in range(tries):
        wait_for(sleeping, "the daemon to sleep")
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: all_threads_stopped(pid), "the daemon to stop")
        if sleeping():
            return
        os.kill(pid, signal.SIGCONT)
    raise AssertionError(f"the daemon was never stopped asleep in {tries} tries")


def all_threads_stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped: ``kill(SIGSTOP)``
    returns before the stop takes hold."""
    states = [st for st, _ in thread_states(pid).values()]
    return bool(states) and all(st in ("T", "t") for st in states)
