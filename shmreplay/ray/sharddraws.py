"""One batch drawn over a sharded table's shards, as from one table of their union.

For a batch of B: every shard in service reports its mass M_s (sum of
p^alpha of its sampleable items; their count on a uniform or order
sampler) and its smallest item mass m_s (shardagent.py); ``shardmath.split``
cuts B over the shards by stratified positions over the cumulated masses;
each shard draws its count from its own table (stratified, the table's own
limits and reuse rules) and packs the rows; the learner's own shard is
drawn through its local client, straight into the batch's arrays.  Each
row then carries

* P(i) = P_s(i) x M_s / M, P_s(i) the probability the shard's table gave
  it and M the sum of the masses the split used: exactly the chance the
  draw picked it (split picks shard s with M_s / M, the shard then item i
  with P_s(i));
* its weight (P(i) / P_min)^-beta with P_min = min_s m_s / M, which is
  (p_i^alpha / min_s m_s)^-beta: the weight one table of the union gives.

An order sampler's rows (fifo, lifo, a queue) carry probability and weight
1, as a local table's; a queue batch is split by the shards' ready items,
no shard asked for more than it holds.

Shards left out of a batch are said in it (``ShardBatch.missing``: shard
index -> why, and ``mass_left_out``, the mass they last reported): a
daemon that does not answer, a shard whose node is gone (``lost``, for
good).  A shard whose draw fails after the split (its daemon died in
between) is left out and its part drawn from the others in a next round
(at most one round per shard); those rows carry their own round's P.
Rows a shard gave for a batch that then failed (a limit's timeout in
another shard) are kept and start the next batch: a queue's items are
never drawn and dropped.

Who calls it: the ``ShardedTable`` that owns it, one thread at a time (its
``sample``: the caller's thread, or the prefetch thread of ``iterate``).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import ray

from ..client.gather import SampleBatch
from ..errors import DaemonUnavailable, RateLimited, ReplayError
from . import shardmath
from .shardbook import Emptied

POLL_S = (0.02, 0.5)  # waits between reports while nothing can be drawn: first, longest


@dataclasses.dataclass
class ShardBatch(SampleBatch):
    """A ``SampleBatch`` drawn over shards: ``shards[i]`` is the shard row
    i came from (pass it to ``ShardedTable.update_priorities``); ``missing``
    the shards left out (index -> why), ``mass_left_out`` the mass they
    last reported (0 when none was)."""

    shards: np.ndarray = None
    missing: dict = dataclasses.field(default_factory=dict)
    mass_left_out: float = 0.0


@dataclasses.dataclass
class Part:
    """Rows one shard gave: field -> rows, their keys, their p^alpha
    (P_s(i) x M_s; None on an order sampler) and the split's total mass M;
    ``at``: where in the batch its rows already are (the learner's own
    shard draws straight into the batch's tail), None: to be copied in."""

    shard: int
    data: dict
    keys: np.ndarray
    p_alpha: np.ndarray | None
    total: float
    at: int | None = None

    def __len__(self) -> int:
        return self.keys.shape[0]

    def detached(self) -> "Part":
        """The part with rows of its own (kept past its batch: carried)."""
        if self.at is None:
            return self
        return Part(self.shard, {f: a.copy() for f, a in self.data.items()}, self.keys.copy(),
                    None if self.p_alpha is None else self.p_alpha.copy(), self.total)

    def cut(self, k: int) -> tuple["Part", "Part"]:
        """The first k rows, and the rest."""
        def half(s):
            return Part(self.shard, {f: a[s] for f, a in self.data.items()}, self.keys[s],
                        None if self.p_alpha is None else self.p_alpha[s], self.total)
        return half(slice(None, k)), half(slice(k, None))


class ShardDraws:
    def __init__(self, book, fields, ordered: bool, seed=None, split: str = "mass"):
        """``book``: the table's ``ShardBook`` (reports, agents, the local
        shard); ``ordered``: an order sampler (probabilities and weights 1);
        ``split``: "mass", or "in_turn", the rule of a client that samples
        each server in turn (Reverb's), kept to compare against: its rows'
        P(i) are not what it drew with."""
        if split not in ("mass", "in_turn"):
            raise ReplayError(f"split must be 'mass' or 'in_turn', got {split!r}")
        self.book, self.fields, self.ordered, self.split = book, fields, ordered, split
        self.rng = np.random.default_rng(seed)
        self.carry: list[Part] = []  # what shards gave for a batch that then failed
        self.reports: dict = {}  # each shard's last answer: the next batch is split by these

    def sample(self, n: int, beta: float, out: ShardBatch | None, timeout: float | None) -> ShardBatch:
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ReplayError(f"batch_size must be an int >= 1, got {n!r}")
        out = out if out is not None else new_batch(self.fields, n)
        if len(out) != n:
            raise ReplayError(f"out= holds {len(out)} rows, the batch asks for {n}")
        deadline = None if timeout is None else time.monotonic() + timeout
        parts, missing, left_out = self._carried(n), {}, {}
        tail = n  # the local shard's rows go straight into out, from its end back
        rows, least, wait, usable, drawn = sum(map(len, parts)), np.inf, POLL_S[0], None, []
        if not self.reports:
            self.reports = self.book.reports()  # the first batch: a round of reports to split by
        while rows < n:
            if usable is None:  # the shards to split over, by their last answers
                for i, r in self.reports.items():
                    if "down" in r and i not in missing:
                        missing[i], left_out[i] = r["down"], self.book.last_mass(i)
                if len(missing) >= self.book.count:
                    self.reports = {}  # ask every shard again next time
                    self.carry = [p.detached() for p in parts] + self.carry
                    raise DaemonUnavailable(f"every shard of the table is out of service: {missing}")
                usable = {i: r for i, r in self.reports.items() if i not in missing and r["mass"] > 0}
                split = dict(usable)
                if not usable:
                    if deadline is not None and time.monotonic() + wait > deadline:
                        self.carry = [p.detached() for p in parts] + self.carry
                        raise RateLimited(f"no shard of the table held an item to draw within {timeout} s"
                                          + (f" (left out: {missing})" if missing else ""))
                    time.sleep(wait)  # every shard empty: as a local table's sample, wait for items
                    wait = min(2 * wait, POLL_S[1])
                    # the missing keep their last answer: the next batch says them missing too
                    self.reports, usable = {**self.reports, **self.book.reports(exclude=missing)}, None
                    continue
            counts = self._counts(usable, n - rows)
            got, failed, fresh = self.book.exchange(counts, beta, deadline, lambda k: _rows_of(out, tail - k, tail))
            self.reports = {**self.reports, **fresh}  # the next batch's split
            for shard, (data, keys, p_local) in got.items():
                at = None
                if shard == self.book.local:  # drawn into out[tail - k:tail]
                    at = tail = tail - keys.shape[0]
                part = Part(shard, data, keys, None if self.ordered else p_local * usable[shard]["mass"], 0.0, at)
                parts.append(part)
                drawn.append(part)
                rows += keys.shape[0]
            for shard, why in failed.items():
                if isinstance(why, DaemonUnavailable):
                    missing[shard], left_out[shard] = str(why), usable[shard]["mass"]
                elif not isinstance(why, Emptied):  # a limit's timeout, bad input: keep what came
                    _settle(drawn, usable, split)
                    self.carry = [p.detached() for p in parts] + self.carry
                    raise why
                del usable[shard]  # its part is drawn again from the rest (rejection: the rest's distribution)
            if not usable or rows == n:
                # every row drawn over this split was drawn as from the union
                # of the shards that stayed in it: its P and P_min are theirs
                _settle(drawn, usable, split)
                if usable:
                    least = min(least, min(_least_share(self.reports.get(i, r), r) for i, r in usable.items()))
                usable, drawn = None, []
        self._finish(parts, out, beta, least)
        out.missing, out.mass_left_out = dict(missing), float(sum(left_out.values()))
        return out

    def _carried(self, n: int) -> list:
        """Up to n rows of what a failed batch got, oldest first."""
        parts, rows = [], 0
        while self.carry and rows < n:
            part = self.carry.pop(0)
            if rows + len(part) > n:
                part, rest = part.cut(n - rows)
                self.carry.insert(0, rest)
            parts.append(part)
            rows += len(part)
        return parts

    def _counts(self, usable: dict, n: int) -> dict:
        """Draws per usable shard: by mass (``shardmath.split``); an order
        sampler's by ready items, none over what a shard holds unless the
        shards hold fewer than n in all (then the largest waits for more)."""
        ids = sorted(usable)
        if len(ids) == 1:  # the whole batch, whatever the rule (no random draw needed)
            return {ids[0]: n}
        if self.split == "in_turn":
            counts = shardmath.in_turn(n, len(ids))
        else:
            counts = shardmath.split([usable[i]["mass"] for i in ids], n, self.rng)
        out = dict(zip(ids, (int(c) for c in counts)))
        if self.ordered:
            size = {i: int(usable[i]["mass"]) for i in ids}
            extra = sum(max(0, out[i] - size[i]) for i in ids)
            for i in ids:
                out[i] = min(out[i], size[i])
            for i in sorted(ids, key=lambda i: size[i] - out[i], reverse=True):
                give = min(extra, size[i] - out[i])
                out[i] += give
                extra -= give
            out[max(ids, key=lambda i: size[i])] += extra
        return {i: c for i, c in out.items() if c > 0}

    def _finish(self, parts: list, out: ShardBatch, beta: float, least: float) -> None:
        """Copy every part's rows into the batch, with its shard, P and weight
        (a batch of carried rows only: against the last minimum reported)."""
        if not np.isfinite(least):
            least = self.book.last_least()
        at = 0
        for part in parts:
            k = len(part)
            if part.at is not None:  # its rows and keys are in place
                sl = slice(part.at, part.at + k)
            else:
                sl = slice(at, at + k)
                at += k
                for f in self.fields:
                    out.data[f.name][sl] = part.data[f.name]
                out.keys[sl] = part.keys
            out.shards[sl] = part.shard
            if part.p_alpha is None:
                out.probabilities[sl] = 1.0
                out.weights[sl] = 1.0
            else:
                out.probabilities[sl] = shardmath.probabilities(part.p_alpha, part.total)
                out.weights[sl] = shardmath.weights(part.p_alpha, part.total, least, beta)
        out.redraws = 0


def _settle(drawn: list, usable: dict, split: dict) -> None:
    """The total mass of the parts drawn over one split: the shards that
    stayed in it (those that failed were drawn again from the rest), or,
    when none did, those that gave rows."""
    kept = usable or {p.shard: split[p.shard] for p in drawn}
    total = float(sum(r["mass"] for r in kept.values()))
    for part in drawn:
        part.total = total


def _least_share(now: dict, split: dict) -> float:
    """A shard's least likely item's chance in the split: its smallest mass
    over its mass now (its report with this round's answer, else the
    split's), times the mass the split gave it; min over shards, over the
    split's total, is P_min.  With nothing written between the two
    reports, the shard's smallest mass itself."""
    r = now if "down" not in now and now.get("mass", 0) > 0 else split
    return r["least"] / r["mass"] * split["mass"]


def _rows_of(out: ShardBatch, lo: int, hi: int) -> SampleBatch:
    """Rows lo..hi of ``out`` as a batch of views (what the local shard's
    draw gathers into)."""
    return SampleBatch({f: a[lo:hi] for f, a in out.data.items()}, out.keys[lo:hi], out.probabilities[lo:hi],
                       out.weights[lo:hi])


def new_batch(fields, n: int) -> ShardBatch:
    """An empty batch of n rows of ``fields``."""
    return ShardBatch({f.name: np.empty((n, *f.shape), f.dtype) for f in fields}, np.empty(n, np.uint64),
                      np.empty(n), np.empty(n), shards=np.empty(n, np.int32))
