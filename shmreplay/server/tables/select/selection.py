"""A table's committed items as its selectors see them.

``Selection`` owns what decides which item a draw or an eviction picks:
the commit order (``order.py``), the sampler and the remover
(``selectors.py``), the reuse limit (``reuse.py``), the random generator,
the largest priority seen (a new item's default), the newest commit
number, and the count of leaf writes since the sampler's drift bound was last checked.  It reads the
segment's marks (state, stamps, times sampled, priorities) and writes the
priorities and times sampled of the items it is told about; the slot
books (``slots/``) are not its business.

Engine thread only (the ``Table`` owns one); no method may run
concurrently with another.
"""

from __future__ import annotations

import logging

import numpy as np

from ....schema import TableSpec
from ....wire.layout import COMMITTED, TableMap
from ....wire.records import make_keys
from .order import CommitOrder
from .reuse import ReuseLimit
from .selectors import make_remover, make_sampler
from .stamping import NO_PRIORITIES, stamp_new

log = logging.getLogger("shmreplayd.table")
_NONE = np.empty(0, np.int64)


class Selection:
    def __init__(self, spec: TableSpec, tmap: TableMap, seed=None):
        c = spec.capacity
        self.name = spec.name
        self.map = tmap
        self.capacity = c
        self.order = CommitOrder(c, tmap.state, tmap.gens, COMMITTED)
        self.sampler = make_sampler(spec.sampler, c, spec.alpha, self.order)
        self.remover = make_remover(spec.remover, c, self.order)
        self.reuse = (ReuseLimit(self.sampler, tmap.times, tmap.prios, spec.max_times_sampled,
                                 spec.name) if spec.max_times_sampled else None)
        self.rng = np.random.default_rng(seed)
        self.max_priority = 1.0
        self.seqno = 0  # commit number of the newest item
        self.updates_since_check = 0

    def keys_of(self, slots: np.ndarray) -> np.ndarray:
        return make_keys(self.map.gens[slots], slots)

    @property
    def mass(self) -> float:
        """> 0 iff the sampler can pick something."""
        return self.sampler.mass

    @property
    def least(self) -> float:
        """The smallest mass of one sampleable item (0: none)."""
        return self.sampler.least

    # ---- items in and out ----
    def stamp(self, slots: np.ndarray, given: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """New items' marks in the segment, written before their state says
        COMMITTED (a crash sees whole items): priority ``given`` (checked by
        the caller), else the largest seen so far, as PER gives a new
        transition; no uses; the commit numbers after the newest.  Returns
        their priorities and keys, for ``add`` (one kernel: stamping.py)."""
        if given is not None:
            self.max_priority = max(self.max_priority, float(given.max()))
        m = self.map
        prios, keys = stamp_new(slots, NO_PRIORITIES if given is None else given, self.max_priority,
                                m.prios, m.times, m.seqno, self.seqno, m.gens)
        self.seqno += slots.shape[0]
        return prios, keys

    def add(self, slots: np.ndarray, priorities: np.ndarray, keys: np.ndarray | None = None) -> None:
        """Newly committed items (in commit order) become selectable
        (``keys``: theirs, as ``stamp`` returned them; None: from the stamps)."""
        self.sampler.add(slots, priorities)
        self.remover.add(slots, priorities)
        self.order.push(self.keys_of(slots) if keys is None else keys)

    def restore(self) -> np.ndarray:
        """A recovered table: the segment's committed items become
        selectable, oldest first, and its newest commit number and largest
        priority are taken over.  Returns their slots."""
        m = self.map
        slots = np.flatnonzero(m.state == COMMITTED)
        slots = slots[np.argsort(m.seqno[slots], kind="stable")]
        if slots.shape[0]:
            prios = m.prios[slots]
            self.add(slots, prios)
            self.max_priority = max(1.0, float(prios.max()))
            self.seqno = int(m.seqno[slots].max())
        return slots

    def remove(self, slots: np.ndarray, sampler_done: bool = False) -> None:
        """Items leave (``sampler_done``: the sampler let them go already)."""
        if not sampler_done:
            self.sampler.remove(slots)
        self.remover.remove(slots)

    def victims(self, n: int) -> np.ndarray:
        """The slots of n items the remover picks to evict (not removed yet)."""
        return self.remover.pick(n, self.rng)[0]

    # ---- draws ----
    def pick(self, n: int, beta: float):
        """A draw's n picks: (keys, probabilities, weights, spent); ``spent``:
        items the reuse limit retires, out of the sampler already (the
        table removes and holds them).  Raises RateLimited (reuse.py) with
        nothing changed when the items with uses left cannot give n."""
        if self.reuse is None:
            return (*self.sampler.pick_keys(n, self.rng, beta, self.map.gens), _NONE)
        slots, probs, weights, spent = self.reuse.pick(n, self.rng, beta)
        return self.keys_of(slots), probs, weights, spent

    def update(self, keys: np.ndarray, priorities: np.ndarray) -> int:
        """A validated UPDATE (``treeops.check_update``) on private copies:
        returns how many keys still named their item."""
        m = self.map
        live, top = self.sampler.update(keys, priorities, m.gens, m.state, m.prios)
        if live:
            self.max_priority = max(self.max_priority, top)
        return live

    # ---- numerics ----
    def due_check(self, n: int) -> bool:
        """Count n leaf writes; True once per ``capacity`` of them, when the
        drift bound is to be checked: O(1) amortised."""
        self.updates_since_check += n
        if self.updates_since_check >= self.capacity:
            self.updates_since_check = 0
            return True
        return False

    def verify(self) -> bool:
        """Check the sampler against its drift bound; rebuild it from the
        segment's committed items if it fails (then False)."""
        if self.sampler.check():
            return True
        log.warning("table %s: sum tree outside its drift bound; rebuilding", self.name)
        slots = np.flatnonzero(self.map.state == COMMITTED)
        self.sampler.rebuild(slots, self.map.prios[slots])
        return False
