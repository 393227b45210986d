"""The reuse barrier of a durable file-backed table: no slot whose item the
metadata file on disk lists is written until a newer file has landed.

Why: after a reboot the daemon adopts the table from the metadata file of
its last sync (``server/disk/durable.py``) and the rows file.  If a slot listed there
were reused after that sync, the rows file would hold the new writer's
bytes under the old item's stamp and priority: a torn item, silently.  So
a slot freed (evicted, released after its last sample, aborted, orphaned)
while the file on disk lists its item is *retired*, not freed; it goes
back to the free list when a sync whose copy no longer lists it is on disk.

Protection is widened when a sync takes its copy (``protect``: the items
the new file will list may not be reused while it is being written, or the
old file, if the write fails) and narrowed when the file has landed
(``landed``).  The cost: a full table evicts ahead (``Table``), so it holds
up to ``headroom`` fewer items than its capacity while it is written.

Owned by a ``SlotLedger``; engine thread only.
"""

from __future__ import annotations

import numpy as np


def headroom(capacity: int) -> int:
    """How many slots a full durable table keeps evicted ahead, so writers
    find free slots while a sync runs: 1 % of the table, at least 64, at
    most a quarter of it."""
    return max(1, min(capacity // 4, max(64, capacity // 100)))


class ReuseBarrier:
    def __init__(self, capacity: int):
        self.protected = np.zeros(capacity, dtype=bool)  # listed by the file on disk, or the one being written
        self.listed = 0  # how many: with none, eviction reuses slots at once and nothing is evicted ahead
        self.retired: list[np.ndarray] = []
        self.count = 0  # slots retired
        self.taken = 0  # of those, how many the sync in flight frees when it lands
        self.headroom = headroom(capacity)

    @property
    def full(self) -> bool:
        """As many slots retired as the headroom: evict no more, sync."""
        return self.count >= self.headroom

    def usable(self, slots: np.ndarray) -> np.ndarray:
        """Of freed ``slots``, those that may be written now; the rest are retired."""
        keep = self.protected[slots]
        if keep.any():
            held = slots[keep]
            self.retired.append(held)
            self.count += held.shape[0]
            return slots[~keep]
        return slots

    def protect(self, listed: np.ndarray) -> None:
        """A sync took its copy, which lists the items of mask ``listed``:
        protect those too until it lands.  Every slot retired so far is
        free in that copy, so it is freed when it lands."""
        self.protected |= listed
        self.listed = int(np.count_nonzero(self.protected))
        self.taken = self.count

    def landed(self, listed: np.ndarray) -> np.ndarray:
        """The copy that lists ``listed`` is on disk: only its items stay
        protected.  Returns the retired slots now free to use."""
        self.protected = listed.copy()
        self.listed = int(np.count_nonzero(listed))
        n, self.taken = self.taken, 0
        out, rest, got = [], [], 0
        for a in self.retired:
            if got < n:
                out.append(a)
                got += a.shape[0]
            else:
                rest.append(a)
        self.retired = rest
        self.count -= got
        freed = np.concatenate(out) if out else np.empty(0, dtype=np.int64)
        # a slot retired before the copy was free in it; defend anyway
        back = freed[listed[freed]]
        if back.shape[0]:
            self.retired.append(back)
            self.count += back.shape[0]
        return freed[~listed[freed]]


def consumable(spec) -> bool:
    """Items leave by being sampled (a queue: a rate limiter and a reuse
    limit): one evicted early is lost, so such a table never evicts ahead,
    and its writers wait for retired slots as they wait for held ones."""
    return spec.rate_limited and bool(spec.max_times_sampled)
