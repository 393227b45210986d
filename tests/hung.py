"""Hung learners: client processes that stop themselves (SIGSTOP) at a
chosen point of a draw, so a test arranges a learner that holds slots,
has a SAMPLE's reply unread, or has copied its rows but not yet re-checked
their stamps, and resumes it (SIGCONT) when it chooses.  Used by
``fault/test_holds.py`` and ``test_redraw.py``."""

import functools
import multiprocessing as mp
import os
import signal

import shmreplay
from shmreplay.client import gather
from waiting import wait_for

CTX = mp.get_context("fork")


def _stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def _stop_self() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)


def reporting(body):
    """A worker ``body(..., out)`` whose ReplayError goes to ``out`` as
    ("error", class, message), for the test to show, instead of a dead child."""
    @functools.wraps(body)
    def run(*args):
        try:
            body(*args)
        except shmreplay.ReplayError as exc:
            args[-1].put(("error", type(exc).__name__, str(exc)))
    return run


def full_table(start_daemon, table: dict, data: dict, hold_timeout_s: float, **daemon_opts):
    """A daemon serving one table whose items are sampled once, filled with
    ``data``: (daemon, admin client, table handle)."""
    d = start_daemon(tables=[{"max_times_sampled": 1, **table}], hold_timeout_s=hold_timeout_s, **daemon_opts)
    admin = d.connect(timeout=30)
    t = admin.table(table["name"])
    t.insert_batch(data)
    admin.flush()
    return d, admin, t


@reporting
def hung_learner(sock, table, n, how, out):
    """Draw n items and stop before the draw is finished: ``indices`` holds
    them with ``sample_indices`` and never releases; ``before`` stops with the
    SAMPLE's reply unread; ``mid`` stops inside ``sample`` between copying
    the rows and re-checking their stamps.  Once resumed, it finishes the
    gather and reports the batch, then proves it is still connected."""
    with shmreplay.connect(sock, timeout=30) as c:
        t = c.table(table)
        if how == "indices":
            t.sample_indices(n)
            _stop_self()
            out.put(("resumed",))
            return
        if how == "before":
            ticket = t.begin_sample(n, 0.0, 30.0)
            _stop_self()
            b = t.finish_sample(ticket, n, 0.0, None, 30.0)
        else:
            check = gather.stale_rows

            def stop_then_check(gens, batch, rows=None):
                gather.stale_rows = check
                _stop_self()
                return check(gens, batch, rows)

            gather.stale_rows = stop_then_check
            b = t.sample(n, beta=0.0, timeout=30)
        c.flush()  # its RELEASE of the expired hold went first: no protocol error
        out.put(("ok", b.keys, b.data, b.redraws))


def received(q, what: str):
    """The next report on a SimpleQueue (whose put is written at once, so a
    worker may stop itself right after it), within the hang guard."""
    wait_for(lambda: not q.empty(), what)
    return q.get()


def start_learner(d, table, n, how, out):
    p = CTX.Process(target=hung_learner, args=(d.socket, table, n, how, out), daemon=True)
    p.start()
    wait_for(lambda: _stopped(p.pid) or not p.is_alive(), f"the {how} learner to stop itself")
    assert p.is_alive(), "the learner ended before it stopped itself"
    return p
