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

import collections
import multiprocessing as mp
import queue
import time
import traceback

import numpy as np

import shmreplay

from faults import HANG_S, lease_pids, reissued, segment_rows, void_slots, wait_for

N, GAMMA, D = 5, 0.9, 4            # n-step transitions of D-wide int observations
SEQ_LEN, PERIOD = 8, 4             # sequences overlap by half
EP_LEN = {1: 23, 2: 17, 3: 29, 4: 21, 5: 19}   # episode length of each actor
KIND = {1: "nstep", 2: "nstep", 3: "plain", 4: "seq", 5: "seq"}
STALLED = 2                        # holds open transitions across the restart, resumes late
NSTEP_ACTORS = (1, 2, 3)
SEQ_ACTORS = (4, 5)
NSTEP_FIELDS = {"obs": ("int64", (D,)), "next_obs": ("int64", (D,)), "action": ("int64", ()),
                "reward": ("float64", ()), "discount": ("float64", ()), "id": ("int64", ())}
SEQ_FIELDS = {"step": ("int64", (SEQ_LEN,)), "r": ("float32", (SEQ_LEN,)), "id": ("int64", ()),
              "length": ("int32", ())}
CAPACITY = {"nstep": 4096, "seq": 1024}  # nothing is evicted before the restart
TABLES = [{"name": "nstep", "capacity": CAPACITY["nstep"], "sampler": "uniform", "fields": NSTEP_FIELDS},
          {"name": "seq", "capacity": CAPACITY["seq"], "sampler": "uniform", "fields": SEQ_FIELDS}]
BATCH = {"nstep": 64, "seq": 32}
MAX_P2_ROUNDS = 12
ROUND_TIMEOUT_S = 60.0
MASK40 = (1 << 40) - 1
_EP = np.ones(8, np.int64)
for _a, _n in EP_LEN.items():
    _EP[_a] = _n


# ---- the rows every actor's stream must produce ----

def step_ids(a: int, g) -> np.ndarray:
    return (np.int64(a) << np.int64(40)) | np.asarray(g, np.int64)


def obs_of(ids) -> np.ndarray:
    """The observation at the step an id names (next_obs of step g is obs_of(id + 1))."""
    return np.asarray(ids, np.int64)[..., None] * D + np.arange(D, dtype=np.int64)


def reward_of(g):
    return 1.0 + (np.asarray(g) % 5) * 0.25


def action_of(g):
    return (np.asarray(g) * 7 + 3) % 11


def _split(ids: np.ndarray, actors) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(known actor?, step, episode length); unknown ids get a harmless stand-in."""
    a = ids >> 40
    known = (ids >= 0) & np.isin(a, actors)
    g = np.where(known, ids & MASK40, 0)
    return known, g, _EP[np.where(known, a, 0)]


def nstep_rows(ids) -> dict:
    """The transition starting at each id's step: m = min(n, steps left in
    the episode), reward = sum gamma^j r_{t+j} over j < m, discount 0 if the
    episode terminated within those m steps (even episodes terminate, odd
    ones are truncated), else gamma^m; next_obs = the observation after m steps."""
    ids = np.asarray(ids, np.int64)
    _, g, ep = _split(ids, NSTEP_ACTORS)
    k = g % ep
    m = np.minimum(N, ep - k)
    ret = np.zeros(ids.shape)
    for j in range(N):  # the order the writer adds them in
        ret += np.where(j < m, GAMMA ** j * reward_of(g + j), 0.0)
    term = ((g // ep) % 2 == 0) & (k + m == ep)
    return {"obs": obs_of(ids), "next_obs": obs_of(ids + m), "action": action_of(g),
            "reward": ret, "discount": np.where(term, 0.0, GAMMA ** m), "id": ids}


def seq_rows(ids) -> tuple[dict, np.ndarray]:
    """The sequence starting at each id's step, and whether such a sequence
    can exist (it starts a multiple of PERIOD into its episode)."""
    ids = np.asarray(ids, np.int64)
    _, g, ep = _split(ids, SEQ_ACTORS)
    k = g % ep
    n = np.minimum(SEQ_LEN, ep - k)
    j = np.arange(SEQ_LEN)
    real = j < n[:, None]
    rows = {"step": np.where(real, ids[:, None] + j, 0),
            "r": np.where(real, reward_of(g[:, None] + j), 0.0).astype(np.float32),
            "id": ids, "length": n}
    return rows, k % PERIOD == 0


def torn_mask(table: str, data: dict) -> np.ndarray:
    """True for every row that is not exactly what its id says."""
    ids = data["id"]
    if table == "nstep":
        known = _split(ids, NSTEP_ACTORS)[0]
        want = nstep_rows(ids)
        ok = (known & np.all(data["obs"] == want["obs"], axis=1)
              & np.all(data["next_obs"] == want["next_obs"], axis=1)
              & (data["action"] == want["action"])
              & np.isclose(data["reward"], want["reward"], rtol=1e-12, atol=0)
              & np.isclose(data["discount"], want["discount"], rtol=1e-12, atol=0))
    else:
        known = _split(ids, SEQ_ACTORS)[0]
        want, can = seq_rows(ids)
        ok = (known & can & np.all(data["step"] == want["step"], axis=1)
              & np.all(data["r"] == want["r"], axis=1) & (data["length"] == want["length"]))
    return ~ok


def steps_to_mid_episode(g: int, ep: int, steps_in: int = 3) -> int:
    """Steps to append from global step g so that the episode is >= steps_in
    steps old and not over: an n-step writer then has open transitions."""
    s = 1
    while not steps_in - 1 <= (g + s - 1) % ep <= ep - 2:
        s += 1
    return s


def steps_to_episode_end(g: int, ep: int) -> int:
    return ep - g % ep


# ---- processes ----

def _note(rec: dict, where: str, exc: BaseException) -> None:
    rec["n_errors"] += 1
    if len(rec["errors"]) < 8:
        rec["errors"].append(f"{where}: {type(exc).__name__}: {str(exc)[:160]}")


def actor_main(kind: str, a: int, sock: str, cmds, out) -> None:
    """Obey ("steps", k, flush) orders until ("stop",): k more steps of this
    actor's stream (an NStepWriter, a SequenceWriter, or insert_batch of rows
    computed here), then flush() if asked.  A mirror of the writer's open
    items says which ids each step completes; the ids completed since the
    previous flush count as confirmed when a flush returns, as unconfirmed
    when it raises.  Exceptions are recorded, never fatal."""
    rec = {"errors": [], "n_errors": 0, "flushes": [], "confirmed": [], "unconfirmed": []}
    try:
        c = shmreplay.connect(sock, timeout=30, reconnect=True, reconnect_timeout=120)
        t = c.table("seq" if kind == "seq" else "nstep")
        w = (shmreplay.NStepWriter(t, n=N, gamma=GAMMA) if kind == "nstep" else
             shmreplay.SequenceWriter(t, length=SEQ_LEN, period=PERIOD) if kind == "seq" else None)
        ep = EP_LEN[a]
        g, pending, opened = 0, [], collections.deque()
        while True:
            cmd = cmds.get(timeout=300)
            if cmd[0] == "stop":
                break
            _, k, flush = cmd
            if kind == "plain":
                for lo in range(0, k, 32):
                    ids = step_ids(a, np.arange(g, g + min(32, k - lo)))
                    g += ids.shape[0]
                    try:
                        t.insert_batch(nstep_rows(ids))
                    except Exception as exc:
                        _note(rec, "insert_batch", exc)
                    pending.extend(ids.tolist())
            for _ in range(k if kind != "plain" else 0):
                sid = int(step_ids(a, g))
                last = g % ep == ep - 1
                try:
                    if kind == "nstep":
                        terminated = last and (g // ep) % 2 == 0
                        w.append(obs=obs_of(sid), action=int(action_of(g)),
                                 reward=float(reward_of(g)), next_obs=obs_of(sid + 1),
                                 terminated=terminated, truncated=last and not terminated, id=sid)
                    else:
                        w.append(step=sid, r=float(reward_of(g)), id=sid)
                        if last:
                            w.end_episode()
                except Exception as exc:
                    _note(rec, "append", exc)
                # what a correct writer has completed (committed) after this step
                if kind == "nstep" or (g % ep) % PERIOD == 0:
                    opened.append(g)
                span = N if kind == "nstep" else SEQ_LEN
                if last:
                    pending.extend(int(step_ids(a, s)) for s in opened)
                    opened.clear()
                elif opened and g - opened[0] + 1 == span:
                    pending.append(int(step_ids(a, opened.popleft())))
                g += 1
            new = []
            if flush:
                try:
                    c.flush()
                    new = pending
                    rec["flushes"].append("ok")
                except Exception as exc:
                    rec["unconfirmed"].extend(pending)
                    rec["flushes"].append(f"{type(exc).__name__}: {str(exc)[:160]}")
                pending = []
                rec["confirmed"].extend(new)
            out.put(("done", a, g, new, [int(step_ids(a, s)) for s in opened], rec["n_errors"]))
        rec["reconnects"] = c.reconnects
        try:
            c.close()
        except Exception:
            pass
        out.put(("final", a, rec))
    except BaseException:
        out.put(("fatal", a, traceback.format_exc()))


def learner_main(sock: str, stop, progress, out) -> None:
    """Sample both tables until told to stop; check every row."""
    try:
        c = shmreplay.connect(sock, timeout=30, reconnect=True, reconnect_timeout=120)
        tables = {"nstep": c.table("nstep"), "seq": c.table("seq")}
        names = list(tables)
        rows = {n: 0 for n in names}
        torn = {n: 0 for n in names}
        seen = {n: [] for n in names}
        examples, errors, i = [], [], 0
        while not stop.is_set():
            name = names[i % 2]
            i += 1
            try:
                b = tables[name].sample(BATCH[name], timeout=0.2)
            except shmreplay.RateLimited:  # EmptyTable too: nothing inserted yet
                continue
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {str(exc)[:160]}")
                time.sleep(0.05)
                continue
            bad = np.flatnonzero(torn_mask(name, b.data))
            rows[name] += len(b)
            torn[name] += bad.shape[0]
            for r in bad[:max(0, 4 - len(examples))]:
                examples.append((name, {k: v[r].tolist() for k, v in b.data.items()}))
            seen[name].append(b.data["id"].copy())
            progress[names.index(name)] += 1
            time.sleep(0.01)  # light: the box has 2 cores
        ids = {n: np.unique(np.concatenate(s)) if s else np.zeros(0, np.int64) for n, s in seen.items()}
        out.put(("learner", 0, {"rows": rows, "torn": torn, "examples": examples, "ids": ids,
                                "errors": errors[:8], "n_errors": len(errors),
                                "reconnects": c.reconnects}))
        c.close()
    except BaseException:
        out.put(("fatal", "learner", traceback.format_exc()))


class Crew:
    """The actors and the learner, and what they reported."""

    def __init__(self, ctx, sock: str):
        self.out = ctx.Queue()
        self.stop = ctx.Event()
        self.progress = ctx.Array("q", 2)
        self.cmds = {a: ctx.Queue() for a in KIND}
        self.procs = {a: ctx.Process(target=actor_main, args=(KIND[a], a, sock, self.cmds[a], self.out),
                                     daemon=True) for a in KIND}
        self.procs["learner"] = ctx.Process(target=learner_main,
                                            args=(sock, self.stop, self.progress, self.out), daemon=True)
        self.g = {a: 0 for a in KIND}
        self.open = {a: [] for a in KIND}
        self.confirmed = {a: [] for a in KIND}
        self.flushes = {a: 0 for a in KIND}
        self.finals: dict = {}
        self.finished = False
        for p in self.procs.values():
            p.start()

    def _take(self, deadline: float, waiting) -> tuple:
        try:
            msg = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no report from {sorted(map(str, waiting))} within "
                                 f"{ROUND_TIMEOUT_S} s") from None
        kind, who, *rest = msg
        if kind == "fatal":
            raise AssertionError(f"{who} failed:\n{rest[0]}")
        if kind == "done":
            g, new, opened, _ = rest
            self.g[who], self.open[who] = g, opened
            self.confirmed[who].extend(new)
        else:  # "final" / "learner"
            self.finals[who if kind == "final" else "learner"] = rest[0]
        return kind, who

    def run(self, orders: dict) -> None:
        """One round: each actor named does (k steps, flush?); wait for all."""
        for a, (k, flush) in orders.items():
            self.cmds[a].put(("steps", k, flush))
            self.flushes[a] += bool(flush)
        waiting = set(orders)
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while waiting:
            kind, who = self._take(deadline, waiting)
            if kind == "done":
                waiting.discard(who)

    def finish(self) -> None:
        self.stop.set()
        for a in KIND:
            self.cmds[a].put(("stop",))
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while len(self.finals) < len(self.procs):
            self._take(deadline, set(self.procs) - set(self.finals))
        self.finished = True

    def reap(self) -> None:
        for p in self.procs.values():
            p.join(10 if self.finished else 0.5)
            if p.is_alive():
                p.kill()
                p.join(5)


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
    d = start_daemon(tables=TABLES)
    seg = {t: f"/shmreplay.{d.instance}.t.{t}" for t in CAPACITY}
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
