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


# ---- joined to a daemon-side Table over real segments ----

import os  # noqa: E402

from shmreplay.schema import make_spec  # noqa: E402
from shmreplay.server.tables.table import Table, reclaim_frames  # noqa: E402
from shmreplay.wire.layout import FREE, HELD, TableMap  # noqa: E402

ROW_FIELDS = {"obs": ("uint8", (2, 3, 3)), "next_obs": ("uint8", (2, 3, 3)), "r": ("float32", ())}


@pytest.fixture
def frame_table():
    made = []

    def make(capacity=4, **limits):
        spec = make_spec("f", capacity, ROW_FIELDS, frames={"obs": 2, "next_obs": "obs"},
                         sampler="uniform", **limits)
        tm = TableMap.create(f"/shmreplay.test{os.getpid()}.frames{len(made)}", spec)
        made.append(tm)
        return Table(1, spec, tm, seed=0)

    yield make
    for tm in made:
        tm.unlink()
        tm.release()


def put(t, owner, frames, rows):
    """Reserve len(rows) slots and commit them with ``rows`` (indices into ``frames``)."""
    rid, slots, _ = t.reserve(owner, len(rows))
    t.commit(owner, rid, None, refs=np.asarray([[frames[i] for i in r] for r in rows], np.uint32))
    return slots


def count(t, frames):
    return t.frames.book.queues.count[np.asarray(frames)].tolist()


def test_a_tables_items_hold_their_frames_until_their_slots_are_reserved_again(frame_table):
    t = frame_table()
    lid, f = t.frames.lease(1, 0, 8, reclaim=lambda short: pytest.fail("nothing is short"))
    slots = put(t, 1, f, [[0, 1, 1, 2], [1, 2, 2, 3], [2, 3, 3, 4], [3, 4, 4, 5]])
    assert t.map.refs[slots].tolist() == [[f[0], f[1], f[1], f[2]], [f[1], f[2], f[2], f[3]],
                                          [f[2], f[3], f[3], f[4]], [f[3], f[4], f[4], f[5]]]
    t.frames.give_back(1, lid)
    assert count(t, f[:6]) == [1, 3, 4, 4, 3, 1]
    put(t, 1, f, [[5, 5, 5, 5]])  # a full fifo table: the oldest item (slot 0) goes, and its frames
    assert count(t, f[:6]) == [0, 1, 3, 4, 3, 1 + 4]  # slot 0 held f1 twice
    assert f[0] in t.frames.book.queues.queue(0)
    rid, (slot,), _ = t.reserve(1, 1)  # the next oldest (slot 1) goes at its reservation,
    assert slot == 1 and count(t, f[:6]) == [0, 0, 1, 3, 3, 5]  # before any commit
    t.abort(1, rid)
    assert count(t, f[:6]) == [0, 0, 1, 3, 3, 5]


def test_a_commit_with_bad_or_no_references_is_refused_and_frees_the_part(frame_table):
    t = frame_table()
    _, f = t.frames.lease(1, 0, 4, reclaim=lambda short: None)
    rid, slots, _ = t.reserve(1, 2)
    with pytest.raises(FieldError, match="field 'obs', frame 0 of the stack: reference 60"):
        t.commit(1, rid, None, refs=np.asarray([[f[0]] * 4, [60, f[1], f[1], f[1]]], np.uint32))
    assert (t.map.state[slots] == FREE).all() and t.size == 0 and count(t, f) == [1, 1, 1, 1]
    rid, slots, _ = t.reserve(1, 1)
    with pytest.raises(ProtocolError, match="carries uint32\\[1, 4\\] frame references; got none"):
        t.commit(1, rid, None)
    assert (t.map.state[slots] == FREE).all() and t.size == 0


def test_an_item_sampled_out_keeps_its_frames_while_held_and_reclaimed_after(frame_table):
    t = frame_table(max_times_sampled=1)
    lid, f = t.frames.lease(1, 0, 3, reclaim=lambda short: pytest.fail("nothing is short"))
    (slot,) = put(t, 1, f, [[0, 1, 1, 2]])
    t.frames.give_back(1, lid)
    keys, _, _, hid = t.sample(2, 1, beta=0.4)  # its only use: it leaves, held for learner 2
    assert t.size == 0 and t.map.state[slot] == HELD and count(t, f) == [1, 2, 1]
    assert reclaim_frames(t, 3) == 0  # held: nothing to reclaim, nothing to evict
    t.release(2, hid)
    assert t.map.state[slot] == FREE and count(t, f) == [1, 2, 1]  # free, frames still held
    stamp = int(t.map.gens[slot])
    assert reclaim_frames(t, 3) == 3 and count(t, f) == [0, 0, 0]
    assert int(t.map.gens[slot]) == stamp + 1  # the learner's key for it is stale now
    assert t.frames.stats["frames_reclaimed"] == 3 and t.frames.stats["evicted_for_frames"] == 0


def test_a_short_ring_evicts_items_by_the_remover_for_a_lease(frame_table):
    t = frame_table(capacity=4)  # 4 + 64 frames
    _, f = t.frames.lease(1, 0, 34, reclaim=lambda short: pytest.fail("nothing is short"))
    # four items of 4 distinct frames each hold 16; writer 1 keeps its 34 leased
    slots = put(t, 1, f, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]])
    t.frames.release_owner(1)  # writer 1's lease ends: 18 of its frames free again
    _, got = t.frames.lease(2, 0, 32, reclaim=lambda short: pytest.fail("nothing is short"))
    stamps = t.map.gens[slots].copy()
    _, got = t.frames.lease(3, 0, 30, reclaim=lambda short: reclaim_frames(t, short))
    # 68 - 16 held by items - 32 leased = 20 free: 10 short, so the three
    # oldest items go (4 frames each, at most: no more than must)
    assert got.shape[0] == 30 and t.size == 1 and t.frames.stats["evicted_for_frames"] == 3
    assert (t.map.gens[slots[:3]] == stamps[:3] + 1).all() and t.map.gens[slots[3]] == stamps[3]
    assert (t.map.state[slots[:3]] == FREE).all()


def test_a_durable_tables_listed_items_keep_their_frames_and_a_short_ring_asks_for_a_sync(frame_table):
    """Items the file on disk lists: evicted for frames, their slots are
    retired with their references; the frames they free once the sync
    lands are counted as coming, so a writer's every retry does not evict
    more (a reclaim once emptied a durable table), and the sync is asked."""
    t = frame_table(capacity=4)
    syncs = []
    t.ledger.start_barrier(lambda: syncs.append(1))
    _, f = t.frames.lease(1, 0, 34, reclaim=lambda short: pytest.fail("nothing is short"))
    slots = put(t, 1, f, [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]])
    t.frames.release_owner(1)
    t.ledger.protect(np.ones(4, dtype=bool))  # a sync took its copy: all four listed
    _, got = t.frames.lease(2, 0, 32, reclaim=lambda short: pytest.fail("nothing is short"))
    refs = t.map.refs[slots].copy()
    _, got = t.frames.lease(3, 0, 30, reclaim=lambda short: reclaim_frames(t, short))
    assert got.shape[0] == 20  # what is free; 10 short
    for _ in range(5):  # the writer asks again and again for the rest
        lid, got = t.frames.lease(3, 0, 10, reclaim=lambda short: reclaim_frames(t, short))
        assert lid == 0 and got.shape[0] == 0
    # three items evicted (their slots retired, references kept) once; every
    # retry counts their frames as coming and asks for the sync
    assert t.size == 1 and t.frames.stats["evicted_for_frames"] == 3 and len(syncs) == 6
    assert (t.map.refs[slots] == refs).all() and t.ledger.retired() == 3
    assert count(t, f[:16]) == [1] * 16
    t.ledger.landed(np.zeros(4, dtype=bool))  # the sync landed listing none: the slots are free
    _, got = t.frames.lease(3, 0, 10, reclaim=lambda short: reclaim_frames(t, short))
    assert got.shape[0] == 10 and t.size == 1


# ---- a learner's gather rebuilds the stacks (client/gather.py, client/framecopy.py) ----

from shmreplay.client.gather import Rows, new_batch, stale_rows, take_rows  # noqa: E402


def test_a_sampled_batch_holds_the_stacks_its_items_reference_bit_for_bit(frame_table):
    t = frame_table(capacity=6)
    rng = np.random.default_rng(5)
    frames = rng.integers(0, 256, size=(7, 3, 3), dtype=np.uint8)  # one stream's frames 0..6
    _, f = t.frames.lease(1, 0, 7, reclaim=lambda short: pytest.fail("nothing is short"))
    t.map.rings["obs"][f] = frames.reshape(7, -1)  # the writer stores its frames
    # item i: obs = frames (i, i+1), next_obs = frames (i+1, i+2); the first padded (0, 0)
    rows = [[0, 0, 0, 1]] + [[i, i + 1, i + 1, i + 2] for i in range(5)]
    rid, slots, _ = t.reserve(1, 6)
    t.map.fields["r"][slots] = np.arange(6, dtype=np.float32)
    t.commit(1, rid, None, refs=np.asarray([[f[i] for i in r] for r in rows], np.uint32))
    keys, _, _, _ = t.sample(2, 32, beta=0.4)
    src = Rows(t.map)
    out = new_batch(t.spec.fields, 32)
    out.keys[:] = keys
    take_rows(src, t.spec.fields, out, np.arange(32))
    items = np.searchsorted(slots, keys & np.uint64(0xFFFFFFFF))  # which item each key names
    want_obs = np.stack([frames[rows[i][:2]] for i in items])
    want_next = np.stack([frames[rows[i][2:]] for i in items])
    assert out.data["obs"].shape == (32, 2, 3, 3) and out.data["obs"].flags.c_contiguous
    assert out.data["obs"].tobytes() == want_obs.tobytes()
    assert out.data["next_obs"].tobytes() == want_next.tobytes()
    assert out.data["r"].tolist() == items.astype(np.float32).tolist()
    # an out= array the kernel may not write (every other row of a larger one): numpy's way
    wide = np.zeros((64, 2, 3, 3), np.uint8)
    out.data["obs"] = wide[::2]
    take_rows(src, t.spec.fields, out, np.arange(32))
    assert wide[::2].tobytes() == want_obs.tobytes() and not wide[1::2].any()
    # an out= array of another dtype (a batch of another table's): numpy's
    # way, never the kernel writing uint8 rows' bytes into float32's
    guard = np.full((32 + 8, 2, 3, 3), -1.0, np.float32)
    out.data["obs"] = guard[:32]
    take_rows(src, t.spec.fields, out, np.arange(32))
    assert (guard[:32] == want_obs).all() and (guard[32:] == -1.0).all()
    # an item whose slot is reserved again after the copy: its stamp says so
    t.reserve(1, 1)  # the oldest item (slot 0) goes
    stale = stale_rows(t.map.gens, out)
    assert sorted(stale.tolist()) == np.flatnonzero(items == 0).tolist()
