"""Rate limits: ``samples_per_insert`` with its error buffer, and
``min_size_to_sample``, decide when an insert or a sample may go on.
In-process: exactly what a brute-force twin of Reverb's CanInsert and
CanSample admits, the limits that could deadlock refused at creation, a
RESERVE granted only what the ratio allows.  Over a real daemon: the probes
tell in advance, and with actors and a learner running the ratio stays
within its error buffer, the faster side held back.  (How a held-back
request waits in the daemon: test_parking.py.)"""

import math
import time

import numpy as np
import pytest

import shmreplay
from items import F, insert_ids, table_stats
from shmreplay import ratelimiter
from shmreplay.errors import CapacityError, RateLimited, SchemaError
from shmreplay.schema import make_spec
from shmreplay.server.tables.counters import Blocked
from waiting import HANG_S, end_all, start_all, wait_for, wait_for_exit, worker_context

CTX = worker_context()  # clean processes, as spawn's, started sooner


# ---- what the limiter admits: Reverb's predicates, in-process ----
def reverb_can_insert(spec, size, inserts, pending, samples, k):
    if size + pending + k <= spec.min_size_to_sample:
        return True
    lo, hi = spec.diff_bounds
    return (inserts + pending + k) * spec.samples_per_insert - samples <= hi + 1e-9


def reverb_can_sample(spec, size, inserts, samples, n):
    if size < spec.min_size_to_sample:
        return False
    lo, hi = spec.diff_bounds
    return inserts * spec.samples_per_insert - samples - n >= lo - 1e-9


@pytest.mark.parametrize("spi,eb,mss", [(1.0, 10.0, 1), (4.0, 20.0, 50), (0.25, 3.0, 8),
                                        (2.0, (-5.0, 40.0), 10), (1.0, (0.0, 16.0), 1)])
def test_rate_limiter_admits_exactly_what_reverbs_predicates_admit(spi, eb, mss):
    spec = make_spec("t", 100, {"x": ("f4", ())}, samples_per_insert=spi, error_buffer=eb,
                     min_size_to_sample=mss)
    rng = np.random.default_rng(1)
    for _ in range(3000):
        inserts = int(rng.integers(0, 200))
        deletes = int(rng.integers(0, inserts + 1))
        size = inserts - deletes
        pending = int(rng.integers(0, 5))
        samples = int(rng.integers(0, int(inserts * spi) + 30))
        want = int(rng.integers(1, 20))
        room = ratelimiter.insert_room(spec, size, inserts, pending, samples, want)
        # the largest k <= want that Reverb's predicate admits (it is monotone in k)
        best = max([k for k in range(want + 1)
                    if k == 0 or reverb_can_insert(spec, size, inserts, pending, samples, k)])
        assert room == best
        n = int(rng.integers(1, 20))
        ok = ratelimiter.sample_blocker(spec, size, inserts, samples, n) is None
        assert ok == reverb_can_sample(spec, size, inserts, samples, n)


@pytest.mark.parametrize("limits,match", [
    (dict(samples_per_insert=4.0, error_buffer=3.0), "narrower than"),
    (dict(samples_per_insert=1.0, error_buffer=(50.0, 100.0), min_size_to_sample=10), "min_diff"),
    (dict(samples_per_insert=2.0, error_buffer=10.0, max_times_sampled=1), "exceeds max_times_sampled"),
    (dict(min_size_to_sample=101), "could never be sampled"),
    (dict(samples_per_insert=1.0), "needs an error_buffer"),
    (dict(error_buffer=5.0), "needs samples_per_insert"),
    (dict(samples_per_insert=-1.0, error_buffer=5.0), "must be > 0"),
    (dict(sampler="heap"), "sampler 'heap'"),
    (dict(remover="random"), "remover 'random'"),
])
def test_configurations_that_can_deadlock_are_refused_at_creation(limits, match):
    with pytest.raises(SchemaError, match=match):
        make_spec("t", 100, {"x": ("f4", ())}, **limits)


def test_rate_limited_reserve_grants_only_what_the_ratio_allows(make_table):
    t = make_table(capacity=100, samples_per_insert=2.0, error_buffer=(0.0, 10.0),
                   min_size_to_sample=1)
    rid, slots, _ = t.reserve(1, 50)
    assert slots.shape[0] == 5, "(5 inserts) * 2 samples_per_insert = 10 = max_diff"
    t.commit(1, rid, None)
    with pytest.raises(Blocked) as info:
        t.reserve(1, 1)
    assert isinstance(info.value.error, RateLimited) and "max_diff 10" in str(info.value)
    t.sample(1, 4, 0.4)
    _, slots, _ = t.reserve(1, 50)
    assert slots.shape[0] == 2
    with pytest.raises(CapacityError, match="never be admitted"):
        t.sample(1, 11, 0.4)
    assert math.isclose(t.map.words.mass, 5.0)


# ---- over a real daemon ----
def test_insert_waits_for_samples_and_probes_tell_in_advance(client):
    t = client.create_table("r", 100, F, samples_per_insert=1.0, error_buffer=(0.0, 5.0))
    insert_ids(t, 0, 5)
    assert not t.can_insert(1) and t.can_sample(5) and not t.can_sample(6)
    with pytest.raises(shmreplay.RateLimited, match="max_diff 5"):
        t.insert(v=99, timeout=0.2)
    t.sample(2)
    assert t.can_insert(2) and not t.can_insert(3)
    insert_ids(t, 5, 7)
    with pytest.raises(shmreplay.CapacityError, match="never be admitted"):
        t.sample(6)


def limited_actor(sock, batches, pause):
    with shmreplay.connect(sock) as c:
        t = c.table("rl")
        for i in range(batches):
            t.insert_batch({"v": np.arange(4 * i, 4 * i + 4)})  # waits as the limiter says
            if pause:
                time.sleep(pause)  # pacing only: one side is slower
        t.flush()


def limited_learner(sock, total, half, halfway, resume, pause):
    with shmreplay.connect(sock) as c:
        t = c.table("rl")
        drawn = 0
        while drawn < total:
            if drawn == half:
                halfway.set()
                if not resume.wait(10 * HANG_S):
                    raise RuntimeError("never told to resume")
            drawn += len(t.sample(8))  # waits as the limiter says
            if pause:
                time.sleep(pause)


@pytest.mark.parametrize("first,actor_pause,learner_pause,waits",
                         [("actors", 0.0, 0.01, "insert_waits"),
                          ("learner", 0.01, 0.0, "sample_waits")])
def test_rate_limiter_keeps_the_ratio_within_its_error_buffer(
        daemon, client, first, actor_pause, learner_pause, waits):
    spi, lo, hi = 4.0, 100.0 - 60.0, 100.0 + 60.0
    t = client.create_table("rl", 2000, F, sampler="uniform", samples_per_insert=spi,
                            min_size_to_sample=25, error_buffer=60.0)
    batches = 100                                # per actor, of 4 items
    total_inserts = 40 + 2 * 4 * batches         # 840, after 40 put in here
    total_samples = int(total_inserts * spi - lo)  # 3,320 in batches of 8: ends at min_diff
    half = total_samples // 16 * 8
    assert total_samples % 8 == 0 and total_samples > 1000

    def diff(lim):
        return lim["inserts"] * spi - lim["samples"]

    snapshots = [0]

    def checked():
        """A snapshot, checked against the bounds (every one this test takes)."""
        st = table_stats(client, "rl")
        lim = st["limiter"]
        assert diff(lim) <= hi + 1e-9, lim
        if lim["samples"]:
            assert diff(lim) >= lo - 1e-9, lim
        snapshots[0] += 1
        return st

    def parked(key):
        """A snapshot with a request of that side parked and no insert half done."""
        st = checked()
        lim = st["limiter"]
        return st if lim[key] >= 1 and lim["pending"] == 0 else None

    t.insert_batch({"v": np.arange(-40, 0)}, timeout=HANG_S)  # diff 160 = max_diff
    t.flush()
    lim = checked()["limiter"]
    assert (lim["inserts"], lim["samples"], diff(lim)) == (40, 0, hi), lim
    assert not t.can_insert(1) and t.can_sample(8)

    halfway, resume = CTX.Event(), CTX.Event()
    actors = [CTX.Process(target=limited_actor, args=(daemon.socket, batches, actor_pause),
                          daemon=True) for _ in range(2)]
    learner = CTX.Process(target=limited_learner, daemon=True,
                          args=(daemon.socket, total_samples, half, halfway, resume, learner_pause))
    procs = actors + [learner]
    try:
        # the side that starts first runs into its bound and is held there
        if first == "actors":
            start_all(actors)
            st = wait_for(lambda: parked("waiting_inserts"), "the actors to be held at max_diff")
            assert (st["limiter"]["inserts"], diff(st["limiter"])) == (40, hi), st["limiter"]
            learner.start()
        else:
            learner.start()
            st = wait_for(lambda: parked("waiting_samples"), "the learner to be held at min_diff")
            assert (st["limiter"]["samples"], diff(st["limiter"])) == (120, lo), st["limiter"]
            start_all(actors)
        assert st[waits] > 0, f"the side that ran alone must have been held back ({waits})"
        # half way the learner stops: the actors, far from done, are held at max_diff
        st = wait_for(lambda: halfway.is_set() and parked("waiting_inserts"), "the learner half way and the actors held")
        assert st["limiter"]["samples"] == half and diff(st["limiter"]) == hi, st["limiter"]
        assert st["limiter"]["inserts"] < total_inserts
        resume.set()
        # then both run to the end, every snapshot checked
        wait_for_exit(procs, procs, "the workers to finish", probe=checked)
    finally:
        end_all(procs)
    st = checked()
    lim = st["limiter"]
    assert (lim["inserts"], lim["samples"]) == (total_inserts, total_samples), lim
    assert diff(lim) == lo and snapshots[0] >= 5
    # at min_diff: not one more sample, an insert goes in
    assert not t.can_sample(1) and t.can_insert(1)
    with pytest.raises(shmreplay.RateLimited, match="below min_diff 40"):
        t.sample(1, timeout=0)
    # the ratio itself: off by at most the error buffer over all inserts
    assert abs(lim["samples"] / lim["inserts"] - spi) <= max(abs(lo), abs(hi)) / lim["inserts"] + 1e-12
    assert st[waits] > 0, f"the faster side must have been held back ({waits})"
