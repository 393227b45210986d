"""The holds of one table: slots kept for the learners that are reading them.

Two kinds ride on one hold id, which the learner releases when its batch
is copied (``release``) or which expires ``hold_timeout_s`` after it was
made (``expire``: a learner that hangs must not keep slots for ever):

* *held* slots: the items sampled for the last time (``max_times_sampled``)
  left the table; their slots stay HELD, out of any writer's reach, until
  the hold ends;
* *pins*: a protected SAMPLE (the client's redraw of rows writers
  overwrote during its first gather, ``client/draws.py``) pins every slot
  it drew.  A pinned item stays in the table; if an eviction picks it, its
  slot is *parked* (HELD) instead of handed out (``park_pinned``) and the
  last pin to go frees it.  Caps on who pins how much: ``pinbooks.py``.

The slot life cycle these steps belong to is drawn in ``ledger.py``; a
slot a hold lets go goes back through the ledger (``freed``, the ledger's
``make_free``), which decides whether it may be written at once.

Engine thread only (the ``Table`` owns one); no method may run
concurrently with another.
"""

from __future__ import annotations

import collections
import logging
import time

import numpy as np

from ....errors import ProtocolError
from ....wire.layout import HELD, TableMap
from .pinbooks import PinBooks

log = logging.getLogger("shmreplayd.table")

_NONE = np.empty(0, np.int64)
MAX_HOLDS = 64  # open holds per client; past this the oldest is released (its batch is long gathered)
HOLD_TIMEOUT_S = 5.0


class Holds:
    def __init__(self, name: str, tmap: TableMap, timeout_s: float, freed):
        """``freed(slots)``: hand slots nobody uses any more back to the
        ledger (``SlotLedger.make_free``)."""
        self.name = name
        self.map = tmap
        self.freed = freed
        # hid -> (owner, slots held, since, slots pinned): pins ride on holds
        self.holds: dict[int, tuple[int, np.ndarray, float, np.ndarray]] = {}
        self.holds_of: dict[int, collections.deque] = {}
        # (since, hid) in the order holds were made, which is the order they
        # expire in; released ones are dropped when they reach the front
        self.by_age: collections.deque = collections.deque()
        self.timeout_s = timeout_s
        self.next_hid = 1
        self.held = 0     # slots held for learners (parked ones among them)
        cap = tmap.spec.capacity
        self.pinned = np.zeros(cap, np.uint32)  # pins on each slot
        self.parked = np.zeros(cap, np.bool_)   # left the table while pinned: freed at the last unpin
        self.pins = PinBooks(cap)               # who pins how many: the caps (pinbooks.py)

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
        if not self.pins.any():  # the usual case: ~5% of a small table's reservation
            return slots
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
            self.freed(free)
        if pins.shape[0]:
            self.pins.drop(owner, pins.shape[0])
            self.pinned[pins] -= np.uint32(1)
            done = pins[(self.pinned[pins] == 0) & self.parked[pins]]
            self.parked[done] = False
            self.held -= done.shape[0]
            self.freed(done)

    def expire(self, now: float) -> tuple[int, float | None]:
        """Release every hold made ``hold_timeout_s`` or more before ``now``.
        Returns how many held slots that freed, and when the next hold expires
        (None: no hold is open)."""
        q, freed = self.by_age, 0
        while q:
            since, hid = q[0]
            entry = self.holds.get(hid)
            if entry is not None:
                if since + self.timeout_s > now:
                    return freed, since + self.timeout_s
                owner, held, pins = entry[0], entry[1].shape[0], entry[3].shape[0]
                log.warning("table %s: client %d did not release %d held and %d pinned slots "
                            "within %g s (a hung learner?); let them go", self.name, owner, held,
                            pins, self.timeout_s)
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

    def release_owner(self, owner: int) -> None:
        """An owner's lease ended: release every hold it has."""
        for hid in list(self.holds_of.get(owner, ())):
            self.release(owner, hid)
        self.holds_of.pop(owner, None)
