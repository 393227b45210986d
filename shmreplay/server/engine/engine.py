"""The daemon's data plane: one thread that owns every table and channel.

All table state is touched by this thread only, so tables need no locks.
The control plane (the event-loop thread) reaches it through ``submit``:
it queues a call of one of the entry points below (table create/drop,
client attach/detach, stats) to run between bursts, rings the engine's own
doorbell (an eventfd) so a sleeping engine notices, and gets a
``concurrent.futures.Future``.
Entry points assert, in debug mode, that they run on the engine thread.

Loop: serve every channel (up to BURST records each, for fairness, then
one publish of the replies: ``commands.py`` applies them and builds every
reply); run queued calls; free the slots of expired holds and void expired
reservations (``tables.table.expire``) before retrying parked requests, so
a parked RESERVE can take them; if nothing was found, spin, then sleep on
the doorbell (``idle.py``) until the next parked deadline, hold or
reservation expiry at the latest.

Replies wait in the client's outbox until its ring has room
(``outbox.py``).  A client whose input breaks a rule is cut off alone.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import threading
import time

from ...errors import ProtocolError, TableExists, UnknownTable
from ...wire.doorbell import new_doorbell, ring
from ..tables import tablestats
from ..tables.table import Table, expire
from .calls import Calls
from .commands import Commands
from .idle import Idler
from .outbox import ClientState
from .parking import earliest

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
                 on_crash=None, prefetch=None, learner_spin_us: float = 2000.0,
                 learner_spin_max_us: float = 10000.0):
        """``prefetch``: the daemon's ``disk.prefetch.Prefetcher`` (None: no
        read-ahead), told which tables are served and which rows come next.
        ``spin_us``, ``learner_spin_us``, ``learner_spin_max_us``: the
        idler's budgets (``idle.py``)."""
        self.bell = new_doorbell()  # the control plane's: private to this process
        self.idler = Idler(self.bell, spin_us, idle_timeout, learner_spin_us, learner_spin_max_us)
        self.on_client_error = on_client_error or (lambda cid, exc: None)
        self.on_crash = on_crash or (lambda: None)
        self.tables: dict[int, Table] = {}
        self.by_name: dict[str, Table] = {}
        self.clients: dict[int, ClientState] = {}
        self.dropped: dict[int, ClientState] = {}  # cut off, awaiting unmap by the control plane
        self.prefetch = prefetch
        self.commands = Commands(self.tables, prefetch)
        self.parking = self.commands.parking
        self.calls = Calls()
        self.stopping = False
        self.running = False  # True while the thread serves; guarded by lock
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.disconnects = 0

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
            served = False  # the last pass served a command
            while not self.stopping:
                draws, wide = self.commands.draws, self.commands.wide_draws
                # the rings first: a call (stats, a detach) then sees every
                # record a client published before it, lazy COMMITs included
                worked = self._serve_all()
                worked = self.calls.run() or worked
                slots_free_at = expire(self.tables.values(), time.monotonic())
                if self.parking.count:
                    self._cut_off_all(self.commands.settle(time.monotonic()))
                if self.commands.draws != draws:  # served now or from parking: a learner is there
                    self.idler.sampled(wide=self.commands.wide_draws != wide)
                rings = [cl.req for cl in self.clients.values()]
                waiting = self.parking.count > 0
                if worked:
                    served = True
                    # what came meanwhile, unless it is only COMMITs, which
                    # wait as they do for the spin (idle.py, "Lazy COMMITs")
                    if self.idler.wanted(rings, self.calls, waiting):
                        continue
                if self.idler.spin(rings, self.calls, served, waiting):
                    continue
                served = False
                self.idler.sleep(rings, self.calls, earliest(self.parking.next_deadline(), slots_free_at),
                                 waiting=waiting)
        except BaseException:  # the engine dying silently would hang every client
            log.exception("engine thread crashed; the daemon will exit and keep every table")
            self.calls.failed = True
            self.on_crash()
        finally:
            with self.lock:  # after this, submit() runs calls in the caller's thread
                self.running = False
                self.calls.run()

    def _serve_all(self) -> bool:
        """One pass over every client's ring, a burst each.  A client that
        samples is served again after each other client's burst if it has
        a request waiting: its SAMPLE is on its learner's critical path,
        while a writer's COMMITs wait for nobody (4 writers' bursts of
        COMMITs and RESERVEs ahead of it cost a learner of dqn rows on 2
        cores a third of its batches)."""
        worked = False
        clients = list(self.clients.values())
        samplers = [cl for cl in clients if cl.samples]
        for cl in clients:
            worked = self._serve(cl) or worked
            if samplers and not cl.samples:
                for s in samplers:
                    if s.id in self.clients and s.req.has_pending():
                        worked = self._serve(s) or worked
        return worked

    def _serve(self, cl: ClientState) -> bool:
        if cl.id not in self.clients:  # cut off earlier in this pass
            return False
        try:
            return self.commands.serve(cl, BURST) > 0
        except ProtocolError as exc:
            self._cut_off(cl, exc)
        except Exception as exc:  # a bug one client's input reached: cut off that client only
            log.exception("client %d (pid %d): unexpected error", cl.id, cl.pid)
            self._cut_off(cl, ProtocolError(f"daemon could not apply a command: {exc!r}"))
        return False

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
        self.disconnects += 1
        if reclaimed := sum(t.release_owner(cl.id) for t in self.tables.values()):
            log.info("client %d (pid %d): reclaimed %d reserved slots", cl.id, cl.pid, reclaimed)

    # ---- entry points the control plane submits ----
    @entry_point
    def add_table(self, table: Table) -> None:
        if table.spec.name in self.by_name:  # the control plane's creates are one per name: defend
            raise TableExists(f"table {table.spec.name!r} is served already")
        self.tables[table.id] = table
        self.by_name[table.spec.name] = table
        self.parking.add_table(table.id)
        if self.prefetch is not None:
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
        doomed = self.commands.drop_table(t.id, name)
        self.commands.sample_hist.pop(t.id, None)
        self._cut_off_all(doomed)  # after the answers: cutting off unparks
        del self.by_name[name]
        del self.tables[t.id]
        if self.prefetch is not None:
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
                while self.commands.serve(cl, cl.req.slots):
                    pass
            except Exception as exc:  # whatever its ring held, the lease must end
                log.warning("client %d: %r while draining its ring", cid, exc)
            self._drop(cl)
        return self.dropped.pop(cid, None)

    @entry_point
    def snapshot(self) -> dict:
        pids = {cid: cl.pid for cid, cl in self.clients.items()}
        tables = {t.spec.name: self._table_stats(t, pids) for t in self.tables.values()}
        names = {t.id: t.spec.name for t in self.tables.values()}
        roles = {1: "writes", 2: "samples", 3: "writes+samples"}
        clients = [{"client": cid, "pid": cl.pid,
                    "tables": {names[tid]: roles[u] for tid, u in sorted(cl.uses.items()) if tid in names}}
                   for cid, cl in sorted(self.clients.items())]
        for tid, hist in self.commands.sample_hist.items():
            if tid in names:
                tables[names[tid]]["sample_time"] = {"log2_us_buckets": hist[:-1], "sum_ns": hist[-1]}
        return {"engine": {"commands": self.commands.count, "disconnects": self.disconnects,
                           **self.idler.stats, "parked": self.parking.total},
                "prefetch": self.prefetch.stats() if self.prefetch is not None else {},
                "clients": len(self.clients), "client_list": clients, "tables": tables}

    def _table_stats(self, t: Table, pids: dict) -> dict:
        """A table's numbers: its own, its parked requests, its prefetch
        counters (file-backed tables)."""
        st = tablestats.snapshot_stats(t, pids)
        st["limiter"]["waiting_inserts"], st["limiter"]["waiting_samples"] = self.parking.waiting(t.id)
        if self.prefetch is not None:
            st.update(self.prefetch.table_stats(t.id))
        return st
