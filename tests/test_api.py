"""The client API against a real daemon: tables, insert, sample (one
table or several at once), priorities, stats."""

import json
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

import shmreplay
from shmreplay.wire.records import key_slots
from conftest import SMALL_FIELDS
from items import F, ids, insert_ids
from readback import committed


def rows(start, n):
    """Items whose every field is derived from the action id, so any row
    can be checked on its own."""
    a = np.arange(start, start + n, dtype=np.int64)
    obs = (a[:, None, None, None] + np.zeros((1, 4, 8, 8), dtype=np.int64)) % 256
    return {"obs": obs.astype(np.uint8), "action": a, "reward": (a * 0.5).astype(np.float32)}


def assert_rows_consistent(data):
    a = data["action"]
    np.testing.assert_array_equal(data["obs"], np.broadcast_to((a % 256).astype(np.uint8)[:, None, None, None], data["obs"].shape))
    np.testing.assert_array_equal(data["reward"], (a * 0.5).astype(np.float32))


def test_create_insert_flush_sample_round_trip(client):
    t = client.create_table("dqn", capacity=1000, fields=SMALL_FIELDS)
    assert len(t) == 0
    t.insert_batch(rows(0, 300))
    t.insert(obs=np.full((4, 8, 8), 44, np.uint8), action=300, reward=150.0)
    t.flush()
    assert len(t) == 301
    b = t.sample(256, beta=0.4)
    assert b.data["obs"].shape == (256, 4, 8, 8) and b.data["obs"].dtype == np.uint8
    assert b.data["action"].shape == (256,)
    assert b.keys.dtype == np.uint64 and b.weights.shape == (256,) and b.probabilities.shape == (256,)
    assert_rows_consistent(b.data)  # the single insert fits the pattern too: 300 % 256 == 44
    assert set(b.data["action"].tolist()) <= set(range(301))
    np.testing.assert_array_equal(b.indices, key_slots(b.keys))
    # every item, batch and single insert alike, stored whole, in order
    got, _ = committed(t)
    np.testing.assert_array_equal(got["action"], np.arange(301))
    assert_rows_consistent(got)


def test_table_attaches_by_name_from_another_client(daemon, client):
    client.create_table("shared", capacity=100, fields=SMALL_FIELDS)
    client.table("shared").insert_batch(rows(0, 10))
    client.flush()
    with daemon.connect() as other:
        t = other.table("shared")
        assert len(t) == 10
        assert_rows_consistent(t.sample(32).data)
        assert other.list_tables() == ["shared"]


def test_ring_overwrites_the_oldest_items_when_full(client):
    t = client.create_table("ring", capacity=64, fields=SMALL_FIELDS, sampler="uniform")
    for start in range(0, 640, 16):
        t.insert_batch(rows(start, 16))
    t.flush()
    assert len(t) == 64
    seen = set(t.sample(4096).data["action"].tolist())
    assert seen == set(range(640 - 64, 640)), "the 64 newest items, and only they, remain"
    st = client.stats()["tables"]["ring"]
    assert st["inserts"] == 640 and st["evictions"] == 640 - 64


def test_create_table_exist_ok_returns_same_table_and_rejects_other_schema(client):
    t1 = client.create_table("x", capacity=10, fields=SMALL_FIELDS)
    with pytest.raises(shmreplay.TableExists):
        client.create_table("x", capacity=10, fields=SMALL_FIELDS)
    t2 = client.create_table("x", capacity=10, fields=SMALL_FIELDS, exist_ok=True)
    assert t2.id == t1.id
    with pytest.raises(shmreplay.TableExists, match="different schema"):
        client.create_table("x", capacity=11, fields=SMALL_FIELDS, exist_ok=True)


def test_processes_making_one_table_at_once_each_get_it(daemon):
    """Issue 38: TorchRL's collector workers each make the table they feed
    at start, together.  A create with exist_ok waits for another client's
    create of the name under way (a table of a million slots takes the
    daemon milliseconds to make) and returns that table, instead of
    refusing it as "being created by another client"."""
    clients = [daemon.connect() for _ in range(4)]
    start, made, failed = threading.Barrier(4), {}, []

    def make(i):
        start.wait()
        try:
            made[i] = clients[i].create_table("shared", capacity=1_000_000, fields=SMALL_FIELDS,
                                              exist_ok=True).id
        except shmreplay.ReplayError as exc:
            failed.append(exc)

    threads = [threading.Thread(target=make, args=(i,)) for i in range(4)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for c in clients:
            c.close()
    assert not failed, failed
    assert len(made) == 4 and len(set(made.values())) == 1, made


def test_several_tables_per_daemon(client):
    a = client.create_table("a", capacity=50, fields=SMALL_FIELDS)
    b = client.create_table("b", capacity=50, fields={"x": ("float64", (3,))}, sampler="uniform")
    a.insert_batch(rows(0, 5))
    b.insert_batch({"x": np.ones((7, 3))})
    client.flush()
    assert (len(a), len(b)) == (5, 7)
    np.testing.assert_array_equal(b.sample(4).data["x"], np.ones((4, 3)))
    assert sorted(client.list_tables()) == ["a", "b"]


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


def test_drop_table_makes_it_unknown(client):
    t = client.create_table("gone", capacity=10, fields=SMALL_FIELDS)
    t.insert_batch(rows(0, 3))
    client.drop_table("gone")
    with pytest.raises(shmreplay.UnknownTable):
        client.table("gone")
    with pytest.raises(shmreplay.UnknownTable, match="no table with id"):
        t.sample(1)  # the old handle's commands now name a missing table


def test_update_priorities_changes_the_distribution(client):
    t = client.create_table("p", capacity=100, fields=SMALL_FIELDS, alpha=1.0)
    t.insert_batch(rows(0, 100), priorities=np.ones(100))
    b = t.sample(100)
    keys_of = dict(zip(b.data["action"].tolist(), b.keys.tolist()))
    hot = keys_of[next(iter(keys_of))]
    # zero every sampled key but one, raise that one
    new = np.where(b.keys == hot, 1000.0, 0.0)
    t.update_priorities(b.keys, new)
    t.flush()
    again = t.sample(256)
    frac = np.mean(again.keys == hot)
    touched = set(b.keys.tolist())
    total = 1000.0 + (100 - len(touched))  # untouched items keep priority 1
    assert frac == pytest.approx(1000.0 / total, abs=0.08)
    # exactly the formula (alpha 1): hot 1000, the other sampled ones 0 (never
    # drawn), untouched ones 1; an update not applied would leave 1/100 everywhere
    prio = {k: (1000.0 if k == hot else 0.0) for k in touched}
    want = np.array([prio.get(k, 1.0) / total for k in again.keys.tolist()])
    assert not [k for k in again.keys.tolist() if prio.get(k, 1.0) == 0.0]
    np.testing.assert_allclose(again.probabilities, want, rtol=1e-9)


def test_update_with_keys_of_overwritten_slots_is_ignored_and_counted(client):
    t = client.create_table("stale", capacity=10, fields=SMALL_FIELDS)
    t.insert_batch(rows(0, 10))
    old = t.sample(10)
    t.insert_batch(rows(10, 10))  # overwrites all ten slots
    t.update_priorities(old.keys, np.full(10, 5.0))
    t.flush()
    st = client.stats()["tables"]["stale"]
    assert st["stale_priority_updates"] == 10 and st["priority_updates"] == 0
    assert st["max_priority"] == 1.0, "stale updates must not change anything"


def test_default_priority_is_the_max_seen_so_far(client):
    t = client.create_table("mx", capacity=10, fields=SMALL_FIELDS, alpha=1.0)
    t.insert_batch(rows(0, 1), priorities=[7.0])
    t.insert_batch(rows(1, 1))  # no priority: gets 7.0
    t.flush()
    b = t.sample(64)
    np.testing.assert_allclose(b.probabilities, 0.5)
    np.testing.assert_allclose(b.weights, 1.0)


def test_sample_into_preallocated_batch_reuses_its_arrays(client):
    t = client.create_table("pre", capacity=100, fields=SMALL_FIELDS)
    t.insert_batch(rows(0, 100))
    b = t.sample(32)
    obs = b.data["obs"]
    b2 = t.sample(32, out=b)
    assert b2 is b and b2.data["obs"] is obs
    assert_rows_consistent(b2.data)
    with pytest.raises(shmreplay.ReplayError, match="out= holds 32 rows"):
        t.sample(16, out=b)


def test_insert_batch_larger_than_one_command_is_split(client):
    n = client.max_batch + 1000
    t = client.create_table("big", capacity=n, fields={"v": ("int32", ())}, sampler="uniform")
    t.insert_batch({"v": np.arange(n, dtype=np.int32)})
    t.flush()
    assert len(t) == n
    # every item once, in order: each command carries its own part of the batch
    got, _ = committed(t)
    np.testing.assert_array_equal(got["v"], np.arange(n, dtype=np.int32))
    assert client.stats()["tables"]["big"]["inserts"] == n


def test_values_are_cast_when_numpy_same_kind_allows(client):
    t = client.create_table("cast", capacity=10, fields={"f": ("float32", (2,)), "i": ("int16", ())})
    t.insert(f=[1.5, 2.5], i=3)                       # Python floats/ints
    t.insert(f=np.array([1.0, 2.0]), i=np.int64(4))   # float64 -> float32, int64 -> int16
    t.insert_batch({"f": np.array([[-0.25, 3e38], [7.0, -8.5]]), "i": np.array([-300, 32767])})
    t.flush()
    assert len(t) == 4
    # the values, converted: not their bytes reinterpreted, not truncated
    got, _ = committed(t)
    assert got["f"].dtype == np.float32 and got["i"].dtype == np.int16
    np.testing.assert_array_equal(got["f"], np.array([[1.5, 2.5], [1.0, 2.0], [-0.25, 3e38], [7.0, -8.5]],
                                                     np.float32))
    np.testing.assert_array_equal(got["i"], [3, 4, -300, 32767])


def test_stats_and_cli_status(daemon, client):
    import subprocess
    import sys
    t = client.create_table("s", capacity=10, fields=SMALL_FIELDS)
    t.insert_batch(rows(0, 4))
    t.flush()
    st = client.stats()
    assert st["protocol"] == shmreplay.wire.control.PROTOCOL_VERSION and st["daemon_pid"] == daemon.pid
    assert st["tables"]["s"]["size"] == 4
    out = subprocess.run([sys.executable, "-m", "shmreplay.cli", "--socket", daemon.socket, "status"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^s +4 +10 ", out.stdout, re.M), out.stdout   # TABLE ITEMS CAPACITY ...


def test_connect_uses_env_socket(daemon, monkeypatch):
    monkeypatch.setenv("SHMREPLAY_SOCKET", daemon.socket)
    with shmreplay.connect() as c:
        assert c.path == daemon.socket
        assert c.stats()["daemon_pid"] == daemon.pid


def test_default_socket_path_is_shared_by_daemon_and_client(monkeypatch):
    from shmreplay.server.control.config import DaemonConfig
    from shmreplay.wire.names import client_socket_path
    monkeypatch.delenv("SHMREPLAY_SOCKET", raising=False)
    assert DaemonConfig().socket_path() == client_socket_path()
    monkeypatch.setenv("SHMREPLAY_SOCKET", "/tmp/elsewhere.sock")
    assert DaemonConfig().socket_path() == client_socket_path() == "/tmp/elsewhere.sock"


@pytest.mark.parametrize("cpus_to_split", [1, 1 << 20], ids=["two-threads", "one-thread"])
def test_large_rows_are_gathered_intact(client, monkeypatch, cpus_to_split):
    """Batches of >= 1 MiB per field are gathered on two threads where the
    process has ``PARALLEL_GATHER_CPUS`` CPUs (or from 16 MiB a field on
    any; on fewer, from 4 MiB in a thread that waits for its batch, not in
    a prefetch thread), else on one: both intact."""
    from shmreplay.client import gather
    monkeypatch.setattr(gather, "PARALLEL_GATHER_CPUS", cpus_to_split)
    assert gather.parallel_gather(1 << 20) == (cpus_to_split == 1)
    assert not gather.parallel_gather((1 << 20) - 1)
    assert gather.parallel_gather(16 << 20) and not gather.parallel_gather((1 << 20) - 1)
    assert gather.parallel_gather(4 << 20) and gather.parallel_gather((4 << 20) - 1) == (cpus_to_split == 1)

    def background():
        gather.gather_in_background()
        seen.extend(gather.parallel_gather(n) for n in (4 << 20, 16 << 20))
    seen: list = []
    helper = threading.Thread(target=background)
    helper.start()
    helper.join()
    assert seen == [cpus_to_split == 1, True]
    t = client.create_table("wide", capacity=64, fields={"id": ("int64", ()), "img": ("uint8", (512, 1024))},
                            sampler="uniform")
    ids = np.arange(64)
    img = np.broadcast_to((ids % 251).astype(np.uint8)[:, None, None], (64, 512, 1024)).copy()
    img[:, 7, 9] = (ids * 3 % 256).astype(np.uint8)  # and one cell that differs inside each row
    t.insert_batch({"id": ids, "img": img})
    for _ in range(5):
        b = t.sample(9)  # 9 x 512 KiB: both halves of the split are exercised, odd count
        assert b.data["img"].nbytes >= (1 << 20)
        np.testing.assert_array_equal(b.data["img"], img[b.data["id"]])


_SMALL_BOX_GATHER = r"""
import json, os, sys, threading
import numpy as np
import shmreplay
os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # a 2-CPU box, whatever this one is
def helpers():
    return sum(t.name.startswith("shmreplay-gather") for t in threading.enumerate())
def wide(c):
    return c.stats()["engine"]["wide_samples"]
with shmreplay.connect(sys.argv[1]) as c:
    t = c.create_table("big", capacity=32, fields={"id": ("int64", ()), "img": ("uint8", (640, 512))},
                       sampler="uniform")
    ids = np.arange(32)
    img = np.broadcast_to((ids * 7 % 251).astype(np.uint8)[:, None, None], (32, 640, 512)).copy()
    t.insert_batch({"id": ids, "img": img})
    c.flush()
    it = t.iterate(16, prefetch=1)  # 16 x 320 KiB: 5 MiB a batch
    w0 = wide(c)
    intact = []
    for _ in range(4):
        b = next(it)
        intact.append(bool(np.array_equal(b.data["img"], img[b.data["id"]])))
    it.close()
    prefetched, w1 = helpers(), wide(c)
    for _ in range(3):
        b = t.sample(16)
        intact.append(bool(np.array_equal(b.data["img"], img[b.data["id"]])))
    small = t.sample(2)  # 640 KiB: one thread, and no WIDE flag
    print(json.dumps({"prefetched": prefetched, "sampled": helpers(), "intact": intact,
                      "wide_while_prefetching": w1 - w0, "wide_sampled": wide(c) - w1}))
"""


def test_on_a_small_box_a_waiting_sample_splits_its_gather_and_a_prefetch_thread_does_not(daemon):
    """gather.py: on fewer than 4 CPUs a 5 MiB batch is copied on two
    threads by ``sample`` (its caller waits for it), on one by ``iterate``'s
    prefetch thread (its caller trains meanwhile, and a helper would take
    its core); both intact.  On 2 CPUs ``sample``'s SAMPLE says so
    (``records.WIDE``), and the daemon counts it (``wide_samples``: no
    learner spin follows it), the prefetch thread's and a small batch's do
    not.  A client process of its own, pinned to 2 CPUs: the helper thread
    is process-wide and is seen by its name."""
    r = subprocess.run([sys.executable, "-c", _SMALL_BOX_GATHER, daemon.socket], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got == {"prefetched": 0, "sampled": 1, "intact": [True] * 7, "wide_while_prefetching": 0,
                   "wide_sampled": 3}, got


def test_table_names_holding_the_segment_markers_do_not_collide(client):
    """Segment names are /shmreplay.<instance>.t.<table> and .r.<table>: a
    table called "a.t.b" must not take the name of table "a.r.b"'s segment."""
    x = client.create_table("a.t.b", capacity=10, fields=SMALL_FIELDS)
    y = client.create_table("a.r.b", capacity=10, fields=SMALL_FIELDS)
    x.insert(obs=np.full((4, 8, 8), 1, np.uint8), action=1, reward=1.0)
    y.insert(obs=np.full((4, 8, 8), 2, np.uint8), action=2, reward=2.0)
    client.flush()
    assert x.sample(1).data["action"][0] == 1 and y.sample(1).data["action"][0] == 2
