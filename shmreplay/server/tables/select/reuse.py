"""Picks under a reuse limit (``max_times_sampled``).

Reverb removes an item once it was sampled N times; a batch picked with
replacement must then not hold an item more often than it has uses left.
``pick_limited`` picks, keeps each item's first ``uses left`` occurrences,
takes exhausted items out of the sampler, and picks again for the rest.
Ordered samplers need none of this: they are given the uses directly.
``ReuseLimit`` is a table's limit over its sampler: a draw's picks, each
item's uses counted, and the items that reached the limit named, out of
the sampler already, for the table to remove and hold.

It is handed what it works on (the sampler, and the segment's times and
priorities arrays) and reaches into nothing else.  Engine thread only (it
changes the sampler and the times sampled).
"""

from __future__ import annotations

import numpy as np

from ....errors import RateLimited


def pick_limited(sampler, times: np.ndarray, prios: np.ndarray, max_times: int, n: int,
                 beta: float, rng, name: str):
    """(slots, probabilities, weights) of n picks.  Items whose uses this
    batch exhausts stay out of the sampler (the caller removes them from the
    table); if the sampler runs dry first (zero-priority items hold uses
    too), it is restored and ``RateLimited`` raised (the table parks the
    request), so a refused draw takes nothing.  ``times``, ``prios``: each slot's samples so far and priority."""
    extra: dict[int, int] = {}   # uses taken in this batch, per slot
    out, removed, need = [], [], n
    try:
        while need:
            if not sampler.mass > 0:
                raise RateLimited(f"sample of {n} from table {name!r} timed out: the items "
                                  "with uses left have zero priority")
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
    except RateLimited:
        for done in removed:
            sampler.add(done, prios[done])
        raise
    return tuple(np.concatenate(parts) for parts in zip(*out))



class ReuseLimit:
    def __init__(self, sampler, times: np.ndarray, prios: np.ndarray, max_times: int, name: str):
        """``sampler``: the table's; ``times``, ``prios``: the segment's
        times sampled and priority of each slot; ``name``: the table's, for
        messages."""
        self.sampler = sampler
        self.times = times
        self.prios = prios
        self.max_times = max_times
        self.name = name

    def uses_left(self, slots: np.ndarray) -> np.ndarray:
        return self.max_times - self.times[slots].astype(np.int64)

    def pick(self, n: int, rng, beta: float):
        """n picks under the limit: (slots, probabilities, weights, spent).
        Each pick counts as a use; ``spent`` are the items that reached the
        limit, already out of the sampler.  Raises RateLimited as
        ``pick_limited`` does, having changed nothing."""
        s = self.sampler
        if s.ordered:
            slots, probs, weights = s.pick(n, rng, beta, self.uses_left)
        else:
            slots, probs, weights = pick_limited(s, self.times, self.prios, self.max_times, n,
                                                 beta, rng, self.name)
        uniq, counts = np.unique(slots, return_counts=True)
        self.times[uniq] += counts.astype(np.uint32)
        spent = uniq[self.times[uniq] >= self.max_times]
        if s.ordered and spent.shape[0]:
            s.remove(spent)  # random samplers: pick_limited took them out already
        return slots, probs, weights, spent
