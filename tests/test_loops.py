"""Issue 36, item 5: the actor and learner loops of ``shmreplay/client/loops.py``
(``actor_steps``, ``learner_batches``) with a real daemon and real actor and
learner processes: they end at the total, a stop request ends both sides
(each held in a wait only the other side could end), a learner waits out
slow actors without raising RateLimited, the global step counts what every
actor inserted, and a wait nobody can end raises a clear error.

Nothing is timed: each test arranges the state that forces the behaviour
(a limiter that holds, an empty table, a learner held between rounds), and
waits for states with ``waiting.wait_for``, whose deadline only catches a
hang."""

import time

import numpy as np
import pytest

import shmreplay
from shmreplay.client import loops
from readback import committed
from waiting import HANG_S, no_worker_failed, reap, wait_for, worker_context

FIELDS = {"actor": ("int64", ()), "k": ("int64", ())}
BATCH = 4


def table(name, capacity=1024, **limits):
    return {"name": name, "capacity": capacity, "fields": FIELDS, **limits}


def limited(name, spi=1.0, min_size=8, error_buffer=16.0, **more):
    """A table whose rate limiter holds writers error_buffer inserts ahead
    of the samples (and samplers behind)."""
    return table(name, samples_per_insert=spi, min_size_to_sample=min_size, error_buffer=error_buffer, **more)


def actor_main(sock, name, index, total, stop, out, lazy=False):
    """An actor process: one item a step, (actor, k) its k-th; reports
    what it saw."""
    with shmreplay.connect(sock) as c:
        c.lazy_commits = lazy
        t = c.table(name)
        steps = shmreplay.actor_steps(t, total=total, stop=stop, patience=None)
        seen, put = [], 0
        for step in steps:
            seen.append(step)
            put += steps.insert(actor=index, k=put)
        out.put({"actor": index, "put": put, "seen": seen, "ended": steps.ended, "step": steps.step})


def learner_main(sock, name, updates, total, stop, out, started=None):
    with shmreplay.connect(sock) as c:
        t = c.table(name)
        if started is not None:
            started.set()
        with shmreplay.learner_batches(t, BATCH, updates, total=total, stop=stop, patience=None) as batches:
            for b in batches:
                t.update_priorities(b.keys, np.ones(BATCH))
        out.put({"actor": "learner", "updates": batches.updates, "ended": batches.ended})


def run(procs, out, count):
    """Start procs, wait until each has reported and exited 0."""
    for p in procs:
        p.start()
    try:
        got = [wait_for(lambda: no_worker_failed(procs) and _get(out), "a worker's report")
               for _ in range(count)]
        for p in procs:
            p.join(HANG_S)
            assert p.exitcode == 0, (p.name, p.exitcode)
        return {r["actor"]: r for r in got}
    finally:
        reap(procs)


def _get(q):
    try:
        return q.get(timeout=0.1)
    except Exception:
        return None


def test_an_actor_and_a_learner_end_at_the_total(start_daemon):
    """One actor with lazy commits (the daemon's insert count lags its
    commits) and a rate-limited learner, both with total=300: the actor
    stops with exactly 300 items in (it settles the count near the total),
    the learner at the same total, neither by anything else."""
    d = start_daemon(tables=[limited("r", sampler="prioritized")])
    ctx = worker_context()
    stop, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=actor_main, args=(d.socket, "r", 0, 300, stop, out, True), name="actor"),
             ctx.Process(target=learner_main, args=(d.socket, "r", None, 300, stop, out), name="learner")]
    got = run(procs, out, 2)
    assert got[0]["ended"] == "total" and got[0]["put"] == 300, got[0]
    assert got["learner"]["ended"] == "total", got["learner"]
    with d.connect() as c:
        assert c.stats()["tables"]["r"]["inserts"] == 300


def test_the_global_step_counts_what_every_actor_inserted(start_daemon):
    """Two actors to a total of 400: each steps on the table's count (not
    its own steps) and ends when it reaches the total, with every item
    either put counted and at most one step past the total; any client
    attached to the table reads the same count."""
    d = start_daemon(tables=[table("r")])
    ctx = worker_context()
    stop, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=actor_main, args=(d.socket, "r", i, 400, stop, out), name=f"actor{i}")
             for i in range(2)]
    got = run(procs, out, 2)
    put = got[0]["put"] + got[1]["put"]
    assert 400 <= put <= 401, got  # two actors, one item a step: one past at most
    for r in got.values():  # each ends at the table's count, whichever actor wrote it
        assert r["ended"] == "total" and r["seen"] == sorted(r["seen"]) and r["step"] >= 400, r
    with d.connect() as c:
        t = c.table("r")
        assert c.stats()["tables"]["r"]["inserts"] == put
        assert shmreplay.actor_steps(t, nice=0).step == shmreplay.learner_batches(t, BATCH).step == put
        rows, _ = committed(t)  # every item once, as each actor counted it
        assert sorted(zip(rows["actor"].tolist(), rows["k"].tolist())) == \
            [(a, k) for a in (0, 1) for k in range(got[a]["put"])]


def test_a_stop_request_ends_a_held_actor_and_a_waiting_learner(start_daemon):
    """The actor is held by the rate limiter (nobody samples its table) and
    the learner waits on an empty table, both with no patience limit: only
    the stop request can end them, and it ends both."""
    d = start_daemon(tables=[limited("a"), table("b", min_size_to_sample=1)])
    ctx = worker_context()
    stop, out, started = ctx.Event(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=actor_main, args=(d.socket, "a", 0, None, stop, out), name="actor"),
             ctx.Process(target=learner_main, args=(d.socket, "b", None, None, stop, out, started),
                         name="learner")]
    for p in procs:
        p.start()
    try:
        with d.connect() as c:
            a = c.table("a")
            # held: the limiter's room is gone and the actor's leased slots are written
            wait_for(lambda: no_worker_failed(procs) and not a.can_insert() and a.mapped.words.pending == 0,
                     "the rate limiter to hold the actor")
            wait_for(lambda: no_worker_failed(procs) and started.is_set(), "the learner to start")
            assert len(c.table("b")) == 0
            stop.set()
            got = {r["actor"]: r for r in [wait_for(lambda: no_worker_failed(procs) and _get(out),
                                                    "a report after the stop") for _ in range(2)]}
        for p in procs:
            p.join(HANG_S)
            assert p.exitcode == 0, (p.name, p.exitcode)
    finally:
        reap(procs)
    assert got[0]["ended"] == "stop" and got["learner"] == {"actor": "learner", "updates": 0, "ended": "stop"}


def test_the_learner_waits_out_slow_actors_without_rate_limited(start_daemon):
    """A learner of 12 batches, whose rate limiter lets it draw only as the
    actor inserts, and an actor that inserts a round of items only when
    the test says so, each after the learner has been held for several of
    its waits: the learner waits each round out and ends at its updates,
    never raising RateLimited."""
    d = start_daemon(tables=[limited("r", spi=float(BATCH), min_size=1, error_buffer=float(BATCH))])
    ctx = worker_context()
    stop, out = ctx.Event(), ctx.Queue()
    learner = ctx.Process(target=learner_main, args=(d.socket, "r", 12, None, stop, out), name="learner")
    learner.start()
    try:
        with d.connect() as c:
            t = c.table("r")
            for k in range(12):
                # the learner is held (nothing it may draw) ...
                wait_for(lambda: no_worker_failed([learner]) and not t.can_sample(BATCH)
                         and t.mapped.words.samples == BATCH * k, f"the learner to draw batch {k}")
                time.sleep(4 * loops.WAIT_S)  # ... for several waits (a loaded box: more)
                t.insert(actor=1, k=k)  # one item: one batch of BATCH
                c.flush()
            got = wait_for(lambda: no_worker_failed([learner]) and _get(out), "the learner's report")
        learner.join(HANG_S)
        assert learner.exitcode == 0
    finally:
        reap([learner])
    assert got == {"actor": "learner", "updates": 12, "ended": "updates"}


def test_a_wait_nobody_can_end_raises_a_clear_error(start_daemon):
    """With a patience: an actor the limiter holds while no learner samples,
    and a learner on a table no actor fills, each raise ReplayTimeout (not
    RateLimited) naming who is missing, once the table stood still that
    long.  A hang guard stops them if they never do."""
    d = start_daemon(tables=[limited("a", min_size=1), table("b", min_size_to_sample=1)])
    with d.connect() as c:
        a = c.table("a")
        guard = time.monotonic() + HANG_S
        steps = shmreplay.actor_steps(a, stop=lambda: time.monotonic() > guard, patience=0.5, nice=0)
        with pytest.raises(shmreplay.ReplayTimeout) as exc:
            for _ in steps:
                steps.insert(actor=0, k=0)
        assert not isinstance(exc.value, shmreplay.RateLimited) and steps.ended is None, steps.ended
        assert "no learner sampled" in str(exc.value)
        # an insert that cannot wait (timeout 0) is refused at once: the tries
        # pause between them, never spin (a slow box makes fewer, not more)
        tries = []

        def at_once():
            tries.append(1)
            a.insert(actor=0, k=0, timeout=0)
        with pytest.raises(shmreplay.ReplayTimeout, match="no learner sampled"):
            shmreplay.actor_steps(a, patience=0.5, nice=0).put(at_once)
        assert 2 <= len(tries) <= 0.5 / loops.PAUSE_S + 2, len(tries)
        with pytest.raises(shmreplay.ReplayTimeout) as exc:
            with shmreplay.learner_batches(c.table("b"), BATCH, stop=lambda: time.monotonic() > guard,
                                           patience=0.5) as batches:
                for _ in batches:
                    pass
        assert not isinstance(exc.value, shmreplay.RateLimited) and batches.ended is None
        assert "no actor inserted" in str(exc.value)


def test_bad_loop_arguments_are_refused_with_what_to_do(start_daemon):
    d = start_daemon(tables=[table("r")])
    with d.connect() as c:
        t = c.table("r")
        for call, words in [(lambda: shmreplay.actor_steps(t, total=-1), "total must be an int >= 0"),
                            (lambda: shmreplay.actor_steps(None, total=5), "give the table"),
                            (lambda: shmreplay.actor_steps(t, stop=3), "stop must be None, a callable"),
                            (lambda: shmreplay.actor_steps(t, nice=-1), "give 0 or more"),
                            (lambda: shmreplay.learner_batches(t, 4, updates=1.5), "updates must be an int"),
                            (lambda: shmreplay.learner_batches(t, 4, patience=0), "patience must be > 0")]:
            with pytest.raises(shmreplay.ReplayError, match=words):
                call()


def nice_main(sock, name, nice, out):
    """A process that runs two actor loops (``nice``: the first's) and
    reports its nice value before, after the first and after the second."""
    import os
    before = os.nice(0)
    with shmreplay.connect(sock) as c:
        t = c.table(name)
        shmreplay.actor_steps(t, stop=lambda: True, nice=nice)
        first = os.nice(0)
        shmreplay.actor_steps(t, stop=lambda: True)  # the default, in a process already lowered or not
        out.put((before, first, os.nice(0)))


def test_an_actor_loop_lowers_its_process_priority_once(start_daemon):
    """Item 3: actors flat out must leave the learner and the daemon their
    share without nice levels set by hand: an actor loop lowers its own
    process's priority by ``loops.ACTOR_NICE`` (once however many loops the
    process runs); ``nice=0`` keeps it as it was, until a loop with the
    default runs."""
    d = start_daemon(tables=[table("r")])
    ctx = worker_context()
    for nice, after_first in [(None, loops.ACTOR_NICE), (0, 0), (2, 2)]:
        out = ctx.Queue()
        kw = loops.ACTOR_NICE if nice is None else nice
        p = ctx.Process(target=nice_main, args=(d.socket, "r", kw, out))
        p.start()
        try:
            before, first, second = out.get(timeout=HANG_S)
        finally:
            reap([p])
        lowered = min(19, before + after_first)  # a nice value stops at 19
        assert first == lowered, (nice, before, first)
        assert second == (lowered if after_first else min(19, before + loops.ACTOR_NICE)), (nice, second)
