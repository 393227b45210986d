"""Draws: SAMPLE requests on a command pipe, their replies, and the one loop
that turns a draw into a stable batch.

``draw_batch`` is the only place that draws, gathers the rows
(``gather.take_rows``), re-checks their stamps (``gather.stale_rows``) and
draws again the rows whose slot was overwritten meanwhile.  Those redraws
are *protected*: the daemon pins their slots until the batch is copied
(``server/tables/ledger.py``), so no writer can overwrite them and the
second gather is stable however fast writers turn the table over.  A
sample therefore costs at most two draws and two gathers; the deadline
stays for what pins cannot cover (a client at its pin cap, a hold that
expired while the learner was stopped).  ``Table.sample`` and ``Table.finish_sample`` call it, and so,
through ``finish_sample``, do ``BatchIterator`` and ``Client.sample_many``.

Functions over what they are handed (a ``CommandPipe``, the daemon's id for
the table, its field views and stamps as mapped now): they keep nothing
between calls.  Called on the thread that owns the pipe (the client's).
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import ReplayError, ReplayTimeout
from ..wire import records as R
from . import gather
from .gather import SampleBatch, new_batch, take_rows


def send_draw(pipe, table_id: int, k: int, beta: float, wait_s: float,
              protect: bool = False) -> int:
    """Send a SAMPLE of k items the daemon may hold ``wait_s`` for the
    table's limits (``protect``: pinned until released); returns its
    sequence number."""
    return pipe.send(R.put_sample, table_id, k, R.timeout_us(wait_s), beta, protect)


def receive_draw(pipe, seq: int, k: int, rows, out: SampleBatch, wait_s: float) -> int:
    """Wait for the SAMPLE reply ``seq`` (k items) into ``out``'s keys,
    probabilities and weights at ``rows``; returns the hold id (0: none)."""
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


def draw_batch(pipe, table_id: int, views: dict, fields, gens: np.ndarray, ticket: int | None,
               n: int, beta: float, out: SampleBatch | None, wait_s: float) -> SampleBatch:
    """A batch of n stable rows: the SAMPLE ``ticket`` sent (None: send one
    now), its rows copied into ``out`` (None: a new batch), then, until no
    row's stamp moved, those rows drawn again protected and copied again.  Gives up with
    ReplayTimeout after the pipe's timeout.  Holds are handed back once the
    rows are copied, whatever happens."""
    if out is None:
        out = new_batch(fields, n)
    elif len(out) != n:
        raise ReplayError(f"out= holds {len(out)} rows, batch_size is {n}")
    holds = []
    try:
        rows = np.arange(n)
        seq = send_draw(pipe, table_id, n, beta, wait_s) if ticket is None else ticket
        hid = receive_draw(pipe, seq, n, rows, out, wait_s)
        if hid:
            holds.append(hid)
        take_rows(views, fields, out, rows)
        out.redraws = 0
        timeout = pipe.timeout
        deadline = time.monotonic() + timeout
        while True:
            # looked up in the module at each pass, not bound at import: a
            # fault test swaps it to stop a learner between copy and re-check
            rows = gather.stale_rows(gens, out)
            k = rows.shape[0]
            if k == 0:
                return out
            if time.monotonic() > deadline:
                raise ReplayTimeout(f"could not draw {n} stable rows within {timeout} s")
            out.redraws += k
            seq = send_draw(pipe, table_id, k, beta, wait_s, protect=True)
            hid = receive_draw(pipe, seq, k, rows, out, wait_s)
            if hid:
                holds.append(hid)
            take_rows(views, fields, out, rows)
    finally:
        for hid in holds:  # the rows are copied out: the slots may be reused
            pipe.send(R.put_release, table_id, hid)
