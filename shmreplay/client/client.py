"""The ``Client``: one process's lease with the daemon, and its life cycle.

A ``Client`` holds a session (``session.py``: the control link, which is
the lease, and the command pipe the data plane uses, across forks and
daemon restarts), and caches one ``Table`` handle per table.  It keeps the
public API and delegates the connection's life to the session.  It is not
thread-safe: use it
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
table, voids every lease, and runs again once (``retry.py``,
``session.py``); the first
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
import warnings

from ..errors import DaemonUnavailable, ReplayError
from ..schema import make_spec
from ..wire.names import client_socket_path
from .draws import drop_draw
from .pipe import deadline_of, in_slices
from .retry import retried, with_retries
from .session import Session
from .frametable import FrameTable, ReconnectingFrameTable
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
        self._tables: dict[str, Table] = {}
        self._session = Session(path, self.timeout, self.reconnect, self.reconnect_timeout,
                                self._tables)

    # ---- pickling / fork ----
    def __reduce__(self):
        return (Client, (self.path, self.timeout, self.reconnect, self.reconnect_timeout))

    def clone(self, reconnect: bool = False) -> "Client":
        """A new connection to the same daemon with the same timeout, e.g. for
        another thread (a ``Client`` is for one thread at a time)."""
        return Client(self.path, self.timeout, reconnect, self.reconnect_timeout)

    # ---- the connection (the session's) ----
    @property
    def reconnects(self) -> int:
        """How many times this client reconnected after its daemon went away."""
        return self._session.reconnects

    @property
    def daemon_pid(self) -> int:
        return self._session.daemon_pid

    @property
    def max_batch(self) -> int:
        """The most items one command may carry (the daemon's hello says)."""
        return self._session.max_batch

    def close(self) -> None:
        """Wait until my inserts are applied (bounded), then end the lease;
        then, like ``flush()``, raise DaemonUnavailable if inserts made before
        a daemon restart may be lost (no other error of that flush is raised)."""
        self._session.close(self._flush)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, exc_type, *_) -> None:
        try:
            self.close()
        except DaemonUnavailable:
            if exc_type is None:  # else the block's own error goes on: it vouched for nothing
                raise

    # ---- tables ----
    @retried
    def create_table(self, name, capacity, fields, sampler="prioritized", alpha=0.6,
                     exist_ok=False, **limits) -> Table:
        """Create a table.  ``fields`` is one of::

            {"obs": ("uint8", (4, 84, 84)), "reward": ("float32", ())}  # (dtype, shape); a list too
            {"obs": {"dtype": "uint8", "shape": [4, 84, 84]}, "reward": {"dtype": "float32"}}
            [["obs", "uint8", [4, 84, 84]], ["reward", "float32", []]]

        names: Python identifiers (<= 64 chars); dtypes: plain numbers or
        bool as numpy names them ("float32", np.float32, np.dtype("<f4"),
        bool); shapes: tuples or lists of positive ints, () for a scalar
        (an int n means (n,)).  Anything else is a SchemaError naming the
        field and what to write (fields.py).  ``insert`` then takes numpy
        arrays or anything np.asarray converts, cast per numpy's same_kind
        rule; tensors must be detached and on the CPU.
        ``limits``: remover, max_times_sampled,
        min_size_to_sample, samples_per_insert, error_buffer (schema.make_spec
        says what each means and which combinations are refused), and
        storage_dir (rows in a file there: a directory the daemon's config
        allows; "" for /dev/shm; unset: the daemon's default), and writers
        ("creator": only this user and the daemon's admins may write it).
        ``exist_ok`` returns an existing table with the same definition."""
        spec = make_spec(name, capacity, fields, sampler, alpha, **limits)
        desc = self._session.request("create_table", spec=spec.to_request(), exist_ok=bool(exist_ok))["table"]
        for said in desc.get("warnings", ()):  # settings that may never work (leasing.py); the daemon logs them
            warnings.warn(str(said), UserWarning, stacklevel=2)
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
        self._session.check_fork()
        t = self._tables.get(name)
        if t is not None:
            return t
        return self._adopt(self._session.request("open_table", name=name)["table"])

    def _adopt(self, desc: dict) -> Table:
        t = self._tables.get(desc["spec"]["name"])
        if t is not None and t.id == desc["id"]:
            if desc.get("rows_fd") is not None:  # mapped already
                os.close(desc["rows_fd"])
            return t
        if desc["spec"].get("frames"):  # a frame table's handle stores frames once (frametable.py)
            t = (ReconnectingFrameTable if self.reconnect else FrameTable)(self, self._session, desc)
        else:
            t = (ReconnectingTable if self.reconnect else Table)(self, self._session, desc)
        self._tables[t.name] = t
        return t

    def drop_table(self, name: str) -> None:
        self._session.request("drop_table", name=name)
        self._tables.pop(name, None)

    @retried
    def list_tables(self) -> list[str]:
        return [d["spec"]["name"] for d in self._session.request("list_tables")["tables"]]

    @retried
    def sample_many(self, requests: dict, beta: float = 0.4, timeout: float | None = None) -> dict:
        """Sample several tables at once: ``{table or name: batch_size}`` ->
        ``{name: SampleBatch}``.  Every SAMPLE is sent before the first reply
        is awaited, so the tables draw while this process gathers."""
        self._session.check_fork()
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
                    pipe = self._session.pipe
                    for (t2, _), ticket2 in zip(tables[i + 1:], tickets[i + 1:]):
                        drop_draw(pipe, t2.id, ticket2, w)  # drain the rest, hand back holds
                    raise
            return out

        return in_slices(deadline_of(timeout), attempt)

    # ---- admin and stats ----
    def checkpoint(self, to: str, tables=None) -> list[dict]:
        """Admin: checkpoint ``tables`` (names; None: all) into the directory
        ``to`` (absolute, written by the daemon's user).  Returns one report
        per table: path, items, bytes, pause_s (the only time inserts and
        samples waited), write_s."""
        names = [tables] if isinstance(tables, str) else list(tables or [])
        return self._session.request("checkpoint", tables=names, to=str(to))["checkpoints"]

    def sync(self, tables=None) -> list[dict]:
        """Admin: write the metadata of durable file-backed tables (names;
        None: all of them) to disk now, so a reboot finds every item
        committed before this call.  One report per table: path, items,
        bytes, seconds, freed (retired slots the sync gave back)."""
        names = [tables] if isinstance(tables, str) else list(tables or [])
        return self._session.request("sync", tables=names)["syncs"]

    def shutdown(self) -> None:
        """Admin: ask the daemon to shut down cleanly."""
        self._session.request("shutdown")

    @retried
    def stats(self) -> dict:
        """Daemon-wide and per-table counters (one control round trip)."""
        msg = self._session.request("stats")
        msg.pop("id", None)
        msg.pop("ok", None)
        return msg

    @property
    def lazy_commits(self) -> bool:
        """True (the default): an insert's COMMIT leaves a sleeping daemon
        asleep, and the item becomes sampleable at the daemon's next wake:
        this client's next request that waits for an answer (a ``flush()``,
        a reservation, a sample), another client's, or the daemon's
        ``idle_timeout_s`` (1 s by default) at the latest; at once while a
        request is parked on the table's limits (the daemon's sleeping word
        says so and the commit wakes it); and at the 17th commit left to a
        sleeping daemon in a row (``pipe.LAZY_MAX``), so that a writer flat
        out keeps it in step.  A wake-up costs the daemon more
        CPU than a small commit (measured: ~330-430 us against ~110 us per
        64-row chunk; 35-150 us per single-row insert), so a program that
        inserts every env step and samples every few pays one wake-up per
        sample, not one per insert.  A daemon that is up lets them wait the
        same way, up to 16 in a row (docs/protocol.md, "Waking").  False:
        every COMMIT wakes a sleeping daemon, and one that is up serves it
        at once (the channel's eager word), so the item is sampleable
        within microseconds with nothing else asked.  Kept across reconnects and forks; not carried by
        pickling."""
        return self._session.lazy_commits

    @lazy_commits.setter
    def lazy_commits(self, on: bool) -> None:
        self._session.set_lazy_commits(on)

    # ---- durability ----
    def flush(self, keep_leases: bool = False) -> None:
        """Return once every command sent so far has been applied.  Unused
        slot leases of inserts are handed back, so the table's full capacity
        counts, unless ``keep_leases``: then the next insert finds its slots
        reserved and needs no round trip (for a writer that confirms every
        few inserts and goes on at once, as the Ray ingest does; a flush
        without it hands them back, and a writer about to idle should).
        After a daemon restart, raises DaemonUnavailable once if inserts
        made before it may be lost."""
        self._flush(keep_leases)
        self._session.report_loss()  # outside the retried call: a second reconnect cannot hide it

    @retried
    def _flush(self, keep_leases: bool = False) -> None:
        self._session.begin()
        if not keep_leases:
            for t in self._tables.values():
                t.hand_back()
        self._session.flush()


ReconnectingClient = with_retries(Client)
