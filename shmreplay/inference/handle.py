"""What both ends of an inference channel share: ``Handle`` (``with``, and
refusing use after close or in another process), the deadline of a wait,
and how long either end spins before it sleeps.

Base of ``server.py``'s ``InferenceServer`` and ``env.py``'s
``InferenceClient``; no state of its own beyond what they set.  Each
object's thread, as its own methods say.
"""

from __future__ import annotations

import os
import time

from ..errors import InferenceClosed, ReplayError

SPIN_US = 50     # spin this long on the shared words before sleeping on a futex word


def deadline_after(timeout):
    """When a wait of ``timeout`` seconds (None: no limit) ends, on the
    monotonic clock; ValueError for anything else than a number >= 0."""
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be >= 0 seconds or None (no limit), got {timeout!r}")
    return None if timeout is None else time.monotonic() + timeout


class Handle:
    """What both ends share: ``with``, and refusing use after close or in
    another process (a forked child makes its own)."""

    def _usable(self) -> None:
        if self._closed:
            raise InferenceClosed(f"this {type(self).__name__} of {self.address} is closed")
        if os.getpid() != self._pid:
            raise ReplayError(f"this {type(self).__name__} belongs to process {self._pid}, not "
                              f"{os.getpid()}: a forked child attaches its own, "
                              "InferenceClient(address)")

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
