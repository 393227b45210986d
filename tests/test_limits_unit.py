"""In-process checks of the pieces behind the replay semantics: the commit
order with lazy deletion, the rate limiter against a brute-force twin of
Reverb's predicates, reuse limits and held slots on a real segment."""

import math
import os

import numpy as np
import pytest

from shmreplay import ratelimiter
from shmreplay.errors import CapacityError, EmptyTable, ProtocolError, RateLimited, SchemaError
from shmreplay.wire.layout import COMMITTED, FREE, HELD, TableMap
from shmreplay.wire.records import key_slots
from shmreplay.server.tables.order import CommitOrder
from shmreplay.schema import make_spec
from shmreplay.server.tables.counters import Blocked
from shmreplay.server.tables.table import Table


# ---- commit order ----
def test_commit_order_skips_dead_keys_at_both_ends_and_compacts():
    rng = np.random.default_rng(0)
    dead: set[int] = set()
    order = CommitOrder(16, lambda keys: np.array([int(k) not in dead for k in keys], bool))
    ref: list[int] = []   # the live keys in order: the reference
    nxt = 0
    for step in range(3000):
        op = rng.integers(4)
        if op == 0 or not ref:
            k = min(int(rng.integers(1, 5)), 16 - len(ref))
            keys = np.arange(nxt, nxt + k, dtype=np.uint64)
            nxt += k
            order.push(keys)
            ref.extend(keys.tolist())
        elif op == 1:  # an item leaves out of order
            victim = ref.pop(int(rng.integers(len(ref))))
            dead.add(victim)
        elif op == 2:
            back = bool(rng.integers(2))
            k = int(rng.integers(1, 4))
            want = (ref[::-1] if back else ref)[:k]
            assert order.peek(k, back).tolist() == want
        else:
            back = bool(rng.integers(2))
            k = int(rng.integers(1, 4))
            want = (ref[::-1] if back else ref)[:k]
            assert order.pop(k, back).tolist() == want
            for key in want:
                ref.remove(key)
                dead.add(key)
        assert len(order) <= 32


# ---- rate limiter vs a brute-force twin of Reverb's CanInsert/CanSample ----
def reverb_can_insert(spec, size, inserts, pending, samples, k):
    if size + pending + k <= spec.min_size_to_sample:
        return True
    lo, hi = spec.diff_bounds
    return (inserts + pending + k) * spec.samples_per_insert - samples <= hi + 1e-9


def reverb_can_sample(spec, size, inserts, samples, n):
    if size < spec.min_size_to_sample:
        return False
    lo, hi = spec.diff_bounds
    return inserts * spec.samples_per_insert - samples - n >= lo - 1e-9


@pytest.mark.parametrize("spi,eb,mss", [(1.0, 10.0, 1), (4.0, 20.0, 50), (0.25, 3.0, 8),
                                        (2.0, (-5.0, 40.0), 10), (1.0, (0.0, 16.0), 1)])
def test_rate_limiter_admits_exactly_what_reverbs_predicates_admit(spi, eb, mss):
    spec = make_spec("t", 100, {"x": ("f4", ())}, samples_per_insert=spi, error_buffer=eb,
                     min_size_to_sample=mss)
    rng = np.random.default_rng(1)
    for _ in range(3000):
        inserts = int(rng.integers(0, 200))
        deletes = int(rng.integers(0, inserts + 1))
        size = inserts - deletes
        pending = int(rng.integers(0, 5))
        samples = int(rng.integers(0, int(inserts * spi) + 30))
        want = int(rng.integers(1, 20))
        room = ratelimiter.insert_room(spec, size, inserts, pending, samples, want)
        # the largest k <= want that Reverb's predicate admits (it is monotone in k)
        best = max([k for k in range(want + 1)
                    if k == 0 or reverb_can_insert(spec, size, inserts, pending, samples, k)])
        assert room == best
        n = int(rng.integers(1, 20))
        ok = ratelimiter.sample_blocker(spec, size, inserts, samples, n) is None
        assert ok == reverb_can_sample(spec, size, inserts, samples, n)


@pytest.mark.parametrize("limits,match", [
    (dict(samples_per_insert=4.0, error_buffer=3.0), "narrower than"),
    (dict(samples_per_insert=1.0, error_buffer=(50.0, 100.0), min_size_to_sample=10), "min_diff"),
    (dict(samples_per_insert=2.0, error_buffer=10.0, max_times_sampled=1), "exceeds max_times_sampled"),
    (dict(min_size_to_sample=101), "could never be sampled"),
    (dict(samples_per_insert=1.0), "needs an error_buffer"),
    (dict(error_buffer=5.0), "needs samples_per_insert"),
    (dict(samples_per_insert=-1.0, error_buffer=5.0), "must be > 0"),
    (dict(sampler="heap"), "sampler 'heap'"),
    (dict(remover="random"), "remover 'random'"),
])
def test_configurations_that_can_deadlock_are_refused_at_creation(limits, match):
    with pytest.raises(SchemaError, match=match):
        make_spec("t", 100, {"x": ("f4", ())}, **limits)


# ---- reuse limits and held slots on a real segment ----
@pytest.fixture
def make_table():
    made = []

    def make(capacity=8, **limits):
        spec = make_spec("unit", capacity, {"x": ("int64", ())}, **limits)
        tm = TableMap.create(f"/shmreplay.test{os.getpid()}.lim{len(made)}", spec)
        t = Table(1, spec, tm, seed=0)
        made.append(tm)
        return t

    yield make
    for tm in made:
        tm.unlink()
        tm.release()


def fill(t, n, owner=1):
    done = 0
    while done < n:
        rid, slots, _ = t.reserve(owner, n - done)
        t.map.fields["x"][slots] = t.seqno + 1 + np.arange(slots.shape[0])
        t.commit(owner, rid, None)
        done += slots.shape[0]


def values(t, keys):
    return t.map.fields["x"][key_slots(keys)].tolist()


def test_fifo_draws_repeat_each_item_max_times_then_move_on(make_table):
    t = make_table(sampler="fifo", max_times_sampled=2)
    fill(t, 5)
    keys, probs, weights, hid = t.sample(9, 5, 0.4)
    assert values(t, keys) == [1, 1, 2, 2, 3]
    assert hid and t.size == 3 and np.all(probs == 1) and np.all(weights == 1)
    keys, *_ = t.sample(9, 3, 0.4)
    assert values(t, keys) == [3, 4, 4]


def test_items_sampled_for_the_last_time_are_held_until_released(make_table):
    t = make_table(capacity=4, sampler="uniform", max_times_sampled=1)
    fill(t, 4)
    keys, _, _, hid = t.sample(7, 4, 0.4)
    slots = key_slots(keys)
    assert sorted(values(t, keys)) == [1, 2, 3, 4], "each item once: no repeats past the limit"
    assert np.all(t.map.state[slots] == HELD) and t.size == 0
    with pytest.raises(Blocked) as info:     # no slot is free: they are held, not reusable
        t.reserve(1, 1)
    assert isinstance(info.value.error, CapacityError) and "held by learners" in str(info.value)
    with pytest.raises(ProtocolError, match="not yours"):
        t.release(8, hid)
    t.release(7, hid)
    assert np.all(t.map.state[slots] == FREE)
    fill(t, 1)


def test_random_draws_never_exceed_an_items_uses_left(make_table):
    t = make_table(capacity=64, sampler="prioritized", alpha=1.0, max_times_sampled=3)
    fill(t, 64)
    seen = {}
    while t.counters.uses_left:
        keys, *_ = t.sample(1, min(50, t.counters.uses_left), 0.4)
        for v in values(t, keys):
            seen[v] = seen.get(v, 0) + 1
    assert seen == {v: 3 for v in range(1, 65)}
    assert t.size == 0 and t.stats["removed_after_max_samples"] == 64
    with pytest.raises(Blocked) as info:
        t.sample(1, 1, 0.4)
    assert isinstance(info.value.error, EmptyTable)


def untouched(t) -> tuple:
    """What a blocked sample must leave as it was: the counters, every
    slot's state and times sampled, and the sampler's trees bit for bit."""
    return (t.size, t.counters.uses_left, t.counters.samples, t.ledger.held,
            t.stats["samples"], t.stats["removed_after_max_samples"], t.map.state.copy(),
            t.map.times.copy(), t.sampler.sums.copy(), t.sampler.mins.copy(), t.sampler.mass)


def assert_untouched(t, before: tuple) -> None:
    for k, (now, was) in enumerate(zip(untouched(t), before)):
        np.testing.assert_array_equal(now, was, err_msg=f"item {k} of untouched()")


def test_a_blocked_sample_takes_nothing(make_table):
    """Two ways a reuse-limited SAMPLE of a prioritized table blocks: no
    item can be drawn at all (refused before the draw), and the items with
    uses left run dry part-way through the draw, which has then taken the
    drawable item out of the sum tree and must put it back."""
    t = make_table(capacity=8, sampler="prioritized", alpha=1.0, max_times_sampled=1)
    fill(t, 4)
    keys, *_ = t.sample(1, 1, 0.4)
    (gone,) = key_slots(keys)
    live = np.flatnonzero(t.map.state == COMMITTED)
    assert live.shape[0] == 3 and gone not in live
    # the three left have zero priority: uses remain, but nothing can be drawn
    t.update_priorities(t.keys_of(live), np.zeros(3))
    before = untouched(t)
    with pytest.raises(Blocked, match="no item has a positive priority"):
        t.sample(1, 2, 0.4)
    assert_untouched(t, before)
    # one of them drawable: the limits admit 2 (3 uses left, positive mass);
    # the draw takes that item (its one use) out of the tree, then runs dry
    t.update_priorities(t.keys_of(live[:1]), np.array([2.0]))
    before = untouched(t)
    with pytest.raises(Blocked, match="the items with uses left have zero priority") as info:
        t.sample(1, 2, 0.4)
    assert isinstance(info.value.error, RateLimited)
    assert_untouched(t, before)
    # put back as it was: the item is drawn next, with all of the mass
    keys, probs, _, hid = t.sample(1, 1, 0.4)
    assert key_slots(keys).tolist() == [live[0]] and probs.tolist() == [1.0] and hid


def test_rate_limited_reserve_grants_only_what_the_ratio_allows(make_table):
    t = make_table(capacity=100, samples_per_insert=2.0, error_buffer=(0.0, 10.0),
                   min_size_to_sample=1)
    rid, slots, _ = t.reserve(1, 50)
    assert slots.shape[0] == 5, "(5 inserts) * 2 samples_per_insert = 10 = max_diff"
    t.commit(1, rid, None)
    with pytest.raises(Blocked) as info:
        t.reserve(1, 1)
    assert isinstance(info.value.error, RateLimited) and "max_diff 10" in str(info.value)
    t.sample(1, 4, 0.4)
    _, slots, _ = t.reserve(1, 50)
    assert slots.shape[0] == 2
    with pytest.raises(CapacityError, match="never be admitted"):
        t.sample(1, 11, 0.4)
    assert math.isclose(t.map.words.mass, 5.0)
