"""A replay table as the daemon sees it: slot life cycle, selectors, limits, stats.

Slot life cycle (state array in the segment)::

    FREE --reserve--> RESERVED --commit--> COMMITTED --evict/reserve--> RESERVED
      ^  ^               |  abort, or the writer's lease ends     |
      |  +---------------+                                        | N-th sample
      +-------- release (the learner is done reading) ------ HELD <+

The generation stamp of a slot is bumped when it is reserved, before the
writer learns the slot index.  A key is ``gen << 32 | slot``; a reader that
sampled a key and then finds a different stamp knows the row was (or is
being) overwritten.  Slots come from the free list first, then by evicting
the item the remover picks.  An item sampled for the ``max_times_sampled``-th
time leaves the table at once but its slot is HELD for the learner that drew
it until that learner RELEASEs it, so a row handed out is never overwritten
while being read and a queue item is never lost to a redraw.

Requests that cannot run now (rate limiter, reuse limits, all slots taken)
raise ``Blocked``; the engine parks them and retries (engine.py), so a
waiting request never blocks the engine or another table.

Engine thread only: no method may be called concurrently with another.
"""

from __future__ import annotations

import collections
import logging
import os
import time

import numpy as np

from . import ratelimiter
from .commands import SLOT_BITS, SLOT_MASK
from .errors import (CapacityError, EmptyTable, PriorityError, ProtocolError, RateLimited,
                     ReplayError)
from .layout import (COMMITTED, FREE, HELD, LIVE_DELETES, LIVE_EPOCH, LIVE_FREE, LIVE_INSERTS,
                     LIVE_PENDING, LIVE_SAMPLES, LIVE_SIZE, LIVE_USES, RESERVED, TableMap,
                     process_start)
from .order import CommitOrder
from .priorities import check_priorities
from .removers import make_remover
from .schema import TableSpec
from .selectors import make_sampler
from .slotqueue import SlotQueue

log = logging.getLogger("shmreplayd.table")

MAX_HOLDS = 64  # open holds per client; past this the oldest is released (its batch is long gathered)


class Blocked(Exception):
    """The request cannot run now but may later.  ``error`` is what the
    client gets if it is still blocked when its timeout runs out."""

    def __init__(self, error: ReplayError):
        super().__init__(str(error))
        self.error = error


class Table:
    def __init__(self, table_id: int, spec: TableSpec, tmap: TableMap, seed=None,
                 recover: bool = False, quarantine_s: float = 0.0):
        """``recover``: the segment holds a table a dead daemon served (or a
        restored checkpoint); rebuild every structure from it (``_recover``)."""
        self.id = table_id
        self.spec = spec
        self.map = tmap
        self.segment_name = tmap.seg.name
        c = spec.capacity
        self.order = CommitOrder(c, self._alive)
        self.sampler = make_sampler(spec.sampler, c, spec.alpha, self.order)
        self.remover = make_remover(spec.remover, c, self.order)
        self.free = SlotQueue(c)
        self.reservations: dict[int, list] = {}
        self.next_rid = 1
        self.holds: dict[int, tuple[int, np.ndarray]] = {}
        self.holds_of: dict[int, collections.deque] = {}
        self.next_hid = 1
        self.max_priority = 1.0
        self.rng = np.random.default_rng(seed)
        self.updates_since_check = 0
        # limiter counters; the segment's live words mirror them for clients
        self.size = self.inserts = self.pending = self.samples = self.deletes = self.held = 0
        self.uses_left = 0
        self.seqno = 0
        # parked requests, oldest first (the engine owns what is in them)
        self.waiting_inserts: collections.deque = collections.deque()
        self.waiting_samples: collections.deque = collections.deque()
        self.stats = {"inserts": 0, "reservations": 0, "samples": 0, "sample_calls": 0, "evictions": 0,
                      "removed_after_max_samples": 0, "stale_priority_updates": 0,
                      "priority_updates": 0, "reclaimed_reservations": 0, "tree_rebuilds": 0,
                      "insert_waits": 0, "sample_waits": 0, "timeouts": 0, "recovered_items": 0,
                      "recovered_orphans": 0}
        self.quarantine: tuple[np.ndarray, float] | None = None
        if recover:
            self._recover(quarantine_s)
        else:
            self.free.push(np.arange(c, dtype=np.int64))
        self._publish()

    def _publish(self) -> None:
        live = self.map.live
        live[LIVE_SIZE] = self.size
        live[LIVE_INSERTS] = self.inserts
        live[LIVE_PENDING] = self.pending
        live[LIVE_SAMPLES] = self.samples
        live[LIVE_DELETES] = self.deletes
        live[LIVE_FREE] = len(self.free)
        live[LIVE_USES] = self.uses_left
        self.map.mass[0] = self.sampler.mass

    def _keys(self, slots: np.ndarray) -> np.ndarray:
        return (self.map.gens[slots].astype(np.uint64) << np.uint64(SLOT_BITS)) | slots.astype(np.uint64)

    def _alive(self, keys: np.ndarray) -> np.ndarray:
        return self._current(keys)[1]

    def _current(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots, mask of keys that still name the committed item they were drawn for)."""
        slots = (keys & np.uint64(SLOT_MASK)).astype(np.int64)
        m = self.map
        live = (m.state[slots] == COMMITTED) & (
            m.gens[slots].astype(np.uint64) == (keys >> np.uint64(SLOT_BITS)))
        return slots, live

    def _recover(self, quarantine_s: float) -> None:
        """Rebuild the table from its segment: the committed items (state,
        priority, times sampled, commit number) are the truth; everything
        else is derived.  Slots a writer had reserved, or a learner held,
        under the dead daemon are void: their stamps are bumped (any key a
        client kept for them is stale) and they stay out of use for
        ``quarantine_s``, in case a writer of the old daemon is still
        copying into one (writers check the epoch before they copy)."""
        m, spec = self.map, self.spec
        st = m.state
        mts = spec.max_times_sampled
        if mts:  # the daemon died between counting an item's last use and removing it
            st[(st == COMMITTED) & (m.times >= mts)] = HELD
        committed = np.flatnonzero(st == COMMITTED)
        committed = committed[np.argsort(m.seqno[committed], kind="stable")]
        orphans = np.flatnonzero((st == RESERVED) | (st == HELD))
        if orphans.shape[0]:
            st[orphans] = FREE
            m.prios[orphans] = 0.0
            m.gens[orphans] += np.uint32(1)
        free = np.flatnonzero(st == FREE)
        if orphans.shape[0] and quarantine_s > 0:
            free = np.setdiff1d(free, orphans, assume_unique=True)
            self.quarantine = (orphans, time.monotonic() + quarantine_s)
        self.free.push(free)
        prios = m.prios[committed]
        if committed.shape[0]:
            self.sampler.add(committed, prios)
            self.remover.add(committed)
            self.order.push(self._keys(committed))
            self.max_priority = max(1.0, float(prios.max()))
            self.seqno = int(m.seqno[committed].max())
        if mts:
            self.uses_left = int((mts - m.times[committed].astype(np.int64)).sum())
        live = m.live
        self.size = committed.shape[0]
        self.inserts = max(int(live[LIVE_INSERTS]), self.size)
        self.deletes = int(live[LIVE_DELETES])
        can_sample = (self.size >= spec.min_size_to_sample and self.sampler.mass > 0
                      and (not mts or self.uses_left > 0))
        self.samples = ratelimiter.restored_samples(spec, self.inserts, int(live[LIVE_SAMPLES]),
                                                    can_sample)
        live[LIVE_EPOCH] += np.uint64(1)
        m.header["owner_pid"] = os.getpid()
        m.header["owner_start"] = process_start(os.getpid())
        self.stats["recovered_items"] = self.size
        self.stats["recovered_orphans"] = orphans.shape[0]

    def _end_quarantine(self) -> None:
        slots, until = self.quarantine
        if time.monotonic() >= until:
            self.quarantine = None
            self.free.push(slots)

    # ---- writers ----
    def reserve(self, owner: int, n: int) -> tuple[int, np.ndarray, bool]:
        """Reserve up to n slots: as many as the rate limiter and the free or
        evictable slots allow, at least one; else raise Blocked."""
        if n < 1:
            raise CapacityError(f"table {self.spec.name!r}: cannot reserve {n} slots")
        if self.quarantine is not None:
            self._end_quarantine()
        room = ratelimiter.insert_room(self.spec, self.size, self.inserts, self.pending,
                                       self.samples, n)
        if room == 0:
            raise Blocked(RateLimited(f"insert into table {self.spec.name!r} timed out: " +
                                      ratelimiter.insert_blocker(self.spec, self.inserts,
                                                                 self.pending, self.samples)))
        # while learners hold slots, take only free ones: evicting instead
        # would push out items the table has room for once they release
        # (a queue would lose them)
        k = min(room, len(self.free) + (0 if self.held else self.size))
        if k == 0:
            raise Blocked(CapacityError(
                f"table {self.spec.name!r}: no slot is free or evictable now; "
                f"{self.pending} are reserved by writers that have not committed and "
                f"{self.held} are held by learners still reading their last sample"))
        slots = self.free.pop(k)
        if slots.shape[0] < k:
            slots = np.concatenate((slots, self._evict(k - slots.shape[0])))
        m = self.map
        m.state[slots] = RESERVED
        m.prios[slots] = 0.0
        m.gens[slots] += np.uint32(1)  # wraps at 2**32 by design
        rid = self.next_rid
        self.next_rid += 1
        self.pending += k
        self.stats["reservations"] += 1
        self.reservations[rid] = [owner, slots, 0]  # owner, slots, how many committed
        self._publish()
        contiguous = bool(k == 1 or (slots[-1] - slots[0] == k - 1 and np.all(np.diff(slots) == 1)))
        return rid, slots, contiguous

    def _evict(self, n: int) -> np.ndarray:
        slots = self.remover.pick(n, self.rng)
        if slots.shape[0] < n:  # cannot happen while size >= n; defend anyway
            raise CapacityError(f"table {self.spec.name!r}: remover found {slots.shape[0]} of "
                                f"{n} items to evict")
        self._remove(slots)
        self.stats["evictions"] += n
        return slots

    def _remove(self, slots: np.ndarray, sampler_done: bool = False) -> None:
        """The one path by which committed items leave the table."""
        if not sampler_done:
            self.sampler.remove(slots)
        self.remover.remove(slots)
        if self.spec.max_times_sampled:
            self.uses_left -= int((self.spec.max_times_sampled
                                   - self.map.times[slots].astype(np.int64)).sum())
        self.size -= slots.shape[0]
        self.deletes += slots.shape[0]

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
        m.times[part] = 0
        m.seqno[part] = np.arange(self.seqno + 1, self.seqno + n + 1, dtype=np.uint64)
        self.seqno += n
        m.state[part] = COMMITTED
        self.sampler.add(part, priorities)
        self.remover.add(part)
        self.order.push(self._keys(part))
        self.size += n
        self.inserts += n
        self.pending -= n
        self.uses_left += n * self.spec.max_times_sampled
        self._publish()
        self.stats["inserts"] += n
        self._count_updates(n)

    def abort(self, owner: int, rid: int) -> int:
        """Free the slots of a reservation not committed yet; returns how many."""
        _, slots, done = self._entry(owner, rid)
        del self.reservations[rid]
        rest = slots[done:]
        self.map.state[rest] = FREE
        self.free.push(rest)
        self.pending -= rest.shape[0]
        self._publish()
        return rest.shape[0]

    def release_owner(self, owner: int) -> int:
        """An owner's lease ended: free what it reserved but never committed,
        and the slots it held for reading.  Returns how many reservations."""
        rids = [rid for rid, entry in self.reservations.items() if entry[0] == owner]
        n = sum(self.abort(owner, rid) for rid in rids)
        for hid in list(self.holds_of.get(owner, ())):
            self.release(owner, hid)
        self.holds_of.pop(owner, None)
        self.stats["reclaimed_reservations"] += n
        return n

    # ---- readers ----
    def check_sample(self, n: int, beta: float) -> None:
        """Refuse, at once, samples that could never run (bad beta, a batch
        larger than the limits can ever admit)."""
        if not np.isfinite(beta) or beta < 0:
            raise ReplayError(f"beta must be finite and >= 0, got {beta}")
        top = ratelimiter.max_sample_batch(self.spec)
        if top is not None and n > top:
            raise CapacityError(
                f"table {self.spec.name!r}: a batch of {n} can never be admitted: its error buffer "
                f"[{self.spec.diff_bounds[0]:g}, {self.spec.diff_bounds[1]:g}] admits at most {top} "
                "samples at once; sample smaller batches or widen error_buffer")
        mts = self.spec.max_times_sampled
        if mts and n > mts * self.spec.capacity:
            raise CapacityError(
                f"table {self.spec.name!r}: a batch of {n} exceeds capacity {self.spec.capacity} x "
                f"max_times_sampled {mts}, the most samples the table can ever hold at once")

    def _sample_blocker(self, n: int) -> ReplayError | None:
        name = self.spec.name
        why = ratelimiter.sample_blocker(self.spec, self.size, self.inserts, self.samples, n)
        if why is None and self.spec.max_times_sampled and self.uses_left < n:
            why = (f"its items can give only {self.uses_left} more samples "
                   f"(max_times_sampled {self.spec.max_times_sampled}), fewer than {n}")
        if why is None and not self.sampler.mass > 0:
            why = "no item has a positive priority"
        if why is None:
            return None
        if self.size == 0 or not self.sampler.mass > 0:
            return EmptyTable(f"table {name!r} has no sampleable items ({self.size} committed): {why}")
        return RateLimited(f"sample of {n} from table {name!r} timed out: {why}")

    def sample(self, owner: int, n: int, beta: float):
        """Draw n items: (keys, probabilities, weights, hold id or 0).  Raises
        Blocked when the limits say not yet; nothing is taken then."""
        self.check_sample(n, beta)
        err = self._sample_blocker(n)
        if err is not None:
            raise Blocked(err)
        mts = self.spec.max_times_sampled
        if self.sampler.ordered:
            slots = self.sampler.draw(n, self._uses_of if mts else None)
            probs, weights = np.ones(n), np.ones(n)
        elif mts:
            slots, probs, weights = self._draw_limited(n, beta)
        else:
            slots, probs, weights = self.sampler.sample(self.rng.random(n), beta)
        keys = self._keys(slots)
        # random samplers: _draw_limited took exhausted items out of the sampler already
        hid = self._count_uses(owner, slots, sampler_done=not self.sampler.ordered) if mts else 0
        self.samples += n
        self._publish()
        self.stats["samples"] += n
        self.stats["sample_calls"] += 1
        return keys, probs, weights, hid

    def _uses_of(self, slots: np.ndarray) -> np.ndarray:
        return self.spec.max_times_sampled - self.map.times[slots].astype(np.int64)

    def _draw_limited(self, n: int, beta: float):
        """Random draws under a reuse limit: no item appears in the batch
        more often than it has uses left.  Draw, keep each item's first
        ``uses left`` occurrences, take exhausted items out of the sampler,
        and redraw the rest.  Times are counted later (_count_uses), and
        the exhausted items stay out of the sampler; the sampler is restored
        if it runs dry (zero-priority items hold uses too), so a blocked
        sample takes nothing."""
        times = self.map.times
        mts = self.spec.max_times_sampled
        extra: dict[int, int] = {}   # uses taken in this batch, per slot
        out, removed, need = [], [], n
        try:
            while need:
                if not self.sampler.mass > 0:
                    raise Blocked(RateLimited(
                        f"sample of {n} from table {self.spec.name!r} timed out: the items with "
                        f"uses left have zero priority"))
                s, p, w = self.sampler.sample(self.rng.random(need), beta)
                uniq, inv, counts = np.unique(s, return_inverse=True, return_counts=True)
                left = mts - times[uniq].astype(np.int64) - np.array(
                    [extra.get(int(u), 0) for u in uniq], dtype=np.int64)
                rank = np.empty(need, dtype=np.int64)
                by_slot = np.argsort(inv, kind="stable")
                starts = np.cumsum(counts) - counts
                rank[by_slot] = np.arange(need) - np.repeat(starts, counts)
                ok = rank < left[inv]
                took = np.minimum(counts, left)
                for u, t in zip(uniq.tolist(), took.tolist()):
                    extra[u] = extra.get(u, 0) + t
                done = uniq[took == left]
                if done.shape[0]:
                    self.sampler.remove(done)
                    removed.append(done)
                out.append((s[ok], p[ok], w[ok]))
                need -= int(ok.sum())
        except Blocked:
            for done in removed:
                self.sampler.add(done, self.map.prios[done])
            raise
        return tuple(np.concatenate(parts) for parts in zip(*out))

    def _count_uses(self, owner: int, slots: np.ndarray, sampler_done: bool) -> int:
        """Count a batch's draws against max_times_sampled; items that reach
        it leave the table and their slots are held for ``owner``.
        ``sampler_done``: the draw took exactly those items out of the sampler."""
        uniq, counts = np.unique(slots, return_counts=True)
        m = self.map
        m.times[uniq] += counts.astype(np.uint32)
        self.uses_left -= slots.shape[0]
        done = uniq[m.times[uniq] >= self.spec.max_times_sampled]
        if done.shape[0] == 0:
            return 0
        # _remove subtracts the uses they have left, which is 0 now
        self._remove(done, sampler_done)
        m.state[done] = HELD
        self.held += done.shape[0]
        self.stats["removed_after_max_samples"] += done.shape[0]
        hid = self.next_hid
        self.next_hid += 1
        self.holds[hid] = (owner, done)
        mine = self.holds_of.setdefault(owner, collections.deque())
        mine.append(hid)
        if len(mine) > MAX_HOLDS:
            self.release(owner, mine[0])
        return hid

    def release(self, owner: int, hid: int) -> None:
        """The learner is done reading the rows of hold ``hid``: free the slots."""
        if not 0 < hid < self.next_hid:
            raise ProtocolError(f"table {self.spec.name!r}: RELEASE of hold {hid}, which never existed")
        entry = self.holds.get(hid)
        if entry is None:
            return  # released already (the MAX_HOLDS cap got there first)
        if entry[0] != owner:
            raise ProtocolError(f"table {self.spec.name!r}: hold {hid} is not yours")
        del self.holds[hid]
        mine = self.holds_of.get(owner)
        if mine is not None:
            try:
                mine.remove(hid)
            except ValueError:
                pass
        slots = entry[1]
        self.held -= slots.shape[0]
        self.map.state[slots] = FREE
        self.free.push(slots)
        self._publish()

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
            m.mass[0] = self.sampler.mass
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
        self.map.mass[0] = self.sampler.mass

    def describe(self) -> dict:
        return {"id": self.id, "segment": self.segment_name, "spec": self.spec.to_wire(),
                "segment_size": self.map.layout.size, "items": self.size}

    def snapshot_stats(self) -> dict:
        return {**self.stats, "size": self.size, "capacity": self.spec.capacity,
                "reserved": self.pending, "held": self.held,
                "limiter": {"inserts": self.inserts, "samples": self.samples,
                            "deletes": self.deletes, "pending": self.pending,
                            "uses_left": self.uses_left,
                            "waiting_inserts": len(self.waiting_inserts),
                            "waiting_samples": len(self.waiting_samples)},
                "max_priority": self.max_priority, "sampler": self.spec.sampler,
                "remover": self.spec.remover}
