"""A SAMPLE reply taken off the response ring by one kernel (wire/replytake.py)
against its twin, the Python path (``records.read_sample_reply`` after
``Ring.consume``), over a real channel; what it leaves to that path; and a
learner's sample through a real daemon taking it."""

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmreplay.client import pipe as pipemod
from shmreplay.errors import RateLimited
from shmreplay.wire import records as R
from shmreplay.wire.channel import Channel, ChannelLayout
from shmreplay.wire.replytake import NOT_TAKEN, take_sample
from waiting import wait_for

LAYOUT = ChannelLayout(req_slots=8, resp_slots=8, req_payload=4096, resp_payload=8192)


@pytest.fixture
def chan():
    ch = Channel.create(LAYOUT, os.getpid(), os.getpid())
    yield ch
    ch.release()


def _take(ring, seq, n, out):
    """take_sample on ``ring``'s consumer end, as CommandPipe.take_sample calls it."""
    return take_sample(ring.words(), ring.ctl, ring.head_w, ring.tail_w, ring.pay_tail_w, ring.tail,
                       ring.payload.view(np.uint64), R.SAMPLE, seq, n, *out)


def _python(ring, n):
    """The twin: the record at the tail read by the Python path, then consumed."""
    rec = ring.peek(0)
    pay = ring.payload_of(rec)
    out = (np.zeros(n, np.uint64), np.zeros(n), np.zeros(n))
    hid = R.read_sample_reply(rec, pay, n, slice(None), *out)
    ring.consume(1, ring.payload_end(rec))
    return hid, out


def _control(ring):
    return int(ring.ctl[ring.tail_w]), int(ring.ctl[ring.pay_tail_w])


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 100), st.integers(0, 2**63 - 1), st.integers(0, 2**61), st.integers(0, 5))
def test_the_kernel_reads_what_the_python_path_reads(n, seed, hid, skip):
    """Byte for byte, including NaN payloads and the hold id, after
    ``skip`` earlier replies moved the ring (wrapping its records and its
    payload area); the ring's tail and payload tail end where the Python
    path leaves them."""
    chans = [Channel.create(LAYOUT, os.getpid(), os.getpid()) for _ in range(2)]
    try:
        rng = np.random.default_rng(seed)
        keys = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
        probs, weights = (rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True).view(np.float64)
                          for _ in range(2))
        got = []
        for i, ch in enumerate(chans):
            ring = ch.responses
            for s in range(skip):  # earlier replies, read and handed back
                assert R.put_reply(ring, R.sample_reply(s + 1, keys[:1], probs[:1], weights[:1], 0))
                ring.publish()
                _python(ring, 1)
            assert R.put_reply(ring, R.sample_reply(77, keys, probs, weights, hid))
            ring.publish()
            if i == 0:
                out = (np.zeros(n, np.uint64), np.zeros(n), np.zeros(n))
                took = _take(ring, 77, n, out)
                ring.kernel_consumed()
                got.append((took, out, _control(ring)))
            else:
                took, out = _python(ring, n)
                got.append((took, out, _control(ring)))
        (h0, o0, c0), (h1, o1, c1) = got
        assert h0 == h1 == hid and c0 == c1
        assert all(a.tobytes() == b.tobytes() for a, b in zip(o0, o1))
    finally:
        for ch in chans:
            ch.release()


def test_what_it_does_not_take_it_leaves_untouched(chan):
    """The ring empty, an error reply, one that says so only in its status,
    another sequence number or count, a payload of the wrong size, outside the area or misaligned, a hold id
    past 2**62: NOT_TAKEN, nothing written, the ring as it was (the Python
    path reads it then, and raises what it carries)."""
    ring = chan.responses
    out = (np.zeros(4, np.uint64), np.zeros(4), np.zeros(4))
    assert _take(ring, 1, 4, out) == NOT_TAKEN  # nothing came
    assert R.put_reply(ring, R.error_reply(R.SAMPLE, 1, RateLimited("not yet")))
    ring.publish()
    before = _control(ring)
    assert _take(ring, 1, 4, out) == NOT_TAKEN
    assert _control(ring) == before and not any(a.any() for a in out)
    with pytest.raises(RateLimited, match="not yet"):
        pipemod._finish(ring.peek(0), ring.payload_of(ring.peek(0)), None)
    ring.consume(1, ring.payload_end(ring.peek(0)))
    k = np.arange(4, dtype=np.uint64)
    assert R.put_reply(ring, R.sample_reply(2, k, k.astype(float), k.astype(float), 5))
    ring.publish()
    rec = ring.peek(0)
    cases = {"status": (2, 4, ("status", 7)), "seq": (3, 4, None), "count": (2, 3, None), "pay_len": (2, 4, ("pay_len", 24 * 4 - 8)),
             "outside": (2, 4, ("pay_off", LAYOUT.resp_payload - 8)), "misaligned": (2, 4, ("pay_off", 4)),
             "hold": (2, 4, ("a1", 2**62))}
    for name, (seq, n, poke) in cases.items():
        saved = rec.copy()
        if poke is not None:
            rec[poke[0]] = poke[1]
        before = _control(ring)
        assert _take(ring, seq, n, out) == NOT_TAKEN, name
        assert _control(ring) == before and not any(a.any() for a in out), name
        ring.records[ring.tail % ring.slots] = saved
    assert _take(ring, 2, 4, out) == 5  # as it was: taken
    assert out[0].tolist() == [0, 1, 2, 3]


def test_a_learners_sample_takes_the_kernel_and_a_stashed_reply_the_python_path(start_daemon, monkeypatch):
    """Through a real daemon: a sample whose reply has come is read by the
    kernel; one drained into the stash first (a FLUSH waited on after it)
    is read from there; both batches hold the table's items."""
    d = start_daemon(tables=[{"name": "t", "capacity": 100, "fields": {"x": ("int64", ())},
                              "sampler": "uniform"}])
    calls = []
    real = pipemod.replytake.take_sample
    monkeypatch.setattr(pipemod.replytake, "take_sample", lambda *a: calls.append(real(*a)) or calls[-1])
    with d.connect() as c:
        t = c.table("t")
        t.insert_batch({"x": np.arange(10)})
        c.flush()
        ticket = t.begin_sample(8, 0.0, 10.0)
        wait_for(c._session.pipe.resp.has_pending, "the SAMPLE's reply")
        b = t.finish_sample(ticket, 8, 0.0, None, 10.0)
        assert calls and calls[-1] >= 0  # come already: taken by the kernel
        assert set(b.data["x"].tolist()) <= set(range(10)) and len(b) == 8
        ticket = t.begin_sample(6, 0.0, 10.0)
        c.flush()  # waits past the SAMPLE's reply: it is stashed
        del calls[:]
        b = t.finish_sample(ticket, 6, 0.0, None, 10.0)
        assert not calls  # not on the ring any more: the stash had it
        assert set(b.data["x"].tolist()) <= set(range(10)) and len(b) == 6
