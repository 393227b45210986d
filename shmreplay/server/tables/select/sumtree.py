"""Sum and min trees over float64, as numba kernels.

Layout (flat, 1-based, as in TorchRL's segment_tree.h)::

    index:   1            root
             2   3        level 1
             4 5 6 7      level 2
             ...
             P .. 2P-1    leaves; leaf i of the table is node P + i

``P`` is the capacity rounded up to a power of two; leaves past the capacity
stay 0 in the sum tree and +inf in the min tree.  A leaf's value is the
*tree value* ``priority ** alpha`` (0 for an empty slot or a zero priority);
the min tree holds +inf for zero leaves, so its root is the smallest
*positive* value, which is what importance weights are normalised by.

Numerics (defended here, not by callers):

* Every internal node is recomputed as ``fl(left + right)`` from its children
  on each update, never adjusted by a delta, so nodes cannot drift apart from
  their children.  The root then differs from the exact sum of the leaves by
  at most ``depth * 2**-53 * sum`` (the pairwise-summation bound).
  ``tree_check`` compares the root with a compensated (Neumaier) sum of the
  leaves and reports whether that bound, times a safety factor of 4, holds;
  the table rebuilds the tree when it does not (a bug or a stray write).
* A zero leaf is never sampled: the descent only enters a child whose value
  is > 0, so even a target that rounding pushed past a boundary lands on a
  positive leaf.

All functions are pure functions of their array arguments; randomness comes
in as an array of uniforms in [0, 1).  ``tests/sumtree_reference.py`` holds
a plain numpy twin of each, with the same names, that the tests compare
against.
Callers: the daemon's engine thread only; not safe to call concurrently on
the same arrays.
"""

from __future__ import annotations

import mmap

import numba
import numpy as np

from ....numbaconf import JIT
from ....wire.segment import HUGE_PAGE_BYTES, advise_huge_pages

DRIFT_SAFETY = 4.0


def tree_size(capacity: int) -> int:
    """Number of leaves ``P`` (a power of two >= capacity)."""
    return 1 << max(0, int(capacity - 1).bit_length())


def new_trees(capacity: int) -> tuple[np.ndarray, np.ndarray]:
    p = tree_size(capacity)
    sums = _private_array(2 * p)
    mins = _private_array(2 * p)
    sums[:] = 0.0
    mins[:] = np.inf
    return sums, mins


# a tree of 1M leaves is two 16 MiB arrays read at random: on 4 KiB pages
# nearly every node below the cached top levels is also a TLB miss
def _private_array(n: int) -> np.ndarray:
    """n float64 in this process's own memory, on transparent huge pages
    where the kernel gives them (``advise_huge_pages``, as the table
    segments; for private memory the machine's
    /sys/kernel/mm/transparent_hugepage/enabled must say "madvise" or
    "always").  The array keeps its mapping alive."""
    if n * 8 < HUGE_PAGE_BYTES:
        return np.empty(n, dtype=np.float64)
    buf = mmap.mmap(-1, n * 8, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(buf)
    return np.frombuffer(buf, dtype=np.float64, count=n)


@numba.njit(**JIT)
def tree_rebuild(sums, mins, values):
    """Set every leaf from ``values`` (length <= P) and recompute all nodes."""
    p = sums.shape[0] // 2
    for i in range(p):
        v = values[i] if i < values.shape[0] else 0.0
        sums[p + i] = v
        mins[p + i] = v if v > 0.0 else np.inf
    for j in range(p - 1, 0, -1):
        sums[j] = sums[2 * j] + sums[2 * j + 1]
        mins[j] = min(mins[2 * j], mins[2 * j + 1])


@numba.njit(**JIT)
def tree_update(sums, mins, idx, values):
    """Set leaves ``idx[k] = values[k]`` in order (later duplicates win),
    then recompute every touched node from its children, one level at a
    time from the leaves up.  A level's recomputes are independent, so
    their cache misses overlap: 29 us for 256 leaves of a million, against
    61 us one path at a time.  A node touched twice is recomputed twice, to
    the same value, so the result does not depend on how duplicates are
    ordered except through "last wins".
    """
    p = sums.shape[0] // 2
    n = idx.shape[0]
    for k in range(n):
        j = p + idx[k]
        v = values[k]
        sums[j] = v
        mins[j] = v if v > 0.0 else np.inf
    shift = 1
    while (p >> shift) >= 1:
        for k in range(n):
            j = (p + idx[k]) >> shift
            sums[j] = sums[2 * j] + sums[2 * j + 1]
            a = mins[2 * j]
            b = mins[2 * j + 1]
            mins[j] = a if a < b else b
        shift += 1


@numba.njit(**JIT)
def tree_sample_stratified(sums, u01, out_idx, out_value):
    """Draw ``len(u01)`` leaves, one per equal-mass stratum of the total.

    Target ``k`` is ``(k + u01[k]) / n * total``.  All descents advance level
    by level, and each level first loads every descent's two children in a
    tight loop of its own (independent loads: many cache misses in flight,
    27-35 us for 256 draws from a million leaves against 50-58 us with the
    loads inside the step), then steps each descent by arithmetic, not a
    branch (the direction is random, so a branch mispredicts half the
    time).  Writes the leaf index and the leaf's value.  The root must be
    > 0.
    """
    n = u01.shape[0]
    if n == 0:
        return
    p = sums.shape[0] // 2
    total = sums[1]
    width = total / n
    kids = np.empty(2 * n)
    for k in range(n):
        out_value[k] = (k + u01[k]) * width  # reuse as the running target
        out_idx[k] = 1
    while out_idx[0] < p:
        for k in range(n):
            c = 2 * out_idx[k]
            kids[2 * k] = sums[c]
            kids[2 * k + 1] = sums[c + 1]
        for k in range(n):
            u = out_value[k]
            left = kids[2 * k]
            right = kids[2 * k + 1]
            # left if it has mass and holds the target, or the right has none
            g = np.int64(left > 0.0) & (np.int64(u < left) | np.int64(not right > 0.0))
            out_idx[k] = 2 * out_idx[k] + 1 - g
            out_value[k] = u - left * (1 - g)  # u - 0.0 == u exactly when going left
    for k in range(n):
        leaf = out_idx[k]
        out_value[k] = sums[leaf]
        out_idx[k] = leaf - p


@numba.njit(**JIT)
def tree_draw(sums, mins, u01, beta, out_idx, out_prob, out_weight):
    """``tree_sample_stratified``, then each draw's probability
    ``value / total`` and importance weight ``(value / min) ** -beta`` (1 for
    the smallest positive leaf), in place: one kernel call per SAMPLE."""
    tree_sample_stratified(sums, u01, out_idx, out_prob)
    total = sums[1]
    smallest = mins[1]
    for k in range(u01.shape[0]):
        v = out_prob[k]
        out_weight[k] = (v / smallest) ** -beta
        out_prob[k] = v / total


@numba.njit(**JIT)
def tree_check(sums, mins):
    """Return (root, exact_sum, ok) where ok says the drift bound holds.

    ``exact_sum`` is a Neumaier-compensated sum of the leaves (error ~1 ulp).
    The bound is ``DRIFT_SAFETY * depth * 2**-53 * exact_sum`` plus one
    subnormal; the min root must equal the smallest positive leaf exactly.
    """
    p = sums.shape[0] // 2
    s = 0.0
    c = 0.0
    m = np.inf
    for i in range(p, 2 * p):
        v = sums[i]
        t = s + v
        if abs(s) >= abs(v):
            c += (s - t) + v
        else:
            c += (v - t) + s
        s = t
        if v > 0.0 and v < m:
            m = v
    exact = s + c
    depth = 1
    q = p
    while q > 1:
        q >>= 1
        depth += 1
    bound = DRIFT_SAFETY * depth * 1.1102230246251565e-16 * abs(exact) + 5e-324
    ok = abs(sums[1] - exact) <= bound and mins[1] == m
    return sums[1], exact, ok


@numba.njit(**JIT)
def tree_values(priorities, alpha, out):
    """Tree value of each priority: ``p ** alpha``, and 0 for p == 0.

    ``0 ** 0`` is 1 in IEEE arithmetic; a zero priority must still mean
    probability zero (Reverb does the same), so it is special-cased.
    """
    for k in range(priorities.shape[0]):
        v = priorities[k]
        out[k] = v ** alpha if v > 0.0 else 0.0
