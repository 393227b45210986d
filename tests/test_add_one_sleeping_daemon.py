"""What a one-item insert (``client.addone``'s kernel path) asks of a
sleeping daemon, which each test stops asleep (SIGSTOP) so that every
record it publishes sees it sleeping and nothing the daemon does can
answer for the client:

* the RESERVE a lease asks ahead rides with the lazy COMMITs (no bell of
  its own) while the lease outlasts the pipe's forced bell;
* a drawn-ahead SAMPLE's reply waits on the response ring while the loop
  inserts, and collecting it rings no bell.
"""

import os
import signal

import numpy as np

from shmreplay.client import pipe as pipemod
from shmreplay.client.lease import SlotLease
from waiting import stop_asleep, wait_for


def test_single_inserts_ask_for_the_next_lease_without_waking_a_sleeping_daemon(start_daemon, monkeypatch):
    """The RESERVE a lease asks ahead at half time rides with the lazy
    COMMITs when the lease outlasts the lazy bound (``LAZY_MAX`` records:
    a bell comes before the lease runs out), so single inserts wake a
    sleeping daemon only at that bound; a batch's ask-ahead still rings.
    The daemon is stopped asleep, so every publish sees it sleeping."""
    fields = {"obs": ("float32", (4,)), "action": ("int64", ())}
    d = start_daemon(tables=[{"name": "t", "capacity": 10000, "fields": fields}])  # leases of 39
    with d.connect() as c:
        t = c.table("t")
        obs = np.zeros(4, np.float32)
        t.insert(obs=obs, action=0)  # leases 39 slots (no flush: it would hand the rest back)
        ring = c._session.pipe.req
        stop_asleep(d.pid, lambda: int(ring.ctl[ring.sleeping_w]) != 0)
        try:
            bells, asking = [], []
            real_ring, real_ask = pipemod.ring_bell, SlotLease._ask_ahead

            def ring_bell(fd):
                bells.append(bool(asking))
                real_ring(fd)

            def ask_ahead(self, *args):
                asking.append(1)
                try:
                    return real_ask(self, *args)
                finally:
                    asking.pop()
            monkeypatch.setattr(pipemod, "ring_bell", ring_bell)
            monkeypatch.setattr(SlotLease, "_ask_ahead", ask_ahead)
            for i in range(1, 30):  # past half the lease: the ask-ahead is sent
                t.insert(obs=obs, action=i)
            assert t._lease.ahead is not None
            assert bells and not any(bells)  # the LAZY_MAX bell only, none for the RESERVE
        finally:
            os.kill(d.pid, signal.SIGCONT)
        c.flush()
        assert c.stats()["tables"]["t"]["size"] == 30


def test_a_reply_already_there_is_collected_without_waking_the_daemon(start_daemon, monkeypatch):
    """A drawn-ahead SAMPLE's reply waits in the response ring while the
    loop inserts (the kernel leaves answers for the call that waits for
    them), and collecting it rings no bell, although lazy COMMITs are owed
    to the sleeping daemon: the reply needs none of them.  The daemon is
    stopped asleep, so nothing it does can answer for the client."""
    fields = {"obs": ("float32", (4,)), "action": ("int64", ())}
    d = start_daemon(tables=[{"name": "t", "capacity": 10000, "fields": fields}])
    with d.connect() as c:
        t = c.table("t")
        obs = np.zeros(4, np.float32)
        for i in range(5):  # into a lease of 39 slots (no flush: it would hand the rest back)
            t.insert(obs=obs, action=i)
        ticket = t.begin_sample(4, 0.0, 10.0)  # after the COMMITs: the daemon applies them first
        pipe = c._session.pipe
        wait_for(pipe.resp.has_pending, "the SAMPLE's reply")
        ring = pipe.req
        stop_asleep(d.pid, lambda: int(ring.ctl[ring.sleeping_w]) != 0)
        try:
            bells = []
            real_ring = pipemod.ring_bell
            monkeypatch.setattr(pipemod, "ring_bell", lambda fd: (bells.append(fd), real_ring(fd)))
            t.insert(obs=obs, action=5)  # lazy: owed to the sleeping daemon
            t.insert(obs=obs, action=6)
            assert pipe.resp.has_pending() and pipe.owed_bell  # the answer is still in the ring
            batch = t.finish_sample(ticket, 4, 0.0, None, 10.0)
            assert bells == []
            assert set(batch.data["action"].tolist()) <= set(range(5))
        finally:
            os.kill(d.pid, signal.SIGCONT)
        c.flush()
        assert c.stats()["tables"]["t"]["size"] == 7
