"""Removers: which committed item leaves when a writer needs a slot and the
table has no free one (Reverb's remover selector).

Interface, engine thread only: ``add(slots)`` on commit, ``remove(slots)``
whenever items leave for any reason, ``pick(n, rng)`` -> n victims (the table
then removes them through its one removal path).

* ``fifo`` (default): oldest first, the replay buffer everyone expects;
* ``lifo``: newest first (keeps the initial data, e.g. demonstrations);
* ``uniform``: a random item, Reverb's "reservoir-like" choice.
"""

from __future__ import annotations

import numpy as np

from .commands import SLOT_MASK
from .selectors import UniformSampler


class OrderRemover:
    def __init__(self, order, back: bool):
        self.order = order
        self.back = back

    def add(self, slots: np.ndarray) -> None:
        pass  # the table pushes commits onto the order itself

    def remove(self, slots: np.ndarray) -> None:
        pass  # order entries die lazily

    def pick(self, n: int, rng) -> np.ndarray:
        keys = self.order.pop(n, self.back)
        return (keys & np.uint64(SLOT_MASK)).astype(np.int64)


class UniformRemover:
    def __init__(self, capacity: int):
        self.members = UniformSampler(capacity)

    def add(self, slots: np.ndarray) -> None:
        self.members.add(slots, None)

    def remove(self, slots: np.ndarray) -> None:
        self.members.remove(slots)

    def pick(self, n: int, rng) -> np.ndarray:
        return self.members.pick(n, rng)


def make_remover(kind: str, capacity: int, order):
    if kind in ("fifo", "lifo"):
        return OrderRemover(order, back=kind == "lifo")
    if kind == "uniform":
        return UniformRemover(capacity)
    raise ValueError(kind)
