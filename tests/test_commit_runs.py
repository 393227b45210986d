"""Both ends of a payload-free COMMIT record against plain-Python twins.

The engine's read of a run of them (``records.read_commit_run``, whose
payload-free case is the ``commitrun.commit_run`` kernel) against the
record-by-record loop it replaced: records are written into a ring's
arrays as a client would, in any order of ops, tables, reservations,
offsets and counts, wrapped around the ring's end; the twin and the kernel
must agree on where the run ends and how many items it holds, and both
must refuse the same bad count.

A client's write of one (``Ring.commit_one``, the ``commitrun.put_commit_one``
kernel) against ``records.put_commit`` then ``Ring.publish``, the path it
replaces: the same record bytes, head and sleeping word, and with no room
(or a tail a peer scribbled) nothing written at all."""

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shmreplay.errors import ProtocolError
from shmreplay.wire import records as R
from shmreplay.wire.channel import Ring
from shmreplay.wire.commitrun import SLEEPING_TOP

SLOTS = 16


def twin(recs, tail: int, i: int, n: int):
    """(index after the run, items) or ("bad", index) of the first record
    whose count is outside 1..MAX_BATCH: the loop before the kernel."""
    first = recs[(tail + i) % SLOTS]
    table, rid, offset = int(first["table"]), int(first["a0"]), int(first["a2"])
    total, j = 0, i
    while j < n:
        rec = recs[(tail + j) % SLOTS]
        if j > i and (int(rec["op"]) != R.COMMIT or int(rec["table"]) != table
                      or int(rec["a0"]) != rid or int(rec["a2"]) != offset + total
                      or int(rec["pay_len"]) != 0):
            break
        k = int(rec["a1"])
        if not 1 <= k <= R.MAX_BATCH:
            return "bad", j
        total += k
        j += 1
    return j, total


def ring_with(rows, tail: int) -> Ring:
    ctl = np.zeros(8, np.uint64)
    recs = np.zeros(SLOTS, R.RECORD)
    ring = Ring(ctl, recs, np.zeros(64, np.uint8), 0, 1, 2, 3)
    ring.tail = tail
    for j, (op, table, rid, count, offset, pay_len) in enumerate(rows):
        recs[(tail + j) % SLOTS] = (op, 0, table, j + 1, rid % 2**64, count, offset % 2**64, 0.0, 0, pay_len)
    return ring


@st.composite
def runs(draw):
    """A first payload-free COMMIT and up to 15 records after it, each of
    which continues the run or breaks it one way."""
    tail = draw(st.integers(0, 2**40))
    table = draw(st.integers(0, 3))
    rid = draw(st.one_of(st.integers(0, 2**40), st.just(2**64 - 1)))  # any 64-bit value a client writes
    offset = draw(st.one_of(st.integers(0, 2**33), st.just(2**64 - 2)))
    counts = st.one_of(st.integers(1, 40), st.sampled_from([0, R.MAX_BATCH, R.MAX_BATCH + 1, 2**64 - 1]))
    rows = [(R.COMMIT, table, rid, draw(counts), offset, 0)]
    at = offset + max(rows[0][3], 0)
    for _ in range(draw(st.integers(0, SLOTS - 1))):
        k = draw(counts)
        how = draw(st.sampled_from(["continue"] * 6 + ["op", "table", "rid", "offset", "payload"]))
        rows.append((R.SAMPLE if how == "op" else R.COMMIT,
                     table + (how == "table"), rid + (how == "rid"), k,
                     at + (how == "offset"), 8 if how == "payload" else 0))
        at += k
    return tail, rows


@settings(max_examples=400, deadline=None)
@given(runs())
def test_commit_run_kernel_matches_the_record_loop(case):
    tail, rows = case
    ring = ring_with(rows, tail)
    n = len(rows)
    want = twin(ring.records, tail, 0, n)
    if want[0] == "bad":
        with pytest.raises(ProtocolError, match="COMMIT of"):
            R.read_commit_run(ring, 0, n)
        return
    run = R.read_commit_run(ring, 0, n)
    assert (run.next, run.n) == want
    assert (run.table, run.rid, run.offset, run.prios, run.pay_end) == (rows[0][1], rows[0][2], rows[0][4],
                                                                       None, None)


def test_a_run_of_ten_single_inserts_is_one_commit_and_stops_at_the_next_op():
    rows = [(R.COMMIT, 1, 7, 1, 100 + j, 0) for j in range(10)] + [(R.SAMPLE, 1, 128, 0, 0, 0)]
    run = R.read_commit_run(ring_with(rows, SLOTS - 3), 0, len(rows))  # wraps the ring's end
    assert (run.next, run.n, run.offset) == (10, 10, 100)


def producer_ring(tail_word: int, head: int, sleeping: int) -> Ring:
    """The client's end of a request ring whose consumer left ``tail_word``
    in the tail word (anything: a peer may write any value) and sleeping
    word ``sleeping``; ``head`` records written so far.  Records are filled
    with a pattern, so a write shows wherever it lands."""
    ctl = np.zeros(8, np.uint64)
    ctl[0], ctl[1], ctl[3] = head, tail_word, sleeping
    recs = np.zeros(SLOTS, R.RECORD)
    recs.view(np.uint8)[:] = np.arange(recs.nbytes, dtype=np.uint64).astype(np.uint8)
    return Ring(ctl, recs, np.zeros(64, np.uint8), 0, 1, 2, 3)


@settings(max_examples=400, deadline=None)
@example(head=0, used=5, sleeping=0, table=1, seq=1, rid=7, offset=0)  # a scribbled tail near 2**64
@example(head=3, used=SLOTS - 1, sleeping=0, table=1, seq=1, rid=7, offset=0)  # past a new channel's head
@given(head=st.one_of(st.integers(0, 2**40), st.integers(0, SLOTS)),
       used=st.one_of(st.integers(0, SLOTS), st.integers(-3, -1), st.integers(SLOTS + 1, SLOTS + 3)),
       sleeping=st.sampled_from([0, 1, 2, 2**64 - 1]), table=st.integers(0, 2**32 - 1),
       seq=st.integers(1, 2**62), rid=st.integers(0, 2**62), offset=st.integers(0, 2**33))
def test_commit_one_writes_what_put_commit_and_publish_write(head, used, sleeping, table, seq, rid, offset):
    tail_word = (head - used) % 2**64  # used < 0 or > SLOTS: a tail a peer scribbled
    fast, slow = producer_ring(tail_word, head, sleeping), producer_ring(tail_word, head, sleeping)
    got = fast.commit_one(table, seq, rid, offset)
    if R.put_commit(slow, seq, table, rid, 1, offset, None):
        want = min(slow.publish(), SLEEPING_TOP)  # any value past ASLEEP_WAITING means the same
    else:
        want = -1
    assert got == want
    # room iff the tail is at most SLOTS - 1 records behind the head; a tail
    # "behind" a head smaller than it has wrapped past 2**64: ahead of it
    assert got == (min(sleeping, 2**62) if 0 <= used < SLOTS and used <= head else -1)
    assert fast.head == slow.head
    assert fast.records.tobytes() == slow.records.tobytes()
    assert fast.ctl.tolist() == slow.ctl.tolist()
    if got >= 0:  # and what the engine reads back is that commit
        rec = fast.records[head % SLOTS]
        assert (int(rec["op"]), int(rec["table"]), int(rec["seq"]), int(rec["a0"]), int(rec["a1"]),
                int(rec["a2"]), int(rec["pay_len"])) == (R.COMMIT, table, seq, rid, 1, offset, 0)


@pytest.mark.parametrize("parts", [1, 3])
def test_a_commit_runs_priorities_are_the_daemons_copy_not_the_clients_ring(parts):
    """The table checks a COMMIT's priorities, then writes them into the
    segment and the sum tree: if they were a view of the client's payload,
    a client rewriting its ring in between (NaN, a negative) would reach
    the tree past the check.  One part and several."""
    ctl = np.zeros(8, np.uint64)
    recs = np.zeros(SLOTS, R.RECORD)
    ring = Ring(ctl, recs, np.zeros(4096, np.uint8), 0, 1, 2, 3)
    for j in range(parts):
        assert R.put_commit(ring, j + 1, 1, 7, 2, 2 * j, np.array([1.5, 2.5]) + j)
    ring.publish()
    client_end = Ring(ctl, recs, ring.payload, 0, 1, 2, 3)  # the daemon's end reads from the same memory
    run = R.read_commit_run(client_end, 0, parts)
    assert run.n == 2 * parts and run.prios.tolist() == sum(([1.5 + j, 2.5 + j] for j in range(parts)), [])
    ring.payload.view(np.float64)[:] = np.nan  # the client scribbles its payload afterwards
    assert run.prios.tolist() == sum(([1.5 + j, 2.5 + j] for j in range(parts)), [])
