"""``wire/framerecords.py``: a frame table's records over real rings, each
written by the client's functions and read by the engine's, and every
record a client could bend refused before any value is used."""

import numpy as np
import pytest

from shmreplay.errors import CapacityError, ProtocolError
from shmreplay.wire import framerecords as F
from shmreplay.wire import records as R
from shmreplay.wire.channel import Ring

SLOTS = 16


def rings():
    """The two ends of one ring over the same memory: the client's, the daemon's."""
    ctl = np.zeros(8, np.uint64)
    recs = np.zeros(SLOTS, R.RECORD)
    client = Ring(ctl, recs, np.zeros(1 << 16, np.uint8), 0, 1, 2, 3)
    return client, Ring(ctl, recs, client.payload, 0, 1, 2, 3)


def test_a_frame_lease_and_its_reply_round_trip():
    client, daemon = rings()
    assert F.put_frames(client, 5, 3, 1, 40)
    client.publish()
    rec = daemon.peek(0)
    assert R.envelope(rec) == (F.FRAMES, 3, 5) and F.read_frames(rec) == (1, 40)
    reply = F.frames_reply(5, 17, np.array([9, 4, 2]))
    assert R.put_reply(client, reply)  # a reply ring is a ring like any other
    client.publish()
    rec = daemon.peek(1)
    assert F.read_frames_reply(rec, daemon.payload_of(rec))[0] == 17
    assert F.read_frames_reply(rec, daemon.payload_of(rec))[1].tolist() == [9, 4, 2]
    assert F.put_frames_back(client, 6, 3, 17)
    client.publish()
    assert F.read_frames_back(daemon.peek(2)) == 17


@pytest.mark.parametrize("n", [0, F.MAX_LEASE_FRAMES + 1, 2**64 - 1])
def test_a_frame_lease_out_of_bounds_is_refused(n):
    client, daemon = rings()
    F.put_frames(client, 1, 3, 0, n)
    client.publish()
    with pytest.raises(CapacityError, match="FRAMES lease of .* frames outside the allowed 1..4096"):
        F.read_frames(daemon.peek(0))


@pytest.mark.parametrize("with_prios", [False, True])
def test_a_frame_commit_round_trips_and_its_payload_is_the_daemons_copy(with_prios):
    client, daemon = rings()
    refs = np.arange(12, dtype=np.uint32).reshape(3, 4)
    prios = np.array([0.5, 1.5, 2.5]) if with_prios else None
    assert F.put_fcommit(client, 8, 2, 44, 6, refs, prios)
    client.publish()
    rec = daemon.peek(0)
    rid, n, offset, got_prios, got_refs = F.read_fcommit(rec, daemon.payload_of(rec), 4)
    assert (rid, n, offset) == (44, 3, 6) and got_refs.tolist() == refs.tolist()
    assert (got_prios is None) if not with_prios else got_prios.tolist() == [0.5, 1.5, 2.5]
    client.payload[:] = 0xFF  # the client scribbles its payload after the read
    assert got_refs.tolist() == refs.tolist()
    assert with_prios is False or got_prios.tolist() == [0.5, 1.5, 2.5]


@pytest.mark.parametrize("bend, says", [
    ("refs_per_item", "FCOMMIT of 3 items of 5 frame references carries 48 payload bytes"),
    ("flag", "FCOMMIT flag 0.5"),
    ("count", "FCOMMIT of 0 items outside the allowed"),
])
def test_a_bent_frame_commit_cuts_its_client_off(bend, says):
    client, daemon = rings()
    F.put_fcommit(client, 8, 2, 44, 0, np.zeros((3, 4), np.uint32))
    client.publish()
    rec = daemon.peek(0)
    per = 4
    if bend == "refs_per_item":
        per = 5  # a payload that is not the table's shape
    elif bend == "flag":
        rec["f0"] = 0.5
    else:
        rec["a1"] = 0
    with pytest.raises(ProtocolError, match=says):
        F.read_fcommit(rec, daemon.payload_of(rec), per)
