"""A table handle's slot leases, and how many slots a lease reserves at a time.

A table handle (``table.py``) inserts through a lease of its own (``own``:
``insert``, ``insert_batch``) and makes one for each writer whose items
stay open across calls (``new``: ``writers.py``, ``parameters.py``).
``TableLeases`` keeps them all (weakly: a writer's goes with its writer),
binds each to the table as mapped now, again after every reconnect, and
voids or renews them when the connection goes or the daemon voided a
reservation.  ``leasing.lease_size`` (shared with the daemon's checks of
a table's settings) and ``widened_lease_size`` say how large a lease is.

Who calls it: its table handle, which makes it and is its only caller
(the handle's own lease it also writes through directly), on the client's
thread, one call at a time.
"""

from __future__ import annotations

import weakref

from ..errors import ReplayError
from ..leasing import LEASE_MAX, lease_size
from .lease import SlotLease


class TableLeases:
    """The slot leases of one table handle: its own (``own``) and its
    writers' (``new``).  Built from what they use: the table's spec, the
    client's ``session.Session`` and the table's priority check."""

    def __init__(self, spec, session, priorities):
        self.size = lease_size(spec, session.max_batch)  # a new lease's size (Table.lease_size)
        self._spec = spec
        self._session = session
        self._priorities = priorities
        self._leases: weakref.WeakSet = weakref.WeakSet()
        self._binding: tuple = (0, {}, [], None, None)  # SlotLease.bind's arguments, as bound now
        self.own = self.new()

    def bind(self, table_id: int, views: dict, view_list: list, words, epoch: int) -> None:
        """The table as mapped now (``SlotLease.bind``), for every lease of it."""
        self._binding = (table_id, views, view_list, words, epoch)
        for lease in list(self._leases):
            lease.bind(*self._binding)

    def retire(self) -> None:
        """No table has this name any more: id 0, so every later call raises UnknownTable."""
        self.bind(0, *self._binding[1:])

    def new(self) -> SlotLease:
        """A lease of its own for a writer, bound to the table as mapped now."""
        lease = SlotLease(self.size, self._spec.name, self._session, self._priorities)
        lease.bind(*self._binding)
        self._leases.add(lease)
        return lease

    def void(self) -> bool:
        """The connection of these leases is gone (reconnect, fork): every
        one is void; True if a writer had items open in one (possibly lost)."""
        return any([lease.void() for lease in list(self._leases)])

    def renew(self) -> None:
        """The daemon voided a reservation of this client: every lease hands
        back what it can and starts anew; a writer's open items are gone."""
        for lease in list(self._leases):
            lease.release()
            if lease is not self.own:
                lease.void()

    def widen(self, slots) -> int:
        """``Table.widen_lease``: the own lease reserves up to ``slots`` at a
        time (``widened_lease_size``); returns its size now."""
        return self.own.resize(widened_lease_size(self._spec, self.size, slots, self._session.max_batch))


def widened_lease_size(spec, default: int, slots, max_batch: int) -> int:
    """``Table.widen_lease``: the lease size for a writer that inserts large
    batches back to back (the Ray ingest), which asks for ``slots``: with
    the default lease (capacity/256) a 64-row batch into a 20,000-item
    table needs a reservation, a daemon wake-up, nearly every call.  Never
    below the default, at most a 32nd of the capacity (two leases withhold
    at most ~6% of the table from sampling) and LEASE_MAX; a rate-limited
    table or a tiny one keeps its lease (its limiter counts a reserved slot
    as an insert)."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
        raise ReplayError(f"widen_lease takes a number of slots >= 0, got {slots!r}")
    if default == 0 or spec.rate_limited:
        return default
    return max(default, min(slots, LEASE_MAX, spec.capacity // 32, max_batch))
