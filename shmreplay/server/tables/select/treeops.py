"""A prioritized table's UPDATE and SAMPLE, each one kernel over the sum
tree and the segment's per-slot arrays.

Why kernels: applied from Python, a priority update of 256 keys on a
million-item table took ~110 us in-process (key checks, the live mask, the
stored priorities, tree values, tree update: each a numpy pass with its
own temporaries) for ~30 us of tree work, and a draw with its keys ~100 us
for ~40; fused, each is the tree's cost plus ~10 us (docs/performance.md,
"Per-call costs").

* ``update_fault`` validates an UPDATE before anything is written, so a
  refused update changes nothing (the table then builds the error message
  the slow way: ``priorities.check_priorities``).
* ``store_live`` writes the priorities of the keys that still name the
  committed item they were made for (a key whose slot was reused since is
  *stale* and skipped), and returns how many were live and the largest;
  ``apply_update`` does that and updates the tree (any other sampler takes
  the live slots from ``store_live``).
* ``draw_keys`` draws (``sumtree.tree_draw``) and stamps each slot with its
  generation: the keys a learner gets.

Pure functions of their arguments; plain-numpy twins with the same names
in ``tests/sumtree_reference.py``.  Engine thread only, like the tree.
"""

from __future__ import annotations

import numba
import numpy as np

from ....errors import PriorityError, ProtocolError
from ....numbaconf import JIT
from ....priorities import MAX_TREE_VALUE, check_priorities
from ....wire.layout import COMMITTED
from ....wire.records import SLOT_BITS, SLOT_MASK
from .sumtree import tree_draw, tree_update

BAD_PRIORITY, TOO_LARGE, BAD_SLOT = 1, 2, 3
_MASK = np.uint64(SLOT_MASK)   # numpy scalars: numba keeps keys unsigned
_BITS = np.uint64(SLOT_BITS)


def check_update(keys: np.ndarray, priorities: np.ndarray, spec) -> None:
    """Raise unless an UPDATE of table ``spec`` may run: PriorityError for a
    priority (the message ``check_priorities`` gives), ProtocolError for a
    key past the capacity (no client makes one)."""
    n = keys.shape[0]
    what = f"update_priorities on table {spec.name!r}"
    if priorities.shape != (n,):
        check_priorities(priorities, n, what, spec.alpha)  # raises: says which shape
    fault, at = update_fault(keys, priorities, spec.alpha, spec.capacity)
    if fault == BAD_SLOT:
        raise ProtocolError(f"{what}: key names slot {int(keys[at]) & SLOT_MASK} "
                            f"beyond capacity {spec.capacity}")
    if fault:
        check_priorities(priorities, n, what, spec.alpha)  # raises, with the message
        raise PriorityError(f"{what}: priority[{at}] = {priorities[at]!r} is out of range")


@numba.njit(**JIT)
def update_fault(keys, prios, alpha, capacity):
    """(0, -1) if the update may run, else (what, index) of the first fault:
    BAD_PRIORITY (NaN, infinite or negative), TOO_LARGE (``p ** alpha`` over
    MAX_TREE_VALUE: the tree's total must stay finite) or BAD_SLOT (a key
    naming a slot past the capacity).  Priorities are checked before keys,
    as ``check_priorities`` then the slot check did."""
    n = keys.shape[0]
    for k in range(n):
        v = prios[k]
        if not (v >= 0.0 and v < np.inf):
            return BAD_PRIORITY, k
    for k in range(n):
        if prios[k] ** alpha > MAX_TREE_VALUE:
            return TOO_LARGE, k
    for k in range(n):
        if np.int64(keys[k] & _MASK) >= capacity:
            return BAD_SLOT, k
    return 0, -1


@numba.njit(**JIT)
def store_live(keys, prios, gens, state, stored, slots, values):
    """Of a validated update, the keys that still name the committed item
    they were made for (a key whose slot was reused since is *stale* and
    skipped): each one's raw priority into ``stored``, in order (a later
    duplicate wins), and its slot and priority into the scratch ``slots``
    and ``values`` (at least len(keys) each).  Returns (live keys, largest
    live priority or 0)."""
    m = 0
    top = 0.0
    for k in range(keys.shape[0]):
        key = keys[k]
        s = np.int64(key & _MASK)
        if state[s] != COMMITTED or np.uint64(gens[s]) != key >> _BITS:
            continue
        p = prios[k]
        stored[s] = p
        slots[m] = s
        values[m] = p
        top = max(top, p)
        m += 1
    return m, top


@numba.njit(**JIT)
def apply_update(keys, prios, alpha, gens, state, stored, sums, mins, slots, values):
    """``store_live``, then each live priority's tree value ``p ** alpha``
    (0 for 0) into the tree: a prioritized table's whole UPDATE."""
    m, top = store_live(keys, prios, gens, state, stored, slots, values)
    for k in range(m):
        p = values[k]
        values[k] = p ** alpha if p > 0.0 else 0.0
    tree_update(sums, mins, slots[:m], values[:m])
    return m, top


@numba.njit(**JIT)
def draw_keys(sums, mins, u01, beta, gens, slots, keys, probs, weights):
    """``tree_draw`` into ``slots``, ``probs`` and ``weights``, and each
    draw's key ``gen << 32 | slot``."""
    tree_draw(sums, mins, u01, beta, slots, probs, weights)
    for k in range(u01.shape[0]):
        s = slots[k]
        keys[k] = (np.uint64(gens[s]) << _BITS) | np.uint64(s)
