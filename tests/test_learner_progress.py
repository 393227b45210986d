"""Issue 22, item 2: a learner always makes progress, whatever the writers
do.  A writer process overwrites a small table flat out, and the learner is
stopped between each copy of its rows and their stamp check until the
writer has replaced every item the table held (a forced worst case: the
whole table turns over during every gather).  Unprotected, every row of
every round is stale and the learner never finishes a batch; with the
protected redraw (``client/draws.py``: the redrawn slots are pinned until
the batch is copied) each batch takes one plain round and one protected
one, and every row is whole.  Counted in work (inserts), never in time."""

import numpy as np

import shmreplay
from shmreplay.client import gather
from idrows import FIELDS, rows, torn
from waiting import HANG_S, reap, stop_asleep, wait_for, worker_context

CAPACITY, BATCH, BATCHES = 64, 16, 5


def writer_main(sock, stop):
    with shmreplay.connect(sock) as c:
        t = c.table("p")
        i = 0
        while not stop.is_set():
            t.insert_batch(rows(np.arange(i, i + 8)), timeout=None)
            i += 8
        t.flush()


def test_learner_completes_batches_while_the_whole_table_turns_over_during_each_gather(
        start_daemon, monkeypatch):
    # holds never expire here: the pins must be what keeps the rows
    d = start_daemon(tables=[{"name": "p", "capacity": CAPACITY, "sampler": "prioritized",
                              "fields": FIELDS}], hold_timeout_s=600.0)
    ctx = worker_context()
    stop = ctx.Event()
    writer = ctx.Process(target=writer_main, args=(d.socket, stop))
    with d.connect() as c:
        t = c.table("p")
        t.insert_batch(rows(np.arange(-CAPACITY, 0)))
        c.flush()

        def inserts():
            return c.stats()["tables"]["p"]["inserts"]

        check = gather.stale_rows
        rounds = []

        def after_the_table_turned_over(gens, out, rows=None):
            # the rows are copied: let the writer replace every item first
            start = inserts()
            wait_for(lambda: inserts() >= start + CAPACITY, "the writer to turn the table over")
            rounds.append(1)
            return check(gens, out, rows)

        monkeypatch.setattr(gather, "stale_rows", after_the_table_turned_over)
        writer.start()
        try:
            for k in range(BATCHES):
                del rounds[:]
                b = t.sample(BATCH)
                assert torn(b.data) == 0, "a row mixes two writes"
                assert np.all(b.data["id"] >= -CAPACITY)
                # one plain round (all of it overwritten) and one protected round
                assert len(rounds) == 2, rounds
                assert 0 < b.redraws <= BATCH, b.redraws
        finally:
            stop.set()
            writer.join(HANG_S)
            reap([writer])
        assert writer.exitcode == 0
        st = c.stats()["tables"]["p"]
        assert st["protected_samples"] >= BATCHES
        assert st["parked_pinned_slots"] > 0, "the writer never reached a pinned slot"
        assert st["held"] == 0 and st["holders"] == [], "every pin is released with its batch"


def test_rows_whole_at_their_check_are_not_drawn_again_when_overwritten_later(
        start_daemon, monkeypatch):
    """Issue 36, item 3 (16 cores, a 1,000-item table turning over every
    ~15 ms: six redraw rounds a batch).  A row whose stamp held after its
    copy is whole; the check after the protected round looks only at the
    rows copied again.  Forced by a second client in this process, which
    writes between copy and check: the oldest half of the table before the
    first check (some rows stale, some whole), then the whole table before
    the second (every slot but the pinned ones, the whole rows of the first
    round among them).  Checking those again would take a third round."""
    d = start_daemon(tables=[{"name": "p", "capacity": CAPACITY, "sampler": "prioritized",
                              "fields": FIELDS}], hold_timeout_s=600.0)
    with d.connect() as c, d.connect() as w:
        t, wt = c.table("p"), w.table("p")
        written = [0]  # torn() counts a negative id as a row never written

        def write(n):  # each call reserves exactly n slots (a table under 256 items)
            wt.insert_batch(rows(np.arange(written[0], written[0] + n)))
            written[0] += n
            w.flush()

        write(CAPACITY)
        check = gather.stale_rows
        rounds, partial = [], 0

        def after_writes(gens, out, rows=None):
            write(CAPACITY // 2 if not rounds else CAPACITY)
            rounds.append(1)
            return check(gens, out, rows)

        monkeypatch.setattr(gather, "stale_rows", after_writes)
        for k in range(BATCHES):
            del rounds[:]
            b = t.sample(BATCH)
            assert torn(b.data) == 0, "a row mixes two writes"
            assert len(rounds) <= 2, f"{len(rounds)} checks: rows whole in the first were drawn again"
            partial += 0 < b.redraws < BATCH
        # half the slots overwritten: all 16 rows of a first round stale, or
        # none, with probability ~2 * 0.5 ** 16 each batch; the case above ran
        assert partial > 0
        st = c.stats()["tables"]["p"]
        assert st["held"] == 0 and st["holders"] == [], "every pin is released with its batch"


def test_a_learners_sample_is_served_before_other_writers_queued_commits(start_daemon):
    """Issue 36, item 3: the engine serves a client that samples between
    the other clients' bursts (engine.py ``_serve_all``), so a learner's
    SAMPLE waits behind one writer's queued records, not every writer's.
    Arranged, not timed: the daemon is asleep, then stopped (SIGSTOP) while
    writer A, writer B and then the learner queue their records (A's and
    B's lazy COMMITs, the learner's SAMPLE of a LIFO table: its newest item);
    once it continues, its next pass visits A, then the learner, then B.
    Served in plain turn, the sample would hold B's items."""
    import os
    import signal

    from shmreplay.wire.channel import CTL_DAEMON_SLEEPING
    d = start_daemon(tables=[{"name": "q", "capacity": 1000, "sampler": "lifo",
                              "fields": {"id": ("int64", ())}}])
    a, b, learner = d.connect(), d.connect(), d.connect()  # the engine's order: connection order
    try:
        ta, tb, tl = a.table("q"), b.table("q"), learner.table("q")
        for t in (ta, tb):
            t.insert(id=0 if t is ta else 100)  # its lease (16 slots): the next inserts need no round trip
        tl.insert(id=-1)
        learner.flush()
        tl.sample(1)  # the daemon knows it for a sampler now (and applied A's and B's commits)
        ring = learner._session.pipe.req  # the daemon announces its sleep in every ring
        stop_asleep(d.pid, lambda: int(ring.ctl[CTL_DAEMON_SLEEPING]) != 0)
        try:
            for i in range(1, 5):
                ta.insert(id=i)
            for i in range(101, 105):
                tb.insert(id=i)
            ticket = tl.begin_sample(4, 0.0, HANG_S)
        finally:
            os.kill(d.pid, signal.SIGCONT)
        got = tl.finish_sample(ticket, 4, 0.0, None, HANG_S)
        # LIFO draws the newest item each time: A's last, not B's
        assert got.data["id"].tolist() == [4] * 4, got.data["id"]
        b.flush()
        assert tl.sample(2).data["id"].tolist() == [104] * 2  # B's commits came right after
    finally:
        for c in (learner, b, a):
            c.close()
