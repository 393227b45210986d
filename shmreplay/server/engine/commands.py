"""Applying a client's commands: each record of its request ring decoded
(``wire.records`` says what it holds), applied to its table, and its reply
built and queued in the client's outbox.

One handler per op.  A run of COMMIT records that continue one
reservation is applied as one commit (``records.read_commit_run``).
RESERVE and SAMPLE run at once, or park behind the table's limits
(``parking.py``) when the table raises ``Blocked`` and the request may
still wait; later requests of the same kind on that table queue behind a
parked one, so a large batch is not starved by small ones.  Parked
requests are retried after every pass (``settle``), and every reply,
including the error of one whose wait ran out, is built here.  A
reservation or a draw of a file-backed table also tells the prefetcher
which rows its client will touch next.

Errors: a ``ReplayError`` is that command's error reply; a
``ProtocolError`` (a record that breaks a rule, an outbox left unread) is
raised to the engine, which cuts that client off alone.

Engine thread only.
"""

from __future__ import annotations

import logging
import time

from ...errors import PermissionDenied, ProtocolError, ReplayError, UnknownTable
from ...wire import framerecords as FR
from ...wire import records as R
from ..tables.counters import Blocked
from ..tables.table import reclaim_frames
from .outbox import ClientState
from .parking import Parking, Waiter

log = logging.getLogger("shmreplayd.engine")

USES_WRITE, USES_SAMPLE = 1, 2  # ClientState.uses: what a client did with a table
HIST_BUCKETS = 24               # SAMPLE times up to 1.024 us * 2**22 (4.3 s), then "more"


class Commands:
    def __init__(self, tables: dict, prefetch=None):
        self.tables = tables      # the engine's: table id -> Table
        self.prefetch = prefetch  # disk.prefetch.Prefetcher, or None: told which rows come next
        self.parking = Parking()
        self.count = 0            # records applied
        self.draws = 0            # SAMPLE requests answered with items
        self.wide_draws = 0       # those whose client gathers on every CPU (records.WIDE)
        # per table id: the engine's time per SAMPLE, a log2 histogram of
        # microseconds (bucket k: < 1.024 us * 2**k) and the sum in ns, for
        # the metrics (control/metrics.py): two clock reads per SAMPLE
        self.sample_hist: dict[int, list] = {}
        self._handlers = {R.RESERVE: self._on_draw, R.SAMPLE: self._on_draw, R.ABORT: self._on_abort,
                          R.RELEASE: self._on_release, R.UPDATE: self._on_update, R.FLUSH: self._on_flush,
                          FR.FRAMES: self._on_frames, FR.FRAMES_BACK: self._on_frames_back,
                          FR.FCOMMIT: self._on_fcommit}

    def serve(self, cl: ClientState, limit: int) -> int:
        """Apply up to ``limit`` records of ``cl``'s ring and publish the
        replies; returns how many.  Raises ProtocolError to cut it off."""
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
            self.count += n
        cl.flush()
        return n

    def table(self, table_id: int):
        table = self.tables.get(table_id)
        if table is None:
            raise UnknownTable(f"no table with id {table_id} (dropped?)")
        return table

    # ---- handlers: one per op ----
    def _on_commit(self, cl: ClientState, run: R.CommitRun) -> None:
        try:
            self.table(run.table).commit(cl.id, run.rid, run.prios, offset=run.offset, n=run.n)
        except ProtocolError:
            raise
        except ReplayError as exc:
            cl.respond(R.error_reply(R.COMMIT, run.seq, exc))

    def _on_draw(self, cl, rec, pay, op, tid, seq) -> None:
        """RESERVE and SAMPLE: run now, or park behind the table's limits."""
        if op == R.RESERVE:
            (n, wait_us), beta, protect, wide = R.read_reserve(rec), 0.0, False, False
        else:
            n, wait_us, beta, protect, wide = R.read_sample(rec)
        table = self.table(tid)
        if op == R.RESERVE:
            _may_write(cl, table)
        else:
            cl.samples = True
        cl.uses[tid] = cl.uses.get(tid, 0) | (USES_WRITE if op == R.RESERVE else USES_SAMPLE)
        w = Waiter(cl, op, seq, n, beta, _deadline(wait_us), protect, wide)
        if self.parking.queued(tid, op):  # keep the order behind a parked one
            self.parking.park(table, w)
            return
        try:
            self.run(table, w)
        except Blocked as b:
            if w.deadline <= time.monotonic():
                raise b.error from None
            self.parking.park(table, w)

    def _on_abort(self, cl, rec, pay, op, tid, seq) -> None:
        self.table(tid).abort(cl.id, R.read_abort(rec))

    def _on_release(self, cl, rec, pay, op, tid, seq) -> None:
        self.table(tid).release(cl.id, R.read_release(rec))

    def _on_update(self, cl, rec, pay, op, tid, seq) -> None:
        table = self.table(tid)
        _may_write(cl, table)
        table.update_priorities(*R.read_update(rec, pay))

    def _on_flush(self, cl, rec, pay, op, tid, seq) -> None:  # every earlier record is applied
        cl.respond(R.flush_reply(seq))

    # ---- a frame table's records (wire/framerecords.py, docs/frames.md) ----
    def _on_frames(self, cl, rec, pay, op, tid, seq) -> None:
        """A frame lease: what is free, after the table freed what it could
        for it (``reclaim_frames``); none free is lease id 0."""
        ring, n = FR.read_frames(rec)
        table = self._frame_table(tid)
        _may_write(cl, table)
        cl.uses[tid] = cl.uses.get(tid, 0) | USES_WRITE
        lid, frames = table.frames.lease(cl.id, ring, n, lambda short: reclaim_frames(table, short))
        cl.respond(FR.frames_reply(seq, lid, frames))

    def _on_frames_back(self, cl, rec, pay, op, tid, seq) -> None:
        self._frame_table(tid).frames.give_back(cl.id, FR.read_frames_back(rec))

    def _on_fcommit(self, cl, rec, pay, op, tid, seq) -> None:
        table = self._frame_table(tid)
        rid, n, offset, prios, refs = FR.read_fcommit(rec, pay, table.frames.refs_per_item)
        table.commit(cl.id, rid, prios, offset=offset, n=n, refs=refs)

    def _frame_table(self, tid: int):
        table = self.table(tid)
        if table.frames is None:  # a client sends these only to a frame table
            raise ProtocolError(f"a frame record for table {table.spec.name!r}, which stores rows")
        return table

    # ---- draws, now or parked ----
    def run(self, table, w: Waiter) -> None:
        """Run a RESERVE or SAMPLE and queue its reply; raises Blocked.  Then
        the prefetcher learns which rows the client will touch next: a
        writer the reserved slots', a learner the drawn ones'."""
        if w.op == R.RESERVE:
            rid, slots, contiguous = table.reserve(w.cl.id, w.n, w.cl.pid, w.cl.start, w.cl.user)
            w.cl.respond(R.reserve_reply(w.seq, rid, slots, contiguous))
            keys = None
        else:
            t0 = time.perf_counter_ns()
            keys, probs, weights, hid = table.sample(w.cl.id, w.n, w.beta, w.protect, w.cl.user)
            dt = time.perf_counter_ns() - t0
            hist = self.sample_hist.get(table.id)
            if hist is None:
                hist = self.sample_hist[table.id] = [0] * (HIST_BUCKETS + 1)  # the last: the sum
            hist[min(HIST_BUCKETS - 1, (dt >> 10).bit_length())] += 1
            hist[HIST_BUCKETS] += dt
            w.cl.respond(R.sample_reply(w.seq, keys, probs, weights, hid))
            self.draws += 1
            self.wide_draws += w.wide
            slots = None
        if self.prefetch is not None:
            self.prefetch.read(table.id, slots, keys)

    def settle(self, now: float) -> list:
        """Retry the parked requests and answer those that ended.  Returns
        the clients to cut off, as (client, ProtocolError)."""
        return self.answer(self.parking.settle(self.tables, now, self.run))

    def answer(self, ended: list) -> list:
        """Answer parked requests that ended, ``(waiter, None)`` when it ran
        (its reply is queued) or ``(waiter, error)``, and publish.  Returns
        the clients to cut off: a client that left its replies unread, or
        whose request reached a bug."""
        doomed = []
        for w, exc in ended:
            try:
                if isinstance(exc, ReplayError) and not isinstance(exc, ProtocolError):
                    w.cl.respond(R.error_reply(w.op, w.seq, exc))
                elif exc is not None:
                    raise _as_protocol_error(w, exc)
                w.cl.flush()
            except ProtocolError as err:
                doomed.append((w.cl, err))
        return doomed

    def drop_table(self, table_id: int, name: str) -> list:
        """A table goes: its parked requests are answered UnknownTable.
        Returns the clients to cut off."""
        gone = UnknownTable(f"table {name!r} was dropped")
        return self.answer([(w, gone) for w in self.parking.drop_table(table_id)])


def _may_write(cl: ClientState, table) -> None:
    """A table whose definition says ``writers="creator"`` takes RESERVEs
    (so commits) and priority updates only from its writer's uid and the
    daemon's admins (``cl.user`` None: root, the daemon's user, the admin
    group); an ordinary table pays one attribute look."""
    uid = table.spec.writer_uid
    if uid is not None and cl.user is not None and cl.user != uid:
        raise PermissionDenied(
            f"table {table.spec.name!r} is written only by its creator (uid {uid}) and the daemon's "
            f"admins (writers=\"creator\"); you are uid {cl.user}: read it, or write your own table")


def _as_protocol_error(w: Waiter, exc: BaseException) -> ProtocolError:
    if isinstance(exc, ProtocolError):  # its outbox is full: it stopped reading
        return exc
    # a bug this request reached: it costs its client, not the engine
    log.error("client %d (pid %d): parked request failed", w.cl.id, w.cl.pid, exc_info=exc)
    return ProtocolError(f"daemon could not apply a command: {exc!r}")


def _deadline(timeout_us: int) -> float:
    if timeout_us >= R.FOREVER:
        return float("inf")
    return time.monotonic() + timeout_us * 1e-6
