"""Plain-numpy twins of the kernels in ``shmreplay.server.tables.select.sumtree`` (and of
``shmreplay.priorities.first_invalid_priority``), with the same names.

Slow and obviously correct: updates rebuild the whole tree level by level
from the leaves; sampling advances all descents with vectorised numpy.  The
tests assert the numba kernels produce identical arrays (each internal node
is ``fl(left + right)`` in both, so equality is exact, not approximate).

Powers (tree values ``p ** alpha``, weights ``(v / min) ** -beta``) are
the one operation whose rounding is not fixed by IEEE 754: the kernels'
``**`` on floats is LLVM's ``llvm.pow.f64``, which calls the C library's
``pow``; numpy's ``np.power`` does not always (on AVX-512 machines it runs
its own vectorised pow, within 1 ulp of the C library's, and it turns some
exponents into ``sqrt``, ``square`` or ``reciprocal``).  A fresh-clone run
once failed on exactly that, 1 ulp apart.  So the twins raise to a power
with the C library's own ``pow`` (``libm_pow``), element by element, as
the kernels do, and agree bit for bit on every machine whose numba calls
that same ``pow`` (it would not with Intel's SVML installed, ``icc_rt``,
which numba then uses to vectorise such loops; the test extra does not
install it).
"""

from __future__ import annotations

import ctypes
import math

import numpy as np

from shmreplay.server.tables.select.sumtree import DRIFT_SAFETY, new_trees, tree_size  # noqa: F401  (same public names)


_pow = ctypes.CDLL(None).pow  # the process's C library: the symbol numba's pow calls
_pow.argtypes = (ctypes.c_double, ctypes.c_double)
_pow.restype = ctypes.c_double


def libm_pow(x, y: float) -> np.ndarray:
    """``x ** y`` element by element with the C library's ``pow`` (inf on
    overflow, as the kernels give), float64."""
    x = np.asarray(x, dtype=np.float64)
    return np.array([_pow(float(v), float(y)) for v in x.ravel()], dtype=np.float64).reshape(x.shape)


def _rebuild_internal(sums: np.ndarray, mins: np.ndarray) -> None:
    p = sums.shape[0] // 2
    width = p
    while width > 1:
        lo = width // 2
        children = np.arange(width, 2 * width)
        sums[lo:width] = sums[children[0::2]] + sums[children[1::2]]
        mins[lo:width] = np.minimum(mins[children[0::2]], mins[children[1::2]])
        width = lo


def tree_rebuild(sums, mins, values):
    p = sums.shape[0] // 2
    leaves = np.zeros(p)
    leaves[: len(values)] = values
    sums[p:] = leaves
    mins[p:] = np.where(leaves > 0, leaves, np.inf)
    _rebuild_internal(sums, mins)


def tree_update(sums, mins, idx, values):
    p = sums.shape[0] // 2
    idx = np.asarray(idx, dtype=np.int64)
    values = np.asarray(values, dtype=np.float64)
    # numpy fancy assignment with duplicates: the last occurrence wins
    sums[p + idx] = values
    mins[p + idx] = np.where(values > 0, values, np.inf)
    _rebuild_internal(sums, mins)


def tree_sample_stratified(sums, u01, out_idx, out_value):
    n = len(u01)
    if n == 0:
        return
    p = sums.shape[0] // 2
    target = (np.arange(n) + np.asarray(u01)) * (sums[1] / n)
    node = np.ones(n, dtype=np.int64)
    while node[0] < p:
        left = sums[2 * node]
        right = sums[2 * node + 1]
        go_left = (left > 0) & ((target < left) | ~(right > 0))
        target = np.where(go_left, target, target - left)
        node = np.where(go_left, 2 * node, 2 * node + 1)
    out_value[:] = sums[node]
    out_idx[:] = node - p


def tree_draw(sums, mins, u01, beta, out_idx, out_prob, out_weight):
    tree_sample_stratified(sums, u01, out_idx, out_prob)
    v = out_prob.copy()
    out_weight[:] = libm_pow(v / mins[1], -beta)
    out_prob[:] = v / sums[1]


def tree_check(sums, mins):
    p = sums.shape[0] // 2
    leaves = sums[p:]
    exact = math.fsum(leaves)
    depth = int(math.log2(p)) + 1
    bound = DRIFT_SAFETY * depth * 2.0**-53 * abs(exact) + 5e-324
    positive = leaves[leaves > 0]
    m = positive.min() if positive.size else np.inf
    return sums[1], exact, bool(abs(sums[1] - exact) <= bound and mins[1] == m)


def tree_values(priorities, alpha, out):
    pr = np.asarray(priorities, dtype=np.float64)
    out[:] = np.where(pr > 0, libm_pow(np.where(pr > 0, pr, 1.0), alpha), 0.0)


def first_invalid_priority(priorities):
    pr = np.asarray(priorities, dtype=np.float64)
    bad = np.flatnonzero(~((pr >= 0) & (pr < np.inf)))
    return int(bad[0]) if bad.size else -1


def priorities_fit(priorities, alpha):
    from shmreplay.priorities import MAX_TREE_VALUE
    pr = np.asarray(priorities, dtype=np.float64)
    if first_invalid_priority(pr) >= 0:
        return False
    top = pr.max() if pr.size else 0.0
    return not float(libm_pow(np.array([max(top, 0.0)]), alpha)[0]) > MAX_TREE_VALUE


# ---- twins of shmreplay.server.tables.select.treeops ----
def update_fault(keys, prios, alpha, capacity):
    from shmreplay.priorities import MAX_TREE_VALUE
    from shmreplay.server.tables.select.treeops import BAD_PRIORITY, BAD_SLOT, TOO_LARGE
    prios = np.asarray(prios, dtype=np.float64)
    bad = np.flatnonzero(~((prios >= 0) & (prios < np.inf)))
    if bad.size:
        return BAD_PRIORITY, int(bad[0])
    big = np.flatnonzero(libm_pow(prios, alpha) > MAX_TREE_VALUE)
    if big.size:
        return TOO_LARGE, int(big[0])
    beyond = np.flatnonzero((np.asarray(keys, np.uint64) & np.uint64(0xFFFFFFFF)) >= capacity)
    if beyond.size:
        return BAD_SLOT, int(beyond[0])
    return 0, -1


def store_live(keys, prios, gens, state, stored, slots, values):
    from shmreplay.wire.layout import COMMITTED
    keys = np.asarray(keys, np.uint64)
    s = (keys & np.uint64(0xFFFFFFFF)).astype(np.int64)
    live = (state[s] == COMMITTED) & (gens[s].astype(np.uint64) == keys >> np.uint64(32))
    s, p = s[live], np.asarray(prios, np.float64)[live]
    stored[s] = p  # fancy assignment: a later duplicate wins
    m = s.shape[0]
    slots[:m], values[:m] = s, p
    return m, float(p.max()) if m else 0.0


def apply_update(keys, prios, alpha, gens, state, stored, sums, mins, slots, values):
    m, top = store_live(keys, prios, gens, state, stored, slots, values)
    v = np.empty(m)
    tree_values(values[:m], alpha, v)
    tree_update(sums, mins, slots[:m], v)
    values[:m] = v
    return m, top


def draw_keys(sums, mins, u01, beta, gens, slots, keys, probs, weights):
    tree_draw(sums, mins, u01, beta, slots, probs, weights)
    keys[:] = (gens[slots].astype(np.uint64) << np.uint64(32)) | slots.astype(np.uint64)
