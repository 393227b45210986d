"""Slot writers across a daemon restart (SIGKILL, start again with the same
config): no torn row, no transition or sequence completed into a slot the
dead daemon had leased, and no flush() vouching for items that were lost.

Semantics checked, with ``connect(..., reconnect=True)``:

* ``NStepWriter.append``, ``SequenceWriter.append`` and ``insert_batch`` ride
  out the restart by themselves: they never raise because of it;
* a writer's items that were open (started, not committed) when the daemon
  died are dropped, never completed into the voided slots, which the new
  daemon gives to other writers once their writer reconnected or exited,
  never while it may still write them (the stalled actor's stay out of use
  until it resumes and reconnects);
* the first ``flush()`` after the restart raises ``DaemonUnavailable``
  ("may be lost") if anything sent before it was unflushed (plain inserts,
  writer commits, open items), and every flush that returns vouches for
  everything inserted or committed since the flush before it.

The run is arranged, not timed: actors do exactly what the test orders, in
rounds, and are idle when the daemon is killed; sleeps are only polls.
Every row is self-verifying: every value derives from ``id = actor << 40 |
global step`` and the actor's fixed episode length, so a row mixing two
writes (or a transition built from another n than the episode allowed)
shows up wherever it is read.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np

import shmreplay

from faults import HANG_S, lease_pids, reissued, segment_rows, void_slots, wait_for
from writer_crew import Crew
from writer_streams import (EP_LEN, KIND, MASK40, NSTEP_FIELDS, PERIOD, SEQ_FIELDS, STALLED,
                            steps_to_episode_end, steps_to_mid_episode, torn_mask)

CAPACITY = {"nstep": 4096, "seq": 1024}  # nothing is evicted before the restart
TABLES = [{"name": "nstep", "capacity": CAPACITY["nstep"], "sampler": "uniform", "fields": NSTEP_FIELDS},
          {"name": "seq", "capacity": CAPACITY["seq"], "sampler": "uniform", "fields": SEQ_FIELDS}]
MAX_P2_ROUNDS = 12


def scan(segment: str, table: str) -> tuple[dict, np.ndarray, int]:
    """Committed rows of a table segment, which of them are torn, and how
    many items have left the table (FIFO evictions)."""
    data, deletes = segment_rows(segment)
    return data, torn_mask(table, data), deletes


def presence_problems(what: str, confirmed: dict, data: dict, torn: np.ndarray, deletes: int) -> list:
    """Every confirmed item must be in the table, untorn, unless FIFO
    evicted it: each actor commits its items in id order, so the evicted
    ones of an actor are older than every one of its items still present,
    and there are at most ``deletes`` of them."""
    have = data["id"][~torn]
    problems, total = [], 0
    for a, ids in confirmed.items():
        ids = np.asarray(ids, np.int64)
        mine = have[(have >> 40) == a]
        missing = np.setdiff1d(ids, mine)
        total += missing.shape[0]
        oldest = mine.min() if mine.shape[0] else np.iinfo(np.int64).max
        lost = missing[missing > oldest]
        if lost.shape[0]:
            problems.append(f"{what}: actor {a}: {lost.shape[0]} of {ids.shape[0]} flush-confirmed "
                            f"items are missing although older ones of it are present (not a FIFO "
                            f"eviction), e.g. steps {(lost[:5] & MASK40).tolist()}")
    if total > deletes:
        problems.append(f"{what}: {total} flush-confirmed items missing, only {deletes} ever evicted")
    return problems


def test_writers_ride_out_a_daemon_restart(start_daemon, capsys):
    d = start_daemon(tables=TABLES, reservation_timeout_s=3600.0)  # writers left idle for many rounds
    seg = {t: d.segment(t) for t in CAPACITY}
    crew = None
    failures: list[str] = []   # torn rows first, then lost items, then errors
    presence_p2: list[str] = []
    fig: dict = {}
    try:
        crew = Crew(mp.get_context("fork"), d.socket)
        # ---- phase 1: fill most of the n-step table, every flush returns ----
        for _ in range(3):
            crew.run({1: (300, True), 2: (300, True), 3: (300, True), 4: (200, True),
                      5: (200, True)})
        # then leave unflushed work of every kind: open transitions (1, and
        # the stalled 2), plain inserts (3), commits of a finished episode and
        # nothing open (4), open sequences (5)
        crew.run({1: (steps_to_mid_episode(crew.g[1], EP_LEN[1]), False),
                  STALLED: (steps_to_mid_episode(crew.g[STALLED], EP_LEN[STALLED]), False),
                  3: (40, False),
                  4: (steps_to_episode_end(crew.g[4], EP_LEN[4]), False),
                  5: (steps_to_mid_episode(crew.g[5], EP_LEN[5], PERIOD + 2), False)})
        assert (crew.open[1] and crew.open[STALLED] and not crew.open[4]
                and crew.open[5]), crew.open
        pre_flushes = dict(crew.flushes)
        for t in CAPACITY:
            data, torn, deletes = scan(seg[t], t)
            assert deletes == 0, f"table {t} evicted {deletes} items before the restart: resize"
            assert not torn.any(), f"table {t}: {int(torn.sum())} torn rows before the restart"
            conf = {a: v for a, v in crew.confirmed.items() if (KIND[a] == "seq") == (t == "seq")}
            problems = presence_problems(f"{t} before the restart", conf, data, torn, 0)
            assert not problems, problems

        # ---- the crash: every slot reserved now is void for the next daemon ----
        d.crash()
        g_crash = dict(crew.g)
        open_at_crash = {a: list(v) for a, v in crew.open.items()}
        void, void_gens = void_slots(seg["nstep"])
        assert void.shape[0] >= len(open_at_crash[1]) + len(open_at_crash[STALLED]), void.shape
        stalled_void = lease_pids(seg["nstep"], void) == crew.procs[STALLED].pid
        assert stalled_void.any(), "the stalled actor leased no slot: the case under test"
        d.start()

        # ---- phase 2: all but the stalled actor go on until every void slot
        # of theirs holds another actor's committed item; the stalled
        # actor's stay out of use, since it may still write them ----
        rounds = 0
        while rounds < MAX_P2_ROUNDS:
            rounds += 1
            orders = {1: (32, True), 3: (256, True)}
            if rounds <= 2:
                orders[4] = orders[5] = (64, True)
            crew.run(orders)
            if reissued(seg["nstep"], void[~stalled_void], void_gens[~stalled_void]).all() and rounds >= 2:
                break
        reused = reissued(seg["nstep"], void, void_gens)
        fig["void slots"] = (f"{int(reused[~stalled_void].sum())}/{int((~stalled_void).sum())} re-issued "
                             f"after {rounds} rounds; the stalled writer's "
                             f"{int(stalled_void.sum())} kept out of use")
        if not reused[~stalled_void].all():
            failures.append(f"setup: only {int(reused[~stalled_void].sum())} of the "
                            f"{int((~stalled_void).sum())} slots reserved at the crash by writers that "
                            f"reconnected were given out and committed again in {rounds} rounds")
        if reused[stalled_void].any():
            failures.append(f"{int(reused[stalled_void].sum())} slots leased to the stalled writer were "
                            "given to another writer while it could still write them")
        with shmreplay.connect(d.socket, timeout=HANG_S) as admin:
            st = admin.stats()["tables"]["nstep"]
            if st["orphaned"] != int(stalled_void.sum()):
                failures.append(f"stats show {st['orphaned']} orphaned slots, "
                                f"expected the stalled writer's {int(stalled_void.sum())}")
        for t in CAPACITY:
            data, torn, deletes = scan(seg[t], t)
            fig[f"{t} torn in segment before release"] = int(torn.sum())
            if torn.any():
                failures.append(f"{t}: {int(torn.sum())} torn rows in the segment before the stalled "
                                f"writer resumed, e.g. ids {data['id'][torn][:4].tolist()}")
            conf = {a: v for a, v in crew.confirmed.items() if (KIND[a] == "seq") == (t == "seq")}
            presence_p2 += presence_problems(f"{t} after phase 2", conf, data, torn, deletes)

        # ---- phase 3: release the stalled actor; everyone does a little more ----
        for _ in range(2):
            crew.run({1: (64, True), STALLED: (64, True), 3: (64, True), 4: (64, True),
                      5: (64, True)})
        with shmreplay.connect(d.socket, timeout=HANG_S) as admin:  # it reconnected: its slots are free
            wait_for(lambda: admin.stats()["tables"]["nstep"]["orphaned"] == 0,
                     "the stalled writer's leases to be freed once it reconnected")
        base = list(crew.progress)
        deadline = time.monotonic() + 60  # a hang guard
        while min(p - b for p, b in zip(crew.progress, base)) < 10:  # the learner still samples
            assert time.monotonic() < deadline, "the learner stopped sampling after the restart"
            time.sleep(0.05)
        crew.finish()
    finally:
        if crew is not None:
            crew.stop.set()
            crew.reap()

    # ---- final checks (in this order: torn rows first) ----
    lrn = crew.finals["learner"]
    for t in CAPACITY:
        fig[f"learner {t}"] = f"{lrn['rows'][t]} rows sampled, {lrn['torn'][t]} torn"
        if lrn["torn"][t]:
            failures.append(f"{t}: the learner sampled {lrn['torn'][t]} torn rows of {lrn['rows'][t]}")
    if any(lrn["torn"].values()):
        failures.append(f"torn samples, e.g. {lrn['examples'][:2]}")
    final = {}
    for t in CAPACITY:
        final[t] = data, torn, deletes = scan(seg[t], t)
        fig[f"{t} final"] = (f"{data['id'].shape[0]} committed, {int(torn.sum())} torn, "
                             f"{deletes} evicted")
        if torn.any():
            failures.append(f"{t}: {int(torn.sum())} torn rows in the segment at the end, e.g. "
                            f"{[{k: v[r].tolist() for k, v in data.items()} for r in np.flatnonzero(torn)[:2]]}")
    failures += presence_p2
    for t, (data, torn, deletes) in final.items():
        conf = {a: v for a, v in crew.confirmed.items() if (KIND[a] == "seq") == (t == "seq")}
        failures += presence_problems(f"{t} at the end", conf, data, torn, deletes)
    for a in KIND:
        data, torn, _ = final["seq" if KIND[a] == "seq" else "nstep"]
        ids = data["id"][~torn]
        after = ids[((ids >> 40) == a) & ((ids & MASK40) >= g_crash[a])]
        fig[f"actor {a} rows after restart"] = after.shape[0]
        if not after.shape[0]:
            failures.append(f"actor {a} ({KIND[a]}{', stalled' if a == STALLED else ''}): no untorn "
                            "row of its steps after the restart is in the table")
        dropped = np.intersect1d(np.asarray(open_at_crash[a], np.int64), data["id"])
        if dropped.shape[0]:
            failures.append(f"actor {a}: transitions open at the crash were completed anyway: steps "
                            f"{(dropped & MASK40).tolist()}")
    seen_after = {}
    for a in KIND:
        ids = lrn["ids"]["seq" if KIND[a] == "seq" else "nstep"]
        seen_after[a] = int(np.sum(((ids >> 40) == a) & ((ids & MASK40) >= g_crash[a])))
    fig["learner: distinct rows sampled per actor from after the restart"] = seen_after
    if not sum(seen_after.values()):
        failures.append("the learner sampled no row written after the restart")
    for a in KIND:
        rec = crew.finals[a]
        fig[f"actor {a}"] = (f"{KIND[a]}, g at crash {g_crash[a]}, confirmed {len(rec['confirmed'])}, "
                             f"unconfirmed {len(rec['unconfirmed'])}, reconnects {rec['reconnects']}, "
                             f"append/insert errors {rec['n_errors']}")
        if rec["n_errors"]:
            failures.append(f"actor {a} ({KIND[a]}): append/insert raised {rec['n_errors']} times, e.g. "
                            f"{rec['errors'][:3]}")
    for a in KIND:
        after = crew.finals[a]["flushes"][pre_flushes[a]:]
        warned = sum("may be lost" in f for f in after)
        ok = (len(after) > 0 and after[0].startswith("DaemonUnavailable")
              and "may be lost" in after[0] and all(f == "ok" for f in after[1:]))
        if not ok:
            failures.append(f"actor {a} ({KIND[a]}) had unflushed work at the crash: its first flush "
                            f"after the restart must raise DaemonUnavailable('... may be lost') and "
                            f"every later one return; got {warned} warnings in {after}")
    with capsys.disabled():
        print("\n[writer restart figures]", *(f"  {k}: {v}" for k, v in fig.items()),
              f"  learner errors: {lrn['n_errors']} {lrn['errors'][:2]}, reconnects {lrn['reconnects']}",
              sep="\n")
    assert not failures, "\n".join(failures)
