"""The client library: what actor and learner processes import.

A ``Client`` holds one control connection (its lease) and one command
channel.  It is not thread-safe: use it from one thread at a time (give each
thread its own ``connect()``).  After ``fork`` the child's first call opens
a fresh connection and channel; a ``Client`` or ``Table`` can be pickled
into a ``spawn``ed process, where it reconnects by socket path.

Data path (no payload byte passes through the daemon):

* insert: copy each field straight into rows of a slot lease (reserved
  ahead, the next lease requested at half time, so no round trip), then
  COMMIT that part with priorities (streamed, no reply);
* sample: SAMPLE (one round trip) returns keys, probabilities and weights;
  the client gathers rows itself with ``np.take`` and then re-reads each
  slot's generation stamp; rows whose stamp changed were overwritten while
  being read and are drawn again, so a batch never holds a torn row.

Errors of streamed commands (COMMIT, UPDATE) come back asynchronously and
are raised by the next call on the client, or by ``flush()``.

Durability.  An item is in the table, and survives a daemon crash, once a
``flush()`` that follows its insert has returned.  When the daemon dies,
calls raise ``DaemonUnavailable`` within ~50 ms (waits poll the socket), and
a writer never copies into slots leased from a dead daemon: it compares the
table's epoch, which a restarted daemon bumps, before each copy.  With
``connect(..., reconnect=True)`` a call that finds the daemon gone waits up
to ``reconnect_timeout`` s for it to come back, reopens every table, and
runs again once; inserts not yet flushed when the daemon died may be lost
(or, for the interrupted call itself, stored twice if the daemon applied
them just before it died).

Waiting.  ``insert``/``insert_batch``/``sample`` wait while the table's
limits hold them (rate limiter, min_size_to_sample, reuse limits), as
Reverb's do: ``timeout=None`` (the default) waits as long as it takes,
``timeout=0`` fails at once, a number bounds the wait; running out raises
``RateLimited`` (``EmptyTable`` if nothing is sampleable).  The wait happens
in the daemon, so it costs no CPU here.  It is asked for in slices of at
most WAIT_SLICE_S, each answered by the daemon, so a daemon that dies
raises ``DaemonUnavailable`` within ~50 ms and one that hangs raises
``ReplayTimeout`` within a slice plus the client's timeout.  Rate-limited tables get no slot
leases: every insert call reserves exactly its rows, so the limiter counts
it at once.
"""

from __future__ import annotations

import functools
import os
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import posix_ipc

from . import atomics
from . import commands as C
from .channel import CTL_RESP_HEAD, Channel
from .config import client_socket_path
from .errors import (DaemonUnavailable, FieldError, PriorityError, ProtocolError,
                     RateLimited, ReplayError, ReplayTimeout, UnknownTable, error_from_code,
                     error_from_name)
from . import ratelimiter
from .layout import (LIVE_EPOCH, LIVE_INSERTS, LIVE_PENDING, LIVE_SAMPLES, LIVE_SIZE, LIVE_USES,
                     TableMap)
from .priorities import as_priorities
from .protocol import PROTOCOL_VERSION, FrameDecoder, encode
from .schema import make_spec, spec_from_wire

WAIT_SLICE_S = 1.0

DEFAULT_TIMEOUT = 30.0
# Spin budget before sleeping on the semaphore, set from how long the last
# reply took: twice that if it fits under SPIN_MAX_S, else the minimum.  On
# an idle box replies come in tens to a few hundred microseconds (a learner's
# UPDATE then SAMPLE: ~160 us) and spinning saves a ~35 us wake-up on each
# side; on a saturated one the daemon waits for a CPU and spinning would only
# take that CPU from it.  Budgets are counted in atomic loads, calibrated
# once per process (2.5e9/s on this VM; a fixed guess of 1e9/s made the cap
# 80 us instead of 200, so every learner round trip slept).
SPIN_MIN_S, SPIN_MAX_S = 1e-6, 400e-6
_U32 = np.uint64(C.SLOT_BITS)
_MASK = np.uint64(C.SLOT_MASK)


def connect(path: str | None = None, timeout: float = DEFAULT_TIMEOUT, reconnect: bool = False,
            reconnect_timeout: float = 60.0) -> "Client":
    """Connect to a daemon: ``path``, else $SHMREPLAY_SOCKET, else the default
    path.  ``reconnect``: ride out a daemon restart (see Durability above)."""
    return Client(client_socket_path(path), timeout, reconnect, reconnect_timeout)


def _reconnecting(method):
    """Run a public call again, once, after reconnecting if the daemon went
    away during it and the client asked for reconnects.  (A flush after a
    reconnect raises if inserts were made before it: ``Client.flush``.)"""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        cl = self if isinstance(self, Client) else self._client
        try:
            return method(self, *args, **kwargs)
        except DaemonUnavailable:
            if not cl.reconnect or cl._closed:
                raise
            cl._reconnect()
            return method(self, *args, **kwargs)
    return call


@dataclass
class SampleBatch:
    """One sampled batch.  ``data[f]`` has shape (n, *field.shape)."""

    data: dict
    keys: np.ndarray           # uint64: generation << 32 | slot
    probabilities: np.ndarray  # float64: P(i) when drawn
    weights: np.ndarray        # float64: importance weights, max 1 over the table
    redraws: int = 0           # rows drawn again because their slot was overwritten

    @property
    def indices(self) -> np.ndarray:
        return (self.keys & _MASK).astype(np.int64)

    def __len__(self) -> int:
        return self.keys.shape[0]


class Client:
    def __init__(self, path: str, timeout: float = DEFAULT_TIMEOUT, reconnect: bool = False,
                 reconnect_timeout: float = 60.0):
        self.path = path
        self.timeout = float(timeout)
        self.reconnect = bool(reconnect)
        self.reconnect_timeout = float(reconnect_timeout)
        self.reconnects = 0
        self._lost = False  # inserts were unflushed when a daemon died (flush says so)
        self._tables: dict[str, Table] = {}
        self._sock = None
        self._open()

    # ---- pickling / fork ----
    def __reduce__(self):
        return (Client, (self.path, self.timeout, self.reconnect, self.reconnect_timeout))

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            # the parent's socket and channel belong to the parent's lease
            self._sock = None
            self._chan = None
            self._open()

    # ---- connection ----
    def _open(self) -> None:
        self._pid = os.getpid()
        self._closed = False
        self._deferred: ReplayError | None = None
        self._bye: ReplayError | None = None
        self._seq = 0
        self._next_id = 1
        self._decoder = FrameDecoder()
        self._loads_per_s = atomics.loads_per_second()
        self._spin = int(16 * SPIN_MIN_S * self._loads_per_s)
        self._dirty = False               # inserts sent since the last flush
        self._pending: set[int] = set()   # replies to keep if they arrive while waiting for another
        self._stash: dict[int, tuple] = {}
        for t in self._tables.values():  # leases belonged to the old connection
            t._lease = t._next_seq = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonUnavailable(
                f"no shmreplay daemon at {self.path} ({exc.strerror}); start shmreplayd or "
                "set $SHMREPLAY_SOCKET") from None
        except socket.timeout:
            sock.close()
            raise ReplayTimeout(f"connecting to {self.path} timed out after {self.timeout} s") from None
        self._sock = sock
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        try:
            w = self._request("hello", protocol=PROTOCOL_VERSION, pid=os.getpid())
            self.daemon_pid = w["daemon_pid"]
            self.max_batch = int(w["max_batch"])
            self._chan = Channel.attach(w["channel"])
            self._sem = posix_ipc.Semaphore(w["channel_sem"])
            self._doorbell = posix_ipc.Semaphore(w["doorbell"])
            self._request("ready")
        except BaseException:
            sock.close()
            self._sock = None
            raise
        self._req = self._chan.requests
        self._resp = self._chan.responses

    def _abandon(self) -> None:
        """Drop the connection and channel of a lease that is over (no flush)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            for sem in (self._sem, self._doorbell):
                sem.close()
            self._req = self._resp = None
            self._chan.release()

    def _reconnect(self) -> None:
        """Open a new lease, waiting up to reconnect_timeout for a daemon,
        and rebind every table handle to what the daemon serves now."""
        self._abandon()
        self._lost = self._lost or self._dirty
        deadline = time.monotonic() + self.reconnect_timeout
        while True:
            try:
                self._open()
                break
            except (DaemonUnavailable, ReplayTimeout) as exc:
                if time.monotonic() > deadline:
                    raise DaemonUnavailable(f"no daemon came back at {self.path} within "
                                            f"{self.reconnect_timeout} s: {exc}") from None
                time.sleep(0.1)
        self.reconnects += 1
        for name, t in list(self._tables.items()):
            try:
                t._rebind(self._request("open_table", name=name)["table"])
            except UnknownTable:
                del self._tables[name]  # its next call says so

    def close(self) -> None:
        """Wait until my inserts are applied (bounded), then end the lease."""
        if self._closed or self._sock is None or self._pid != os.getpid():
            self._closed = True
            return
        try:
            self.flush()
        except ReplayError:
            pass
        finally:
            self._closed = True
            self._sock.close()
            for sem in (self._sem, self._doorbell):
                sem.close()
            self._req = self._resp = None
            self._chan.release()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- control plane ----
    def _request(self, op: str, **args) -> dict:
        if self._bye is not None:
            raise self._bye
        rid = self._next_id
        self._next_id += 1
        try:
            self._sock.sendall(encode({"op": op, "id": rid, **args}))
            while True:
                data = self._sock.recv(1 << 16)
                if not data:
                    raise DaemonUnavailable(f"daemon at {self.path} closed the connection")
                for msg in self._decoder.feed(data):
                    self._check_bye(msg)
                    if msg.get("id") == rid:
                        if msg.get("ok"):
                            return msg
                        raise error_from_name(msg.get("error"), str(msg.get("message")))
        except socket.timeout:
            raise ReplayTimeout(f"daemon did not answer {op!r} within {self.timeout} s") from None
        except (BrokenPipeError, ConnectionResetError) as exc:
            self._read_bye()  # a refused connection is closed with a reason; raise that
            raise DaemonUnavailable(f"daemon at {self.path} went away: {exc}") from None

    def _read_bye(self) -> None:
        """Raise the bye notice still buffered on a closed socket, if any."""
        try:
            data = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
            for msg in FrameDecoder().feed(data):
                self._check_bye(msg)
        except (OSError, ProtocolError):
            pass

    def _live(self) -> None:
        """Raise DaemonUnavailable (or the daemon's bye reason) if the lease ended."""
        if self._bye is not None:
            raise self._bye
        if not self._poll.poll(0):
            return
        try:
            data = self._sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            raise DaemonUnavailable(f"daemon at {self.path} went away: {exc}") from None
        if not data:
            self._bye = DaemonUnavailable(f"daemon at {self.path} closed the connection")
            raise self._bye
        for msg in self._decoder.feed(data):
            self._check_bye(msg)

    def _check_bye(self, msg: dict) -> None:
        """The daemon's last word before it closes the lease (protocol rule 4)."""
        if msg.get("op") == "bye":
            self._bye = error_from_name(msg.get("error"), str(msg.get("message")))
            raise self._bye

    @_reconnecting
    def create_table(self, name, capacity, fields, sampler="prioritized", alpha=0.6,
                     exist_ok=False, **limits) -> "Table":
        """Create a table.  ``limits``: remover, max_times_sampled,
        min_size_to_sample, samples_per_insert, error_buffer (schema.make_spec
        says what each means and which combinations are refused).
        ``exist_ok`` returns an existing table with the same definition."""
        self._check_fork()
        spec = make_spec(name, capacity, fields, sampler, alpha, **limits)
        desc = self._request("create_table", spec=spec.to_wire(), exist_ok=bool(exist_ok))["table"]
        return self._adopt(desc)

    def create_queue(self, name, capacity, fields, exist_ok=False) -> "Table":
        """A queue (Reverb's ``Table.queue``): fifo sampler and remover, each
        item delivered once, inserts wait while ``capacity`` items are
        unsampled, samples wait for items.  Needs capacity >= 2."""
        return self.create_table(name, capacity, fields, sampler="fifo", remover="fifo",
                                 max_times_sampled=1, samples_per_insert=1.0,
                                 error_buffer=(0.0, float(capacity)), exist_ok=exist_ok)

    @_reconnecting
    def sample_many(self, requests: dict, beta: float = 0.4, timeout: float | None = None) -> dict:
        """Sample several tables at once: ``{table or name: batch_size}`` ->
        ``{name: SampleBatch}``.  Every SAMPLE is sent before the first reply
        is awaited, so the tables draw while this process gathers."""
        self._check_fork()
        tables = [(t if isinstance(t, Table) else self.table(t), n) for t, n in requests.items()]
        for t, _ in tables:
            if t._client is not self:
                raise ReplayError(f"table {t.name!r} belongs to another client")
        checked = [(t, *t._check_draw(n, beta)) for t, n in tables]

        def attempt(w):
            seqs = []
            for t, n, b in checked:
                seqs.append(t._send_draw(n, b, w))
                self._pending.add(seqs[-1])
            out = {}
            for i, ((t, n, b), seq) in enumerate(zip(checked, seqs)):
                try:
                    out[t.name] = t._complete(n, b, None, seq, w)
                except BaseException:
                    for (t2, _, _), seq2 in zip(checked[i + 1:], seqs[i + 1:]):
                        self._drop_reply(t2, seq2, w)  # drain the rest, hand back holds
                    raise
            return out

        return _in_slices(_deadline_of(timeout), attempt)

    def _drop_reply(self, t: "Table", seq: int, wait: float) -> None:
        try:
            hid = self._wait(seq, lambda rec, pay: int(rec["a1"]), wait)
        except ReplayError:
            return
        if hid:
            self._send(C.RELEASE, t.id, a0=hid)

    @_reconnecting
    def table(self, name: str) -> "Table":
        """Attach to an existing table (UnknownTable if there is none)."""
        self._check_fork()
        t = self._tables.get(name)
        if t is not None:
            return t
        return self._adopt(self._request("open_table", name=name)["table"])

    def _adopt(self, desc: dict) -> "Table":
        t = self._tables.get(desc["spec"]["name"])
        if t is not None and t.id == desc["id"]:
            return t
        t = Table(self, desc)
        self._tables[t.name] = t
        return t

    def drop_table(self, name: str) -> None:
        self._check_fork()
        self._request("drop_table", name=name)
        self._tables.pop(name, None)

    @_reconnecting
    def list_tables(self) -> list[str]:
        self._check_fork()
        return [d["spec"]["name"] for d in self._request("list_tables")["tables"]]

    def checkpoint(self, to: str, tables=None) -> list[dict]:
        """Admin: checkpoint ``tables`` (names; None: all) into the directory
        ``to`` (absolute, written by the daemon's user).  Returns one report
        per table: path, items, bytes, pause_s (the only time inserts and
        samples waited), write_s."""
        self._check_fork()
        names = [tables] if isinstance(tables, str) else list(tables or [])
        return self._request("checkpoint", tables=names, to=str(to))["checkpoints"]

    def shutdown(self) -> None:
        """Admin: ask the daemon to shut down cleanly."""
        self._check_fork()
        self._request("shutdown")

    @_reconnecting
    def stats(self) -> dict:
        """Daemon-wide and per-table counters (one control round trip)."""
        self._check_fork()
        msg = self._request("stats")
        msg.pop("id", None)
        msg.pop("ok", None)
        return msg

    # ---- data plane ----
    def _send(self, op: int, table: int = 0, a0: int = 0, a1: int = 0, a2: int = 0,
              f0: float = 0.0, payload: tuple = ()) -> int:
        ring = self._req
        deadline = None
        while not ring.try_put(payload, op, table, self._seq + 1, a0, a1, a2, f0):
            # the daemon is behind; it frees room without waking us, so poll
            if deadline is None:
                deadline = time.monotonic() + self.timeout
            self._live()
            if time.monotonic() > deadline:
                raise ReplayTimeout(f"command ring stayed full for {self.timeout} s")
            time.sleep(20e-6)
        self._seq += 1
        if ring.publish():
            self._doorbell.release()
        return self._seq

    def _wait(self, seq: int, take, timeout: float = 0.0):
        """Wait for the reply to ``seq``; ``take(rec, payload)`` copies what it
        needs before the payload is handed back to the daemon.  Replies to
        other requests in ``_pending`` are stashed; error replies to streamed
        commands become the deferred error.  ``seq == 0`` only drains.
        ``timeout``: how long the daemon may hold the request; the client
        waits that plus its own timeout for the reply."""
        if seq in self._stash:
            self._pending.discard(seq)
            return _finish(*self._stash.pop(seq), take)
        ring = self._resp
        started = time.perf_counter()
        deadline = time.monotonic() + self.timeout + timeout
        while True:
            while ring.pending():
                rec = ring.peek(0)
                pay = ring.payload_of(rec)
                rseq = int(rec["seq"])
                try:
                    if rseq == seq:
                        self._pending.discard(seq)
                        self._learn_wait(time.perf_counter() - started)
                        return _finish(rec, pay, take)
                    if rseq in self._pending:
                        self._pending.discard(rseq)
                        self._stash[rseq] = (rec.copy(), pay.copy())
                    elif int(rec["status"]) and self._deferred is None:
                        self._deferred = _error_of(rec, pay)
                finally:
                    ring.consume(1, ring.payload_end(rec))
            if seq == 0:
                return None
            self._sleep(ring, deadline)

    def _learn_wait(self, waited: float) -> None:
        spin = 2 * waited if waited < SPIN_MAX_S else SPIN_MIN_S
        self._spin = int(max(SPIN_MIN_S, min(SPIN_MAX_S, spin)) * self._loads_per_s)

    def _sleep(self, ring, deadline: float) -> None:
        if atomics.spin_until_changed(ring.ctl, CTL_RESP_HEAD, ring.tail, self._spin) != ring.tail:
            return
        if ring.set_sleeping():
            ring.clear_sleeping()
            return
        remaining = deadline - time.monotonic()
        try:
            # wake at least every 50 ms to notice a daemon that died
            self._sem.acquire(max(0.0, min(0.05, remaining)))
            return
        except posix_ipc.BusyError:
            pass
        finally:
            ring.clear_sleeping()
        self._live()
        if time.monotonic() > deadline:
            raise ReplayTimeout(f"daemon did not answer within {self.timeout} s")

    def _begin(self) -> None:
        """Common prologue of data calls: fork check, liveness, deferred errors."""
        if self._closed:
            raise ReplayError("client is closed")
        self._check_fork()
        if self._resp.pending():
            self._wait(0, None)
        self._raise_deferred()

    def _raise_deferred(self) -> None:
        if self._deferred is not None:
            err, self._deferred = self._deferred, None
            raise err

    @_reconnecting
    def flush(self) -> None:
        """Return once every command sent so far has been applied.  Unused
        slot leases are handed back, so the table's full capacity counts."""
        self._begin()
        for t in self._tables.values():
            t._release_lease()
            t.release()
        self._wait(self._send(C.FLUSH), lambda rec, pay: None)
        self._dirty = False
        self._raise_deferred()
        if self._lost:
            self._lost = False
            raise DaemonUnavailable(
                "the daemon was restarted since the last flush; inserts made before the restart "
                "may be lost (those since are applied)")


_TABLE_CALLS = ("insert", "insert_batch", "sample", "sample_indices", "update_priorities")


class Table:
    """A handle on one table; cheap, cached per client.  Same threading rule as Client."""

    def __init__(self, client: Client, desc: dict):
        self._client = client
        self.spec = spec_from_wire(desc["spec"])
        self.name = self.spec.name
        self._fields = self.spec.fields
        self._names = frozenset(f.name for f in self._fields)
        self._map = None
        self._bind(desc)
        if client.reconnect:  # per handle, so the hot paths of others pay nothing
            for name in _TABLE_CALLS:
                setattr(self, name, _reconnecting(getattr(Table, name)).__get__(self))
        # a writer fills a lease of reserved slots across calls and asks for
        # the next one before it runs out, so inserts need no round trip;
        # at most two leases of capacity/256 slots each, i.e. < 1% of the
        # table withheld from sampling per writer (0: reserve per call)
        self._lease_size = 0 if self.spec.rate_limited else min(
            4096, self.spec.capacity // 256, client.max_batch)
        self._lease: list | None = None   # [rid, slots, next position, contiguous]
        self._held: list[int] = []         # holds of sample_indices() batches
        self._next_seq: int | None = None  # RESERVE sent for the next lease

    def _bind(self, desc: dict) -> None:
        self.id = int(desc["id"])
        old, self._map = self._map, TableMap.attach(desc["segment"], self.spec)
        if old is not None:
            old.release()  # arrays handed out keep their mapping alive
        self._views = self._map.fields
        self._view_list = [self._views[f.name] for f in self._fields]
        # a writer's leases are valid while this stays (Client durability notes);
        # read through a memoryview: a Python int, cheaper than a numpy scalar
        self._live_words = memoryview(self._map.live).cast("B").cast("Q")
        self._epoch = self._live_words[LIVE_EPOCH]

    def _rebind(self, desc: dict) -> None:
        """After a reconnect: the daemon's table of this name, new leases."""
        if spec_from_wire(desc["spec"]) != self.spec:
            raise ReplayError(f"table {self.name!r} came back with another definition")
        self._bind(desc)
        self._lease = self._next_seq = None
        self._held = []

    def __reduce__(self):
        return (_reopen, (self._client, self.name))

    def __len__(self) -> int:
        return int(self._map.live[LIVE_SIZE])

    def __repr__(self) -> str:
        return f"<shmreplay.Table {self.name!r} {len(self)}/{self.spec.capacity}>"

    @property
    def capacity(self) -> int:
        return self.spec.capacity

    # ---- rate-limiter probes (no round trip: the daemon's counters are in the segment) ----
    def can_insert(self, n: int = 1) -> bool:
        """True if an insert of n items would run now without waiting for
        the rate limiter.  A snapshot: other clients may change it at once."""
        live = self._map.live
        return ratelimiter.insert_room(self.spec, int(live[LIVE_SIZE]), int(live[LIVE_INSERTS]),
                                       int(live[LIVE_PENDING]), int(live[LIVE_SAMPLES]), n) >= n

    def can_sample(self, n: int = 1) -> bool:
        """True if a sample of n would run now without waiting (min size,
        ratio, reuse limits, something with positive priority)."""
        live = self._map.live
        if ratelimiter.sample_blocker(self.spec, int(live[LIVE_SIZE]), int(live[LIVE_INSERTS]),
                                      int(live[LIVE_SAMPLES]), n) is not None:
            return False
        if self.spec.max_times_sampled and int(live[LIVE_USES]) < n:
            return False
        return bool(self._map.mass[0] > 0)

    def _priorities(self, values, n: int, what: str) -> np.ndarray:
        return as_priorities(values, n, f"{what} on table {self.name!r}", self.spec.alpha)

    # ---- writing ----
    def _check(self, data, batch: bool) -> tuple[list, int]:
        if not isinstance(data, dict):
            raise FieldError(f"table {self.name!r}: data must be a dict of field -> array")
        if data.keys() != self._names:
            missing = sorted(self._names - data.keys())
            unknown = sorted(data.keys() - self._names)
            parts = ([f"missing field(s) {missing}"] if missing else []) + (
                [f"unknown field(s) {unknown}"] if unknown else [])
            raise FieldError(f"table {self.name!r}: {', '.join(parts)}; "
                             f"its fields are {sorted(self._names)}")
        arrays, n = [], None
        for f in self._fields:
            v = data[f.name]
            a = v if isinstance(v, np.ndarray) else np.asarray(v)
            if a.dtype != f.dtype and not np.can_cast(a.dtype, f.dtype, "same_kind"):
                raise FieldError(f"table {self.name!r}, field {f.name!r}: dtype {a.dtype} "
                                 f"cannot be stored as {f.dtype}")
            if batch:
                if a.ndim != len(f.shape) + 1 or a.shape[1:] != f.shape:
                    expect = "(n" + "".join(f", {d}" for d in f.shape) + ")"
                    raise FieldError(f"table {self.name!r}, field {f.name!r}: shape {a.shape}, "
                                     f"expected {expect}")
                if n is None:
                    n = a.shape[0]
                elif a.shape[0] != n:
                    raise FieldError(f"table {self.name!r}: field {f.name!r} has {a.shape[0]} "
                                     f"items, earlier fields have {n}")
            elif a.shape != f.shape:
                raise FieldError(f"table {self.name!r}, field {f.name!r}: shape {a.shape}, "
                                 f"expected {f.shape}")
            arrays.append(a)
        return arrays, (n if batch else 1)

    def insert(self, priority=None, timeout: float | None = None, **fields) -> None:
        """Insert one item; ``priority=None`` means the max priority seen so
        far.  Waits up to ``timeout`` s (None: no limit) for the rate limiter."""
        arrays, _ = self._check(fields, batch=False)
        prios = None if priority is None else self._priorities([priority], 1, "insert")
        self._client._begin()
        self._write(arrays, 1, prios, single=True, deadline=_deadline_of(timeout))

    def insert_batch(self, data: dict, priorities=None, timeout: float | None = None) -> None:
        """Insert n items; every field's leading dimension is n.  On a
        rate-limited table the items go in as the limiter admits them; if
        ``timeout`` runs out part-way, the items before the error are in."""
        arrays, n = self._check(data, batch=True)
        prios = None if priorities is None else self._priorities(priorities, n, "insert_batch")
        if n == 0:
            return
        self._client._begin()
        step = self._client.max_batch
        deadline = _deadline_of(timeout)
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            self._write([a[lo:hi] for a in arrays], hi - lo,
                        None if prios is None else prios[lo:hi], single=False, deadline=deadline)

    def _write(self, arrays: list, n: int, prios, single: bool, deadline: float | None) -> None:
        cl = self._client
        if self._live_words[LIVE_EPOCH] != self._epoch:
            raise DaemonUnavailable(f"table {self.name!r} was taken over by a restarted daemon; "
                                    "this client's slot leases died with the old one")
        lo = 0
        while lo < n:
            lease = self._lease
            if lease is None or lease[2] == lease[1].shape[0]:
                lease = self._lease = self._new_lease(n - lo, deadline)
            rid, slots, pos, contiguous = lease
            k = min(n - lo, slots.shape[0] - pos)
            whole = lo == 0 and k == n  # the usual case: no need to slice the input
            try:
                if single or contiguous:
                    s0 = int(slots[pos])
                    for view, a in zip(self._view_list, arrays):
                        if single:
                            view[s0] = a
                        else:
                            view[s0:s0 + k] = a if whole else a[lo:lo + k]
                else:
                    part = slots[pos:pos + k]
                    for view, a in zip(self._view_list, arrays):
                        view[part] = a if whole else a[lo:lo + k]
            except BaseException:
                self._release_lease()  # the rows of this part may be half written
                raise
            lease[2] = pos + k
            cl._dirty = True
            cl._send(C.COMMIT, self.id, a0=rid, a1=k, a2=pos,
                     payload=() if prios is None else (prios if whole else prios[lo:lo + k],))
            lo += k
        lease = self._lease
        # ask for the next lease at half time, so its reply is there when needed
        if (self._next_seq is None and 0 < n <= self._lease_size
                and lease[1].shape[0] - lease[2] < max(n, self._lease_size // 2)):
            self._next_seq = cl._send(C.RESERVE, self.id, a0=self._lease_size,
                                      a1=C.timeout_us(cl.timeout))
            cl._pending.add(self._next_seq)

    def _new_lease(self, need: int, deadline: float | None = None) -> list:
        cl = self._client
        if self._next_seq is not None:
            seq, self._next_seq = self._next_seq, None
            rid, contiguous, slots = cl._wait(seq, _take_reservation, cl.timeout)
            return [rid, slots, 0, contiguous]
        size = min(max(need, self._lease_size), cl.max_batch)
        rid, contiguous, slots = reserve(self, size, deadline)
        return [rid, slots, 0, contiguous]

    def _release_lease(self) -> None:
        """Hand back the slots of my leases that hold no item yet."""
        cl = self._client
        if self._next_seq is not None:
            seq, self._next_seq = self._next_seq, None
            try:
                rid = cl._wait(seq, _take_reservation, cl.timeout)[0]
                cl._send(C.ABORT, self.id, a0=rid)
            except ReplayError:
                pass  # the RESERVE failed: nothing to hand back
        lease, self._lease = self._lease, None
        if lease is not None and lease[2] < lease[1].shape[0]:
            cl._send(C.ABORT, self.id, a0=lease[0])

    def flush(self) -> None:
        """Return when all my inserts (on any table of this client) are sampleable."""
        self._client.flush()

    # ---- reading ----
    def iterate(self, batch_size: int, beta: float = 0.4, prefetch: int = 2,
                timeout: float | None = None):
        """Prefetching batches for a learner loop (see ``iterator.BatchIterator``)::

            with table.iterate(256, beta=0.4) as batches:
                for b in batches:
                    ...train...
                    table.update_priorities(b.keys, new_priorities)

        ``timeout`` bounds each batch's wait for the table's limits."""
        from .iterator import BatchIterator
        return BatchIterator(self, batch_size, beta, prefetch, timeout)

    def _check_draw(self, batch_size, beta) -> tuple[int, float]:
        n = int(batch_size)
        if not 1 <= n <= self._client.max_batch:
            raise ReplayError(f"batch_size {batch_size} outside 1..{self._client.max_batch}")
        beta = float(beta)
        if not (0.0 <= beta < np.inf):
            raise ReplayError(f"beta must be finite and >= 0, got {beta}")
        self._client._begin()
        return n, beta

    def sample_indices(self, batch_size: int, beta: float = 0.4, timeout: float | None = None):
        """Draw without gathering: (keys, probabilities, weights).  For a
        learner that reads rows itself (``indices = keys & 0xFFFFFFFF``); it
        must then check the generation stamps as ``sample`` does.  On a
        table with ``max_times_sampled``, slots of items drawn for the last
        time stay held for this learner until its next ``sample_indices``
        call on the table or ``release()``, so read them before that."""
        n, beta = self._check_draw(batch_size, beta)
        self.release()
        keys, probs, weights = np.empty(n, np.uint64), np.empty(n), np.empty(n)

        def attempt(w):
            return self._receive_draw(self._send_draw(n, beta, w), slice(None), n, keys, probs,
                                      weights, w)

        hid = _in_slices(_deadline_of(timeout), attempt)
        if hid:
            self._held.append(hid)
        return keys, probs, weights

    def release(self) -> None:
        """Hand back the slots ``sample_indices`` held for reading (see there)."""
        held, self._held = self._held, []
        for hid in held:
            self._client._send(C.RELEASE, self.id, a0=hid)

    def sample(self, batch_size: int, beta: float = 0.4, out: SampleBatch | None = None,
               timeout: float | None = None) -> SampleBatch:
        """Draw ``batch_size`` items.  With ``out=`` (an earlier batch of the
        same size) the rows are gathered into its arrays instead of new ones.
        Waits up to ``timeout`` s (None: no limit) for the table's limits."""
        n, beta = self._check_draw(batch_size, beta)
        return _in_slices(_deadline_of(timeout), lambda w: self._complete(n, beta, out, None, w))

    def _complete(self, n: int, beta: float, out: SampleBatch | None, seq: int | None,
                  timeout: float) -> SampleBatch:
        """Gather a batch whose SAMPLE was sent (seq) or is to be sent (None)."""
        cl = self._client
        if out is None:
            out = SampleBatch({f.name: np.empty((n, *f.shape), f.dtype) for f in self._fields},
                              np.empty(n, np.uint64), np.empty(n), np.empty(n))
        elif len(out) != n:
            raise ReplayError(f"out= holds {len(out)} rows, batch_size is {n}")
        holds = []
        try:
            self._draw(out, np.arange(n), beta, seq, timeout, holds)
            out.redraws = 0
            gens = self._map.gens
            deadline = time.monotonic() + cl.timeout
            while True:
                # read the stamps only after the rows: if a writer got a slot
                # during the gather, its reservation bumped the stamp first
                bad = np.flatnonzero(gens[out.keys & _MASK].astype(np.uint64) != (out.keys >> _U32))
                if bad.shape[0] == 0:
                    return out
                if time.monotonic() > deadline:
                    raise ReplayTimeout(f"could not draw {n} stable rows within {cl.timeout} s")
                out.redraws += bad.shape[0]
                self._draw(out, bad, beta, None, timeout, holds)
        finally:
            for hid in holds:  # the rows are copied out: the slots may be reused
                cl._send(C.RELEASE, self.id, a0=hid)

    def _send_draw(self, k: int, beta: float, timeout: float) -> int:
        return self._client._send(C.SAMPLE, self.id, a0=k, a1=C.timeout_us(timeout), f0=beta)

    def _receive_draw(self, seq: int, rows, k: int, keys, probs, weights, timeout: float) -> int:
        """Wait for the SAMPLE reply ``seq``; it lands in keys/probs/weights[rows].
        Returns the hold id (0: none)."""
        cl = self._client

        def take(rec, pay):
            kk = int(rec["a0"])
            if kk != k or pay.shape[0] != 24 * k:
                raise ProtocolError(f"SAMPLE reply carries {kk} items / {pay.shape[0]} bytes")
            keys[rows] = pay[:8 * k].view(np.uint64)
            probs[rows] = pay[8 * k:16 * k].view(np.float64)
            weights[rows] = pay[16 * k:].view(np.float64)
            return int(rec["a1"])

        return cl._wait(seq, take, timeout)

    def _draw(self, out: SampleBatch, rows: np.ndarray, beta: float, seq: int | None,
              timeout: float, holds: list) -> None:
        k = rows.shape[0]
        if seq is None:  # else the SAMPLE was sent ahead (iterator pipelining)
            seq = self._send_draw(k, beta, timeout)
        hid = self._receive_draw(seq, rows, k, out.keys, out.probabilities, out.weights, timeout)
        if hid:
            holds.append(hid)
        slots = (out.keys[rows] & _MASK).astype(np.intp)
        whole = k == out.keys.shape[0]
        for f in self._fields:
            if whole:
                _take(self._views[f.name], slots, out.data[f.name])
            else:
                out.data[f.name][rows] = self._views[f.name][slots]

    def update_priorities(self, keys, priorities) -> None:
        """Set new priorities for sampled keys; keys whose slot has been
        overwritten since are ignored (and counted in the table's stats)."""
        keys = np.ascontiguousarray(keys, dtype=np.uint64)
        if keys.ndim != 1:
            raise PriorityError(f"keys must be 1-D, got shape {keys.shape}")
        n = keys.shape[0]
        prios = self._priorities(priorities, n, "update_priorities")
        cl = self._client
        cl._begin()
        cl._live()
        step = cl.max_batch
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            cl._send(C.UPDATE, self.id, a0=hi - lo, payload=(keys[lo:hi], prios[lo:hi]))


# Gathering large rows on two threads: np.take releases the GIL, so each
# half copies in parallel (dqn-atari rows from /dev/shm: 14.5 -> 20.8 GB/s,
# as fast as a numba prange kernel, without numba's threading layers, which
# are process-global and not all fork- or thread-safe).  Below ~1 MiB the
# hand-off to the helper thread costs more than it saves.
PARALLEL_GATHER_BYTES = 1 << 20
_helper_pool: tuple[int, ThreadPoolExecutor] | None = None


def _helper() -> ThreadPoolExecutor:
    global _helper_pool
    if _helper_pool is None or _helper_pool[0] != os.getpid():  # threads do not survive fork
        _helper_pool = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="shmreplay-gather"))
    return _helper_pool[1]


def _take(src: np.ndarray, slots: np.ndarray, dst: np.ndarray) -> None:
    if dst.nbytes < PARALLEL_GATHER_BYTES:
        np.take(src, slots, axis=0, out=dst, mode="clip")
        return
    half = slots.shape[0] // 2
    other = _helper().submit(np.take, src, slots[:half], 0, dst[:half], "clip")
    np.take(src, slots[half:], axis=0, out=dst[half:], mode="clip")
    other.result()


def _error_of(rec, pay) -> ReplayError:
    return error_from_code(int(rec["status"]), bytes(pay).decode("utf-8", "replace"))


def _finish(rec, pay, take):
    if int(rec["status"]):
        raise _error_of(rec, pay)
    return take(rec, pay)


def _take_reservation(rec, pay):
    n = int(rec["a2"])
    if pay.shape[0] != 4 * n:
        raise ProtocolError(f"RESERVE reply of {n} slots carries {pay.shape[0]} bytes")
    return int(rec["a0"]), bool(rec["a1"]), pay.view(np.uint32).astype(np.intp)


def _deadline_of(timeout: float | None) -> float | None:
    if timeout is not None and not timeout >= 0:
        raise ReplayError(f"timeout must be >= 0 seconds or None, got {timeout}")
    return None if timeout is None else time.monotonic() + timeout


def _in_slices(deadline: float | None, attempt):
    """Run ``attempt(wait_s)`` (a request the daemon may hold up to wait_s)
    until it succeeds or ``deadline`` (None: none) passes, asking for at
    most WAIT_SLICE_S at a time."""
    while True:
        left = WAIT_SLICE_S if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            return attempt(min(WAIT_SLICE_S, left))
        except RateLimited:
            if deadline is not None and time.monotonic() >= deadline:
                raise


def reserve(table: Table, n: int, deadline: float | None) -> tuple[int, bool, np.ndarray]:
    """RESERVE up to n slots of ``table`` and wait for them: (rid,
    contiguous, slots).  The daemon may grant fewer (rate limiter)."""
    cl = table._client

    def attempt(w):
        return cl._wait(cl._send(C.RESERVE, table.id, a0=n, a1=C.timeout_us(w)), _take_reservation, w)

    return _in_slices(deadline, attempt)


def _reopen(client: Client, name: str) -> Table:
    return client.table(name)
