"""The numba sum/min-tree kernels against their plain-numpy twins."""

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from shmreplay.priorities import first_invalid_priority, priorities_fit
from shmreplay.server.tables.select import sumtree as fast
import sumtree_reference as ref

priorities = st.one_of(
    st.just(0.0),
    st.floats(min_value=1e-300, max_value=1e300, allow_nan=False, allow_infinity=False),
    st.floats(min_value=0.0, max_value=10.0),
)


@st.composite
def tree_and_updates(draw):
    capacity = draw(st.integers(1, 300))
    initial = draw(arrays(np.float64, capacity, elements=priorities))
    k = draw(st.integers(0, 3 * capacity))
    idx = draw(arrays(np.int64, k, elements=st.integers(0, capacity - 1)))
    vals = draw(arrays(np.float64, k, elements=priorities))
    return capacity, initial, idx, vals


def build(mod, capacity, values):
    sums, mins = fast.new_trees(capacity)
    mod.tree_rebuild(sums, mins, values)
    return sums, mins


def updated(case, need_min=False):
    """The tree of ``case`` after its updates, or None if nothing can be
    drawn from it (no positive finite total; ``need_min``: no positive min)."""
    capacity, initial, idx, vals = case
    sums, mins = build(fast, capacity, initial)
    fast.tree_update(sums, mins, idx, vals)
    if not sums[1] > 0 or not np.isfinite(sums[1]) or (need_min and not mins[1] > 0):
        return None
    return sums, mins


@settings(max_examples=300, deadline=None)
@given(tree_and_updates())
def test_update_with_duplicates_matches_reference(case):
    capacity, initial, idx, vals = case
    a = build(fast, capacity, initial)
    b = build(ref, capacity, initial)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    fast.tree_update(a[0], a[1], idx, vals)
    ref.tree_update(b[0], b[1], idx, vals)
    np.testing.assert_array_equal(a[0], b[0])  # bit-identical, not approximately
    np.testing.assert_array_equal(a[1], b[1])
    # last write wins for duplicates
    expect = initial.copy()
    for i, v in zip(idx, vals):
        expect[i] = v
    p = a[0].shape[0] // 2
    np.testing.assert_array_equal(a[0][p:p + capacity], expect)


@settings(max_examples=300, deadline=None)
@given(tree_and_updates(), st.integers(1, 64), st.integers(0, 2**32 - 1))
def test_stratified_sample_matches_reference_and_never_draws_zero(case, n, seed):
    capacity = case[0]
    if (tree := updated(case)) is None:
        return
    sums, mins = tree
    u = np.random.default_rng(seed).random(n)
    i1, v1 = np.empty(n, np.int64), np.empty(n)
    i2, v2 = np.empty(n, np.int64), np.empty(n)
    fast.tree_sample_stratified(sums, u, i1, v1)
    ref.tree_sample_stratified(sums, u, i2, v2)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_array_equal(v1, v2)
    p = sums.shape[0] // 2
    assert np.all(i1 < capacity)
    assert np.all(sums[p + i1] > 0), "a zero-priority leaf was sampled"
    np.testing.assert_array_equal(v1, sums[p + i1])
    assert np.all(np.diff(i1) >= 0), "strata are in increasing order of mass"


def test_stratified_sample_hits_the_leaf_that_owns_each_target():
    rng = np.random.default_rng(0)
    vals = rng.random(1000) * (rng.random(1000) < 0.7)  # 30% zeros
    sums, mins = build(fast, 1000, vals)
    n = 512
    u = rng.random(n)
    idx, got = np.empty(n, np.int64), np.empty(n)
    fast.tree_sample_stratified(sums, u, idx, got)
    cum = np.cumsum(vals)
    targets = (np.arange(n) + u) * (sums[1] / n)
    expect = np.searchsorted(cum, targets, side="right")
    # identical except where the target sits within rounding of a boundary
    differ = idx != expect
    near = np.abs(cum[np.minimum(expect, 999)] - targets) < 1e-9 * sums[1]
    assert np.all(~differ | near)


def test_min_tree_ignores_zero_leaves():
    sums, mins = build(fast, 5, np.array([0.0, 3.0, 0.0, 0.5, 2.0]))
    assert mins[1] == 0.5
    fast.tree_update(sums, mins, np.array([3]), np.array([0.0]))
    assert mins[1] == 2.0
    fast.tree_update(sums, mins, np.array([1, 4]), np.array([0.0, 0.0]))
    assert mins[1] == np.inf and sums[1] == 0.0


@settings(max_examples=200, deadline=None)
@given(arrays(np.float64, st.integers(0, 50), elements=st.floats(allow_nan=True, allow_infinity=True)))
def test_first_invalid_priority_matches_reference(p):
    assert first_invalid_priority(p) == ref.first_invalid_priority(p)


@settings(max_examples=300, deadline=None)
@given(arrays(np.float64, st.integers(0, 50), elements=st.floats(allow_nan=True, allow_infinity=True)),
       st.sampled_from([0.0, 0.5, 0.6, 1.0, 2.0]))
@example(np.array([1e290]), 1.0)                      # at the limit: fits
@example(np.array([0.5, np.nextafter(1e290, np.inf)]), 1.0)  # one ulp past it
@example(np.array([1e150, 2.0]), 2.0)                 # 1e300 once raised
@example(np.array([-0.0, 0.0]), 0.0)                  # 0 ** 0 is 1: fits
def test_priorities_fit_matches_reference(p, alpha):
    """The client's and the daemon's one-call check (``check_priorities``
    runs its slow, message-building path only when this says no)."""
    assert priorities_fit(p, alpha) == ref.priorities_fit(p, alpha)


# exponents np.power turns into sqrt, square or a reciprocal, at values
# where that is 1 ulp off the C library's pow (found by search on this
# box): a twin built on np.power disagreed with the kernel on each
SQRT_OFF = np.array([3.182439444681048e-153, 6.54626805523484e+47])
SQUARE_OFF = np.array([1.0938733830700074e+116, 8.272441739541505e+49])


@settings(max_examples=200, deadline=None)
@given(arrays(np.float64, st.integers(0, 50), elements=priorities),
       st.floats(min_value=0.0, max_value=2.0))
@example(SQRT_OFF, 0.5)
@example(SQUARE_OFF, 2.0)
def test_tree_values_match_reference_and_zero_stays_zero(p, alpha):
    a, b = np.empty_like(p), np.empty_like(p)
    fast.tree_values(p, alpha, a)
    ref.tree_values(p, alpha, b)
    np.testing.assert_array_equal(a, b)  # both raise with the C library's pow (sumtree_reference.py)
    assert np.all(a[p == 0] == 0.0), "0 ** alpha must be 0 even for alpha == 0"


def test_rejects_nan_negative_and_infinite():
    for bad in (np.nan, -1e-9, np.inf, -np.inf):
        p = np.array([1.0, 2.0, bad, 3.0])
        assert first_invalid_priority(p) == 2
    assert first_invalid_priority(np.array([0.0, 1.0])) == -1


@settings(max_examples=100, deadline=None)
@given(tree_and_updates())
def test_check_holds_on_a_healthy_tree_and_agrees_with_reference(case):
    capacity, initial, idx, vals = case
    sums, mins = build(fast, capacity, initial)
    fast.tree_update(sums, mins, idx, vals)
    r1 = fast.tree_check(sums, mins)
    r2 = ref.tree_check(sums, mins)
    assert r1[2] and r2[2]
    assert r1[0] == r2[0]
    assert math.isclose(r1[1], r2[1], rel_tol=1e-12, abs_tol=1e-300)


def test_check_detects_drift_and_rebuild_repairs_it():
    rng = np.random.default_rng(1)
    vals = rng.random(1 << 12)
    sums, mins = build(fast, vals.shape[0], vals)
    good = sums.copy()
    sums[1] *= 1 + 1e-9       # a drifted root
    assert not fast.tree_check(sums, mins)[2]
    sums[:] = good
    sums[3] += 1e-6           # a drifted inner node (root no longer its children's sum)
    sums[1] = sums[2] + sums[3]
    assert not fast.tree_check(sums, mins)[2]
    p = sums.shape[0] // 2
    fast.tree_rebuild(sums, mins, sums[p:].copy())
    assert fast.tree_check(sums, mins)[2]
    np.testing.assert_array_equal(sums, good)


@pytest.mark.parametrize("capacity", [1, 2, 3, 1000, 1 << 16])
def test_tree_size_is_the_next_power_of_two(capacity):
    p = fast.tree_size(capacity)
    assert p >= capacity and p & (p - 1) == 0 and (p == 1 or p // 2 < capacity)


# beta = 1: a weight (v / min) ** -1 where np.power's reciprocal is 1 ulp
# off pow (v / min = 1.1659820878814966e+234, the min leaf 1.0)
RECIPROCAL_OFF = (2, np.array([1.0, 1.1659820878814966e+234]), np.empty(0, np.int64), np.empty(0))


@settings(max_examples=100, deadline=None)
@given(tree_and_updates(), st.integers(1, 64), st.integers(0, 2**32 - 1),
       st.floats(min_value=0.0, max_value=1.0))
@example(RECIPROCAL_OFF, 64, 7, 1.0)
def test_draw_matches_reference(case, n, seed, beta):
    if (tree := updated(case, need_min=True)) is None:
        return
    sums, mins = tree
    u = np.random.default_rng(seed).random(n)
    a = [np.empty(n, np.int64), np.empty(n), np.empty(n)]
    b = [np.empty(n, np.int64), np.empty(n), np.empty(n)]
    with np.errstate(over="ignore", divide="ignore"):
        fast.tree_draw(sums, mins, u, beta, *a)
        ref.tree_draw(sums, mins, u, beta, *b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x, y)
    assert np.all(a[2] <= 1.0), "the smallest positive leaf has weight 1; the others less"


# ---- treeops: a prioritized table's UPDATE and SAMPLE kernels ----
from shmreplay.server.tables.select import treeops  # noqa: E402
from shmreplay.wire.layout import COMMITTED  # noqa: E402


@st.composite
def table_and_update(draw):
    """A table's per-slot arrays, some slots committed, and an UPDATE whose
    keys are live, stale (old generation), on uncommitted slots or past
    the capacity, with priorities valid or not."""
    capacity = draw(st.integers(1, 200))
    gens = draw(arrays(np.uint32, capacity, elements=st.integers(0, 5)))
    state = draw(arrays(np.uint8, capacity, elements=st.integers(0, 3)))
    k = draw(st.integers(0, 3 * capacity))
    slots = draw(arrays(np.int64, k, elements=st.integers(0, capacity + 2)))
    bump = draw(arrays(np.uint32, k, elements=st.sampled_from([0, 0, 0, 1])))
    g = gens[np.minimum(slots, capacity - 1)] + bump
    keys = (g.astype(np.uint64) << np.uint64(32)) | slots.astype(np.uint64)
    prios = draw(arrays(np.float64, k, elements=st.one_of(
        priorities, st.sampled_from([np.nan, -1.0, np.inf, 1e300]))))
    alpha = draw(st.sampled_from([0.0, 0.6, 1.0, 2.0]))
    return capacity, gens, state, keys, prios, alpha


@settings(max_examples=150, deadline=None)
@given(table_and_update())
def test_update_kernel_matches_reference_and_a_refused_update_writes_nothing(case):
    capacity, gens, state, keys, prios, alpha = case
    with np.errstate(over="ignore"):
        fault = tuple(int(x) for x in treeops.update_fault(keys, prios, alpha, capacity))
        assert fault == ref.update_fault(keys, prios, alpha, capacity)
    if fault[0]:
        return  # the table raises before apply_update runs
    initial = np.random.default_rng(0).random(capacity)
    trees, stored = [], []
    for mod in (treeops, ref):
        sums, mins = build(fast, capacity, initial)
        st_ = np.full(capacity, -1.0)
        slots, values = np.empty(len(keys), np.int64), np.empty(len(keys))
        live, top = mod.apply_update(keys, prios, alpha, gens, state, st_, sums, mins, slots, values)
        trees.append((sums, mins, int(live), float(top)))
        stored.append(st_)
    np.testing.assert_array_equal(trees[0][0], trees[1][0])
    np.testing.assert_array_equal(trees[0][1], trees[1][1])
    assert trees[0][2:] == trees[1][2:]
    np.testing.assert_array_equal(stored[0], stored[1])
    outs = []
    for mod in (treeops, ref):  # store_live alone: what a sampler without a kernel gets
        st_ = np.full(capacity, -1.0)
        slots, values = np.empty(len(keys), np.int64), np.empty(len(keys))
        m, top = mod.store_live(keys, prios, gens, state, st_, slots, values)
        outs.append((int(m), float(top), st_, slots[:m].copy(), values[:m].copy()))
    assert outs[0][:2] == outs[1][:2]
    for x, y in zip(outs[0][2:], outs[1][2:]):
        np.testing.assert_array_equal(x, y)
    s = (keys & np.uint64(0xFFFFFFFF)).astype(np.int64)
    dead = np.ones(capacity, bool)
    dead[s[(state[s] == COMMITTED) & (gens[s] == (keys >> np.uint64(32)))]] = False
    assert np.all(stored[0][dead] == -1.0), "a stale key or an uncommitted slot was written"


@settings(max_examples=100, deadline=None)
@given(tree_and_updates(), st.integers(1, 64), st.integers(0, 2**32 - 1))
def test_draw_keys_stamp_each_draw_with_its_slots_generation(case, n, seed):
    capacity = case[0]
    if (tree := updated(case, need_min=True)) is None:
        return
    sums, mins = tree
    gens = np.random.default_rng(seed).integers(0, 2**32, capacity).astype(np.uint32)
    u = np.random.default_rng(seed).random(n)
    out = []
    for mod in (treeops, ref):
        o = [np.empty(n, np.int64), np.empty(n, np.uint64), np.empty(n), np.empty(n)]
        with np.errstate(over="ignore", divide="ignore"):
            mod.draw_keys(sums, mins, u, 0.4, gens, *o)
        out.append(o)
    for x, y in zip(*out):
        np.testing.assert_array_equal(x, y)
    np.testing.assert_array_equal(out[0][1] >> np.uint64(32), gens[out[0][0]])
