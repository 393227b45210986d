"""Exact prioritized sampling over shards (issue 39, item 3): the sums a
learner makes of what each shard reports.  Pure numpy; any thread.

Shards s = 1..N each report their mass ``M_s`` (the sum of p_i^alpha over
their items), their smallest p^alpha ``m_s`` and their size.  A batch of
B drawn over them, the way one table of their union would draw it:

* ``split(masses, B, rng)``: how many of the batch each shard draws.  The
  total mass M is cut into B strata (stratum j: [jM/B, (j+1)M/B)), each
  gets one uniform position, and a shard draws as many items as positions
  fall in its span of the cumulated masses: E[count_s] = B M_s / M
  exactly, and a count is never 2 or more from it.  Each shard then draws
  its count from its own items by p^alpha (stratified, as a table does),
  so every draw of the batch picks item i with P(i) = p_i^alpha / M: the
  distribution of one table holding every shard's items.
* ``probabilities(p, M)``: P(i) = p_i^alpha / M, for items drawn anywhere.
* ``weights(p, M, m, n, beta)``: importance weights against the global
  minimum, (P(i) / P_min)^-beta with P_min = m / M (m the smallest of the
  shards' minima): at most 1 over the union, as one table's.
* ``in_turn(B, shards)``: the rule a client that samples each server in
  turn follows (Reverb's), B / N draws a shard whatever its mass; kept to
  show, in the tests, that it is not the union's distribution.

A shard with no mass (empty, or all priorities 0) gets no draw; a batch
over shards with no mass at all is refused.
"""

from __future__ import annotations

import numpy as np

from ..errors import ReplayError


def split(masses, batch: int, rng: np.random.Generator) -> np.ndarray:
    """Draws per shard (int64, summing to ``batch``) by stratified positions
    over the cumulated ``masses``."""
    m = np.asarray(masses, np.float64)
    if m.ndim != 1 or m.size == 0 or not np.all(np.isfinite(m)) or np.any(m < 0):
        raise ReplayError(f"shard masses must be finite and >= 0, one a shard; got {masses!r}")
    total = m.sum()
    if not total > 0:
        raise ReplayError("no shard holds an item with priority: nothing to sample yet")
    if batch < 1:
        raise ReplayError(f"batch must be >= 1, got {batch}")
    positions = (np.arange(batch) + rng.random(batch)) * (total / batch)
    edges = np.cumsum(m)
    edges[-1] = np.inf  # rounding may leave the last position a hair past the sum
    shard = np.searchsorted(edges, positions, side="right")
    return np.bincount(shard, minlength=m.size).astype(np.int64)


def probabilities(p_alpha, total_mass: float) -> np.ndarray:
    """P(i) of items whose p^alpha is ``p_alpha``, over the union's mass."""
    return np.asarray(p_alpha, np.float64) / float(total_mass)


def weights(p_alpha, total_mass: float, global_min: float, beta: float) -> np.ndarray:
    """(P(i) / P_min)^-beta, P_min = global_min / total_mass: 1 for the
    least likely item of the union, below 1 for the rest."""
    p = probabilities(p_alpha, total_mass)
    return (p / (float(global_min) / float(total_mass))) ** (-float(beta))


def in_turn(batch: int, shards: int) -> np.ndarray:
    """Draws per shard when a client samples each in turn: an equal share
    (the first ``batch % shards`` one more), whatever their masses."""
    counts = np.full(shards, batch // shards, np.int64)
    counts[: batch % shards] += 1
    return counts
