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
client's flush (``hand_back``).  It owns its table's mapping and binds its
slot leases to it (``SlotLease.bind``), again after every reconnect.

Handles of a client made with ``reconnect=True`` are ``ReconnectingTable``:
every call marked ``@retried`` runs again, once, after a reconnect, if the
daemon went away during it.  Other clients' handles are plain ``Table`` so
their hot paths pay nothing for it.
"""

from __future__ import annotations

import dataclasses
import os
import weakref

import numpy as np

from .. import ratelimiter
from ..errors import PriorityError, ReplayError
from ..priorities import as_priorities
from ..schema import spec_from_wire
from ..wire import records as R
from ..wire.layout import TableMap
from .draws import draw_batch, receive_draw, send_draw
from .gather import SampleBatch, new_batch
from .iterator import BatchIterator
from .lease import SlotLease
from .pipe import deadline_of, in_slices
from .retry import retried, with_retries
from .rows import check_rows


class Table:
    """A client's handle on one table; made by its ``Client`` (see the
    module docstring for who may call what).  One thread at a time."""

    def __init__(self, client, session, desc: dict):
        self._client = client
        self._session = session
        self._begin = session.begin  # bound once: the prologue of every data call
        self.spec = _spec_of(desc)
        self.name = self.spec.name
        self._fields = self.spec.fields
        self._names = frozenset(f.name for f in self._fields)
        self._map = None
        self._leases: weakref.WeakSet = weakref.WeakSet()
        self._held: list[int] = []  # holds of sample_indices() batches
        self._bind(desc)
        self.lease_size = lease_size(self.spec, session.max_batch)
        self._lease = self.lease()

    def _bind(self, desc: dict) -> None:
        self.id = int(desc["id"])
        old, self._map = self._map, TableMap.attach(desc["segment"], self.spec, desc.get("rows_fd"))
        if old is not None:
            old.release()  # arrays handed out keep their mapping alive
        self._views = self._map.fields
        self._view_list = [self._views[f.name] for f in self._fields]
        self._words = self._map.words
        self._gens = self._map.gens
        self._epoch = self._words.epoch  # leases are valid while this stays (lease.py)
        for lease in list(self._leases):
            self._bind_lease(lease)

    def _bind_lease(self, lease: SlotLease) -> None:
        lease.bind(self.id, self._views, self._view_list, self._words, self._epoch)

    # ---- called by the session (connection gone, back) and the client's flush ----
    def rebind(self, desc: dict) -> None:
        """After a reconnect: the daemon's table of this name, every lease void."""
        self.spec = _spec_of(desc, self.spec)
        self._bind(desc)  # TableMap.attach takes rows_fd: closed on every path

    def retire(self) -> None:
        """After a reconnect no table has this name: id 0, so every later call raises UnknownTable."""
        self.id = 0
        for lease in list(self._leases):
            self._bind_lease(lease)

    def forget_connection(self) -> bool:
        """The connection of this handle's leases and holds is gone (reconnect,
        fork); True if a writer had items open in a lease (possibly lost)."""
        self._held = []
        return any([lease.void() for lease in list(self._leases)])

    def hand_back(self) -> None:
        """The client's flush: hand back unused leased slots and ``sample_indices``' holds."""
        self._lease.release()
        self.release()

    def renew_leases(self) -> None:
        """The daemon voided a reservation of this client (``ReservationExpired``):
        every lease of this table hands back what it can and starts anew, so
        no item goes into a void one; a writer's open items are gone."""
        for lease in list(self._leases):
            lease.release()
            if lease is not self._lease:
                lease.void()

    def __reduce__(self):
        return (_reopen, (self._client, self.name))

    client = property(lambda self: self._client, doc="The ``Client`` this handle belongs to.")
    # the segments as mapped now (anew at a reconnect): marks (``state``, ``gens``, ``seqno``; read only)
    # and rows, for a reader that copies rows and checks the stamps itself (``ParameterBoard``)
    mapped = property(lambda self: self._map)

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
        arrays, _ = check_rows(self.spec, self._names, fields, batch=False)
        prios = None if priority is None else self._priorities([priority], 1, "insert")
        self._begin()
        self._lease.write(arrays, 1, prios, True, deadline_of(timeout))

    @retried
    def insert_batch(self, data: dict, priorities=None, timeout: float | None = None) -> None:
        """Insert n items; every field's leading dimension is n.  On a
        rate-limited table the items go in as the limiter admits them; if
        ``timeout`` runs out part-way, the items before the error are in."""
        arrays, n = check_rows(self.spec, self._names, data, batch=True)
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

    def widen_lease(self, slots: int) -> int:
        """Reserve up to ``slots`` at a time from the next reservation on
        (``widened_lease_size`` says how far); returns the lease size now."""
        return self._lease.resize(widened_lease_size(self.spec, self.lease_size, slots, self._session.max_batch))

    def lease(self) -> SlotLease:
        """A slot lease for a writer whose items stay open across calls (``writers.py``)."""
        lease = SlotLease(self.lease_size, self.name, self._session, self._priorities)
        self._bind_lease(lease)
        self._leases.add(lease)
        return lease

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

    def _check_draw(self, batch_size, beta) -> tuple[int, float]:
        n, beta = R.check_draw(batch_size, beta, "batch_size {n}", self._session.max_batch)
        self._begin()
        return n, beta

    @retried
    def sample_indices(self, batch_size: int, beta: float = 0.4, timeout: float | None = None):
        """Draw without gathering: (keys, probabilities, weights).  For a
        learner that reads rows itself (``indices = keys & 0xFFFFFFFF``); it
        must then check the generation stamps as ``sample`` does.  On a
        table with ``max_times_sampled``, slots of items drawn for the last
        time stay held for this learner until its next ``sample_indices``
        call on the table or ``release()``, and at most the daemon's
        ``hold_timeout_s``, so read them before that."""
        n, beta = self._check_draw(batch_size, beta)
        self.release()
        b = new_batch((), n)
        pipe = self._session.pipe
        hid = in_slices(deadline_of(timeout), lambda w: receive_draw(
            pipe, send_draw(pipe, self.id, n, beta, w), n, slice(None), b, w))
        if hid:
            self._held.append(hid)
        return b.keys, b.probabilities, b.weights

    def release(self) -> None:
        """Hand back the slots ``sample_indices`` held for reading (see there)."""
        self._session.check_fork()  # a forked child holds none of its parent's holds
        held, self._held = self._held, []
        pipe = self._session.pipe
        for hid in held:
            pipe.send(R.put_release, self.id, hid)

    @retried
    def sample(self, batch_size: int, beta: float = 0.4, out: SampleBatch | None = None,
               timeout: float | None = None) -> SampleBatch:
        """Draw ``batch_size`` items.  With ``out=`` (an earlier batch of the
        same size) the rows are gathered into its arrays instead of new ones.
        Waits up to ``timeout`` s (None: no limit) for the table's limits."""
        n, beta = self._check_draw(batch_size, beta)
        return in_slices(deadline_of(timeout), lambda w: self.finish_sample(None, n, beta, out, w))

    # ---- pipelined draws (BatchIterator, Client.sample_many) ----
    def begin_sample(self, n: int, beta: float, wait_s: float) -> int:
        """Send a SAMPLE now and collect it later with ``finish_sample``;
        returns its ticket.  The daemon may hold it ``wait_s`` for the limits."""
        n, beta = self._check_draw(n, beta)
        pipe = self._session.pipe
        seq = send_draw(pipe, self.id, n, beta, wait_s)
        pipe.expect(seq)
        return seq

    def finish_sample(self, ticket: int | None, n: int, beta: float, out: SampleBatch | None,
                      wait_s: float) -> SampleBatch:
        """Gather the batch a ``begin_sample`` ticket drew (None: draw now):
        rows whose slot was overwritten during the gather are drawn again."""
        return draw_batch(self._session.pipe, self.id, self._views, self._fields, self._gens,
                          ticket, n, beta, out, wait_s)

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


# Below this capacity a writer reserves per call: a lease reserved ahead
# evicts items early (the oldest, which the next inserts evict anyway), and
# in a table of a few hundred items that is a visible share of it.
LEASE_MIN_CAPACITY = 256
LEASE_MIN, LEASE_MAX, QUEUE_LEASE_MAX = 16, 4096, 16


def lease_size(spec, max_batch: int) -> int:
    """Slots a writer reserves at a time (0: per call), and asks for again
    at half time, so inserts need no round trip: capacity/256, at least 16
    (a 1,000-item table: 16, where one round trip per call capped inserts
    at a quarter of cpprb's rate), at most 4,096.  Two leases per writer
    withhold at most ~1% of a large table from sampling, ~3% of a
    1,000-item one.  A rate-limited table (a queue) leases at most 16 and a
    64th of its capacity: its limiter counts a reserved slot as an insert,
    so a lease takes that much of the limiter's room before the items are
    written (it is handed back at ``flush()`` and when the writer closes)."""
    cap = spec.capacity
    if cap < LEASE_MIN_CAPACITY:
        return 0
    size = max(LEASE_MIN, cap // 256)
    if spec.rate_limited:
        size = min(size, QUEUE_LEASE_MAX, cap // 64)
    return max(0, min(LEASE_MAX, size, max_batch))


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
