"""The SPSC command ring over a real sealed memfd, across processes."""

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from shmreplay.wire.channel import CTL_EAGER, CTL_REQ_HEAD, Channel, ChannelLayout
from shmreplay.wire.records import COMMIT, SAMPLE
from shmreplay.errors import ProtocolError

LAYOUT = ChannelLayout(req_slots=16, resp_slots=16, req_payload=8192, resp_payload=8192)
N_RECORDS = 20000


def payload_for(seq: int) -> np.ndarray:
    size = (seq * 7919) % 3000  # 0..2999 bytes: forces skips at the ring's end
    return ((np.arange(size) + seq) % 251).astype(np.uint8)


def produce(fd: int) -> None:
    ch = Channel.attach(fd)
    ring = ch.requests
    for seq in range(1, N_RECORDS + 1):
        p = payload_for(seq)
        while True:
            placed = ring.place_payload(p.shape[0]) if ring.room() > 0 else None
            if placed is not None:
                break
            time.sleep(0)
        off, view = placed
        view[:] = p
        ring.put(1, 0, seq, int(p.sum()), 0, 0, 0.0, off, p.shape[0], 0)
        if seq % 3 == 0 or seq == N_RECORDS:  # publish in batches, as clients do
            ring.publish()
    os._exit(0)


@pytest.fixture
def channel():
    ch = Channel.create(LAYOUT, os.getpid(), os.getpid())
    yield ch
    ch.release()


def test_records_and_payloads_arrive_in_order_and_intact_across_processes(channel):
    # the child maps the channel from its own copy of the descriptor, as a
    # client maps the one the daemon passes it
    fd = os.dup(channel.fd)
    proc = mp.get_context("fork").Process(target=produce, args=(fd,))
    proc.start()
    os.close(fd)
    ring = channel.requests
    seen = 0
    deadline = time.monotonic() + 120
    while seen < N_RECORDS:
        assert time.monotonic() < deadline, f"only {seen} records arrived"
        k = ring.pending()
        if not k:
            time.sleep(0)
            continue
        end = None
        for i in range(k):
            rec = ring.peek(i)
            seq = seen + i + 1
            assert int(rec["seq"]) == seq
            got = ring.payload_of(rec)
            np.testing.assert_array_equal(got, payload_for(seq))
            assert int(rec["a0"]) == int(got.sum())
            if got.shape[0]:
                end = int(rec["pay_off"]) + int(rec["pay_len"])
        ring.consume(k, end)
        seen += k
    proc.join(30)
    assert proc.exitcode == 0


def test_a_corrupt_head_is_a_protocol_error(channel):
    channel.ctl[CTL_REQ_HEAD] = 10**9  # a hostile peer scribbles on its control word
    with pytest.raises(ProtocolError, match="impossible position"):
        channel.requests.pending()


def test_a_payload_outside_the_area_is_a_protocol_error(channel):
    ring = channel.requests
    ring.put(1, 0, 1, 0, 0, 0, 0.0, 8000, 1000, 0)  # runs past the end of the area
    ring.publish()
    with pytest.raises(ProtocolError, match="outside the payload area"):
        ring.payload_of(ring.peek(0))


def test_producer_sees_no_room_until_consumer_frees_it(channel):
    ring = channel.requests
    for seq in range(LAYOUT.req_slots):
        assert ring.room() > 0
        ring.put(1, 0, seq, 0, 0, 0, 0.0, 0, 0, 0)
    ring.publish()
    assert ring.room() == 0
    assert ring.pending() == LAYOUT.req_slots
    ring.consume(4, None)
    assert ring.room() == 4


def test_a_client_cannot_resize_its_channel_under_the_daemon(channel):
    """Sealed: shrinking it would make the daemon's next touch a SIGBUS."""
    for size in (0, channel.layout.size // 2, channel.layout.size * 2):
        with pytest.raises(PermissionError):
            os.ftruncate(channel.fd, size)
    assert os.fstat(channel.fd).st_size == channel.layout.size


def _put(ring, op: int, seq: int) -> None:
    ring.put(op, 0, seq, 7, 1, seq, 0.0, 0, 0, 0)
    ring.publish()


def test_commits_wait_for_a_record_that_wants_an_answer(channel):
    """The daemon's idle loop (``Ring.wants_service``): fewer than ``limit``
    pending records, all COMMITs, may wait, and the sleep handshake then
    counts only what came after them; a record of another op, ``limit``
    of them, or a limit of 1 (requests parked) want serving; an impossible
    head does too, and nothing raises (``pending`` reports it)."""
    ring = channel.requests
    assert not ring.wants_service(4)
    for seq in (1, 2, 3):
        _put(ring, COMMIT, seq)
        assert not ring.wants_service(4)
    assert ring.wants_service(1)
    assert not ring.set_sleeping(1, lazy=True)  # may sleep with the three waiting
    assert ring.set_sleeping(1)  # a sleeper that counts every record may not
    ring.clear_sleeping()
    _put(ring, SAMPLE, 4)
    assert ring.wants_service(4)
    assert ring.set_sleeping(1, lazy=True)  # the SAMPLE came: stay up
    ring.clear_sleeping()
    ring.consume(4, None)
    assert not ring.wants_service(4)
    for seq in (5, 6, 7):
        _put(ring, COMMIT, seq)
    assert not ring.wants_service(4)
    _put(ring, COMMIT, 8)
    assert ring.wants_service(4)  # the fourth: served now, in one run
    ring.consume(4, None)
    _put(ring, COMMIT, 9)
    assert not ring.wants_service(4)
    channel.ctl[CTL_EAGER] = 1  # its client's lazy_commits is off: every COMMIT is served at once
    assert ring.wants_service(4)
    channel.ctl[CTL_EAGER] = 0
    assert not channel.responses.wants_service(4)  # a response ring has no eager word to read
    ring.consume(1, None)
    channel.ctl[CTL_REQ_HEAD] = 10**9
    assert ring.wants_service(4)
