"""Replay semantics over a real daemon and real client processes:
selectors, removers, reuse limits, queues, rate limiting, several tables."""

import multiprocessing as mp
import os
import signal
import threading
import time

import numpy as np
import pytest

import shmreplay

F = {"v": ("int64", ())}
CTX = mp.get_context("spawn")


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
    got = set(np.unique(np.concatenate([t.sample(512).data["v"] for _ in range(10)])).tolist())
    assert len(got) == 50
    assert min(got) < 100, "fifo would have kept only 100..149"


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


# ---- queues ----
def queue_actor(sock, actor, n):
    with shmreplay.connect(sock) as c:
        t = c.table("q")
        for i in range(n):
            t.insert(v=actor * 1_000_000 + i, timeout=60)


def queue_learner(sock, out, stop):
    got = []
    with shmreplay.connect(sock) as c:
        t = c.table("q")
        while True:
            try:
                got.extend(ids(t.sample(7, timeout=0.3)))
            except shmreplay.RateLimited:
                if stop.is_set():
                    break
    out.put(got)


def test_queue_delivers_each_item_exactly_once_in_order_per_actor(daemon, client):
    client.create_queue("q", 64, F)
    n = 700  # per actor; 2,800 = 400 batches of 7
    stop, out = CTX.Event(), CTX.Queue()
    learners = [CTX.Process(target=queue_learner, args=(daemon.socket, out, stop)) for _ in range(2)]
    actors = [CTX.Process(target=queue_actor, args=(daemon.socket, a, n)) for a in range(4)]
    for p in learners + actors:
        p.start()
    for p in actors:
        p.join(120)
        assert p.exitcode == 0
    stop.set()
    per_learner = [out.get(timeout=60) for _ in learners]
    for p in learners:
        p.join(30)
    delivered = [v for got in per_learner for v in got]
    want = [a * 1_000_000 + i for a in range(4) for i in range(n)]
    assert sorted(delivered) == want, "every item exactly once"
    for got in per_learner:
        assert len(got) > 0
        for a in range(4):
            mine = [v for v in got if v // 1_000_000 == a]
            assert mine == sorted(mine), f"actor {a}'s items out of order"
    st = client.stats()["tables"]["q"]
    assert st["limiter"]["inserts"] == 4 * n
    assert st["insert_waits"] > 0, "a 64-item queue fed by 4 actors must have made them wait"


# ---- rate limiting ----
def test_sample_blocks_until_min_size_reached(client, daemon):
    t = client.create_table("m", 100, F, min_size_to_sample=50)
    insert_ids(t, 0, 49)
    assert not t.can_sample(1)
    box = {}

    def learner():
        with daemon.connect() as c2:
            t0 = time.monotonic()
            box["b"] = c2.table("m").sample(10, timeout=10)
            box["waited"] = time.monotonic() - t0

    th = threading.Thread(target=learner)
    th.start()
    time.sleep(0.5)
    assert "b" not in box, "sampled before min_size_to_sample items were in"
    insert_ids(t, 49, 50)
    th.join(10)
    assert len(box["b"]) == 10 and box["waited"] >= 0.3
    assert t.can_sample(1)


def test_sample_times_out_with_an_error_naming_the_limit(client):
    t = client.create_table("m", 100, F, min_size_to_sample=50)
    insert_ids(t, 0, 10)
    t0 = time.monotonic()
    with pytest.raises(shmreplay.RateLimited, match="fewer than min_size_to_sample 50"):
        t.sample(4, timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 3.0


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


def limited_actor(sock, seconds, pause):
    with shmreplay.connect(sock) as c:
        t = c.table("rl")
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            try:
                t.insert_batch({"v": np.arange(i, i + 4)}, timeout=0.2)
                i += 4
            except shmreplay.RateLimited:
                pass
            if pause:
                time.sleep(pause)


def limited_learner(sock, seconds, pause):
    with shmreplay.connect(sock) as c:
        t = c.table("rl")
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            try:
                t.sample(16, timeout=0.2)
            except shmreplay.RateLimited:
                pass
            if pause:
                time.sleep(pause)


@pytest.mark.parametrize("actor_pause,learner_pause,waits", [(0.0, 0.01, "insert_waits"),
                                                             (0.01, 0.0, "sample_waits")])
def test_rate_limiter_keeps_the_ratio_within_its_error_buffer_for_10s(
        daemon, client, actor_pause, learner_pause, waits):
    spi, lo, hi = 4.0, 100.0 - 60.0, 100.0 + 60.0
    client.create_table("rl", 2000, F, sampler="uniform", samples_per_insert=spi,
                        min_size_to_sample=25, error_buffer=60.0)
    seconds = 10.0
    procs = [CTX.Process(target=limited_actor, args=(daemon.socket, seconds, actor_pause))
             for _ in range(2)]
    procs.append(CTX.Process(target=limited_learner, args=(daemon.socket, seconds, learner_pause)))
    for p in procs:
        p.start()
    seen = 0
    end = time.monotonic() + seconds + 1
    while time.monotonic() < end:
        lim = client.stats()["tables"]["rl"]["limiter"]  # one consistent snapshot
        diff = lim["inserts"] * spi - lim["samples"]
        assert diff <= hi + 1e-9, lim
        if lim["samples"]:
            assert diff >= lo - 1e-9, lim
            seen += 1
        time.sleep(0.05)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    st = client.stats()["tables"]["rl"]
    lim = st["limiter"]
    assert seen > 100 and lim["samples"] > 1000
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
    deadline = time.monotonic() + 60

    def wait_for(key, value):
        while client.stats()["tables"]["w"]["limiter"][key] != value:
            assert time.monotonic() < deadline, f"{key} never became {value}"
            time.sleep(0.02)

    def kill_while_parked(what, key):
        p = CTX.Process(target=waiting_client, args=(daemon.socket, what))
        p.start()
        wait_for(key, 1)
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        wait_for(key, 0)

    insert_ids(t, 0, 10)   # below min size: a sample waits
    kill_while_parked("sample", "waiting_samples")
    insert_ids(t, 10, 25)  # 25 inserts x 1 - 0 samples = max_diff: an insert waits
    kill_while_parked("insert", "waiting_inserts")
    assert client.stats()["tables"]["w"]["limiter"]["pending"] == 0
    # everyone else carries on: a sample frees room, an insert goes through
    assert len(t.sample(4, timeout=5)) == 4
    t.insert(v=100, timeout=5)
    t.flush()
    assert len(t) == 26


def test_a_waiting_request_does_not_hold_up_other_tables(daemon, client):
    a = client.create_table("w", 100, F, min_size_to_sample=50)
    b = client.create_table("free", 100, F)
    insert_ids(b, 0, 10)
    done = threading.Event()

    def stuck():
        with daemon.connect() as c2:
            with pytest.raises(shmreplay.RateLimited):
                c2.table("w").sample(4, timeout=3.0)
        done.set()

    th = threading.Thread(target=stuck)
    th.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    for _ in range(50):
        b.sample(8)
        insert_ids(b, 10, 12)
    assert time.monotonic() - t0 < 2.0 and not done.is_set()
    th.join(10)
    assert done.is_set() and len(a) == 0


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
