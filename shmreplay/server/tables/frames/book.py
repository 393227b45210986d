"""``FrameBook``: a frame table's frames as the daemon keeps them (docs/frames.md).

The invariant it keeps, and why it is enough:

    count[f] = references to frame f held by slots (a slot's item's, from
    its commit until the slot is reserved again; a slot that references
    f twice counts twice) + writers' leases holding f.
    A frame is handed to a writer only while its count is 0.

A slot lets go of its references only when it is reserved again, which
is when its generation stamp is bumped (``slots/ledger.py``), in the same
engine step and before any later request can lease the frames freed.  A
learner's gather copies a drawn item's frames and then re-checks the
item's stamp, as for rows: if the stamp still holds, the slot was not
reserved again before the check, so none of the item's frames had been
handed out, and the stack is whole; else the item is drawn again.  Not
letting go when the item leaves matters: an item sampled for the last
time (``max_times_sampled``) leaves at once while its slot is held for the
learner still reading it, with its stamp unchanged.  Eviction order could
not keep the invariant: lifo and uniform removers, ``max_times_sampled``
and queues remove items out of frame order, and an old item's frames must
outlive the newer ones around them.

What it owns: each ring's counts and free queue (``FrameQueues``), the
writers' frame leases (``FrameLeases``), and the daemon's copy of every
item's references (``refs``, capacity x references an item: the meta
segment's array once frame tables are stored, which learners read; a
client never writes it; ``NO_REF`` in a row: the slot holds none).  Who
calls it: the table that joins it to its slots and selection (``commit``
when an item is committed, ``let_go`` for every slot reserved again), the
engine's handlers of frame leases, and recovery (``adopt``).  Engine
thread only.
"""

from __future__ import annotations

import numpy as np

from ....errors import CapacityError, FieldError
from ....framespec import Frames
from ....wire.framelayout import NO_REF
from .frameleases import FrameLeases
from .freeframes import FrameQueues
from .refcount import give_back, lease_frames, let_go_slots, rebuild, take_refs


class FrameBook:
    """The frames of one table: rings, counts, leases, items' references."""

    def __init__(self, frames: Frames, capacity: int, refs: np.ndarray | None = None,
                 cap_per_owner: int | None = None):
        self.frames = frames
        self.rings = frames.bases
        self.size = frames.ring_frames(capacity)
        self.queues = FrameQueues([self.size] * len(self.rings))
        cols, self._col_names = [], []
        for name, base, _, depth in frames.columns:
            cols += [self.rings.index(base)] * depth
            self._col_names += [(name, d) for d in range(depth)]
        self.col_ring = np.asarray(cols, dtype=np.int64)
        shape = (capacity, len(cols))
        self.refs = np.full(shape, NO_REF, dtype=np.uint32) if refs is None else refs
        if self.refs.shape != shape or self.refs.dtype != np.uint32:
            raise ValueError(f"refs must be uint32{shape}, got {self.refs.dtype}{self.refs.shape}")
        # one owner holds at most half the frames beyond one an item: the
        # rest stay for other writers however one of them misbehaves
        self.leases = FrameLeases((self.size - capacity * frames.per_item) // 2 if cap_per_owner is None
                                  else cap_per_owner)

    # ---- writers' frame leases ----
    def lease(self, owner: int, ring: int, n: int) -> tuple[int, np.ndarray]:
        """Up to ``n`` free frames of ring ``ring`` for ``owner``: (lease
        id, frames), fewer than asked if fewer are free (the table then
        evicts items and asks again, or the writer waits); none is a
        lease of no frames (id 0); at most what ``owner`` may still hold.
        An owner at its cap gets a ``CapacityError`` saying what to give
        back."""
        room = self.leases.room(owner)
        n = min(n, room)
        if n <= 0:
            raise CapacityError(
                f"a client holds {self.leases.held(owner)} frames of this table's "
                f"{self.rings[ring]!r} ring in leases and may hold at most "
                f"{self.leases.cap_per_owner}: its writers share that (close the ones it no "
                f"longer uses), or give the table a larger capacity, whose ring keeps more "
                f"frames for writers")
        out = np.empty(n, dtype=np.int64)
        got = lease_frames(ring, out, *self.queues.kernel_args)
        if not got:
            return 0, out[:0]
        return self.leases.add(owner, ring, out[:got]), out[:got]

    def give_back(self, owner: int, lid: int) -> int:
        """Lease ``lid`` ends; returns how many of its frames are free now."""
        ring, frames = self.leases.pop(owner, lid)
        return give_back(ring, frames, *self.queues.kernel_args)

    def release_owner(self, owner: int) -> int:
        """Every lease of ``owner`` ends (its client is gone); returns how
        many frames are free now."""
        return sum(give_back(ring, frames, *self.queues.kernel_args)
                   for ring, frames in self.leases.pop_owner(owner))

    # ---- items ----
    def commit(self, slot: int, row: np.ndarray) -> None:
        """The item in ``slot`` is committed with the references ``row``
        (read once: it is client-written).  A reference outside its ring or
        to a frame nobody holds is a ``FieldError`` naming it; nothing is
        counted then, and the caller refuses the commit."""
        if self.refs[slot, 0] != NO_REF:  # not let go when reserved: never leak a count
            self.let_go(np.array([slot], dtype=np.int64))
        bad = take_refs(row, self.refs[slot], self.col_ring, self.queues.ring_off,
                        self.queues.ring_size, self.queues.count)
        if bad >= 0:
            name, d = self._col_names[bad]
            value = int(self.refs[slot, bad])
            self.refs[slot] = NO_REF  # the slot holds nothing: reserving it again lets go of nothing
            raise FieldError(
                f"field {name!r}, frame {d} of the stack: reference {value} "
                f"is not a frame of the {self.rings[self.col_ring[bad]]!r} ring ({self.size} "
                "frames) that a lease or a slot holds: reference only frames your "
                "writer leased and stored, or frames of items it committed that are still live")

    def let_go(self, slots: np.ndarray) -> int:
        """``slots`` (int64) are reserved again: they let go of their items'
        references; returns how many frames are free now."""
        return let_go_slots(slots, self.refs, self.col_ring, *self.queues.kernel_args)

    def adopt(self) -> int:
        """Counts rebuilt from the references slots hold (``refs``, as a
        dead daemon left them), every lease gone with the daemon that gave
        it.  Returns how many references were outside their ring or in a
        half-marked row (none is counted; a table with any is not one this
        build wrote)."""
        self.leases.clear()
        return rebuild(self.refs, self.col_ring, *self.queues.kernel_args)

    # ---- what it holds ----
    def free(self, ring: int = 0) -> int:
        return self.queues.free(ring)

    def held(self, ring: int = 0) -> int:
        return self.queues.held(ring)
