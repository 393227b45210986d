"""A hung learner: slots held for it must not stop the writers.

Slots of items sampled for their last time (``max_times_sampled``) are held
until the learner that drew them has copied the rows.  A learner that
stops (SIGSTOP, a debugger, a swapped-out box) before it releases them must
cost the writers nothing: a full table evicts around the held slots, a
writer with no timeout waits until held slots come back while one with a
timeout raises, holds expire after the config's ``hold_timeout_s``, and the
daemon's stats name the holder.  The expiry itself, and the resumed
learner's late gather that redraws the rows whose slots were reused, are
checked in test_redraw.py.

Each learner here stops itself at a chosen point of its draw (``hung.py``),
so every state is arranged, never waited out by the clock."""

import os
import re
import signal
import subprocess
import sys

import numpy as np
import pytest

import shmreplay
from faults import FIELDS, committed_ids, reap, rows, wait_for
from hung import CTX, _stop_self, _stopped, full_table, received, reporting, start_learner
from shmreplay.wire.layout import HELD, TableMap


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
        assert "8 held" in status.stdout   # the table's line: reserved, held, evicted
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


SEQ_FIELDS = {"obs": ("uint8", (3, 8)), "length": ("int32", ())}


@reporting
def sequence_writer(sock, steps, timeout, out):
    """Append ``steps`` steps of one episode with a ``SequenceWriter``; each
    step starts a sequence, so each takes a slot.  It stops itself after
    the first step."""
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
    # 200 items: under 256, a writer reserves per call (no lease ahead), so
    # once the learner holds every committed item each step needs a slot
    # nothing can give
    cap = 200
    d, admin, s = full_table(start_daemon, {"name": "s", "capacity": cap, "sampler": "uniform",
                                            "fields": SEQ_FIELDS},
                             {"obs": np.zeros((cap, 3, 8), np.uint8), "length": np.full(cap, 3, np.int32)},
                             hold_timeout_s=3600.0, reservation_timeout_s=3600.0)
    assert s.lease_size == 0
    out, learner_out = CTX.SimpleQueue(), CTX.SimpleQueue()
    learner = writer = None

    def table():
        return admin.stats()["tables"]["s"]

    try:
        # the writer's first step takes a slot (evicting an item); then the
        # learner holds every committed item: nothing is free or evictable
        writer = CTX.Process(target=sequence_writer, args=(d.socket, 4, None, out), daemon=True)
        writer.start()
        assert received(out, "the first step") == ("step", 0)
        wait_for(lambda: _stopped(writer.pid), "the writer to stop itself")
        learner = start_learner(d, "s", cap - 1, "indices", learner_out)
        wait_for(lambda: table()["held"] == cap - 1, "the learner to hold every committed item")
        with pytest.raises(shmreplay.SlotsBusy) as err:
            s.insert_batch({"obs": np.zeros((1, 3, 8), np.uint8), "length": np.ones(1, np.int32)},
                           timeout=0.5)
        assert isinstance(err.value, shmreplay.RateLimited) and isinstance(err.value, shmreplay.CapacityError)
        # the writer's next step needs a slot: with no timeout it re-asks,
        # slice after slice, instead of raising
        waits = table()["insert_waits"]
        os.kill(writer.pid, signal.SIGCONT)
        wait_for(lambda: table()["insert_waits"] >= waits + 3 or not out.empty(),
                 "the writer to wait three slices for a slot")
        assert out.empty(), out.get()
        os.kill(learner.pid, signal.SIGKILL)  # its holds go back: room at last
        assert [received(out, "the last steps") for _ in range(4)] == [
            ("step", 1), ("step", 2), ("step", 3), ("done",)]
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
