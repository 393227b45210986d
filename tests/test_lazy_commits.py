"""``Client.lazy_commits`` (the default): a COMMIT that does not wake a
sleeping daemon, unless it sleeps with requests parked.  What it must keep: every row arrives, in
order, and becomes sampleable without any further request from its writer
(at the daemon's next wake, its idle timeout at the latest); a writer never
waits on a daemon that sleeps on records nobody announced."""

import os
import signal
import threading

import numpy as np

import shmreplay
from shmreplay.wire import atomics
from shmreplay.wire.channel import ASLEEP_WAITING, CTL_EAGER
from waiting import HANG_S, wait_for

FIELDS = {"x": ("int64", ())}


def test_lazy_commits_arrive_whole_and_in_order_through_a_full_command_ring(start_daemon):
    """More single-row commits than the command ring holds (256), with the
    daemon asleep between them: the writer wakes it when the ring is full
    instead of waiting for room that never comes."""
    d = start_daemon(tables=[{"name": "t", "capacity": 300_000, "fields": FIELDS}])
    c = d.connect()
    c.lazy_commits = True
    assert c.lazy_commits
    t = c.table("t")
    for i in range(2000):  # a lease of 1,171 slots: hundreds of commits between two RESERVEs
        t.insert(x=np.int64(i))
    c.flush()
    assert len(t) == 2000
    from readback import committed  # every item in commit order
    got, _ = committed(t)
    np.testing.assert_array_equal(got["x"], np.arange(2000))
    c.close()


def test_lazy_commits_leave_a_sleeping_daemon_asleep_up_to_lazy_max_in_a_row(start_daemon):
    """The promise itself (docs/protocol.md, "Waking"): a client with
    ``lazy_commits`` set does not write the daemon's doorbell for its
    COMMITs, ``LAZY_MAX`` in a row; the one after rings it.  The daemon
    never spins (``spin_us`` 0: it sleeps as soon as a pass finds nothing
    to do) and its idle timeout is an hour, so between the looks below only
    a doorbell could wake it; the stats count the wakes a client's doorbell
    ended apart from the control plane's bell (``client_wakeups``,
    docs/operations.md), which the stats call itself and the monitor's
    once-a-second look ring.  ``LAZY_MAX`` single-row commits into a lease
    reserved before the first look add no client wake; the next one adds
    one, and that wake applies them all, in order, with no request of the
    writer."""
    from shmreplay.client.pipe import LAZY_MAX
    d = start_daemon(tables=[{"name": "t", "capacity": 256_000, "fields": FIELDS}],
                     spin_us=0, idle_timeout_s=3600)
    c = d.connect()
    c.lazy_commits = True
    t = c.table("t")
    t.insert(x=np.int64(0))  # reserves a lease of 1,000 slots (capacity / 256); the flushes
    # below keep it: no RESERVE in the attempts
    req = c._session.pipe.req  # the request ring's word the daemon sets when it sleeps
    asleep = lambda: atomics.load(req.ctl, req.sleeping_w)  # noqa: E731
    x = 1
    # the monitor's once-a-second look wakes the daemon too: a commit that
    # meets it awake rings nothing and starts the count again (the daemon
    # reads it then), and a ring owed just then is not owed any more.  An
    # attempt such a wake met is made again: a client that never rang
    # fails every attempt
    for _attempt in range(5):
        c.flush(keep_leases=True)  # no commit left unannounced: the count starts at 0
        before = c.stats()["engine"]["client_wakeups"]
        for _ in range(LAZY_MAX):  # of 1,000 slots: the next reservation is asked ahead at half only
            # each commit is published to a daemon known asleep (one still awake
            # from the look before would read it without any bell, and a bell
            # rung for it would go unseen): a bell rung anyway is counted
            wait_for(asleep, "the daemon to sleep")
            t.insert(x=np.int64(x))
            x += 1
        assert c.stats()["engine"]["client_wakeups"] == before
        wait_for(asleep, "the daemon to sleep")  # (the stats call's wake applied the commits)
        t.insert(x=np.int64(x))  # one past LAZY_MAX in a row: rings
        x += 1
        wait_for(lambda: len(t) == x, "the commits to be applied at that wake")
        if c.stats()["engine"]["client_wakeups"] == before + 1:
            break
    else:
        raise AssertionError("the commit after LAZY_MAX lazy ones in a row never rang the daemon's doorbell")
    from readback import committed
    got, _ = committed(t)
    np.testing.assert_array_equal(got["x"], np.arange(x))
    c.close()


def test_a_lazy_commit_becomes_sampleable_without_another_request(start_daemon):
    """The writer inserts and asks nothing more: the daemon's next wake (its
    idle timeout here, 0.2 s) applies the commit."""
    d = start_daemon(tables=[{"name": "t", "capacity": 1000, "fields": FIELDS}], idle_timeout_s=0.2)
    c = d.connect()
    c.lazy_commits = True
    t = c.table("t")
    t.insert_batch({"x": np.arange(10, dtype=np.int64)})
    wait_for(lambda: len(t) == 10, "the lazy commit to be applied")
    with d.connect() as other:  # a learner elsewhere samples them
        o = other.table("t")
        assert len(o) == 10 and set(o.sample(100).data["x"].tolist()) <= set(range(10))
    c.close()


def test_lazy_commits_is_kept_across_a_fork(start_daemon):
    import os
    d = start_daemon(tables=[{"name": "t", "capacity": 1000, "fields": FIELDS}])
    c = shmreplay.connect(d.socket)
    c.lazy_commits = True
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child's own connection keeps the setting
        try:
            t = c.table("t")
            t.insert(x=np.int64(7))
            c.flush()
            os.write(w, b"1" if c.lazy_commits else b"0")
        finally:
            os._exit(0)
    os.close(w)
    assert os.read(r, 1) == b"1"
    os.waitpid(pid, 0)
    assert len(c.table("t")) == 1
    c.close()


def test_a_lease_renewed_lazily_keeps_every_row_in_order(start_daemon):
    """Batches into a lease that asks for its next reservation ahead, lazily
    (CommandPipe.send's wake=False): the next batch that needs it collects
    that reply, and every row arrives once, in order.  (That the wait rings
    the daemon first, instead of waiting for its next wake, is a matter of
    latency, which no test here times.)"""
    d = start_daemon(tables=[{"name": "t", "capacity": 20_000, "fields": FIELDS}])  # leases of 78
    c = d.connect()
    c.lazy_commits = True
    t = c.table("t")
    for i in range(200):  # ~330 reservations, each asked ahead while the last one runs
        t.insert_batch({"x": np.arange(i * 50, (i + 1) * 50, dtype=np.int64)})
        if i % 16 == 15:
            c.flush(keep_leases=True)
    c.flush()
    from readback import committed
    got, _ = committed(t)
    np.testing.assert_array_equal(got["x"], np.arange(10_000))
    c.close()


def test_commits_are_lazy_by_default_yet_wake_a_daemon_asleep_on_a_parked_sample(start_daemon):
    """A learner's sample waits (parked) for the table to reach
    ``min_size_to_sample``; the daemon never spins and its idle timeout is
    an hour.  A writer with the default setting commits the missing items
    and asks nothing more.  The daemon's sleeping word says requests are
    parked, so those commits ring its doorbell (``client_wakeups`` counts
    the wakes a client's doorbell ended; the control plane's bell, which
    the monitor rings once a second, is not counted) and the sample is
    answered.  Each commit is published to a daemon known asleep so; left
    lazy regardless (the commits ring nothing), only the monitor's wake
    would apply them and no client wake-up would be counted."""
    d = start_daemon(tables=[{"name": "t", "capacity": 1000, "fields": FIELDS,
                              "sampler": "uniform", "min_size_to_sample": 4}],
                     spin_us=0, learner_spin_us=0, idle_timeout_s=3600)
    c = d.connect()
    assert c.lazy_commits  # the default
    t = c.table("t")
    t.insert(x=np.int64(0))
    c.flush(keep_leases=True)  # one item, and a lease for the rest: no RESERVE below
    got = {}
    with d.connect() as learner:
        def sample():
            got["x"] = learner.table("t").sample(2, timeout=HANG_S).data["x"].tolist()
        th = threading.Thread(target=sample)
        th.start()
        req = c._session.pipe.req  # the word the daemon sets in this writer's ring when it sleeps
        asleep_waiting = lambda: atomics.load(req.ctl, req.sleeping_w) == ASLEEP_WAITING  # noqa: E731
        wait_for(asleep_waiting, "the daemon to sleep with the sample parked")
        before = c.stats()["engine"]["client_wakeups"]
        for i in range(1, 4):
            wait_for(asleep_waiting, "the daemon to sleep with the sample parked")
            t.insert(x=np.int64(i))
        th.join(HANG_S)
        assert not th.is_alive(), "the parked sample was never answered"
        assert c.stats()["engine"]["client_wakeups"] > before, "no commit woke the daemon"
    assert set(got["x"]) <= {0, 1, 2, 3}
    c.close()


def test_a_killed_writers_published_commits_are_kept(start_daemon):
    """A writer publishes lazy commits to a sleeping daemon and is killed
    before anything wakes it.  The detach the control plane queues applies
    what the writer's ring still holds before it reclaims the lease, so the
    whole items the writer committed are kept."""
    d = start_daemon(tables=[{"name": "t", "capacity": 1000, "fields": FIELDS}],
                     spin_us=0, learner_spin_us=0, idle_timeout_s=3600)
    c = d.connect()
    pid = os.fork()
    if pid == 0:
        try:
            w = shmreplay.connect(d.socket)
            t = w.table("t")
            t.insert(x=np.int64(0))
            w.flush(keep_leases=True)
            req = w._session.pipe.req
            for i in range(1, 6):
                wait_for(lambda: atomics.load(req.ctl, req.sleeping_w), "the daemon to sleep")
                t.insert(x=np.int64(i))
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    t = c.table("t")
    wait_for(lambda: c.stats()["clients"] == 1, "the daemon to drop the killed writer")
    from readback import committed
    got, _ = committed(t)
    np.testing.assert_array_equal(got["x"], np.arange(6))
    c.close()


def test_turning_lazy_commits_off_tells_a_daemon_that_is_up_too(start_daemon):
    """``lazy_commits = False`` sets the channel's eager word (a daemon that
    is up then serves every COMMIT at once, ``Ring.wants_service``), back
    to 0 when turned on again, and the setting holds for a new pipe."""
    d = start_daemon(tables=[{"name": "t", "capacity": 1000, "fields": FIELDS}])
    with d.connect() as c:
        assert int(c._session.pipe.req.ctl[CTL_EAGER]) == 0
        c.lazy_commits = False
        assert int(c._session.pipe.req.ctl[CTL_EAGER]) == 1
        t = c.table("t")
        t.insert(x=np.int64(5))
        wait_for(lambda: len(t) == 1, "the eager commit to be applied")
        c.lazy_commits = True
        assert int(c._session.pipe.req.ctl[CTL_EAGER]) == 0
        c.lazy_commits = False
    with d.connect() as c2:  # a new client starts lazy
        assert int(c2._session.pipe.req.ctl[CTL_EAGER]) == 0
