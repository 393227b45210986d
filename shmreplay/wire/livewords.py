"""The live words of a table's meta segment: the counters the daemon
mirrors for clients, read and written by name.

Sixteen uint64 words at ``headers.LIVE_OFF`` (docs/layout.md draws them).
The engine thread is the only writer (``publish``, after every change to a
table); clients read them with no round trip: ``len(table)``, the
rate-limiter probes ``can_insert``/``can_sample`` (``ratelimiter``), and a
writer's epoch check before every copy into leased slots.

Any thread may read; only the engine thread (or one thread before the
table is served) may write.
"""

from __future__ import annotations

import numpy as np

LIVE_WORDS = 16
LIVE_SIZE = 0      # committed items (what len(table) reports)
LIVE_INSERTS = 1   # items committed since creation
LIVE_PENDING = 2   # slots reserved by writers, not committed yet (count as inserts for the limiter)
LIVE_SAMPLES = 3   # items handed out by SAMPLE since creation
LIVE_DELETES = 4   # items that left: evicted, or removed after max_times_sampled
LIVE_FREE = 5      # slots on the free list
LIVE_USES = 6      # samples the committed items can still give (max_times_sampled tables)
LIVE_MASS = 7      # float64: the sampler's total mass; 0 means nothing can be drawn
# How many times a daemon adopted or restored this table.  A writer checks
# it before it copies into slots leased from a daemon: a changed epoch means
# that daemon died and its leases are void (recovery.py).  client/addone.py's
# kernel compiles this index in: numba's cache stamps a kernel by its own
# file's bytes, so addone.py carries a hash of this file (``COMPILED_IN``,
# checked by tests/test_add_one.py) and a change here changes it too
LIVE_EPOCH = 8
LIVE_LEAST = 9     # float64: the smallest mass one sampleable item adds (0: none); a sharded table's global minimum


class LiveWords:
    """The live words by name.  Reads go through a memoryview, so each is a
    plain Python int (cheaper on a writer's hot path than a numpy scalar);
    the engine thread is the only writer."""

    __slots__ = ("_w", "_mass", "_least", "words")

    def __init__(self, words: np.ndarray):
        self.words = words  # uint64[LIVE_WORDS], for kernels (``client.addone``)
        self._w = memoryview(words).cast("B").cast("Q")
        self._mass = words[LIVE_MASS:LIVE_MASS + 1].view(np.float64)
        self._least = words[LIVE_LEAST:LIVE_LEAST + 1].view(np.float64)

    size = property(lambda self: self._w[LIVE_SIZE])
    inserts = property(lambda self: self._w[LIVE_INSERTS])
    pending = property(lambda self: self._w[LIVE_PENDING])
    samples = property(lambda self: self._w[LIVE_SAMPLES])
    deletes = property(lambda self: self._w[LIVE_DELETES])
    free = property(lambda self: self._w[LIVE_FREE])
    uses = property(lambda self: self._w[LIVE_USES])

    @property
    def epoch(self) -> int:
        return self._w[LIVE_EPOCH]

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._w[LIVE_EPOCH] = int(value)

    @property
    def mass(self) -> float:
        return float(self._mass[0])

    @mass.setter
    def mass(self, value: float) -> None:
        self._mass[0] = value

    @property
    def least(self) -> float:
        return float(self._least[0])

    def publish(self, size: int, inserts: int, pending: int, samples: int, deletes: int,
                free: int, uses: int, mass: float, least: float = 0.0) -> None:
        """Engine thread: the counters clients read for len() and the
        rate-limiter probes."""
        w = self._w
        w[LIVE_SIZE], w[LIVE_INSERTS], w[LIVE_PENDING] = size, inserts, pending
        w[LIVE_SAMPLES], w[LIVE_DELETES], w[LIVE_FREE], w[LIVE_USES] = samples, deletes, free, uses
        self._mass[0] = mass
        self._least[0] = least

    def set_counters(self, inserts: int, samples: int, deletes: int) -> None:
        """Checkpoint restore: the limiter counters a table restarts from."""
        w = self._w
        w[LIVE_INSERTS], w[LIVE_SAMPLES], w[LIVE_DELETES] = int(inserts), int(samples), int(deletes)
