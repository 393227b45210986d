"""Calls the control plane hands the engine: ``(fn, args, future)``, run by
the engine thread between bursts (``Engine.submit`` queues them).

Any thread may ``put``; only the thread that owns the engine's state (the
engine thread, or the caller once no engine thread runs) may ``run``.
After the engine failed, calls are answered with DaemonUnavailable instead
of being run: its state may be half-applied, and touching it could only
make things worse for the next daemon, which adopts the tables as they are.
"""

from __future__ import annotations

import concurrent.futures
import queue

from ...errors import DaemonUnavailable


class Calls:
    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.failed = False

    def put(self, fn, args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._q.put((fn, args, fut))
        return fut

    def empty(self) -> bool:
        return self._q.empty()

    def run(self) -> bool:
        """Run every queued call; True if there was any.  A call's
        exception goes to its future, never up the engine's loop."""
        ran = False
        while True:
            try:
                fn, args, fut = self._q.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            if self.failed:
                fut.set_exception(DaemonUnavailable("the daemon's engine failed"))
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller, not swallowed
                fut.set_exception(exc)
