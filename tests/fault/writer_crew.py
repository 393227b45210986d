"""The actors and the learner of ``test_writer_restart.py``: processes that
do exactly what the test orders, in rounds (``Crew.run``), and report what
each flush confirmed; the learner checks every row it samples."""

from __future__ import annotations

import collections
import queue
import time
import traceback

import numpy as np

import shmreplay

from writer_streams import (EP_LEN, GAMMA, KIND, N, PERIOD, SEQ_LEN, action_of, nstep_rows, obs_of,
                            reward_of, step_ids, torn_mask)

BATCH = {"nstep": 64, "seq": 32}
ROUND_TIMEOUT_S = 60.0


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
