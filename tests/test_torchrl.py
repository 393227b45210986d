"""Issue 38, item 2: ``shmreplay.torchrl``'s buffers with real TorchRL and
tensordict: the same items in and out as TorchRL's own buffer (keys,
dtypes, shapes, FIFO eviction, len, write_count), priorities drawn and
weighted as (p + eps)^alpha says and updated per sampled item (not per
slot), batches a caller keeps, TorchRL's multi-process collector writing
from its workers while a learner samples, and the errors that say what to
do."""

import multiprocessing

import numpy as np
import pytest
import torch

from tensordict import TensorDict
from torchrl.collectors import MultiSyncCollector, RandomPolicy
from torchrl.data import LazyTensorStorage, TensorDictReplayBuffer

import shmreplay
import shmreplay.torchrl as srl


def items(first: int, n: int) -> TensorDict:
    """n transitions whose every entry follows from their id, nested keys
    and four dtypes, as a collector's output has them."""
    i = torch.arange(first, first + n)
    return TensorDict({
        "id": i, "observation": i[:, None].float().expand(n, 3).clone(),
        "pixels": (i % 251)[:, None, None].to(torch.uint8).expand(n, 2, 5).clone(),
        "action": (i % 4)[:, None],
        "next": {"observation": (i + 1)[:, None].float().expand(n, 3).clone(),
                 "reward": (i * 0.5)[:, None].float(), "done": (i % 7 == 0)[:, None]},
    }, batch_size=[n])


def check_rows(td: TensorDict) -> None:
    """Every sampled row is the item its id made."""
    want = items(0, int(td["id"].max()) + 1)[td["id"]]
    for key in want.keys(include_nested=True, leaves_only=True):
        torch.testing.assert_close(td[key], want[key], rtol=0, atol=0)


def leaves(td) -> dict:
    return {k: (v.dtype, tuple(v.shape)) for k, v in td.items(include_nested=True, leaves_only=True)}


@pytest.fixture
def socket(daemon):
    return daemon.socket


def test_the_buffer_holds_and_samples_what_torchrls_own_does(socket):
    ours = srl.ReplayBuffer(storage=LazyTensorStorage(50), batch_size=1000, socket=socket)
    theirs = TensorDictReplayBuffer(storage=LazyTensorStorage(50), batch_size=1000)
    for first, n in [(0, 30), (30, 50)]:  # 80 items into 50: the first 30 are evicted
        ours.extend(items(first, n))
        theirs.extend(items(first, n))
    assert len(ours) == len(theirs) == 50
    assert ours.write_count == theirs.write_count == 80
    got, want = ours.sample(), theirs.sample()
    assert got.batch_size == want.batch_size == torch.Size([1000])
    assert leaves(got) == {**leaves(want), "index_generation": (torch.int64, (1000,))}
    check_rows(got)
    # TorchRL's round robin keeps the last 50; 1000 uniform draws see each
    # (the daemon's seed makes the draw the same every run)
    assert set(got["id"].tolist()) == set(range(30, 80))
    assert got["index"].min() >= 0 and got["index"].max() < 50
    one = {}  # an (index, generation) names one item
    for slot, gen, i in zip(got["index"].tolist(), got["index_generation"].tolist(), got["id"].tolist()):
        assert one.setdefault((slot, gen), i) == i
    assert len(one) == 50
    ours.close()


def binomial_ok(counts: np.ndarray, p: np.ndarray) -> bool:
    """Every count within 6 standard deviations of n p_i."""
    n = counts.sum()
    return bool(np.all(np.abs(counts - n * p) <= 6 * np.sqrt(n * p * (1 - p))))


def draw_counts(rb, batches: int = 20) -> tuple[np.ndarray, TensorDict]:
    counts = np.zeros(4)
    for _ in range(batches):
        s = rb.sample()
        counts += np.bincount(s["id"].numpy() % 4, minlength=4)
    return counts, s


def test_priorities_draw_weigh_and_update_as_torchrls_prioritized_buffer_does(socket):
    alpha, beta, eps = 0.7, 0.5, 1e-8
    rb = srl.PrioritizedReplayBuffer(alpha=alpha, beta=beta, storage=4, batch_size=1000, socket=socket)
    p = np.array([1.0, 2.0, 3.0, 10.0])
    first = items(0, 4)
    first["td_error"] = torch.tensor(p)
    rb.extend(first)
    q = (p + eps) ** alpha
    counts, s = draw_counts(rb)
    assert binomial_ok(counts, q / q.sum()), counts
    assert "td_error" not in s.keys()  # the priority, not a stored entry
    # weights: (P_i / P_min)^-beta, as TorchRL's sampler computes them, under both its names
    want = ((q / q.min()) ** -beta)[s["id"].numpy() % 4]
    np.testing.assert_allclose(s["priority_weight"].numpy(), want, rtol=1e-5)
    assert torch.equal(s["priority_weight"], s["_weight"])

    new = np.array([10.0, 3.0, 2.0, 1.0])  # reversed, through the sampled TensorDict
    s["td_error"] = torch.tensor(new)[s["id"] % 4]
    rb.update_tensordict_priority(s)
    q = (new + eps) ** alpha
    counts, s = draw_counts(rb)
    assert binomial_ok(counts, q / q.sum()), counts
    # update_priority without a generation: the one this buffer's last sample saw
    rb.update_priority(s["index"], torch.tensor([1.0, 1.0, 1.0, 50.0])[s["id"] % 4])
    q = (np.array([1.0, 1.0, 1.0, 50.0]) + eps) ** alpha
    counts, old = draw_counts(rb)
    assert binomial_ok(counts, q / q.sum()), counts

    rb.extend(items(4, 4))  # every slot holds a new item, at the highest priority so far
    rb.update_priority(old["index"], torch.full((1000,), 1e6), generation=old["index_generation"])
    counts, s = draw_counts(rb)
    assert set(s["id"].tolist()) == {4, 5, 6, 7}
    assert binomial_ok(counts, np.full(4, 0.25)), counts  # the stale update was not applied
    with shmreplay.connect(socket) as c:
        assert c.stats()["tables"]["replay"]["stale_priority_updates"] == 1000
    rb.close()


def test_a_prefetched_batch_is_the_callers_to_keep(socket):
    rb = srl.ReplayBuffer(storage=100, batch_size=16, prefetch=2, socket=socket)
    rb.extend(items(0, 100))
    kept = rb.sample()
    copy = kept.clone()
    for _, b in zip(range(6), rb):  # the rotating buffers are reused meanwhile
        check_rows(b)
    assert (kept == copy).all()
    check_rows(kept)
    rb.close()


def extend_in_child(rb, first: int, n: int) -> None:
    rb.extend(items(first, n))
    rb.close()


def test_the_buffer_pickles_into_another_process_as_its_table():
    rb = srl.ReplayBuffer(storage=100, batch_size=10, seed=3)  # a private daemon
    rb.extend(items(0, 5))
    child = multiprocessing.get_context("spawn").Process(target=extend_in_child, args=(rb, 5, 10))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert len(rb) == 15
    check_rows(rb.sample(200))
    rb.empty()  # its own table: dropped and made again at the next extend
    assert len(rb) == 0
    rb.extend(items(0, 3).exclude("pixels"))  # a new form is a new table
    assert len(rb) == 3 and "pixels" not in rb.sample(4).keys()
    rb.close()


def extend_and_exit(rb, first: int, n: int) -> None:
    rb.extend(items(first, n))  # and exit without close(), as a collector's worker does


@pytest.mark.parametrize("method, children", [("fork", 10), ("spawn", 2)])
def test_a_worker_that_exits_without_close_has_flushed_its_items(method, children):
    """Each child's last extend is applied by the time it has exited: its
    buffer's connection is closed (flushed) by a multiprocessing finalizer,
    registered again in a forked child (multiprocessing drops the parent's).
    Without, the commits wait for the daemon's next wake-up: 3 of 10 forked
    children were found short right after their exit (the fork case fails
    then; a spawned child is here to show the finalizer works there too)."""
    rb = srl.ReplayBuffer(storage=1000, batch_size=10)  # a private daemon
    rb.extend(items(0, 5))
    assert len(rb) == 5
    ctx = multiprocessing.get_context(method)
    for i in range(children):
        child = ctx.Process(target=extend_and_exit, args=(rb, 5 + 10 * i, 10))
        child.start()
        child.join(120)
        assert child.exitcode == 0
        assert rb.write_count == 5 + 10 * (i + 1), i  # the daemon's counter, no flush asked
    rb.close()


def make_env():
    from torchrl.envs import GymEnv
    return GymEnv("CartPole-v1")


@pytest.mark.slow
def test_torchrls_collector_workers_feed_a_learner():
    """TorchRL's MultiSyncCollector with ``replay_buffer=``: two worker
    processes write their frames straight into the table; the learner
    samples and updates priorities between batches."""
    rb = srl.PrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=10_000, batch_size=64, seed=5)
    collector = MultiSyncCollector([make_env, make_env], policy=RandomPolicy(make_env().action_spec),
                                   frames_per_batch=200, total_frames=1000, replay_buffer=rb)
    sampled = 0
    try:
        for _ in collector:
            s = rb.sample()
            s["td_error"] = torch.rand(64)
            rb.update_tensordict_priority(s)
            sampled += 64
    finally:
        collector.shutdown()
    assert len(rb) == rb.write_count == 1000
    s = rb.sample(1000)
    assert torch.all(s["next", "reward"] == 1.0)  # CartPole pays 1 a step
    assert s["observation"].shape == (1000, 4) and s["action"].shape == (1000, 2)
    # a transition's next observation is where the episode went, not where it was
    assert not torch.equal(s["observation"], s["next", "observation"])
    assert sampled == 64 * 5  # a batch a collector round (1,000 frames in rounds of 200)
    rb.close()


def test_frames_store_each_frame_once_and_give_the_stacks_back(socket):
    frames = torch.arange(40, dtype=torch.uint8)[:, None, None].expand(40, 6, 6)
    stacks = torch.stack([frames[i:i + 4] for i in range(30)])  # one stream's stacks of 4
    td = TensorDict({"pixels": stacks[:-1], "next": {"pixels": stacks[1:]},
                     "action": torch.arange(29)}, batch_size=[29])
    rb = srl.ReplayBuffer(storage=64, batch_size=200, socket=socket,
                          frames={"pixels": 4, ("next", "pixels"): "pixels"})
    rb.extend(td)
    assert rb.table.spec.frames is not None
    s = rb.sample()
    a = s["action"]
    assert torch.equal(s["pixels"], stacks[a]) and torch.equal(s["next", "pixels"], stacks[a + 1])
    rb.close()


def test_keys_choose_what_is_stored_and_the_rest_is_left_out(socket):
    """A collector's first frames come from a random policy, the later ones
    carry the Q-values too: ``keys=`` stores a fixed set either way."""
    rb = srl.ReplayBuffer(storage=50, batch_size=20, socket=socket, keys=["id", ("next", "reward")])
    rb.extend(items(0, 5))
    rb.extend(items(5, 5).set("action_value", torch.zeros(5, 2)))  # more entries: left out
    s = rb.sample()
    assert leaves(s).keys() == {"id", ("next", "reward"), "index", "index_generation"}
    torch.testing.assert_close(s["next", "reward"], items(0, 10)[s["id"]]["next", "reward"])
    with pytest.raises(shmreplay.ReplayError, match="lacks"):
        rb.extend(items(10, 2).exclude(("next", "reward")))
    assert len(rb) == 10
    rb.close()


def test_a_buffer_that_reads_first_keeps_its_keys_and_takes_one_priority_for_all(socket):
    """A collector's worker asks the write count before its first extend:
    the table another worker made is found first, and ``keys=`` must still
    leave the other entries out.  A single priority applies to every index
    (TorchRL's ``update_priority(index, 5.0)``); ``beta`` anneals."""
    maker = srl.PrioritizedReplayBuffer(alpha=1.0, beta=0.4, storage=50, batch_size=200, socket=socket,
                                        keys=["id", ("next", "reward")])
    maker.extend(items(0, 4))
    late = srl.PrioritizedReplayBuffer(alpha=1.0, beta=0.4, storage=50, batch_size=200, socket=socket,
                                       keys=["id", ("next", "reward")])
    assert late.write_count == 4 and len(late) == 4  # found, before any write of its own
    late.extend(items(4, 4).set("action_value", torch.zeros(4, 2)))  # more entries: left out
    assert len(late) == 8
    s = late.sample()
    late.update_priority(s["index"][s["id"] == 0][:1], 5.0)  # one slot: item 0
    late.update_priority(s["index"][s["id"] != 0], 1.0)  # one value for every other index
    late.beta = 1.0
    s = late.sample()
    p = np.where(s["id"].numpy() == 0, 5.0, 1.0) / 12.0  # max priority 1 before; now 5 + 7 x 1
    np.testing.assert_allclose(s["priority_weight"].numpy(), (p / p.min()) ** -1.0, rtol=1e-5)
    maker.close()
    late.close()


def test_bad_input_says_what_to_do_and_loses_nothing(socket):
    rb = srl.PrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=10, batch_size=4, socket=socket)
    with pytest.raises(shmreplay.ReplayError, match="extend the buffer before sampling"):
        rb.sample()
    with pytest.raises(shmreplay.ReplayError, match="takes a TensorDict"):
        rb.extend({"x": torch.zeros(3)})
    with pytest.raises(shmreplay.ReplayError, match="exclude"):
        rb.extend(TensorDict({"a-b": torch.zeros(3)}, batch_size=[3]))
    with pytest.raises(shmreplay.ReplayError, match="float32"):
        rb.extend(TensorDict({"x": torch.zeros(3, dtype=torch.bfloat16)}, batch_size=[3]))
    with pytest.raises(shmreplay.ReplayError, match="not a tensor"):
        rb.extend(TensorDict({"x": torch.zeros(3), "s": "text"}, batch_size=[3]))
    rb.extend(items(0, 5))
    with pytest.raises(shmreplay.ReplayError, match="lacks 'id'"):
        rb.extend(items(5, 2).exclude("id"))
    with pytest.raises(shmreplay.ReplayError, match="does not store"):
        rb.extend(items(5, 2).set("extra", torch.zeros(2)))
    with pytest.raises(shmreplay.ReplayError, match="generation="):
        rb.update_priority(torch.tensor([3]), torch.tensor([1.0]))  # never sampled here
    with pytest.raises(shmreplay.ReplayError, match="outside"):
        rb.update_priority(torch.tensor([10]), torch.tensor([1.0]), generation=torch.tensor([1]))
    with pytest.raises(shmreplay.ReplayError, match="no batch size"):
        with srl.ReplayBuffer(storage=10, socket=socket, table="other") as other:
            other.sample()
    with pytest.raises(shmreplay.ReplayError, match="samples prioritized"):
        with srl.ReplayBuffer(storage=10, socket=socket) as uniform:  # the same table, another sampler
            len(uniform)
    with pytest.raises(shmreplay.ReplayError, match="no 'td_error'"):
        rb.update_tensordict_priority(rb.sample())
    with pytest.raises(shmreplay.ReplayError, match="index_generation"):
        s = rb.sample()
        rb.update_priority(s["index"], torch.ones(4), generation=s["index_generation"][:2])
    with pytest.raises(shmreplay.ReplayError, match="never stores it"):
        srl.PrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=10, socket=socket, keys=["id", "td_error"])
    with pytest.raises(shmreplay.ReplayError, match="shared daemon"):
        srl.ReplayBuffer(storage=10, socket=socket, seed=1)
    with pytest.raises(shmreplay.ReplayError, match="which other processes share"):
        rb.empty()
    assert len(rb) == 5  # nothing refused went in, nothing stored was lost
    check_rows(rb.sample(50))
    rb.close()
