"""Queues (``client.create_queue``: FIFO, each item sampled once, one
sample per insert): several actors and learners over a real daemon; a
full queue holds its actors back, and every item is delivered exactly
once, in order per actor."""

import queue
import time

import pytest

import shmreplay
from items import F, ids, table_stats
from waiting import HANG_S, end_all, no_worker_failed, start_all, wait_for, wait_for_exit, worker_context

CTX = worker_context()  # clean processes, as spawn's, started sooner


def queue_actor(sock, actor, n):
    with shmreplay.connect(sock) as c:
        t = c.table("q")
        for i in range(n):
            t.insert(v=actor * 1_000_000 + i)  # waits as long as the queue is full
        t.flush()


def queue_learner(sock, warm, first, ready, go, stop, out):
    got = []
    with shmreplay.connect(sock) as c:
        t = c.table("q")
        warm.set()
        if not first.wait(10 * HANG_S):
            raise RuntimeError("never told to take a first batch")
        got.extend(ids(t.sample(7)))  # a first batch before the next learner takes one
        ready.set()
        if not go.wait(10 * HANG_S):
            raise RuntimeError("never told to go on")
        while True:
            draining = stop.is_set()  # read before the request: then no item can come after it
            try:
                got.extend(ids(t.sample(7, timeout=0.3)))
            except shmreplay.RateLimited:
                if draining:
                    break
    out.put(got)


def test_queue_delivers_each_item_exactly_once_in_order_per_actor(daemon, client):
    q = client.create_queue("q", 64, F)
    n = 350  # per actor; 1,400 = 200 batches of 7
    stop, go, out = CTX.Event(), CTX.Event(), CTX.Queue()
    warm, first, ready = ([CTX.Event() for _ in range(2)] for _ in range(3))
    actors = [CTX.Process(target=queue_actor, args=(daemon.socket, a, n), daemon=True)
              for a in range(4)]
    learners = [CTX.Process(target=queue_learner, daemon=True,
                            args=(daemon.socket, warm[i], first[i], ready[i], go, stop, out))
                for i in range(2)]
    procs = actors + learners
    try:
        start_all(learners)
        wait_for(lambda: no_worker_failed(procs) and all(w.is_set() for w in warm), "the learners to start", timeout=10 * HANG_S)
        # no learner samples yet: the actors fill the queue, then the limiter must hold them
        start_all(actors)

        def full_and_waiting():
            st = table_stats(client, "q")
            lim = st["limiter"]
            done = lim["inserts"] > 64 or (lim["inserts"] == 64 and lim["pending"] == 0
                                           and lim["waiting_inserts"] >= 1)
            return st if done else None

        st = wait_for(full_and_waiting, "the actors to fill the queue and wait")
        assert st["limiter"]["inserts"] == 64 and st["limiter"]["samples"] == 0, st["limiter"]
        assert len(q) == 64 and not q.can_insert(1)
        assert st["insert_waits"] > 0, "a full 64-item queue must make its actors wait"
        # each learner takes a batch before the next starts, then all run together
        for f, r in zip(first, ready):
            f.set()
            wait_for(lambda: no_worker_failed(procs) and r.is_set(), "a learner's first batch")
        go.set()
        wait_for_exit(actors, procs, "the actors to finish")
        wait_for(lambda: (no_worker_failed(procs)
                            and table_stats(client, "q")["limiter"]["samples"] >= 4 * n), "every item to be sampled")
        stop.set()
        per_learner = []
        deadline = time.monotonic() + 10 * HANG_S
        while len(per_learner) < len(learners):  # read before they exit: a pipe holds little
            try:
                per_learner.append(out.get(timeout=0.5))
            except queue.Empty:
                no_worker_failed(procs)
                assert time.monotonic() < deadline, "the learners never reported"
        wait_for_exit(learners, procs, "the learners to finish")
    finally:
        end_all(procs)
    delivered = [v for got in per_learner for v in got]
    want = [a * 1_000_000 + i for a in range(4) for i in range(n)]
    assert sorted(delivered) == want, "every item exactly once"
    for got in per_learner:
        assert len(got) > 0
        for a in range(4):
            mine = [v for v in got if v // 1_000_000 == a]
            assert mine == sorted(mine), f"actor {a}'s items out of order"
    st = table_stats(client, "q")
    assert st["limiter"]["inserts"] == st["limiter"]["samples"] == 4 * n and len(q) == 0
    assert st["insert_waits"] > 0


def test_a_large_queue_leases_slots_and_still_holds_exactly_its_capacity(client):
    """Issue 22, item 3: a queue of 1,024 items leases 16 slots at a time
    (one RESERVE per 16 inserts, not one per insert), and its limiter still
    admits exactly its capacity: the 1,025th insert waits until an item is
    sampled, and every item comes out once, in order."""
    q = client.create_queue("bigq", 1024, F)
    assert q.lease_size == 16
    for i in range(1024):
        q.insert(v=i, timeout=HANG_S)
    with pytest.raises(shmreplay.RateLimited):
        q.insert(v=1024, timeout=0.2)
    client.flush()
    st = table_stats(client, "bigq")
    assert len(q) == 1024 and st["limiter"]["inserts"] == 1024
    assert st["reservations"] <= 1024 // 16 + 4, st["reservations"]
    assert ids(q.sample(7)) == list(range(7))
    q.insert(v=1024, timeout=HANG_S)  # room again
    client.flush()
    got = []
    while len(got) < 1024 - 7 + 1:
        got.extend(ids(q.sample(1)))
    assert got == list(range(7, 1025))
