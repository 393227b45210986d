"""The daemon-side Table over a real segment, in-process: slot life cycle,
reclaim, and the drift check that rebuilds the sum tree from the segment."""

import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from shmreplay.errors import CapacityError, ProtocolError
from shmreplay.wire.layout import COMMITTED, FREE, HELD, RESERVED, TableMap
from shmreplay.wire.records import key_slots
from shmreplay.schema import make_spec
from shmreplay.server.tables.counters import Blocked
from shmreplay.server.tables.slots.slotqueue import is_run
from shmreplay.server.tables.table import Table


@pytest.fixture
def table():
    # alpha 0.5, not 1: a sum tree rebuilt without the exponent differs
    spec = make_spec("unit", 8, {"x": ("int64", ())}, alpha=0.5)
    tm = TableMap.create(f"/shmreplay.test{os.getpid()}.unit", spec)
    yield Table(1, spec, tm, seed=0)
    tm.unlink()
    tm.release()


def fill(t, n, owner=1, prios=None):
    rid, slots, _ = t.reserve(owner, n)
    t.map.fields["x"][slots] = slots
    t.commit(owner, rid, prios)
    return slots


def test_reserve_takes_free_slots_then_evicts_oldest(table):
    # two reservations committed in the reverse order: the oldest items are
    # the ones committed first, which are not the lowest slots
    rid_a, first, _ = table.reserve(1, 3)
    rid_b, second, _ = table.reserve(1, 2)
    assert list(first) == [0, 1, 2] and list(second) == [3, 4]
    table.commit(1, rid_b, None)
    table.commit(1, rid_a, None)
    assert table.size == 5
    _, slots, contiguous = table.reserve(1, 3)
    assert list(slots) == [5, 6, 7] and contiguous
    assert np.all(table.map.state[slots] == RESERVED)
    _, slots, _ = table.reserve(2, 2)  # no free slots: the two oldest items go
    assert list(slots) == [3, 4] and table.size == 3
    _, slots, _ = table.reserve(2, 1)
    assert list(slots) == [0] and table.size == 2
    assert table.stats["evictions"] == 3
    assert list(np.flatnonzero(table.map.state == COMMITTED)) == [1, 2]


def test_reservation_bumps_the_generation_before_the_writer_sees_it(table):
    slots = fill(table, 2)
    keys = table.keys_of(slots)
    gens_before = table.map.gens[slots].copy()
    _, again, _ = table.reserve(1, 8)  # evicts both
    assert np.all(table.map.gens[slots] == gens_before + 1)
    assert table.update_priorities(keys, np.ones(2)) == 2, "old keys are stale now"


def test_all_slots_reserved_blocks_with_a_capacity_error(table):
    table.reserve(1, 8)
    with pytest.raises(Blocked, match="reserved by writers") as info:
        table.reserve(2, 1)
    assert isinstance(info.value.error, CapacityError)


def test_release_owner_frees_only_that_owners_reservations(table):
    table.reserve(1, 3)
    rid2, s2, _ = table.reserve(2, 2)
    assert table.release_owner(1) == 3
    assert np.sum(table.map.state == FREE) == 6
    # freed means reservable again: the 3 slots go back on the free list
    _, s3, _ = table.reserve(3, 8)
    assert sorted(s3.tolist()) == [0, 1, 2, 5, 6, 7] and table.stats["evictions"] == 0
    with pytest.raises(ProtocolError, match="not yours"):  # while still open
        table.commit(1, rid2, None)
    table.commit(2, rid2, None)
    assert np.all(table.map.state[s2] == COMMITTED)


def test_drift_beyond_the_bound_is_detected_and_rebuilt_from_the_segment(table):
    fill(table, 8, prios=np.arange(1.0, 9.0))
    sums, mins = table.selection.sampler.sums, table.selection.sampler.mins
    good, good_mins = sums.copy(), mins.copy()
    sums[3] += 0.5   # a corrupted inner node over slots 4..7...
    sums[1] += 0.5   # ...and a root consistent with it
    leaves = sums.shape[0] // 2
    sums[leaves + 5] += 0.25  # and slot 5's leaf: only the segment still has its priority
    assert not table.selection.sampler.check()
    # updates of slot 0 recompute only its own path (8 -> 4 -> 2 -> 1), so
    # the damage survives them; the periodic check runs after `capacity`
    # leaf writes and rebuilds from the segment's priorities
    key0 = table.keys_of(np.zeros(8, dtype=np.int64))
    table.update_priorities(key0, np.ones(8))
    assert table.stats["tree_rebuilds"] == 1
    np.testing.assert_array_equal(sums, good)  # slot 0 had priority 1 before and after
    np.testing.assert_array_equal(mins, good_mins)
    assert table.map.words.mass == good[1]
    assert table.verify_tree()


def test_a_commit_restarts_a_reservations_idle_clock(table):
    """A reservation expires when its writer commits none of it for
    reservation_timeout_s, not that long after it was granted: a slow
    writer keeps its lease, a stalled one loses the rest of it."""
    import time
    from shmreplay.errors import ReservationExpired
    rid, slots, _ = table.reserve(1, 4, user=7)  # a member's client
    books = table.ledger.books
    e = books.entries[rid]
    granted, t = e.since, books.timeout_s
    time.sleep(0.3)  # a slow writer, not a stalled one
    table.commit(1, rid, None, offset=0, n=1)
    assert e.since >= granted + 0.3
    assert books.expire(granted + t + 0.1)[0] == 0 and not e.void  # the grant's deadline is gone
    assert books.expire(e.since + t) == (3, None) and e.void      # idle since its commit: void
    assert table.stats["voided_reserved_slots"] == 0  # (Table.expire counts; books.expire does not)
    with pytest.raises(ReservationExpired, match="1 items were not stored"):
        table.commit(1, rid, None, offset=1, n=1)
    assert table.map.state[slots[1]] == FREE and all(table.map.state[slots[2:]] == RESERVED)
    table.abort(1, rid)  # its writer lets go of the rest
    assert all(table.map.state[slots[2:]] == FREE) and books.voided == 0



# ---- pins: a protected draw's slots are not reused until released ----
def pinned_table(capacity=8, **opts):
    spec = make_spec("pins", capacity, {"x": ("int64", ())}, alpha=0.5, **opts)
    tm = TableMap.create(f"/shmreplay.test{os.getpid()}.pins", spec)
    return Table(1, spec, tm, seed=0), tm


def test_evicting_a_pinned_item_parks_its_slot_until_the_last_pin_goes():
    t, tm = pinned_table()
    try:
        fill(t, 8)
        keys, _, _, hid = t.sample(7, 2, 0.4, protect=True)
        pinned = np.unique(key_slots(keys))
        assert hid and 0 < pinned.shape[0] <= 2
        gens = tm.gens.copy()
        # a writer takes the whole table: the pinned items leave it, their
        # slots are parked (HELD, rows and stamps untouched), the rest reused
        rid, slots, _ = t.reserve(3, 8)
        assert set(slots.tolist()) == set(range(8)) - set(pinned.tolist())
        assert np.all(tm.state[pinned] == HELD) and np.array_equal(tm.gens[pinned], gens[pinned])
        assert t.stats["parked_pinned_slots"] == pinned.shape[0] and t.holds.held == pinned.shape[0]
        with pytest.raises(Blocked):  # nothing left to give: the parked slots are not evictable
            t.reserve(4, 1)
        t.release(7, hid)
        assert np.all(tm.state[pinned] == FREE) and t.holds.held == 0
        assert sorted(t.reserve(4, 8)[1].tolist()) == sorted(pinned.tolist())
    finally:
        tm.unlink()
        tm.release()


def test_a_pin_outlives_another_learners_hold_on_the_same_slot():
    """max_times_sampled=1: learner A's draw takes item s out of the table
    (held for A); learner B pinned s before.  A's release must not free a
    slot B still reads: it is parked until B releases."""
    t, tm = pinned_table(capacity=1, max_times_sampled=2)
    try:
        fill(t, 1)
        _, _, _, pin = t.sample(8, 1, 0.4, protect=True)    # B pins slot 0 (1st of 2 uses)
        _, _, _, held = t.sample(9, 1, 0.4)                 # A: 2nd use, the item leaves
        assert pin and held and tm.state[0] == HELD
        t.release(9, held)
        assert tm.state[0] == HELD and t.holds.parked[0], "B still reads slot 0"
        t.release(8, pin)
        assert tm.state[0] == FREE and t.holds.held == 0 and not t.holds.parked[0]
    finally:
        tm.unlink()
        tm.release()


def test_pins_of_one_client_stop_at_a_quarter_of_the_table_and_expire():
    t, tm = pinned_table(capacity=8)
    try:
        fill(t, 8)
        t.holds.timeout_s = 0.0
        hids = [t.sample(5, 1, 0.4, protect=True)[3] for _ in range(3)]
        assert hids[0] and hids[1], "2 slots: a quarter of 8"
        assert t.holds.pins.of_owner[5] == 2
        assert hids[2] == 0, "past the cap a protected draw is a plain one"
        t.expire(float("inf"))  # the holds run out: pins go with them
        assert 5 not in t.holds.pins.of_owner and not t.holds.pinned.any()
        assert t.holds.held == 0
    finally:
        tm.unlink()
        tm.release()


def test_a_rate_limited_table_without_reuse_limits_evicts_past_parked_pins():
    """samples_per_insert without max_times_sampled: a learner's parked
    pins (items that left the table already) do not stall writers."""
    t, tm = pinned_table(capacity=8, samples_per_insert=1.0, error_buffer=(-100.0, 100.0))
    try:
        fill(t, 8)
        _, _, _, hid = t.sample(7, 2, 0.4, protect=True)
        assert hid and t.holds.pinned.any()
        rid, slots, _ = t.reserve(3, 8)            # evicts every item, parks the pinned ones
        assert 0 < t.holds.held < 8 and slots.shape[0] == 8 - t.holds.held
        t.commit(3, rid, None)
        _, more, _ = t.reserve(3, 2)               # before: Blocked until the learner's release
        assert more.shape[0] == 2 and t.stats["evictions"] == 8 + 2
        t.release(7, hid)
    finally:
        tm.unlink()
        tm.release()


def test_a_queue_waits_for_the_slots_of_a_void_reservation_instead_of_evicting_unsampled_items():
    t, tm = pinned_table(capacity=8, sampler="fifo", remover="fifo", max_times_sampled=1,
                         samples_per_insert=1.0, error_buffer=(0.0, 8.0))
    try:
        t.ledger.books.timeout_s = 0.0
        t.reserve(1, 2)                             # a writer that stalls: its reservation goes void
        t.expire(float("inf"))
        assert t.ledger.books.voided == 2 and t.ledger.pending == 0
        fill(t, 6, owner=2)                         # the other writer fills the free slots
        assert t.size == 6
        with pytest.raises(Blocked):                # the limiter has room, the slots are void:
            t.reserve(2, 1)                         # wait, do not evict an unsampled item
        assert t.stats["evictions"] == 0
        keys, _, _, hid = t.sample(5, 1, 0.4)       # the learner takes one: its slot is freed
        t.release(5, hid)
        _, slots, _ = t.reserve(2, 1)
        assert list(slots) == [int(key_slots(keys)[0])] and t.stats["evictions"] == 0
    finally:
        tm.unlink()
        tm.release()


def test_pins_of_one_user_over_many_clients_stop_at_a_quarter_and_all_users_at_half():
    """A user (not root, the daemon's or the admin group's) with many
    learners: a quarter of the table across its clients; every such user
    together: half.  An uncapped client (user None) is held only by its own
    cap.  Caps are per slot pinned; past one, a protected draw is plain."""
    t, tm = pinned_table(capacity=16, sampler="uniform")
    try:
        fill(t, 16)

        def pin(owner, user):
            slots = np.array([owner % 16], np.int64)  # one distinct slot per client
            return t.holds.pin(owner, slots, 0, user)
        assert all(pin(owner, 1000) for owner in range(10, 14))   # user 1000: 4 slots = a quarter
        assert pin(14, 1000) == 0, "a fifth client of the same user pins nothing"
        assert all(pin(owner, 1001) for owner in range(20, 24))   # user 1001: its own quarter
        assert t.holds.pins.others == 8 == t.holds.pins.others_cap
        assert pin(30, 1002) == 0, "all capped users together: half the table"
        assert pin(31, None), "root, the daemon's user, the admin group: their own cap only"
        hid = pin(15, None)
        t.release(15, hid)
        assert 15 not in t.holds.pins.of_owner
        for owner in range(10, 14):
            t.release_owner(owner)
        assert 1000 not in t.holds.pins.of_user and t.holds.pins.others == 4
        assert pin(32, 1002), "room again once user 1000's clients left"
    finally:
        tm.unlink()
        tm.release()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-3, 3), max_size=12), st.integers(0, 1 << 40))
def test_is_run_agrees_with_numpy(steps, first):
    # slots built from steps of -3..3 from any start: runs (all steps 1),
    # repeats, gaps and reversals; the twin is numpy's diff
    slots = np.cumsum([first] + steps).astype(np.int64)
    assert is_run(slots) == bool(np.all(np.diff(slots) == 1))


def test_a_reservation_says_whether_its_slots_are_one_run(make_table):
    t = make_table(capacity=8)
    rid, slots, contiguous = t.reserve(1, 3)
    assert slots.tolist() == [0, 1, 2] and contiguous
    t.abort(1, rid)  # slots 0-2 go back to the free list behind 3-7
    rid, slots, contiguous = t.reserve(1, 8)
    assert slots.tolist() == [3, 4, 5, 6, 7, 0, 1, 2] and not contiguous
