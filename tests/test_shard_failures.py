"""Issue 39, item 5: what a sharded table does when part of it fails, on a
real three-node Ray cluster on 127.0.0.1: a shard's daemon killed and
started again, a learner killed while its draw waits in a shard, a
shard's node lost for good (last: the node stays gone for the module)."""

import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest

ray = pytest.importorskip("ray")
import shmreplay.ray as sray  # noqa: E402
from shmreplay.errors import RateLimited, ReplayError  # noqa: E402
from shmreplay.ray.shardhost import node_alive  # noqa: E402
from shmreplay.wire.peer import EXITED, process_alive, process_state  # noqa: E402
from daemons import checkout_env  # noqa: E402
from rayfixtures import cluster3  # noqa: E402,F401 (a fixture)
from shardkit import FIELDS, LABELS, drain, held, on, rows, write  # noqa: E402
from waiting import wait_for  # noqa: E402

pytestmark = pytest.mark.xdist_group("ray")


@pytest.fixture(scope="module")
def shards(cluster3):
    got = sray.start_shards(cluster3.node_ids(), auto_restart=False)
    places = ray.get([s.host.where.remote() for s in got])
    yield got
    sray.stop_shards(got)  # a lost node's shard is skipped: its box went with it
    for s, place in zip(got, places):  # what a lost box left on this one (they share /tmp and /dev/shm here)
        if os.path.exists(os.path.dirname(s.socket)):
            subprocess.run([sys.executable, "-m", "shmreplay.cli", "cleanup", "--instance", place["instance"]],
                           env=checkout_env(), check=True, capture_output=True)
            shutil.rmtree(os.path.dirname(s.socket))


def fill(t, sizes, priorities, base: int = 0):
    ray.get([write.options(**on(LABELS[s])).remote(t.writer(), base + 100 * s + np.arange(n),
                                                  np.full(n, priorities[s])) for s, n in enumerate(sizes)])


def test_an_agent_takes_a_zombie_daemon_for_gone():
    """A daemon its parent never reaped answers signals but serves nothing:
    the agent's liveness look (once a ZOMBIE_S) says gone."""
    from shmreplay.ray.shardagent import _alive
    p = subprocess.Popen(["true"])
    try:
        wait_for(lambda: process_state(p.pid)[0] in EXITED, "the child to be a zombie")  # not reaped yet
        assert _alive(p.pid, zombie_check=False) and not _alive(p.pid, zombie_check=True)
        assert _alive(os.getpid(), zombie_check=True)
    finally:
        p.wait()


def where(shard) -> dict:
    return ray.get(shard.host.where.remote())


def test_a_shard_whose_daemon_died_is_left_out_until_it_is_back_with_its_items(shards):
    t = sray.ShardedTable.create(shards, "crash", capacity=300, fields=FIELDS, alpha=1.0, seed=7)
    try:
        fill(t, (10, 10, 10), (1.0, 2.0, 4.0))  # masses 10, 20, 40
        assert not t.sample(64).missing  # the learner has seen every shard's mass
        os.kill(where(shards[1])["pid"], signal.SIGKILL)
        wait_for(lambda: not where(shards[1])["running"], "shard 1's daemon to be dead")
        for _ in range(3):  # batches go on from the other shards, and say what they left out
            b = t.sample(64)
            assert list(b.missing) == [1] and b.mass_left_out == 20.0
            assert set(b.shards.tolist()) == {0, 2}
            p = np.where(b.shards == 0, 1.0, 4.0)
            np.testing.assert_allclose(b.probabilities, p / 50.0, rtol=1e-12)  # the live shards' union
        assert "down" in t.stats()["shards"][1]

        back = ray.get(shards[1].host.restart_daemon.remote())
        assert back["running"] and back["restarts"] == 1
        assert list(t.sample(8).missing) == [1]  # split by the last answers; this one asks shard 1 again
        b = t.sample(256)  # the restarted daemon adopted the table: its items are back
        assert not b.missing and set(b.shards.tolist()) == {0, 1, 2}
        np.testing.assert_allclose(b.probabilities, np.array([1.0, 2.0, 4.0])[b.shards] / 70.0, rtol=1e-12)
        assert ray.get(held.options(**on(LABELS[1])).remote(shards[1].socket, "crash"))[0] == list(range(100, 110))

        # by default a host starts its daemon again by itself
        ray.get(shards[1].host.set_auto_restart.remote(True))
        os.kill(where(shards[1])["pid"], signal.SIGKILL)
        wait_for(lambda: (lambda w: w["running"] and w["restarts"] == 2)(where(shards[1])),
                 "shard 1's daemon to be started again by its host")
        wait_for(lambda: not t.sample(32).missing, "shard 1 back in the batches")
        assert t.stats()["shards"][1]["size"] == 10
    finally:
        ray.get(shards[1].host.set_auto_restart.remote(False))
        t.drop()


def test_a_shard_whose_daemon_hangs_is_left_out_after_shard_timeout_and_serves_again(shards):
    made = sray.ShardedTable.create(shards, "hung", capacity=96, fields=FIELDS, alpha=1.0)
    fill(made, (10, 10, 10), (1.0, 2.0, 4.0))
    made.close()
    # its agents connect and answer within 5 s on a loaded box: the daemons serve, none is stopped yet
    t = sray.ShardedTable(shards, "hung", shard_timeout=5.0)
    try:
        assert pickle.loads(pickle.dumps(t)).shard_timeout == 5.0  # a copy waits as long
        wait_for(lambda: not t.sample(64).missing, "every shard to answer within shard_timeout")
        pid = where(shards[2])["pid"]
        os.kill(pid, signal.SIGSTOP)  # alive, answering nothing
        try:
            b = t.sample(64)
        finally:
            os.kill(pid, signal.SIGCONT)
        assert "did not answer in time" in b.missing[2] and set(b.shards.tolist()) <= {0, 1}
        kept = [s for s in (0, 1) if s not in b.missing]  # shards 0 and 1 (another left out only if slow)
        np.testing.assert_allclose(b.probabilities, np.array([1.0, 2.0])[b.shards] / (10.0 * sum(
            1.0 + s for s in kept)), rtol=1e-12)
        b = t.sample(256)  # it stayed in service: the next batch asks it again
        assert 2 not in b.missing and 2 in b.shards.tolist()
    finally:
        t.drop()
    for bad in (0, -1.0, float("nan"), "5"):
        with pytest.raises(ReplayError, match="shard_timeout"):
            sray.ShardedTable(shards, "hung", shard_timeout=bad)


def test_flush_returns_once_every_shards_daemon_applied_the_updates(shards):
    """``flush`` waits for the daemons, not only for the calls that carried
    the updates: with every shard's daemon stopped it cannot return."""
    t = sray.ShardedTable.create(shards, "flushed", capacity=96, fields=FIELDS, alpha=1.0)
    try:
        fill(t, (10, 10, 10), (1.0, 1.0, 1.0))
        b = t.sample(30)
        t.update_priorities(b.keys, np.ones(30), b.shards)  # every update path connected
        t.flush()
        pids, done, errors = [where(s)["pid"] for s in shards], threading.Event(), []

        def flush():
            try:
                t.flush()
            except BaseException as exc:
                errors.append(exc)
            done.set()

        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            t.update_priorities(b.keys, np.full(30, 3.0), b.shards)  # into each daemon's command ring
            waiter = threading.Thread(target=flush)
            waiter.start()
            assert not done.wait(1.0)  # no daemon has run since: none has applied them
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        waiter.join(60)
        assert done.is_set() and not errors
        for s in range(3):
            ids, prios = ray.get(held.options(**on(LABELS[s])).remote(shards[s].socket, "flushed"))
            sampled = set(b.data["id"][b.shards == s].tolist())
            assert prios == [3.0 if i in sampled else 1.0 for i in ids], s
    finally:
        t.drop()


def test_rows_a_failed_batch_drew_start_the_next_even_into_the_same_out(shards):
    """The learner's own shard draws straight into the batch; rows it drew
    for a batch that then failed (other shards' limits) are kept apart
    from ``out``, so the next batch into the same ``out`` starts with them."""
    from shmreplay.ray.sharddraws import new_batch
    t = sray.ShardedTable.create(shards, "carried", capacity=300, fields=FIELDS, sampler="uniform",
                                 samples_per_insert=2.0, error_buffer=(0.0, 100.0))
    try:
        fill(t, (10, 10, 10), (1.0, 1.0, 1.0))
        ray.get([drain.options(**on(LABELS[s])).remote(shards[s].socket, "carried") for s in (1, 2)])
        out = new_batch(t.spec.fields, 30)
        out.data["id"][:] = -1
        with pytest.raises(RateLimited):  # shard 0 (the head's: this process) drew; 1 and 2 are held back
            t.sample(30, out=out, timeout=1.0)
        drawn = sorted(out.data["id"][out.data["id"] >= 0].tolist())
        assert drawn and all(i < 100 for i in drawn)  # what shard 0 gave, in place
        fill(t, (10, 10, 10), (1.0, 1.0, 1.0), base=1000)
        b = t.sample(30, out=out, timeout=60.0)
        assert sorted(b.data["id"][:len(drawn)].tolist()) == drawn  # they start it, whole
        assert np.array_equal(b.data["obs"], rows(b.data["id"])["obs"])
    finally:
        t.drop()


@ray.remote(num_cpus=0)
class Learner:
    """A learner on another node: its agents are its own (they die with it)."""

    def __init__(self, table):
        self.table = table

    def pid(self) -> int:
        return os.getpid()

    def draw_until_held(self) -> None:
        while True:
            self.table.sample(8)  # no timeout: waits in a shard's limits for ever


def test_a_learner_killed_mid_batch_leaves_the_shards_serving_and_holding_nothing(shards):
    # at most one sample an insert in each shard: a learner soon waits in one
    t = sray.ShardedTable.create(shards, "held", capacity=300, fields=FIELDS, sampler="uniform",
                                 samples_per_insert=1.0, error_buffer=(0.0, 100.0))
    try:
        fill(t, (4, 4, 4), (1.0, 1.0, 1.0))
        learner = Learner.options(**on("remote_node_1")).remote(t)
        pid = ray.get(learner.pid.remote())
        run = learner.draw_until_held.remote()
        wait_for(lambda: sum(e.get("sample_waits", 0) for e in t.stats()["shards"]) > 0,
                 "the learner's draw to wait in a shard's limiter")
        assert pid in t.stats()["shards"][1]["daemon_client_pids"]  # its own node's shard, in its process
        ray.kill(learner)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(run)
        # its agents went with it: no shard holds a slot for it, nor a client of a dead process
        wait_for(lambda: all("down" not in e and not e["holders"] and e["held"] == 0
                             and all(os.path.exists(f"/proc/{p}") for p in e["daemon_client_pids"])
                             for e in t.stats()["shards"]), "the dead learner's holds and clients to go")
        fill(t, (20, 20, 20), (1.0, 1.0, 1.0), base=1000)
        b = t.sample(8, timeout=60.0)  # the shards serve on
        assert len(b) == 8 and not b.missing
    finally:
        t.drop()


def test_a_dead_hosts_daemon_leaves_its_items_to_the_next_start_of_its_instance(cluster3):
    """Another job kills a shard's host: its daemon stops (the host's
    child) and keeps the shard's table, which ``start_shards`` with the
    same instance adopts."""
    node, inst = cluster3.node_ids()[1], f"t{os.getpid()}host"
    [first] = sray.start_shards([node], instance=inst)
    pid = where(first)["pid"]
    with sray.ShardedTable.create([first], "kept", capacity=50, fields=FIELDS) as t:
        assert ray.get(write.options(**on("remote_node_1")).remote(t.writer(), np.arange(10))) == 0
    ray.kill(first.host)
    wait_for(lambda: not process_alive(pid), "the dead host's daemon to stop")  # exited (a zombie too)
    [again] = sray.start_shards([node], instance=inst)
    try:
        assert ray.get(held.options(**on("remote_node_1")).remote(again.socket, "kept")) == (
            list(range(10)), [1.0] * 10)
    finally:
        sray.stop_shards([again])
        shutil.rmtree(os.path.dirname(first.socket), ignore_errors=True)  # the dead host's folder
    assert not [n for n in os.listdir("/dev/shm") if inst in n]


def test_a_shard_whose_node_is_lost_is_named_in_stats_and_the_table_serves_on(cluster3, shards):
    t = sray.ShardedTable.create(shards, "lose", capacity=300, fields=FIELDS, alpha=1.0, seed=9)
    try:
        fill(t, (10, 12, 14), (1.0, 1.0, 1.0))
        before = t.sample(64)
        assert set(before.shards.tolist()) == {0, 1, 2}
        cluster3.lose_node(2)
        # Ray's word that the node is dead (the shard is lost, not its agent restarted)
        wait_for(lambda: not node_alive(shards[2].node), "Ray to see node 2 dead")
        b = t.sample(64)
        assert list(b.missing) == [2] and "lost" in b.missing[2] and set(b.shards.tolist()) <= {0, 1}
        np.testing.assert_allclose(b.probabilities, 1 / 22, rtol=1e-12)
        st = t.stats()
        assert st["lost"][2]["items"] == 14 and st["lost"][2]["node"] == shards[2].node
        assert st["items_lost"] == 14 and st["size"] == 22 and "lost" in st["shards"][2]
        t.update_priorities(before.keys, np.ones(64), before.shards)  # updates for the lost shard are dropped
        t.flush()
        assert t.stats()["updates_lost"] == int(np.count_nonzero(before.shards == 2))
        # writers: the head's and remote_node_1's go to their own shards; one elsewhere
        # (here the driver's copy, on the head) is not stopped by the lost shard
        fill(t, (5, 5), (1.0, 1.0), base=5000)
        assert t.stats()["size"] == 32
    finally:
        t.drop()
