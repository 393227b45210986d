"""Issue 25: remote producers on a real two-node Ray cluster (both nodes
on 127.0.0.1, each with its own resource label: benchmarks/
harness/raycluster.py) feed a table through an ingest actor pinned to the replay
node.  The cluster is started once for this module and stopped at the end."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")
import shmreplay  # noqa: E402
import shmreplay.ray as sray  # noqa: E402
from daemons import checkout_env  # noqa: E402
from rayfixtures import HOLD_MAX, before_the_ingest_thread, cluster  # noqa: E402,F401 (a fixture)
from rayproducer import BACK, FIELDS, GONE, LIVE, P, QUIET, Producer, rows  # noqa: E402
from benchmarks.harness.raycluster import ENV  # noqa: E402
from shmreplay.ray.packing import layout_id, row_dtype  # noqa: E402
from waiting import HANG_S, wait_for  # noqa: E402


HERE = os.path.dirname(os.path.abspath(__file__))
# one pytest-xdist worker runs every test that starts Ray (this module's
# cluster, the docs' local-Ray snippet): one Ray at a time on the box
pytestmark = pytest.mark.xdist_group("ray")


def test_remote_producers_feed_the_table_through_an_ingest_on_the_replay_node(cluster, start_daemon):
    d = start_daemon(tables=[{"name": "t", "capacity": 4096, "fields": FIELDS}])
    ingest = sray.start_ingest(d.socket, "t", node_id=cluster)
    producers = [Producer.remote(ingest, 64, 2) for _ in range(3)]
    assert ray.get(ingest.stats.remote())["node"] == cluster
    assert all(ray.get(p.node.remote()) != cluster for p in producers)  # on the other node
    done = ray.get([p.write.remote(np.arange(k * 10_000, k * 10_000 + 500), k == 0)
                    for k, p in enumerate(producers)], timeout=HANG_S)
    assert done[0] == 8  # 500 rows one by one in chunks of 64: 7 full and the rest at flush
    with d.connect() as c:
        t = c.table("t")
        assert len(t) == 1500
        b = t.sample(1500)
        got = np.unique(b.data["id"])
        want = np.concatenate([np.arange(k * 10_000, k * 10_000 + 500) for k in range(3)])
        assert set(got.tolist()) <= set(want.tolist())
        np.testing.assert_array_equal(b.data["obs"], rows(b.data["id"])["obs"])  # nothing torn
    stats = ray.get(ingest.stats.remote())
    assert stats["rows"] == 1500 and stats["chunks"] == 3 * 8
    assert stats["packed"] == 3 * 8  # small chunks travel as one byte array each (packing.py)
    assert stats["flushes"] <= 3 + 3  # confirmation is batched: once per 16 chunks, once per producer's flush
    # the plain call, for a driver that inserts now and then: inserted and flushed when it returns
    assert ray.get(ingest.insert.remote(rows(np.arange(90_000, 90_010)), None), timeout=HANG_S) == 10
    with d.connect() as c:
        assert len(c.table("t")) == 1510
    ray.kill(ingest)


def held_by_a_full_queue(c, d, cluster, capacity: int, n: int):
    """A queue of ``capacity`` items, its ingest, and a producer (chunks of
    16, 2 in flight, 2 held unconfirmed) writing ids 0..n-1 one by one, once
    the ingest waits in the daemon with a chunk the limiter holds (no
    learner yet): (queue, ingest, producer, its write)."""
    q = c.create_queue("q", capacity, FIELDS)
    ingest = sray.start_ingest(d.socket, "q", node_id=cluster)
    p = Producer.remote(ingest, 16, 2, 2)
    job = p.write.remote(np.arange(n), True)
    wait_for(lambda: c.stats()["tables"]["q"]["limiter"]["waiting_inserts"] == 1,
             "the ingest to wait for the limiter with a chunk")
    # the queue's chunks, one waiting in the limiter, one more sent and one
    # waiting for room: then the producer waits
    wait_for(lambda: ray.get(p.progress.remote())[0] == capacity // 16 + 3, "the producer to be held")
    return q, ingest, p, job


def test_the_ingest_forgets_what_it_owes_a_producer_that_stopped_calling(cluster, start_daemon):
    """A producer that died never collects the sequence numbers flushed
    after its last answer: past ``forget_s`` the ingest drops them."""
    d = start_daemon(tables=[{"name": "t", "capacity": 4096, "fields": FIELDS}])
    ingest = sray.start_ingest(d.socket, "t", node_id=cluster, flush_every=1000, forget_s=0)
    assert ray.get(ingest.put.remote(rows(np.arange(8)), [None, GONE, 1, False, None]), timeout=HANG_S)[1] == []
    # another producer's flush vouches for "gone"'s chunk, which "gone" will never hear of
    assert ray.get(ingest.sync.remote(LIVE), timeout=HANG_S)[0] == 0
    stats = ray.get(ingest.stats.remote())
    assert stats["forgotten"] == 0 and stats["producers"] == 2  # "gone" was calling until now
    assert ray.get(ingest.sync.remote(LIVE), timeout=HANG_S)[1] == []
    stats = ray.get(ingest.stats.remote())
    assert stats["forgotten"] == 1 and stats["producers"] == 1  # what "gone" was owed is dropped
    # a producer silent past forget_s that calls again is told what it is owed, not forgotten
    ray.get(ingest.put.remote(rows(np.arange(8, 16)), [None, BACK, 7, False, None]), timeout=HANG_S)
    ray.get(ingest.sync.remote(LIVE), timeout=HANG_S)  # vouches for "back"'s chunk
    assert ray.get(ingest.sync.remote(BACK), timeout=HANG_S)[1] == [7]
    with d.connect() as c:
        assert len(c.table("t")) == 16  # forgetting drops bookkeeping, never rows
    with pytest.raises(shmreplay.ReplayError, match="forget_s must be"):
        sray.start_ingest(d.socket, "t", node_id=cluster, forget_s=-1)
    ray.kill(ingest)


def test_small_chunks_are_inserted_together_and_none_waits_for_a_call(cluster, start_daemon):
    """Small chunks between two flushes are inserted as one batch per run
    of priorities given or not (coalesce.py), each row with its own
    priority; chunks held with no call after them are inserted by the
    ingest's thread (a quiet producer's rows become sampleable); with
    ``hold_s=0`` each chunk is inserted when it comes."""
    d = start_daemon(tables=[{"name": "t", "capacity": 64, "fields": FIELDS}])
    prios = np.arange(1.0, 9.0)
    # ids as uint64: cast to the table's int64 when held (concatenated with int64 they would be float64)
    unsigned = {k: v.astype(np.uint64) if k == "id" else v for k, v in rows(np.arange(16, 24)).items()}
    with d.connect() as c:
        def held_then_flushed(k):
            # hold_s at its most: the thread leaves the chunks to the calls (counts read within it)
            name = f"batch{k}"
            c.create_table(name, 64, FIELDS, sampler="prioritized", alpha=1.0)
            ingest = sray.start_ingest(d.socket, name, node_id=cluster, flush_every=1000, hold_s=HOLD_MAX)
            ray.get(ingest.stats.remote(), timeout=HANG_S)  # serving: its start is no part of the window
            t0 = time.monotonic()
            ray.get(ingest.put.remote(rows(np.arange(8)), [prios, P, 1, False, None]), timeout=HANG_S)
            ray.get(ingest.put.remote(rows(np.arange(8, 16)), [None, P, 2, False, None]), timeout=HANG_S)
            before = ray.get(ingest.stats.remote())
            acked = ray.get(ingest.put.remote(unsigned, [None, P, 3, True, None]), timeout=HANG_S)[1]
            after = ray.get(ingest.stats.remote())
            seconds = time.monotonic() - t0
            ray.kill(ingest)
            return seconds, (name, before, acked, after)

        name, before, acked, after = before_the_ingest_thread(held_then_flushed)
        assert (before["held"], before["inserts"]) == (2, 0)
        assert acked == [1, 2, 3]
        assert (after["held"], after["inserts"], after["chunks"], after["flushes"]) == (0, 2, 3, 1)  # runs: [1], [2, 3]
        t = c.table(name)
        b = t.sample(512)
        assert len(t) == 24 and set(b.data["id"].tolist()) == set(range(24))
        # alpha 1: P(i) is i's priority over the total; unprioritized rows got the max so far (8)
        want = np.where(b.data["id"] < 8, b.data["id"] + 1.0, 8.0)
        np.testing.assert_allclose(b.probabilities, want / (prios.sum() + 16 * 8.0))
        np.testing.assert_array_equal(b.data["obs"], rows(b.data["id"])["obs"])

    ingest = sray.start_ingest(d.socket, "t", node_id=cluster, flush_every=1000)  # hold_s: 0.05 s
    ray.get(ingest.put.remote(rows(np.arange(24, 32)), [None, QUIET, 1, False, None]), timeout=HANG_S)
    with d.connect() as c:  # no call inserts it: the thread does, unconfirmed (nothing flushed)
        wait_for(lambda: len(c.table("t")) == 8, "a held chunk to be inserted with no call after it")
    stats = ray.get(ingest.stats.remote())
    assert (stats["held"], stats["inserts"], stats["flushes"], stats["release_errors"]) == (0, 1, 0, 0)
    ray.kill(ingest)

    ingest = sray.start_ingest(d.socket, "t", node_id=cluster, flush_every=1000, hold_s=0)
    for k in range(2):
        ray.get(ingest.put.remote(rows(np.arange(32 + 8 * k, 40 + 8 * k)), [None, P, k, False, None]), timeout=HANG_S)
    stats = ray.get(ingest.stats.remote())
    assert (stats["held"], stats["inserts"]) == (0, 2)
    # a writer packs rows the table's check would pass (float64 obs: cast), sends the rest as they are
    w = sray.RemoteWriter(ingest, chunk=8)
    data = rows(np.arange(48, 56))
    w.insert_batch({"id": data["id"], "obs": data["obs"].astype(np.float64)})
    w.flush()
    assert ray.get(ingest.stats.remote())["packed"] == 1
    with d.connect() as c:
        b = c.table("t").sample(512)
        got = b.data["id"] >= 48
        assert set(b.data["id"][got].tolist()) == set(range(48, 56))
        np.testing.assert_array_equal(b.data["obs"][got], rows(b.data["id"][got])["obs"])
    w.insert_batch({"id": np.arange(56, 60)})
    with pytest.raises(sray.ChunkRefused, match="missing field"):
        w.flush()
    with pytest.raises(ray.exceptions.RayTaskError, match="packed chunk has rows of 40 bytes"):
        ray.get(ingest.put.remote(np.zeros((4, 39), np.uint8), [None, P, 9, False, None]), timeout=HANG_S)
    # packed for another layout of the same width (a table made anew with other fields)
    other = row_dtype({"obs": ("float32", (8,)), "id": ("int64", ())})
    with pytest.raises(ray.exceptions.RayTaskError, match="packed for other fields"):
        ray.get(ingest.put.remote(np.zeros((4, 40), np.uint8), [None, P, 9, False, layout_id(other)]),
                timeout=HANG_S)
    for bad in (-1, 11, "1", True):
        with pytest.raises(shmreplay.ReplayError, match="hold_s must be"):
            sray.start_ingest(d.socket, "t", node_id=cluster, hold_s=bad)
    ray.kill(ingest)


def test_a_rate_limited_table_holds_remote_producers_back(cluster, start_daemon):
    """A queue of 64 items and no learner: the producer stops with at most
    in_flight + hold (+ 1 waiting for room) chunks unconfirmed (nothing piles up anywhere), then
    delivers every row once, in order, as the learner takes them."""
    d = start_daemon()
    with d.connect() as c:
        q, ingest, p, job = held_by_a_full_queue(c, d, cluster, 64, 400)
        sent, confirmed, most, now = ray.get(p.progress.remote())
        assert sent - confirmed == now <= 5 and most <= 5 and len(q) <= 64  # in_flight + hold + 1
        taken = []
        while len(taken) < 400:
            taken += q.sample(16, timeout=HANG_S).data["id"].tolist()
        assert taken == list(range(400))
        assert ray.get(job, timeout=HANG_S) == 25
        assert ray.get(p.progress.remote())[2] <= 5
    ray.kill(ingest)


@pytest.mark.parametrize("breakage", ["ingest killed", "daemon restarted"])
def test_remote_producers_lose_nothing_confirmed_when_the_ingest_or_the_daemon_goes(
        cluster, start_daemon, breakage):
    """Producers pause with their chunks so far inserted but none confirmed
    (the ingest flushes only when asked, and its thread inserts the small
    chunks it held), the ingest is killed (Ray
    restarts it) or the daemon is SIGKILLed and started again (it adopts
    the table); the producers go on: every chunk the break may have lost is
    sent again, every row arrives, none torn (at-least-once: a re-sent
    chunk may be stored twice)."""
    d = start_daemon(tables=[{"name": "t", "capacity": 8192, "fields": FIELDS}])
    ingest = sray.start_ingest(d.socket, "t", node_id=cluster, flush_every=1000)
    producers = [Producer.remote(ingest, 16, 2, 1000) for _ in range(2)]
    jobs = [p.write.remote(np.arange(k * 10_000, k * 10_000 + 1000), True, 400, False)
            for k, p in enumerate(producers)]
    wait_for(lambda: all(ray.get([p.is_paused.remote() for p in producers])), "the producers to pause")
    assert [ray.get(p.progress.remote())[1] for p in producers] == [0, 0]  # nothing confirmed yet
    # the held chunks inserted (the ingest's thread, hold_s after they came): a restart loses them
    wait_for(lambda: ray.get(ingest.stats.remote())["held"] == 0, "the ingest to insert the chunks it held")
    if breakage == "ingest killed":
        ray.kill(ingest, no_restart=False)
    else:
        d.crash()
        d.start()
    ray.get([p.resume.remote() for p in producers])
    ray.get(jobs, timeout=HANG_S)
    assert all(ray.get(p.resent.remote()) >= 1 for p in producers)
    with d.connect() as c:
        t = c.table("t")
        b = t.sample(len(t))
        ids = set(b.data["id"].tolist())
        want = set(range(1000)) | set(range(10_000, 11_000))
        assert ids == want, sorted(want - ids)[:10]
        np.testing.assert_array_equal(b.data["obs"], rows(b.data["id"])["obs"])
        assert len(t) <= 2000 + 2 * (400 + 2 * 16)  # duplicates: at most the unconfirmed rows
    ray.kill(ingest)


def test_a_chunk_in_flight_when_the_ingest_dies_is_sent_again(cluster, start_daemon):
    """The ingest waits in the daemon with a chunk (a full queue, no
    learner) when it is killed: that call fails in the producer, which sends
    the chunk again to the restarted ingest; every row arrives."""
    d = start_daemon()
    with d.connect() as c:
        q, ingest, p, job = held_by_a_full_queue(c, d, cluster, 32, 200)
        ray.kill(ingest, no_restart=False)
        taken = []
        while len(set(taken)) < 200:
            taken += q.sample(8, timeout=HANG_S).data["id"].tolist()
        assert set(taken) == set(range(200))
        assert ray.get(job, timeout=HANG_S) >= 13 and ray.get(p.resent.remote()) >= 1
    ray.kill(ingest)


NSTEP = {"observation": ("float32", (2,)), "a": ("int32", ()), "r": ("float32", ()),
         "gamma_t": ("float32", ()), "next_observation": ("float32", (2,))}


def test_remote_step_writers_store_what_the_local_ones_do(cluster, start_daemon):
    from rayproducer import nstep_episodes, sequence_steps
    from test_writers import nstep_reference
    rng = np.random.default_rng(4)
    episodes = []
    for _ in range(6):
        k = int(rng.integers(1, 12))
        obs = rng.normal(size=(k + 1, 2)).astype(np.float32)
        episodes.append(([(obs[i], int(rng.integers(4)), float(rng.normal()), obs[i + 1]) for i in range(k)],
                         "terminated" if rng.random() < 0.5 else "truncated"))
    seq_fields = {"x": ("int64", (5,)), "h": ("float32", (3,)), "length": ("int32", ())}
    d = start_daemon(tables=[{"name": "n", "capacity": 512, "fields": NSTEP},
                             {"name": "s", "capacity": 512, "fields": seq_fields},
                             {"name": "local", "capacity": 512, "fields": seq_fields}])
    roles = {"obs": "observation", "action": "a", "reward": "r", "discount": "gamma_t",
             "next_obs": "next_observation"}
    ingest_n = sray.start_ingest(d.socket, "n", node_id=cluster)
    ingest_s = sray.start_ingest(d.socket, "s", node_id=cluster)
    ray.get(nstep_episodes.remote(ingest_n, episodes, 3, 0.9, roles), timeout=HANG_S)
    seqs = [[(100 * e + i, np.full(3, i, np.float32)) for i in range(int(rng.integers(1, 14)))]
            for e in range(5)]
    ray.get(sequence_steps.remote(ingest_s, seqs, 5, 2), timeout=HANG_S)
    with d.connect() as c:
        from readback import committed  # every item in commit order
        got, _ = committed(c.table("n"))
        want = nstep_reference(episodes, 3, 0.9)
        assert len(got["r"]) == len(want)
        np.testing.assert_array_equal(got["observation"], [w[0] for w in want])
        np.testing.assert_array_equal(got["a"], [w[1] for w in want])
        np.testing.assert_allclose(got["r"], [w[2] for w in want], rtol=1e-5)
        np.testing.assert_allclose(got["gamma_t"], [w[3] for w in want], rtol=1e-6)
        np.testing.assert_array_equal(got["next_observation"], [w[4] for w in want])
        # the same steps through a local SequenceWriter: the same items
        local = c.table("local")
        with shmreplay.SequenceWriter(local, length=5, period=2) as w:
            for steps in seqs:
                for x, h in steps:
                    w.append(x=x, h=h)
                w.end_episode()
        local.flush()
        a, _ = committed(c.table("s"))
        b, _ = committed(local)
        for k in seq_fields:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    ray.kill(ingest_n)
    ray.kill(ingest_s)


def test_apex_dqn_runs_its_actors_on_the_remote_node(cluster, tmp_path):
    """Issue 25, item 2, smoke: clients/apex_dqn.py --ray with its actors
    confined to the second node's resource label; data flows end to end
    and nothing is left behind.  (Learning to 475 is a README command.)"""
    import csv
    import re
    address = ray.get_runtime_context().gcs_address
    name = f"test{os.getpid()}apexray"
    env = checkout_env(**ENV)
    p = subprocess.run([sys.executable, os.path.join(os.path.dirname(HERE), "clients", "apex_dqn.py"),
                        "--ray", address, "--actor-resource", "remote_node", "--actors", "1", "--envs", "2",
                        "--max-batches", "5", "--batch", "32", "--max-minutes", "8", "--target-return", "1e9",
                        "--min-size", "100", "--out", str(tmp_path), "--instance", name],
                       capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]  # 3: stopped before the target (docs/guide.md, "Example programs")
    done = re.search(r"([\d,]+) env steps, ([\d,]+) batches", p.stdout)
    assert done and int(done.group(1).replace(",", "")) > 0 and done.group(2) == "5", p.stdout[-2000:]
    assert list(csv.DictReader(open(tmp_path / "apex_dqn.csv")))
    assert not [n for n in os.listdir("/dev/shm") if name in n]


def test_a_producer_killed_mid_stream_loses_only_its_unconfirmed_chunks_and_tears_none(cluster, start_daemon):
    """What it had confirmed is in; of what it sent after, each chunk is in
    whole or not at all; the ingest goes on serving another producer."""
    d = start_daemon(tables=[{"name": "t", "capacity": 8192, "fields": FIELDS}])
    ingest = sray.start_ingest(d.socket, "t", node_id=cluster)
    doomed, other = Producer.remote(ingest, 16, 2), Producer.remote(ingest, 16, 2)
    job = doomed.write.remote(np.arange(4000), True, 400)     # 400 rows confirmed, then it waits
    wait_for(lambda: ray.get(doomed.is_paused.remote()), "the producer to confirm its first rows")
    doomed.resume.remote()
    wait_for(lambda: ray.get(doomed.progress.remote())[1] >= 26, "chunks past the first 400 rows")
    ray.kill(doomed)                                          # mid-stream, chunks in flight
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(job, timeout=HANG_S)
    assert ray.get(other.write.remote(np.arange(10_000, 10_100), False), timeout=HANG_S) >= 7
    with d.connect() as c:
        t = c.table("t")
        b = t.sample(len(t))
        ids = set(b.data["id"].tolist())
        np.testing.assert_array_equal(b.data["obs"], rows(b.data["id"])["obs"])   # nothing torn
    assert set(range(400)) <= ids and set(range(10_000, 10_100)) <= ids
    for lo in range(400, 4000, 16):                            # whole chunks or nothing
        part = ids & set(range(lo, lo + 16))
        assert len(part) in (0, 16), (lo, sorted(part))
    ray.kill(ingest)


def test_a_frame_table_is_fed_through_the_ingest_and_stores_each_frame_once(cluster, start_daemon):
    """Issue 37: the ingest inserts full stacks into a frame table as any
    client does (``FrameTable.insert_batch``): each frame stored once, every
    stack sampled whole."""
    from framestreams import FIELDS as PX, FRAMES, check_items, stack, tag
    d = start_daemon(tables=[{"name": "px", "capacity": 256, "fields": PX, "frames": FRAMES}])
    ingest = sray.start_ingest(d.socket, "px", node_id=cluster)
    items = [{"obs": stack(0, 0, i), "next_obs": stack(0, 0, i + 1), "action": i, "reward": float(i),
              "discount": 0.5, "tag": tag(0, 0, i)} for i in range(120)]
    chunk = {k: np.stack([np.asarray(it[k]) for it in items]) for k in items[0]}
    assert ray.get(ingest.insert.remote(chunk, None), timeout=HANG_S) == 120
    ray.kill(ingest)
    with d.connect() as c:
        t = c.table("px")
        from readback import committed_stacks
        data, _ = committed_stacks(t)
        assert check_items(data, length=10**6, n=1) == 120
        assert check_items(t.sample(64).data, length=10**6, n=1) == 64
        wait_for(lambda: c.stats()["tables"]["px"]["frames"]["in_leases"] == 0, "the ingest's leases back")
        assert c.stats()["tables"]["px"]["frames"]["rings"]["obs"]["held"] == 121  # frames 0..120, once
