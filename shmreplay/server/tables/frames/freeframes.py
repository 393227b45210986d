"""The arrays the frame books' kernels work on (``refcount.py`` says what
each holds): every ring's counts and free queue, sized from a table's
declaration.  ``FrameQueues`` owns them and answers what they say; the
kernels change them.  Engine thread only.
"""

from __future__ import annotations

import numpy as np


class FrameQueues:
    """Counts and free queues of a table's frame rings (``sizes[r]`` frames
    in ring ``r``), every frame free at first."""

    def __init__(self, sizes: list[int]):
        self.ring_size = np.asarray(sizes, dtype=np.int64)
        self.ring_off = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            self.ring_off[1:] = np.cumsum(self.ring_size)[:-1]
        total = int(self.ring_size.sum())
        self.count = np.zeros(total, dtype=np.int64)
        self.qbuf = np.empty(total, dtype=np.int64)
        for r, n in enumerate(sizes):
            self.qbuf[self.ring_off[r]:self.ring_off[r] + n] = np.arange(n)
        self.qhead = np.zeros(len(sizes), dtype=np.int64)
        self.qlen = self.ring_size.copy()

    @property
    def kernel_args(self) -> tuple:
        """(ring_off, ring_size, count, qbuf, qhead, qlen), the order the
        kernels take them in after their own arguments."""
        return self.ring_off, self.ring_size, self.count, self.qbuf, self.qhead, self.qlen

    def free(self, r: int) -> int:
        """Frames of ring ``r`` nobody holds."""
        return int(self.qlen[r])

    def held(self, r: int) -> int:
        """Frames of ring ``r`` a slot or a lease holds."""
        return int(self.ring_size[r] - self.qlen[r])

    def counts(self, r: int) -> np.ndarray:
        """Ring ``r``'s counts (a view)."""
        off = self.ring_off[r]
        return self.count[off:off + self.ring_size[r]]

    def queue(self, r: int) -> np.ndarray:
        """Ring ``r``'s free frames, the next one handed out first (a copy)."""
        off, n = self.ring_off[r], self.ring_size[r]
        idx = (self.qhead[r] + np.arange(self.qlen[r])) % n
        return self.qbuf[off:off + n][idx]
