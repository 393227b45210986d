"""``Client.lazy_commits``: a COMMIT that does not wake a sleeping daemon
(the Ray ingest's setting).  What it must keep: every row arrives, in
order, and becomes sampleable without any further request from its writer
(at the daemon's next wake, its idle timeout at the latest); a writer never
waits on a daemon that sleeps on records nobody announced."""

import numpy as np

import shmreplay
from waiting import wait_for

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
