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
parts, in order.  A hold keeps slots of items sampled for the last time
(``max_times_sampled``) out of use until the learner that drew them
releases them, so a row handed out is never overwritten while being read,
or until it is ``hold_timeout_s`` old (``expire``): a learner that hangs
must not keep slots for ever.  Its late gather still returns no wrong row:
a slot is reused only through ``reserve``, which bumps the stamp the
learner re-reads after its copy.

A *pin* protects the slots of a batch a learner is gathering: a SAMPLE
marked protected (the client's redraw of rows that writers overwrote
during its first gather, ``client/draws.py``) pins every slot it drew
until the learner releases the hold, or the hold expires.  A pinned item
stays in the table and may be drawn again; if a writer's eviction picks
it, the item leaves the table but its slot is *parked* (HELD) instead of
handed out, and the eviction takes the next victim; the last pin to go
frees a parked slot.  So a protected batch is stable whatever the
writers do, and a learner's sample costs bounded work: at most one
plain gather and one protected one.  A client pins at most a quarter of
the table, so does a capped user over all its clients, and all capped
users together at most half (``pinbooks.py``); past a cap a protected
draw is a plain one.

The ledger does not decide which slots to reserve (the table asks the free
list, then its remover) nor what committed items are; it keeps the books.

Engine thread only; no method may run concurrently with another.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from ...errors import ProtocolError, SlotsBusy
from ...wire.layout import COMMITTED, FREE, HELD, RESERVED, TableMap
from ...wire.records import owner_key
from .barrier import ReuseBarrier
from .orphans import OrphanLeases
from .pinbooks import PinBooks
from .reservations import RESERVATION_TIMEOUT_S, Reservations
from .slotqueue import SlotQueue

log = logging.getLogger("shmreplayd.table")

_NONE = np.empty(0, np.int64)
MAX_HOLDS = 64  # open holds per client; past this the oldest is released (its batch is long gathered)
HOLD_TIMEOUT_S = 5.0


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
        # hid -> (owner, slots held, since, slots pinned): pins ride on holds
        self.holds: dict[int, tuple[int, np.ndarray, float, np.ndarray]] = {}
        self.holds_of: dict[int, collections.deque] = {}
        # (since, hid) in the order holds were made, which is the order they
        # expire in; released ones are dropped when they reach the front
        self.by_age: collections.deque = collections.deque()
        self.hold_timeout_s = limits.hold_timeout_s
        self.next_hid = 1
        self.held = 0     # slots held for learners (parked ones among them)
        cap = tmap.spec.capacity
        self.pinned = np.zeros(cap, np.uint32)  # pins on each slot
        self.parked = np.zeros(cap, np.bool_)   # left the table while pinned: freed at the last unpin
        self.pins = PinBooks(cap)               # who pins how many: the caps (pinbooks.py)
        self.orphans: OrphanLeases | None = None  # leased under a dead daemon (orphans.py)
        self.barrier: ReuseBarrier | None = None   # a durable table's (barrier.py)
        self.daemon_pid = os.getpid()

    def make_free(self, slots: np.ndarray) -> None:
        """Slots nobody uses any more: on the free list, or retired while the
        metadata file on disk lists their items (barrier.py)."""
        self.map.state[slots] = FREE
        if self.barrier is not None:
            slots = self.barrier.usable(slots)
        self.free.push(slots)

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

    def check_part(self, owner: int, rid: int, offset: int, n: int | None):
        """(the reservation, its slots ``[offset, offset + n)``; n None: the
        rest), which must be the next part to commit; nothing changes.  A
        void reservation's part is to be ``let_go``, not committed."""
        return self.books.part(owner, rid, offset, n)

    def committed(self, rid: int, entry, part: np.ndarray) -> None:
        """The part ``check_part`` returned is committed."""
        self.books.settle(rid, entry, part.shape[0])
        self.map.state[part] = COMMITTED

    def let_go(self, rid: int, entry, part: np.ndarray) -> None:
        """The part of a void reservation its writer committed: it is done
        with those slots (``reservations.py``); they are free, not committed."""
        self.books.settle(rid, entry, part.shape[0])
        self.make_free(part)

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

    def busy(self, note: str = "") -> SlotsBusy:
        """What an insert that found no free or evictable slot is told
        (``note``: more of why, e.g. a durable table's failing syncs)."""
        return SlotsBusy(
            f"table {self.name!r}: no slot is free or evictable now; {self.pending} are reserved "
            f"by writers that have not committed and {self.held} are held by learners still "
            f"reading their last sample (a hold ends at the latest {self.hold_timeout_s:g} s "
            "after its sample)" + (f"; {self.books.voided} are held by writers whose reservations "
                                   "expired, until they commit or leave" if self.books.voided else "")
            + (f"; {self.barrier.count} wait for the table's next sync to disk"
               if self.barrier is not None and self.barrier.count else "") + note)

    def take_free(self, k: int) -> np.ndarray:
        """Up to k slots off the free list, oldest first."""
        return self.free.pop(k)

    # ---- learners ----
    def hold(self, owner: int, slots: np.ndarray) -> int:
        """Keep ``slots`` (their items just left the table) for ``owner`` to read."""
        self.map.state[slots] = HELD
        self.held += slots.shape[0]
        return self._new_hold(owner, slots, _NONE)

    def pin(self, owner: int, slots: np.ndarray, hid: int = 0, user: int | None = None) -> int:
        """Protect the slots of a batch ``owner`` drew (duplicates allowed)
        until it releases hold ``hid`` (0: a new hold); returns the hold id,
        or ``hid`` unchanged when a cap would be passed (``pinbooks.py``;
        ``user``: the owner's capped uid, None for root, the daemon's user
        and the admin group)."""
        u = np.unique(slots)
        if not self.pins.admit(owner, u.shape[0], user):
            return hid
        self.pinned[u] += np.uint32(1)
        if hid:
            o, held, since, _ = self.holds[hid]
            self.holds[hid] = (o, held, since, u)
            return hid
        return self._new_hold(owner, _NONE, u)

    def park_pinned(self, slots: np.ndarray) -> np.ndarray:
        """Of ``slots`` whose items were just evicted, park the pinned ones
        (HELD until their last pin goes); returns the others."""
        mask = self.pinned[slots] > 0
        if not mask.any():
            return slots
        p = slots[mask]
        self.map.state[p] = HELD
        self.parked[p] = True
        self.held += p.shape[0]
        return slots[~mask]

    def _new_hold(self, owner: int, slots: np.ndarray, pins: np.ndarray) -> int:
        hid = self.next_hid
        self.next_hid += 1
        since = time.monotonic()
        self.holds[hid] = (owner, slots, since, pins)
        self.by_age.append((since, hid))
        mine = self.holds_of.setdefault(owner, collections.deque())
        mine.append(hid)
        if len(mine) > MAX_HOLDS:
            self.release(owner, mine[0])
        return hid

    def release(self, owner: int, hid: int) -> None:
        """The learner is done reading the rows of hold ``hid``: free the
        held slots nobody pins, and drop its pins."""
        if not 0 < hid < self.next_hid:
            raise ProtocolError(f"table {self.name!r}: RELEASE of hold {hid}, which never existed")
        entry = self.holds.get(hid)
        if entry is None:
            return  # released already: the MAX_HOLDS cap or the hold's expiry got there first
        if entry[0] != owner:
            raise ProtocolError(f"table {self.name!r}: hold {hid} is not yours")
        del self.holds[hid]
        mine = self.holds_of.get(owner)
        if mine is not None and hid in mine:
            mine.remove(hid)
        slots, pins = entry[1], entry[3]
        if slots.shape[0]:
            busy = self.pinned[slots] > 0  # another learner still reads them: park
            self.parked[slots[busy]] = True
            free = slots[~busy]
            self.held -= free.shape[0]
            self.make_free(free)
        if pins.shape[0]:
            self.pins.drop(owner, pins.shape[0])
            self.pinned[pins] -= np.uint32(1)
            done = pins[(self.pinned[pins] == 0) & self.parked[pins]]
            self.parked[done] = False
            self.held -= done.shape[0]
            self.make_free(done)

    def expire(self, now: float) -> tuple[int, float | None]:
        """Release every hold made ``hold_timeout_s`` or more before ``now``.
        Returns how many held slots that freed, and when the next hold expires
        (None: no hold is open)."""
        q, freed = self.by_age, 0
        while q:
            since, hid = q[0]
            entry = self.holds.get(hid)
            if entry is not None:
                if since + self.hold_timeout_s > now:
                    return freed, since + self.hold_timeout_s
                owner, held, pins = entry[0], entry[1].shape[0], entry[3].shape[0]
                log.warning("table %s: client %d did not release %d held and %d pinned slots "
                            "within %g s (a hung learner?); let them go", self.name, owner, held,
                            pins, self.hold_timeout_s)
                self.release(owner, hid)
                freed += held  # pinned slots hold committed items: nothing to free (parked ones aside)
            q.popleft()
        return freed, None

    def holders(self, pids: dict) -> list[dict]:
        """Who holds slots: per client its id, pid (from ``pids``), how many
        slots, and the age of its oldest hold in seconds."""
        now, out = time.monotonic(), {}
        for owner, slots, since, pins in self.holds.values():  # oldest first
            h = out.setdefault(owner, {"client": owner, "pid": pids.get(owner, 0), "held": 0,
                                       "pinned": 0, "oldest_s": round(now - since, 3)})
            h["held"] += slots.shape[0]
            h["pinned"] += pins.shape[0]
        return list(out.values())

    def release_owner(self, owner: int) -> int:
        """An owner's lease ended: free what it reserved but never committed,
        and the slots it held for reading.  Returns how many slots."""
        n = sum(self.abort(owner, rid) for rid in self.books.of(owner))
        self.books.forget(owner)
        for hid in list(self.holds_of.get(owner, ())):
            self.release(owner, hid)
        self.holds_of.pop(owner, None)
        return n
