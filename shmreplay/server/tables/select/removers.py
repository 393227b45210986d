"""Removers: which committed item leaves when a writer needs a slot and the
table has no free one (Reverb's remover selector).

Each implements ``selectors.Selector``; ``pick(n, rng)`` returns n distinct
victims, which the table then removes through its one removal path.
Priorities do not matter to any of them (``samplers.unweighted``).

* ``fifo`` (default): oldest first, the replay buffer everyone expects;
* ``lifo``: newest first (keeps the initial data, e.g. demonstrations);
* ``uniform``: a random item, Reverb's "reservoir-like" choice.

Engine thread only, like every selector.
"""

from __future__ import annotations

import numpy as np

from ....wire.records import key_slots
from .samplers import OrderCount, UniformSampler, unweighted


class OrderRemover(OrderCount):
    ordered = False  # picks whole items: a reuse limit does not apply

    def pick(self, n: int, rng=None, beta: float = 0.0, uses_left=None):
        return unweighted(key_slots(self.order.pop(n, self.back)))


class UniformRemover:
    """A uniform sampler's dense members, drawn without replacement."""

    ordered = False

    def __init__(self, capacity: int):
        self.members = UniformSampler(capacity)

    def add(self, slots: np.ndarray, priorities=None) -> None:
        self.members.add(slots, None)

    def set(self, slots: np.ndarray, priorities=None) -> None:
        pass

    def remove(self, slots: np.ndarray) -> None:
        self.members.remove(slots)

    @property
    def mass(self) -> float:
        return self.members.mass

    def pick(self, n: int, rng=None, beta: float = 0.0, uses_left=None):
        return unweighted(self.members.distinct(n, rng))

    def check(self) -> bool:
        return True

    def rebuild(self, slots: np.ndarray, priorities=None) -> None:
        self.members.rebuild(slots, priorities)
