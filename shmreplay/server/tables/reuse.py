"""Random draws under a reuse limit (``max_times_sampled``).

Reverb removes an item once it was sampled N times; a batch drawn with
replacement must then not hold an item more often than it has uses left.
``draw_limited`` draws, keeps each item's first ``uses left`` occurrences,
takes exhausted items out of the sampler, and redraws the rest.  Ordered
samplers need none of this: they are given the uses directly.

Engine thread only (it changes the sampler).
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
