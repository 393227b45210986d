"""Issue 33: three promises of the Ray integration, on a real two-node Ray
cluster (rayfixtures.cluster: both nodes on 127.0.0.1) and a real daemon:
the parameter relay, a chunk sent again after the daemon voided the
ingest's lease, and held chunks inserted once they reach 1 MiB.  Issue 34,
item 5: no acknowledgement from an earlier ingest incarnation or from
another party confirms a producer's chunk (docs/reliability.md, section 13)."""

import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
import shmreplay  # noqa: E402
import shmreplay.ray as sray  # noqa: E402
from rayfixtures import HOLD_MAX, before_the_ingest_thread, cluster  # noqa: E402,F401 (a fixture)
from rayproducer import FIELDS, P, Producer, claim, read_parameters, restarted, rows  # noqa: E402
from readback import committed  # noqa: E402
from shmreplay.ray.coalesce import HOLD_S  # noqa: E402
from shmreplay.ray.producers import new_key  # noqa: E402
from waiting import HANG_S, wait_for  # noqa: E402

# one pytest-xdist worker runs every test that starts Ray: one Ray at a time on the box
pytestmark = pytest.mark.xdist_group("ray")


def parameters(version: int) -> dict:
    """The learner's parameters at ``version``: three dtypes, one of them a
    scalar, every value exact in its dtype and different per version."""
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) + np.float32(0.25 * version),
            "b": np.array([-2.0, -1.0, 0.0, 1.0, 2.0]) * version,
            "step": np.int64(1000 * version)}


def test_remote_actors_read_the_learners_parameters_through_the_relay(cluster, start_daemon):
    """docs/scaling.md ("A program that uses it": the actors read the
    learner's weights through ``start_parameter_relay``, a ParameterBoard
    read on the replay node) and relay.py: ``relay.latest.remote(
    newer_than=v)`` is None or ``(version, {name: array})``, for any actor.
    Actors on the other node get the version and arrays the learner
    published, then the newer one after the next publish, and None when
    nothing newer than theirs exists; one relay serves every actor, so an
    actor that has read less than another is still told of the newest."""
    d = start_daemon()
    with d.connect() as c:
        board = shmreplay.ParameterBoard.create(c, "policy", like=parameters(0))
        relay = sray.start_parameter_relay(d.socket, "policy", parameters(0), node_id=cluster)

        def read(newer_than):
            got, node = ray.get(read_parameters.remote(relay, newer_than), timeout=HANG_S)
            assert node != cluster  # not on the replay node
            return got

        def check(got, version):
            assert got is not None and got[0] == version
            arrays, want = got[1], parameters(version)
            assert sorted(arrays) == ["b", "step", "w"]
            for k, v in want.items():
                assert arrays[k].dtype == v.dtype and arrays[k].shape == v.shape, k
                np.testing.assert_array_equal(arrays[k], v, err_msg=k)

        assert read(None) is None  # nothing published yet
        assert board.publish(parameters(1), flush=True) == 1
        check(read(None), 1)
        assert read(1) is None
        check(read(0), 1)  # an actor behind the one that read version 1
        assert board.publish(parameters(2), flush=True) == 2
        check(read(1), 2)
        assert read(2) is None
        check(read(0), 2)  # the newest, not each version in turn
        check(read(None), 2)
    ray.kill(relay)


ROUNDS = 5  # rounds of one chunk each, at most, until one met a void lease


@pytest.mark.parametrize("hold_s", [HOLD_S, 0], ids=["held", "at-once"])
def test_a_chunk_the_daemon_refused_for_a_void_lease_is_sent_again_and_stored_once(
        cluster, start_daemon, hold_s):
    """docs/scaling.md (Failures: "a lease the daemon voided
    (``ReservationExpired``) is handled the same way": the chunk is sent
    again) and inserter.py (LEASE_KEEP_S: a commit into a void lease is
    refused, which the ingest survives).  The ingest keeps its slot lease
    between chunks; the daemon voids it once no commit touched it for
    ``reservation_timeout_s`` (docs/reliability.md).  A producer's chunk
    copied into those slots is refused at the ingest's flush; the producer
    sends it again and sees it confirmed, and the table holds every row
    exactly once.  Each chunk is flushed before the next is sent
    (``hold=1``, ``in_flight=1``), so nothing else is unconfirmed when the
    lease goes: a chunk stored twice would be a defect, not at-least-once.
    With the chunk held until the flush (coalesce.py), and inserted as it
    comes (``hold_s=0``)."""
    d = start_daemon(tables=[{"name": "t", "capacity": 4096, "fields": FIELDS}], reservation_timeout_s=1.0)
    ingest = sray.start_ingest(d.socket, "t", node_id=cluster, flush_every=1000, hold_s=hold_s)
    producer = Producer.remote(ingest, 8, 1, 1)  # chunks of 8 rows, each flushed as it goes
    with d.connect() as c:
        def table():
            return c.stats()["tables"]["t"]

        # the first chunk: a reservation of 16 slots (capacity/256), 8 of them used, 8 kept
        assert ray.get(producer.write.remote(np.arange(8), False), timeout=HANG_S) == 1
        chunks = 1
        # a round: every reservation the ingest holds is void, then one chunk.  The
        # ingest hands back a lease it has held LEASE_KEEP_S (10 s) before its next
        # insert, and a chunk that came that late, on a stalled machine, goes into
        # a new one: then the round proves nothing, and another one runs
        while ray.get(producer.resent.remote(), timeout=HANG_S) == 0:
            assert chunks < ROUNDS, f"no chunk of {ROUNDS} met a void lease"
            wait_for(lambda: 0 < table()["reserved"] == table()["voided"],
                     "the daemon to void every slot the ingest reserved")
            lo = 8 * chunks
            assert ray.get(producer.write.remote(np.arange(lo, lo + 8), False), timeout=HANG_S) == chunks + 1
            chunks += 1
        sent, confirmed, _, unconfirmed = ray.get(producer.progress.remote(), timeout=HANG_S)
        assert (sent, confirmed, unconfirmed) == (chunks, chunks, 0)  # each chunk confirmed, none pending
        assert table()["voided_reserved_slots"] >= 8  # the daemon did void slots the ingest held
        got, _ = committed(c.table("t"))
        assert sorted(got["id"].tolist()) == list(range(8 * chunks))  # each row once: none lost, none twice
        np.testing.assert_array_equal(got["obs"], rows(got["id"])["obs"])
    ray.kill(producer)
    ray.kill(ingest)


# 8 + 120 bytes a row: a chunk of 512 rows is 65,536 bytes, 64 KiB, the most
# the ingest holds (coalesce.CHUNK_BYTES); 16 of them are 1 MiB (BATCH_BYTES)
BLOB = {"id": ("int64", ()), "blob": ("uint8", (120,))}
ROW_BYTES = 8 + 120


def blob_rows(lo: int, n: int) -> dict:
    ids = np.arange(lo, lo + n, dtype=np.int64)
    return {"id": ids, "blob": (ids[:, None] + np.arange(120)).astype(np.uint8)}


def holding_ingest(c, d, cluster, name: str, capacity: int, fields: dict):
    """A new table ``name`` and an ingest for it that flushes only when
    asked and holds small chunks for ``HOLD_MAX``, once it serves (its
    start is no part of a before_the_ingest_thread window)."""
    c.create_table(name, capacity, fields)
    ingest = sray.start_ingest(d.socket, name, node_id=cluster, flush_every=1000, hold_s=HOLD_MAX)
    ray.get(ingest.stats.remote(), timeout=HANG_S)
    return ingest


def test_held_chunks_are_inserted_once_they_reach_1_MiB(cluster, start_daemon):
    """shmreplay/ray/__init__.py ("Small chunks, inserted together") and
    docs/scaling.md: chunks of up to 64 KiB are held and inserted as one
    batch before the flush, once they reach 1 MiB, or ``hold_s`` after the
    first.  With no flush asked (``flush_every=1000``) and ``hold_s`` at its
    most (read within it: rayfixtures.before_the_ingest_thread), held
    chunks 128 bytes short of 1 MiB stay held, and the chunk that brings
    them to 1 MiB has them all inserted, in one batch, by its own call,
    before any flush.  A chunk over 64 KiB is not held."""
    assert 512 * ROW_BYTES == 64 << 10 and 16 * (64 << 10) == 1 << 20
    d = start_daemon()
    with d.connect() as c:
        def fill(k):
            name = f"t{k}"
            ingest = holding_ingest(c, d, cluster, name, 16384, BLOB)

            def put(lo, n, seq):
                ray.get(ingest.put.remote(blob_rows(lo, n), [None, P, seq, False, None]), timeout=HANG_S)
                return ray.get(ingest.stats.remote(), timeout=HANG_S)

            t0 = time.monotonic()
            for i in range(15):  # 15 x 512 rows x 128 B = 983,040 B (960 KiB)
                put(512 * i, 512, i + 1)
            before = put(7680, 511, 16)  # + 511 x 128 B = 65,408 B: 1,048,448 B, 1 MiB - 128 B
            after = put(8191, 1, 17)  # + 128 B: 1,048,576 B, 1 MiB
            seconds = time.monotonic() - t0
            # 513 x 128 B = 65,664 B, over 64 KiB: inserted as it comes, never held
            big = put(8192, 513, 18)
            ray.get(ingest.sync.remote(P), timeout=HANG_S)  # the flush: every insert applied
            ray.kill(ingest)
            return seconds, (name, before, after, big)

        name, before, after, big = before_the_ingest_thread(fill)
        assert (before["chunks"], before["held"], before["inserts"]) == (16, 16, 0)
        assert (after["chunks"], after["held"], after["inserts"], after["flushes"]) == (17, 0, 1, 0)
        assert (big["chunks"], big["held"], big["inserts"], big["flushes"]) == (18, 0, 2, 0)
        got, _ = committed(c.table(name))  # in commit order: the batch, then the large chunk
        np.testing.assert_array_equal(got["id"], np.arange(8192 + 513))
        np.testing.assert_array_equal(got["blob"], blob_rows(0, 8192 + 513)["blob"])


def test_a_restarted_ingest_never_confirms_chunks_an_earlier_incarnation_answered(cluster, start_daemon):
    """Issue 34, item 5, the reported sequence: a producer's 10 chunks (80
    rows) are answered and held by the ingest (coalesce.py), none flushed;
    the ingest is killed (any job holding its handle may), and once Ray
    has restarted it, another party that holds the producer's key sends
    empty chunks under sequence numbers 1-10 and has them flushed.  The
    producer's next answer, from the new incarnation, acknowledges 1-10:
    those acknowledge the other party's chunks, not the ones the dead
    ingest held, so ``flush()`` sends all 10 again and returns only once
    the table holds every one of its 80 rows, each once.  (On the old
    order, acks read before the incarnation: ``flush()`` returned with 10
    chunks confirmed and 0 of the 80 rows stored.)  The ingest holds with
    ``hold_s`` at its most, killed within it
    (rayfixtures.before_the_ingest_thread): the dead ingest stored
    nothing."""
    d = start_daemon()
    with d.connect() as c:
        def held_then_killed(k):
            name = f"claimed{k}"
            ingest = holding_ingest(c, d, cluster, name, 1024, FIELDS)
            pid = ray.get(ingest.pid.remote(), timeout=HANG_S)
            key = new_key()
            w = sray.RemoteWriter(ingest, chunk=8, in_flight=2, hold=1000, key=key)
            t0 = time.monotonic()
            w.insert_batch(rows(np.arange(80)))  # 10 chunks, the last two still unanswered
            # read after the 10 puts: one caller's calls run in order
            before = ray.get(ingest.stats.remote(), timeout=HANG_S)
            ray.kill(ingest, no_restart=False)
            return time.monotonic() - t0, (name, ingest, pid, key, w, before)

        name, ingest, pid, key, w, before = before_the_ingest_thread(held_then_killed)
        assert (before["chunks"], before["held"], before["inserts"], before["flushes"]) == (10, 10, 0, 0)
        wait_for(lambda: restarted(ingest, pid), "Ray to restart the ingest")
        after = ray.get(claim.remote(ingest, key, list(range(1, 11))), timeout=HANG_S)
        assert (after["chunks"], after["rows"], after["flushes"]) == (10, 0, 1)  # the other party's 10, flushed
        assert len(c.table(name)) == 0 and w.confirmed == 0
        w.flush()
        got, _ = committed(c.table(name))
        assert sorted(got["id"].tolist()) == list(range(80))  # every row the producer was told of, once
        np.testing.assert_array_equal(got["obs"], rows(got["id"])["obs"])
        assert (w.sent, w.confirmed, w.resent) == (10, 10, 10)
    ray.kill(ingest)


def test_the_id_a_producer_shows_lets_nobody_claim_its_chunks(cluster, start_daemon):
    """Issue 34, item 5: a producer is known to the ingest by a secret key
    of 128 random bits (shmreplay/ray/producers.py); its stats show only a
    digest of it, the writer's ``id``.  Another party that read that id
    cannot use it as a key, and a key made of it is another producer's:
    sequence numbers 2-11 it sends and has flushed under that key are owed
    to it, never to the producer, whose chunks 2-11, answered and held by
    the ingest but not yet flushed, stay unconfirmed until its own flush
    stores them.  (With the id shown being the key, chunk 2's answer
    confirmed it while it was only held.)"""
    d = start_daemon(tables=[{"name": "t", "capacity": 1024, "fields": FIELDS}])
    ingest = sray.start_ingest(d.socket, "t", node_id=cluster, flush_every=1000, hold_s=HOLD_MAX)
    w = sray.RemoteWriter(ingest, chunk=8, in_flight=2, hold=1000)
    w.insert_batch(rows(np.arange(8)))
    w.flush()
    assert w.confirmed == 1
    shown = ray.get(ingest.stats.remote(), timeout=HANG_S)["producer_ids"]
    assert shown == [w.id]
    with pytest.raises(ray.exceptions.RayTaskError, match="producer's key must be 32 lowercase hex digits"):
        ray.get(claim.remote(ingest, shown[0], [2]), timeout=HANG_S)
    ray.get(claim.remote(ingest, shown[0] * 2, list(range(2, 12))), timeout=HANG_S)
    w.insert_batch(rows(np.arange(8, 88)))  # chunks 2-11; 2-9 answered, none flushed
    assert w.confirmed == 1
    w.flush()
    assert (w.sent, w.confirmed, w.resent) == (11, 11, 0)
    with d.connect() as c:
        got, _ = committed(c.table("t"))
        assert sorted(got["id"].tolist()) == list(range(88))
        np.testing.assert_array_equal(got["obs"], rows(got["id"])["obs"])
    ray.kill(ingest)
