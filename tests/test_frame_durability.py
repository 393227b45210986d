"""Frame tables through the daemon's failures (docs/frames.md, "Durable
tables, adoption and checkpoints"): a SIGKILLed daemon's table adopted
and its frames counted again, references no daemon wrote set aside, a
checkpoint round-tripped bit-exact, a durable file-backed table whole
after a reboot."""

import os

import numpy as np

import shmreplay
from framestreams import FIELDS, FRAMES, check_items, fresh, make, transition, write_nstep
from readback import committed_stacks


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
