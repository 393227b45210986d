"""What one learner knows of a sharded table's shards: its agent on each,
what each last reported, and which are lost for good.

The learner's own shard (one on the node it runs on) is served in this
process by a ``ShardAgent`` object, a local client of that node's daemon:
its rows are gathered from the node's shared memory, with no Ray call.
Every other shard gets an agent actor pinned to its node and owned by
this process.

A call to an agent that fails tells the kind of failure apart:

* the agent answers ``down`` (its daemon does not answer): the shard is
  left out of this batch and asked again at the next;
* the agent actor died and its node is alive: a new agent is started
  (the next batch uses it);
* the agent actor died with its node (Ray says the node is dead): the
  shard is ``lost`` for good, with the items it last reported; the table
  serves on with the rest;
* the agent's daemon does not answer within ``shard_timeout``, or the
  agent within ``CALL_S`` more: left out of this batch (``lost`` when Ray
  says its node is dead);
* a rate limit's timeout, or bad input: the shard stays in service (its
  last report stands) and the error is the caller's.

Who calls it: the ``ShardedTable`` that owns it: draws and reports from
one thread at a time (the learner's, or its prefetch thread); its
``ShardUpdates`` (priority updates, the learner's thread) calls ``get``
meanwhile.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..errors import DaemonUnavailable, RateLimited, ReplayError, ReplayTimeout
from .shardagent import ANSWER_S, KEY, PROB, ShardAgent, row_dtype
from .shardhost import node_alive

class Emptied(ReplayError):
    """A shard the split counted on had nothing to draw when asked (its
    items' priorities went to 0, or a queue's went to another learner):
    its part is drawn from the others; it is not out of service."""


CALL_S = 10.0  # how much longer than its agent's own bound an agent's answer is waited for


class ShardBook:
    def __init__(self, shards: list, name: str, shard_timeout: float = ANSWER_S):
        self.shards, self.name, self.shard_timeout = list(shards), name, shard_timeout
        self.call_s = shard_timeout + CALL_S  # a call's answer, past the wait it asked for
        self.row = None  # the packed row (``bind``, once the table's fields are known)
        self.here = ray.get_runtime_context().get_node_id()
        self.lost: dict = {}  # shard -> {"node", "why", "items"}
        self.last: list = [{} for _ in self.shards]  # each shard's last good report
        self.local = next((i for i, s in enumerate(self.shards) if s.node == self.here), None)
        self.agents = [ShardAgent(s.socket, name, shard_timeout) if i == self.local else self._start_agent(i)
                       for i, s in enumerate(self.shards)]
        # the local agent's client is one thread's: draws and reports (the
        # prefetch thread, or the learner's) take it under this lock (the
        # learner's priority updates have a client of their own: shardupdates.py)
        self.local_lock = threading.Lock()

    count = property(lambda self: len(self.shards))

    def bind(self, fields) -> None:
        """The table's fields: what every shard's packed part must be."""
        self.row = row_dtype([f.to_wire() for f in fields])

    def _start_agent(self, i: int):
        s = self.shards[i]
        return ray.remote(ShardAgent).options(
            num_cpus=0, max_restarts=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=s.node, soft=False)
        ).remote(s.socket, self.name, self.shard_timeout)

    def close(self) -> None:
        for i, a in enumerate(self.agents):
            if a is None:  # closed already, or lost
                continue
            if i == self.local:
                with self.local_lock:
                    a.close()
            else:
                ray.kill(a)
        self.agents = [None] * len(self.shards)

    # ---- calls to every shard ----
    def call(self, method: str, *args, shards=None, timeout: float | None = None) -> dict:
        """``method(*args)`` on each shard in service (or ``shards``): shard ->
        its answer, or the exception it raised (``ray.get`` unwrapped);
        ``timeout``: the longest to wait for each (None: ``shard_timeout``
        and ``CALL_S``)."""
        timeout = self.call_s if timeout is None else timeout
        idx = [i for i in (range(self.count) if shards is None else shards) if i not in self.lost]
        refs = {i: getattr(self.agents[i], method).remote(*args) for i in idx if i != self.local}
        out = {}
        if self.local in idx:
            try:
                with self.local_lock:
                    out[self.local] = getattr(self.agents[self.local], method)(*args)
            except ReplayError as exc:
                out[self.local] = exc
        for i, ref in refs.items():
            out[i] = self.get(i, ref, timeout)
        return out

    def get(self, i: int, ref, timeout):
        """The answer of a call ``ref`` to shard i's agent, or the failure
        as a value: the exception it raised (unwrapped), DaemonUnavailable
        for no answer within ``timeout`` or an agent that died (the shard
        lost when its node did)."""
        try:
            return ray.get(ref, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref)
            if not node_alive(self.shards[i].node):  # an agent on a node that died before Ray told its callers
                return self._agent_died(i, DaemonUnavailable("no answer"))
            return DaemonUnavailable(f"shard {i} (node {self.shards[i].node[:12]}) did not answer within {timeout} s")
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            return cause
        except ray.exceptions.RayActorError as exc:
            return self._agent_died(i, exc)

    def _agent_died(self, i: int, exc) -> DaemonUnavailable:
        node = self.shards[i].node
        if not node_alive(node):
            self.lost[i] = {"node": node, "why": f"its node is gone: {type(exc).__name__}",
                            "items": self.last[i].get("size", 0)}
            self.agents[i] = None
            return DaemonUnavailable(f"shard {i} is lost: node {node[:12]} is gone")
        self.agents[i] = self._start_agent(i)
        return DaemonUnavailable(f"shard {i}'s agent died ({type(exc).__name__}); a new one serves the next batch")

    # ---- what ShardDraws asks ----
    def reports(self, exclude=()) -> dict:
        """shard -> its report, or ``{"down": why}``, for shards in service
        not in ``exclude``."""
        got = self.call("report", shards=[i for i in range(self.count) if i not in exclude])
        out = {i: {"down": str(r)} if isinstance(r, BaseException) else self._checked(i, r) for i, r in got.items()}
        for i, info in self.lost.items():
            if i not in exclude:
                out[i] = {"down": f"lost: {info['why']}"}
        return out

    def last_mass(self, i: int) -> float:
        return float(self.last[i].get("mass", 0.0))

    def last_least(self) -> float:
        seen = [r["least"] for r in self.last if r.get("least", 0) > 0]
        return min(seen) if seen else 1.0

    def exchange(self, counts: dict, beta: float, deadline: float | None, place) -> tuple[dict, dict, dict]:
        """One call to each shard in service: a draw of its count where it
        has one, a report elsewhere; ``place(k)``: the batch's rows the
        local shard's k rows are gathered into (views).  Returns ({shard:
        (data, keys, p within the shard)}, {shard: why its draw failed},
        {shard: its report})."""
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        live = [i for i in range(self.count) if i not in self.lost]
        calls = {i: self.agents[i].draw.remote(counts[i], beta, wait) if i in counts else self.agents[i].report.remote()
                 for i in live if i != self.local}
        answers = {}
        if self.local in live:
            try:
                with self.local_lock:
                    mine = self.agents[self.local]
                    answers[self.local] = (mine.draw_into(place(counts[self.local]), beta, wait)
                                           if self.local in counts else mine.report())
            except ReplayError as exc:
                answers[self.local] = exc
        for i, ref in calls.items():
            answers[i] = self.get(i, ref, None if wait is None else wait + self.call_s)
        got, failed, fresh = {}, {}, {}
        for i, a in answers.items():
            if isinstance(a, BaseException):
                # a limit's timeout or bad input leaves the shard in service:
                # its last report stands (marking it down would leave it out of
                # the next batches, and all of them out would stop the table)
                kept = not isinstance(a, DaemonUnavailable) and bool(self.last[i])
                fresh[i] = self.last[i] if kept else {"down": str(a)}
                if i in counts:  # a daemon too slow to answer: this batch goes on without it
                    slow = isinstance(a, ReplayTimeout) and not isinstance(a, RateLimited)
                    failed[i] = DaemonUnavailable(f"shard {i} did not answer in time: {a}") if slow else a
                continue
            report, rows = a if i in counts else (a, None)
            fresh[i] = self._checked(i, report)
            if i not in counts:
                continue
            if "down" in fresh[i]:
                failed[i] = DaemonUnavailable(fresh[i]["down"])
            elif rows is None:
                failed[i] = Emptied(f"shard {i} had nothing to draw (emptied since its last report)")
            elif i == self.local:  # drawn in place by this process's own client
                got[i] = (rows.data, rows.keys, rows.probabilities)
            elif bad := _bad_part(rows, counts[i], self.row):
                failed[i] = DaemonUnavailable(f"shard {i} sent {bad}: left out")
            else:
                got[i] = _unpacked(rows)
        for i, info in self.lost.items():
            fresh[i] = {"down": f"lost: {info['why']}"}
        return {i: got[i] for i in counts if i in got}, failed, fresh

    def _checked(self, i: int, r) -> dict:
        """A report as the learner may use it: checked (``_bad_report``),
        kept as the shard's last good one; else ``{"down": why}``."""
        if not isinstance(r, dict):
            return {"down": f"shard {i} answered {type(r).__name__}, not a report: left out"}
        if "down" in r:
            return {"down": str(r["down"])}
        bad = _bad_report(r)
        if bad:  # one shard's nonsense never stops the batch: it is left out, and said why
            return {"down": f"shard {i} reported {bad}: left out"}
        self.last[i] = r
        return r


def _bad_report(r) -> str | None:
    """What is wrong with a shard's report (None: nothing): masses must be
    finite and >= 0, sizes ints >= 0."""
    try:
        mass, least = float(r["mass"]), float(r["least"])
        size = r["size"]
    except (KeyError, TypeError, ValueError):
        return f"a report without mass, least and size ({type(r).__name__})"
    if not (math.isfinite(mass) and math.isfinite(least) and mass >= 0 and least >= 0):
        return f"mass {mass!r}, least {least!r} (not finite and >= 0)"
    if not isinstance(size, int) or size < 0:
        return f"size {size!r}"
    return None


def _bad_part(rec, k: int, row: np.dtype) -> str | None:
    """What is wrong with a shard's packed part of k rows (None: nothing)."""
    if not isinstance(rec, np.ndarray) or rec.dtype != row or rec.shape != (k,):
        got = f"{rec.dtype}{rec.shape}" if isinstance(rec, np.ndarray) else type(rec).__name__
        return f"{got} for {k} rows of the table's packed row"
    p = rec[PROB]
    if not np.all((p > 0) & (p <= 1)):
        return "probabilities outside (0, 1]"
    return None


def _unpacked(rec: np.ndarray) -> tuple[dict, np.ndarray, np.ndarray]:
    """A packed part's rows as views: (field -> rows, keys, probabilities)."""
    names = [n for n in rec.dtype.names if n not in (KEY, PROB)]
    return {n: rec[n] for n in names}, rec[KEY], rec[PROB]
