"""Promise 2: SIGKILL the daemon under load, start it again with the same
config: every item a flush vouched for is still there, untorn, sampleable,
with its priority; clients learn of the crash promptly and reconnect."""

import multiprocessing as mp
import os
import threading
import time

import numpy as np
import pytest

import shmreplay
from shmreplay.wire.headers import LAYOUT_VERSION
from shmreplay.wire.layout import COMMITTED, TableMap
from shmreplay.wire.records import key_slots

from faults import (FIELDS, HANG_S, reap, actor, committed_ids, learner, rows, segment_rows, torn,
                    wait_for, writable_map)

CAPACITY = 1 << 17  # larger than everything the test inserts: nothing is evicted
TABLES = [{"name": "per", "capacity": CAPACITY, "sampler": "prioritized", "alpha": 0.7,
           "fields": FIELDS},
          {"name": "fifo", "capacity": 1024, "sampler": "fifo", "fields": FIELDS}]
ACTORS = (1, 2)
RESTARTS = 3
# items each actor inserts per connection at most: with RESTARTS + 1
# connections each, all of them fit in CAPACITY however long the run takes
ACTOR_BUDGET = CAPACITY // (2 * len(ACTORS) * (RESTARTS + 1))
PROGRESS = 64  # items each actor must commit, per daemon, before it is killed


def _per_actor(ids: np.ndarray) -> dict:
    return {k: int(np.count_nonzero((ids >> 40) == k)) for k in ACTORS}


def wait_until_all_carry_on(admin, segment: str, workers: int, since: dict) -> None:
    """Every worker is attached to this daemon, each actor has committed
    PROGRESS items more than ``since`` (its count when this daemon started,
    read while no daemon ran) and the learner samples: all of them
    reconnected (if this daemon is a restarted one) and work."""
    wait_for(lambda: admin.stats()["clients"] == 1 + workers, f"{workers} workers to attach")
    samples = admin.stats()["tables"]["per"]["samples"]

    def moved():
        now = _per_actor(committed_ids(segment))
        return (all(now[k] >= since[k] + PROGRESS for k in ACTORS)
                and admin.stats()["tables"]["per"]["samples"] > samples)
    wait_for(moved, "every actor to commit and the learner to sample", poll=0.05)


def test_sigkill_under_load_loses_nothing_committed(start_daemon, capsys):
    d = start_daemon(tables=TABLES)
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=actor, args=(d.socket, "per", k << 40, stop, out, 64, 0.002, ACTOR_BUDGET),
                         daemon=True) for k in ACTORS]
    procs.append(ctx.Process(target=learner, args=(d.socket, "per", stop, out), daemon=True))
    for p in procs:
        p.start()
    segment = d.segment("per")
    figures = []
    since = {k: 0 for k in ACTORS}  # each actor's committed items when the daemon started
    try:
        for restart in range(RESTARTS):
            admin = d.connect(timeout=30)
            wait_until_all_carry_on(admin, segment, len(procs), since)
            # a client parked in a wait must hear of the crash, not hang
            waiter = d.connect(timeout=30)
            name = f"empty{restart}"
            empty = waiter.create_table(name, capacity=4, fields=FIELDS)
            caught = {}

            def wait_forever():
                t0 = time.monotonic()
                try:
                    empty.sample(1)  # timeout=None: waits until told otherwise
                except BaseException as exc:
                    caught["exc"], caught["after_s"] = exc, time.monotonic() - t0
            th = threading.Thread(target=wait_forever, daemon=True)
            th.start()
            wait_for(lambda: admin.stats()["tables"][name]["limiter"]["waiting_samples"] == 1,
                     "the waiter's sample to park")
            before = len(committed_ids(segment))
            d.crash()
            killed_at = time.monotonic()
            th.join(HANG_S)
            assert not th.is_alive(), "a waiting sample hung after the daemon died"
            assert isinstance(caught["exc"], shmreplay.DaemonUnavailable), caught
            noticed_s = time.monotonic() - killed_at
            waiter._session.abandon()
            admin._session.abandon()
            frozen = committed_ids(segment)  # no daemon runs: nothing changes it now
            since = _per_actor(frozen)
            d.start()
            found = committed_ids(segment)
            assert len(found) >= before  # nothing committed went missing across the restart
            assert np.setdiff1d(frozen, found).shape[0] == 0
            figures.append((restart, before, len(found), round(noticed_s, 2)))
        with d.connect(timeout=30) as admin:  # the clients reconnect and carry on
            wait_until_all_carry_on(admin, segment, len(procs), since)
        stop.set()
        results = [out.get(timeout=HANG_S) for _ in procs]
        for p in procs:
            p.join(30)
    finally:
        stop.set()
        reap(procs)
    actors = [r for r in results if r[0] == "actor"]
    (lrn,) = [r for r in results if r[0] == "learner"]
    confirmed = np.sort(np.concatenate([np.asarray(r[2], np.int64) for r in actors]))
    found = committed_ids(segment)
    assert segment_rows(segment)[1] == 0, "items were evicted: the actors' budgets exceed CAPACITY"
    missing = np.setdiff1d(confirmed, found)
    assert missing.shape[0] == 0, f"{missing.shape[0]} confirmed items lost, e.g. {missing[:5]}"
    assert all(r[4] == RESTARTS for r in actors), [r[4] for r in actors]  # each rode out 3 restarts
    # no flush vouched for inserts a restart may have lost (each was owed a "may be lost")
    assert all(r[6] == 0 for r in actors), [r[6] for r in actors]
    assert lrn[3] == 0, f"the learner sampled {lrn[3]} torn rows"
    assert lrn[2] > 0 and lrn[4] == RESTARTS
    # the clients kept working after the last restart
    with d.connect() as c:
        st = c.stats()["tables"]["per"]
        assert st["inserts"] > 0 and st["samples"] > 0
    with capsys.disabled():
        print(f"\n[restart figures] (restart, committed before kill, found after, "
              f"waiter noticed in s): {figures}; confirmed {confirmed.shape[0]}, found "
              f"{found.shape[0]}, unconfirmed at kills {sum(r[3] for r in actors)}")


def test_restart_keeps_priorities_order_and_keys(start_daemon):
    """The priorities after the restart are the ones the clients set (at
    insert and by update), not merely whatever the segment holds; a key
    from before the crash updates its item; FIFO order is the commit order,
    which the ring's wrap makes differ from the slot order."""
    d = start_daemon(tables=TABLES)
    with d.connect() as c:
        per, fifo = c.table("per"), c.table("fifo")
        ids = np.arange(500)
        per.insert_batch(rows(ids), priorities=0.5 + (ids % 13))
        fifo.insert_batch(rows(np.arange(1024 + 76)))  # wraps: slot 0 holds 1024, the oldest is 76
        c.flush()
        b = per.sample(64, beta=0.5)
        per.update_priorities(b.keys, np.full(64, 40.0))
        c.flush()
        assert int(fifo.sample(1).data["id"][0]) == 76
        held_keys = b.keys.copy()
    want = 0.5 + (ids % 13)  # what the clients set, by id
    want[np.unique(b.data["id"])] = 40.0
    d.crash()
    d.start()
    seg = TableMap.attach(d.segment("per"))
    try:
        assert seg.words.epoch == 1
        slots = np.flatnonzero(seg.state == COMMITTED)
        assert slots.shape[0] == 500
        slot_ids = seg.fields["id"][slots]
        np.testing.assert_array_equal(np.sort(slot_ids), ids)
        np.testing.assert_array_equal(seg.prios[slots], want[slot_ids])
        p = want ** 0.7
        with d.connect() as c:
            per, fifo = c.table("per"), c.table("fifo")
            b2 = per.sample(256, beta=0.5)
            assert torn(b2.data) == 0
            # the sum tree was rebuilt from the priorities the clients set
            np.testing.assert_allclose(b2.probabilities, p[b2.data["id"]] / p.sum(), rtol=1e-9)
            # keys from before the crash still name their items
            per.update_priorities(held_keys, np.full(64, 2.0))
            c.flush()
            st = c.stats()["tables"]["per"]
            assert (st["stale_priority_updates"], st["priority_updates"]) == (0, 64), st
            np.testing.assert_array_equal(seg.prios[key_slots(held_keys)], 2.0)
            # fifo order survives: the oldest item comes first, as before
            assert int(fifo.sample(1).data["id"][0]) == 76
    finally:
        seg.release()


def test_schema_change_is_refused_and_keeps_the_data(start_daemon, tmp_path):
    from conftest import write_config
    d = start_daemon(tables=TABLES[1:])
    with d.connect() as c:
        c.table("fifo").insert_batch(rows(np.arange(10)))
        c.flush()
    d.crash()
    changed = [dict(TABLES[1], capacity=2048)]
    write_config(d.config, changed, instance=d.instance, socket=d.socket)
    # the daemon serves on; the table is set aside with its data, not reformatted
    assert "another definition than the config" in d.start_set_aside("fifo")["reason"]
    assert committed_ids(d.segment("fifo")).shape[0] == 10
    write_config(d.config, TABLES[1:], instance=d.instance, socket=d.socket)
    d.start()
    with d.connect() as c:
        assert len(c.table("fifo")) == 10


def test_a_second_daemon_of_a_live_instance_is_refused(start_daemon):
    import subprocess
    import sys
    d = start_daemon(tables=TABLES[1:])
    run = subprocess.run([sys.executable, "-m", "shmreplay.server.daemon", "--config", d.config,
                          "--socket", d.socket + ".other"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert f"is served by a live daemon (pid {d.pid})" in run.stderr
    with d.connect() as c:  # and the live one was not touched
        c.table("fifo").insert(**{k: v[0] for k, v in rows([1]).items()})
        c.flush()


def test_retain_tables_keeps_data_across_a_clean_restart(start_daemon):
    d = start_daemon(tables=TABLES[1:], retain_tables=True)
    with d.connect() as c:
        c.table("fifo").insert_batch(rows(np.arange(7)))
        c.flush()
    assert d.stop() == 0
    d.start()
    with d.connect() as c:
        assert len(c.table("fifo")) == 7
        c.drop_table("fifo")  # so the fixture's leak check sees nothing left


def own_a_table(name, ready):
    from shmreplay.schema import make_spec
    TableMap.create(name, make_spec("other", 8, FIELDS))
    ready.set()
    time.sleep(600)


def test_adoption_checks_magic_version_and_owner(start_daemon):
    """A segment that fails a check is set aside with its data kept (issue
    21, item 1: one bad table never stops the daemon); fixed, it is adopted."""
    from shmreplay.server.control import recovery
    d = start_daemon(tables=TABLES[1:])
    with d.connect() as c:
        c.table("fifo").insert_batch(rows(np.arange(3)))
        c.flush()
    d.crash()
    seg = d.segment("fifo")
    tm = writable_map(seg)
    try:
        tm.header["layout_version"] = 99
        why = d.start_set_aside("fifo")
        assert f"layout version 99, this build reads versions {LAYOUT_VERSION}, 5" in why["reason"]
        assert "/dev/shm" + seg in why["objects"]
        tm.header["layout_version"] = LAYOUT_VERSION
        tm.header["magic"] = b"NOTMINE\x00"
        assert "is not a shmreplay table" in d.start_set_aside("fifo")["reason"]
        tm.header["magic"] = b"SHMRTBL\x00"
    finally:
        tm.release()
    # a segment whose owner is alive (another process) is never adopted
    name = f"/shmreplay.{d.instance}x.t.other"
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    owner = ctx.Process(target=own_a_table, args=(name, ready))
    owner.start()
    try:
        assert ready.wait(30)
        with pytest.raises(shmreplay.ReplayError, match=f"belongs to live process {owner.pid}"):
            recovery.adopt(name, 0o600, -1)
    finally:
        owner.kill()
        owner.join(10)
        TableMap.attach(name).unlink()
    d.start()
    with d.connect() as c:
        assert len(c.table("fifo")) == 3


def test_a_handle_whose_table_did_not_come_back_never_writes_into_another(start_daemon):
    """A restarted daemon that no longer serves a table may give its id to a
    new one: the old handle must say UnknownTable, not insert there."""
    d = start_daemon()
    c = shmreplay.connect(d.socket, timeout=30, reconnect=True, reconnect_timeout=HANG_S)
    ta = c.create_table("a", capacity=64, fields=FIELDS)
    ta.insert_batch(rows(np.arange(4)))
    c.flush()
    d.crash()
    for part in "tr":  # the table is gone for good
        os.unlink("/dev/shm" + d.segment("a", part))
    d.start()
    with d.connect(timeout=30) as admin:
        tb = admin.create_table("b", capacity=64, fields=FIELDS)
        assert tb.id == ta.id, "the new table got the old one's id: the case under test"
        with pytest.raises(shmreplay.UnknownTable):  # after it reconnected: "a" is gone
            ta.insert_batch(rows(np.arange(4, 8)))
        assert c.reconnects == 1
        with pytest.raises(shmreplay.UnknownTable):
            ta.insert_batch(rows(np.arange(8, 12)))
        with pytest.raises(shmreplay.UnknownTable):
            ta.sample(1)
        c.flush()  # nothing was unflushed at the crash
        assert len(tb) == 0 and admin.stats()["tables"]["b"]["inserts"] == 0
    c.close()


def test_adoption_restores_limiter_counters_and_ignores_a_reused_pid(start_daemon):
    """Issue 13 item 4: the limiter counters survive adoption exactly; an
    owner recorded as a live pid with another start time is a reused pid,
    so its table is adopted."""
    d = start_daemon(tables=TABLES[1:])
    with d.connect() as c:
        f = c.table("fifo")
        f.insert_batch(rows(np.arange(1100)))  # 76 evicted
        c.flush()
        f.sample(5)
        before = c.stats()["tables"]["fifo"]
    d.crash()
    tm = writable_map(d.segment("fifo"))
    try:  # a live process (this one) under the pid, but not the one that started then
        tm.header["owner_pid"] = os.getpid()
        tm.header["owner_start"] = 12345
    finally:
        tm.release()
    d.start()
    with d.connect() as c:
        after = c.stats()["tables"]["fifo"]
        assert after["recovered_items"] == 1024
        for k in ("inserts", "samples", "deletes"):
            assert after["limiter"][k] == before["limiter"][k], (k, before["limiter"], after["limiter"])


def test_a_lease_from_before_a_restart_is_never_written(start_daemon):
    """The epoch check (client/lease.py): a client that holds leased slots
    when its daemon dies, and does not reconnect, is refused its next insert
    by the adopted table's new epoch before it copies a byte, and its slots
    are kept for it as orphans (its pid is alive), not handed out."""
    d = start_daemon(tables=[{"name": "s", "capacity": 4096, "fields": FIELDS}])
    seg = d.segment("s")
    c = d.connect(timeout=30)
    t = c.table("s")
    t.insert(**{k: v[0] for k, v in rows([1]).items()})
    _, slots, pos, _ = t._lease.cur
    unused = np.asarray(slots[pos:])
    assert unused.shape[0] == t.lease_size - 1
    tm = TableMap.attach(seg)
    try:
        before = {k: v[unused].copy() for k, v in tm.fields.items()}
        d.crash()
        d.start()
        assert tm.words.epoch == 1
        with pytest.raises(shmreplay.DaemonUnavailable, match="taken over by a restarted daemon"):
            t.insert(**{k: v[0] for k, v in rows([2]).items()})
        for k, v in tm.fields.items():
            np.testing.assert_array_equal(v[unused], before[k], err_msg=f"{k} written")
        with d.connect() as admin:
            st = admin.stats()["tables"]["s"]
            assert st["orphaned"] >= unused.shape[0], st
            assert [h["pid"] for h in st["orphan_holders"]] == [os.getpid()], st
    finally:
        tm.release()
        c.close()
