"""A replay table as the daemon sees it: items in, items out, and the numbers.

A table is composed of parts that each own their state:

* ``ledger.SlotLedger``: which slot is free, reserved or held (the slot
  life cycle is drawn there);
* ``counters.LimiterCounters``: the rate limiter's and reuse limit's
  counters, mirrored into the segment's live words;
* a sampler and a remover (``selectors.Selector``), and the commit order
  the ordered ones read (``order.CommitOrder``).

Slots for a writer come from the free list first, then by evicting the
item the remover picks, which never picks a held slot (its item left the
table).  An item sampled for the ``max_times_sampled``-th time leaves the
table at once; its slot is held for the learner that drew it, at most
``hold_timeout_s`` (``expire_holds``, which the engine calls every pass).
Requests that cannot run now raise ``counters.Blocked``; the engine
parks them (``engine/parking.py``), so a waiting request never blocks the engine or
another table.  ``recovery.rebuild`` makes a table from a segment that a
dead daemon or a checkpoint left.

Engine thread only: no method may be called concurrently with another.
"""

from __future__ import annotations

import logging

import numpy as np

from ...errors import CapacityError, PriorityError, ReservationExpired
from ...priorities import check_priorities
from ...schema import TableSpec
from ...wire.layout import COMMITTED, TableMap
from ...wire.records import key_slots, make_keys, stale
from . import tablestats, treeops
from .barrier import evict_ahead, evict_for, waits_for_sync, want_sync
from .counters import Blocked, LimiterCounters
from .ledger import SlotLedger, SlotLimits
from .order import CommitOrder
from . import reuse
from .selectors import make_remover, make_sampler

log = logging.getLogger("shmreplayd.table")


class Table:
    def __init__(self, table_id: int, spec: TableSpec, tmap: TableMap, seed=None,
                 fresh: bool = True, limits: SlotLimits = SlotLimits()):
        """``fresh``: the segment is new and every slot free.  Otherwise the
        caller fills the parts in (``recovery.rebuild``)."""
        self.id = table_id
        self.spec = spec
        self.map = tmap
        self.segment_name = tmap.name
        c = spec.capacity
        self.order = CommitOrder(c, self._alive)
        self.sampler = make_sampler(spec.sampler, c, spec.alpha, self.order)
        self.remover = make_remover(spec.remover, c, self.order)
        self.ledger = SlotLedger(spec.name, tmap, limits)
        self.counters = LimiterCounters(spec, tmap.words)
        self.max_priority = 1.0
        self.rng = np.random.default_rng(seed)
        self.updates_since_check = 0
        self.seqno = 0  # commit number of the newest item
        self.durable = None  # a durable file-backed table's sync state (server/disk/durable.py)
        self.stats = tablestats.new_stats()
        if fresh:
            self.ledger.free.push(np.arange(c, dtype=np.int64))
            self.publish()

    def publish(self) -> None:
        """Mirror the counters into the segment for clients' probes."""
        self.counters.publish(self.ledger.pending, len(self.ledger.free), self.sampler.mass)

    def _alive(self, keys: np.ndarray) -> np.ndarray:
        """Mask of keys that still name the committed item they were made for."""
        m = self.map
        return (m.state[key_slots(keys)] == COMMITTED) & ~stale(keys, m.gens)

    def keys_of(self, slots: np.ndarray) -> np.ndarray:
        return make_keys(self.map.gens[slots], slots)

    # ---- writers ----
    def reserve(self, owner: int, n: int, pid: int = 0, start: int = 0,
                user: int | None = None) -> tuple[int, np.ndarray, bool]:
        """Reserve up to n slots: as many as the writer's caps (``user``: its
        uid, if capped; ``reservations.py``: raises at a cap), the rate
        limiter and the free or evictable slots allow, at least one; else
        raise Blocked."""
        if n < 1:
            raise CapacityError(f"table {self.spec.name!r}: cannot reserve {n} slots")
        led, cnt = self.ledger, self.counters
        n = led.books.room(owner, user, n)
        free = led.free_slots()
        room = cnt.insert_room(led.pending, n)
        if room == 0:
            raise Blocked(cnt.insert_refusal(led.pending))
        # a full table evicts while slots are held (a hung learner stops no
        # writer); a rate-limited queue (max_times_sampled) would lose an
        # unsampled item: it waits for held and void-reserved slots instead.
        # Other tables' held slots are parked pins.  Durable: see barrier.py
        waits = ((self.spec.rate_limited and self.spec.max_times_sampled and (led.held or led.books.voided))
                 or (led.barrier is not None and waits_for_sync(self)))
        k = min(room, free + (0 if waits else cnt.size))
        slots = led.take_free(k)
        if slots.shape[0] < k:
            slots = np.concatenate((slots, self._evict(k - slots.shape[0])))
        if led.barrier is not None:
            evict_ahead(self)
            want_sync(self, force=slots.shape[0] == 0)
        if slots.shape[0] == 0:
            self.publish()  # evictions may have changed the counters
            raise Blocked(led.busy(self.durable.trouble() if self.durable is not None else ""))
        rid = led.reserve(owner, slots, pid, start, user)
        self.stats["reservations"] += 1
        self.publish()
        contiguous = bool(k == 1 or (slots[-1] - slots[0] == k - 1 and np.all(np.diff(slots) == 1)))
        return rid, slots, contiguous

    def _evict(self, n: int) -> np.ndarray:
        """Evict n items for a writer and return their slots (a durable
        table: maybe fewer, see ``barrier.evict_for``)."""
        slots = self.evict_items(n)
        return slots if self.ledger.barrier is None else evict_for(self, slots, n)

    def evict_items(self, n: int) -> np.ndarray:
        """Evict up to n items for a writer and return the slots it may
        have: a pinned slot is parked instead (``ledger.py``), and the next
        victim taken, until n or the table is empty (each pass removes at
        least one item, so this ends)."""
        got, need = [], n
        while need > 0 and self.counters.size > 0:
            slots = self.remover.pick(min(need, self.counters.size), self.rng)[0]
            if slots.shape[0] == 0:  # cannot happen while size > 0; defend anyway
                raise CapacityError(f"table {self.spec.name!r}: remover found no item to evict "
                                    f"of {self.counters.size}")
            self.remove_items(slots)
            self.stats["evictions"] += slots.shape[0]
            kept = self.ledger.park_pinned(slots)
            self.stats["parked_pinned_slots"] += slots.shape[0] - kept.shape[0]
            got.append(kept)
            need -= kept.shape[0]
        return np.concatenate(got) if got else np.empty(0, np.int64)

    def remove_items(self, slots: np.ndarray, sampler_done: bool = False) -> None:
        """The one path by which committed items leave the table
        (``sampler_done``: the sampler let them go already, ``reuse.py``)."""
        if not sampler_done:
            self.sampler.remove(slots)
        self.remover.remove(slots)
        mts = self.spec.max_times_sampled
        unused = int((mts - self.map.times[slots].astype(np.int64)).sum()) if mts else 0
        self.counters.removed(slots.shape[0], unused)

    def commit(self, owner: int, rid: int, priorities: np.ndarray | None,
               offset: int = 0, n: int | None = None) -> None:
        """Commit slots ``[offset, offset + n)`` (n None: the rest) of a
        reservation; a writer commits its lease in parts, in order."""
        entry, part = self.ledger.check_part(owner, rid, offset, n)
        n = part.shape[0]
        if entry.void:  # its writer is done with the slots: let go, not committed
            self.ledger.let_go(rid, entry, part)
            self.publish()
            raise ReservationExpired(
                f"table {self.spec.name!r}: {n} items were not stored: they were copied into "
                f"slots reserved more than {self.ledger.books.timeout_s:g} s before their commit "
                "(reservation_timeout_s; a stalled writer?), whose reservation was void by then")
        if priorities is not None:
            try:
                check_priorities(priorities, n, f"commit to table {self.spec.name!r}", self.spec.alpha)
            except PriorityError:
                self.abort(owner, rid)
                raise
            self.max_priority = max(self.max_priority, float(priorities.max()))
        else:
            priorities = np.full(n, self.max_priority)
        m = self.map
        m.prios[part] = priorities
        m.times[part] = 0
        m.seqno[part] = np.arange(self.seqno + 1, self.seqno + n + 1, dtype=np.uint64)
        self.seqno += n
        self.ledger.committed(rid, entry, part)  # the state last: a crash sees whole items
        self.sampler.add(part, priorities)
        self.remover.add(part, priorities)
        self.order.push(self.keys_of(part))
        self.counters.committed(n)
        self.publish()
        self.stats["inserts"] += n
        self._count_updates(n)

    def abort(self, owner: int, rid: int) -> int:
        """Free the slots of a reservation not committed yet; returns how many."""
        n = self.ledger.abort(owner, rid)
        self.publish()
        return n

    def release_owner(self, owner: int) -> int:
        """An owner's lease ended: free what it reserved but never committed,
        and the slots it held for reading.  Returns how many reserved slots."""
        n = self.ledger.release_owner(owner)
        self.stats["reclaimed_reservations"] += n
        self.publish()
        return n

    # ---- readers ----
    def sample(self, owner: int, n: int, beta: float, protect: bool = False, user: int | None = None):
        """Draw n items: (keys, probabilities, weights, hold id or 0).  Raises
        Blocked when the limits say not yet; nothing is taken then.
        ``protect``: pin the drawn slots until the hold is released
        (``ledger.pin``; ``user``: its capped uid), so no writer reuses them."""
        self.counters.check_sample(n)
        err = self.counters.sample_refusal(n, self.sampler.mass)
        if err is not None:
            raise Blocked(err)
        if self.sampler.fused and not self.spec.max_times_sampled:
            keys, probs, weights = self.sampler.draw(n, self.rng, beta, self.map.gens)
            hid = 0
        else:
            slots, probs, weights, hid = reuse.draw(self, owner, n, beta)
            keys = self.keys_of(slots)
        if protect:
            hid = self.ledger.pin(owner, key_slots(keys), hid, user)
            self.stats["protected_samples"] += n
        self.counters.sampled(n)
        self.publish()
        self.stats["samples"] += n
        self.stats["sample_calls"] += 1
        return keys, probs, weights, hid

    def release(self, owner: int, hid: int) -> None:
        """The learner is done reading the rows of hold ``hid``: free the slots."""
        self.ledger.release(owner, hid)
        if self.ledger.barrier is not None:
            want_sync(self)
        self.publish()

    def expire(self, now: float) -> float | None:
        """Free the slots of holds older than ``hold_timeout_s``, void the
        reservations older than ``reservation_timeout_s``; returns when the
        next of either expires (None: none is open)."""
        freed, soonest = self.ledger.expire(now)
        voided, later = self.ledger.books.expire(now)
        if freed or voided:
            self.stats["expired_held_slots"] += freed
            self.stats["voided_reserved_slots"] += voided
            self.publish()
        return soonest if later is None or (soonest is not None and soonest < later) else later

    def update_priorities(self, keys: np.ndarray, priorities: np.ndarray) -> int:
        """Set the priorities of the keys that still name their item (the
        others are stale: counted, skipped); returns how many were stale.
        A refused update (PriorityError, ProtocolError) changes nothing."""
        n = keys.shape[0]
        # the payload is the client's ring, which it may still write: check
        # and apply one private copy (the kernel indexes without bounds checks)
        keys, priorities = keys.copy(), priorities.copy()
        treeops.check_update(keys, priorities, self.spec)
        m = self.map
        live, top = self.sampler.update(keys, priorities, m.gens, m.state, m.prios)
        if live:
            self.max_priority = max(self.max_priority, top)
            m.words.mass = self.sampler.mass
        stale_n = n - live
        self.stats["stale_priority_updates"] += stale_n
        self.stats["priority_updates"] += live
        self._count_updates(n)
        return stale_n

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
        self.map.words.mass = self.sampler.mass

    # ---- reports ----
    @property
    def size(self) -> int:
        return self.counters.size


def private_bytes(spec: TableSpec) -> int:
    """What the daemon allocates for a table beside its segments: the
    ledger's and order's slot arrays, the sampler's (a prioritized one's
    sum and min trees over the next power of two) and a uniform remover's.
    Per slot as measured by summing the arrays of a built table (24 B, plus
    32 B x pow2/capacity prioritized or 16 B uniform sampling, plus 16 B for
    a uniform remover)."""
    c = spec.capacity
    per = 24.0
    if spec.sampler == "prioritized":
        per += 32.0 * (1 << max(0, (c - 1).bit_length())) / c
    elif spec.sampler == "uniform":
        per += 16.0
    if spec.remover == "uniform":
        per += 16.0
    return int(c * per)


def expire(tables, now: float) -> float | None:
    """Expire the old holds and reservations of every table; returns when
    the next one expires (None: none is open), for the engine's sleep."""
    soonest = None
    for t in tables:
        at = t.expire(now)
        if at is not None and (soonest is None or at < soonest):
            soonest = at
    return soonest
