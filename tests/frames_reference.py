"""A plain reference model of a frame table's frames and items, the twin
of ``shmreplay/server/tables/frames/`` (``refcount.py``'s kernels and
``FrameBook``): Python lists and dicts, no numpy in its decisions.

It keeps what the invariant is about (which frames each lease holds,
which references each slot holds: its item's, from the commit until the
slot is reserved again) and derives every count from them
from scratch (``count``); only the free queues' order is kept step by step
(a frame joins the back of its ring's queue when nothing holds it any
more, a lease takes from the front), as the kernels keep it.
"""

from __future__ import annotations

from collections import deque


class FramesModel:
    def __init__(self, rings: int, size: int, col_ring: list[int]):
        self.size = size
        self.col_ring = list(col_ring)
        self.free = [deque(range(size)) for _ in range(rings)]
        self.items: dict[int, list[int]] = {}                 # slot -> the references it holds
        self.leases: dict[int, tuple[int, int, list[int]]] = {}  # id -> (owner, ring, frames)
        self.next_lease = 1

    def count(self, ring: int, frame: int) -> int:
        """References from live items plus leases holding it, counted now."""
        n = sum(1 for refs in self.items.values() for j, f in enumerate(refs)
                if self.col_ring[j] == ring and f == frame)
        return n + sum(1 for _, r, fs in self.leases.values() for f in fs if r == ring and f == frame)

    def counts(self) -> list[int]:
        return [self.count(r, f) for r in range(len(self.free)) for f in range(self.size)]

    def _let_go(self, ring: int, frames: list[int]) -> int:
        freed = 0
        for f in frames:  # in order: a frame referenced twice is freed at its last letting go
            if self.count(ring, f) == 0 and f not in self.free[ring]:
                self.free[ring].append(f)
                freed += 1
        return freed

    def lease(self, owner: int, ring: int, n: int, cap: int) -> tuple[int, list[int]] | None:
        """None: the owner is at its cap."""
        held = sum(len(fs) for o, _, fs in self.leases.values() if o == owner)
        n = min(n, cap - held)
        if n <= 0:
            return None
        frames = [self.free[ring].popleft() for _ in range(min(n, len(self.free[ring])))]
        if not frames:
            return 0, []
        lid = self.next_lease
        self.next_lease += 1
        self.leases[lid] = (owner, ring, frames)
        return lid, frames

    def give_back(self, owner: int, lid: int) -> int | None:
        """None: not a lease of ``owner``'s."""
        if lid not in self.leases or self.leases[lid][0] != owner:
            return None
        _, ring, frames = self.leases.pop(lid)
        return self._let_go(ring, frames)

    def release_owner(self, owner: int) -> int:
        return sum(self.give_back(owner, lid) for lid in sorted(
            lid for lid, (o, _, _) in self.leases.items() if o == owner))

    def commit(self, slot: int, refs: list[int]) -> int:
        """-1, or the first column whose reference is outside its ring or to
        a frame nothing holds (nothing is committed then).  The slot holds
        none: it was just reserved (``let_go``)."""
        assert slot not in self.items
        for j, f in enumerate(refs):
            if not 0 <= f < self.size or self.count(self.col_ring[j], f) == 0:
                return j
        self.items[slot] = list(refs)
        return -1

    def let_go(self, slot: int) -> int:
        """The slot is reserved again.  A frame it referenced and nothing
        else holds joins its queue at the slot's last reference to it (the
        kernel lets go of references in column order)."""
        if slot not in self.items:
            return 0
        refs = self.items.pop(slot)
        freed = 0
        for j, f in enumerate(refs):
            ring = self.col_ring[j]
            later = any(self.col_ring[k] == ring and refs[k] == f for k in range(j + 1, len(refs)))
            if not later and self.count(ring, f) == 0:
                self.free[ring].append(f)
                freed += 1
        return freed

    def adopt(self) -> None:
        """Leases die with the daemon; free queues in frame order."""
        self.leases.clear()
        self.free = [deque(f for f in range(self.size) if self.count(r, f) == 0)
                     for r in range(len(self.free))]
