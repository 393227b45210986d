"""The daemon's data plane: one thread that owns every table and channel.

All table state is touched by this thread only, so tables need no locks.
The control plane (the event-loop thread) reaches it through ``submit``:
it queues a call of one of the entry points below (table create/drop,
client attach/detach, stats) to run between bursts, rings the doorbell so
a sleeping engine notices, and gets a ``concurrent.futures.Future``.
Entry points assert, in debug mode, that they run on the engine thread.

Loop: run queued calls; serve every channel (up to BURST records each, for
fairness, then one publish of the replies); retry parked requests
(``parking.py``); if nothing was found, spin for ``spin_us`` re-checking the
ring heads, then announce sleep in every channel and wait on the doorbell
(clients post it when they see the announcement).  An idle engine
therefore sleeps in ``sem_wait`` and uses no CPU.

Each record is decoded by ``wire.records`` and applied by the handler of
its op.  Replies wait in the client's outbox until its ring has room; a
client that leaves MAX_OUTBOX replies unread is cut off.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
import queue
import threading
import time

import posix_ipc

from ..errors import ProtocolError, ReplayError, UnknownTable
from ..wire import records as R
from ..wire.channel import Channel
from .counters import Blocked
from .parking import Parking, Waiter
from .table import Table

log = logging.getLogger("shmreplayd.engine")

BURST = 64
MAX_OUTBOX = 1024  # replies a client may leave unread before it is cut off


class ClientState:
    def __init__(self, cid: int, pid: int, channel: Channel, sem: posix_ipc.Semaphore):
        self.id = cid
        self.pid = pid
        self.channel = channel
        self.req = channel.requests
        self.resp = channel.responses
        self.sem = sem
        self.outbox: collections.deque = collections.deque()


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
    def __init__(self, doorbell: posix_ipc.Semaphore, spin_us: float = 250.0,
                 idle_timeout: float = 1.0, on_client_error=None, on_crash=None):
        self.doorbell = doorbell
        self.spin_max = spin_us * 1e-6
        self.spin_min = min(2e-6, self.spin_max)
        self.spin_s = self.spin_max
        self.idle_since = 0.0  # when the last fruitless spin began
        self.idle_timeout = idle_timeout
        self.on_client_error = on_client_error or (lambda cid, exc: None)
        self.on_crash = on_crash or (lambda: None)
        self.tables: dict[int, Table] = {}
        self.by_name: dict[str, Table] = {}
        self.clients: dict[int, ClientState] = {}
        self.dropped: dict[int, ClientState] = {}  # cut off, awaiting unmap by the control plane
        self.parking = Parking()
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = False
        self.running = False  # True while the thread serves; guarded by lock
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self._doomed: list = []  # (client, error): cut off once the queues are walked
        self.stats = {"commands": 0, "wakeups": 0, "sleeps": 0, "disconnects": 0}
        # one handler per op; COMMIT runs are merged in _serve
        self._handlers = {R.RESERVE: self._on_draw, R.SAMPLE: self._on_draw, R.ABORT: self._on_abort,
                          R.RELEASE: self._on_release, R.UPDATE: self._on_update,
                          R.FLUSH: self._on_flush}

    # ---- any thread ----
    def start(self) -> None:
        self.running = True
        self.thread = threading.Thread(target=self._run, name="shmreplay-engine", daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if self.running:
                self.calls.put((fn, args, fut))
                self.doorbell.release()
                return fut
        # no engine thread (not started, stopped or crashed): the caller is
        # now the only one touching engine state, so run the call here
        self.calls.put((fn, args, fut))
        self._run_calls()
        return fut

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        self.doorbell.release()
        if self.thread is not None:
            self.thread.join(timeout)

    # ---- engine thread ----
    def _run(self) -> None:
        try:
            while not self.stopping:
                worked = self._run_calls()
                worked = self._serve_all() or worked
                if self.parking.count:
                    self.parking.settle(self.tables, self._settle, time.monotonic())
                    self._cut_off_doomed()
                if worked or self._spin():
                    continue
                self._sleep()
        except BaseException:  # the engine dying silently would hang every client
            log.exception("engine thread crashed; the daemon will exit")
            self.on_crash()
        finally:
            with self.lock:  # after this, submit() runs calls in the caller's thread
                self.running = False
                self._run_calls()

    def _run_calls(self) -> bool:
        ran = False
        while True:
            try:
                fn, args, fut = self.calls.get_nowait()
            except queue.Empty:
                return ran
            ran = True
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # handed to the caller, not swallowed
                fut.set_exception(exc)

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
                    self._respond(cl, R.error_reply(op, seq, exc))
                i += 1
            if end is not None:
                pay_end = end
        if n:
            ring.consume(n, pay_end)
            self.stats["commands"] += n
        self._flush(cl)
        return n > 0

    # ---- handlers: one per op (records.py says what each record holds) ----
    def _on_commit(self, cl: ClientState, run: R.CommitRun) -> None:
        try:
            self._table(run.table).commit(cl.id, run.rid, run.prios, offset=run.offset, n=run.n)
        except ProtocolError:
            raise
        except ReplayError as exc:
            self._respond(cl, R.error_reply(R.COMMIT, run.seq, exc))

    def _on_draw(self, cl, rec, pay, op, tid, seq) -> None:
        """RESERVE and SAMPLE: run now, or park behind the table's limits."""
        if op == R.RESERVE:
            (n, wait_us), beta = R.read_reserve(rec), 0.0
        else:
            n, wait_us, beta = R.read_sample(rec)
        table = self._table(tid)
        w = Waiter(cl, op, seq, n, beta, _deadline(wait_us))
        if self.parking.busy(tid, op):  # behind a parked one of its kind: keep the order
            self.parking.park(table, w)
            return
        try:
            self._run_waiter(table, w)
        except Blocked as b:
            if w.deadline <= time.monotonic():
                raise b.error from None
            self.parking.park(table, w)

    def _on_abort(self, cl, rec, pay, op, tid, seq) -> None:
        self._table(tid).abort(cl.id, R.read_abort(rec))

    def _on_release(self, cl, rec, pay, op, tid, seq) -> None:
        self._table(tid).release(cl.id, R.read_release(rec))

    def _on_update(self, cl, rec, pay, op, tid, seq) -> None:
        table = self._table(tid)
        table.update_priorities(*R.read_update(rec, pay))

    def _on_flush(self, cl, rec, pay, op, tid, seq) -> None:
        self._respond(cl, R.flush_reply(seq))

    def _run_waiter(self, table: Table, w: Waiter) -> None:
        """Run a RESERVE or SAMPLE and queue its reply; raises Blocked."""
        if w.op == R.RESERVE:
            rid, slots, contiguous = table.reserve(w.cl.id, w.n)
            self._respond(w.cl, R.reserve_reply(w.seq, rid, slots, contiguous))
        else:
            keys, probs, weights, hid = table.sample(w.cl.id, w.n, w.beta)
            self._respond(w.cl, R.sample_reply(w.seq, keys, probs, weights, hid))

    def _settle(self, table: Table, w: Waiter, now: float) -> bool:
        """Run a parked request, or answer it with its error once its
        deadline has passed.  False while it stays parked."""
        try:
            self._run_waiter(table, w)
        except Blocked as b:
            if w.deadline > now:
                return False
            table.stats["timeouts"] += 1
            self._reply_error(w, b.error)
            return True
        except ProtocolError as exc:  # its outbox is full: it stopped reading
            self._doomed.append((w.cl, exc))
            return True
        except ReplayError as exc:
            self._reply_error(w, exc)
            return True
        self._reply_error(w, None)
        return True

    def _reply_error(self, w: Waiter, exc: ReplayError | None) -> None:
        """Queue the error reply of a parked request (None: its reply is
        queued already) and publish.  A client that left its replies unread
        is cut off after the pass, so no queue changes while walked."""
        try:
            if exc is not None:
                self._respond(w.cl, R.error_reply(w.op, w.seq, exc))
            self._flush(w.cl)
        except ProtocolError as err:
            self._doomed.append((w.cl, err))

    def _cut_off_doomed(self) -> None:
        doomed, self._doomed = self._doomed, []
        for cl, exc in doomed:
            if cl.id in self.clients:
                self._cut_off(cl, exc)

    def _cut_off(self, cl: ClientState, exc: ProtocolError) -> None:
        log.warning("client %d (pid %d): %s; disconnecting it", cl.id, cl.pid, exc)
        self._drop(cl)
        self.on_client_error(cl.id, exc)

    def _table(self, table_id: int) -> Table:
        table = self.tables.get(table_id)
        if table is None:
            raise UnknownTable(f"no table with id {table_id} (dropped?)")
        return table

    # ---- the outbox ----
    def _respond(self, cl: ClientState, reply: R.Reply) -> None:
        cl.outbox.append(reply)
        if len(cl.outbox) > MAX_OUTBOX:
            raise ProtocolError(f"client left {MAX_OUTBOX} responses unread")

    def _flush(self, cl: ClientState) -> None:
        ring = cl.resp
        wrote = 0
        if ring.room() < 0:  # the client scribbled its tail
            raise ProtocolError("response ring tail moved to an impossible position")
        while cl.outbox:
            if not R.put_reply(ring, cl.outbox[0]):
                break
            cl.outbox.popleft()
            wrote += 1
        if wrote and ring.publish():
            cl.sem.release()

    # ---- idling ----
    def _spin(self) -> bool:
        """Re-check the rings for up to the current spin budget.

        The budget follows the gaps between commands: after a wait, it is set
        to twice the gap if that fits under ``spin_us`` (commands come back to
        back: spinning saves a ~35 us wake-up), else to the 2 us minimum (a
        trickle: spinning would be pure cost, e.g. 1,000 inserts/s)."""
        if not self.clients or self.spin_max <= 0:
            return False
        start = time.perf_counter()
        deadline = start + self.spin_s
        rings = [cl.req for cl in self.clients.values()]
        while True:
            now = time.perf_counter()
            for r in rings:
                if r.has_pending():  # never raises: errors surface in _serve_all
                    self._learn_gap(now - start)
                    return True
            if not self.calls.empty():
                return True
            if now >= deadline:
                self.idle_since = start
                return False

    def _learn_gap(self, gap: float) -> None:
        self.spin_s = min(self.spin_max, 2 * gap) if gap < self.spin_max else self.spin_min
        self.spin_s = max(self.spin_min, self.spin_s)

    def _sleep(self) -> None:
        rings = [cl.req for cl in self.clients.values()]
        try:
            if any([r.set_sleeping() for r in rings]) or not self.calls.empty():
                return
            self.stats["sleeps"] += 1
            timeout = self.idle_timeout
            deadline = self.parking.next_deadline()
            if deadline is not None:
                timeout = max(0.0, min(timeout, deadline - time.monotonic()))
            try:
                self.doorbell.acquire(timeout)
                self.stats["wakeups"] += 1
                self._learn_gap(time.perf_counter() - self.idle_since)
            except posix_ipc.BusyError:
                pass
        finally:
            for r in rings:
                r.clear_sleeping()

    # ---- entry points the control plane submits ----
    @entry_point
    def add_table(self, table: Table) -> None:
        self.tables[table.id] = table
        self.by_name[table.spec.name] = table
        self.parking.add_table(table.id)

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
    def describe_table(self, name: str) -> dict | None:
        t = self.by_name.get(name)
        return t.describe() if t is not None else None

    @entry_point
    def describe_tables(self) -> list[dict]:
        return [t.describe() for t in self.tables.values()]

    @entry_point
    def drop_table(self, name: str) -> Table:
        t = self.table_named(name)
        for w in self.parking.drop_table(t.id):
            self._reply_error(w, UnknownTable(f"table {name!r} was dropped"))
        self._cut_off_doomed()
        del self.by_name[name]
        del self.tables[t.id]
        return t

    @entry_point
    def add_client(self, cl: ClientState) -> None:
        self.clients[cl.id] = cl

    @entry_point
    def detach_client(self, cid: int) -> ClientState | None:
        """The client's lease ended: apply what its ring still holds, then
        reclaim its reservations.  Returns its state for the caller to unmap."""
        cl = self.clients.get(cid)
        if cl is not None:
            try:
                while self._serve(cl, limit=cl.req.slots):
                    pass
            except ProtocolError as exc:
                log.warning("client %d: %s while draining its ring", cid, exc)
            self._drop(cl)
        return self.dropped.pop(cid, None)

    def _drop(self, cl: ClientState) -> None:
        if self.clients.pop(cl.id, None) is None:
            return
        self.dropped[cl.id] = cl
        cl.outbox.clear()
        self.parking.unpark_client(cl)
        self.stats["disconnects"] += 1
        reclaimed = sum(t.release_owner(cl.id) for t in self.tables.values())
        if reclaimed:
            log.info("client %d (pid %d): reclaimed %d reserved slots", cl.id, cl.pid, reclaimed)

    @entry_point
    def snapshot(self) -> dict:
        tables = {}
        for t in self.tables.values():
            st = t.snapshot_stats()
            st["limiter"]["waiting_inserts"], st["limiter"]["waiting_samples"] = \
                self.parking.waiting(t.id)
            tables[t.spec.name] = st
        return {"engine": {**self.stats, "parked": self.parking.total}, "clients": len(self.clients),
                "tables": tables}


def _deadline(timeout_us: int) -> float:
    if timeout_us >= R.FOREVER:
        return float("inf")
    return time.monotonic() + timeout_us * 1e-6
