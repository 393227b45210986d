"""Removers: which committed item leaves when a writer needs a slot and the
table has no free one (Reverb's remover selector).

Each implements ``selectors.Selector``; ``pick(n, rng)`` returns n distinct
victims, which the table then removes through its one removal path.
Priorities do not matter to any of them.

* ``fifo`` (default): oldest first, the replay buffer everyone expects;
* ``lifo``: newest first (keeps the initial data, e.g. demonstrations);
* ``uniform``: a random item, Reverb's "reservoir-like" choice.
"""

from __future__ import annotations

import numpy as np

from ...wire.records import key_slots
from .samplers import UniformSampler


class _Remover:
    """What removers share: priorities and probabilities do not matter."""

    ordered = False

    def set(self, slots: np.ndarray, priorities) -> None:
        pass

    def check(self) -> bool:
        return True

    def _picked(self, slots: np.ndarray):
        n = slots.shape[0]
        return slots, np.ones(n), np.ones(n)


class OrderRemover(_Remover):
    def __init__(self, order, back: bool):
        self.order = order
        self.back = back
        self.count = 0

    def add(self, slots: np.ndarray, priorities=None) -> None:
        self.count += slots.shape[0]  # the table pushes commits onto the order itself

    def remove(self, slots: np.ndarray) -> None:
        self.count -= slots.shape[0]  # order entries die lazily

    @property
    def mass(self) -> float:
        return float(self.count)

    def pick(self, n: int, rng=None, beta: float = 0.0, uses_left=None):
        return self._picked(key_slots(self.order.pop(n, self.back)))

    def rebuild(self, slots: np.ndarray, priorities=None) -> None:
        self.count = slots.shape[0]


class UniformRemover(_Remover):
    def __init__(self, capacity: int):
        self.members = UniformSampler(capacity)

    def add(self, slots: np.ndarray, priorities=None) -> None:
        self.members.add(slots, None)

    def remove(self, slots: np.ndarray) -> None:
        self.members.remove(slots)

    @property
    def mass(self) -> float:
        return self.members.mass

    def pick(self, n: int, rng=None, beta: float = 0.0, uses_left=None):
        return self._picked(self.members.distinct(n, rng))

    def rebuild(self, slots: np.ndarray, priorities=None) -> None:
        self.members.rebuild(slots, priorities)
