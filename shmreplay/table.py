"""A replay table as the daemon sees it: slot life cycle, sampler, stats.

Slot life cycle (state array in the segment)::

    FREE --reserve--> RESERVED --commit--> COMMITTED --evict/reserve--> RESERVED
      ^                  |  abort, or the writer's lease ends              |
      +------------------+-------------------------------------------------+

The generation stamp of a slot is bumped when it is reserved, before the
writer learns the slot index.  A key is ``gen << 32 | slot``; a reader that
sampled a key and then finds a different stamp knows the row was (or is
being) overwritten.  Slots are handed out from a free list first, then by
evicting the oldest committed item (the default remover, oldest-first); the
commit-order queue holds keys, so items removed out of order simply fail the
key check when they come up for eviction.

Engine thread only: no method may be called concurrently with another.
"""

from __future__ import annotations

import logging

import numpy as np

from .commands import SLOT_BITS, SLOT_MASK
from .errors import CapacityError, EmptyTable, PriorityError, ProtocolError, ReplayError
from .priorities import check_priorities
from .layout import COMMITTED, FREE, LIVE_INSERTS, LIVE_SIZE, RESERVED, TableMap
from .schema import TableSpec
from .selectors import make_sampler
from .slotqueue import SlotQueue

log = logging.getLogger("shmreplayd.table")


class Table:
    def __init__(self, table_id: int, spec: TableSpec, tmap: TableMap, seed=None):
        self.id = table_id
        self.spec = spec
        self.map = tmap
        self.segment_name = tmap.seg.name
        c = spec.capacity
        self.sampler = make_sampler(spec.sampler, c, spec.alpha)
        self.free = SlotQueue(c)
        self.free.push(np.arange(c, dtype=np.int64))
        self.order = SlotQueue(c, dtype=np.uint64)
        self.reservations: dict[int, list] = {}
        self.next_rid = 1
        self.max_priority = 1.0
        self.rng = np.random.default_rng(seed)
        self.updates_since_check = 0
        self.stats = {"inserts": 0, "reservations": 0, "samples": 0, "sample_calls": 0, "evictions": 0,
                      "stale_priority_updates": 0, "priority_updates": 0,
                      "reclaimed_reservations": 0, "tree_rebuilds": 0}

    @property
    def size(self) -> int:
        return int(self.map.live[LIVE_SIZE])

    def _set_size(self, delta: int) -> None:
        self.map.live[LIVE_SIZE] = self.size + delta

    def _keys(self, slots: np.ndarray) -> np.ndarray:
        return (self.map.gens[slots].astype(np.uint64) << np.uint64(SLOT_BITS)) | slots.astype(np.uint64)

    def _current(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, mask of keys that still name the committed item they were drawn for)."""
        slots = (keys & np.uint64(SLOT_MASK)).astype(np.int64)
        m = self.map
        live = (m.state[slots] == COMMITTED) & (
            m.gens[slots].astype(np.uint64) == (keys >> np.uint64(SLOT_BITS)))
        return slots, live

    # ---- writers ----
    def reserve(self, owner: int, n: int) -> tuple[int, np.ndarray, bool]:
        c = self.spec.capacity
        if not 1 <= n <= c:
            raise CapacityError(f"table {self.spec.name!r}: cannot reserve {n} slots (capacity {c})")
        if len(self.free) + self.size < n:
            raise CapacityError(
                f"table {self.spec.name!r}: only {len(self.free) + self.size} of {c} slots are "
                f"free or evictable; the rest are reserved by writers that have not committed")
        slots = self.free.pop(n)
        if slots.shape[0] < n:
            slots = np.concatenate((slots, self._evict(n - slots.shape[0])))
        m = self.map
        m.state[slots] = RESERVED
        m.prios[slots] = 0.0
        m.gens[slots] += np.uint32(1)  # wraps at 2**32 by design
        rid = self.next_rid
        self.next_rid += 1
        self.stats["reservations"] += 1
        self.reservations[rid] = [owner, slots, 0]  # owner, slots, how many committed
        contiguous = bool(n == 1 or (slots[-1] - slots[0] == n - 1 and np.all(np.diff(slots) == 1)))
        return rid, slots, contiguous

    def _evict(self, n: int) -> np.ndarray:
        out = []
        got = 0
        while got < n:
            keys = self.order.pop(n - got)
            if keys.shape[0] == 0:  # cannot happen while size >= n; defend anyway
                raise CapacityError(f"table {self.spec.name!r}: eviction queue ran dry")
            slots, live = self._current(keys)
            slots = slots[live]
            out.append(slots)
            got += slots.shape[0]
        slots = np.concatenate(out)
        self.sampler.remove(slots)
        self._set_size(-slots.shape[0])
        self.stats["evictions"] += slots.shape[0]
        return slots

    def _entry(self, owner: int, rid: int) -> list:
        entry = self.reservations.get(rid)
        if entry is None or entry[0] != owner:
            raise ProtocolError(f"table {self.spec.name!r}: reservation {rid} is not yours or not open")
        return entry

    def commit(self, owner: int, rid: int, priorities: np.ndarray | None,
               offset: int = 0, n: int | None = None) -> None:
        """Commit slots ``[offset, offset + n)`` of a reservation.  A writer
        may commit a reservation (its lease) in several parts, in order."""
        entry = self._entry(owner, rid)
        _, slots, done = entry
        if n is None:
            n = slots.shape[0] - done
        if offset != done or n < 1 or done + n > slots.shape[0]:
            raise ProtocolError(
                f"table {self.spec.name!r}: commit of [{offset}, {offset + n}) of reservation {rid} "
                f"is out of order (next is {done} of {slots.shape[0]})")
        if priorities is not None:
            try:
                check_priorities(priorities, n, f"commit to table {self.spec.name!r}", self.spec.alpha)
            except PriorityError:
                self.abort(owner, rid)
                raise
        part = slots[done:done + n]
        entry[2] = done + n
        if entry[2] == slots.shape[0]:
            del self.reservations[rid]
        if priorities is None:
            priorities = np.full(n, self.max_priority)
        else:
            self.max_priority = max(self.max_priority, float(priorities.max()))
        m = self.map
        m.prios[part] = priorities
        m.state[part] = COMMITTED
        self.sampler.set(part, priorities)
        self.order.push(self._keys(part))
        self._set_size(n)
        m.live[LIVE_INSERTS] += np.uint64(n)
        self.stats["inserts"] += n
        self._count_updates(n)

    def abort(self, owner: int, rid: int) -> int:
        """Free the slots of a reservation not committed yet; returns how many."""
        _, slots, done = self._entry(owner, rid)
        del self.reservations[rid]
        rest = slots[done:]
        self.map.state[rest] = FREE
        self.free.push(rest)
        return rest.shape[0]

    def release_owner(self, owner: int) -> int:
        """Free every slot an owner reserved but never committed (its lease ended)."""
        rids = [rid for rid, entry in self.reservations.items() if entry[0] == owner]
        n = sum(self.abort(owner, rid) for rid in rids)
        self.stats["reclaimed_reservations"] += n
        return n

    # ---- readers ----
    def sample(self, n: int, beta: float):
        if not np.isfinite(beta) or beta < 0:
            raise ReplayError(f"beta must be finite and >= 0, got {beta}")
        if not self.sampler.mass > 0:
            raise EmptyTable(f"table {self.spec.name!r} has no sampleable items "
                             f"({self.size} committed)")
        slots, probs, weights = self.sampler.sample(self.rng.random(n), beta)
        self.stats["samples"] += n
        self.stats["sample_calls"] += 1
        return self._keys(slots), probs, weights

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> int:
        n = keys.shape[0]
        check_priorities(priorities, n, f"update_priorities on table {self.spec.name!r}",
                         self.spec.alpha)
        top = int((keys & np.uint64(SLOT_MASK)).max()) if n else 0
        if top >= self.spec.capacity:
            raise ProtocolError(
                f"update_priorities on table {self.spec.name!r}: key names slot {top} "
                f"beyond capacity {self.spec.capacity}")
        m = self.map
        slots, live = self._current(keys)
        slots, priorities = slots[live], priorities[live]
        stale = n - slots.shape[0]
        if slots.shape[0]:
            m.prios[slots] = priorities
            self.sampler.set(slots, priorities)
            self.max_priority = max(self.max_priority, float(priorities.max()))
        self.stats["stale_priority_updates"] += stale
        self.stats["priority_updates"] += n - stale
        self._count_updates(n)
        return stale

    # ---- numerics ----
    def _count_updates(self, n: int) -> None:
        # check the drift bound once per `capacity` leaf writes: O(1) amortised
        self.updates_since_check += n
        if self.updates_since_check >= self.spec.capacity:
            self.updates_since_check = 0
            self.verify_tree()

    def verify_tree(self) -> bool:
        """Check the sampler against its drift bound; rebuild from the segment if it fails."""
        if self.sampler.check():
            return True
        log.warning("table %s: sum tree outside its drift bound; rebuilding", self.spec.name)
        self.rebuild_sampler()
        self.stats["tree_rebuilds"] += 1
        return False

    def rebuild_sampler(self) -> None:
        slots = np.flatnonzero(self.map.state == COMMITTED)
        self.sampler.rebuild(slots, self.map.prios[slots])

    def describe(self) -> dict:
        return {"id": self.id, "segment": self.segment_name, "spec": self.spec.to_wire(),
                "segment_size": self.map.layout.size}

    def snapshot_stats(self) -> dict:
        return {**self.stats, "size": self.size, "capacity": self.spec.capacity,
                "reserved": sum(s.shape[0] - done for _, s, done in self.reservations.values()),
                "max_priority": self.max_priority, "sampler": self.spec.sampler}
