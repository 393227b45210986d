"""Replay semantics over a real daemon and real client processes:
selectors, removers, reuse limits, queues, rate limiting, several tables."""

import os
import queue
import signal
import threading
import time

import numpy as np
import pytest

import shmreplay
from shmreplay.wire.records import key_slots
from waiting import HANG_S, wait_for, worker_context

F = {"v": ("int64", ())}
CTX = worker_context()  # clean processes, as spawn's, started sooner


def ids(batch):
    return batch.data["v"].tolist()


def insert_ids(t, lo, hi):
    t.insert_batch({"v": np.arange(lo, hi)})
    t.flush()


# ---- selectors and removers ----
def test_fifo_sampler_returns_the_oldest_item_and_lifo_the_newest(client):
    f = client.create_table("f", 10, F, sampler="fifo")
    l_ = client.create_table("l", 10, F, sampler="lifo")
    for t in (f, l_):
        insert_ids(t, 0, 5)
    assert ids(f.sample(3)) == [0, 0, 0]
    assert ids(l_.sample(3)) == [4, 4, 4]


def test_fifo_with_max_times_sampled_gives_each_item_n_times_in_order(client):
    t = client.create_table("f", 10, F, sampler="fifo", max_times_sampled=2)
    insert_ids(t, 0, 5)
    assert ids(t.sample(5)) == [0, 0, 1, 1, 2]
    assert ids(t.sample(3)) == [2, 3, 3]
    assert len(t) == 1


def test_uniform_sampler_draws_every_item_about_equally(client):
    t = client.create_table("u", 20, F, sampler="uniform")
    insert_ids(t, 0, 20)
    counts = np.bincount(np.concatenate([t.sample(500).data["v"] for _ in range(40)]), minlength=20)
    expected = 20000 / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 50.0, f"chi2 {chi2:.1f} with 19 dof (p < 1e-4 at 43.8)"


@pytest.mark.parametrize("remover,survivors", [("fifo", set(range(4, 12))),
                                                ("lifo", set(range(7)) | {11})])
def test_remover_picks_which_item_leaves_when_full(client, remover, survivors):
    t = client.create_table("r", 8, F, sampler="uniform", remover=remover)
    for i in range(12):  # one at a time, so each insert evicts one item
        t.insert(v=i)
        t.flush()
    got = set(np.unique(np.concatenate([t.sample(256).data["v"] for _ in range(10)])).tolist())
    assert got == survivors


def test_uniform_remover_evicts_items_at_random(client):
    t = client.create_table("r", 50, F, sampler="uniform", remover="uniform")
    for i in range(0, 150, 10):
        insert_ids(t, i, i + 10)
    got = np.unique(np.concatenate([t.sample(512).data["v"] for _ in range(10)]))
    assert len(got) == 50
    # victims are picked among committed items: the batch being inserted stays
    assert set(range(140, 150)) <= set(got.tolist())
    # each earlier item survives each batch with chance 4/5 whatever its age,
    # so survivors come from most of the 14 earlier batches (in 20,000
    # simulated runs from 8 or more; the daemon's seed is fixed besides);
    # fifo, lifo or always the first few members keep 4 batches' items
    batches = set((got[got < 140] // 10).tolist())
    assert len(batches) >= 6, sorted(got.tolist())


def test_max_times_sampled_removes_an_item_after_its_nth_sample(client):
    t = client.create_table("m", 100, F, sampler="uniform", max_times_sampled=3)
    insert_ids(t, 0, 100)
    seen = np.zeros(100, int)
    while t.can_sample(1):
        b = t.sample(min(25, 300 - int(seen.sum())))
        np.add.at(seen, b.data["v"], 1)
    assert np.all(seen == 3) and len(t) == 0
    with pytest.raises(shmreplay.EmptyTable):
        t.sample(1, timeout=0)


def table_stats(client, name):
    return client.stats()["tables"][name]  # one consistent snapshot


def start_all(procs):
    for p in procs:
        p.start()


def no_worker_failed(procs):
    """True while none of procs has exited with an error (fails the test if one has)."""
    failed = [(p.name, p.exitcode) for p in procs if p.exitcode not in (None, 0)]
    assert not failed, f"worker(s) failed: {failed}"
    return True


def wait_for_exit(procs, watch, what, probe=lambda: True):
    """Wait until every process in ``procs`` has exited 0; stop at once if any
    process in ``watch`` fails (the others may then wait for ever)."""
    wait_for(lambda: (no_worker_failed(watch) and probe()
                              and all(p.exitcode is not None for p in procs)), what, timeout=10 * HANG_S)
    no_worker_failed(procs)


def end_all(procs):
    """Kill whichever worker is still running (a failed assert must not hang the run)."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            p.kill()
    for p in procs:
        if p.pid is not None:
            p.join(10)


# ---- queues ----
def queue_actor(sock, actor, n):
    with shmreplay.connect(sock) as c:
        t = c.table("q")
        for i in range(n):
            t.insert(v=actor * 1_000_000 + i)  # waits as long as the queue is full
        t.flush()


def queue_learner(sock, warm, first, ready, go, stop, out):
    got = []
    with shmreplay.connect(sock) as c:
        t = c.table("q")
        warm.set()
        if not first.wait(10 * HANG_S):
            raise RuntimeError("never told to take a first batch")
        got.extend(ids(t.sample(7)))  # a first batch before the next learner takes one
        ready.set()
        if not go.wait(10 * HANG_S):
            raise RuntimeError("never told to go on")
        while True:
            draining = stop.is_set()  # read before the request: then no item can come after it
            try:
                got.extend(ids(t.sample(7, timeout=0.3)))
            except shmreplay.RateLimited:
                if draining:
                    break
    out.put(got)


def test_queue_delivers_each_item_exactly_once_in_order_per_actor(daemon, client):
    q = client.create_queue("q", 64, F)
    n = 350  # per actor; 1,400 = 200 batches of 7
    stop, go, out = CTX.Event(), CTX.Event(), CTX.Queue()
    warm, first, ready = ([CTX.Event() for _ in range(2)] for _ in range(3))
    actors = [CTX.Process(target=queue_actor, args=(daemon.socket, a, n), daemon=True)
              for a in range(4)]
    learners = [CTX.Process(target=queue_learner, daemon=True,
                            args=(daemon.socket, warm[i], first[i], ready[i], go, stop, out))
                for i in range(2)]
    procs = actors + learners
    try:
        start_all(learners)
        wait_for(lambda: no_worker_failed(procs) and all(w.is_set() for w in warm), "the learners to start", timeout=10 * HANG_S)
        # no learner samples yet: the actors fill the queue, then the limiter must hold them
        start_all(actors)

        def full_and_waiting():
            st = table_stats(client, "q")
            lim = st["limiter"]
            done = lim["inserts"] > 64 or (lim["inserts"] == 64 and lim["pending"] == 0
                                           and lim["waiting_inserts"] >= 1)
            return st if done else None

        st = wait_for(full_and_waiting, "the actors to fill the queue and wait")
        assert st["limiter"]["inserts"] == 64 and st["limiter"]["samples"] == 0, st["limiter"]
        assert len(q) == 64 and not q.can_insert(1)
        assert st["insert_waits"] > 0, "a full 64-item queue must make its actors wait"
        # each learner takes a batch before the next starts, then all run together
        for f, r in zip(first, ready):
            f.set()
            wait_for(lambda: no_worker_failed(procs) and r.is_set(), "a learner's first batch")
        go.set()
        wait_for_exit(actors, procs, "the actors to finish")
        wait_for(lambda: (no_worker_failed(procs)
                            and table_stats(client, "q")["limiter"]["samples"] >= 4 * n), "every item to be sampled")
        stop.set()
        per_learner = []
        deadline = time.monotonic() + 10 * HANG_S
        while len(per_learner) < len(learners):  # read before they exit: a pipe holds little
            try:
                per_learner.append(out.get(timeout=0.5))
            except queue.Empty:
                no_worker_failed(procs)
                assert time.monotonic() < deadline, "the learners never reported"
        wait_for_exit(learners, procs, "the learners to finish")
    finally:
        end_all(procs)
    delivered = [v for got in per_learner for v in got]
    want = [a * 1_000_000 + i for a in range(4) for i in range(n)]
    assert sorted(delivered) == want, "every item exactly once"
    for got in per_learner:
        assert len(got) > 0
        for a in range(4):
            mine = [v for v in got if v // 1_000_000 == a]
            assert mine == sorted(mine), f"actor {a}'s items out of order"
    st = table_stats(client, "q")
    assert st["limiter"]["inserts"] == st["limiter"]["samples"] == 4 * n and len(q) == 0
    assert st["insert_waits"] > 0


# ---- rate limiting ----
def test_an_insert_waits_through_slices_while_every_slot_is_held(start_daemon):
    """Every slot reserved or held (a learner still reading its last sample of
    a queue) is a wait like the rate limiter's: ``timeout=None`` keeps waiting
    past the client's 1 s slices, a finite timeout ends in SlotsBusy.  A
    queue waits for held slots rather than evict an item not yet sampled."""
    daemon = start_daemon(seed=1234, hold_timeout_s=3600.0)  # the holds outlast any slow run
    client = daemon.connect()
    q = client.create_queue("q", 8, F)
    insert_ids(q, 0, 8)
    learner = daemon.connect()
    keys, _, _ = learner.table("q").sample_indices(2)  # 2 items leave; their slots are held
    assert len(q) == 6 and q.can_insert(2)  # the limiter would admit 2 more: only slots lack
    with pytest.raises(shmreplay.SlotsBusy, match="held by learners") as info:
        q.insert(v=100, timeout=0.2)
    assert isinstance(info.value, shmreplay.CapacityError)
    done, box = threading.Event(), {}

    def insert_forever():
        try:
            with daemon.connect() as c:
                c.table("q").insert(v=101)  # timeout=None
        except BaseException as exc:
            box["exc"] = exc
        finally:
            done.set()

    th = threading.Thread(target=insert_forever, daemon=True)
    th.start()
    base = table_stats(client, "q")["timeouts"]
    # one of its 1 s slices ran out in the daemon and the client asked again
    wait_for(lambda: (
        (st := table_stats(client, "q"))["timeouts"] > base
        and st["limiter"]["waiting_inserts"] == 1), "a slice of the waiting insert to run out and be asked again")
    assert not done.is_set(), box
    learner.table("q").release()  # the held slots come back
    assert done.wait(HANG_S) and "exc" not in box, box
    learner.close()
    assert len(q) == 7
    client.close()


def test_sample_blocks_until_min_size_reached(client, daemon):
    t = client.create_table("m", 100, F, min_size_to_sample=50)
    insert_ids(t, 0, 49)
    assert not t.can_sample(1)
    box = {}

    def learner():
        try:
            with daemon.connect() as c2:
                box["b"] = c2.table("m").sample(10, timeout=10 * HANG_S)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            box["error"] = exc

    th = threading.Thread(target=learner, daemon=True)
    th.start()

    def held_or_answered():
        st = table_stats(client, "m")
        return box or (st if st["limiter"]["waiting_samples"] == 1 else None)

    # the daemon holds the sample (or, wrongly, answers it)
    st = wait_for(held_or_answered, "the sample to wait in the daemon")
    assert not box, f"sample answered with {len(t)} < min_size_to_sample items: {box}"
    assert st["size"] == 49 and st["sample_waits"] >= 1, st
    insert_ids(t, 49, 50)
    th.join(HANG_S)
    assert not th.is_alive() and "error" not in box, box
    assert len(box["b"]) == 10
    assert t.can_sample(1)
    assert table_stats(client, "m")["limiter"]["waiting_samples"] == 0


def test_sample_times_out_with_an_error_naming_the_limit(client):
    t = client.create_table("m", 100, F, min_size_to_sample=50)
    insert_ids(t, 0, 10)
    t0 = time.monotonic()
    with pytest.raises(shmreplay.RateLimited, match="fewer than min_size_to_sample 50"):
        t.sample(4, timeout=0.3)
    # the client raises only once its deadline has passed; the top is a hang guard
    assert 0.3 <= time.monotonic() - t0 < 30.0
    st = table_stats(client, "m")
    assert st["timeouts"] >= 1 and st["limiter"]["waiting_samples"] == 0 and len(t) == 10


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


def waiting_client(sock, what):
    with shmreplay.connect(sock) as c:
        t = c.table("w")
        if what == "sample":
            t.sample(8, timeout=None)
        else:
            t.insert(v=1, timeout=None)


def test_no_deadlock_when_clients_die_while_waiting(daemon, client):
    t = client.create_table("w", 100, F, min_size_to_sample=20, samples_per_insert=1.0,
                            error_buffer=(-5.0, 25.0))

    def limiter_shows(key, value):
        wait_for(lambda: table_stats(client, "w")["limiter"][key] == value, f"{key} to become {value}")

    def kill_while_parked(what, key):
        p = CTX.Process(target=waiting_client, args=(daemon.socket, what), daemon=True)
        try:
            p.start()
            limiter_shows(key, 1)
            os.kill(p.pid, signal.SIGKILL)
            p.join(HANG_S)
            assert p.exitcode == -signal.SIGKILL
            limiter_shows(key, 0)
        finally:
            end_all([p])

    insert_ids(t, 0, 10)   # below min size: a sample waits
    kill_while_parked("sample", "waiting_samples")
    insert_ids(t, 10, 25)  # 25 inserts x 1 - 0 samples = max_diff: an insert waits
    kill_while_parked("insert", "waiting_inserts")
    assert table_stats(client, "w")["limiter"]["pending"] == 0
    # everyone else carries on: a sample frees room, an insert goes through
    # (both can run at once; the timeouts only catch a hang)
    assert t.can_sample(4)
    assert len(t.sample(4, timeout=HANG_S)) == 4
    assert t.can_insert(1)
    t.insert(v=100, timeout=HANG_S)
    t.flush()
    assert len(t) == 26


def test_a_waiting_request_does_not_hold_up_other_tables(daemon, client):
    a = client.create_table("w", 100, F, min_size_to_sample=50)
    b = client.create_table("free", 100, F)
    insert_ids(b, 0, 10)
    box = {}

    def stuck():
        try:
            with daemon.connect() as c2:
                box["b"] = c2.table("w").sample(4, timeout=10 * HANG_S)  # until "w" holds 50
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            box["error"] = exc

    th = threading.Thread(target=stuck, daemon=True)
    th.start()

    def parked():
        """(parks so far, timeouts so far) while the sample on "w" is parked."""
        st = table_stats(client, "w")
        return (st["sample_waits"], st["timeouts"]) if st["limiter"]["waiting_samples"] == 1 else None

    # Round trips on "free" that all start and end inside one and the same
    # park of the sample on "w" (parked before and after, never re-parked):
    # the daemon served "free" while it held that request.  The client asks
    # for long waits in slices, so a run that straddles a slice is retried.
    deadline = time.monotonic() + HANG_S
    k = 10
    while True:
        before = wait_for(parked, "the sample on 'w' to wait in the daemon")
        for i in range(20):
            assert len(b.sample(8)) == 8
            insert_ids(b, k, k + 2)
            k += 2
        if parked() == before:
            break
        assert time.monotonic() < deadline, "no run of round trips fitted inside one wait"
    assert not box, box
    assert len(a) == 0
    insert_ids(a, 0, 50)  # now the waiting sample can run
    th.join(HANG_S)
    assert not th.is_alive() and "error" not in box, box
    assert len(box["b"]) == 4 and len(a) == 50


# ---- several tables ----
def test_a_learner_samples_several_tables_at_once(client):
    x = client.create_table("x", 100, F)
    y = client.create_table("y", 100, {"w": ("float32", (3,))}, sampler="uniform")
    insert_ids(x, 0, 10)
    y.insert_batch({"w": np.ones((5, 3), np.float32)})
    y.flush()
    out = client.sample_many({"x": 16, y: 8})
    assert set(out) == {"x", "y"} and len(out["x"]) == 16 and out["y"].data["w"].shape == (8, 3)
    assert set(ids(out["x"])) <= set(range(10))
    with pytest.raises(shmreplay.EmptyTable):
        client.create_table("z", 10, F)
        client.sample_many({"x": 4, "z": 4}, timeout=0)
    assert len(client.sample_many({"x": 4})["x"]) == 4, "the client is still usable"


# ---- configuration ----
def test_every_limit_is_settable_in_the_daemon_config(start_daemon):
    tables = [
        {"name": "impala", "capacity": 64, "sampler": "fifo", "remover": "fifo",
         "max_times_sampled": 1, "samples_per_insert": 1.0, "error_buffer": [0.0, 64.0],
         "fields": {"v": ("int64", ())}},
        {"name": "apex", "capacity": 100, "sampler": "prioritized", "alpha": 0.9,
         "remover": "lifo", "min_size_to_sample": 10, "samples_per_insert": 8.0,
         "error_buffer": 40.0, "fields": {"v": ("int64", ())}},
    ]
    d = start_daemon(tables=tables)
    with d.connect() as c:
        q, a = c.table("impala"), c.table("apex")
        assert (q.spec.sampler, q.spec.max_times_sampled, q.spec.diff_bounds) == ("fifo", 1, (0.0, 64.0))
        assert (a.spec.remover, a.spec.min_size_to_sample, a.spec.diff_bounds) == ("lifo", 10, (40.0, 120.0))
        insert_ids(q, 0, 3)
        assert ids(q.sample(3)) == [0, 1, 2] and len(q) == 0
        with pytest.raises(shmreplay.RateLimited, match="min_size_to_sample 10"):
            a.sample(1, timeout=0)


def test_rows_overwritten_between_draw_and_gather_are_drawn_again(daemon, client):
    """Issue 13 item 3: the redraw path, forced.  Every slot a SAMPLE drew is
    overwritten by another client before the learner gathers: the gather's
    stamp re-check must notice each one and draw again, so the batch holds
    only rows of the new items, each matching its key."""
    t = client.create_table("rd", 16, F, sampler="uniform")
    insert_ids(t, 0, 16)
    ticket = t.begin_sample(16, 0.4, 0.0)  # drawn now, gathered below
    with daemon.connect() as other:
        insert_ids(other.table("rd"), 100, 116)  # every slot, each stamp bumped
    b = t.finish_sample(ticket, 16, 0.4, None, 0.0)
    assert b.redraws >= 16, b.redraws
    assert set(ids(b)) <= set(range(100, 116))
    # each returned key names the slot its row came from, under the slot's stamp now
    slots = key_slots(b.keys)
    assert np.array_equal(t._map.fields["v"][slots], b.data["v"])
    assert np.array_equal(t._map.gens[slots], (b.keys >> 32).astype(np.uint32))


def test_parked_samples_are_served_oldest_first(daemon, client):
    """Issue 13 item 4: requests a table's limits hold back are served in
    the order they parked.  Each item can be sampled once; two learners park
    on the empty table one after the other; one item arrives: the first
    learner gets it, the second keeps waiting for the next one."""
    t = client.create_table("o", 8, F, sampler="fifo", max_times_sampled=1)
    got: dict = {}

    def learner(name):
        with daemon.connect() as c:
            got[name] = ids(c.table("o").sample(1, timeout=HANG_S))

    threads = {}
    for k, name in enumerate(("first", "second")):
        threads[name] = threading.Thread(target=learner, args=(name,), daemon=True)
        threads[name].start()
        wait_for(lambda: client.stats()["tables"]["o"]["limiter"]["waiting_samples"] == k + 1,
                 f"the {name} learner to park")
    insert_ids(t, 0, 1)
    threads["first"].join(HANG_S)
    assert got == {"first": [0]}  # the older request took the one item
    assert client.stats()["tables"]["o"]["limiter"]["waiting_samples"] == 1
    insert_ids(t, 1, 2)
    threads["second"].join(HANG_S)
    assert got == {"first": [0], "second": [1]}
