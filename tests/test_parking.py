"""Parking: a request its table's limits hold back (a SAMPLE below its
min size or past the rate limit, a RESERVE while every slot is reserved or
held) waits in the daemon (``server/engine/parking.py``).  It runs as soon
as it can, oldest first, or gets the table's error at its deadline; a
client with no timeout asks in slices and waits on; the engine's retries
take nothing; a dead client's request is dropped; other tables are served
meanwhile; the wait ends with a named error when the daemon stops or dies."""

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

import shmreplay
from conftest import SMALL_FIELDS
from idrows import FIELDS, rows
from items import TABLE, F, good_row, ids, insert_ids, table_stats
from readback import table_state
from shmreplay.wire.layout import TableMap
from waiting import HANG_S, all_threads_stopped, end_all, reap, wait_for, worker_context

CTX = worker_context()  # clean processes, as spawn's, started sooner
FORK = mp.get_context("fork")  # the blocked learner's


# ---- a parked request runs once it can, oldest first, or times out ----
def test_sample_blocks_until_min_size_reached(client, daemon):
    t = client.create_table("m", 100, F, min_size_to_sample=50)
    insert_ids(t, 0, 49)
    assert not t.can_sample(1)
    box = {}

    def learner():
        try:
            with daemon.connect() as c2:
                box["b"] = c2.table("m").sample(10, timeout=10 * HANG_S)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            box["error"] = exc

    th = threading.Thread(target=learner, daemon=True)
    th.start()

    def held_or_answered():
        st = table_stats(client, "m")
        return box or (st if st["limiter"]["waiting_samples"] == 1 else None)

    # the daemon holds the sample (or, wrongly, answers it)
    st = wait_for(held_or_answered, "the sample to wait in the daemon")
    assert not box, f"sample answered with {len(t)} < min_size_to_sample items: {box}"
    assert st["size"] == 49 and st["sample_waits"] >= 1, st
    insert_ids(t, 49, 50)
    th.join(HANG_S)
    assert not th.is_alive() and "error" not in box, box
    assert len(box["b"]) == 10
    assert t.can_sample(1)
    assert table_stats(client, "m")["limiter"]["waiting_samples"] == 0


def test_parked_samples_are_served_oldest_first(daemon, client):
    """Issue 13 item 4: requests a table's limits hold back are served in
    the order they parked.  Each item can be sampled once; two learners park
    on the empty table one after the other; one item arrives: the first
    learner gets it, the second keeps waiting for the next one."""
    t = client.create_table("o", 8, F, sampler="fifo", max_times_sampled=1)
    got: dict = {}

    def learner(name):
        with daemon.connect() as c:
            got[name] = ids(c.table("o").sample(1, timeout=HANG_S))

    threads = {}
    for k, name in enumerate(("first", "second")):
        threads[name] = threading.Thread(target=learner, args=(name,), daemon=True)
        threads[name].start()
        wait_for(lambda: client.stats()["tables"]["o"]["limiter"]["waiting_samples"] == k + 1,
                 f"the {name} learner to park")
    insert_ids(t, 0, 1)
    threads["first"].join(HANG_S)
    assert got == {"first": [0]}  # the older request took the one item
    assert client.stats()["tables"]["o"]["limiter"]["waiting_samples"] == 1
    insert_ids(t, 1, 2)
    threads["second"].join(HANG_S)
    assert got == {"first": [0], "second": [1]}


def test_sample_times_out_with_an_error_naming_the_limit(client):
    t = client.create_table("m", 100, F, min_size_to_sample=50)
    insert_ids(t, 0, 10)
    t0 = time.monotonic()
    with pytest.raises(shmreplay.RateLimited, match="fewer than min_size_to_sample 50"):
        t.sample(4, timeout=0.3)
    # the client raises only once its deadline has passed; the top is a hang guard
    assert 0.3 <= time.monotonic() - t0 < 30.0
    st = table_stats(client, "m")
    assert st["timeouts"] >= 1 and st["limiter"]["waiting_samples"] == 0 and len(t) == 10


def test_an_insert_waits_through_slices_while_every_slot_is_held(start_daemon):
    """Every slot reserved or held (a learner still reading its last sample of
    a queue) is a wait like the rate limiter's: ``timeout=None`` keeps waiting
    past the client's 1 s slices, a finite timeout ends in SlotsBusy.  A
    queue waits for held slots rather than evict an item not yet sampled."""
    daemon = start_daemon(seed=1234, hold_timeout_s=3600.0)  # the holds outlast any slow run
    client = daemon.connect()
    q = client.create_queue("q", 8, F)
    insert_ids(q, 0, 8)
    learner = daemon.connect()
    keys, _, _ = learner.table("q").sample_indices(2)  # 2 items leave; their slots are held
    assert len(q) == 6 and q.can_insert(2)  # the limiter would admit 2 more: only slots lack
    with pytest.raises(shmreplay.SlotsBusy, match="held by learners") as info:
        q.insert(v=100, timeout=0.2)
    assert isinstance(info.value, shmreplay.CapacityError)
    done, box = threading.Event(), {}

    def insert_forever():
        try:
            with daemon.connect() as c:
                c.table("q").insert(v=101)  # timeout=None
        except BaseException as exc:
            box["exc"] = exc
        finally:
            done.set()

    th = threading.Thread(target=insert_forever, daemon=True)
    th.start()
    base = table_stats(client, "q")["timeouts"]
    # one of its 1 s slices ran out in the daemon and the client asked again
    wait_for(lambda: (
        (st := table_stats(client, "q"))["timeouts"] > base
        and st["limiter"]["waiting_inserts"] == 1), "a slice of the waiting insert to run out and be asked again")
    assert not done.is_set(), box
    learner.table("q").release()  # the held slots come back
    assert done.wait(HANG_S) and "exc" not in box, box
    learner.close()
    assert len(q) == 7
    client.close()


# ---- meanwhile: retries take nothing, a dead waiter is dropped, other tables served ----
# A queue (client.create_queue: fifo, each item sampled once, one sample per
# insert) holds 3 items and is asked for 8: the rate limiter holds the
# sample back before anything is drawn.  A prioritized table whose items are
# sampled once holds 4 items, 2 of priority 0, and is asked for 3: the limits
# admit it (4 uses left, positive mass), the draw takes the 2 positive
# items out of the sum tree and then runs dry, so it must put them back.
BLOCKED = {
    "queue": dict(table={"name": "q", "capacity": 16, "sampler": "fifo", "remover": "fifo",
                         "max_times_sampled": 1, "samples_per_insert": 1.0,
                         "error_buffer": [0.0, 16.0], "fields": FIELDS},
                  prios=[1.0, 1.0, 1.0], ask=8, why="below min_diff",
                  then=[0, 1, 2]),  # in insertion order: every item, once
    "zero priority": dict(table={"name": "z", "capacity": 16, "sampler": "prioritized",
                                 "max_times_sampled": 1, "fields": FIELDS},
                          prios=[1.0, 1.0, 0.0, 0.0], ask=3, why="zero priority",
                          then=[0, 1]),  # the two that can be drawn, once each
}
WAIT_S = 2.0  # how long the blocked sample waits: the test takes that long, no assert depends on it


def untouched(c, segment: str, name: str) -> dict:
    """What a blocked sample must leave as it was: the table's counters in
    the daemon's stats, and per slot its state, stamp, priority and times
    sampled plus every live word, in the segment."""
    st = c.stats()["tables"][name]
    tm = TableMap.attach(segment)
    try:
        w = tm.words
        seg = {"state": tm.state.copy(),
               "words": [w.size, w.inserts, w.pending, w.samples, w.deletes, w.free, w.uses, w.mass]}
    finally:
        tm.release()
    lim = st["limiter"]  # less waiting_samples: that one is meant to move
    return {**{k: st[k] for k in ("size", "samples", "sample_calls", "held", "reserved",
                                  "removed_after_max_samples", "evictions")},
            **{f"limiter.{k}": lim[k] for k in ("inserts", "samples", "deletes", "pending", "uses_left")},
            **seg, **table_state(segment)}


def assert_untouched(now: dict, before: dict, when: str) -> None:
    assert now.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(now[k], before[k], err_msg=f"{k} {when}")


def blocked_learner(sock, table, n, timeout, out):
    """Sample n items, waiting at most ``timeout``; report the ids or the error."""
    with shmreplay.connect(sock, timeout=30) as c:
        try:
            out.put(("batch", c.table(table).sample(n, timeout=timeout).data["id"].tolist()))
        except shmreplay.ReplayError as exc:
            out.put((type(exc).__name__, str(exc)))


@pytest.mark.parametrize("case", list(BLOCKED))
def test_a_blocked_sample_takes_nothing(start_daemon, case):
    """A SAMPLE the table holds back is parked and retried by the engine
    until its timeout, then answered RateLimited; meanwhile and after, no
    item left the table, none counts a sample, no slot is held and no
    limiter counter moved; the items are then sampled as if it never was."""
    spec = BLOCKED[case]
    name = spec["table"]["name"]
    d = start_daemon(tables=[spec["table"]])
    segment = d.segment(name)
    with d.connect() as c:
        t = c.table(name)
        t.insert_batch(rows(np.arange(len(spec["prios"]))), priorities=spec["prios"])
        c.flush()
        before = untouched(c, segment, name)
        assert before["size"] == len(spec["prios"]) and before["held"] == 0
        out = FORK.Queue()
        p = FORK.Process(target=blocked_learner, args=(d.socket, name, spec["ask"], WAIT_S, out))
        p.start()
        try:
            # sample_waits counts parkings ever made: the wait cannot miss a
            # park that a loaded box let end before the first poll
            wait_for(lambda: c.stats()["tables"][name]["sample_waits"] >= 1, "the sample to park")
            # each stats call wakes the engine, and every pass of the engine
            # retries the parked sample: it has been refused again by now
            assert_untouched(untouched(c, segment, name), before, "while the sample is parked")
            got = out.get(timeout=HANG_S)
            p.join(HANG_S)
        finally:
            reap([p])
        assert got[0] == "RateLimited" and "timed out" in got[1] and spec["why"] in got[1], got
        assert_untouched(untouched(c, segment, name), before, "after the sample timed out")
        st = c.stats()["tables"][name]
        assert st["timeouts"] >= 1 and st["limiter"]["waiting_samples"] == 0, st
        b = t.sample(len(spec["then"]), timeout=0)  # runs at once: nothing is missing
        ids = b.data["id"].tolist()
        assert (ids if case == "queue" else sorted(ids)) == spec["then"]


def waiting_client(sock, what):
    with shmreplay.connect(sock) as c:
        t = c.table("w")
        if what == "sample":
            t.sample(8, timeout=None)
        else:
            t.insert(v=1, timeout=None)


def test_no_deadlock_when_clients_die_while_waiting(daemon, client):
    t = client.create_table("w", 100, F, min_size_to_sample=20, samples_per_insert=1.0,
                            error_buffer=(-5.0, 25.0))

    def limiter_shows(key, value):
        wait_for(lambda: table_stats(client, "w")["limiter"][key] == value, f"{key} to become {value}")

    def kill_while_parked(what, key):
        p = CTX.Process(target=waiting_client, args=(daemon.socket, what), daemon=True)
        try:
            p.start()
            limiter_shows(key, 1)
            os.kill(p.pid, signal.SIGKILL)
            p.join(HANG_S)
            assert p.exitcode == -signal.SIGKILL
            limiter_shows(key, 0)
        finally:
            end_all([p])

    insert_ids(t, 0, 10)   # below min size: a sample waits
    kill_while_parked("sample", "waiting_samples")
    insert_ids(t, 10, 25)  # 25 inserts x 1 - 0 samples = max_diff: an insert waits
    kill_while_parked("insert", "waiting_inserts")
    assert table_stats(client, "w")["limiter"]["pending"] == 0
    # everyone else carries on: a sample frees room, an insert goes through
    # (both can run at once; the timeouts only catch a hang)
    assert t.can_sample(4)
    assert len(t.sample(4, timeout=HANG_S)) == 4
    assert t.can_insert(1)
    t.insert(v=100, timeout=HANG_S)
    t.flush()
    assert len(t) == 26


def test_a_waiting_request_does_not_hold_up_other_tables(daemon, client):
    a = client.create_table("w", 100, F, min_size_to_sample=50)
    b = client.create_table("free", 100, F)
    insert_ids(b, 0, 10)
    box = {}

    def stuck():
        try:
            with daemon.connect() as c2:
                box["b"] = c2.table("w").sample(4, timeout=10 * HANG_S)  # until "w" holds 50
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            box["error"] = exc

    th = threading.Thread(target=stuck, daemon=True)
    th.start()

    def parked():
        """(parks so far, timeouts so far) while the sample on "w" is parked."""
        st = table_stats(client, "w")
        return (st["sample_waits"], st["timeouts"]) if st["limiter"]["waiting_samples"] == 1 else None

    # Round trips on "free" that all start and end inside one and the same
    # park of the sample on "w" (parked before and after, never re-parked):
    # the daemon served "free" while it held that request.  The client asks
    # for long waits in slices, so a run that straddles a slice is retried.
    deadline = time.monotonic() + HANG_S
    k = 10
    while True:
        before = wait_for(parked, "the sample on 'w' to wait in the daemon")
        for i in range(20):
            assert len(b.sample(8)) == 8
            insert_ids(b, k, k + 2)
            k += 2
        if parked() == before:
            break
        assert time.monotonic() < deadline, "no run of round trips fitted inside one wait"
    assert not box, box
    assert len(a) == 0
    insert_ids(a, 0, 50)  # now the waiting sample can run
    th.join(HANG_S)
    assert not th.is_alive() and "error" not in box, box
    assert len(box["b"]) == 4 and len(a) == 50


# ---- the wait ends when the daemon stops answering or dies ----
def test_a_parked_wait_notices_a_stopped_daemon_at_its_next_re_ask(start_daemon):
    """A sample parked with no timeout of its own asks the daemon for at
    most 1 s at a time and re-asks; a daemon that stops answering (SIGSTOP:
    its socket stays open, so only the missing answer can tell) is reported
    after that slice plus the client's timeout, instead of a hang."""
    d = start_daemon(tables=[TABLE])  # empty: the sample parks
    c = d.connect(timeout=1.0)
    t = c.table("cfg")
    out = {}

    def learner():
        try:
            t.sample(1, timeout=None)
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    th = threading.Thread(target=learner)
    th.start()
    try:
        with d.connect() as admin:
            wait_for(lambda: admin.stats()["tables"]["cfg"]["limiter"]["waiting_samples"] == 1,
                     "the sample to park")
        os.kill(d.pid, signal.SIGSTOP)
        wait_for(lambda: all_threads_stopped(d.pid), "the daemon to stop")
        th.join(HANG_S)
        assert not th.is_alive(), "the parked wait hung on a stopped daemon"
    finally:
        os.kill(d.pid, signal.SIGCONT)
        th.join(HANG_S)
    assert isinstance(out.get("error"), shmreplay.ReplayTimeout), out
    assert "did not answer within 1.0 s" in str(out["error"])
    c.close()


class CountingPoll:
    """The client's doorbell poller, recording the timeout of every wait."""

    def __init__(self, inner):
        self.inner, self.waits_ms = inner, []

    def poll(self, timeout_ms):
        self.waits_ms.append(timeout_ms)
        return self.inner.poll(timeout_ms)


def test_a_crash_is_noticed_within_one_50_ms_wait(start_daemon):
    """The documented ~50 ms: a client parked in a wait (timeout None) sleeps
    on its doorbell at most 50 ms at a time and checks the control socket
    after each sleep, so once the dead daemon's socket is closed it starts
    at most one more sleep before DaemonUnavailable.  Counted in sleeps, not
    measured in seconds, so a loaded machine cannot fail it."""
    d = start_daemon()
    c = d.connect(timeout=HANG_S)
    t = c.create_table("t", capacity=10, fields=SMALL_FIELDS)
    bell = c._session.pipe._bell = CountingPoll(c._session.pipe._bell)
    seen = {}

    def crash_once_parked():
        with d.connect() as admin:
            wait_for(lambda: admin.stats()["tables"]["t"]["limiter"]["waiting_samples"] == 1,
                     "the sample to park on the empty table")
        d.kill()  # returns once the process is reaped: its socket is closed
        seen["sleeps"] = len(bell.waits_ms)

    killer = threading.Thread(target=crash_once_parked)
    killer.start()
    with pytest.raises(shmreplay.DaemonUnavailable, match="closed the connection|went away"):
        t.sample(1, timeout=None)
    killer.join(HANG_S)
    assert not killer.is_alive()
    assert bell.waits_ms and max(bell.waits_ms) <= 50, "every sleep is at most 50 ms"
    assert len(bell.waits_ms) - seen["sleeps"] <= 1, bell.waits_ms
    with pytest.raises(shmreplay.DaemonUnavailable):
        t.insert(**good_row())
    c.close()
