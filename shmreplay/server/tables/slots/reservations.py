"""Writers' reservations of one table: whose slots, committed how far, how
long idle, and how much of the table other users may hold.

A reservation (``rid``) is the slots one RESERVE granted a client, which it
commits in parts, in order.  Two bounds keep a user from taking a table
from its owner (a client that reserves every slot and never commits would
otherwise evict every item and starve every other writer):

* **caps**, for clients of users other than the daemon's own, root and the
  admin group (the daemon's own users are its trust domain, and one actor
  of theirs may run many writers).  Such a client holds at most
  ``client_cap`` uncommitted slots of a table: 64 leases' worth (clients
  reserve capacity/256 at a time, at most two leases per writer), never
  more than a quarter of the table, but always 64 (all of a smaller table:
  a writer of a small queue needs its batch).  Such a user holds at most
  ``user_cap`` over all of its connections (the same quarter, or 64), and
  all such users together at most ``others_cap`` (half the table), so the
  owner always has half of it.  A grant is cut to what the caps leave; at
  a cap the RESERVE is refused at once, never parked (a parked one would
  hold up the table's queue of RESERVEs, the owner's among them, and only
  its own side's commits could make room): ``CapacityError`` at the
  client's cap, ``SlotsBusy`` at the user's or the others'.
* **expiry.**  A reservation its writer has not committed any of for
  ``timeout_s`` (since it was granted, or since its last commit: a slow
  writer that commits now and then keeps it) is *void*: it stops counting
  as an insert for the rate limiter, and the slots it still holds stay
  reserved, never reused, until its writer commits or aborts them (a COMMIT
  comes after the copy, so it proves the writer has stopped writing there)
  or its lease ends.  A late writer's commit is refused
  (``ReservationExpired``, reported by its next call or flush): it loses
  its own uncommitted items and never tears a committed row.  No clock
  decides when a stalled writer is done copying, so none frees the slots
  (as for orphaned leases, ``orphans.py``).  Void slots still count
  against their client's caps.

Owned by a ``SlotLedger``, which marks the slots in the segment; engine
thread only.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ....errors import CapacityError, ProtocolError, SlotsBusy

log = logging.getLogger("shmreplayd.table")

RESERVATION_TIMEOUT_S = 60.0
MIN_CAP_LEASES = 8  # a lease of fewer slots than this counts as this many for the cap
CAP_LEASES = 64     # a client may hold this many leases' worth (at most a quarter of the table)
ANY_CAP = 64        # but always this many (all of a smaller table)


def client_cap(capacity: int) -> int:
    """The most uncommitted slots one capped client may hold in a table."""
    lease = min(4096, capacity // 256)
    return max(min(capacity, ANY_CAP), min(capacity // 4, CAP_LEASES * max(lease, MIN_CAP_LEASES)))


def user_cap(capacity: int) -> int:
    """The most one capped user may hold over all of its connections: a
    quarter of the table (or 64)."""
    return max(min(capacity, ANY_CAP), capacity // 4)


def others_cap(capacity: int) -> int:
    """The most all capped users together may hold: half the table (or 64)."""
    return max(min(capacity, ANY_CAP), capacity // 2)


class Entry:
    __slots__ = ("owner", "user", "slots", "done", "since", "void", "held")

    def __init__(self, owner: int, user: int | None, slots: np.ndarray, since: float, held: tuple):
        self.owner, self.user, self.slots = owner, user, slots
        self.since = since  # granted, or last committed to: the idle clock starts here
        self.done, self.void = 0, False
        self.held = held    # its client's count and its user's (None: uncapped): one-item lists

    @property
    def rest(self) -> int:
        return self.slots.shape[0] - self.done


class Reservations:
    """The books, and what each capped client and user holds (uncommitted
    slots, void ones too), kept as counts a commit moves by its size."""

    def __init__(self, name: str, capacity: int, timeout_s: float = RESERVATION_TIMEOUT_S):
        self.name = name
        self.timeout_s = timeout_s
        self.client_cap, self.user_cap = client_cap(capacity), user_cap(capacity)
        self.others_cap = others_cap(capacity)
        self.entries: dict[int, Entry] = {}
        self.next_rid = 1
        self.next_expiry: float | None = None  # no reservation expires before this (None: none open)
        self.pending = 0   # uncommitted slots of live reservations: inserts, to the rate limiter
        self.voided = 0    # uncommitted slots of void ones: reserved until their writer lets go
        # capped client -> [uncommitted slots] (dropped when it leaves); capped uid -> the same
        # over its clients; and all capped users together.  One-item lists each entry holds:
        # a commit moves them without a look-up
        self.by_owner: dict[int, list] = {}
        self.by_user: dict[int, list] = {}
        self.others = [0]

    # ---- caps ----
    def held_by(self, owner: int = -1, user: int | None = None) -> int:
        """Uncommitted slots (void ones too) of capped client ``owner``, or of
        every client of capped ``user``."""
        got = self.by_user.get(user) if user is not None else self.by_owner.get(owner)
        return got[0] if got else 0

    def room(self, owner: int, user: int | None, n: int) -> int:
        """How many of n slots ``owner`` (of ``user``; None: a client of the
        daemon's own users, uncapped) may reserve now, at least one; raises
        at a cap (module docstring)."""
        if user is None:
            return n
        mine = self.held_by(owner)
        if mine >= self.client_cap:
            raise CapacityError(
                f"table {self.name!r}: this client holds {mine} reserved slots it has not committed, "
                f"its cap ({self.client_cap}); commit or close its writers' open items, or use "
                "more clients")
        theirs, together = self.held_by(user=user), self.others[0]
        if theirs >= self.user_cap or together >= self.others_cap:
            which = (f"user {user} holds {theirs} reserved slots over its connections, its cap "
                     f"({self.user_cap}, a quarter of the table)" if theirs >= self.user_cap else
                     f"users other than the daemon's hold {together} reserved slots, their cap "
                     f"({self.others_cap}, half of the table)")
            raise SlotsBusy(f"table {self.name!r}: {which}; those writers must commit first")
        return min(n, self.client_cap - mine, self.user_cap - theirs, self.others_cap - together)

    # ---- the books ----
    def open(self, owner: int, slots: np.ndarray, user: int | None, now: float) -> int:
        rid = self.next_rid
        self.next_rid += 1
        held = (None, None) if user is None else (self.by_owner.setdefault(owner, [0]),
                                                  self.by_user.setdefault(user, [0]))
        e = self.entries[rid] = Entry(owner, user, slots, now, held)
        if self.next_expiry is None:
            self.next_expiry = now + self.timeout_s
        self._count(e, slots.shape[0])
        self.pending += slots.shape[0]
        return rid

    def entry(self, owner: int, rid: int) -> Entry:
        e = self.entries.get(rid)
        if e is None or e.owner != owner:
            raise ProtocolError(f"table {self.name!r}: reservation {rid} is not yours or not open")
        return e

    def part(self, owner: int, rid: int, offset: int, n: int | None) -> tuple[Entry, np.ndarray]:
        """The reservation and its slots ``[offset, offset + n)`` (n None:
        the rest), which must be the next part to commit; nothing changes."""
        e = self.entry(owner, rid)
        rest = e.slots.shape[0] - e.done
        if n is None:
            n = rest
        if offset != e.done or n < 1 or n > rest:
            raise ProtocolError(
                f"table {self.name!r}: commit of [{offset}, {offset + n}) of reservation {rid} "
                f"is out of order (next is {e.done} of {e.slots.shape[0]})")
        return e, e.slots[e.done:e.done + n]

    def settle(self, rid: int, e: Entry, n: int) -> None:
        """n more slots of ``rid`` are committed (or, for a void one, let go)."""
        e.done += n
        e.since = time.monotonic()  # active: the idle clock starts again
        if e.void:
            self.voided -= n
        else:
            self.pending -= n
        self._count(e, -n)
        if e.done == e.slots.shape[0]:
            del self.entries[rid]

    def close(self, owner: int, rid: int) -> np.ndarray:
        """End a reservation (abort, a lease that ended); its uncommitted slots."""
        e = self.entry(owner, rid)
        del self.entries[rid]
        rest = e.slots[e.done:]
        if e.void:
            self.voided -= rest.shape[0]
        else:
            self.pending -= rest.shape[0]
        self._count(e, -rest.shape[0])
        return rest

    def of(self, owner: int) -> list[int]:
        return [rid for rid, e in self.entries.items() if e.owner == owner]

    def forget(self, owner: int) -> None:
        """A client left (its reservations are closed): drop its count."""
        self.by_owner.pop(owner, None)

    def _count(self, e: Entry, n: int) -> None:
        mine, users = e.held
        if users is not None:
            mine[0] += n
            users[0] += n
            self.others[0] += n

    # ---- expiry ----
    def expire(self, now: float) -> tuple[int, float | None]:
        """Void every reservation idle for ``timeout_s`` or more at ``now``;
        returns how many uncommitted slots that voided, and when the next
        one may expire (None: none is open).  Called every engine pass:
        nothing to do before ``next_expiry``; then one look at every open
        reservation (a few per writer), which sets the next."""
        if self.next_expiry is None or now < self.next_expiry:
            return 0, self.next_expiry
        voided, soonest = 0, None
        for e in self.entries.values():
            if e.void:
                continue
            at = e.since + self.timeout_s
            if at > now:
                soonest = at if soonest is None or at < soonest else soonest
                continue
            e.void = True
            self.pending -= e.rest
            self.voided += e.rest
            voided += e.rest
            log.warning("table %s: client %d committed none of its %d reserved slots for %g s; its "
                        "reservation is void: they stay out of use until it commits or aborts them "
                        "or its lease ends, and its commit of them is refused",
                        self.name, e.owner, e.rest, self.timeout_s)
        self.next_expiry = soonest
        return voided, soonest
