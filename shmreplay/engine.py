"""The daemon's data plane: one thread that owns every table and channel.

All table state is touched by this thread only, so tables need no locks.
The control plane (asyncio thread) reaches it in two ways:

* ``submit(fn, *args)`` queues a call to run on the engine thread between
  bursts and returns a ``concurrent.futures.Future`` (table create/drop,
  client attach/detach, stats);
* it rings the doorbell semaphore so a sleeping engine notices the call.

Loop: run queued calls; serve every channel (up to BURST records each, for
fairness, then one publish of the responses); if nothing was found, spin for
``spin_us`` re-checking the ring heads, then announce sleep in every channel
and wait on the doorbell (clients post it when they see the announcement).
An idle engine therefore sleeps in ``sem_wait`` and uses no CPU.

Parked requests.  A RESERVE or SAMPLE that a table's limits hold back
(``table.Blocked``) waits in that table's queue, oldest first per kind,
instead of holding up the loop; after every pass that did work the queues
are retried, and a request still blocked at its deadline is answered with
the error the table gave.  A sleeping engine wakes for the earliest
deadline.  Later requests of the same kind on that table queue behind a
parked one, so a large batch is not starved by small ones.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time

import numpy as np
import posix_ipc

from . import commands as C
from .channel import Channel
from .errors import CapacityError, ProtocolError, ReplayError, UnknownTable
from .table import Blocked, Table

log = logging.getLogger("shmreplayd.engine")

BURST = 64
MAX_OUTBOX = 1024  # responses a client may leave unread before it is cut off


class ClientState:
    def __init__(self, cid: int, pid: int, channel: Channel, sem: posix_ipc.Semaphore):
        self.id = cid
        self.pid = pid
        self.channel = channel
        self.req = channel.requests
        self.resp = channel.responses
        self.sem = sem
        self.outbox: collections.deque = collections.deque()


class Waiter:
    """A parked RESERVE or SAMPLE."""

    __slots__ = ("cl", "op", "seq", "n", "beta", "deadline")

    def __init__(self, cl: ClientState, op: int, seq: int, n: int, beta: float, deadline: float):
        self.cl, self.op, self.seq, self.n, self.beta, self.deadline = cl, op, seq, n, beta, deadline


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
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.stopping = False
        self.running = False  # True while the thread serves; guarded by lock
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self.parked = 0  # requests waiting in tables' queues
        self._doomed: list = []  # (client, error): cut off once the queues are walked
        self.stats = {"commands": 0, "wakeups": 0, "sleeps": 0, "disconnects": 0, "parked": 0}

    # ---- control-plane entry points (any thread) ----
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
                if self.parked:
                    self._serve_waiters()
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
                log.warning("client %d (pid %d): %s; disconnecting it", cl.id, cl.pid, exc)
                self._drop(cl)
                self.on_client_error(cl.id, exc)
            except Exception as exc:  # a bug one client's input reached: cut off that client only
                log.exception("client %d (pid %d): unexpected error; disconnecting it", cl.id, cl.pid)
                self._drop(cl)
                self.on_client_error(cl.id, ProtocolError(f"daemon could not apply a command: {exc!r}"))
        return worked

    def _serve(self, cl: ClientState, limit: int = BURST) -> bool:
        n = min(cl.req.pending(), limit)
        pay_end = None
        i = 0
        while i < n:
            rec = cl.req.peek(i)
            if int(rec["op"]) == C.COMMIT:
                i, end = self._commit_run(cl, i, n)
            else:
                end = self._handle(cl, rec)
                i += 1
            if end is not None:
                pay_end = end
        if n:
            cl.req.consume(n, pay_end)
            self.stats["commands"] += n
        self._flush(cl)
        return n > 0

    def _handle(self, cl: ClientState, rec) -> int | None:
        """Apply one request; returns the end of its payload (or None)."""
        op, seq = int(rec["op"]), int(rec["seq"])
        pay = cl.req.payload_of(rec)   # bounds-checked; ProtocolError disconnects
        end = cl.req.payload_end(rec)
        if op not in C.NAMES:
            raise ProtocolError(f"unknown command op {op} in the request ring")
        try:
            if op == C.FLUSH:
                self._respond(cl, op, seq)
                return end
            table = self._table(int(rec["table"]))
            if op in (C.RESERVE, C.SAMPLE):
                n = _count(rec["a0"], C.NAMES[op])
                w = Waiter(cl, op, seq, n, float(rec["f0"]), _deadline(int(rec["a1"])))
                queue_ = table.waiting_inserts if op == C.RESERVE else table.waiting_samples
                if queue_:  # behind a parked one of its kind: keep the order
                    self._park(table, queue_, w)
                else:
                    try:
                        self._run_waiter(table, w)
                    except Blocked as b:
                        if w.deadline <= time.monotonic():
                            raise b.error from None
                        self._park(table, queue_, w)
            elif op == C.ABORT:
                table.abort(cl.id, int(rec["a0"]))
            elif op == C.RELEASE:
                table.release(cl.id, int(rec["a0"]))
            elif op == C.UPDATE:
                n = _count(rec["a0"], "UPDATE")
                if pay.shape[0] != 16 * n:
                    raise ProtocolError(f"UPDATE of {n} keys carries {pay.shape[0]} payload bytes")
                keys = pay[:8 * n].view(np.uint64)
                table.update_priorities(keys, pay[8 * n:].view(np.float64))
        except ProtocolError:
            raise
        except ReplayError as exc:
            self._respond_error(cl, op, seq, exc)
        return end

    # ---- parked requests ----
    def _run_waiter(self, table: Table, w: Waiter) -> None:
        """Run a RESERVE or SAMPLE and queue its reply; raises Blocked."""
        if w.op == C.RESERVE:
            rid, slots, contiguous = table.reserve(w.cl.id, w.n)
            self._respond(w.cl, w.op, w.seq, a0=rid, a1=int(contiguous), a2=slots.shape[0],
                          payload=(slots.astype(np.uint32),))
        else:
            keys, probs, weights, hid = table.sample(w.cl.id, w.n, w.beta)
            self._respond(w.cl, w.op, w.seq, a0=w.n, a1=hid, payload=(keys, probs, weights))

    def _park(self, table: Table, queue_, w: Waiter) -> None:
        queue_.append(w)
        self.parked += 1
        self.stats["parked"] += 1
        table.stats["insert_waits" if w.op == C.RESERVE else "sample_waits"] += 1

    def _serve_waiters(self) -> None:
        """Retry parked requests, oldest first per queue, and answer those
        whose deadline passed with the error that still holds them (also
        behind a head that stays blocked).  Queues change only here."""
        now = time.monotonic()
        for table in self.tables.values():
            for queue_ in (table.waiting_inserts, table.waiting_samples):
                while queue_ and self._settle(table, queue_[0], now):
                    queue_.popleft()
                    self.parked -= 1
                if any(w.deadline <= now for w in queue_):
                    keep = [w for w in queue_ if not (w.deadline <= now and self._settle(table, w, now))]
                    self.parked -= len(queue_) - len(keep)
                    queue_.clear()
                    queue_.extend(keep)
        self._cut_off_doomed()

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
                self._respond_error(w.cl, w.op, w.seq, exc)
            self._flush(w.cl)
        except ProtocolError as err:
            self._doomed.append((w.cl, err))

    def _cut_off_doomed(self) -> None:
        doomed, self._doomed = self._doomed, []
        for cl, exc in doomed:
            if cl.id in self.clients:
                log.warning("client %d (pid %d): %s; disconnecting it", cl.id, cl.pid, exc)
                self._drop(cl)
                self.on_client_error(cl.id, exc)

    def _unpark(self, pred) -> list[Waiter]:
        """Take every parked request matching ``pred(table, waiter)`` out of its queue."""
        out = []
        for table in self.tables.values():
            for queue_ in (table.waiting_inserts, table.waiting_samples):
                gone = [w for w in queue_ if pred(table, w)]
                if gone:
                    out.extend(gone)
                    keep = [w for w in queue_ if w not in gone]
                    queue_.clear()
                    queue_.extend(keep)
        self.parked -= len(out)
        return out

    def next_deadline(self) -> float | None:
        if not self.parked:
            return None
        return min((w.deadline for t in self.tables.values()
                    for q in (t.waiting_inserts, t.waiting_samples) for w in q), default=None)

    def _commit_run(self, cl: ClientState, i: int, n: int) -> tuple[int, int | None]:
        """Apply COMMIT records i.. that continue one lease as one commit.

        A writer streams a COMMIT per insert call; the parts of one lease
        arrive back to back, and one table update for all of them costs
        about what one part costs.  Returns (next record, payload end)."""
        ring = cl.req
        first = ring.peek(i)
        table_id, rid, offset = int(first["table"]), int(first["a0"]), int(first["a2"])
        with_prios = int(first["pay_len"]) > 0
        total, parts, end, j = 0, [], None, i
        while j < n:
            rec = ring.peek(j)
            if j > i and (int(rec["op"]) != C.COMMIT or int(rec["table"]) != table_id
                          or int(rec["a0"]) != rid or int(rec["a2"]) != offset + total
                          or (int(rec["pay_len"]) > 0) != with_prios):
                break
            k = _count(rec["a1"], "COMMIT")
            pay = ring.payload_of(rec)
            if with_prios:
                parts.append(_f64(pay, k, "COMMIT"))
                end = ring.payload_end(rec)
            total += k
            j += 1
        prios = (parts[0] if len(parts) == 1 else np.concatenate(parts)) if with_prios else None
        try:
            self._table(table_id).commit(cl.id, rid, prios, offset=offset, n=total)
        except ProtocolError:
            raise
        except ReplayError as exc:
            self._respond_error(cl, C.COMMIT, int(first["seq"]), exc)
        return j, end

    def _table(self, table_id: int) -> Table:
        table = self.tables.get(table_id)
        if table is None:
            raise UnknownTable(f"no table with id {table_id} (dropped?)")
        return table

    def _respond_error(self, cl: ClientState, op: int, seq: int, exc: ReplayError) -> None:
        self._respond(cl, op, seq, status=exc.code, payload=(str(exc).encode(),))

    def _respond(self, cl: ClientState, op: int, seq: int, status: int = 0,
                 a0: int = 0, a1: int = 0, a2: int = 0, payload=()) -> None:
        cl.outbox.append((op, seq, status, a0, a1, a2, payload))
        if len(cl.outbox) > MAX_OUTBOX:
            raise ProtocolError(f"client left {MAX_OUTBOX} responses unread")

    def _flush(self, cl: ClientState) -> None:
        ring = cl.resp
        wrote = 0
        if ring.room() < 0:  # the client scribbled its tail
            raise ProtocolError("response ring tail moved to an impossible position")
        while cl.outbox:
            op, seq, status, a0, a1, a2, payload = cl.outbox[0]
            if not ring.try_put(payload, op, 0, seq, a0, a1, a2, 0.0, status):
                break
            cl.outbox.popleft()
            wrote += 1
        if wrote and ring.publish():
            cl.sem.release()

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
            deadline = self.next_deadline()
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

    # ---- calls the control plane submits (run on this thread) ----
    def add_table(self, table: Table) -> None:
        self.tables[table.id] = table
        self.by_name[table.spec.name] = table

    def table_named(self, name: str) -> Table:
        t = self.by_name.get(name)
        if t is None:
            raise UnknownTable(f"no table named {name!r}")
        return t

    def find_table(self, name: str) -> dict | None:
        t = self.by_name.get(name)
        return t.describe() if t is not None else None

    def drop_table(self, name: str) -> Table:
        t = self.table_named(name)
        for w in self._unpark(lambda table, w: table is t):
            self._reply_error(w, UnknownTable(f"table {name!r} was dropped"))
        self._cut_off_doomed()
        del self.by_name[name]
        del self.tables[t.id]
        return t

    def add_client(self, cl: ClientState) -> None:
        self.clients[cl.id] = cl

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
        self._unpark(lambda table, w: w.cl is cl)
        self.stats["disconnects"] += 1
        reclaimed = sum(t.release_owner(cl.id) for t in self.tables.values())
        if reclaimed:
            log.info("client %d (pid %d): reclaimed %d reserved slots", cl.id, cl.pid, reclaimed)

    def snapshot(self) -> dict:
        return {
            "engine": dict(self.stats),
            "clients": len(self.clients),
            "tables": {t.spec.name: t.snapshot_stats() for t in self.tables.values()},
        }


def _deadline(timeout_us: int) -> float:
    if timeout_us >= C.FOREVER:
        return float("inf")
    return time.monotonic() + timeout_us * 1e-6


def _count(value, what: str) -> int:
    n = int(value)
    if not 1 <= n <= C.MAX_BATCH:
        raise CapacityError(f"{what} of {n} items: allowed 1..{C.MAX_BATCH}")
    return n


def _f64(pay: np.ndarray, n: int, what: str) -> np.ndarray:
    if pay.shape[0] != 8 * n:
        raise ProtocolError(f"{what} of {n} items carries {pay.shape[0]} payload bytes")
    return pay.view(np.float64)
