"""A replay table as the daemon sees it: items in, items out, and the numbers.

A table is composed of parts that each own their state:

* the slot books (``slots/``): ``SlotLedger``, which slot is free or
  reserved by a writer (the slot life cycle is drawn there), and
  ``Holds``, the slots kept for the learners reading them;
* the selection (``select/``): ``Selection``, the sampler, the remover,
  the commit order and the reuse limit over the committed items;
* ``counters.LimiterCounters``: the rate limiter's and reuse limit's
  counters, mirrored into the segment's live words.

The table moves items between them.  Slots for a writer come from the
free list first, then by evicting the item the remover picks, which never
picks a held slot (its item left the table).  An item sampled for the
``max_times_sampled``-th time leaves the table at once; its slot is held
for the learner that drew it, at most ``hold_timeout_s`` (``expire``,
which the engine calls every pass).  Requests that cannot run now raise
``counters.Blocked``; the engine parks them (``engine/parking.py``), so a
waiting request never blocks the engine or another table.
``control/recovery.rebuild`` takes a table over from the segment a dead
daemon or a checkpoint left, through each part's own ``recover`` or
``restore``.

Engine thread only: no method may be called concurrently with another.
"""

from __future__ import annotations

import numpy as np

from ...errors import CapacityError, FieldError, PriorityError, ProtocolError, RateLimited
from ...priorities import check_priorities
from ...schema import TableSpec
from ...wire.layout import FREE, TableMap
from ...wire.records import key_slots
from . import tablestats
from .counters import Blocked, LimiterCounters
from .frames.tableframes import TableFrames
from .select import treeops
from .select.selection import Selection
from .slots.barrier import consumable
from .slots.holds import Holds
from .slots.ledger import SlotLedger, SlotLimits
from .slots.slotqueue import is_run


class Table:
    def __init__(self, table_id: int, spec: TableSpec, tmap: TableMap, seed=None,
                 fresh: bool = True, limits: SlotLimits = SlotLimits()):
        """``fresh``: the segment is new and every slot free.  Otherwise the
        caller restores the parts first (``control/recovery.rebuild``)."""
        self.id = table_id
        self.spec = spec
        self.map = tmap
        self.segment_name = tmap.name
        self.ledger = SlotLedger(spec.name, tmap, limits)
        self.holds = Holds(spec.name, tmap, limits.hold_timeout_s, self.ledger.make_free)
        self.selection = Selection(spec, tmap, seed)
        self.counters = LimiterCounters(spec, tmap.words)
        self.frames = (TableFrames(spec.name, spec.frames, spec.capacity, tmap.refs)  # a frame
                       if spec.frames else None)  # table's frame side (frames/tableframes.py)
        self.durable = None  # a durable file-backed table's sync state (server/disk/durable.py)
        self.stats = tablestats.new_stats()
        if fresh:
            self.ledger.free.push(np.arange(spec.capacity, dtype=np.int64))
            self.publish()
        tablestats.warn(self)

    def publish(self) -> None:
        """Mirror the counters into the segment for clients' probes."""
        self.counters.publish(self.ledger.pending, len(self.ledger.free), self.selection.mass, self.selection.least)

    def keys_of(self, slots: np.ndarray) -> np.ndarray:
        return self.selection.keys_of(slots)

    def make_durable(self, durability, listed: np.ndarray | None = None) -> None:
        """From now on the table is synced to its metadata file
        (``durability``: its sync state, ``server/disk/durable.py``) and
        keeps the reuse barrier; ``listed``: what the file an adopted table
        came from lists (``SlotLedger.start_barrier``)."""
        self.ledger.start_barrier(durability.want, listed)
        self.durable = durability
        tablestats.warn(self, durable=True)

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
        n = led.room(owner, user, n)
        free = led.free_slots()
        room = cnt.insert_room(led.pending, n)
        if room == 0:
            raise Blocked(cnt.insert_refusal(led.pending))
        # a full table evicts while slots are held (a hung learner stops no
        # writer); a rate-limited queue (max_times_sampled) would lose an
        # unsampled item: it waits for held and void-reserved slots instead.
        # Other tables' held slots are parked pins.  Durable: see barrier.py
        waits = ((self.spec.rate_limited and self.spec.max_times_sampled
                  and (self.holds.held or led.voided))
                 or led.waits_for_sync())
        k = min(room, free + (0 if waits else cnt.size))
        slots = led.take_free(k)
        if slots.shape[0] < k:
            slots = np.concatenate((slots, self._evict(k - slots.shape[0])))
        if led.durable:
            self._evict_ahead()
            led.want_sync(force=slots.shape[0] == 0)
        if slots.shape[0] == 0:
            self.publish()  # evictions may have changed the counters
            raise Blocked(led.busy(self.holds.held, self.holds.timeout_s,
                                   self.durable.trouble() if self.durable is not None else ""))
        rid = led.reserve(owner, slots, pid, start, user)
        if self.frames is not None:  # stamped anew: the frames of their last items go
            self.frames.reserved(slots)
        self.stats["reservations"] += 1
        self.publish()
        contiguous = bool(is_run(slots))
        return rid, slots, contiguous

    def _evict(self, n: int) -> np.ndarray:
        """Evict n items for a writer and return their slots.  A durable
        table: maybe fewer, even none, as the slots its file on disk lists
        are retired (``barrier.py``)."""
        slots = self.evict_items(n)
        if not self.ledger.durable:
            return slots
        self.ledger.make_free(slots)
        self._evict_ahead()
        return self.ledger.take_free(n)

    def _evict_ahead(self) -> None:
        """A full durable table keeps its free and retired slots at the sync
        headroom (``SlotLedger.ahead``)."""
        ahead = self.ledger.ahead(self.counters.size)
        if ahead > 0:
            self.ledger.make_free(self.evict_items(ahead))

    def evict_items(self, n: int) -> np.ndarray:
        """Evict up to n items for a writer and return the slots it may
        have: a pinned slot is parked instead (``holds.py``), and the next
        victim taken, until n or the table is empty (each pass removes at
        least one item, so this ends)."""
        got, need = [], n
        while need > 0 and self.counters.size > 0:
            slots = self.selection.victims(min(need, self.counters.size))
            if slots.shape[0] == 0:  # cannot happen while size > 0; defend anyway
                raise CapacityError(f"table {self.spec.name!r}: remover found no item to evict "
                                    f"of {self.counters.size}")
            self.remove_items(slots)
            self.stats["evictions"] += slots.shape[0]
            kept = self.holds.park_pinned(slots)
            self.stats["parked_pinned_slots"] += slots.shape[0] - kept.shape[0]
            got.append(kept)
            need -= kept.shape[0]
        return np.concatenate(got) if got else np.empty(0, np.int64)

    def remove_items(self, slots: np.ndarray, sampler_done: bool = False) -> None:
        """The one path by which committed items leave the table
        (``sampler_done``: the sampler let them go already, ``reuse.py``)."""
        self.selection.remove(slots, sampler_done)
        mts = self.spec.max_times_sampled
        unused = int((mts - self.map.times[slots].astype(np.int64)).sum()) if mts else 0
        self.counters.removed(slots.shape[0], unused)

    def commit(self, owner: int, rid: int, priorities: np.ndarray | None,
               offset: int = 0, n: int | None = None, refs=None) -> None:
        """Commit slots ``[offset, offset + n)`` (n None: the rest) of a
        reservation; a writer commits its lease in parts, in order.  A
        frame table's items come with their frame references (``refs``)."""
        entry, part = self.ledger.check_part(owner, rid, offset, n)
        n = part.shape[0]
        if entry.void:  # its writer is done with the slots: let go, not committed
            refusal = self.ledger.let_go(rid, entry, part)
            self.publish()
            raise refusal
        try:
            if priorities is not None:
                check_priorities(priorities, n, f"commit to table {self.spec.name!r}", self.spec.alpha)
            if self.frames is not None:
                self.frames.commit(part, refs)
        except (PriorityError, FieldError, ProtocolError):
            self.abort(owner, rid)
            raise
        priorities, keys = self.selection.stamp(part, priorities)
        self.ledger.committed(rid, entry, part)  # the state last: a crash sees whole items
        self.selection.add(part, priorities, keys)
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
        self.holds.release_owner(owner)
        if self.frames is not None:
            self.frames.release_owner(owner)
        self.stats["reclaimed_reservations"] += n
        self.publish()
        return n

    # ---- learners ----
    def sample(self, owner: int, n: int, beta: float, protect: bool = False, user: int | None = None):
        """A draw (one SAMPLE) of n items: (keys, probabilities, weights, hold
        id or 0).  Raises Blocked when the limits say not yet; nothing is
        taken then.  ``protect``: pin the drawn slots until the hold is
        released (``Holds.pin``; ``user``: its capped uid), so no writer
        reuses them."""
        self.counters.check_sample(n)
        err = self.counters.sample_refusal(n, self.selection.mass)
        if err is not None:
            raise Blocked(err)
        try:
            keys, probs, weights, spent = self.selection.pick(n, beta)
        except RateLimited as exc:  # the items with uses left ran dry; nothing was taken
            raise Blocked(exc) from None
        hid = 0
        if spent.shape[0]:  # no uses left: they leave, held for this learner
            self.remove_items(spent, sampler_done=True)
            self.stats["removed_after_max_samples"] += spent.shape[0]
            hid = self.holds.hold(owner, spent)
        if protect:
            hid = self.holds.pin(owner, key_slots(keys), hid, user)
            self.stats["protected_samples"] += n
        self.counters.sampled(n)
        self.publish()
        self.stats["samples"] += n
        self.stats["sample_calls"] += 1
        return keys, probs, weights, hid

    def release(self, owner: int, hid: int) -> None:
        """The learner is done reading the rows of hold ``hid``: free the slots."""
        self.holds.release(owner, hid)
        self.ledger.want_sync()
        self.publish()

    def expire(self, now: float) -> float | None:
        """Free the slots of holds older than ``hold_timeout_s``, void the
        reservations older than ``reservation_timeout_s``; returns when the
        next of either expires (None: none is open)."""
        freed, soonest = self.holds.expire(now)
        voided, later = self.ledger.expire(now)
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
        live = self.selection.update(keys, priorities)
        if live:
            self.map.words.mass = self.selection.mass
        stale_n = n - live
        self.stats["stale_priority_updates"] += stale_n
        self.stats["priority_updates"] += live
        self._count_updates(n)
        return stale_n

    # ---- numerics ----
    def _count_updates(self, n: int) -> None:
        if self.selection.due_check(n):
            self.verify_tree()

    def verify_tree(self) -> bool:
        """Check the sampler against its drift bound; rebuild from the segment if it fails."""
        if self.selection.verify():
            return True
        self.map.words.mass = self.selection.mass
        self.stats["tree_rebuilds"] += 1
        return False

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


def reclaim_frames(table: Table, short: int) -> int:
    """Free ``short`` frames of a frame table for a frame lease
    (``TableFrames.lease``'s ``reclaim``): first those of free slots (their
    items left), then by evicting items by the remover; each slot stamped
    anew as it lets go, so a learner still copying its item sees the stamp
    move.  Held slots keep theirs until released.  Returns how many frames
    it freed: fewer once the table is empty."""
    frames, led = table.frames, table.ledger
    # a durable table's slots whose items its file on disk lists keep their
    # frames: after a reboot those items are read from that file
    slots = led.reusable(frames.holding(np.flatnonzero(table.map.state == FREE)))
    led.restamp(slots)
    freed = frames.reclaim_from(slots)
    # a durable table's retired slots free their items' frames once the
    # next sync lands: count them as coming, at most an item's references
    # each (an item sharing frames with its neighbours frees fewer: its
    # writer then waits for a sync more, never the table evicted for
    # nothing), or every retry of a waiting writer would evict more (and
    # one call the whole table).  A queue (consumable) never evicts an
    # unsampled item for frames: its writer waits for the learners, as for slots
    per_item = frames.refs_per_item
    coming = led.retired() * per_item
    if consumable(table.spec):
        coming = short
    while freed + coming < short and table.counters.size > 0:  # each round evicts at least one item
        # an item frees at most its references' frames: evict no more than must go
        victims = table.evict_items(-(-(short - freed - coming) // frames.refs_per_item))
        frames.stats["evicted_for_frames"] += victims.shape[0]
        led.make_free(victims)
        usable = led.reusable(victims)
        coming += (victims.shape[0] - usable.shape[0]) * per_item
        led.restamp(usable)
        freed += frames.reclaim_from(usable)
    if freed < short:  # retired slots hold them: a writer waits for the sync that frees them
        led.want_sync(force=True)
    table.publish()
    return freed


def expire(tables, now: float) -> float | None:
    """Expire the old holds and reservations of every table; returns when
    the next one expires (None: none is open), for the engine's sleep."""
    soonest = None
    for t in tables:
        at = t.expire(now)
        if at is not None and (soonest is None or at < soonest):
            soonest = at
    return soonest
