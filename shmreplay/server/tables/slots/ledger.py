"""The slot ledger of one table: which slot is free, reserved by a writer, or
held for a learner, and the life-cycle marks in the segment that go with it.

Slot life cycle (state array in the segment)::

    FREE --reserve--> RESERVED --commit--> COMMITTED --evict/reserve--> RESERVED
      ^  ^               |  abort, or the writer's lease ends     |
      |  +---------------+                                        | N-th sample
      +-------- release (the learner is done reading) ------ HELD <+

The generation stamp of a slot is bumped when it is reserved, before the
writer learns the slot index, so a key (``wire.records``) drawn before the
reservation no longer matches the slot.  A reservation is committed in
parts, in order.  Slots leave HELD through the table's holds (``holds.py``:
learners' holds and pins), which hand them back here (``make_free``).
Slots a writer leased under a dead daemon stay RESERVED until that writer
provably cannot write them (``orphans.py``); a durable table's freed
slots wait for the next sync while the file on disk lists their items
(``barrier.py``).

The ledger does not decide which slots to reserve (the table asks the free
list, then its remover) nor what committed items are; it keeps the books.

Engine thread only; no method may run concurrently with another.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from ....errors import ReservationExpired, SlotsBusy
from ....wire.layout import COMMITTED, FREE, HELD, RESERVED, TableMap
from ....wire.records import owner_key
from .barrier import ReuseBarrier, consumable
from .holds import HOLD_TIMEOUT_S
from .orphans import OrphanLeases
from .reservations import RESERVATION_TIMEOUT_S, Reservations
from .slotqueue import SlotQueue



@dataclass(frozen=True)
class SlotLimits:
    """How long slots may stay out of use (the daemon's config)."""
    hold_timeout_s: float = HOLD_TIMEOUT_S                # a learner's holds
    reservation_timeout_s: float = RESERVATION_TIMEOUT_S  # a writer's reservations


class SlotLedger:
    def __init__(self, name: str, tmap: TableMap, limits: SlotLimits = SlotLimits()):
        self.name = name
        self.map = tmap
        self.free = SlotQueue(tmap.spec.capacity)
        # writers' reservations, their caps and expiry (reservations.py)
        self.books = Reservations(name, tmap.spec.capacity, limits.reservation_timeout_s)
        self.orphans: OrphanLeases | None = None  # leased under a dead daemon (orphans.py)
        self.barrier: ReuseBarrier | None = None   # a durable table's (barrier.py)
        self.wake_sync = None  # and how it asks for a sync
        self.daemon_pid = os.getpid()

    def make_free(self, slots: np.ndarray) -> None:
        """Slots nobody uses any more: on the free list, or retired while the
        metadata file on disk lists their items (barrier.py)."""
        self.map.state[slots] = FREE
        if self.barrier is not None:
            slots = self.barrier.usable(slots)
        self.free.push(slots)

    def reusable(self, slots: np.ndarray) -> np.ndarray:
        """Those of ``slots`` no durable table's file on disk lists (all of
        them for any other table): what may be written, or let go of."""
        return slots if self.barrier is None else slots[~self.barrier.protected[slots]]

    def retired(self) -> int:
        """Slots freed while the file on disk lists their items (0: not durable)."""
        return 0 if self.barrier is None else self.barrier.count

    def restamp(self, slots: np.ndarray) -> None:
        """Free ``slots`` whose items' frames are let go before the slots
        are reserved again (a frame table short of frames): a new stamp
        each, as a reservation gives, so a learner still copying one of
        those items sees it move (``frames/book.py``)."""
        self.map.gens[slots] += np.uint32(1)  # wraps at 2**32 by design

    # ---- writers ----
    @property
    def pending(self) -> int:
        """Slots reserved and not committed, of reservations not void: what
        the rate limiter counts as inserts already."""
        return self.books.pending

    def reserve(self, owner: int, slots: np.ndarray, pid: int = 0, start: int = 0,
                user: int | None = None) -> int:
        """Mark ``slots`` (taken off the free list, or evicted) reserved for
        client ``owner`` (process ``pid`` started at ``start``, recorded so a
        later daemon knows who may still write them; ``user``: its uid, if
        it is under a user cap); returns the reservation id."""
        m = self.map
        m.lease_pid[slots] = pid
        m.lease_start[slots] = start
        m.lease_owner[slots] = owner_key(self.daemon_pid, owner)
        m.state[slots] = RESERVED
        m.prios[slots] = 0.0
        m.gens[slots] += np.uint32(1)  # wraps at 2**32 by design
        return self.books.open(owner, slots, user, time.monotonic())

    @property
    def voided(self) -> int:
        """Slots of void reservations their writers still hold (``reservations.py``)."""
        return self.books.voided

    def room(self, owner: int, user: int | None, n: int) -> int:
        """How many of n slots the writer's caps let it reserve (raises at a cap)."""
        return self.books.room(owner, user, n)

    def check_part(self, owner: int, rid: int, offset: int, n: int | None):
        """(the reservation, its slots ``[offset, offset + n)``; n None: the
        rest), which must be the next part to commit; nothing changes.  A
        void reservation's part is to be ``let_go``, not committed."""
        return self.books.part(owner, rid, offset, n)

    def committed(self, rid: int, entry, part: np.ndarray) -> None:
        """The part ``check_part`` returned is committed."""
        self.books.settle(rid, entry, part.shape[0])
        self.map.state[part] = COMMITTED

    def let_go(self, rid: int, entry, part: np.ndarray) -> ReservationExpired:
        """The part of a void reservation its writer committed: it is done
        with those slots (``reservations.py``); they are free, not
        committed.  Returns what the writer is told."""
        self.books.settle(rid, entry, part.shape[0])
        self.make_free(part)
        return ReservationExpired(
            f"table {self.name!r}: {part.shape[0]} items were not stored: they were copied into "
            f"slots reserved more than {self.books.timeout_s:g} s before their commit "
            "(reservation_timeout_s; a stalled writer?), whose reservation was void by then")

    def abort(self, owner: int, rid: int) -> int:
        """Free the slots of a reservation not committed yet; returns how many."""
        rest = self.books.close(owner, rid)
        self.make_free(rest)
        return rest.shape[0]

    def free_slots(self) -> int:
        """Slots on the free list, with those of dead daemons' writers that
        have exited since (orphans.py)."""
        if self.orphans is not None and self.orphans.count:
            self._unorphan(self.orphans.gone(time.monotonic()))
        return len(self.free)

    def resumed(self, pid: int, start: int, owner: int) -> int:
        """A writer of a dead daemon reconnected naming its old lease: free
        what it held.  Returns how many slots."""
        if self.orphans is None or not self.orphans.count:
            return 0
        return self._unorphan(self.orphans.resumed(pid, start, owner))

    def _unorphan(self, slots: np.ndarray) -> int:
        if slots.shape[0]:
            self.make_free(slots)
        return slots.shape[0]

    def busy(self, held: int, hold_timeout_s: float, note: str = "") -> SlotsBusy:
        """What an insert that found no free or evictable slot is told
        (``held``: slots the holds keep; ``note``: more of why, e.g. a
        durable table's failing syncs)."""
        return SlotsBusy(
            f"table {self.name!r}: no slot is free or evictable now; {self.pending} are reserved "
            f"by writers that have not committed and {held} are held by learners still "
            f"reading their last sample (a hold ends at the latest {hold_timeout_s:g} s "
            "after its sample)" + (f"; {self.books.voided} are held by writers whose reservations "
                                   "expired, until they commit or leave" if self.books.voided else "")
            + (f"; {self.barrier.count} wait for the table's next sync to disk"
               if self.barrier is not None and self.barrier.count else "") + note)

    def take_free(self, k: int) -> np.ndarray:
        """Up to k slots off the free list, oldest first."""
        return self.free.pop(k)

    def release_owner(self, owner: int) -> int:
        """An owner's lease ended: free what it reserved but never
        committed.  Returns how many slots."""
        n = sum(self.abort(owner, rid) for rid in self.books.of(owner))
        self.books.forget(owner)
        return n

    def expire(self, now: float) -> tuple[int, float | None]:
        """Void the reservations older than ``reservation_timeout_s``:
        (slots voided, when the next one expires or None)."""
        return self.books.expire(now)

    # ---- after a dead daemon ----
    def recover(self, max_times: int) -> tuple[int, int]:
        """Take the books over from the segment a dead daemon (or a restored
        checkpoint) left, whose marks are the truth.  An item whose last use
        was counted (``max_times``: the reuse limit, 0 for none) is held
        (the daemon died between counting and removing it); held slots are
        freed; reserved ones are orphans until their writer provably cannot
        write them (``orphans.py``).  Both get their stamps bumped, so no
        key a client kept for them matches.  Returns (held, leased) slots."""
        m = self.map
        st = m.state
        if max_times:
            st[(st == COMMITTED) & (m.times >= max_times)] = HELD
        held = np.flatnonzero(st == HELD)
        leased = np.flatnonzero(st == RESERVED)
        for void in (held, leased):
            m.prios[void] = 0.0
            m.gens[void] += np.uint32(1)
        st[held] = FREE
        if leased.shape[0]:
            self.orphans = OrphanLeases(leased, m.lease_pid[leased], m.lease_start[leased],
                                        m.lease_owner[leased])
        self.free.push(np.flatnonzero(st == FREE))
        return held.shape[0], leased.shape[0]

    def orphaned(self) -> tuple[int, list[dict]]:
        """Slots leased under a dead daemon not yet freed, and their holders."""
        return (self.orphans.count, self.orphans.holders()) if self.orphans else (0, [])

    # ---- a durable table's reuse barrier (barrier.py) ----
    def start_barrier(self, want_sync, listed: np.ndarray | None = None) -> None:
        """The table is durable from now on: no slot the file on disk lists
        is written before the next sync, which ``want_sync()`` asks for.
        ``listed``: the mask of items the file an adopted table came from
        lists, protected until then (the free slots they name are retired)."""
        self.barrier = ReuseBarrier(self.map.spec.capacity)
        self.wake_sync = want_sync
        if listed is not None:
            self.barrier.protect(listed)
            self.make_free(self.free.pop(len(self.free)))

    @property
    def durable(self) -> bool:
        return self.barrier is not None

    def protect(self, listed: np.ndarray) -> None:
        """A sync took its copy, which lists the items of mask ``listed``."""
        self.barrier.protect(listed)

    def landed(self, listed: np.ndarray) -> int:
        """That copy is on disk: the retired slots it no longer lists are
        free again.  Returns how many."""
        freed = self.barrier.landed(listed)
        self.free.push(freed)
        return freed.shape[0]

    def waits_for_sync(self) -> bool:
        """A writer waits for the next sync instead of evicting: as many
        slots retired as the headroom, or a queue (``barrier.consumable``)
        with any retired."""
        b = self.barrier
        return b is not None and (b.full or (b.count > 0 and consumable(self.map.spec)))

    def ahead(self, size: int) -> int:
        """How many of ``size`` items a full durable table evicts ahead now,
        so its free and retired slots stay at the headroom and the next
        sync frees a batch while writers use what is free (a queue: none)."""
        b = self.barrier
        if (b is None or not b.listed or len(self.free) >= b.headroom // 2 + 1
                or consumable(self.map.spec)):
            return 0
        return max(0, min(size, b.headroom - b.count - len(self.free)))

    def want_sync(self, force: bool = False) -> None:
        """Ask for a sync when retired slots are needed: the free list is
        below half the headroom (``force``: a writer waits for them)."""
        b = self.barrier
        if b is not None and b.count and (force or len(self.free) < b.headroom // 2 + 1):
            self.wake_sync()

    def kept_for_sync(self) -> int:
        """The sync headroom a full durable table keeps out of use once it
        has synced (``leasing.sampling_warning`` says how much of it when),
        0 for a table that evicts none ahead (not durable, or a queue)."""
        b = self.barrier
        return 0 if b is None or consumable(self.map.spec) else b.headroom

    def barrier_report(self) -> dict:
        b = self.barrier
        return {} if b is None else {"retired": b.count, "sync_headroom": b.headroom}
