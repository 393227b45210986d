"""Commit order of a table's items: the FIFO/LIFO samplers and removers read it.

A deque of keys (``gen << 32 | slot``) in commit order, in a numpy ring of
twice the table's capacity.  Items leave out of order (sampled for the last
time, evicted by another remover), so entries are deleted lazily: an entry
whose key no longer names a committed item is skipped, and dropped once it
reaches either end.  When the ring fills, it is compacted to the live keys,
at most ``capacity`` of them, so compaction runs at most once per
``capacity`` pushes: O(1) amortised.

Engine thread only, never concurrently.
"""

from __future__ import annotations

import numpy as np


class CommitOrder:
    def __init__(self, capacity: int, alive):
        """``alive(keys) -> bool mask``: which keys still name a committed item."""
        self.buf = np.zeros(2 * max(1, capacity), dtype=np.uint64)
        self.start = 0
        self.count = 0
        self.alive = alive

    def __len__(self) -> int:
        """Entries, dead ones included."""
        return self.count

    def _positions(self, i: int, n: int, back: bool) -> np.ndarray:
        """Ring positions of entries i..i+n-1 counted from the chosen end."""
        if back:
            idx = self.start + self.count - 1 - i - np.arange(n)
        else:
            idx = self.start + i + np.arange(n)
        return idx % self.buf.shape[0]

    def push(self, keys: np.ndarray) -> None:
        n = keys.shape[0]
        cap = self.buf.shape[0]
        if self.count + n > cap:
            self.compact()
            if self.count + n > cap:
                raise OverflowError(f"commit order of {cap} entries cannot take {n} more "
                                    f"({self.count} live)")
        self.buf[self._positions_tail(n)] = keys
        self.count += n

    def _positions_tail(self, n: int) -> np.ndarray:
        return (self.start + self.count + np.arange(n)) % self.buf.shape[0]

    def compact(self) -> None:
        keys = self.buf[self._positions(0, self.count, False)]
        keys = keys[self.alive(keys)]
        self.buf[:keys.shape[0]] = keys
        self.start, self.count = 0, keys.shape[0]

    def _scan(self, k: int, back: bool) -> tuple[np.ndarray, int, int]:
        """Up to k live keys from one end, in order from that end; how many
        dead entries precede the first of them; how many entries (live and
        dead) lie up to and including the last of them."""
        w = min(self.count, max(2 * k, 64))
        while True:
            keys = self.buf[self._positions(0, w, back)]
            live = np.flatnonzero(self.alive(keys))
            if live.shape[0] >= k or w == self.count:
                live = live[:k]
                if live.shape[0] == 0:
                    return keys[:0], w, w
                return keys[live], int(live[0]), int(live[-1]) + 1
            w = min(self.count, 2 * w)

    def _drop(self, n: int, back: bool) -> None:
        if not back:
            self.start = (self.start + n) % self.buf.shape[0]
        self.count -= n

    def peek(self, k: int, back: bool = False) -> np.ndarray:
        """Up to k live keys from the front (oldest first) or the back (newest first)."""
        keys, dead, _ = self._scan(k, back)
        self._drop(dead, back)  # they can never come back to life
        return keys

    def pop(self, k: int, back: bool = False) -> np.ndarray:
        """Remove and return up to k live keys from one end (dead ones passed are dropped)."""
        keys, _, used = self._scan(k, back)
        self._drop(used, back)
        return keys
