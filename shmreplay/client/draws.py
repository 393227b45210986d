"""Draws: SAMPLE requests on a command pipe, their replies, and the one loop
that turns a draw into a stable batch.

``draw_batch`` is the only place that draws, gathers the rows
(``gather.take_rows``), re-checks their stamps (``gather.stale_rows``) and
draws again the rows whose slot was overwritten meanwhile.  Those redraws
are *protected*: the daemon pins their slots until the batch is copied
(``server/tables/slots/holds.py``), so no writer can overwrite them and the
second gather is stable however fast writers turn the table over; a row
whose stamp held once is whole for good, so each check after the first
looks only at the rows copied again (``stale_rows``).  A sample therefore
costs at most two draws and two gathers; the deadline
stays for what pins cannot cover (a client at its pin cap, a hold that
expired while the learner was stopped).  ``Table.sample`` and ``Table.finish_sample`` call it, and so,
through ``finish_sample``, do ``BatchIterator`` and ``Client.sample_many``.

The functions work over what they are handed (a ``CommandPipe``, the
daemon's id for the table, its field views and stamps as mapped now) and
keep nothing between calls.  ``TableDraws`` is a table handle's draw side:
what it draws from (the table as mapped now, bound by the handle, again
after every reconnect), the holds of its ``sample_indices`` batches and
the batch it draws ahead for ``sample(ahead=True)`` (sent by the
handle's insert calls, ``step``); its handle (``table.py``) makes it and
is its only caller.  All of it runs
on the thread that owns the pipe (the client's), one call at a time.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import RateLimited, ReplayError, ReplayTimeout
from ..wire import records as R
from . import gather
from .gather import SampleBatch, new_batch, take_rows
from .pipe import deadline_of, in_slices


def send_draw(pipe, table_id: int, k: int, beta: float, wait_s: float,
              protect: bool = False, wide: bool = False) -> int:
    """Send a SAMPLE of k items the daemon may hold ``wait_s`` for the
    table's limits (``protect``: pinned until released; ``wide``: this
    thread will copy the rows on every CPU, ``gather.gathers_wide``);
    returns its sequence number."""
    return pipe.send(R.put_sample, table_id, k, R.timeout_us(wait_s), beta, protect, wide)


def receive_draw(pipe, seq: int, k: int, rows, out: SampleBatch, wait_s: float) -> int:
    """Wait for the SAMPLE reply ``seq`` (k items) into ``out``'s keys,
    probabilities and weights at ``rows``; returns the hold id (0: none).
    A reply of every row that has come already is read by one kernel
    (``CommandPipe.take_sample``)."""
    if k == out.keys.shape[0]:  # rows: all of them, in order (arange or slice(None))
        hid = pipe.take_sample(seq, k, out.keys, out.probabilities, out.weights)
        if hid is not None:
            return hid
    return pipe.wait(seq, lambda rec, pay: R.read_sample_reply(rec, pay, k, rows, out.keys,
                                                               out.probabilities, out.weights),
                     wait_s)


def drop_draw(pipe, table_id: int, seq: int, wait_s: float) -> None:
    """Collect and discard the reply to the SAMPLE ``seq``, handing back its
    hold; an error it carries is dropped with it."""
    try:
        hid = pipe.wait(seq, lambda rec, pay: R.read_hold(rec), wait_s)
    except ReplayError:
        return
    if hid:
        pipe.send(R.put_release, table_id, hid)


def draw_batch(pipe, table_id: int, src: gather.Rows, fields, gens: np.ndarray, ticket: int | None,
               n: int, beta: float, out: SampleBatch | None, wait_s: float) -> SampleBatch:
    """A batch of n stable rows: the SAMPLE ``ticket`` sent (None: send one
    now), its rows copied into ``out`` (None: a new batch), then, until no
    row's stamp moved, those rows drawn again protected and copied again.  Gives up with
    ReplayTimeout after the pipe's timeout.  Holds are handed back once the
    rows are copied, whatever happens."""
    if out is None:
        out = new_batch(fields, n, addressed=src.stride > 0)
    elif len(out) != n:
        raise ReplayError(f"out= holds {len(out)} rows, batch_size is {n}")
    holds = []
    try:
        rows = np.arange(n)
        seq = (send_draw(pipe, table_id, n, beta, wait_s, wide=gather.gathers_wide(src, fields, n))
               if ticket is None else ticket)
        hid = receive_draw(pipe, seq, n, rows, out, wait_s)
        if hid:
            holds.append(hid)
        take_rows(src, fields, out, rows)
        out.redraws = 0
        timeout = pipe.timeout
        deadline = time.monotonic() + timeout
        first = True
        while True:
            # looked up in the module at each pass, not bound at import: a
            # fault test swaps it to stop a learner between copy and re-check.
            # After the first pass only the rows copied again are checked: a
            # row that passed once is whole, whatever a writer does later
            rows = gather.stale_rows(gens, out, None if first else rows)
            first = False
            k = rows.shape[0]
            if k == 0:
                return out
            if time.monotonic() > deadline:
                raise ReplayTimeout(f"could not draw {n} stable rows within {timeout} s")
            out.redraws += k
            seq = send_draw(pipe, table_id, k, beta, wait_s, protect=True,
                            wide=gather.gathers_wide(src, fields, k))
            hid = receive_draw(pipe, seq, k, rows, out, wait_s)
            if hid:
                holds.append(hid)
            take_rows(src, fields, out, rows)
    finally:
        for hid in holds:  # the rows are copied out: the slots may be reused
            pipe.send(R.put_release, table_id, hid)


class TableDraws:
    """A table handle's draw side: the table as mapped now (``bind``) and
    the holds of its ``sample_indices`` batches, and the batch it draws
    ahead for ``sample(ahead=True)``.  Built from what it uses: the
    client's ``session.Session`` (the command pipe now, ``max_batch``,
    ``begin``, ``check_fork``) and the table's fields."""

    def __init__(self, session, fields):
        self._session = session
        self._fields = fields
        self._table_id = 0
        self._rows: gather.Rows | None = None
        self._gens = None
        self._held: list[int] = []  # holds of sample_indices() batches
        # the batch drawn ahead: its SAMPLE's seq (None: none out), its
        # (n, beta), the handle's insert calls since the last ahead sample
        # (counted once one was asked for: ``counting``), and the count at
        # which the next is sent (0: sent, or none armed)
        self._ahead_seq: int | None = None
        self._ahead_of = (0, 0.0)
        self.counting = False
        self._since = 0
        self._due = 0
        self._interval: int | None = None  # insert calls between the last two ahead samples
        self._sent_at = 0   # _since when the batch ahead was sent

    def bind(self, table_id: int, rows: gather.Rows, gens: np.ndarray) -> None:
        """The table as mapped now (called by its handle, again after a
        reconnect): the daemon's id for it, its rows and stamps."""
        self._table_id = table_id
        self._rows = rows
        self._gens = gens

    def retire(self) -> None:
        """No table has this name any more: id 0, so every later draw raises UnknownTable."""
        self._table_id = 0
        self._ahead_seq = None
        self._due = 0

    def forget(self) -> None:
        """The connection the holds (and a batch drawn ahead) were taken on is
        gone (reconnect, fork)."""
        self._held = []
        self._ahead_seq = None
        self._due = 0

    def check(self, batch_size, beta) -> tuple[int, float]:
        """A draw's size and beta, checked; then the prologue of a data call."""
        n, beta = R.check_draw(batch_size, beta, "batch_size {n}", self._session.max_batch)
        self._session.begin()
        return n, beta

    def indices(self, n: int, beta: float, timeout: float | None):
        """``Table.sample_indices`` (checked): (keys, probabilities, weights),
        the hold of the last draw kept until the next or ``release``."""
        self.release()
        b = new_batch((), n)
        pipe = self._session.pipe
        hid = in_slices(deadline_of(timeout), lambda w: receive_draw(
            pipe, send_draw(pipe, self._table_id, n, beta, w), n, slice(None), b, w))
        if hid:
            self._held.append(hid)
        return b.keys, b.probabilities, b.weights

    def release(self) -> None:
        """Hand back the slots ``indices`` held for reading."""
        self._session.check_fork()  # a forked child holds none of its parent's holds
        held, self._held = self._held, []
        pipe = self._session.pipe
        for hid in held:
            pipe.send(R.put_release, self._table_id, hid)

    def begin(self, n: int, beta: float, wait_s: float) -> int:
        """``Table.begin_sample``: send a SAMPLE (n, beta checked) now; its ticket."""
        pipe = self._session.pipe
        seq = send_draw(pipe, self._table_id, n, beta, wait_s,
                        wide=gather.gathers_wide(self._rows, self._fields, n))
        pipe.expect(seq)
        return seq

    def finish(self, ticket: int | None, n: int, beta: float, out: SampleBatch | None,
               wait_s: float) -> SampleBatch:
        """``Table.finish_sample``: the batch a ``begin`` ticket drew (None: draw now)."""
        return draw_batch(self._session.pipe, self._table_id, self._rows, self._fields, self._gens,
                          ticket, n, beta, out, wait_s)

    # ---- a batch drawn ahead: Table.sample(ahead=True) ----
    def ahead(self, n: int, beta: float, out: SampleBatch | None, deadline: float | None) -> SampleBatch:
        """``Table.sample(ahead=True)`` (n, beta checked): the batch sent
        ahead, then the next one armed.  ``step`` sends it once the handle
        has made half as many insert calls as it made since the last ahead
        sample; it goes now if it made none (a learner that only samples).
        A draw of another n or beta, or one sent more insert calls ago than
        the last interval had (at least one; the first interval is not
        known, and not bounded), is dropped and the call draws now; so is
        one the table's limits refused when it was sent, under the call's
        own timeout."""
        pipe = self._session.pipe
        ticket, self._ahead_seq = self._ahead_seq, None
        if ticket is not None and ((n, beta) != self._ahead_of or (
                self._interval is not None and self._since - self._sent_at > max(1, self._interval))):
            drop_draw(pipe, self._table_id, ticket, 0.0)
            ticket = None
        batch = None
        if ticket is not None:
            try:
                batch = draw_batch(pipe, self._table_id, self._rows, self._fields, self._gens, ticket,
                                   n, beta, out, 0.0)
            except RateLimited:
                pass  # refused when it was sent (or a redraw now): drawn below
            except BaseException:
                if pipe.outstanding(ticket):  # never collected: the next call collects or drops it
                    self._ahead_seq = ticket
                raise
        if batch is None:
            batch = in_slices(deadline, lambda wait_s: draw_batch(
                pipe, self._table_id, self._rows, self._fields, self._gens, None, n, beta, out, wait_s))
        self._ahead_of = (n, beta)
        # the first interval is unknown: inserts were not counted before it
        self._interval = self._since if self.counting else None
        self.counting, self._since = True, 0
        self._due = ((self._interval or 0) + 1) // 2
        if not self._due:
            self._send_ahead()
        return batch

    def step(self) -> None:
        """An insert call on the handle, once ``counting``: the batch armed
        is sent when it is due."""
        self._since += 1
        if self._since == self._due:
            self._due = 0
            self._send_ahead()

    def _send_ahead(self) -> None:
        # sent with no wait in the daemon: limits that refuse it now are
        # waited for by the sample that collects it, under its own timeout.
        # Best effort: the insert or sample that sends it has done its work
        # (a failure here would fail it, and a reconnecting handle would do
        # it again); without it the next ahead sample draws at the call
        n, beta = self._ahead_of
        self._sent_at = self._since
        try:
            self._ahead_seq = self.begin(n, beta, 0.0)
        except ReplayError:
            self._ahead_seq = None
