"""Samplers: which committed slots a sample returns, and with what probability.

Each implements ``selectors.Selector`` (see there for who calls it and
when).  Random samplers (prioritized, uniform) pick with replacement; the
reuse limit is applied on top (``reuse.ReuseLimit``).  Engine
thread only, like every selector.  Order samplers (fifo, lifo) are Reverb's:
each pick returns the oldest (newest) item, so without a reuse limit a batch
holds one item n times, and with ``max_times_sampled=N`` each item is
returned N times before the next one.
"""

from __future__ import annotations

import numpy as np

from ....wire.records import key_slots, make_keys
from . import sumtree, treeops
from .members import members_add, members_remove


class SamplerBase:
    """What a sampler without kernels of its own does by key: ``update``
    (the live keys' priorities stored, ``treeops.store_live``, then
    ``set``) and ``pick_keys`` (``pick``, then each slot stamped)."""

    scratch = (np.empty(0, np.int64), np.empty(0))  # grown on demand: slots, values

    @property
    def least(self) -> float:
        """The smallest mass one item adds (what a shard reports as its
        minimum, ray/shardmath.py): 1 where items are equally likely, 0
        when there is none."""
        return 1.0 if self.mass > 0 else 0.0

    def _scratch(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if self.scratch[0].shape[0] < n:
            self.scratch = (np.empty(n, np.int64), np.empty(n))
        return self.scratch

    def update(self, keys: np.ndarray, priorities: np.ndarray, gens: np.ndarray,
               state: np.ndarray, stored: np.ndarray) -> tuple[int, float]:
        """A validated UPDATE (``treeops.check_update``): the live keys'
        priorities into ``stored`` (the segment's) and this sampler.
        Returns (live keys, largest live priority)."""
        slots, values = self._scratch(keys.shape[0])
        live, top = treeops.store_live(keys, priorities, gens, state, stored, slots, values)
        if live:
            self.set(slots[:live], values[:live])  # set() keeps neither array
        return int(live), float(top)

    def pick_keys(self, n: int, rng, beta: float, gens: np.ndarray):
        """n picks as (keys, probabilities, weights), each slot stamped with
        its generation (``wire.records.make_keys``)."""
        slots, probs, weights = self.pick(n, rng, beta)
        return make_keys(gens[slots], slots), probs, weights


class PrioritizedSampler(SamplerBase):
    """P(i) = p_i^alpha / sum_j p_j^alpha, stratified over the batch.

    Importance weights are ``(P(i) / P_min) ** -beta``, i.e. normalised so
    the item with the smallest positive priority has weight 1 (the PER
    paper's ``w_i / max_j w_j``).  A zero priority is never sampled.
    """

    name = "prioritized"

    def __init__(self, capacity: int, alpha: float):
        self.capacity = capacity
        self.alpha = float(alpha)
        self.sums, self.mins = sumtree.new_trees(capacity)

    def _values(self, priorities: np.ndarray) -> np.ndarray:
        out = np.empty(priorities.shape[0], dtype=np.float64)
        sumtree.tree_values(priorities, self.alpha, out)
        return out

    ordered = False  # pick_keys and update: one kernel each (treeops)

    def set(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        sumtree.tree_update(self.sums, self.mins, slots, self._values(priorities))

    def update(self, keys: np.ndarray, priorities: np.ndarray, gens: np.ndarray,
               state: np.ndarray, stored: np.ndarray) -> tuple[int, float]:
        slots, values = self._scratch(keys.shape[0])
        live, top = treeops.apply_update(keys, priorities, self.alpha, gens, state, stored,
                                         self.sums, self.mins, slots, values)
        return int(live), float(top)

    def pick_keys(self, n: int, rng, beta: float, gens: np.ndarray):
        """n stratified picks as (keys, probabilities, weights), in one kernel."""
        slots, u01 = self._scratch(n)
        rng.random(out=u01[:n])
        keys, probs, weights = np.empty(n, np.uint64), np.empty(n), np.empty(n)
        treeops.draw_keys(self.sums, self.mins, u01[:n], beta, gens, slots[:n], keys, probs, weights)
        return keys, probs, weights

    add = set

    def remove(self, slots: np.ndarray) -> None:
        sumtree.tree_update(self.sums, self.mins, slots, np.zeros(slots.shape[0]))

    @property
    def mass(self) -> float:
        return float(self.sums[1])

    @property
    def least(self) -> float:
        """The smallest positive p^alpha (the min tree's root; +inf there
        when no item has a positive priority: 0 here)."""
        m = float(self.mins[1])
        return m if np.isfinite(m) else 0.0

    def pick(self, n: int, rng, beta: float = 0.0, uses_left=None):
        u01 = rng.random(n)
        slots = np.empty(n, dtype=np.int64)
        probs = np.empty(n, dtype=np.float64)
        weights = np.empty(n, dtype=np.float64)
        sumtree.tree_draw(self.sums, self.mins, u01, beta, slots, probs, weights)
        return slots, probs, weights

    def check(self) -> bool:
        """True if the drift bound holds (sumtree.tree_check)."""
        return bool(sumtree.tree_check(self.sums, self.mins)[2])

    def rebuild(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        """Rebuild both trees from the authoritative (slot, priority) pairs."""
        leaves = np.zeros(self.capacity)
        leaves[slots] = self._values(priorities)
        sumtree.tree_rebuild(self.sums, self.mins, leaves)


class UniformSampler(SamplerBase):
    """Every committed item equally likely, picks independent (with replacement).

    Members sit in a dense array with a position index (the kernels of
    ``members.py``), so add, remove and pick are O(1) per item.  Priorities
    are stored but do not matter.
    """

    name = "uniform"
    ordered = False

    def __init__(self, capacity: int):
        self.members = np.zeros(capacity, dtype=np.int64)
        self.pos = np.full(capacity, -1, dtype=np.int64)
        self.count = 0

    def set(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self.count = members_add(self.members, self.pos, self.count, _slots(slots))

    def add(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self.set(slots, priorities)

    def remove(self, slots: np.ndarray) -> None:
        self.count = members_remove(self.members, self.pos, self.count, _slots(slots))

    @property
    def mass(self) -> float:
        return float(self.count)

    def pick(self, n: int, rng, beta: float = 0.0, uses_left=None):
        u01 = rng.random(n)
        picks = np.minimum((u01 * self.count).astype(np.int64), self.count - 1)
        slots = self.members[picks]
        return slots, np.full(n, 1.0 / self.count), np.ones(n)

    def check(self) -> bool:
        return True

    def rebuild(self, slots: np.ndarray, priorities: np.ndarray) -> None:
        self.pos[:] = -1
        self.count = 0
        self.set(slots, priorities)

    def distinct(self, n: int, rng) -> np.ndarray:
        """n distinct members chosen uniformly (the uniform remover's victims)."""
        return self.members[rng.choice(self.count, size=n, replace=False)].copy()


def _slots(slots) -> np.ndarray:
    """Slot numbers as the member kernels take them (one compiled signature)."""
    return np.ascontiguousarray(slots, dtype=np.int64)


def unweighted(slots: np.ndarray):
    """(slots, probabilities, importance weights) of picks for which the
    probability does not matter (order samplers, every remover): all 1."""
    n = slots.shape[0]
    return slots, np.ones(n), np.ones(n)


class OrderCount:
    """What the order selectors (fifo and lifo, samplers and removers)
    share: they pick from one end of the table's ``CommitOrder``, which
    the table keeps itself, so they only count their items; the entries of
    items that left die lazily in the order.  Priorities do not matter."""

    def __init__(self, order, back: bool):
        self.order = order
        self.back = back  # the newest end (lifo)
        self.count = 0

    def add(self, slots: np.ndarray, priorities=None) -> None:
        self.count += slots.shape[0]

    def set(self, slots: np.ndarray, priorities=None) -> None:
        pass

    def remove(self, slots: np.ndarray) -> None:
        self.count -= slots.shape[0]

    @property
    def mass(self) -> float:
        return float(self.count)

    def check(self) -> bool:
        return True

    def rebuild(self, slots: np.ndarray, priorities=None) -> None:
        self.count = slots.shape[0]


class OrderSampler(SamplerBase, OrderCount):
    """fifo: the oldest committed item; lifo: the newest (Reverb's Fifo/Lifo).
    Probabilities and weights are 1."""

    ordered = True

    def __init__(self, order, back: bool):
        super().__init__(order, back)
        self.name = "lifo" if back else "fifo"

    def pick(self, n: int, rng=None, beta: float = 0.0, uses_left=None):
        return unweighted(self.pick_slots(n, uses_left))

    def pick_slots(self, n: int, uses_left) -> np.ndarray:
        """Slots of n successive picks.  ``uses_left(slots)`` gives how many
        more samples each item may give, or is None for no limit; the caller
        has checked the items hold at least n uses between them."""
        keys = self.order.peek(1 if uses_left is None else n, self.back)
        slots = key_slots(keys)
        if uses_left is None:
            return np.full(n, slots[0])
        quota = np.minimum(uses_left(slots), n).astype(np.int64)
        k = int(np.searchsorted(np.cumsum(quota), n))  # items 0..k are needed
        reps = quota[:k + 1].copy()
        reps[-1] -= int(quota[:k + 1].sum()) - n
        return np.repeat(slots[:k + 1], reps)
