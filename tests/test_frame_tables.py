"""Frame tables end to end (docs/frames.md): a real daemon, real client
processes, real shared memory.  Stacks are known without the code under
test (``framestreams.py``: every frame is drawn from a generator seeded by
its stream position), and read back either by sampling or straight from
the segment (``readback.committed_stacks``, a plain-numpy twin of the
gather)."""

import multiprocessing
import os
import re
import signal

import numpy as np
import pytest

import shmreplay
from framestreams import (DEPTH, FIELDS, FRAMES, check_items, stack, tag, untag,
                          write_nstep)
from readback import committed_stacks
from waiting import wait_for

ROWS = {"obs": ("uint8", (DEPTH, 8, 8)), "next_obs": ("uint8", (DEPTH, 8, 8)),
        "action": ("int64", ())}


def make(client, name="px", capacity=256, **kw):
    return client.create_table(name, capacity=capacity, fields=FIELDS, frames=FRAMES, **kw)


def transition(i: int) -> dict:
    """Transition i of one stream of 0 .. as a plain insert gives it."""
    return {"obs": stack(0, 0, i), "next_obs": stack(0, 0, i + 1), "action": i, "reward": float(i),
            "discount": 0.5, "tag": tag(0, 0, i)}


def stacked(items: list[dict]) -> dict:
    return {k: np.stack([np.asarray(it[k]) for it in items]) for k in items[0]}


# ---- plain inserts ----
def frames_stored(daemon, client, name="px") -> int:
    """Frames the table's items hold: those held once no writer holds a
    lease (call it when the writers have closed their clients)."""
    wait_for(lambda: client.stats()["tables"][name]["frames"]["in_leases"] == 0,
             "the writers' frame leases are given back")
    return client.stats()["tables"][name]["frames"]["rings"]["obs"]["held"]


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


# ---- writers ----
def test_nstep_writer_stores_each_step_once_and_items_hold_their_streams_stacks(daemon, client):
    t = make(client, capacity=400)
    n_items = write_nstep(t, 0, range(6), length=20, n=3)  # its close gives its leases back
    client.flush()
    data, _ = committed_stacks(t)
    assert check_items(data, length=20, n=3) == n_items == 120
    assert frames_stored(daemon, client) == 6 * 21  # per episode: frames 0..20, each once


def test_nstep_writer_over_gymnasiums_frame_stack_both_paddings(client):
    gym = pytest.importorskip("gymnasium")
    from gymnasium.wrappers import FrameStackObservation

    class Pixels(gym.Env):
        observation_space = gym.spaces.Box(0, 255, (8, 8), np.uint8)
        action_space = gym.spaces.Discrete(2)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return self.np_random.integers(1, 256, (8, 8), dtype=np.uint8), {}

        def step(self, a):
            self.t += 1
            return self.np_random.integers(1, 256, (8, 8), dtype=np.uint8), 1.0, self.t >= 9, False, {}

    for padding in ("reset", "zero"):
        t = make(client, name=f"gym_{padding}", capacity=200)
        env = FrameStackObservation(Pixels(), DEPTH, padding_type=padding)
        truth = {}
        with shmreplay.NStepWriter(t, n=2, gamma=0.5) as w:
            for e in range(5):
                o, _ = env.reset(seed=e)
                for s in range(9):
                    o2, r, term, trunc, _ = env.step(0)
                    w.append(obs=o, action=s, reward=r, next_obs=o2, terminated=term, truncated=trunc,
                             tag=tag(0, e, s))
                    truth[tag(0, e, s)] = o
                    o = o2
        client.flush()
        data, _ = committed_stacks(t)
        assert len(data["tag"]) == 45
        for i, x in enumerate(data["tag"]):
            assert np.array_equal(data["obs"][i], truth[int(x)]), (padding, untag(x))
        stored = frames_stored(None, client, f"gym_{padding}")
        # 10 frames an episode (reset, 9 steps); "zero" adds the zero frame
        assert stored == 5 * 10 + (0 if padding == "reset" else 5), (padding, stored)


def _nstep_writer(path, w, episodes, length):
    with shmreplay.connect(path) as c:
        write_nstep(c.table("px"), w, range(episodes), length)


def test_interleaved_writer_processes_never_mix_streams_while_a_learner_samples(daemon, client):
    """Three writer processes stream into a table smaller than what they
    write, while this process samples: every sampled stack is its item's,
    whole (a frame handed out again during a gather is caught by the stamp)."""
    t = make(client, capacity=128)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_nstep_writer, args=(daemon.socket, w, 8, 30)) for w in range(3)]
    for p in procs:
        p.start()
    checked = 0
    try:
        while any(p.is_alive() for p in procs) or checked == 0:
            if len(t) >= 32:
                checked += check_items(t.sample(32).data, length=30)
    finally:
        for p in procs:
            p.join(120)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    data, _ = committed_stacks(t)
    assert check_items(data, length=30) == 128
    assert {untag(x)[0] for x in t.sample(128, beta=0.0).data["tag"]} <= {0, 1, 2}


def _hold_frames_then_die(path, ready):
    c = shmreplay.connect(path)
    t = c.table("px")
    for i in range(20):
        t.insert(**transition(i))
    c.flush()
    ready.set()
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_writer_killed_holding_frame_leases_gives_them_back(daemon, client):
    t = make(client)
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_frames_then_die, args=(daemon.socket, ready))
    p.start()
    p.join(120)
    assert ready.is_set() and p.exitcode == -signal.SIGKILL
    wait_for(lambda: client.stats()["tables"]["px"]["frames"]["in_leases"] == 0,
          "the dead writer's frame leases are given back")
    data, _ = committed_stacks(t)
    assert check_items(data, length=10**6, n=1) == 20
    write_nstep(t, 1, range(2), length=10)  # the table serves on
    client.flush()
    assert len(t) == 40


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


# ---- the daemon dies ----
def test_a_sigkilled_daemons_frame_table_is_adopted_whole_and_serves_on(start_daemon):
    """Declared in the config; items flushed before the SIGKILL are all
    there, their frames counted again from the references (a frame an item
    holds is never handed to a writer after the restart), and a client made
    with reconnect=True writes on through the same handle."""
    table = {"name": "px", "capacity": 512, "sampler": "uniform", "fields": FIELDS, "frames": FRAMES}
    d = start_daemon(tables=[table])
    c = d.connect()
    c.close()
    c = shmreplay.connect(d.socket, reconnect=True)
    try:
        t = c.table("px")
        for i in range(100):
            t.insert(**transition(i))
        c.flush()
        before = committed_stacks(t)[0]
        d.crash()
        d.start()
        for i in range(100, 300):  # through the same handle: it reconnects, its frame leases void
            t.insert(**transition(i))
        c.flush()
        with d.connect() as other:
            write_nstep(other.table("px"), 3, range(4), length=25)
        data, _ = committed_stacks(c.table("px"))
        first = {k: v[:100] for k, v in data.items()}
        assert all(np.array_equal(first[k], before[k]) for k in before)
        plain = data["tag"] < 10**6
        assert check_items({k: v[plain] for k, v in data.items()}, length=10**6, n=1) == 300
        assert check_items({k: v[~plain] for k, v in data.items()}, length=25) == 100
        assert c.stats()["tables"]["px"]["recovered_items"] == 100
    finally:
        c.close()


def test_a_frame_table_whose_references_no_daemon_wrote_is_set_aside_not_served(start_daemon):
    from shmreplay.wire.layout import COMMITTED, TableMap
    from shmreplay.wire.rowfile import rows_name
    from shmreplay.wire.segment import Segment
    d = start_daemon()
    with d.connect() as c:
        t = make(c)
        for i in range(10):
            t.insert(**transition(i))
    d.crash()
    seg = d.segment("px")
    tm = TableMap._checked(Segment.attach(seg), Segment.attach(rows_name(seg)))  # as root may
    try:
        tm.refs[np.flatnonzero(tm.state == COMMITTED)[3], 2] = tm.rings["obs"].shape[0]
    finally:
        tm.release()
    reason = d.start_set_aside("px")["reason"]
    assert "1 frame references in its meta segment are outside their rings" in reason, reason
    for path in (seg, rows_name(seg)):
        os.unlink("/dev/shm" + path)


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


# ---- sequences (R2D2): overlap stored once ----
SEQ = {"obs": ("uint8", (8, 8, 8)), "action": ("int64", (8,)), "length": ("int32", ()),
       "tag": ("int64", ())}


def _write_sequences(t, w, episodes, steps):
    with shmreplay.SequenceWriter(t, length=8, period=4) as wr:
        for e in range(episodes):
            for s in range(steps):
                wr.append(obs=frame_of(w, e, s), action=s, tag=tag(w, e, s))
            wr.end_episode()


def frame_of(w, e, s):
    from framestreams import frame
    return frame(w, e, s)


def test_sequence_writer_stores_each_step_once_however_sequences_overlap(daemon, client):
    t = client.create_table("r2d2", capacity=64, fields=SEQ, frames={"obs": 8}, frames_per_item=4)
    assert t.spec.frames.per_item == 4 and client.table("r2d2").spec == t.spec
    _write_sequences(t, 0, episodes=3, steps=18)
    client.flush()
    data, _ = committed_stacks(t)
    # sequences start every 4 steps of an 18-step episode: at 0, 4, 8, 12, 16
    assert len(data["tag"]) == 15
    for i, x in enumerate(data["tag"]):
        w, e, s0 = untag(x)
        n = min(8, 18 - s0)
        assert data["length"][i] == n
        for k in range(8):
            want = frame_of(w, e, s0 + k) if k < n else np.zeros((8, 8), np.uint8)
            assert np.array_equal(data["obs"][i, k], want), (e, s0, k)
    # 18 frames an episode, and the zero frame its last two sequences end
    # with: stored at the first, found again at the second; the next
    # episode's is 10+ frames on, out of the writer's window (length + 2)
    assert frames_stored(daemon, client, "r2d2") == 3 * (18 + 1)
    b = t.sample(8)
    assert b.data["obs"].shape == (8, 8, 8, 8)


# ---- checkpoints ----
def test_a_checkpoint_of_a_frame_table_round_trips_bit_exact(start_daemon, tmp_path):
    """Items, stamps, priorities, order, references and every frame they
    reference come back as they were; the restored table's frames are
    counted again (a writer after the restore never gets a live one)."""
    from readback import table_state
    ck = str(tmp_path / "ck")
    table = {"name": "px", "capacity": 200, "fields": FIELDS, "frames": FRAMES}
    d = start_daemon(tables=[table])
    with d.connect() as c:
        t = c.table("px")
        write_nstep(t, 0, range(4), length=40)  # 160 items into 200: a full ring of frames turns
        for i in range(60):
            t.insert(priority=float(i + 1), **transition(i))
        c.flush()
        t.sample(64)
        before, prios = committed_stacks(t)
        state = table_state(d.segment("px"))
        m = t.mapped
        refs = m.refs[state["slots"]].copy()
        c.checkpoint(ck, "px")
    assert d.stop() == 0
    d.start(["--restore", ck])
    with d.connect() as c:
        t = c.table("px")
        after, prios_after = committed_stacks(t)
        assert all(np.array_equal(after[k], before[k]) for k in before)
        assert np.array_equal(prios_after, prios)
        again = table_state(d.segment("px"))
        assert all(np.array_equal(again[k], state[k]) for k in state if k != "counters")
        assert np.array_equal(t.mapped.refs[again["slots"]], refs)
        write_nstep(t, 5, range(3), length=20)  # new frames go around the restored ones
        c.flush()
        data, _ = committed_stacks(t)
        old = data["tag"] < 5 * 10**6
        assert old.sum() == 200 - 60 and check_items({k: v[~old] for k, v in data.items()}, length=20) == 60
        plain = {k: v[old] for k, v in data.items()}
        kept = {int(x) for x in plain["tag"]}
        want = {int(x): i for i, x in enumerate(before["tag"])}
        for i, x in enumerate(plain["tag"]):
            assert np.array_equal(plain["obs"][i], before["obs"][want[int(x)]])
        assert kept <= set(want)


# ---- in a file, and durable ----
def fresh(i: int):
    """Stacks of eight frames no stream shares, known from ``i``."""
    rng = np.random.default_rng([99, i])
    return (rng.integers(0, 256, (DEPTH, 8, 8), dtype=np.uint8),
            rng.integers(0, 256, (DEPTH, 8, 8), dtype=np.uint8))


def test_a_durable_frame_table_in_a_file_comes_back_whole_after_a_reboot(start_daemon, tmp_path):
    """Writers churn a file-backed frame table through many syncs (its
    frames reclaimed and evicted for); the machine "reboots" mid-stream
    (daemon SIGKILLed, /dev/shm emptied, clean pages dropped): every item
    the table comes back with is whole.  A frame an item the file on disk
    lists references is never handed out again before a newer sync lands
    (its slot stays retired: ``SlotLedger.reusable``)."""
    from test_durable import reboot
    store = str(tmp_path / "tables")
    table = {"name": "px", "capacity": 64, "fields": FIELDS, "frames": FRAMES, "storage_dir": store}
    d = start_daemon(tables=[table], sync_interval_s=0, storage_dirs=[store])
    with d.connect() as c:
        t = c.table("px")
        assert t.spec.file_backed
        write_nstep(t, 0, range(6), length=30)  # 180 items through 64 slots
        [rep] = c.sync("px")
        synced = committed_stacks(t)[0]
        assert rep["items"] == len(synced["tag"]) > 0
        for i in range(40):  # after the sync: fresh stacks, eight new frames each
            obs, next_obs = fresh(i)
            t.insert(obs=obs, next_obs=next_obs, action=0, reward=0.0, discount=0.0, tag=-1 - i)
        c.flush()
        st = c.stats()["tables"]["px"]
        assert st["syncs"] >= 2, st  # the frames' want of slots made it sync again
    reboot(d, store)
    d.start()
    with d.connect() as c:
        t = c.table("px")
        data, _ = committed_stacks(t)
        streamed = data["tag"] >= 0
        assert 0 < len(data["tag"]) <= 64
        check_items({k: v[streamed] for k, v in data.items()}, length=30)
        for k in np.flatnonzero(~streamed):
            obs, next_obs = fresh(-1 - int(data["tag"][k]))
            assert np.array_equal(data["obs"][k], obs) and np.array_equal(data["next_obs"][k], next_obs)
        write_nstep(t, 1, range(2), length=30)  # and it serves on
        c.flush()
        data, _ = committed_stacks(t)
        assert check_items({k: v[data["tag"] >= 10**6] for k, v in data.items()}, length=30) > 0


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


def test_several_writers_of_one_client_share_its_frame_leases(client):
    """A vector env's streams: four n-step writers of one client, stepped
    in turn (one client may lease half its ring's slack: 625 frames of a
    20,000-item table's), each stream's items whole."""
    t = make(client, capacity=20_000)
    writers = [shmreplay.NStepWriter(t, n=3, gamma=0.5) for _ in range(4)]
    for e in range(2):
        for s in range(30):
            for w, wr in enumerate(writers):
                wr.append(obs=stack(w, e, s), action=s, reward=float(s), next_obs=stack(w, e, s + 1),
                          terminated=s == 29, tag=tag(w, e, s))
    for wr in writers:
        wr.close()
    client.flush()
    data, _ = committed_stacks(t)
    assert check_items(data, length=30) == 4 * 2 * 30


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
