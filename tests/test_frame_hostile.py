"""A client out of its protocol against a frame table (docs/reliability.md,
section 14): raw records (``rawclient.py``) refused or cut off, leases
capped per client, a scribbled ring tearing only its own table's items;
nobody else's items change."""

import numpy as np
import pytest

import shmreplay
from framestreams import DEPTH, check_items, make, stacked, transition, write_nstep
from readback import committed_stacks

ROWS = {"obs": ("uint8", (DEPTH, 8, 8)), "next_obs": ("uint8", (DEPTH, 8, 8)),
        "action": ("int64", ())}


# ---- a client out of its protocol (raw records: rawclient.py) ----
def _second_writers_items_intact(daemon):
    """Another client's frame table items, written before and after, read whole."""
    with daemon.connect() as c:
        t = c.table("px")
        write_nstep(t, 7, range(1), length=10)
        c.flush()
        data, _ = committed_stacks(t)
        return check_items(data, length=10)


def frame_lease(client, t, ring=0, n=4):
    from shmreplay.wire import framerecords as FR
    pipe = client._session.pipe
    return pipe.wait(pipe.send(FR.put_frames, t.id, ring, n), FR.read_frames_reply)


CUT = {"no_refs_commit": r"COMMIT of 1 items to frame table 'px' carries uint32\[1, 8\] frame references; got none",
       "short_payload": "FCOMMIT of 1 items of 8 frame references carries 28 payload bytes",
       "bad_flag": "FCOMMIT flag 0.5", "rows_table": "a frame record for table 'rows', which stores rows",
       "bad_ring": "asks for ring 1 of 1"}


@pytest.mark.parametrize("case", ["unheld", "outside", "no_refs_commit", "short_payload",
                                  "bad_flag", "rows_table", "bad_ring"])
def test_a_client_out_of_protocol_is_refused_or_cut_off_and_nobody_elses_items_change(daemon, case):
    from rawclient import commit, reserve, send_raw
    from shmreplay.wire import framerecords as FR
    from shmreplay.wire import records as R
    with daemon.connect() as owner:
        t = make(owner)
        write_nstep(t, 6, range(1), length=10)
        owner.flush()
        before = committed_stacks(t)[0]
    with daemon.connect() as bad:
        t = bad.table("px")
        rid, _, slots = reserve(t, 1)
        lid, frames = frame_lease(bad, t)
        refs = np.repeat(frames[:1], 8).astype(np.uint32).reshape(1, 8)
        cut = True
        if case == "unheld":  # a frame no lease or slot holds: refused, the reservation aborted
            held = set(frames.tolist()) | set(t.mapped.refs[t.mapped.refs[:, 0] != 0xFFFFFFFF].ravel().tolist())
            free = next(f for f in range(t.mapped.rings["obs"].shape[0]) if f not in held)
            refs[0, 5] = free
            send_raw(bad, FR.FCOMMIT, t.id, rid, 1, 0, 0.0, (refs,))
            cut = False
            with pytest.raises(shmreplay.FieldError, match="field 'next_obs', frame 1 of the stack"):
                bad.flush()
        elif case == "outside":  # past the ring: refused the same way
            refs[0, 0] = 10**6
            send_raw(bad, FR.FCOMMIT, t.id, rid, 1, 0, 0.0, (refs,))
            cut = False
            with pytest.raises(shmreplay.FieldError, match="field 'obs', frame 0 of the stack"):
                bad.flush()
        elif case == "no_refs_commit":  # a COMMIT of rows to a frame table
            commit(t, rid, 1)
        elif case == "short_payload":
            send_raw(bad, FR.FCOMMIT, t.id, rid, 1, 0, 0.0, (refs[:, :7],))
        elif case == "bad_flag":
            send_raw(bad, FR.FCOMMIT, t.id, rid, 1, 0, 0.5, (refs,))
        elif case == "rows_table":  # frame records for a table of rows
            rows = bad.create_table("rows", capacity=16, fields=ROWS)
            send_raw(bad, FR.FRAMES, rows.id, 0, 4)
        elif case == "bad_ring":
            send_raw(bad, FR.FRAMES, t.id, 1, 4)
        if cut:  # the daemon's word for why, as the client's next call's error
            with pytest.raises(shmreplay.ProtocolError, match=CUT[case]):
                for _ in range(3):
                    bad.flush()
        else:  # refused, not cut off: a frame lease of its own is given back, the client goes on
            bad._session.pipe.send(FR.put_frames_back, t.id, lid)
            with pytest.raises(shmreplay.ReplayError, match="frame lease .* is not one of yours"):
                bad._session.pipe.send(FR.put_frames_back, t.id, lid)
                bad.flush()
            assert frame_lease(bad, t)[0] > 0
        del R
    with daemon.connect() as c:
        t = c.table("px")
        data = committed_stacks(t)[0]
        assert all(np.array_equal(data[k], before[k]) for k in before)
    assert _second_writers_items_intact(daemon) == 20


def test_frame_leases_are_capped_per_client_and_say_what_to_give_back(daemon, client):
    t = make(client, capacity=256)  # 64 frames of slack: a client holds at most 32
    got = 0
    with pytest.raises(shmreplay.CapacityError, match="may hold at most 32: its writers share that"):
        for _ in range(10):
            got += frame_lease(client, t, n=8)[1].shape[0]
    assert got == 32
    from shmreplay.wire import framerecords as FR
    with pytest.raises(shmreplay.CapacityError, match="FRAMES lease of 5000 frames"):
        frame_lease(client, t, n=5000)
    with daemon.connect() as other:  # another client still gets frames
        assert frame_lease(other, other.table("px"))[0] > 0
    del FR


def test_a_scribbled_ring_tears_only_its_own_tables_items(daemon, client, tmp_path):
    """A writer may write the rows object, rings included: garbage over a
    whole ring tears that table's items and nothing else; the daemon reads
    no frame through a mapping and checkpoints the table; learners sample
    both tables."""
    t = make(client)
    other = make(client, name="other")
    for i in range(30):
        t.insert(**transition(i))
        other.insert(**transition(i))
    client.flush()
    before = committed_stacks(other)[0]
    with daemon.connect() as hostile:
        ring = hostile.table("px").mapped.rings["obs"]
        ring[:] = np.random.default_rng(0).integers(0, 256, ring.shape, dtype=np.uint8)
    assert not np.array_equal(committed_stacks(t)[0]["obs"], stacked([transition(i) for i in range(30)])["obs"])
    assert len(t.sample(16)) == 16  # torn stacks, whole batches
    client.checkpoint(str(tmp_path / "ck"), "px")
    after = committed_stacks(other)[0]
    assert all(np.array_equal(after[k], before[k]) for k in before)
    assert check_items(other.sample(16).data, length=10**6, n=1) == 16
