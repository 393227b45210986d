"""A writer's slot lease: slots reserved ahead, handed out in order, committed in order.

Every way of inserting goes through one: ``Table.insert``/``insert_batch``
use the table handle's own lease, each ``SequenceWriter``/``NStepWriter``
has one of its own (its items stay open across calls).  A lease

* reserves slots from the daemon, ``size`` at a time (capacity/256), and
  asks for the next reservation at half time, so inserts need no round
  trip (``size`` 0: reserve exactly what each call needs, as rate-limited
  tables do, so the limiter counts an insert when it starts);
* hands slots out in reservation order, and commits them in that order
  (the daemon refuses a commit out of order);
* checks the table's epoch before every copy into a slot: a restarted
  daemon bumps it, and the slots leased from the dead one are void;
* is voided when its client reconnects or forks (no reservation id of the
  old connection is ever sent again): its writer is told (``renewed``), and
  slots it had handed out and not committed count as possibly lost, so the
  next ``flush()`` says so;
* hands back unused slots on ``release`` (the table's lease at ``flush()``,
  a writer's at its ``close()``);
* raises the client's deferred errors (``begin``).

A lease is built from what it uses, never from the table handle: the
client's session (``session.Session``: the command pipe now, ``max_batch``,
the ``dirty`` mark, and ``begin``/``check_fork``/``recover``) and the
table's priority check; its table handle makes it (``Table.lease``) and
binds it to the table as mapped now (``bind``: the daemon's id for the
table, the field views, the counters whose epoch it checks, kept by a
``binding.LeaseBinding``), again after every reconnect, and voids it
(``void``) when the connection goes.  The lease itself owns the
reservation state: the current and next reservation, the slots handed out.

Who calls it: its table handle (``bind``, ``void``, ``resize``; ``write`` for
``insert``/``insert_batch``; ``release`` at the client's flush) and its
writer (``begin``, ``check``, ``take``, ``commit``, ``release``, ``run``,
``views``, ``renewed``).  Same threading rule as the table handle: one
thread at a time, the client's.
"""

from __future__ import annotations

from os import getpid

from ..errors import CapacityError, DaemonUnavailable, RateLimited, ReplayError
from ..wire import records as R
from ..wire.framerecords import put_fcommit
from ..wire.channel import LAZY_MAX
from .addone import RING_FULL
from .binding import LeaseBinding
from .pipe import in_slices


class SlotLease:
    """Slots of one table reserved for one writer (see the module docstring)."""

    def __init__(self, size: int, table_name: str, session, priorities):
        """``session``: the client's ``session.Session``; ``priorities(values,
        n, what)``: the table's priority check (``Table._priorities``)."""
        self.size = size
        self.cur: list | None = None    # [rid, slots, next position, contiguous]
        self.ahead: int | None = None   # seq of a RESERVE sent for the next reservation
        self.taken = 0                  # slots handed to a writer, not committed or abandoned
        self.renewed = False            # voided since the writer last looked
        self._session = session
        self._priorities = priorities
        self._at = LeaseBinding(table_name)  # the table as mapped now (bind)

    # ---- state ----
    def bind(self, table_id: int, views: dict, view_list: list, words, epoch: int) -> None:
        """The table as mapped now (called by its handle, again after a
        reconnect): the daemon's id for it, its field views (a dict, and a
        list in field order), and its counters with the epoch they must
        still show for this lease's slots to be ours (``binding.py``)."""
        self._at.bind(table_id, views, view_list, words, epoch)

    @property
    def views(self) -> dict:
        """The table's field arrays, as mapped now (a writer copies its items into them)."""
        return self._at.views

    def begin(self) -> None:
        """Prologue of a writer's call: fork check, deferred errors."""
        self._session.begin()

    def check(self) -> None:
        """Before a copy into leased slots: are they still ours?"""
        self._at.check()

    def resize(self, size: int) -> int:
        """Reserve ``size`` slots at a time from the next reservation on
        (its table handle bounds it: ``Table.widen_lease``); returns it."""
        self.size = size
        return size

    def void(self) -> bool:
        """The connection these slots were reserved on is gone (reconnect,
        fork).  Returns True if slots were handed out and not committed."""
        lost = self.taken > 0
        self.cur = self.ahead = None
        self.taken = 0
        self.renewed = True
        return lost

    def run(self, fn, *args):
        """Run a writer's call; if the daemon went away during it and the
        client reconnects, reconnect (voiding this lease) and run it again."""
        try:
            return fn(*args)
        except DaemonUnavailable:
            if not self._session.recover():
                raise
            return fn(*args)

    # ---- reserving ----
    def _reserve(self, n: int, deadline: float | None) -> list:
        pipe = self._session.pipe
        table_id = self._at.table_id
        got = None
        if self.ahead is not None:
            seq, self.ahead = self.ahead, None
            try:
                got = pipe.wait(seq, R.read_reserve_reply, 0.0)
            except (RateLimited, CapacityError):
                pass  # no room (or at its cap) when it was asked: ask again, waiting as this call may
        if got is None:
            def attempt(w):
                return pipe.wait(pipe.send(R.put_reserve, table_id, n, R.timeout_us(w)),
                                 R.read_reserve_reply, w)
            got = in_slices(deadline, attempt)
        rid, contiguous, slots = got
        self.cur = [rid, slots, 0, contiguous]
        return self.cur

    def _ask_ahead(self, n: int, used: int | None = None) -> None:
        """Ask for the next reservation at half time, so its reply is there
        when needed (``used``: the current reservation's slots used once the
        rows being copied are in, None: as now).  It may not wait in the daemon: the call that will use
        it has a timeout of its own, which the daemon does not know yet.
        (``leasing.writer_reserved`` counts what this rule keeps reserved.)"""
        cur = self.cur
        if (self.ahead is None and 0 < n <= self.size
                and cur[1].shape[0] - (cur[2] if used is None else used) < max(n, self.size // 2)):
            pipe = self._session.pipe
            # it wakes a sleeping daemon (one wake-up a lease, not an insert):
            # left lazy, its reply was not ready when the lease ran out, and
            # every lease waited for a wake-up (dqn-atari insert64: 142k
            # against 189k items/s); but single inserts whose lease outlasts
            # the pipe's forced bell (LAZY_MAX records) leave it lazy: read at
            # that bell or at the next sample, a wake-up a lease saved
            # (docs/performance.md, "The ask-ahead RESERVE rides...")
            left = cur[1].shape[0] - (cur[2] if used is None else used)
            lazy = n == 1 and left > LAZY_MAX - pipe.unannounced + 1
            self.ahead = pipe.send(R.put_reserve, self._at.table_id, self.size, R.timeout_us(0.0),
                                   wake=not lazy)
            pipe.expect(self.ahead)

    # ---- inserts: copy and commit in one call ----
    def write(self, arrays: list, n: int, prios, single: bool, deadline: float | None) -> None:
        """Copy n rows (``arrays`` in field order; ``single``: one item,
        unbatched) into leased slots and commit them with ``prios``."""
        self.check()
        session = self._session
        table_id = self._at.table_id
        views = self._at.view_list
        lo = 0
        while lo < n:
            cur = self.cur
            if cur is None or cur[2] == cur[1].shape[0]:
                cur = self._reserve(min(max(n - lo, self.size), session.max_batch), deadline)
                self.check()
            rid, slots, pos, contiguous = cur
            k = min(n - lo, slots.shape[0] - pos)
            whole = lo == 0 and k == n  # the usual case: no need to slice the input
            if lo + k == n:  # the call's last part (every call has one)
                # asked before the copy, the daemon reserves while the rows go
                # in: a writer whose calls use up a lease each (a small table's
                # 16 slots, 16 rows a call) found the reply not yet there
                self._ask_ahead(n, pos + k)
            try:
                if single or contiguous:
                    s0 = int(slots[pos])
                    for view, a in zip(views, arrays):
                        if single:
                            view[s0] = a
                        else:
                            view[s0:s0 + k] = a if whole else a[lo:lo + k]
                else:
                    part = slots[pos:pos + k]
                    for view, a in zip(views, arrays):
                        view[part] = a if whole else a[lo:lo + k]
            except BaseException:
                self.release()  # the rows of this part may be half written
                raise
            cur[2] = pos + k
            session.dirty = True
            session.pipe.send(R.put_commit, table_id, rid, k, pos,
                              None if prios is None else (prios if whole else prios[lo:lo + k]), wake=False)
            lo += k

    def write_one(self, values: list, deadline: float | None) -> None:
        """``write(values, 1, None, True, deadline)``: one item with the
        largest priority, the call a step-by-step actor makes per env step
        (an SB3-style ``add``).  While the reservation has a slot it skips
        ``write``'s loop over parts, and its COMMIT is one kernel call
        (``CommandPipe.commit_one``): 31 -> ~17 us a CartPole item."""
        cur = self.cur
        if cur is None or cur[2] == cur[1].shape[0] or not self._at.current():
            return self.write(values, 1, None, True, deadline)  # reserves; raises on a dead epoch
        rid, slots, pos, _ = cur
        if self.ahead is None and slots.shape[0] - pos <= self.size // 2 + 1:
            self._ask_ahead(1, pos + 1)  # before the copy, as ``write`` does (it tests again)
        s0 = slots.item(pos)
        try:
            for view, v in zip(self._at.view_list, values):
                view[s0] = v
        except BaseException:
            self.release()  # the row may be half written
            raise
        cur[2] = pos + 1
        session = self._session
        session.dirty = True
        session.pipe.commit_one(self._at.table_id, rid, pos)

    def add_one(self, values: tuple) -> bool:
        """``write_one`` without its row check or the session's prologue,
        for values in field order: one kernel checks, stores and commits
        (``addone.OneAdd``).  False with nothing written where that cannot
        be (no slot left in the reservation, the epoch moved, a fork, a
        deferred error, a value of a type or shape the kernel does not
        take): the caller then checks the row and takes ``write_one``,
        which handles each."""
        cur = self.cur
        session = self._session
        pipe = session.pipe
        if (cur is None or pipe is None or pipe.deferred is not None or session.pid != getpid()
                or session.closed):
            return False
        rid, slots, pos, _ = cur
        if self.ahead is None and slots.shape[0] - pos <= self.size // 2 + 1:
            if pos >= slots.shape[0] or not self._at.current():
                return False  # ``write`` reserves, or raises for a lease a restarted daemon voided
            self._ask_ahead(1, pos + 1)  # before the copy, as ``write`` does (the kernel
            # refuses a used-up reservation or a moved epoch whatever the branch)
        at = self._at
        got = at.one.add(pipe, at.table_id, rid, slots, pos, values, at.epoch)
        if got < RING_FULL:
            return False
        cur[2] = pos + 1  # the slot is written (and its COMMIT out, or owed): never again
        session.dirty = True
        pipe.row_added(got, at.table_id, rid, pos)
        return True

    # ---- writers: items that stay open across calls ----
    def take(self, deadline: float | None) -> tuple[int, int, int]:
        """The next slot for an item: (reservation id, position, slot).
        Commit items in the order they were taken."""
        cur = self.cur
        if cur is None or cur[2] == cur[1].shape[0]:
            cur = self._reserve(max(1, self.size), deadline)
        self.check()
        pos = cur[2]
        cur[2] = pos + 1
        self.taken += 1
        self._ask_ahead(1)
        return cur[0], pos, int(cur[1][pos])

    def commit(self, rid: int, pos: int, priority: float | None, refs=None) -> None:
        """Commit a taken item; ``refs``: a frame table's item's frame
        references (uint32[1, references an item]: ``FrameStore.item_refs``)."""
        prio = None if priority is None else self._priorities([priority], 1, "commit")
        session = self._session
        session.dirty = True
        if refs is None:
            session.pipe.send(R.put_commit, self._at.table_id, rid, 1, pos, prio, wake=False)
        else:
            session.pipe.send(put_fcommit, self._at.table_id, rid, pos, refs, prio, wake=False)
        self.taken -= 1

    def release(self, abandoned=(), timeout: float | None = None) -> None:
        """Hand back the slots not handed out, and those of ``abandoned``
        items ((rid, pos, slot) taken but never to be committed; none may
        precede a committed one in its reservation).  Waits at most
        ``timeout`` (None: the client's) for a reservation asked ahead
        (never parked in the daemon: ``_ask_ahead``)."""
        session = self._session
        session.check_fork()  # a forked child must not send its parent's ids on its parent's channel
        if self.renewed:  # voided (reconnect, fork): the abandoned items' ids are dead
            abandoned = ()
        rids = {rid for rid, _, _ in abandoned}
        self.taken -= len(abandoned)
        if self.ahead is not None:
            seq, self.ahead = self.ahead, None
            try:
                rids.add(session.pipe.wait(seq, R.read_reserve_reply,
                                           session.pipe.timeout if timeout is None else timeout)[0])
            except ReplayError:
                pass  # the RESERVE failed: nothing to hand back
        cur, self.cur = self.cur, None
        if cur is not None and cur[2] < cur[1].shape[0]:
            rids.add(cur[0])
        for rid in sorted(rids):
            session.pipe.send(R.put_abort, self._at.table_id, rid)

