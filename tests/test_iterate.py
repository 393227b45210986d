"""table.iterate(): prefetched batches on a background connection."""

import numpy as np
import pytest

import shmreplay
from waiting import wait_for

FIELDS = {"v": ("int64", ()), "w": ("float32", (3,))}


def rows(lo, n):
    v = np.arange(lo, lo + n)
    return {"v": v, "w": np.repeat(v[:, None], 3, axis=1).astype(np.float32)}


def test_iterate_yields_consistent_batches_and_rotates_buffers(client):
    t = client.create_table("it", capacity=1000, fields=FIELDS)
    t.insert_batch(rows(0, 1000))
    seen = set()
    with t.iterate(64, beta=0.4, prefetch=2) as batches:
        for i, b in enumerate(batches):
            assert len(b) == 64
            np.testing.assert_array_equal(b.data["w"][:, 1], b.data["v"].astype(np.float32))
            assert np.all(b.weights <= 1.0 + 1e-12)
            t.update_priorities(b.keys, np.full(64, 2.0))  # the caller's own client
            seen.add(id(b))
            if i == 30:
                break
    assert len(seen) == 3, "prefetch + 1 buffers, reused in turn"
    t.flush()
    assert client.stats()["tables"]["it"]["priority_updates"] == 31 * 64


def test_iterate_keeps_rows_intact_while_writers_overwrite(client):
    t = client.create_table("it", capacity=300, fields=FIELDS)
    t.insert_batch(rows(0, 300))
    n = 300
    with t.iterate(32, prefetch=2) as batches:
        for i, b in enumerate(batches):
            np.testing.assert_array_equal(b.data["w"][:, 0], b.data["v"].astype(np.float32))
            t.insert_batch(rows(n, 50))  # overwrite a sixth of the table per batch
            n += 50
            if i == 100:
                break


def test_iterate_raises_what_the_background_draw_hit(client):
    t = client.create_table("empty", capacity=10, fields=FIELDS)
    with pytest.raises(shmreplay.EmptyTable, match="no sampleable items"):
        with t.iterate(4, timeout=0) as batches:
            next(batches)


def test_closing_the_iterator_ends_its_lease(client):
    t = client.create_table("it", capacity=100, fields=FIELDS)
    t.insert_batch(rows(0, 100))
    before = client.stats()["clients"]
    it = t.iterate(8)
    next(it)
    assert client.stats()["clients"] == before + 1
    it.close()
    wait_for(lambda: client.stats()["clients"] == before, "the iterator's connection to end")
    with pytest.raises(StopIteration):
        next(it)


def test_closing_the_iterator_discards_what_it_prefetched(client):
    """docs/algorithms.md: on a queue, batches drawn ahead and never handed
    out count as delivered when the iterator closes; they do not come back,
    and nothing stays held."""
    t = client.create_table("q", capacity=100, fields=FIELDS, sampler="fifo", max_times_sampled=1)
    t.insert_batch(rows(0, 100))
    t.flush()
    drawn = lambda: client.stats()["tables"]["q"]["samples"]  # noqa: E731
    before = client.stats()["clients"]
    it = t.iterate(10, prefetch=2)
    first = next(it).data["v"].copy()
    np.testing.assert_array_equal(first, np.arange(10))  # oldest first
    # the thread refills both free buffers and keeps one draw in flight
    wait_for(lambda: drawn() >= 30, "the iterator to draw ahead")
    it.close()
    # once its connection has ended, nothing of the iterator's can move the counters
    wait_for(lambda: client.stats()["clients"] == before, "the iterator's connection to end")
    n = drawn()
    assert n % 10 == 0 and n >= 30
    st = client.stats()["tables"]["q"]
    assert st["held"] == 0 and len(t) == 100 - n
    rest = t.sample(100 - n).data["v"]
    np.testing.assert_array_equal(np.sort(rest), np.arange(n, 100))
