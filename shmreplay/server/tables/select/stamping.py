"""New items' marks in the table segment, and their keys, in one kernel.

``Selection.stamp`` calls ``stamp_new`` for each commit: it writes each
new item's priority, times sampled (0) and commit number into the
segment's marks, and returns their priorities and keys.  It replaces
seven numpy calls on a few slots (``np.full`` of the largest priority,
three fancy writes, an ``arange``, the keys' gather and shifts), which a
commit that finds the daemon's caches cold (a learner's update between
two samples) paid ~10-30 us each.  Its twin is the numpy it replaced
(tests/test_stamping.py).  Engine thread only; a pure function of its
arguments but for the marks it writes.

What it trusts: ``slots`` are the daemon's own (a reservation's, from
the slot ledger), every one in range; ``gens`` is read from the meta
segment, which clients map read-only.
"""

from __future__ import annotations

import numba
import numpy as np

from ....numbaconf import JIT
from ....wire.records import SLOT_BITS

_SHIFT = np.uint64(SLOT_BITS)  # the key's layout, records.py's: gen << 32 | slot
NO_PRIORITIES = np.empty(0, np.float64)  # ``given`` when the caller gave none


@numba.njit(**JIT)
def stamp_new(slots, given, fill, prios, times, seqno, seq0, gens):
    """Stamp the items in ``slots`` (commit order): priority ``given[i]``
    (or ``fill`` where ``given`` is empty), never sampled, commit numbers
    ``seq0 + 1``.. in order.  Returns (their priorities, their keys)."""
    n = slots.shape[0]
    out_prios = np.empty(n, np.float64)
    keys = np.empty(n, np.uint64)
    use_given = given.shape[0] > 0
    for i in range(n):
        s = slots[i]
        p = given[i] if use_given else fill
        prios[s] = p
        times[s] = 0
        seqno[s] = np.uint64(seq0 + 1 + i)
        out_prios[i] = p
        keys[i] = (np.uint64(gens[s]) << _SHIFT) | np.uint64(s)
    return out_prios, keys
