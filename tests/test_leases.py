"""Slot leases: writers reserve slots ahead and commit them in parts, so
inserts do not wait for the daemon."""

import os
import signal
import time

import numpy as np
import pytest

import shmreplay
from shmreplay.wire import records as R
from readback import committed
from waiting import HANG_S, wait_for, worker_context

FIELDS = {"v": ("int64", ()), "w": ("float32", (3,))}


def stats(c, name="big"):
    return c.stats()["tables"][name]


def in_forked_child(fn) -> int:
    """Run ``fn()`` in a forked child; its exit code (0: it returned)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def test_single_inserts_share_a_few_reservations(client):
    t = client.create_table("big", capacity=100_000, fields=FIELDS)
    lease = t.lease_size
    assert lease == 100_000 // 256
    for i in range(2000):
        t.insert(v=i, w=np.full(3, i, np.float32))
    t.flush()
    st = stats(client)
    assert st["inserts"] == 2000 and len(t) == 2000
    assert st["reservations"] <= 2000 // lease + 2, "one RESERVE per lease, not per insert"
    assert st["reserved"] == 0, "flush hands unused leased slots back"
    got, _ = committed(t)  # every insert once, in the order made
    np.testing.assert_array_equal(got["v"], np.arange(2000))
    np.testing.assert_array_equal(got["w"], np.repeat(np.arange(2000, dtype=np.float32)[:, None], 3, axis=1))


NSTEP = {"obs": ("float32", (2,)), "action": ("int32", ()), "reward": ("float32", ()),
         "discount": ("float32", ()), "next_obs": ("float32", (2,))}


def test_a_writer_holds_at_most_two_leases(client):
    """table.py: a writer withholds at most two leases (the one it fills and
    the one asked for at half time) from sampling, for plain inserts and for
    a writer whose items stay open across calls alike."""
    t = client.create_table("big", capacity=256 * 16, fields=FIELDS)
    n = client.create_table("n", capacity=256 * 16, fields=NSTEP)
    assert t.lease_size == n.lease_size == 16
    peaks = {}
    for i in range(160):
        t.insert(v=i, w=np.full(3, i, np.float32))
        peaks["big"] = max(peaks.get("big", 0), stats(client)["reserved"])
    with shmreplay.NStepWriter(n, n=3, gamma=0.9) as w:
        for i in range(160):
            w.append(obs=[i, i], action=i, reward=1.0, next_obs=[i + 1, i + 1], terminated=i % 40 == 39)
            peaks["n"] = max(peaks.get("n", 0), stats(client, "n")["reserved"])
    client.flush()
    for name in ("big", "n"):
        st = stats(client, name)
        assert st["reservations"] >= 160 // 16, "leases were taken in turn"
        assert 0 < peaks[name] <= 2 * 16, (name, peaks[name])  # how close to 32 depends on timing
        assert st["reserved"] == 0
    assert len(t) == 160 and len(n) == 160


def test_the_next_lease_is_asked_for_before_the_rows_that_use_up_this_one_are_copied(client):
    """lease.py: a writer whose call uses up its lease (a 1,000-item table's
    16 slots, 16 rows a call) sends the RESERVE for the next one before it
    copies the rows, so the daemon reserves while they go in and the next
    call finds the reply there (issue 36: flat-out actors of a small table
    waited for it every call)."""
    t = client.create_table("small", capacity=1000, fields=FIELDS)
    assert t.lease_size == 16
    pipe = client._session.pipe
    sent, send = [], pipe.send

    def recording(put, *args, **kw):
        sent.append(put)
        return send(put, *args, **kw)

    pipe.send = recording
    calls = []
    try:
        for i in range(4):
            del sent[:]
            v = np.arange(16 * i, 16 * (i + 1))
            t.insert_batch({"v": v, "w": np.repeat(v[:, None], 3, axis=1).astype(np.float32)})
            calls.append([{R.put_reserve: "reserve", R.put_commit: "commit"}.get(p, p.__name__)
                          for p in sent])
    finally:
        pipe.send = send
    assert calls[0] == ["reserve", "reserve", "commit"], calls  # its own lease, then the next
    assert calls[1:] == [["reserve", "commit"]] * 3, calls
    t.flush()
    got, _ = committed(t)
    np.testing.assert_array_equal(np.sort(got["v"]), np.arange(64))


def test_batches_span_lease_boundaries_in_order(client):
    t = client.create_table("big", capacity=10_000, fields=FIELDS, sampler="uniform")
    n = 0
    for k in [7, 30, 1, 39, 39, 39, 5, 100, 3]:  # lease of 39 slots: parts straddle leases
        v = np.arange(n, n + k)
        t.insert_batch({"v": v, "w": np.repeat(v[:, None], 3, axis=1).astype(np.float32)})
        n += k
    t.flush()
    assert len(t) == n and stats(client)["reserved"] == 0
    got, _ = committed(t)  # commit order is insert order, across every lease boundary
    np.testing.assert_array_equal(got["v"], np.arange(n))
    np.testing.assert_array_equal(got["w"], np.repeat(np.arange(n, dtype=np.float32)[:, None], 3, axis=1))


def test_leases_do_not_cross_a_fork(client):
    t = client.create_table("big", capacity=10_000, fields=FIELDS)
    t.insert(v=1, w=np.ones(3, np.float32))  # the parent now holds a lease
    assert t._lease.cur is not None

    def child():
        t.insert(v=2, w=np.ones(3, np.float32))
        t.flush()

    assert in_forked_child(child) == 0
    t.insert(v=3, w=np.ones(3, np.float32))
    t.flush()
    assert len(t) == 3


NSTEP = {"obs": ("float32", (2,)), "action": ("int32", ()), "reward": ("float32", ()),
         "discount": ("float32", ()), "next_obs": ("float32", (2,))}


def test_a_forked_child_closing_a_writer_leaves_the_parents_lease_alone(client):
    """The child inherits the writer and its lease, but the reservation ids
    and the channel are the parent's: closing the writer in the child must
    send nothing on them (it would abort the parent's open transitions)."""
    t = client.create_table("n", capacity=10_000, fields=NSTEP)
    w = shmreplay.NStepWriter(t, n=3, gamma=0.5)
    step = dict(obs=[0, 0], action=0, reward=1.0, next_obs=[1, 1])
    w.append(**step)
    w.append(**step)  # two transitions open in the parent's lease
    assert in_forked_child(w.close) == 0
    for _ in range(3):
        w.append(**step)  # completes the parent's open transitions
    t.flush()
    assert len(t) == 3
    w.close()


def hold_a_lease(sock, ready):
    c = shmreplay.connect(sock)
    t = c.table("big")
    t.insert(v=1, w=np.ones(3, np.float32))
    ready.set()
    time.sleep(60)


def test_a_killed_writers_lease_is_reclaimed(daemon, client):
    t = client.create_table("big", capacity=10_000, fields=FIELDS)
    ctx = worker_context()
    ready = ctx.Event()
    p = ctx.Process(target=hold_a_lease, args=(daemon.socket, ready))
    p.start()
    try:
        assert ready.wait(HANG_S)
        wait_for(lambda: stats(client)["inserts"] == 1, "the writer's streamed commit")
        # one lease of capacity/256 slots, one of them committed
        assert stats(client)["reserved"] == t.lease_size - 1 == 38
        os.kill(p.pid, signal.SIGKILL)
        p.join(HANG_S)
    finally:
        if p.is_alive():
            p.kill()
    wait_for(lambda: stats(client)["reserved"] == 0, "the dead writer's lease to be reclaimed")
    assert stats(client)["reclaimed_reservations"] == t.lease_size - 1
    got, _ = committed(t)
    assert len(t) == 1 and got["v"].tolist() == [1]


def test_a_widened_lease_reserves_for_many_batches_at_once(client):
    """Table.widen_lease (the Ray ingest's): 64-row batches into a table
    whose default lease (capacity/256 = 78) fits one batch need a
    reservation nearly every call; widened, one per eight batches.  Bounded
    by a 32nd of the capacity; a rate-limited table keeps its lease."""
    t = client.create_table("big", capacity=20_000, fields=FIELDS)
    assert t.lease_size == 78
    assert t.widen_lease(10) == 78  # never below the default
    assert t.widen_lease(10**6) == 20_000 // 32
    assert t.widen_lease(512) == 512
    for i in range(40):
        t.insert_batch({"v": np.arange(i * 64, (i + 1) * 64), "w": np.zeros((64, 3), np.float32)})
    t.flush()
    st = stats(client)
    assert st["inserts"] == 2560 and st["reservations"] <= 2560 // 512 + 2
    got, _ = committed(t)
    np.testing.assert_array_equal(got["v"], np.arange(2560))
    q = client.create_table("q", capacity=20_000, fields=FIELDS, samples_per_insert=1.0,
                            min_size_to_sample=1, error_buffer=100)
    assert q.widen_lease(512) == q.lease_size == 16
    with pytest.raises(shmreplay.ReplayError, match="widen_lease takes"):
        t.widen_lease(-1)
