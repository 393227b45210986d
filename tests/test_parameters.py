"""ParameterBoard: model parameters from one publisher to many readers, never torn."""

import multiprocessing

import numpy as np
import pytest

import shmreplay

LIKE = {"w1": np.zeros((64, 33), np.float32), "b1": np.zeros(64, np.float32),
        "steps": np.zeros((), np.int64), "w2": np.zeros((2, 64), np.float64)}


def params(v: int) -> dict:
    return {k: np.full(a.shape, v, a.dtype) for k, a in LIKE.items()}


def test_a_reader_gets_the_newest_version_and_nothing_when_none_is_newer(client):
    pub = shmreplay.ParameterBoard.create(client, "policy", like=LIKE)
    reader = shmreplay.ParameterBoard.attach(client.clone(), "policy", like=LIKE)
    assert reader.latest() is None                      # nothing published yet
    assert pub.publish(params(1)) == 1
    assert pub.publish(params(2), flush=True) == 2
    v, got = reader.latest()
    assert v == 2 and all((got[k] == 2).all() and got[k].dtype == LIKE[k].dtype for k in LIKE)
    assert reader.latest(newer_than=2) is None           # no round trip: the insert counter did not move
    pub.publish(params(3), flush=True)
    assert reader.latest(newer_than=2)[0] == 3
    # a publisher that comes back continues the count
    again = shmreplay.ParameterBoard.create(client, "policy", like=LIKE)
    assert again.publish(params(4)) == 4
    reader.table.client.close()


def test_a_reader_with_another_model_is_told(client):
    pub = shmreplay.ParameterBoard.create(client, "policy", like=LIKE)
    pub.publish(params(1), flush=True)
    with pytest.raises(shmreplay.FieldError, match="attach with the model the publisher uses"):
        shmreplay.ParameterBoard.attach(client, "policy", like={"w1": np.zeros(3, np.float32)})
    renamed = {("W1" if k == "w1" else k): a for k, a in LIKE.items()}
    other = shmreplay.ParameterBoard.attach(client, "policy", like=renamed)
    with pytest.raises(shmreplay.FieldError, match="published with another model"):
        other.latest()
    with pytest.raises(shmreplay.FieldError, match=r"parameter 'b1' is float64\[64\]"):
        pub.publish({**params(2), "b1": np.zeros(64)})
    with pytest.raises(shmreplay.FieldError, match="'extra'.* not on the board"):
        pub.publish({**params(2), "extra": np.zeros(1)})


PUBLISHES = 400


def _publisher(client, made, ready):
    board = shmreplay.ParameterBoard.create(client, "policy", like=LIKE, slots=2)
    made.set()
    ready.wait(120)
    for v in range(1, PUBLISHES + 1):
        board.publish(params(v))
    client.close()


def _reader(client, out, made):
    made.wait(120)
    board = shmreplay.ParameterBoard.attach(client, "policy", like=LIKE)
    seen, reads, torn = 0, 0, 0
    while seen < PUBLISHES:
        got = board.latest(newer_than=seen, timeout=30.0)
        if got is None:
            continue
        v, arrays = got
        reads += 1
        torn += sum(int((a != v).any()) for a in arrays.values())
        assert v > seen
        seen = v
    out.put((reads, torn))
    client.close()


def test_readers_never_see_a_torn_version_while_the_publisher_overwrites(client):
    """Two slots: every publish overwrites the slot a reader copied one
    version ago, so copies and overwrites meet; the stamp check re-reads."""
    ctx = multiprocessing.get_context("fork")
    out, made, ready = ctx.Queue(), ctx.Event(), ctx.Event()
    readers = [ctx.Process(target=_reader, args=(client, out, made)) for _ in range(2)]
    pub = ctx.Process(target=_publisher, args=(client, made, ready))
    pub.start()
    for r in readers:
        r.start()
    ready.set()
    try:
        results = [out.get(timeout=300) for _ in readers]
    finally:
        for p in (pub, *readers):
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in (pub, *readers))
    assert all(reads >= 1 and torn == 0 for reads, torn in results), results
