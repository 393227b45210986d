"""Frame tables as queues (a rate limiter and ``max_times_sampled``): each
item delivered once and whole while its writer waits, and never an
unsampled item evicted for frames."""

import multiprocessing

import numpy as np
import pytest

import shmreplay
from framestreams import FIELDS, FRAMES, check_items, fresh, tag, transition
from readback import committed_stacks


# ---- queues and rate limits ----
def _consume(path, n, out):
    with shmreplay.connect(path) as c:
        q = c.table("q")
        got = []
        while len(got) < n:
            b = q.sample(8, timeout=60)
            check_items(b.data, length=10**6, n=1)
            got += b.data["tag"].tolist()
        out.put(got)


def test_a_queue_of_stacks_delivers_each_item_once_whole_while_its_writer_waits_on_the_limiter(daemon, client):
    """A queue (fifo, each item sampled once, inserts wait while it is full)
    of frame items: the writer is held by the limiter, a learner process
    takes every item once and whole, and the frames of items it took come
    back to the writer (the ring holds 64 more than the queue's 16)."""
    q = client.create_table("q", capacity=16, fields=FIELDS, frames=FRAMES, sampler="fifo", remover="fifo",
                            max_times_sampled=1, samples_per_insert=1.0, error_buffer=(0.0, 16.0))
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_consume, args=(daemon.socket, 400, out))
    p.start()
    try:
        for i in range(400):
            q.insert(timeout=60, **transition(i))
        client.flush()
        got = out.get(timeout=120)
    finally:
        p.join(60)
    assert p.exitcode == 0
    assert got == [tag(0, 0, i) for i in range(400)]  # each once, in order
    st = client.stats()["tables"]["q"]
    assert st["insert_waits"] > 0 and st["frames"]["rings"]["obs"]["frames"] == 16 + 64


def test_a_queue_never_evicts_an_unsampled_item_for_frames(client):
    """Interleaved streams into a queue store more frames an item than its
    ring holds for: the writer waits for the learner (here: a timeout),
    no unsampled item is evicted for frames."""
    q = client.create_table("q", capacity=16, fields=FIELDS, frames=FRAMES, sampler="fifo", remover="fifo",
                            max_times_sampled=1, samples_per_insert=1.0, error_buffer=(0.0, 16.0))
    with pytest.raises(shmreplay.ReplayTimeout, match="no frame of its 'obs' ring came free"):
        for i in range(16):
            obs, next_obs = fresh(i)  # eight new frames an item: 128 for a ring of 80
            q.insert(obs=obs, next_obs=next_obs, action=0, reward=0.0, discount=0.0, tag=-1 - i, timeout=1)
    client.flush()
    st = client.stats()["tables"]["q"]
    assert st["frames"]["evicted_for_frames"] == 0 and st["size"] == i and st["evictions"] == 0
    data, _ = committed_stacks(q)
    for k, x in enumerate(data["tag"]):
        obs, next_obs = fresh(-1 - int(x))
        assert np.array_equal(data["obs"][k], obs) and np.array_equal(data["next_obs"][k], next_obs)
