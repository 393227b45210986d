"""Issue 21, item 2: reservations are bounded and expire.

A client holds at most a quarter of a table's slots reserved (64 leases'
worth, or 64 of a small table), a user other than the daemon's at most a
quarter over all its connections: a member who reserves and never commits
takes no table from its owner.  A reservation not committed within
``reservation_timeout_s`` is void: its slots stay out of use until its
writer lets go of them (a late copy tears nothing), and its writer loses
only its own items, told so at its next call or flush."""

import multiprocessing as mp
import os

import numpy as np
import pytest

import shmreplay
from shmreplay.wire.layout import RESERVED

from faults import FIELDS, HANG_S, committed_ids, rows, wait_for
from people import GROUP, MEMBER, needs_root, shared_start, users  # noqa: F401 (fixtures)
from rawclient import commit, reserve

CAP = 256  # of a table of 1,024: a quarter


def table_stats(c, name="t") -> dict:
    return c.stats()["tables"][name]


def become(ident) -> None:
    uid, gid, groups = ident
    os.setgroups(groups)
    os.setgid(gid)
    os.setuid(uid)


def hog(ident, sock, connections, got, done):
    """A member's process: reserve all it can of table t on several
    connections, never commit, and stay connected until ``done``."""
    become(ident)
    clients = [shmreplay.connect(sock, timeout=HANG_S) for _ in range(connections)]
    n = 0
    for i, c in enumerate(clients):
        t = c.table("t")
        while True:
            try:  # the later ones ask to wait: at a cap they must be refused at once, not parked
                n += reserve(t, 1024, wait_s=0 if i == 0 else 10 * HANG_S)[2].shape[0]
            except shmreplay.CapacityError as exc:  # its client's cap, or the user's (SlotsBusy)
                got.put(("refused", type(exc).__name__, str(exc)))
                break
    got.put(("reserved", n))
    done.wait(10 * HANG_S)
    for c in clients:
        c.close()


@pytest.fixture
def shared_daemon(shared_start):
    return shared_start(tables=[{"name": "t", "capacity": 1024, "fields": FIELDS}],
                        allowed_groups=[GROUP])


@needs_root
def test_a_member_cannot_reserve_an_owners_table_away(shared_daemon, users):
    d = shared_daemon
    with d.connect() as owner:
        t = owner.table("t")
        t.insert_batch(rows(np.arange(1024)))
        owner.flush()
        ctx = mp.get_context("fork")
        got, done = ctx.Queue(), ctx.Event()
        p = ctx.Process(target=hog, args=(users[MEMBER], d.socket, 4, got, done))
        p.start()
        try:
            msgs = [got.get(timeout=HANG_S) for _ in range(5)]
            assert msgs[-1] == ("reserved", CAP), msgs
            # its first client hit its own cap, the others the user's
            assert msgs[0][1] == "CapacityError" and "this client holds 256 reserved" in msgs[0][2]
            assert all(m[1] == "SlotsBusy" and f"user {users[MEMBER][0]} holds 256" in m[2]
                       for m in msgs[1:4]), msgs
            st = table_stats(owner)
            assert st["reserved"] == CAP and st["size"] == 1024 - CAP  # it evicted its share, no more
            # the owner inserts and samples as ever, waiting for nothing
            t.insert_batch(rows(np.arange(2000, 2500)), timeout=5)
            owner.flush()
            assert len(t) == 1024 - CAP and len(t.sample(256, timeout=5)) == 256
        finally:
            done.set()
            p.join(HANG_S)
            p.kill() if p.is_alive() else None
        wait_for(lambda: table_stats(owner)["reserved"] == 0, "the member's lease to end")


def test_a_writer_stalled_past_the_deadline_loses_only_its_own_items(start_daemon):
    """A writer leases slots, then stalls past reservation_timeout_s: the
    daemon voids the reservation, other writers go on and never get its
    slots, its late copy tears no committed row, and its commit is refused:
    its next flush says so, then it inserts as before."""
    d = start_daemon(tables=[{"name": "t", "capacity": 256, "fields": FIELDS}],
                     reservation_timeout_s=3.0)  # a loaded box may stall a writer 0.5 s
    with d.connect() as slow, d.connect() as other:
        s = slow.table("t")
        rid, _, slots = reserve(s, 16)
        seg = d.segment("t")
        wait_for(lambda: table_stats(other)["voided"] == 16, "the daemon to void the reservation")
        gens = s._map.gens[slots].copy()
        o = other.table("t")
        for lo in range(0, 1024, 64):  # four times around the table: its free slots only
            o.insert_batch(rows(np.arange(lo, lo + 64)))
        other.flush()
        st = table_stats(other)
        assert st["voided"] == 16 and st["reserved"] == 16 and st["size"] == 256 - 16
        tm = s._map
        assert np.all(tm.state[slots] == RESERVED) and np.array_equal(tm.gens[slots], gens)
        # the late copy, then the commit the daemon refuses
        for view, a in zip((tm.fields["obs"], tm.fields["id"]), (rows(np.full(16, 7))["obs"], 7)):
            view[slots] = a
        commit(s, rid, 16)
        with pytest.raises(shmreplay.ReservationExpired, match="16 items were not stored"):
            slow.flush()
        found = committed_ids(seg)  # asserts no committed row is torn
        assert 7 not in found.tolist() and len(found) == 256 - 16
        assert table_stats(other)["reserved"] == 0 and table_stats(other)["voided_reserved_slots"] == 16
        s.insert_batch(rows(np.arange(5000, 5010)))  # and it inserts as before
        slow.flush()
        assert set(range(5000, 5010)) <= set(committed_ids(seg).tolist())


def test_an_insert_after_a_stall_reports_the_loss_once_and_then_inserts(start_daemon):
    """The same through the client API: a table's own lease holds slots
    reserved ahead; past the deadline, inserts into them are refused and
    reported by the next flush, once; the lease is handed back, and the
    next inserts go into a new reservation."""
    d = start_daemon(tables=[{"name": "t", "capacity": 4096, "fields": FIELDS}],
                     reservation_timeout_s=3.0)  # a loaded box may stall a writer 0.5 s
    with d.connect() as c:
        t = c.table("t")
        t.insert_batch(rows(np.arange(3)))  # leases 16 slots, 3 of them used
        wait_for(lambda: table_stats(c)["voided"] > 0, "the daemon to void the lease")
        t.insert_batch(rows(np.arange(3, 6)))  # into the void lease
        with pytest.raises(shmreplay.ReservationExpired, match="3 items were not stored"):
            c.flush()
        t.insert_batch(rows(np.arange(6, 9)))
        c.flush()  # nothing more to report
        assert sorted(committed_ids(d.segment("t")).tolist()) == [0, 1, 2, 6, 7, 8]
        assert table_stats(c)["voided"] == 0
