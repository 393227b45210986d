"""A dense member set of slots, as numba kernels: the uniform sampler's and
the uniform remover's.

Layout: ``members[:count]`` holds the member slots, in no particular
order; ``pos[slot]`` is the slot's index in ``members``, or -1 for a slot
that is not a member.  Adding appends; removing moves the last member into
the hole, so both are O(1) per slot and a uniform draw is one index into
``members[:count]``.

Why kernels: the table evicts a lease's worth of items (capacity/256, up to
4,096) on every reservation of a full table, one removal per item; as a
Python loop over numpy scalars that was ~1 us per slot, the largest part of
what a chunk of inserts cost the daemon (issue 25).

Both are pure functions of their array arguments: they update ``members``
and ``pos`` in place and return the new count.  ``slots`` must be valid
slot numbers (< len(pos)): they come from the daemon's own books (a
reservation's part, a remover's pick), never from a client's bytes, so the
kernels index without bounds checks.  A slot given twice, or added while a
member (removed while not one), is taken once (skipped).
``tests/members_reference.py`` holds the plain-numpy twin of each.
Callers: the engine thread only.
"""

from __future__ import annotations

import numba

from ....numbaconf import JIT


@numba.njit(**JIT)
def members_add(members, pos, count, slots):
    """Append the slots that are not members yet, in their order; returns the new count."""
    for j in range(slots.shape[0]):
        s = slots[j]
        if pos[s] < 0:
            members[count] = s
            pos[s] = count
            count += 1
    return count


@numba.njit(**JIT)
def members_remove(members, pos, count, slots):
    """Remove the slots that are members (the last member fills each hole);
    returns the new count."""
    for j in range(slots.shape[0]):
        s = slots[j]
        i = pos[s]
        if i < 0:
            continue
        last = members[count - 1]
        members[i] = last
        pos[last] = i
        pos[s] = -1
        count -= 1
    return count
