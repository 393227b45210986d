"""The daemon's data plane: one thread that owns every table and channel.

All table state is touched by this thread only, so tables need no locks.
The control plane (the event-loop thread) reaches it through ``submit``:
it queues a call of one of the entry points below (table create/drop,
client attach/detach, stats) to run between bursts, rings the engine's own
doorbell (an eventfd) so a sleeping engine notices, and gets a
``concurrent.futures.Future``.
Entry points assert, in debug mode, that they run on the engine thread.

Loop: run queued calls; serve every channel (up to BURST records each, for
fairness, then one publish of the replies); free the slots of expired holds
(``table.expire_holds``) before retrying parked requests (``parking.py``),
so a parked RESERVE can take them; if nothing was found, spin, then sleep
on the doorbell (``idle.py``) until the next parked deadline or hold expiry
at the latest.

Each record is decoded by ``wire.records`` and applied by the handler of
its op.  Replies wait in the client's outbox until its ring has room
(``outbox.py``).  A client whose input breaks a rule is cut off alone.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time

from ...errors import ProtocolError, ReplayError, UnknownTable
from ...wire import records as R
from ...wire.channel import new_doorbell, ring
from ..disk.prefetch import Prefetcher
from ..tables import tablestats
from ..tables.table import Table, expire_holds
from . import parking
from .calls import Calls
from .idle import Idler
from .outbox import ClientState
from .parking import Parking, Waiter, earliest

log = logging.getLogger("shmreplayd.engine")

BURST = 64


def entry_point(method):
    """A call the control plane submits; in debug mode, checks it runs on
    the engine thread (or with no engine thread left to race)."""
    @functools.wraps(method)
    def call(self, *args):
        assert not self.running or threading.current_thread() is self.thread, \
            f"Engine.{method.__name__} called off the engine thread"
        return method(self, *args)
    return call


class Engine:
    def __init__(self, spin_us: float = 250.0, idle_timeout: float = 1.0, on_client_error=None,
                 on_crash=None, prefetch: Prefetcher | None = None):
        self.bell = new_doorbell()  # the control plane's: private to this process
        self.idler = Idler(self.bell, spin_us, idle_timeout)
        self.on_client_error = on_client_error or (lambda cid, exc: None)
        self.on_crash = on_crash or (lambda: None)
        self.tables: dict[int, Table] = {}
        self.by_name: dict[str, Table] = {}
        self.clients: dict[int, ClientState] = {}
        self.dropped: dict[int, ClientState] = {}  # cut off, awaiting unmap by the control plane
        self.prefetch = prefetch or Prefetcher(0)  # reads file-backed tables' rows ahead
        self.parking = Parking(self.prefetch)
        self.calls = Calls()
        self.stopping = False
        self.running = False  # True while the thread serves; guarded by lock
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.stats = {"commands": 0, "disconnects": 0}
        # one handler per op; runs of COMMIT records are merged in _serve
        self._handlers = {R.RESERVE: self._on_draw, R.SAMPLE: self._on_draw, R.ABORT: self._on_abort,
                          R.RELEASE: self._on_release, R.UPDATE: self._on_update, R.FLUSH: self._on_flush}

    # ---- any thread ----
    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._run, name="shmreplay-engine", daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        with self.lock:
            if self.running:
                fut = self.calls.put(fn, args)
                ring(self.bell)
                return fut
        # no engine thread (not started, stopped or failed): the caller is
        # now the only one touching engine state, so run the call here
        fut = self.calls.put(fn, args)
        self.calls.run()
        return fut

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; once it has ended (not before: it may still use
        them), close its epoll and doorbell.  Later calls run in the caller's."""
        if self.idler.epoll.closed:
            return
        self.stopping = True
        ring(self.bell)
        if self.thread is not None:
            self.thread.join(timeout)
        if self.thread is None or not self.thread.is_alive():
            self.idler.close()
            os.close(self.bell)

    # ---- engine thread ----
    def _run(self) -> None:
        try:
            while not self.stopping:
                worked = self.calls.run()
                worked = self._serve_all() or worked
                hold_ends = expire_holds(self.tables.values(), time.monotonic())
                if self.parking.count:
                    self._cut_off_all(self.parking.settle(self.tables, time.monotonic()))
                if worked:
                    continue
                rings = [cl.req for cl in self.clients.values()]
                if self.idler.spin(rings, self.calls):
                    continue
                self.idler.sleep(rings, self.calls, earliest(self.parking.next_deadline(), hold_ends))
        except BaseException:  # the engine dying silently would hang every client
            log.exception("engine thread crashed; the daemon will exit and keep every table")
            self.calls.failed = True
            self.on_crash()
        finally:
            with self.lock:  # after this, submit() runs calls in the caller's thread
                self.running = False
                self.calls.run()

    def _serve_all(self) -> bool:
        worked = False
        for cl in list(self.clients.values()):
            try:
                worked = self._serve(cl) or worked
            except ProtocolError as exc:
                self._cut_off(cl, exc)
            except Exception as exc:  # a bug one client's input reached: cut off that client only
                log.exception("client %d (pid %d): unexpected error", cl.id, cl.pid)
                self._cut_off(cl, ProtocolError(f"daemon could not apply a command: {exc!r}"))
        return worked

    def _serve(self, cl: ClientState, limit: int = BURST) -> bool:
        ring = cl.req
        n = min(ring.pending(), limit)
        pay_end = None
        i = 0
        while i < n:
            rec = ring.peek(i)
            op, tid, seq = R.envelope(rec)
            if op == R.COMMIT:
                run = R.read_commit_run(ring, i, n)
                self._on_commit(cl, run)
                i, end = run.next, run.pay_end
            else:
                handler = self._handlers.get(op)
                if handler is None:
                    raise ProtocolError(f"unknown command op {op} in the request ring")
                pay = ring.payload_of(rec)  # bounds-checked; ProtocolError cuts the client off
                end = ring.payload_end(rec)
                try:
                    handler(cl, rec, pay, op, tid, seq)
                except ProtocolError:
                    raise
                except ReplayError as exc:
                    cl.respond(R.error_reply(op, seq, exc))
                i += 1
            if end is not None:
                pay_end = end
        if n:
            ring.consume(n, pay_end)
            self.stats["commands"] += n
        cl.flush()
        return n > 0

    # ---- handlers: one per op (wire/records.py says what each record holds) ----
    def _on_commit(self, cl: ClientState, run: R.CommitRun) -> None:
        try:
            self._table(run.table).commit(cl.id, run.rid, run.prios, offset=run.offset, n=run.n)
        except ProtocolError:
            raise
        except ReplayError as exc:
            cl.respond(R.error_reply(R.COMMIT, run.seq, exc))

    def _on_draw(self, cl, rec, pay, op, tid, seq) -> None:
        """RESERVE and SAMPLE: run now, or park behind the table's limits."""
        if op == R.RESERVE:
            (n, wait_us), beta = R.read_reserve(rec), 0.0
        else:
            n, wait_us, beta = R.read_sample(rec)
        self.parking.admit(self._table(tid), Waiter(cl, op, seq, n, beta, _deadline(wait_us)))

    def _on_abort(self, cl, rec, pay, op, tid, seq) -> None:
        self._table(tid).abort(cl.id, R.read_abort(rec))

    def _on_release(self, cl, rec, pay, op, tid, seq) -> None:
        self._table(tid).release(cl.id, R.read_release(rec))

    def _on_update(self, cl, rec, pay, op, tid, seq) -> None:
        self._table(tid).update_priorities(*R.read_update(rec, pay))

    def _on_flush(self, cl, rec, pay, op, tid, seq) -> None:  # every earlier record is applied
        cl.respond(R.flush_reply(seq))

    def _table(self, table_id: int) -> Table:
        table = self.tables.get(table_id)
        if table is None:
            raise UnknownTable(f"no table with id {table_id} (dropped?)")
        return table

    def _cut_off_all(self, doomed: list) -> None:
        for cl, exc in doomed:
            self._cut_off(cl, exc)

    def _cut_off(self, cl: ClientState, exc: ProtocolError) -> None:
        if cl.id in self.clients:
            log.warning("client %d (pid %d): %s; disconnecting it", cl.id, cl.pid, exc)
            self._drop(cl)
            self.on_client_error(cl.id, exc)

    def _drop(self, cl: ClientState) -> None:
        if self.clients.pop(cl.id, None) is None:
            return
        self.idler.unwatch(cl.to_daemon)
        self.dropped[cl.id] = cl
        cl.outbox.clear()
        self.parking.unpark_client(cl)
        self.stats["disconnects"] += 1
        if reclaimed := sum(t.release_owner(cl.id) for t in self.tables.values()):
            log.info("client %d (pid %d): reclaimed %d reserved slots", cl.id, cl.pid, reclaimed)

    # ---- entry points the control plane submits ----
    @entry_point
    def add_table(self, table: Table) -> None:
        self.tables[table.id] = table
        self.by_name[table.spec.name] = table
        self.parking.add_table(table.id)
        self.prefetch.add(table)

    @entry_point
    def table_named(self, name: str) -> Table:
        t = self.by_name.get(name)
        if t is None:
            raise UnknownTable(f"no table named {name!r}")
        return t

    @entry_point
    def table_names(self) -> list[str]:
        return list(self.by_name)

    @entry_point
    def describe(self, name: str | None = None):
        """The description of table ``name`` (None if there is none), or
        with no name, of every table."""
        if name is None:
            return [tablestats.describe(t) for t in self.tables.values()]
        t = self.by_name.get(name)
        return tablestats.describe(t) if t is not None else None

    @entry_point
    def drop_table(self, name: str) -> Table:
        t = self.table_named(name)
        doomed: list = []
        for w in self.parking.drop_table(t.id):
            parking.answer(w, UnknownTable(f"table {name!r} was dropped"), doomed)
        self._cut_off_all(doomed)  # after the walk: cutting off unparks
        del self.by_name[name]
        del self.tables[t.id]
        self.prefetch.drop(t.id)
        return t

    @entry_point
    def add_client(self, cl: ClientState) -> None:
        self.clients[cl.id] = cl
        self.idler.watch(cl.to_daemon)
        if cl.resume:  # it voided the leases it held at a dead daemon: free them
            for t in self.tables.values():
                if n := t.ledger.resumed(cl.pid, cl.start, cl.resume):
                    log.info("table %s: %d slots leased under a dead daemon freed: their writer "
                             "(pid %d) reconnected", t.spec.name, n, cl.pid)

    @entry_point
    def detach_client(self, cid: int) -> ClientState | None:
        """The client's lease ended: apply what its ring still holds, then
        reclaim its reservations.  Returns its state for the caller to unmap."""
        cl = self.clients.get(cid)
        if cl is not None:
            try:
                while self._serve(cl, limit=cl.req.slots):
                    pass
            except Exception as exc:  # whatever its ring held, the lease must end
                log.warning("client %d: %r while draining its ring", cid, exc)
            self._drop(cl)
        return self.dropped.pop(cid, None)

    @entry_point
    def snapshot(self) -> dict:
        pids = {cid: cl.pid for cid, cl in self.clients.items()}
        tables = {t.spec.name: _table_stats(t, pids, self.parking, self.prefetch) for t in self.tables.values()}
        return {"engine": {**self.stats, **self.idler.stats, "parked": self.parking.total},
                "prefetch": self.prefetch.stats(), "clients": len(self.clients), "tables": tables}


def _table_stats(t: Table, pids: dict, parking: Parking, prefetch: Prefetcher) -> dict:
    """A table's numbers for ``Engine.snapshot``: its own, its parked
    requests, its prefetch counters (file-backed tables)."""
    st = tablestats.snapshot_stats(t, pids)
    st["limiter"]["waiting_inserts"], st["limiter"]["waiting_samples"] = parking.waiting(t.id)
    st.update(prefetch.table_stats(t.id))
    return st


def _deadline(timeout_us: int) -> float:
    if timeout_us >= R.FOREVER:
        return float("inf")
    return time.monotonic() + timeout_us * 1e-6
