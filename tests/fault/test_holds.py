"""A hung learner: slots held for it must not stop the writers.

Slots of items sampled for their last time (``max_times_sampled``) are held
until the learner that drew them has copied the rows.  A learner that
stops (SIGSTOP, a debugger, a swapped-out box) before it releases them must
cost the writers nothing: a full table evicts around the held slots, holds
expire after ``hold_timeout_s``, a late gather by the resumed learner redraws
the rows whose slots were reused, and the daemon's stats name the holder.

Each learner here stops itself at a chosen point of its draw, so every state
is arranged, never waited out by the clock."""

import functools
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import shmreplay
from faults import FIELDS, committed_ids, reap, rows, torn, wait_for
from shmreplay.client import gather
from shmreplay.wire.layout import HELD, TableMap
from shmreplay.wire.records import key_slots

CTX = mp.get_context("fork")


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def reporting(body):
    """A worker ``body(..., out)`` whose ReplayError goes to ``out`` as
    ("error", class, message), for the test to show, instead of a dead child."""
    @functools.wraps(body)
    def run(*args):
        try:
            body(*args)
        except shmreplay.ReplayError as exc:
            args[-1].put(("error", type(exc).__name__, str(exc)))
    return run


def full_table(start_daemon, table: dict, data: dict, hold_timeout_s: float):
    """A daemon serving one table whose items are sampled once, filled with
    ``data``: (daemon, admin client, table handle)."""
    d = start_daemon(tables=[{"max_times_sampled": 1, **table}], hold_timeout_s=hold_timeout_s)
    admin = d.connect(timeout=30)
    t = admin.table(table["name"])
    t.insert_batch(data)
    admin.flush()
    return d, admin, t


@reporting
def hung_learner(sock, table, n, how, out):
    """Draw n items and stop before the draw is finished: ``indices`` holds
    them with ``sample_indices`` and never releases; ``before`` stops with the
    SAMPLE's reply unread; ``mid`` stops inside ``sample`` between copying
    the rows and re-checking their stamps.  Once resumed, it finishes the
    gather and reports the batch, then proves it is still connected."""
    with shmreplay.connect(sock, timeout=30) as c:
        t = c.table(table)
        if how == "indices":
            t.sample_indices(n)
            _stop_self()
            out.put(("resumed",))
            return
        if how == "before":
            ticket = t.begin_sample(n, 0.0, 30.0)
            _stop_self()
            b = t.finish_sample(ticket, n, 0.0, None, 30.0)
        else:
            check = gather.stale_rows

            def stop_then_check(gens, batch):
                gather.stale_rows = check
                _stop_self()
                return check(gens, batch)

            gather.stale_rows = stop_then_check
            b = t.sample(n, beta=0.0, timeout=30)
        c.flush()  # its RELEASE of the expired hold went first: no protocol error
        out.put(("ok", b.keys, b.data, b.redraws))


def received(q, what: str):
    """The next report on a SimpleQueue (whose put is written at once, so a
    worker may stop itself right after it), within the hang guard."""
    wait_for(lambda: not q.empty(), what)
    return q.get()


def start_learner(d, table, n, how, out):
    p = CTX.Process(target=hung_learner, args=(d.socket, table, n, how, out), daemon=True)
    p.start()
    wait_for(lambda: _stopped(p.pid) or not p.is_alive(), f"the {how} learner to stop itself")
    assert p.is_alive(), "the learner ended before it stopped itself"
    return p


def test_writers_evict_around_a_hung_learners_holds_and_status_names_it(start_daemon):
    d, admin, t = full_table(start_daemon, {"name": "t", "capacity": 512, "sampler": "uniform",
                                            "fields": FIELDS}, rows(np.arange(512)), hold_timeout_s=3600.0)
    out = CTX.SimpleQueue()
    learner = None
    try:
        learner = start_learner(d, "t", 8, "indices", out)
        st = wait_for(lambda: (s := admin.stats()["tables"]["t"])["held"] == 8 and s,
                      "the learner's 8 held slots in the stats")
        (holder,) = st["holders"]
        assert holder["pid"] == learner.pid and holder["held"] == 8 and holder["oldest_s"] >= 0
        status = subprocess.run([sys.executable, "-m", "shmreplay.cli", "--socket", d.socket, "status"],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        assert "8 held" in status.stdout
        assert re.search(rf"client \d+, pid {learner.pid}: 8 slots held, oldest ", status.stdout), \
            status.stdout
        tm = TableMap.attach(t._map.name)
        held = np.flatnonzero(tm.state == HELD)
        stamps = tm.gens[held].copy()
        # twice the table's worth, without waiting: every insert evicts the
        # oldest committed item and none touches a held slot
        new = np.arange(1000, 2024)
        t.insert_batch(rows(new), timeout=0)
        admin.flush()
        st = admin.stats()["tables"]["t"]
        assert (st["held"], st["size"], st["evictions"]) == (8, 504, 1024)
        assert np.all(tm.state[held] == HELD) and np.array_equal(tm.gens[held], stamps)
        assert np.array_equal(committed_ids(t._map.name), new[-504:])
        tm.release()
        os.kill(learner.pid, signal.SIGKILL)
        wait_for(lambda: admin.stats()["tables"]["t"]["held"] == 0, "the killed learner's holds to go back")
        assert admin.stats()["tables"]["t"]["holders"] == []
    finally:
        if learner is not None and learner.is_alive():
            os.kill(learner.pid, signal.SIGKILL)
        reap([p for p in (learner,) if p is not None])
        admin.close()


@reporting
def writer_until_reused(sock, segment, stamps, out):
    """Insert with no timeout into a table whose every slot is held; once
    that insert is in, wait for the last hold to expire and insert until no
    slot has the stamp it had when the learners drew it."""
    tm = TableMap.attach(segment)
    with shmreplay.connect(sock, timeout=30) as c:
        t = c.table("t")
        t.insert_batch(rows(np.arange(10_000, 10_008)), timeout=None)
        c.flush()
        wait_for(lambda: c.stats()["tables"]["t"]["held"] == 0, "every hold to expire")
        t.insert_batch(rows(np.arange(20_000, 20_064)), timeout=None)
        c.flush()
        out.put(("reused", int(np.sum(tm.gens == stamps))))


def test_holds_expire_and_a_late_gather_redraws_the_reused_rows(start_daemon):
    d, admin, t = full_table(start_daemon, {"name": "t", "capacity": 64, "sampler": "fifo", "fields": FIELDS},
                             rows(np.arange(64)), hold_timeout_s=1.0)
    segment = t._map.name
    outs = {how: CTX.SimpleQueue() for how in ("before", "mid")}
    learners, writer = {}, None

    def samples():
        return admin.stats()["tables"]["t"]["samples"]

    try:
        # two learners draw the whole table and stop: one with the reply
        # unread, one between its copy and its stamp check; every slot is held
        for k, how in enumerate(("before", "mid")):
            learners[how] = start_learner(d, "t", 32, how, outs[how])
            wait_for(lambda: samples() == 32 * (k + 1), f"the {how} learner's draw to run")
        tm = TableMap.attach(segment)
        stamps = tm.gens.copy()  # nobody has written since the draws
        wout = CTX.SimpleQueue()
        writer = CTX.Process(target=writer_until_reused, args=(d.socket, segment, stamps, wout), daemon=True)
        writer.start()
        result = received(wout, "the writer to insert past the expired holds")
        assert result == ("reused", 0), result
        st = admin.stats()["tables"]["t"]
        assert (st["held"], st["expired_held_slots"], st["holders"]) == (0, 64, [])
        # resumed, each learner finds every slot it drew overwritten and draws again
        batches = {}
        for how, p in learners.items():
            os.kill(p.pid, signal.SIGCONT)
            batches[how] = received(outs[how], f"the {how} learner's late batch")
            p.join(30)
        ids = []
        for how, got in batches.items():
            assert got[0] == "ok", (how, got)
            _, keys, data, redraws = got
            assert redraws == 32, (how, redraws)
            assert torn(data) == 0
            slots = key_slots(keys)
            # every row is exactly the item its key names (no writer runs now)
            assert np.array_equal((keys >> np.uint64(32)).astype(np.uint32), tm.gens[slots])
            assert np.array_equal(data["id"], tm.fields["id"][slots])
            ids.extend(data["id"].tolist())
        assert sorted(ids) == list(range(20_000, 20_064))
        tm.release()
        assert "disconnecting" not in d.log()
    finally:
        for p in learners.values():
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        reap(list(learners.values()) + [p for p in (writer,) if p is not None])
        admin.close()


SEQ_FIELDS = {"obs": ("uint8", (3, 8)), "length": ("int32", ())}


@reporting
def sequence_writer(sock, steps, timeout, out):
    """Append ``steps`` steps of one episode with a ``SequenceWriter``; each
    step starts a sequence, so each takes a slot, most from its lease.  It
    stops itself after the first step, with one slot of its lease left."""
    with shmreplay.connect(sock, timeout=20) as c:
        w = shmreplay.SequenceWriter(c.table("s"), length=3, period=1, timeout=timeout)
        for i in range(steps):
            w.append(obs=np.full(8, i, np.uint8))
            out.put(("step", i))
            if i == 0:
                _stop_self()
        w.end_episode()
        c.flush()
        out.put(("done",))


def test_a_writer_without_timeout_waits_out_a_hung_learner_and_one_with_a_timeout_raises(start_daemon):
    d, admin, s = full_table(start_daemon, {"name": "s", "capacity": 512, "sampler": "uniform",
                                            "fields": SEQ_FIELDS},
                             {"obs": np.zeros((512, 3, 8), np.uint8), "length": np.full(512, 3, np.int32)},
                             hold_timeout_s=3600.0)
    out, learner_out = CTX.SimpleQueue(), CTX.SimpleQueue()
    learner = writer = None

    def table():
        return admin.stats()["tables"]["s"]

    try:
        # the writer's first step leases 2 slots (evicting 2 items); then the
        # learner holds every committed item: nothing is free or evictable
        writer = CTX.Process(target=sequence_writer, args=(d.socket, 4, None, out), daemon=True)
        writer.start()
        assert received(out, "the first step") == ("step", 0)
        wait_for(lambda: _stopped(writer.pid), "the writer to stop itself")
        learner = start_learner(d, "s", 510, "indices", learner_out)
        wait_for(lambda: table()["held"] == 510, "the learner to hold every committed item")
        with pytest.raises(shmreplay.SlotsBusy) as err:
            s.insert_batch({"obs": np.zeros((1, 3, 8), np.uint8), "length": np.ones(1, np.int32)},
                           timeout=0.5)
        assert isinstance(err.value, shmreplay.RateLimited) and isinstance(err.value, shmreplay.CapacityError)
        # the writer's next steps need a slot beyond its lease: with no
        # timeout it re-asks, slice after slice, instead of raising
        waits = table()["insert_waits"]
        os.kill(writer.pid, signal.SIGCONT)
        assert received(out, "the second step") == ("step", 1)
        wait_for(lambda: table()["insert_waits"] >= waits + 3 or not out.empty(),
                 "the writer to wait three slices for a slot")
        assert out.empty(), out.get()
        os.kill(learner.pid, signal.SIGKILL)  # its holds go back: room at last
        assert [received(out, "the last steps") for _ in range(3)] == [("step", 2), ("step", 3), ("done",)]
        assert table()["held"] == 0
    finally:
        for p in (learner, writer):
            if p is not None and p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
        reap([p for p in (learner, writer) if p is not None])
        admin.close()


def test_hold_timeout_s_comes_from_the_config_and_must_be_positive():
    from conftest import ROOT
    from shmreplay.server.control.config import load_config, parse_config
    assert load_config(os.path.join(ROOT, "daemon", "shmreplayd.toml")).hold_timeout_s == 5.0
    assert parse_config({"daemon": {"hold_timeout_s": 0.25}}).hold_timeout_s == 0.25
    for bad in (0, -1.0, "5"):  # 0 would free held rows before any learner could copy them
        with pytest.raises(shmreplay.SchemaError, match="hold_timeout_s must be a number"):
            parse_config({"daemon": {"hold_timeout_s": bad}})
