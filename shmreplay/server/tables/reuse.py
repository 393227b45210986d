"""Draws under a reuse limit (``max_times_sampled``).

Reverb removes an item once it was sampled N times; a batch drawn with
replacement must then not hold an item more often than it has uses left.
``draw_limited`` draws, keeps each item's first ``uses left`` occurrences,
takes exhausted items out of the sampler, and redraws the rest.  Ordered
samplers need none of this: they are given the uses directly.  ``draw``
is a table's sample with its limit applied: the draw, then the count of
each item's uses, and the items that reached the limit leave the table,
their slots held for the learner that drew them.

Engine thread only (it changes the sampler and the table).
"""

from __future__ import annotations

import numpy as np

from ...errors import RateLimited
from .counters import Blocked


def draw_limited(sampler, times: np.ndarray, prios: np.ndarray, max_times: int, n: int,
                 beta: float, rng, name: str):
    """(slots, probabilities, weights) of n draws.  Items whose uses this
    batch exhausts stay out of the sampler (the caller removes them from the
    table); if the sampler runs dry first (zero-priority items hold uses
    too), it is restored and ``Blocked`` raised, so a blocked sample takes
    nothing.  ``times``, ``prios``: each slot's samples so far and priority."""
    extra: dict[int, int] = {}   # uses taken in this batch, per slot
    out, removed, need = [], [], n
    try:
        while need:
            if not sampler.mass > 0:
                raise Blocked(RateLimited(
                    f"sample of {n} from table {name!r} timed out: the items with "
                    f"uses left have zero priority"))
            s, p, w = sampler.pick(need, rng, beta)
            uniq, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
            left = max_times - times[uniq].astype(np.int64) - np.array(
                [extra.get(int(u), 0) for u in uniq], dtype=np.int64)
            rank = np.empty(need, dtype=np.int64)
            by_slot = np.argsort(inv, kind="stable")
            starts = np.cumsum(counts) - counts
            rank[by_slot] = np.arange(need) - np.repeat(starts, counts)
            ok = rank < left[inv]
            took = np.minimum(counts, left)
            for u, t in zip(uniq.tolist(), took.tolist()):
                extra[u] = extra.get(u, 0) + t
            done = uniq[took == left]
            if done.shape[0]:
                sampler.remove(done)
                removed.append(done)
            out.append((s[ok], p[ok], w[ok]))
            need -= int(ok.sum())
    except Blocked:
        for done in removed:
            sampler.add(done, prios[done])
        raise
    return tuple(np.concatenate(parts) for parts in zip(*out))


def draw(table, owner: int, n: int, beta: float):
    """n draws from ``table`` under its reuse limit: (slots, probabilities,
    weights, hold id or 0).  Raises Blocked as ``draw_limited`` does."""
    spec, m, sampler = table.spec, table.map, table.sampler
    mts = spec.max_times_sampled
    if not mts:
        return (*sampler.pick(n, table.rng, beta), 0)
    if sampler.ordered:
        slots, probs, weights = sampler.pick(n, table.rng, beta,
                                             lambda s: mts - m.times[s].astype(np.int64))
    else:
        slots, probs, weights = draw_limited(sampler, m.times, m.prios, mts, n, beta, table.rng,
                                             spec.name)
    # random samplers: draw_limited took exhausted items out of the sampler already
    return slots, probs, weights, _count_uses(table, owner, slots, sampler_done=not sampler.ordered)


def _count_uses(table, owner: int, slots: np.ndarray, sampler_done: bool) -> int:
    """Count a batch's draws against max_times_sampled; items that reach it
    leave the table and their slots are held for ``owner`` (the hold id, 0
    for none).  ``sampler_done``: the draw took exactly those items out of
    the sampler."""
    uniq, counts = np.unique(slots, return_counts=True)
    m = table.map
    m.times[uniq] += counts.astype(np.uint32)
    done = uniq[m.times[uniq] >= table.spec.max_times_sampled]
    if done.shape[0] == 0:
        return 0
    table.remove_items(done, sampler_done)  # they have no uses left: removes none from uses_left
    table.stats["removed_after_max_samples"] += done.shape[0]
    return table.ledger.hold(owner, done)
