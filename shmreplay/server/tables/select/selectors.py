"""The selector interface: which committed slots a sample or an eviction picks.

As Reverb's ItemSelector: a table holds two selectors, its *sampler* (which
items a SAMPLE returns, with what probability) and its *remover* (which
item leaves when a writer needs a slot and none is free).  Either *picks*
slots: a sampler's picks make a draw (one SAMPLE), a remover's are evicted.  A selector sees
slot indices and priorities, never data (TorchRL's split).  The table calls
it from the engine thread only, never concurrently.

Kinds: samplers ``prioritized``, ``uniform``, ``fifo``, ``lifo``
(``samplers.py``); removers ``fifo``, ``lifo``, ``uniform`` (``removers.py``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from ....errors import SchemaError
from ....schema import REMOVERS, SAMPLERS
from .removers import OrderRemover, UniformRemover
from .samplers import OrderSampler, PrioritizedSampler, UniformSampler


class Selector(Protocol):
    #: picks come from one end of the commit order (fifo/lifo), so a reuse
    #: limit is applied by ``pick(uses_left=...)`` rather than by redrawing
    ordered: bool

    def add(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Newly committed slots become selectable."""

    def set(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Selectable slots get new priorities."""

    def remove(self, slots: np.ndarray) -> None:
        """Slots leave (evicted, sampled for the last time)."""

    @property
    def mass(self) -> float:
        """> 0 iff something can be picked."""

    def pick(self, n: int, rng: np.random.Generator, beta: float = 0.0,
             uses_left=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """n picks: (slots, probabilities, importance weights).  Samplers
        pick with replacement; removers pick n distinct slots.  Ordered
        samplers take ``uses_left(slots)``, how many more samples each item
        may give (None: no limit)."""

    def check(self) -> bool:
        """True if internal numerics hold (the sum tree's drift bound)."""

    def rebuild(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Start over from the authoritative (slot, priority) pairs."""


class Sampler(Selector, Protocol):
    """A table's sampler: a selector that also answers by key.  Each kind
    does both as cheaply as it can (the prioritized one: one kernel each,
    ``treeops.py``); the table never asks which kind it has."""

    def pick_keys(self, n: int, rng: np.random.Generator, beta: float,
                  gens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """n picks as (keys, probabilities, importance weights): each slot
        stamped with its generation in ``gens`` (``wire.records``)."""

    def update(self, keys: np.ndarray, priorities: np.ndarray, gens: np.ndarray,
               state: np.ndarray, stored: np.ndarray) -> tuple[int, float]:
        """A validated UPDATE by key: the priorities of keys still naming
        their item go into ``stored`` (the segment's) and the sampler;
        returns (live keys, largest live priority)."""


def make_sampler(kind: str, capacity: int, alpha: float, order) -> Sampler:
    if kind == "prioritized":
        return PrioritizedSampler(capacity, alpha)
    if kind == "uniform":
        return UniformSampler(capacity)
    if kind in ("fifo", "lifo"):
        return OrderSampler(order, back=kind == "lifo")
    raise SchemaError(f"unknown sampler {kind!r}; the kinds are {', '.join(SAMPLERS)}")


def make_remover(kind: str, capacity: int, order) -> Selector:
    if kind in ("fifo", "lifo"):
        return OrderRemover(order, back=kind == "lifo")
    if kind == "uniform":
        return UniformRemover(capacity)
    raise SchemaError(f"unknown remover {kind!r}; the kinds are {', '.join(REMOVERS)}")
