"""Frame tables end to end (docs/frames.md), the way in and the ways out:
plain inserts store a frame a transition, and every learner path
(``sample``, ``iterate``, ``sample(ahead=True)``, ``shmreplay.torch``)
rebuilds the stacks; ``status`` says what a table holds.  A real daemon,
real processes, real shared memory; stacks known without the code under
test (``framestreams.py``: every frame drawn from a generator seeded by
its stream position) and read back by sampling or straight from the
segment (``readback.committed_stacks``, a plain-numpy twin of the
gather)."""

import re

import pytest

import shmreplay
from framestreams import DEPTH, check_items, frames_stored, make, stacked, tag, transition
from readback import committed_stacks


def test_plain_inserts_store_one_frame_a_transition_and_samples_rebuild_every_stack(daemon, client):
    make(client, capacity=300)
    with daemon.connect() as writer:
        t = writer.table("px")
        assert type(t).__name__ == "FrameTable"
        for i in range(200):
            t.insert(**transition(i))
        t.insert_batch(stacked([transition(i) for i in range(200, 260)]))
    t = client.table("px")
    data, _ = committed_stacks(t)
    assert data["tag"].tolist() == [tag(0, 0, i) for i in range(260)]
    assert check_items(data, length=10**6, n=1) == 260
    # frames 0 .. 260 of the stream, each stored once (the first stack's
    # padding is frame 0 again)
    assert frames_stored(daemon, client) == 261
    b = t.sample(64)
    assert b.data["obs"].shape == (64, DEPTH, 8, 8) and b.data["obs"].flags.c_contiguous
    assert check_items(b.data, length=10**6, n=1) == 64


def test_a_frame_table_holds_its_capacity_as_its_stream_moves_on(client):
    """Three times the capacity through a fifo table: old items go, their
    frames come back to the writers, every item left is whole."""
    t = make(client, capacity=100)
    for i in range(300):
        t.insert(**transition(i))
    t.flush()
    data, _ = committed_stacks(t)
    assert data["tag"].tolist() == [tag(0, 0, i) for i in range(200, 300)]
    check_items(data, length=10**6, n=1)
    st = client.stats()["tables"]["px"]
    assert st["frames"]["evicted_for_frames"] == 0  # the remover's evictions freed enough


def test_a_plain_insert_that_is_refused_stores_nothing_and_the_stream_goes_on(client):
    t = make(client)
    bad = transition(0)
    bad["obs"] = bad["obs"][:, :4]
    with pytest.raises(shmreplay.FieldError, match="'obs'"):
        t.insert(**bad)
    with pytest.raises(shmreplay.PriorityError):
        t.insert(priority=-1.0, **transition(0))
    for i in range(5):
        t.insert(**transition(i))
    t.flush()
    data, _ = committed_stacks(t)
    assert check_items(data, length=10**6, n=1) == 5


# ---- every way a learner reads ----
def test_iterate_torch_and_sample_ahead_rebuild_stacks_as_sample_does(client):
    t = make(client, capacity=200)
    for i in range(150):
        t.insert(**transition(i))
    client.flush()
    with t.iterate(16, prefetch=2) as batches:
        for k, b in enumerate(batches):
            assert check_items(b.data, length=10**6, n=1) == 16
            if k == 5:
                break
    out = t.sample(16)
    b = t.sample(16, out=out)
    assert b is out and check_items(b.data, length=10**6, n=1) == 16
    t.sample(16, ahead=True)
    t.insert(**transition(150))
    assert check_items(t.sample(16, ahead=True).data, length=10**6, n=1) == 16
    torch = pytest.importorskip("torch")
    import shmreplay.torch as srt
    tb = srt.sample(t, 16)
    assert tb.data["obs"].dtype == torch.uint8 and tuple(tb.data["obs"].shape) == (16, DEPTH, 8, 8)
    check_items({k: v.numpy() for k, v in tb.data.items()}, length=10**6, n=1)


def test_status_says_what_a_frame_table_holds_and_what_a_transition_costs(daemon, client):
    from test_cli import cli
    t = make(client, capacity=1000)
    for i in range(100):
        t.insert(**transition(i))
    client.flush()
    st = client.stats()["tables"]["px"]
    ring = st["frames"]["rings"]["obs"]
    assert ring["frames"] == 1000 + 64 and ring["held"] >= 101 and st["frames"]["in_leases"] > 0
    # the table's segments over its capacity: its rows (16 bytes), its ring
    # (1,064 frames of 64 bytes) and references (32 bytes) an item, and books
    assert 16 + 1064 * 64 / 1000 + 32 < st["bytes_per_item"] < 16 + 1064 * 64 / 1000 + 32 + 100
    out = cli("status", socket=daemon.socket)
    assert re.search(r"^ *px: frames: obs \d+/1,064 frames held \([\d.]+ an item\); \d+ in \d+ writers' frame leases, "
                     r"0 items evicted for frames; \d+ bytes a transition, full$", out, re.M), out
