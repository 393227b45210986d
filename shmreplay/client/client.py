"""The ``Client``: one process's lease with the daemon, and its life cycle.

A ``Client`` holds a control link (``link.py``: the socket, which is the
lease) and a command pipe (``pipe.py``: the channel the data plane uses),
and caches one ``Table`` handle per table.  It is not thread-safe: use it
from one thread at a time (give each thread its own ``connect()`` or
``clone()``).  After ``fork`` the child's first call opens a fresh link and
pipe; a ``Client`` or ``Table`` can be pickled into a ``spawn``ed process,
where it reconnects by socket path.

Durability.  An item is in the table, and survives a daemon crash, once a
``flush()`` that follows its insert has returned.  When the daemon dies,
calls raise ``DaemonUnavailable`` within ~50 ms (waits poll the socket), and
a writer never copies into slots leased from a dead daemon (``lease.py``).
With ``connect(..., reconnect=True)`` a call that finds the daemon gone
waits up to ``reconnect_timeout`` s for it to come back, reopens every
table, voids every lease, and runs again once (``retry.py``); the first
``flush()`` after that raises ``DaemonUnavailable`` if inserts or a
writer's open items from before the restart may be lost, however the
restart was noticed.  ``close()`` raises it too, once everything is closed,
so a client that ends without a last ``flush()`` is told as well (but a
``with`` block that ends by an exception lets that exception go on).

Waiting.  ``insert``/``insert_batch``/``sample`` wait while the table's
limits hold them (rate limiter, min_size_to_sample, reuse limits), as
Reverb's do: ``timeout=None`` (the default) waits as long as it takes,
``timeout=0`` fails at once, a number bounds the wait; running out raises
``RateLimited`` (``EmptyTable`` if nothing is sampleable).  The wait
happens in the daemon, so it costs no CPU here (``pipe.in_slices``).
"""

from __future__ import annotations

import os

from ..errors import DaemonUnavailable, ReplayError
from ..schema import make_spec
from ..wire import records as R
from ..wire.names import client_socket_path
from .link import ControlLink
from .pipe import CommandPipe, deadline_of, in_slices
from .retry import report_loss, retried, with_retries
from .table import ReconnectingTable, Table

DEFAULT_TIMEOUT = 30.0


def connect(path: str | None = None, timeout: float = DEFAULT_TIMEOUT, reconnect: bool = False,
            reconnect_timeout: float = 60.0) -> "Client":
    """Connect to a daemon: ``path``, else $SHMREPLAY_SOCKET, else the default
    path.  ``reconnect``: ride out a daemon restart (see Durability above)."""
    return Client(client_socket_path(path), timeout, reconnect, reconnect_timeout)


class Client:
    """A lease with the daemon; made by ``connect``.  See *Durability*
    above for what ``flush()`` and ``close()`` vouch for, and when they
    raise DaemonUnavailable instead."""

    def __new__(cls, path: str, timeout: float = DEFAULT_TIMEOUT, reconnect: bool = False,
                reconnect_timeout: float = 60.0):
        if reconnect and cls is Client:
            cls = ReconnectingClient
        return super().__new__(cls)

    def __init__(self, path: str, timeout: float = DEFAULT_TIMEOUT, reconnect: bool = False,
                 reconnect_timeout: float = 60.0):
        self.path = path
        self.timeout = float(timeout)
        self.reconnect = bool(reconnect)
        self.reconnect_timeout = float(reconnect_timeout)
        self.reconnects = 0
        self._lost = False  # inserts were unflushed when a daemon died (flush says so)
        self._tables: dict[str, Table] = {}
        self._link = self._pipe = None
        self._pid, self._lease_key = 0, 0  # this process's lease at its daemon (records.owner_key)
        self._open()

    # ---- pickling / fork ----
    def __reduce__(self):
        return (Client, (self.path, self.timeout, self.reconnect, self.reconnect_timeout))

    def clone(self, reconnect: bool = False) -> "Client":
        """A new connection to the same daemon with the same timeout, e.g. for
        another thread (a ``Client`` is for one thread at a time)."""
        return Client(self.path, self.timeout, reconnect, self.reconnect_timeout)

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            # the parent's link and pipe belong to the parent's lease
            self._link = self._pipe = None
            self._open()

    # ---- the lease ----
    def _open(self) -> None:
        # the lease this process held at its last daemon: the leases were
        # voided just below, so if that daemon died, the next may reuse the
        # slots it gave us (server/tables/orphans.py)
        resume = self._lease_key if self._pid == os.getpid() else 0
        self._pid = os.getpid()
        self._closed = False
        self._dirty = False  # commits sent since the last flush
        for t in self._tables.values():  # leases belonged to the old connection
            t._forget_connection()
        link = ControlLink(self.path, self.timeout)
        try:
            hello, fds = link.hello(os.getpid(), resume)
            self.daemon_pid = hello["daemon_pid"]
            self._lease_key = R.owner_key(self.daemon_pid, hello["client_id"])
            self.max_batch = int(hello["max_batch"])
            pipe = CommandPipe(link, fds)
            try:
                link.ready()
            except BaseException:
                pipe.close()
                raise
        except BaseException:
            link.close()
            raise
        self._link, self._pipe = link, pipe

    def _abandon(self) -> None:
        """Drop the link and pipe of a lease that is over (no flush)."""
        if self._link is not None:
            self._link.close()
            self._pipe.close()
            self._link = self._pipe = None

    def close(self) -> None:
        """Wait until my inserts are applied (bounded), then end the lease;
        then, like ``flush()``, raise DaemonUnavailable if inserts made before
        a daemon restart may be lost (no other error of that flush is raised)."""
        if self._closed or self._link is None or self._pid != os.getpid():
            self._closed = True
            return
        failed = None
        try:
            self._flush()
        except ReplayError as exc:
            failed = exc
        finally:
            self._closed = True
            self._abandon()
        report_loss(self, failed)  # a quiet close would vouch for them

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, exc_type, *_) -> None:
        try:
            self.close()
        except DaemonUnavailable:
            if exc_type is None:  # else the block's own error goes on: it vouched for nothing
                raise

    def _begin(self) -> None:
        """Prologue of data calls: fork check, replies that arrived, deferred errors."""
        if self._closed:
            raise ReplayError("client is closed")
        self._check_fork()
        pipe = self._pipe
        if pipe is None:
            raise DaemonUnavailable(f"no connection to the daemon at {self.path} (a reconnect failed)")
        if pipe.resp.has_pending():  # cheaper than drain() when, as usually, nothing came
            pipe.drain()
        if pipe.deferred is not None:
            pipe.raise_deferred()

    def _request(self, op: str, **args) -> dict:
        self._check_fork()
        if self._link is None:
            raise DaemonUnavailable(f"no connection to the daemon at {self.path} (a reconnect failed)")
        return self._link.request(op, **args)

    # ---- tables ----
    @retried
    def create_table(self, name, capacity, fields, sampler="prioritized", alpha=0.6,
                     exist_ok=False, **limits) -> Table:
        """Create a table.  ``limits``: remover, max_times_sampled,
        min_size_to_sample, samples_per_insert, error_buffer (schema.make_spec
        says what each means and which combinations are refused), and
        storage_dir (rows in a file there: a directory the daemon's config
        allows; "" for /dev/shm; unset: the daemon's default).
        ``exist_ok`` returns an existing table with the same definition."""
        spec = make_spec(name, capacity, fields, sampler, alpha, **limits)
        desc = self._request("create_table", spec=spec.to_wire(), exist_ok=bool(exist_ok))["table"]
        return self._adopt(desc)

    def create_queue(self, name, capacity, fields, exist_ok=False, storage_dir=None) -> Table:
        """A queue (Reverb's ``Table.queue``): fifo sampler and remover, each
        item delivered once, inserts wait while ``capacity`` items are
        unsampled, samples wait for items.  Needs capacity >= 2.
        ``storage_dir``: as for ``create_table``."""
        return self.create_table(name, capacity, fields, sampler="fifo", remover="fifo",
                                 max_times_sampled=1, samples_per_insert=1.0,
                                 error_buffer=(0.0, float(capacity)), exist_ok=exist_ok,
                                 storage_dir=storage_dir)

    @retried
    def table(self, name: str) -> Table:
        """Attach to an existing table (UnknownTable if there is none)."""
        self._check_fork()
        t = self._tables.get(name)
        if t is not None:
            return t
        return self._adopt(self._request("open_table", name=name)["table"])

    def _adopt(self, desc: dict) -> Table:
        t = self._tables.get(desc["spec"]["name"])
        if t is not None and t.id == desc["id"]:
            return t
        t = (ReconnectingTable if self.reconnect else Table)(self, desc)
        self._tables[t.name] = t
        return t

    def drop_table(self, name: str) -> None:
        self._request("drop_table", name=name)
        self._tables.pop(name, None)

    @retried
    def list_tables(self) -> list[str]:
        return [d["spec"]["name"] for d in self._request("list_tables")["tables"]]

    @retried
    def sample_many(self, requests: dict, beta: float = 0.4, timeout: float | None = None) -> dict:
        """Sample several tables at once: ``{table or name: batch_size}`` ->
        ``{name: SampleBatch}``.  Every SAMPLE is sent before the first reply
        is awaited, so the tables draw while this process gathers."""
        self._check_fork()
        tables = [(t if isinstance(t, Table) else self.table(t), n) for t, n in requests.items()]
        for t, _ in tables:
            if t.client is not self:
                raise ReplayError(f"table {t.name!r} belongs to another client")

        def attempt(w):
            tickets = [t.begin_sample(n, beta, w) for t, n in tables]
            out = {}
            for i, ((t, n), ticket) in enumerate(zip(tables, tickets)):
                try:
                    out[t.name] = t.finish_sample(ticket, n, beta, None, w)
                except BaseException:
                    for (t2, _), ticket2 in zip(tables[i + 1:], tickets[i + 1:]):
                        self._drop_reply(t2, ticket2, w)  # drain the rest, hand back holds
                    raise
            return out

        return in_slices(deadline_of(timeout), attempt)

    def _drop_reply(self, t: Table, seq: int, wait: float) -> None:
        try:
            hid = self._pipe.wait(seq, lambda rec, pay: R.read_hold(rec), wait)
        except ReplayError:
            return
        if hid:
            self._pipe.send(R.put_release, t.id, hid)

    # ---- admin and stats ----
    def checkpoint(self, to: str, tables=None) -> list[dict]:
        """Admin: checkpoint ``tables`` (names; None: all) into the directory
        ``to`` (absolute, written by the daemon's user).  Returns one report
        per table: path, items, bytes, pause_s (the only time inserts and
        samples waited), write_s."""
        names = [tables] if isinstance(tables, str) else list(tables or [])
        return self._request("checkpoint", tables=names, to=str(to))["checkpoints"]

    def sync(self, tables=None) -> list[dict]:
        """Admin: write the metadata of durable file-backed tables (names;
        None: all of them) to disk now, so a reboot finds every item
        committed before this call.  One report per table: path, items,
        bytes, seconds, freed (retired slots the sync gave back)."""
        names = [tables] if isinstance(tables, str) else list(tables or [])
        return self._request("sync", tables=names)["syncs"]

    def shutdown(self) -> None:
        """Admin: ask the daemon to shut down cleanly."""
        self._request("shutdown")

    @retried
    def stats(self) -> dict:
        """Daemon-wide and per-table counters (one control round trip)."""
        msg = self._request("stats")
        msg.pop("id", None)
        msg.pop("ok", None)
        return msg

    # ---- durability ----
    def flush(self) -> None:
        """Return once every command sent so far has been applied.  Unused
        slot leases of inserts are handed back, so the table's full capacity
        counts.  After a daemon restart, raises DaemonUnavailable once if
        inserts made before it may be lost."""
        self._flush()
        report_loss(self)  # outside the retried call: a second reconnect cannot hide it

    @retried
    def _flush(self) -> None:
        self._begin()
        for t in self._tables.values():
            t._lease.release()
            t.release()
        self._pipe.wait(self._pipe.send(R.put_flush), lambda rec, pay: None)
        self._dirty = False
        self._pipe.raise_deferred()


ReconnectingClient = with_retries(Client)
