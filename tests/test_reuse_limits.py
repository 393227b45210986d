"""Reuse limits (``max_times_sampled``): an item leaves the table with its
n-th sample; FIFO gives each item n times in order, random draws never
exceed an item's uses left; the slots of items sampled for the last time
are held until the learner that drew them releases them; and a draw the
limits block takes nothing.  Over a real daemon, and in-process on a
``Table`` over a real segment (conftest's ``make_table``)."""

import numpy as np
import pytest

import shmreplay
from items import F, ids, insert_ids
from shmreplay.errors import CapacityError, EmptyTable, ProtocolError, RateLimited
from shmreplay.server.tables.counters import Blocked
from shmreplay.wire.layout import COMMITTED, FREE, HELD
from shmreplay.wire.records import key_slots


# ---- over a real daemon ----
def test_fifo_with_max_times_sampled_gives_each_item_n_times_in_order(client):
    t = client.create_table("f", 10, F, sampler="fifo", max_times_sampled=2)
    insert_ids(t, 0, 5)
    assert ids(t.sample(5)) == [0, 0, 1, 1, 2]
    assert ids(t.sample(3)) == [2, 3, 3]
    assert len(t) == 1


def test_max_times_sampled_removes_an_item_after_its_nth_sample(client):
    t = client.create_table("m", 100, F, sampler="uniform", max_times_sampled=3)
    insert_ids(t, 0, 100)
    seen = np.zeros(100, int)
    while t.can_sample(1):
        b = t.sample(min(25, 300 - int(seen.sum())))
        np.add.at(seen, b.data["v"], 1)
    assert np.all(seen == 3) and len(t) == 0
    with pytest.raises(shmreplay.EmptyTable):
        t.sample(1, timeout=0)


# ---- in-process, on a real segment ----
def fill(t, n, owner=1):
    done = 0
    while done < n:
        rid, slots, _ = t.reserve(owner, n - done)
        t.map.fields["x"][slots] = t.selection.seqno + 1 + np.arange(slots.shape[0])
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
    return (t.size, t.counters.uses_left, t.counters.samples, t.holds.held,
            t.stats["samples"], t.stats["removed_after_max_samples"], t.map.state.copy(),
            t.map.times.copy(), t.selection.sampler.sums.copy(), t.selection.sampler.mins.copy(), t.selection.sampler.mass)


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
