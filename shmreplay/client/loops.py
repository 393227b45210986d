"""The loops a user writes around a table: an actor's and a learner's.

    steps = shmreplay.actor_steps(table, total=100_000, stop=stop)
    for step in steps:                  # step: items in the table so far, every actor's
        a = policy(obs, epsilon(step))
        obs2, r, term, trunc, _ = env.step(a)
        steps.insert(obs=obs, action=a, reward=r)   # or steps.put(writer.append, ...)

    with shmreplay.learner_batches(table, 128, updates=10_000, stop=stop) as batches:
        for b in batches:               # never RateLimited: it waits for the actors
            table.update_priorities(b.keys, train(b))

**The global step** is the table's own insert counter: the live word the
daemon publishes after every change (``wire/livewords.py``), which every
attached client maps and reads with no round trip (``Table.inserts``).
Actors and learners share it with nothing new in shared memory, and it
counts what is in the table, whoever wrote it.  It lags an actor's newest
commits until the daemon applies them, so near ``total`` an actor makes
the count exact before deciding (``ActorSteps``): the table ends with
``total`` items and at most one step's items more per other actor.  The
count is the daemon's word in a segment only the daemon writes; a wrong
value could only end a loop early or late, never corrupt anything.

**Stopping.**  A loop ends at ``total`` (the global step), at ``updates``
(a learner's own batches), or when ``stop`` says so: a callable returning
True, or anything with ``is_set()`` (a ``threading.Event``, a
``multiprocessing`` one shared with the actor processes).  ``stop`` is
asked before every step or batch and after every bounded wait, so a stop
request ends a loop within one wait (``timeout``, 0.5 s, for an actor;
``WAIT_S`` for a learner).  No wait is unbounded and none spins: an
insert the rate limiter holds is tried again, each try a bounded wait in
the daemon; a learner waits for its batch in slices.  A wait that only
another process can end (the learner for an actor held by the limiter,
the actors for a learner) ends with progress or, once the table's
counters have not moved for ``patience`` seconds, a ``ReplayTimeout``
that says who is missing; ``patience=None`` waits for ever, still
stoppable.

Who may call: the loop's own thread, one loop per table handle at a time
(a handle's rule, ``table.py``); loops in several processes (actors and
learners) run concurrently on one table, each through its own client.
A learner's loop draws through ``Table.iterate`` (a prefetch thread with
its own connection), with its contract: a batch is valid until the next.
"""

from __future__ import annotations

import os
import time

from ..errors import RateLimited, ReplayError, ReplayTimeout

# A learner waits for a batch in slices of this long, looking at stop,
# total and its patience between them.
WAIT_S = 0.25
# A try the rate limiter refused sooner than this (an insert with timeout 0)
# is followed by a pause up to it, so retries never spin.
PAUSE_S = 0.01
# How much an actor loop lowers its process's priority by default: actors
# flat out on as many cores as the box has otherwise starve the learner and
# the daemon (2 cores, dqn-atari, 2 actors: the learner 115 batches/s at
# nice 0, 289 with the actors at +5; cpprb's 264; docs/performance.md).
# The systemd unit runs the daemon at -5 on top.
ACTOR_NICE = 5
_niced: set = set()  # pids whose priority an actor loop lowered: once a process


def yield_to_learners(increment: int = ACTOR_NICE) -> int:
    """Lower this process's CPU priority by ``increment`` (nice), once per
    process however many actor loops it runs; returns its nice value.
    ``actor_steps`` calls it; call it yourself in an actor with a loop of
    its own.  Lowering needs no privilege, and a process cannot raise its
    priority back without one: call it only in actor processes."""
    if increment < 0:
        raise ReplayError(f"nice= lowers an actor's priority: give 0 or more, got {increment!r}")
    pid = os.getpid()
    if increment and pid not in _niced:
        _niced.add(pid)
        return os.nice(increment)
    return os.nice(0)


def _predicate(stop):
    if stop is None:
        return lambda: False
    if callable(getattr(stop, "is_set", None)):
        return stop.is_set
    if callable(stop):
        return stop
    raise ReplayError(f"stop must be None, a callable returning True to stop, or an Event "
                      f"(anything with is_set()); got {type(stop).__name__}")


def _counts(table) -> tuple:
    """What moves when anyone inserts, samples or removes (the live words)."""
    w = table.mapped.words
    return w.inserts, w.samples, w.deletes


def _check_counts(total, patience, updates=None) -> None:
    for name, v in (("total", total), ("updates", updates)):
        if v is not None and not (isinstance(v, int) and v >= 0):
            raise ReplayError(f"{name} must be an int >= 0 or None, got {v!r}")
    if patience is not None and not patience > 0:
        raise ReplayError(f"patience must be > 0 seconds or None, got {patience!r}")


class Patience:
    """How long a loop has waited while the table stood still: a wait the
    table's counters show progress in starts the clock again; one that
    has seen none for ``patience`` seconds raises ReplayTimeout, which
    ends with ``missing`` (who should have moved them, and what to do)."""

    def __init__(self, table, patience: float | None, missing: str):
        self.table, self.patience, self.missing = table, patience, missing
        self.mark = self.since = None

    def reset(self) -> None:
        self.since = None

    def waited(self, what: str) -> None:
        now = time.monotonic()
        mark = None if self.table is None else _counts(self.table)
        if self.since is None or mark != self.mark:
            self.mark, self.since = mark, now
        elif self.patience is not None and now - self.since > self.patience:
            raise ReplayTimeout(f"{what} for {self.patience:g} s and the table's counters did not move "
                                f"(inserts, samples, removals: {mark}): {self.missing}")


# who a waiting actor or learner waits for, and what to do about it
_NO_LEARNER = ("no learner sampled, so the rate limiter holds this actor; did the learner end?  Set "
               "stop= when it does, or raise patience=")
_NO_ACTOR = ("no actor inserted; are the actors running, or did they reach their total?  End the "
             "learner at the same total=, or raise patience=")


class ActorSteps:
    """An actor's loop: iterate for the global step, write through ``put``
    or ``insert``; see the module docstring.  Made by ``actor_steps``."""

    def __init__(self, table, total: int | None = None, *, stop=None, timeout: float = 0.5,
                 patience: float | None = 60.0, nice: int = ACTOR_NICE):
        _check_counts(total, patience)
        if total is not None and table is None:
            raise ReplayError("total= counts the table's inserts: give the table")
        if not timeout > 0:
            raise ReplayError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.table, self.total, self.timeout = table, total, float(timeout)
        self._stop = _predicate(stop)
        self._patience = Patience(table, patience, _NO_LEARNER)
        yield_to_learners(nice)  # last: a refused loop leaves its process as it was
        self.local = 0       # this loop's steps
        self.ended = None    # why it ended: "total" or "stop"

    @property
    def step(self) -> int:
        """The global step: the table's inserts (this loop's steps without a table)."""
        return self.local if self.table is None else self.table.inserts

    def __iter__(self):
        while not self._over(at_step=True):
            yield self.step
            self.local += 1
        if self.ended == "total":
            self.table.client.flush()  # the count stands for every item this actor wrote

    def _over(self, at_step: bool = False) -> bool:
        if self.ended is None:
            if self._stop():
                self.ended = "stop"
            elif self.total is not None and self._reached(at_step):
                self.ended = "total"
        return self.ended is not None

    def _reached(self, settle: bool) -> bool:
        """Whether the table holds ``total`` items.  ``inserts`` misses the
        commits the daemon has not applied yet, which ``pending`` (reserved
        slots) still counts: when the two disagree about the total, this
        actor's commits are applied first (a flush keeping its leases)."""
        w = self.table.mapped.words
        if w.inserts >= self.total:
            return True
        if not settle or w.inserts + w.pending < self.total:
            return False
        self.table.client.flush(keep_leases=True)
        return self.table.inserts >= self.total

    def put(self, fn, *args, **kwargs) -> bool:
        """Run ``fn(*args, **kwargs)``, an insert or a writer's ``append``,
        until the rate limiter lets it through: True once it ran, False if
        the loop ended first (nothing was written; the loop ends at its next
        step).  ``fn`` must write nothing when it raises RateLimited
        (``Table.insert`` and the writers' ``append`` do; ``insert_batch``
        may have written a part) and wait a bounded time: give it
        ``timeout=self.timeout`` (writers take it when made)."""
        self._patience.reset()
        while not self._over():
            began = time.monotonic()
            try:
                fn(*args, **kwargs)
                return True
            except RateLimited:
                pass
            self._patience.waited("actor_steps: the rate limiter held an insert")
            rest = PAUSE_S - (time.monotonic() - began)
            if rest > 0:
                time.sleep(rest)
        return False

    def insert(self, priority=None, **fields) -> bool:
        """``Table.insert`` through ``put``: True once the item is in."""
        return self.put(self.table.insert, priority=priority, timeout=self.timeout, **fields)


class LearnerBatches:
    """A learner's loop: batches until ``updates``, ``total`` or ``stop``;
    see the module docstring.  Made by ``learner_batches``; iterate once;
    ``close()`` (or a ``with`` block) stops its prefetch thread at once."""

    def __init__(self, table, batch_size: int, updates: int | None = None, *, beta: float = 0.4,
                 total: int | None = None, stop=None, prefetch: int = 2,
                 patience: float | None = 60.0, buffers=None, check_reuse: bool = False):
        _check_counts(total, patience, updates)
        self.table, self.total, self.updates_max = table, total, updates
        self._args = (int(batch_size), float(beta), int(prefetch))
        self._buffers, self._check = buffers, bool(check_reuse)
        self._stop = _predicate(stop)
        self._patience = Patience(table, patience, _NO_ACTOR)
        self.updates = 0     # batches handed out
        self.ended = None    # why it ended: "updates", "total" or "stop"
        self._run = None

    step = property(lambda self: self.table.inserts, doc="The global step: the table's inserts.")

    def __iter__(self):
        if self._run is not None:
            raise ReplayError("learner_batches: iterate once (make another for a second loop)")
        self._run = self._batches()
        return self._run

    def _over(self) -> bool:
        if self.ended is None:
            if self.updates_max is not None and self.updates >= self.updates_max:
                self.ended = "updates"
            elif self._stop():
                self.ended = "stop"
            elif self.total is not None and self.table.inserts >= self.total:
                self.ended = "total"
        return self.ended is not None

    def _batches(self):
        if self._over():
            return
        n, beta, prefetch = self._args
        # no timeout: the prefetch thread waits for the limits in bounded
        # slices and never raises RateLimited; this loop waits in WAIT_S slices
        it = self.table.iterate(n, beta, prefetch, None, self._check, self._buffers)
        try:
            while not self._over():
                b = it.next_within(WAIT_S)
                if b is None:
                    self._patience.waited(f"learner_batches: no batch of {n}")
                    continue
                self._patience.reset()
                self.updates += 1
                yield b
        finally:
            it.close()

    def close(self) -> None:
        if self._run is not None:
            self._run.close()

    def __enter__(self) -> "LearnerBatches":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def actor_steps(table, total: int | None = None, *, stop=None, timeout: float = 0.5,
                patience: float | None = 60.0, nice: int = ACTOR_NICE) -> ActorSteps:
    """An actor's loop over ``table`` (a ``Table``; None for one that writes
    elsewhere, e.g. through ``shmreplay.ray``: then the step is its own
    count and there is no total): iterating yields the global step (the
    table's inserts) until the table holds ``total`` items or ``stop`` is
    set; ``put(fn, ...)``/``insert(**fields)`` write, waiting out the rate
    limiter in tries of ``timeout`` s.  ``patience``: the module docstring.
    ``nice``: how much the loop lowers its process's CPU priority, once per
    process (``yield_to_learners``), so that actors flat out leave the
    learner and the daemon their share; 0 keeps it."""
    return ActorSteps(table, total, stop=stop, timeout=timeout, patience=patience, nice=nice)


def learner_batches(table, batch_size: int, updates: int | None = None, *, beta: float = 0.4,
                    total: int | None = None, stop=None, prefetch: int = 2,
                    patience: float | None = 60.0, buffers=None, check_reuse: bool = False) -> LearnerBatches:
    """A learner's loop over ``table``: ``SampleBatch`` es (``Table.iterate``'s,
    with ``buffers``/``check_reuse`` as there) until ``updates`` batches,
    the table's ``total`` inserts, or ``stop``; waits for the actors as long
    as they make progress (``patience``) and never raises RateLimited."""
    return LearnerBatches(table, batch_size, updates, beta=beta, total=total, stop=stop, prefetch=prefetch,
                          patience=patience, buffers=buffers, check_reuse=check_reuse)
