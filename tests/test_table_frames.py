"""``server/tables/frames/tableframes.py``: a frame table's frame side as
its table will use it: commits all or none, the payload's shape checked,
a short ring reclaimed through the table before a lease, and the limits on
what a lease may ask."""

import numpy as np
import pytest

from shmreplay.errors import FieldError, ProtocolError
from shmreplay.fields import parse_fields
from shmreplay.framespec import parse_frames
from shmreplay.server.tables.frames.tableframes import MAX_LEASE_FRAMES, TableFrames
from shmreplay.wire.framelayout import NO_REF

FIELDS = parse_fields({"obs": ("uint8", (2, 3, 3)), "next_obs": ("uint8", (2, 3, 3))})
FRAMES = parse_frames({"obs": 2, "next_obs": "obs"}, FIELDS)
CAPACITY = 4  # 4 + 64 frames


def side(cap_per_owner=None):
    refs = np.full((CAPACITY, 4), NO_REF, dtype=np.uint32)
    return TableFrames("t", FRAMES, CAPACITY, refs, cap_per_owner), refs


def test_a_commit_takes_every_rows_references_or_none():
    tf, refs = side()
    _, frames = tf.lease(1, 0, 6, reclaim=lambda short: pytest.fail("nothing is short"))
    good = np.array([frames[[0, 1, 1, 2]], frames[[2, 3, 3, 4]]], dtype=np.uint32)
    part = np.array([0, 1])
    before = tf.book.queues.count.copy()
    bad = good.copy()
    bad[1, 3] = 60  # free: nobody holds frame 60
    with pytest.raises(FieldError, match="field 'next_obs', frame 1 of the stack: reference 60"):
        tf.commit(part, bad)
    assert (tf.book.queues.count == before).all() and (refs == NO_REF).all()  # the good row let go too
    tf.commit(part, good)
    assert refs[:2].tolist() == good.tolist()
    # frame 1 and 3: twice in their rows; frame 2: once in each row; each also leased
    assert tf.book.queues.count[frames[:5]].tolist() == [2, 3, 3, 3, 2]


@pytest.mark.parametrize("payload, says", [
    (None, "got none"),
    (np.zeros((2, 4), np.int64), "got int64\\(2, 4\\)"),
    (np.zeros((1, 4), np.uint32), "got uint32\\(1, 4\\)"),
    (np.zeros((2, 3), np.uint32), "got uint32\\(2, 3\\)"),
    ([[0, 0, 0, 0]] * 2, "got list"),
])
def test_a_commit_without_its_references_in_their_form_is_a_protocol_error(payload, says):
    tf, refs = side()
    with pytest.raises(ProtocolError, match=f"carries uint32\\[2, 4\\] frame references; {says}"):
        tf.commit(np.array([0, 1]), payload)
    assert (refs == NO_REF).all()


def test_a_short_ring_asks_the_table_to_free_frames_before_a_lease():
    tf, refs = side(cap_per_owner=100)
    _, frames = tf.lease(1, 0, 68, reclaim=lambda short: pytest.fail("nothing is short"))
    assert frames.shape[0] == 68 and tf.book.free(0) == 0
    tf.commit(np.array([2]), np.array([frames[:4]], dtype=np.uint32))
    tf.give_back(1, 1)  # the lease ends: only slot 2's four frames stay held
    assert tf.book.free(0) == 64
    asked = []

    def reclaim(short):  # the table frees slot 2 (its item evicted, its stamp bumped)
        asked.append(short)
        assert tf.holding(np.arange(CAPACITY)).tolist() == [2]
        assert tf.reclaim_from(np.array([2])) == 4

    _, got = tf.lease(2, 0, 66, reclaim)
    assert asked == [2] and got.shape[0] == 66 and tf.stats["frames_reclaimed"] == 4
    _, none = tf.lease(3, 0, 5, reclaim=lambda short: None)  # the table could free nothing
    assert none.shape[0] == 2  # what there was


@pytest.mark.parametrize("ring, n", [(1, 1), (-1, 1), (0, 0), (0, MAX_LEASE_FRAMES + 1)])
def test_a_lease_out_of_the_protocol_is_refused(ring, n):
    tf, _ = side()
    with pytest.raises(ProtocolError, match="frame lease on table 't' asks for ring"):
        tf.lease(1, ring, n, reclaim=lambda short: None)
    assert tf.book.leases.held() == 0
