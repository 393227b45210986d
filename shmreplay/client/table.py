"""A client's handle on one table: insert, sample, update priorities.

Cheap, cached per client (``Client.table``); same threading rule as its
``Client``: one thread at a time.  Inserts go through a ``SlotLease``
(``lease.py``); samples draw in the daemon (keys, probabilities, weights)
and gather rows here (``draws.draw_batch``).  The rate-limiter probes read
the counters the daemon mirrors into the segment, with no round trip.

A handle is made by its ``Client``, with the client's ``session.Session``,
whose connection it uses (``pipe``, ``begin``...).  Besides its public API
it answers the session (``forget_connection``, ``rebind``, ``retire``: the
connection went, came back, or came back without this table) and the
client's flush (``hand_back``).  It owns its table's mapping and binds
its two sides to it, again after every reconnect: its draw side
(``draws.TableDraws``: what ``sample`` and ``sample_indices`` draw from,
and the holds of the latter) and its slot leases (``leases.TableLeases``:
its own, which ``insert`` writes through, and its writers').

Handles of a client made with ``reconnect=True`` are ``ReconnectingTable``:
every call marked ``@retried`` runs again, once, after a reconnect, if the
daemon went away during it.  Other clients' handles are plain ``Table`` so
their hot paths pay nothing for it.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from .. import ratelimiter
from ..errors import PriorityError, ReplayError
from ..priorities import as_priorities
from ..schema import spec_from_wire
from ..wire import records as R
from ..wire.layout import TableMap
from .draws import TableDraws
from .gather import Rows, SampleBatch
from .iterator import BatchIterator
from .lease import SlotLease
from .leases import TableLeases
from .pipe import deadline_of, in_slices
from .retry import retried, with_retries
from .rows import RowForm, check_rows


class Table:
    """A client's handle on one table; made by its ``Client`` (see the
    module docstring for who may call what).  One thread at a time.

    Composed of its draw side (``draws.TableDraws``: what it draws from,
    the holds of ``sample_indices``, the batch drawn ahead) and its slot leases
    (``leases.TableLeases``); it owns the table's mapping and binds both
    to it."""

    def __init__(self, client, session, desc: dict):
        self._client = client
        self._session = session
        self._begin = session.begin  # bound once: the prologue of every data call
        self.spec = _spec_of(desc)
        self.name = self.spec.name
        self._fields = self.spec.fields
        self._form = RowForm(self.spec)  # the fields, for checking what callers hand in
        self._map = None
        self._draws = TableDraws(session, self._fields)
        self._leases = TableLeases(self.spec, session, self._priorities)
        self._lease = self._leases.own  # bound once: inserts write through it
        self._bind(desc)

    def _bind(self, desc: dict) -> None:
        self.id = int(desc["id"])
        old, self._map = self._map, TableMap.attach(desc["segment"], self.spec, desc.get("rows_fd"))
        if old is not None:
            old.release()  # arrays handed out keep their mapping alive
        self._views = views = self._map.fields
        self._words = self._map.words
        self._draws.bind(self.id, Rows(self._map), self._map.gens)
        # leases are valid while the epoch stays (lease.py)
        self._leases.bind(self.id, views, [views[f.name] for f in self._fields if f.name in views],
                          self._words, self._words.epoch)  # a frame table's slots: not its stacks

    # ---- called by the session (connection gone, back) and the client's flush ----
    def rebind(self, desc: dict) -> None:
        """After a reconnect: the daemon's table of this name, every lease void."""
        self.spec = _spec_of(desc, self.spec)
        self._bind(desc)  # TableMap.attach takes rows_fd: closed on every path

    def retire(self) -> None:
        """After a reconnect no table has this name: id 0, so every later call raises UnknownTable."""
        self.id = 0
        self._draws.retire()
        self._leases.retire()

    def forget_connection(self) -> bool:
        """The connection of this handle's leases and holds is gone (reconnect,
        fork); True if a writer had items open in a lease (possibly lost)."""
        self._draws.forget()
        return self._leases.void()

    def hand_back(self) -> None:
        """The client's flush: hand back unused leased slots and ``sample_indices``' holds."""
        self._lease.release()
        self.release()

    def renew_leases(self) -> None:
        """The daemon voided a reservation of this client (``ReservationExpired``):
        every lease of this table hands back what it can and starts anew, so
        no item goes into a void one; a writer's open items are gone."""
        self._leases.renew()

    def __reduce__(self):
        return (_reopen, (self._client, self.name))

    client = property(lambda self: self._client, doc="The ``Client`` this handle belongs to.")
    # the segments as mapped now (anew at a reconnect): marks (``state``, ``gens``, ``seqno``; read only)
    # and rows, for a reader that copies rows and checks the stamps itself (``ParameterBoard``)
    mapped = property(lambda self: self._map)
    lease_size = property(lambda self: self._leases.size,
                          doc="Slots a writer reserves at a time (0: per call): ``leasing.lease_size``.")

    def __len__(self) -> int:
        return self._words.size

    def __repr__(self) -> str:
        return f"<shmreplay.Table {self.name!r} {len(self)}/{self.spec.capacity}>"

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    @property
    def inserts(self) -> int:
        """Items committed so far (shared memory: no round trip; a snapshot)."""
        return self._words.inserts

    # ---- rate-limiter probes (no round trip: the daemon's counters are in the segment) ----
    def can_insert(self, n: int = 1) -> bool:
        """True if an insert of n items would run now without waiting for
        the rate limiter.  A snapshot: other clients may change it at once."""
        w = self._words
        return ratelimiter.insert_room(self.spec, w.size, w.inserts, w.pending, w.samples, n) >= n

    def can_sample(self, n: int = 1) -> bool:
        """True if a sample of n would run now without waiting (min size,
        ratio, reuse limits, something with positive priority)."""
        w = self._words
        if ratelimiter.sample_blocker(self.spec, w.size, w.inserts, w.samples, n) is not None:
            return False
        if self.spec.max_times_sampled and w.uses < n:
            return False
        return w.mass > 0

    def _priorities(self, values, n: int, what: str) -> np.ndarray:
        return as_priorities(values, n, f"{what} on table {self.name!r}", self.spec.alpha)

    # ---- writing ----
    @retried
    def insert(self, priority=None, timeout: float | None = None, **fields) -> None:
        """Insert one item; ``priority=None`` means the max priority seen so
        far.  Waits up to ``timeout`` s (None: no limit) for the rate limiter.
        Values: numpy arrays or anything np.asarray converts (a tensor
        detached and on the CPU), cast per numpy's same_kind rule (rows.py)."""
        deadline = None if timeout is None else deadline_of(timeout)  # a bad one raises on every path
        if priority is None and (ordered := self._form.in_order(fields)) and self._lease.add_one(ordered):
            pass  # the usual item, checked, stored and committed by one kernel (addone.py)
        elif (values := None if priority is not None else self._form.check_one(fields)):
            self._begin()  # what that kernel does not take, or not now (SlotLease.add_one)
            self._lease.write_one(values, deadline)
        else:
            arrays, _ = check_rows(self.spec, self._form.names, fields, batch=False)
            prios = None if priority is None else self._priorities([priority], 1, "insert")
            self._begin()
            self._lease.write(arrays, 1, prios, True, deadline)
        if self._draws.counting:
            self._draws.step()

    @retried
    def insert_batch(self, data: dict, priorities=None, timeout: float | None = None) -> None:
        """Insert n items; every field's leading dimension is n.  On a
        rate-limited table the items go in as the limiter admits them; if
        ``timeout`` runs out part-way, the items before the error are in."""
        arrays, n = check_rows(self.spec, self._form.names, data, batch=True)
        prios = None if priorities is None else self._priorities(priorities, n, "insert_batch")
        if n == 0:
            return
        self._begin()
        step = self._session.max_batch
        deadline = deadline_of(timeout)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            self._lease.write([a[lo:hi] for a in arrays], hi - lo,
                              None if prios is None else prios[lo:hi], False, deadline)
        if self._draws.counting:
            self._draws.step()

    def widen_lease(self, slots: int) -> int:
        """Reserve up to ``slots`` at a time from the next reservation on
        (``leases.widened_lease_size`` says how far); returns the lease size now."""
        return self._leases.widen(slots)

    def lease(self) -> SlotLease:
        """A slot lease for a writer whose items stay open across calls (``writers.py``)."""
        return self._leases.new()

    def flush(self) -> None:
        """Return when all my inserts (on any table of this client) are sampleable."""
        self._client.flush()

    # ---- reading ----
    def iterate(self, batch_size: int, beta: float = 0.4, prefetch: int = 2,
                timeout: float | None = None, check_reuse: bool = False, buffers=None):
        """Prefetching batches for a learner loop (``iterator.BatchIterator``)::

            with table.iterate(256, beta=0.4) as batches:
                for b in batches:
                    ...train...
                    table.update_priorities(b.keys, new_priorities)

        **A batch is valid until the next one is asked for** (then it is
        refilled); ``check_reuse=True`` checks that.  ``timeout`` bounds
        each batch's wait for the limits; ``buffers``: ``BatchIterator``."""
        return BatchIterator(self, batch_size, beta, prefetch, timeout, buffers, check_reuse)

    @retried
    def sample_indices(self, batch_size: int, beta: float = 0.4, timeout: float | None = None):
        """Draw without gathering: (keys, probabilities, weights).  For a
        learner that reads rows itself (``indices = keys & 0xFFFFFFFF``); it
        must then check the generation stamps as ``sample`` does.  On a
        table with ``max_times_sampled``, slots of items drawn for the last
        time stay held for this learner until its next ``sample_indices``
        call on the table or ``release()``, and at most the daemon's
        ``hold_timeout_s``, so read them before that."""
        n, beta = self._draws.check(batch_size, beta)
        return self._draws.indices(n, beta, timeout)

    def release(self) -> None:
        """Hand back the slots ``sample_indices`` held for reading (see there)."""
        self._draws.release()

    @retried
    def sample(self, batch_size: int, beta: float = 0.4, out: SampleBatch | None = None,
               timeout: float | None = None, ahead: bool = False) -> SampleBatch:
        """Draw ``batch_size`` items.  With ``out=`` (an earlier batch of the
        same size) the rows are gathered into its arrays instead of new ones.
        Waits up to ``timeout`` s (None: no limit) for the table's limits.

        ``ahead=True`` (a loop that inserts and samples on one thread, as an
        SB3- or CleanRL-style loop does): the next batch of this size and
        beta is drawn in the daemon while the loop steps its env, sent by
        the handle's insert calls (``insert``, ``insert_batch``; not a
        writer's) halfway to the next such ``sample``, as the last interval
        counted them, and this call collects the one drawn before it
        (``draws.TableDraws.ahead`` says when it draws now instead).  A
        batch then lacks the items inserted after it was drawn and the
        priority updates sent after that: with no insert between two
        samples the next is sent at once, before your update of this one.
        Its rows are gathered, and checked, here."""
        draws = self._draws
        n, beta = draws.check(batch_size, beta)
        if ahead:
            return draws.ahead(n, beta, out, deadline_of(timeout))
        return in_slices(deadline_of(timeout), lambda w: draws.finish(None, n, beta, out, w))

    # ---- pipelined draws (BatchIterator, Client.sample_many) ----
    def begin_sample(self, n: int, beta: float, wait_s: float) -> int:
        """Send a SAMPLE now and collect it later with ``finish_sample``;
        returns its ticket.  The daemon may hold it ``wait_s`` for the limits."""
        n, beta = self._draws.check(n, beta)
        return self._draws.begin(n, beta, wait_s)

    def finish_sample(self, ticket: int | None, n: int, beta: float, out: SampleBatch | None,
                      wait_s: float) -> SampleBatch:
        """Gather the batch a ``begin_sample`` ticket drew (None: draw now):
        rows whose slot was overwritten during the gather are drawn again."""
        return self._draws.finish(ticket, n, beta, out, wait_s)

    @retried
    def update_priorities(self, keys, priorities) -> None:
        """Set new priorities for sampled keys; keys whose slot has been
        overwritten since are ignored (and counted in the table's stats)."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        if keys.ndim != 1:
            raise PriorityError(f"keys must be 1-D, got shape {keys.shape}")
        n = keys.shape[0]
        prios = self._priorities(priorities, n, "update_priorities")
        self._begin()
        session = self._session
        session.link.live()
        step = session.max_batch
        pipe = session.pipe
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            pipe.send(R.put_update, self.id, keys[lo:hi], prios[lo:hi])


ReconnectingTable = with_retries(Table)


def _drop_rows_fd(desc: dict) -> None:
    """Close the writable rows descriptor the daemon passed with ``desc``
    (``link.py``), when the table is not mapped after all."""
    fd = desc.pop("rows_fd", None)
    if fd is not None:
        os.close(fd)


def _spec_of(desc: dict, was=None):
    """The table's definition in ``desc``; ``was``: the one it had before a
    reconnect, which it must still be (but for where its rows live: a
    restore may move them, disk <-> /dev/shm).  If it (or the table's id)
    does not read, or is another, the rows descriptor passed with it is
    closed: nothing else would."""
    try:
        int(desc["id"])  # read by _bind, before TableMap.attach takes the descriptor
        spec = spec_from_wire(desc["spec"])
        if was is not None and dataclasses.replace(spec, storage_dir=was.storage_dir) != was:
            raise ReplayError(f"table {was.name!r} came back with another definition")
        return spec
    except BaseException:
        _drop_rows_fd(desc)
        raise


def _reopen(client, name: str) -> Table:
    return client.table(name)
