"""Redraw: the rows of a sample whose slot was overwritten between the draw
and the gather are drawn again (``client/gather.py`` re-checks each row's
stamp after copying it), so a learner's batch only ever holds rows that
match their keys.  Forced with one writer; after holds expired under two
stopped learners (``hung.py``); and under four actors that constantly
overwrite a small table."""

import json
import os
import signal
import time

import numpy as np
import pytest

import shmreplay
from hung import CTX, full_table, received, reporting, start_learner
from idrows import FIELDS, rows, torn
from items import F, ids, insert_ids
from shmreplay.wire.layout import TableMap
from shmreplay.wire.records import key_slots
from waiting import HANG_S, reap, wait_for, worker_context


def test_rows_overwritten_between_draw_and_gather_are_drawn_again(daemon, client):
    """Issue 13 item 3: the redraw path, forced.  Every slot a SAMPLE drew is
    overwritten by another client before the learner gathers: the gather's
    stamp re-check must notice each one and draw again, so the batch holds
    only rows of the new items, each matching its key."""
    t = client.create_table("rd", 16, F, sampler="uniform")
    insert_ids(t, 0, 16)
    ticket = t.begin_sample(16, 0.4, 0.0)  # drawn now, gathered below
    with daemon.connect() as other:
        insert_ids(other.table("rd"), 100, 116)  # every slot, each stamp bumped
    b = t.finish_sample(ticket, 16, 0.4, None, 0.0)
    assert b.redraws >= 16, b.redraws
    assert set(ids(b)) <= set(range(100, 116))
    # each returned key names the slot its row came from, under the slot's stamp now
    slots = key_slots(b.keys)
    assert np.array_equal(t._map.fields["v"][slots], b.data["v"])
    assert np.array_equal(t._map.gens[slots], (b.keys >> 32).astype(np.uint32))


# ---- a late gather, after the holds expired ----
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


# ---- under load: 4 actor processes and 1 learner over a small, constantly
# overwritten table; every sampled row must verify on its own.  The run is
# measured in work, not seconds: it goes on until the learner has checked
# BATCHES batches, the table has been overwritten TURNOVER times over, and
# REDRAWS rows were overwritten between draw and gather (the race under test:
# it must have happened, not merely been possible), or until a bad row or
# MAX_BATCHES batches end it as a failure.  The deadline only catches a hang.
PAYLOAD = 2048
STRESS_FIELDS = {"actor": ("int32", ()), "seq": ("int64", ()), "payload": ("uint8", (PAYLOAD,)),
          "checksum": ("uint64", ())}
CAPACITY = 2000
# a writer's lease of it (leasing.py lease_size; docs/protocol.md): 2,000 // 256
# is 7, at least 16 makes 16 (not rate-limited, under 4,096)
LEASE = 16
BATCHES, TURNOVER, REDRAWS = 600, 25, 50
MAX_BATCHES = 10 * BATCHES  # on a loaded 2-core box: 1.5-2.5 redraws and ~190 inserts a batch
_RAMP = np.arange(PAYLOAD, dtype=np.int64)
_WEIGHTS = np.arange(1, PAYLOAD + 1, dtype=np.uint64)


def make_rows(actor: int, seqs: np.ndarray) -> dict:
    payload = ((_RAMP[None, :] * (2 * seqs[:, None] + 1) + 7 * actor + seqs[:, None]) % 256).astype(np.uint8)
    return {"actor": np.full(seqs.shape[0], actor, np.int32), "seq": seqs, "payload": payload,
            "checksum": checksum(actor, seqs, payload)}


def checksum(actor, seqs, payload) -> np.ndarray:
    return (payload.astype(np.uint64) @ _WEIGHTS) ^ (np.uint64(actor) << np.uint64(40)) ^ seqs.astype(np.uint64)


def actor_main(sock, actor, stop, out):
    rng = np.random.default_rng(actor)
    with shmreplay.connect(sock) as c:
        t = c.table("stress")
        seq = 0
        while not stop.is_set():
            k = int(rng.integers(1, 17))
            rows = make_rows(actor, np.arange(seq, seq + k, dtype=np.int64))
            prios = None if rng.random() < 0.5 else rng.uniform(0.1, 2.0, size=k)
            if k == 1 and rng.random() < 0.5:
                t.insert(priority=None if prios is None else prios[0], **{f: v[0] for f, v in rows.items()})
            else:
                t.insert_batch(rows, priorities=prios)
            seq += k
        t.flush()
    out.put(json.dumps({"actor": actor, "inserted": seq}))


def learner_main(sock, stop, out):
    verified = bad = batches = redraws = evictions = 0
    with shmreplay.connect(sock) as c:
        t = c.table("stress")
        while not (bad or batches >= MAX_BATCHES or (
                batches >= BATCHES and redraws >= REDRAWS and evictions >= TURNOVER * CAPACITY)):
            try:
                b = t.sample(64, beta=0.4, timeout=0.2)
            except shmreplay.RateLimited:
                time.sleep(0.001)
                continue
            d = b.data
            expect = make_rows(0, d["seq"])  # payload for actor 0; fix up per actor below
            exp_payload = (expect["payload"].astype(np.int64) + 7 * d["actor"][:, None]) % 256
            ok = np.all(exp_payload.astype(np.uint8) == d["payload"], axis=1)
            ok &= checksum(d["actor"].astype(np.uint64), d["seq"], d["payload"]) == d["checksum"]
            ok &= (d["actor"] >= 0) & (d["actor"] < 4)
            bad += int(np.sum(~ok))
            verified += int(np.sum(ok))
            redraws += b.redraws
            batches += 1
            assert np.all(np.isfinite(b.weights)) and np.all(b.weights <= 1.0 + 1e-9)
            t.update_priorities(b.keys, np.abs(np.sin(d["seq"].astype(float))) + 0.01)
            if batches % 50 == 0:
                evictions = c.stats()["tables"]["stress"]["evictions"]
    stop.set()
    out.put(json.dumps({"verified": verified, "bad": bad, "batches": batches, "redraws": redraws}))


@pytest.mark.slow
def test_four_actors_one_learner_under_constant_overwrite_no_torn_or_mismatched_rows(daemon):
    with daemon.connect() as c:
        assert c.create_table("stress", capacity=CAPACITY, fields=STRESS_FIELDS, alpha=0.6).lease_size == LEASE
        ctx = worker_context()
        stop, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=actor_main, args=(daemon.socket, a, stop, out)) for a in range(4)]
        procs.append(ctx.Process(target=learner_main, args=(daemon.socket, stop, out)))
        results = []
        try:
            for p in procs:
                p.start()

            def reported():  # every worker's report, failing at once if one died
                while not out.empty() and len(results) < len(procs):
                    results.append(json.loads(out.get()))
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                assert not failed, f"worker(s) failed: {failed}"
                return len(results) == len(procs)
            wait_for(reported, "the learner's quota of batches, overwrites and redraws", timeout=10 * HANG_S)
            for p in procs:
                p.join(HANG_S)
                assert p.exitcode == 0
        finally:
            stop.set()
            reap(procs)
        stats = c.stats()["tables"]["stress"]
    learner = next(r for r in results if "verified" in r)
    inserted = sum(r["inserted"] for r in results if "actor" in r)
    print(f"\nstress: {inserted} items inserted, {learner['batches']} batches, "
          f"{learner['verified']} rows verified, {learner['redraws']} redrawn, {learner['bad']} bad")
    assert learner["bad"] == 0, "torn or mismatched rows reached the learner"
    assert learner["verified"] == 64 * learner["batches"] and learner["batches"] >= BATCHES
    assert learner["redraws"] >= REDRAWS and stats["evictions"] >= TURNOVER * CAPACITY
    assert stats["inserts"] == inserted, "every committed insert was applied"
    assert stats["evictions"] == inserted - stats["size"]
    # writers hand back unused lease slots at flush; those were evicted when
    # leased, so the table may end short by at most two leases per writer,
    # and by the learner's last protected redraw: items evicted while pinned
    # left the table, their slots freed at its release
    assert CAPACITY - 4 * 2 * LEASE - 64 <= stats["size"] <= CAPACITY and stats["reserved"] == 0
    assert stats["held"] == 0
