"""Issue 39: one table sharded over the daemons of three Ray nodes (all on
127.0.0.1, a cluster of three real nodes started for this module), sampled
as one table of the shards' union.  Each node's shard daemon is started
by ``start_shards``; rows go in through ``ShardedWriter`` s running as Ray
tasks on the nodes; what each shard holds is read back from its segment
by a task on its node (shardkit.held)."""

import os
import pickle

import numpy as np
import pytest

ray = pytest.importorskip("ray")
import shmreplay.ray as sray  # noqa: E402
from rayfixtures import cluster3  # noqa: E402,F401 (a fixture)
from shardkit import FIELDS, LABELS, chi2, chi2_bound, drain, held, on, rows, write  # noqa: E402
from shmreplay.errors import PriorityError, RateLimited, ReplayError, SchemaError  # noqa: E402
from shmreplay.ray.shardagent import KEY, PROB, ShardAgent  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def shards(cluster3):
    got = sray.start_shards(cluster3.node_ids())
    yield got
    sray.stop_shards(got)
    left = [s.socket for s in got if os.path.exists(os.path.dirname(s.socket))]
    assert not left, f"shard daemons' folders left: {left}"


def fill(t, parts, offsets=None) -> list:
    """Shard s gets ids offsets[s]..+len(parts[s]) with priorities parts[s],
    written by a task on shard s's node; returns the shards they wrote to."""
    offsets = offsets if offsets is not None else np.cumsum([0] + [len(p) for p in parts[:-1]])
    return ray.get([write.options(**on(LABELS[s])).remote(t.writer(), np.arange(len(p)) + offsets[s], p)
                    for s, p in enumerate(parts)])


def masses():
    """Three shards of masses ~ 1 : 30 : 300 (test_shard_math.py's), sizes 40, 25, 10."""
    rng = np.random.default_rng(39)
    return [rng.uniform(0.01, 0.05, 40), rng.uniform(0.5, 1.9, 25), rng.uniform(20.0, 40.0, 10)]


def test_a_batch_over_three_shards_is_drawn_as_from_one_table_of_their_union(shards):
    parts = masses()
    union = np.concatenate(parts)
    shard_of = np.repeat(np.arange(3), [len(p) for p in parts])
    t = sray.ShardedTable.create(shards, "union", capacity=3 * 64, fields=FIELDS, alpha=1.0, seed=5)
    try:
        assert fill(t, parts) == [0, 1, 2]  # each writer ran on a shard's node: that shard
        seen = np.zeros(union.size)
        for _ in range(200):
            b = t.sample(512, beta=0.6)
            ids = b.data["id"]
            np.add.at(seen, ids, 1)
            assert np.array_equal(b.shards, shard_of[ids])
            assert np.array_equal(b.data["obs"], rows(ids)["obs"])
            # P(i) and the weights of one table of the union (priorities
            # are stored as float64: the bound is rounding)
            np.testing.assert_allclose(b.probabilities, union[ids] / union.sum(), rtol=1e-9)
            np.testing.assert_allclose(b.weights, (union[ids] / union.min()) ** -0.6, rtol=1e-9)
            assert not b.missing
        p = union / union.sum()
        assert chi2(seen, p) < chi2_bound(p.size - 1), chi2(seen, p)

        # the rule of a client that samples each server in turn, same shards: far off
        with sray.ShardedTable(shards, "union", seed=5, split="in_turn") as turns:
            seen = np.zeros(union.size)
            for _ in range(20):
                np.add.at(seen, turns.sample(512).data["id"], 1)
        assert chi2(seen, p) > 100 * chi2_bound(p.size - 1)
    finally:
        t.drop()


def test_a_uniform_table_over_shards_of_different_sizes_draws_each_item_alike(shards):
    sizes = (5, 20, 50)
    t = sray.ShardedTable.create(shards, "even", capacity=150, fields=FIELDS, sampler="uniform", seed=2)
    try:
        fill(t, [np.ones(n) for n in sizes])
        seen = np.zeros(sum(sizes))
        for _ in range(60):
            b = t.sample(256)
            np.add.at(seen, b.data["id"], 1)
            assert np.all(b.probabilities == 1 / 75) and np.all(b.weights == 1.0)
        p = np.full(seen.size, 1 / seen.size)
        assert chi2(seen, p) < chi2_bound(p.size - 1), chi2(seen, p)
    finally:
        t.drop()


def test_writers_write_to_their_nodes_shard_and_from_elsewhere_in_turn(shards):
    # a table on the head's and remote_node_1's shards: remote_node_2 holds none of it
    t = sray.ShardedTable.create(shards[:2], "route", capacity=512, fields=FIELDS)
    try:
        assert ray.get(write.options(**on("remote_node_1")).remote(t.writer(), np.arange(100))) == 1
        remote = np.arange(1000, 1128)  # 8 chunks of 16, row by row
        assert ray.get(write.options(**on("remote_node_2")).remote(t.writer(chunk=16), remote, None, True)) is None
        got = [set(ray.get(held.options(**on(LABELS[s])).remote(shards[s].socket, "route"))[0]) for s in (0, 1)]
        assert set(range(100)) <= got[1] and not set(range(100)) & got[0]
        chunks = [sorted({(i - 1000) // 16 for i in g if i >= 1000}) for g in got]
        assert sorted(chunks[0] + chunks[1]) == list(range(8))  # every chunk once, whole
        assert {c % 2 for c in chunks[0]} != {c % 2 for c in chunks[1]} and len(chunks[0]) == 4  # in turn
        for g, c in zip(got, chunks):  # a chunk is never split
            assert {i for i in g if i >= 1000} == {1000 + 16 * k + j for k in c for j in range(16)}
    finally:
        t.drop()


def test_priority_updates_go_to_the_shard_each_key_came_from(shards):
    t = sray.ShardedTable.create(shards, "updates", capacity=96, fields=FIELDS, alpha=1.0, seed=3)
    try:
        fill(t, [np.ones(10)] * 3, offsets=[0, 100, 200])
        b = t.sample(64)
        zeroed = set(b.data["id"][b.shards == 2].tolist())
        assert zeroed
        t.update_priorities(b.keys, np.where(b.shards == 2, 0.0, 2.0), b.shards)
        t.flush()
        for s in range(3):
            ids, prios = ray.get(held.options(**on(LABELS[s])).remote(shards[s].socket, "updates"))
            mine = set(b.data["id"][b.shards == s].tolist())
            want = [(0.0 if i in zeroed else 2.0) if i in mine else 1.0 for i in ids]
            assert prios == want, s
        for _ in range(20):
            assert not zeroed & set(t.sample(64).data["id"].tolist())
        with pytest.raises(PriorityError, match="as long"):
            t.update_priorities(b.keys, np.ones(64), b.shards[:10])
        with pytest.raises(PriorityError, match="finite"):
            t.update_priorities(b.keys, np.full(64, np.nan), b.shards)
        with pytest.raises(PriorityError, match="shards must be"):
            t.update_priorities(b.keys, np.ones(64), np.full(64, 7))
    finally:
        t.drop()


def test_a_queue_over_shards_delivers_each_item_to_one_learner(shards):
    t = sray.ShardedTable.create_queue(shards, "jobs", capacity=3 * 40, fields=FIELDS, seed=4)
    try:
        ray.get([write.options(**on(LABELS[s])).remote(t.writer(), np.arange(40) + 100 * s) for s in range(3)])

        @ray.remote(num_cpus=0)
        def learner(table, batches):
            got = []
            while len(got) < batches * 10:
                try:
                    got += table.sample(10, timeout=2.0).data["id"].tolist()
                except RateLimited:  # another learner took what the split counted on: again
                    continue
            return got

        other = learner.options(**on("remote_node_2")).remote(pickle.loads(pickle.dumps(t)), 5)
        mine = ray.get(learner.remote(t, 5))
        theirs = ray.get(other)
        assert len(set(mine)) == len(mine) == 50 and len(set(theirs)) == 50
        assert not set(mine) & set(theirs)  # each item delivered to one learner
        left = [ray.get(held.options(**on(LABELS[s])).remote(shards[s].socket, "jobs"))[0] for s in range(3)]
        every = set(mine) | set(theirs) | {i for ids in left for i in ids}
        assert every == {i + 100 * s for s in range(3) for i in range(40)} and sum(map(len, left)) == 20
        b = t.sample(20)
        assert np.all(b.probabilities == 1.0) and np.all(b.weights == 1.0)
    finally:
        t.drop()


def test_rate_limits_hold_in_each_shard_and_hold_the_batch_back(shards):
    # each shard: at most 2 samples an insert (min_diff 0), inserts never held back here
    t = sray.ShardedTable.create(shards, "limited", capacity=300, fields=FIELDS, sampler="uniform",
                                 samples_per_insert=2.0, error_buffer=(0.0, 100.0))
    try:
        fill(t, [np.ones(10)] * 3, offsets=[0, 100, 200])
        drawn = 0
        with pytest.raises(RateLimited):
            while drawn < 1000:
                t.sample(8, timeout=1.0)
                drawn += 8
        st = t.stats()
        for e in st["shards"]:  # each shard's own limit: samples <= 2 x its inserts
            assert e["inserts"] == 10 and e["samples"] <= 20
        assert 8 <= drawn <= 60  # the first shard out of room held the batch back
        # every shard to its limit, then a batch that asks each of them: all three time out together
        ray.get([drain.options(**on(LABELS[s])).remote(shards[s].socket, "limited") for s in range(3)])
        assert [e["samples"] for e in t.stats()["shards"]] == [20, 20, 20]
        with pytest.raises(RateLimited):
            t.sample(30, timeout=1.0)
        fill(t, [np.ones(10)] * 3, offsets=[1000, 1100, 1200])  # more inserts: the batches go on
        for _ in range(3):  # over every shard: a limit's timeout never left one out
            b = t.sample(8, timeout=30.0)
            assert b.missing == {} and b.mass_left_out == 0.0
    finally:
        t.drop()


def test_rows_come_one_array_a_shard_and_in_the_local_and_torch_forms(shards):
    t = sray.ShardedTable.create(shards, "forms", capacity=300, fields=FIELDS, seed=6)
    try:
        fill(t, [np.ones(20)] * 3, offsets=[0, 100, 200])
        agent = ray.remote(ShardAgent).options(**on("remote_node_1")).remote(shards[1].socket, "forms")
        report, packed = ray.get(agent.draw.remote(16, 0.4, 10.0))  # what one shard's part of a batch is
        ray.kill(agent)
        assert report["mass"] == report["size"] == 20 and report["least"] == 1.0  # with it, the next split's
        assert isinstance(packed, np.ndarray) and packed.shape == (16,)
        assert packed.dtype.names == ("id", "obs", KEY, PROB)
        assert np.array_equal(packed["obs"], rows(packed["id"])["obs"]) and set(packed["id"] // 100) == {1}

        with t.iterate(32, prefetch=2) as batches:
            kept = []
            for _ in range(4):  # updates from this thread while the prefetch thread draws
                kept.append(next(batches))
                t.update_priorities(kept[-1].keys, np.full(32, 2.0), kept[-1].shards)
        t.flush()
        for b in kept:  # each batch is the caller's to keep
            assert len(b) == 32 and np.array_equal(b.data["obs"], rows(b.data["id"])["obs"])
        torch = pytest.importorskip("torch")
        import shmreplay.torch as st
        tb = st.sample(t, 32)
        assert torch.equal(tb.data["obs"], torch.from_numpy(rows(tb.batch.data["id"])["obs"]))
        assert tb.batch.shards.shape == (32,)
    finally:
        t.drop()


def test_tables_are_made_opened_and_dropped_on_every_shard_and_bad_input_is_refused(shards):
    with pytest.raises(SchemaError):  # refused before any shard has it
        sray.ShardedTable.create(shards, "bad", capacity=30, fields={"x": ("float99", ())})
    t = sray.ShardedTable.create(shards, "whole", capacity=np.int64(100), fields=FIELDS)
    try:
        assert t.spec.capacity == 34  # the whole table's, split (a numpy int too)
        fill(t, [np.ones(5), np.ones(6), np.ones(7)], offsets=[0, 100, 200])
        copy = pickle.loads(pickle.dumps(t))
        st = copy.stats()
        assert st["size"] == 18 and st["capacity"] == 102 and [e["size"] for e in st["shards"]] == [5, 6, 7]
        assert len(copy) == 18
        copy.close()
        with pytest.raises(ReplayError, match="batch_size"):
            t.sample(0)
    finally:
        t.drop()
    # one name, two definitions on two shards: not one table
    sray.ShardedTable.create(shards[:1], "other", capacity=10, fields={"x": ("float32", ())}).close()
    sray.ShardedTable.create(shards[1:2], "other", capacity=10, fields=FIELDS).close()
    with pytest.raises(ReplayError, match="different tables"):
        sray.ShardedTable(shards[:2], "other")
    sray.ShardedTable(shards[:1], "other").drop()
    sray.ShardedTable(shards[1:2], "other").drop()
    for s in range(3):
        with pytest.raises(Exception, match="whole"):
            ray.get(held.options(**on(LABELS[s])).remote(shards[s].socket, "whole"))


class Nonsense(ShardAgent):
    """A shard's agent gone bad (a buggy build, another job's code in its
    process): a report of NaN mass, or rows of another layout."""

    def __init__(self, socket, table, how):
        super().__init__(socket, table)
        self.how = how

    def report(self, answered=False):
        got = super().report(answered)
        return {**got, "mass": float("nan")} if self.how == "report" else got

    def draw(self, k, beta, timeout):
        report, rows = super().draw(k, beta, timeout)
        return report, (rows if self.how == "report" else rows[["id", KEY, PROB]])


@pytest.mark.parametrize("how", ["report", "draw"])
def test_a_shard_that_sends_nonsense_is_left_out_and_the_batch_comes_from_the_rest(shards, how):
    t = sray.ShardedTable.create(shards, f"bad_{how}", capacity=96, fields=FIELDS, seed=8)
    try:
        fill(t, [np.ones(10)] * 3, offsets=[0, 100, 200])
        ray.kill(t.book.agents[1])
        t.book.agents[1] = ray.remote(Nonsense).options(**on("remote_node_1")).remote(shards[1].socket,
                                                                                      f"bad_{how}", how)
        ray.get(t.book.agents[1].describe.remote())  # its worker started: the batch's calls get answers
        b = t.sample(64)
        assert list(b.missing) == [1] and set(b.shards.tolist()) == {0, 2}
        assert ("reported mass nan" if how == "report" else "sent") in b.missing[1]
        assert np.array_equal(b.data["obs"], rows(b.data["id"])["obs"])
    finally:
        t.drop()


def test_apex_dqn_runs_with_its_replay_split_over_three_nodes(cluster3, tmp_path):
    """Item 7, smoke: clients/apex_dqn.py --ray --shards 3, its actor on
    another node (it writes to its own node's shard), the learner's
    batches drawn over the shards.  (Learning to 475 is a
    README command, with three seeds' runs.)"""
    import re
    import subprocess
    import sys
    from benchmarks.harness.raycluster import ENV
    from daemons import CHECKOUT, checkout_env
    name = f"test{os.getpid()}apexshards"
    p = subprocess.run([sys.executable, os.path.join(CHECKOUT, "clients", "apex_dqn.py"),
                        "--ray", ray.get_runtime_context().gcs_address, "--shards", "3",
                        "--actor-resource", "remote_node", "--actors", "1", "--envs", "2", "--max-batches", "5",
                        "--batch", "32", "--max-minutes", "8", "--target-return", "1e9", "--min-size", "150",
                        "--out", str(tmp_path), "--instance", name],
                       capture_output=True, text=True, timeout=600, env=checkout_env(**ENV), cwd=tmp_path)
    assert p.returncode == 3, p.stdout[-3000:] + p.stderr[-3000:]
    done = re.search(r"([\d,]+) env steps, ([\d,]+) batches", p.stdout)
    assert done and int(done.group(1).replace(",", "")) > 0 and done.group(2) == "5", p.stdout[-2000:]
    held = re.search(r"replay over 3 shards holds \[(\d+), (\d+), (\d+)\]", p.stdout)
    # no actor on the head: its shard holds nothing; the actor's own node's shard holds what it wrote
    assert held and held.group(1) == "0" and int(held.group(2)) + int(held.group(3)) > 0, p.stdout[-2000:]
    # its board's daemon (--instance) and its shard daemons (<instance>s<k>) left nothing
    assert not [n for n in os.listdir("/dev/shm") if name in n]


def test_shards_attached_to_running_daemons_checkpoint_and_leave_the_daemons_as_they_were(cluster3, tmp_path):
    """``attach_shards``: the operator's daemons (here a Server on the head
    and one on remote_node_1, as a service would be), not started or
    stopped by the shards; each shard checkpoints on its own node."""
    import shmreplay
    nodes = cluster3.node_ids()

    @ray.remote(num_cpus=0)
    class Service:  # a daemon the operator runs on remote_node_1
        def __init__(self):
            self.server = shmreplay.Server()

        def socket(self):
            return self.server.socket

        def stop(self):
            return self.server.stop()

    with shmreplay.Server() as here:
        there = Service.options(**on("remote_node_1")).remote()
        attached = sray.attach_shards([(nodes[0], here.socket), (nodes[1], ray.get(there.socket.remote()))])
        try:
            t = sray.ShardedTable.create(attached, "svc", capacity=64, fields=FIELDS)
            fill(t, [np.ones(5), np.ones(7)], offsets=[0, 100])
            done = t.checkpoint(str(tmp_path))
            assert [d[0]["items"] for _, d in sorted(done.items())] == [5, 7]
            assert all(os.path.exists(d[0]["path"]) for d in done.values())  # one box here: both paths are seen
            t.close()
        finally:
            sray.stop_shards(attached)
        with here.connect() as c:  # the daemons serve on, with the table: the shards did not own them
            assert len(c.table("svc")) == 5
            c.drop_table("svc")
        assert ray.get(there.stop.remote()) == 0
        ray.kill(there)
