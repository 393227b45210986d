"""The daemon-side Table over a real segment, in-process: slot life cycle,
reclaim, and the drift check that rebuilds the sum tree from the segment."""

import os

import numpy as np
import pytest

from shmreplay.errors import CapacityError, ProtocolError
from shmreplay.wire.layout import COMMITTED, FREE, RESERVED, TableMap
from shmreplay.schema import make_spec
from shmreplay.server.counters import Blocked
from shmreplay.server.table import Table


@pytest.fixture
def table():
    spec = make_spec("unit", 8, {"x": ("int64", ())}, alpha=1.0)
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
    first = fill(table, 5)
    assert list(first) == [0, 1, 2, 3, 4] and table.size == 5
    _, slots, contiguous = table.reserve(1, 3)
    assert list(slots) == [5, 6, 7] and contiguous
    assert np.all(table.map.state[slots] == RESERVED)
    rid, slots, _ = table.reserve(2, 2)  # no free slots: the two oldest items go
    assert list(slots) == [0, 1] and table.size == 3
    assert table.stats["evictions"] == 2


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
    table.commit(2, rid2, None)
    assert np.all(table.map.state[s2] == COMMITTED)
    with pytest.raises(ProtocolError, match="not yours"):
        table.commit(1, rid2, None)


def test_drift_beyond_the_bound_is_detected_and_rebuilt_from_the_segment(table):
    fill(table, 8, prios=np.arange(1.0, 9.0))
    sums = table.sampler.sums
    good = sums.copy()
    sums[3] += 0.5   # a corrupted inner node over slots 4..7...
    sums[1] += 0.5   # ...and a root consistent with it
    assert not table.sampler.check()
    # updates of slot 0 recompute only its own path (8 -> 4 -> 2 -> 1), so
    # the damage survives them; the periodic check runs after `capacity`
    # leaf writes and rebuilds from the segment's priorities
    key0 = table.keys_of(np.zeros(8, dtype=np.int64))
    table.update_priorities(key0, np.ones(8))
    assert table.stats["tree_rebuilds"] == 1
    np.testing.assert_array_equal(sums, good)  # slot 0 had priority 1 before and after
    assert table.verify_tree()
