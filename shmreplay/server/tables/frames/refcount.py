"""The frame books' kernels: an item's references checked and counted, a
slot reserved again letting go of its item's references, frames leased
and given back, and the counts rebuilt from what slots hold (twin:
``tests/frames_reference.py``).

The books they work on (``FrameQueues`` in ``freeframes.py`` owns them):

* ``count``  int64[F_all]: every ring's frames, ring ``r``'s from
  ``ring_off[r]``: references slots hold plus writers' leases;
* ``qbuf``   int64[F_all]: ring ``r``'s free frames, a FIFO in
  ``qbuf[ring_off[r] : ring_off[r] + ring_size[r]]`` from ``qhead[r]``,
  ``qlen[r]`` long (a frame freed last is handed out last, so a learner
  still copying a just-removed item's frames rarely sees them rewritten);
* a slot's references: one per column, column ``j`` an index into ring
  ``col_ring[j]`` (local: ``0 <= ref < ring_size[col_ring[j]]``), or
  ``NO_REF`` in every column: the slot holds none (never committed, or
  let go when it was reserved again).

A frame is in its free queue exactly when its count is 0.  Counts are
int64: a hostile writer referencing one frame from every column of every
item cannot overflow them.  Engine thread only.
"""

from __future__ import annotations

import numba

from ....numbaconf import JIT
from ....wire.framelayout import NO_REF


@numba.njit(**JIT)
def _push(r, frame, ring_off, ring_size, qbuf, qhead, qlen):
    qbuf[ring_off[r] + (qhead[r] + qlen[r]) % ring_size[r]] = frame
    qlen[r] += 1


@numba.njit(**JIT)
def _let_go(r, frame, ring_off, ring_size, count, qbuf, qhead, qlen) -> int:
    """One less on ``frame`` of ring ``r``; queued (and 1 returned) when nothing holds it."""
    g = ring_off[r] + frame
    count[g] -= 1
    if count[g] == 0:
        _push(r, frame, ring_off, ring_size, qbuf, qhead, qlen)
        return 1
    return 0


@numba.njit(**JIT)
def take_refs(row, out, col_ring, ring_off, ring_size, count) -> int:
    """Commit an item's references: copy ``row`` (client-written: read
    once) to ``out`` (the daemon's copy), check every one (inside its ring,
    and a frame somebody holds: a free one may be handed to another writer
    at any moment), then count them.  Returns -1, or the first bad column
    with nothing counted (``out`` then holds what was sent: the caller
    reads the bad value and marks the row ``NO_REF`` again)."""
    for j in range(row.shape[0]):
        out[j] = row[j]
    for j in range(out.shape[0]):
        r = col_ring[j]
        ref = out[j]
        if ref >= ring_size[r] or count[ring_off[r] + ref] <= 0:
            return j
    for j in range(out.shape[0]):
        count[ring_off[col_ring[j]] + out[j]] += 1
    return -1


@numba.njit(**JIT)
def let_go_slots(slots, refs, col_ring, ring_off, ring_size, count, qbuf, qhead, qlen) -> int:
    """``slots`` are reserved again (their generation stamps bumped): let
    go of the references each holds (the daemon's copy, checked when
    taken) and mark them ``NO_REF``; frames nobody holds any more go to
    their free queues.  Returns how many were freed."""
    freed = 0
    for i in range(slots.shape[0]):
        row = refs[slots[i]]
        if row[0] == NO_REF:
            continue
        for j in range(row.shape[0]):
            freed += _let_go(col_ring[j], row[j], ring_off, ring_size, count, qbuf, qhead, qlen)
            row[j] = NO_REF
    return freed


@numba.njit(**JIT)
def lease_frames(r, out, ring_off, ring_size, count, qbuf, qhead, qlen) -> int:
    """Hand out up to ``out.shape[0]`` free frames of ring ``r`` (oldest
    freed first), each counted once for the lease; returns how many."""
    n = min(out.shape[0], qlen[r])
    for i in range(n):
        f = qbuf[ring_off[r] + (qhead[r] + i) % ring_size[r]]
        out[i] = f
        count[ring_off[r] + f] = 1
    qhead[r] = (qhead[r] + n) % ring_size[r]
    qlen[r] -= n
    return n


@numba.njit(**JIT)
def give_back(r, frames, ring_off, ring_size, count, qbuf, qhead, qlen) -> int:
    """A lease of ring ``r`` ends: one less on each of its frames (the
    daemon's record of the lease); returns how many were freed."""
    freed = 0
    for i in range(frames.shape[0]):
        freed += _let_go(r, frames[i], ring_off, ring_size, count, qbuf, qhead, qlen)
    return freed


@numba.njit(**JIT)
def rebuild(refs, col_ring, ring_off, ring_size, count, qbuf, qhead, qlen) -> int:
    """Counts from scratch (a daemon adopting a table: leases died with the
    old one): every reference of every slot that holds some, then each
    ring's free frames queued in index order.  A reference outside its
    ring, or a slot that holds some columns and not others (a segment no
    daemon of this build wrote), is not counted; returns how many there
    were, for the caller to set the table aside."""
    count[:] = 0
    bad = 0
    for s in range(refs.shape[0]):
        if refs[s, 0] == NO_REF:
            for j in range(1, refs.shape[1]):
                if refs[s, j] != NO_REF:
                    bad += 1
            continue
        for j in range(refs.shape[1]):
            r = col_ring[j]
            ref = refs[s, j]
            if ref >= ring_size[r]:
                bad += 1
            else:
                count[ring_off[r] + ref] += 1
    for r in range(ring_off.shape[0]):
        qhead[r] = 0
        qlen[r] = 0
        for f in range(ring_size[r]):
            if count[ring_off[r] + f] == 0:
                _push(r, f, ring_off, ring_size, qbuf, qhead, qlen)
    return bad
