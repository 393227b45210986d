"""Promise 3: checkpoints are atomic, versioned, bit-exact on round trip,
taken while inserts and samples go on, periodic if configured, restored at
start, and leave the rate limiter able to move (Reverb issue #103)."""

import os
import shutil
import subprocess
import sys
import threading
import zlib

import msgpack
import numpy as np
import pytest

import shmreplay
from shmreplay import ratelimiter
from shmreplay.server.disk import ckread
from shmreplay.schema import make_spec

from faults import FIELDS, HANG_S, committed_ids, rows, table_state, torn, wait_for

MIXED = {"obs": ("uint8", (4, 5)), "vec": ("float32", (3,)), "id": ("int64", ()), "done": ("bool", ())}
TABLES = [{"name": "per", "capacity": 512, "sampler": "prioritized", "alpha": 0.6, "fields": MIXED},
          {"name": "uses", "capacity": 256, "sampler": "uniform", "max_times_sampled": 5,
           "fields": MIXED}]


def mixed_rows(ids):
    ids = np.asarray(ids, np.int64)
    rng = np.random.default_rng(ids[0])
    return {"obs": rng.integers(0, 256, (ids.shape[0], 4, 5), dtype=np.uint8),
            "vec": rng.standard_normal((ids.shape[0], 3)).astype(np.float32),
            "id": ids, "done": ids % 3 == 0}


def cli(d, *args):
    run = subprocess.run([sys.executable, "-m", "shmreplay.cli", "--socket", d.socket, *args],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
        if isinstance(a[k], np.ndarray):
            assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k


def test_round_trip_is_bit_exact(start_daemon, tmp_path):
    d = start_daemon(tables=TABLES)
    with d.connect() as c:
        per, uses = c.table("per"), c.table("uses")
        per.insert_batch(mixed_rows(np.arange(700)), priorities=np.linspace(0.1, 9.0, 700))
        uses.insert_batch(mixed_rows(np.arange(200)))
        c.flush()
        b = per.sample(100)
        per.update_priorities(b.keys, np.random.default_rng(1).uniform(0.5, 3, 100))
        for _ in range(20):
            uses.sample(16)  # times sampled, and items that reached 5 left
        c.flush()
    segs = {t: d.segment(t) for t in ("per", "uses")}
    before = {t: table_state(s) for t, s in segs.items()}
    out = cli(d, "checkpoint", "--to", str(tmp_path / "ck"))
    assert "per: 512 items" in out and "paused" in out
    assert sorted(ckread.complete(str(tmp_path / "ck"))) == ["per", "uses"]
    assert d.stop() == 0  # the tables are gone with it
    d.start(["--restore", str(tmp_path / "ck")])
    after = {t: table_state(d.segment(t)) for t in segs}  # restored: new segments, new tokens
    for t in segs:
        assert_same(before[t], after[t])
    assert "restored 512 items" in d.log()
    with d.connect() as c:  # and the restored table serves
        assert len(c.table("per").sample(64)) == 64


def reseal(path, fn):
    """Change a checkpoint's meta with ``fn(meta)`` and seal it again (DONE),
    as a checkpoint written that way would be."""
    meta = msgpack.unpackb(open(os.path.join(path, "meta.msgpack"), "rb").read(), raw=False)
    fn(meta)
    raw = msgpack.packb(meta, use_bin_type=True)
    open(os.path.join(path, "meta.msgpack"), "wb").write(raw)
    open(os.path.join(path, "DONE"), "w").write(f"{zlib.crc32(raw)}\n")


def rewrite(path, name, fn):
    """Change one array file of a checkpoint and re-seal it (CRC, DONE)."""
    def change(meta):
        d = meta["files"][name]
        a = np.fromfile(os.path.join(path, f"{name}.bin"), dtype=np.dtype(d["dtype"]))
        a = fn(a.reshape(d["shape"]))
        a.tofile(os.path.join(path, f"{name}.bin"))
        d["crc32"] = zlib.crc32(a.tobytes())
    reseal(path, change)


def flip_byte(path, at=7):
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


def test_damaged_and_incomplete_checkpoints_are_never_restored(start_daemon, tmp_path):
    ck = str(tmp_path / "ck")
    d = start_daemon(tables=TABLES[:1])
    with d.connect() as c:
        t = c.table("per")
        t.insert_batch(mixed_rows(np.arange(100)))
        c.flush()
        c.checkpoint(ck, "per")
        t.insert_batch(mixed_rows(np.arange(100, 150)))
        c.flush()
        newest = c.checkpoint(ck, "per")[0]["path"]
    # a newer checkpoint whose every file was written but its DONE marker
    # (150 items: restored, it would show), and a flipped byte in the newest
    unsealed = os.path.join(ck, "per@29991231T000000.000000000Z")
    shutil.copytree(newest, unsealed)
    os.unlink(os.path.join(unsealed, "DONE"))
    flip_byte(os.path.join(newest, "f.obs.bin"))
    assert d.stop() == 0
    d.start(["--restore", ck])
    with d.connect() as c:
        assert len(c.table("per")) == 100  # the older, intact checkpoint
    assert "fails its CRC-32 check" in d.log()
    # none intact: the table is set aside with its checkpoints, never started empty
    for path in ckread.complete(ck)["per"]:
        with open(os.path.join(path, "DONE"), "w") as f:
            f.write("0\n")
    assert d.stop() == 0
    why = d.start_set_aside("per", ["--restore", ck])
    assert "no checkpoint of table 'per' could be restored" in why["reason"]
    assert set(why["objects"]) == set(ckread.complete(ck)["per"])
    d.start()  # without --restore: a fresh, empty table



def _truncate(path):
    os.truncate(path, os.path.getsize(path) // 2)


DAMAGE = {  # what can happen to the newest checkpoint on disk after it was sealed
    "non-UTF-8 byte in DONE": lambda p: open(os.path.join(p, "DONE"), "wb").write(b"\xff12\n"),
    "prios.bin missing": lambda p: os.unlink(os.path.join(p, "prios.bin")),
    "meta.msgpack missing": lambda p: os.unlink(os.path.join(p, "meta.msgpack")),
    "rows file truncated": lambda p: _truncate(os.path.join(p, "f.obs.bin")),
    "rows file byte flipped": lambda p: flip_byte(os.path.join(p, "f.vec.bin")),
    "other format version": lambda p: reseal(p, lambda m: m.update(format_version=99)),
    "other layout version": lambda p: reseal(p, lambda m: m.update(layout_version=99)),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_any_damage_to_the_newest_checkpoint_falls_back_to_the_older(start_daemon, tmp_path,
                                                                      damage):
    ck = str(tmp_path / "ck")
    d = start_daemon(tables=TABLES[:1])
    seg = d.segment("per")
    with d.connect() as c:
        t = c.table("per")
        t.insert_batch(mixed_rows(np.arange(100)), priorities=np.linspace(0.5, 5.0, 100))
        c.flush()
        older = c.checkpoint(ck, "per")[0]["path"]
        held = table_state(seg)  # nothing runs between the checkpoint and this read
        t.insert_batch(mixed_rows(np.arange(100, 150)))
        c.flush()
        newest = c.checkpoint(ck, "per")[0]["path"]
    assert d.stop() == 0
    DAMAGE[damage](newest)
    d.start(["--restore", ck])
    assert_same(held, table_state(d.segment("per")))  # restored: a new segment
    log = d.log()
    assert f"checkpoint {newest} cannot be restored" in log, log[-2000:]
    assert f"restored 100 items from {older}" in log


HERE = os.path.dirname(os.path.abspath(__file__))
CHURN = {"name": "big", "capacity": 256, "sampler": "uniform", "fields": FIELDS}


def test_inserts_and_samples_flow_during_a_checkpoint(start_daemon, tmp_path):
    """The engine serves while a checkpoint copies the rows: the write is
    held after the engine's snapshot, before the first row is copied
    (``pausing_daemon.py``), and meanwhile an insert with its flush and a
    sample complete; a daemon that stopped for the write would answer
    neither.  The inserts evict the snapshot's oldest items, whose slots
    now hold other rows: the checkpoint must leave out exactly those, and
    restores to the snapshot's items still in the table, every row whole."""
    cap, pause = CHURN["capacity"], tmp_path / "pause"
    pause.mkdir()
    d = start_daemon(tables=[CHURN], command=[sys.executable, os.path.join(HERE, "pausing_daemon.py")],
                     env={"SHMREPLAY_TEST_PAUSE_DIR": str(pause)})
    reports = []

    def take_checkpoint(admin):
        try:
            reports.append(admin.checkpoint(str(tmp_path / "ck"), "big"))
        except BaseException as exc:
            reports.append(exc)

    with d.connect(timeout=HANG_S) as c, d.connect(timeout=HANG_S) as admin:
        t = c.table("big")
        t.insert_batch(rows(np.arange(cap)))
        c.flush()
        th = threading.Thread(target=take_checkpoint, args=(admin,), daemon=True)
        th.start()
        try:
            wait_for(lambda: (pause / "copying").exists(), "the checkpoint to start copying rows")
            t.insert_batch(rows(np.arange(1000, 1040)), timeout=HANG_S)
            c.flush()
            b = t.sample(64, timeout=HANG_S)
            assert torn(b.data) == 0 and len(b) == 64
            assert not reports, "the checkpoint ended before the insert and the sample: not during it"
        finally:
            (pause / "go").touch()
            th.join(HANG_S)
        assert len(reports) == 1 and isinstance(reports[0], list), reports
        (rep,) = reports[0]
        evicted = c.stats()["tables"]["big"]["evictions"]
    # the fifo remover took the oldest: the snapshot's items left are a tail
    now = committed_ids(d.segment("big"))
    kept = now[now < cap]
    assert evicted >= 40 and kept.tolist() == list(range(evicted, cap))
    assert (rep["items"], rep["dropped"]) == (cap - evicted, evicted), rep
    assert d.stop() == 0
    r = start_daemon(tables=[CHURN], args=("--restore", str(tmp_path / "ck")))
    assert np.array_equal(committed_ids(r.segment("big")), kept)  # and none torn
    with r.connect(timeout=HANG_S) as c:
        assert len(c.table("big")) == cap - evicted


def test_periodic_checkpoints_are_kept_pruned_and_restored(start_daemon, tmp_path):
    ck = str(tmp_path / "ck")
    d = start_daemon(tables=TABLES[:1], checkpoint_dir=ck, checkpoint_interval_s=0.3,
                     checkpoint_keep=2)
    with d.connect() as c:
        c.table("per").insert_batch(mixed_rows(np.arange(64)))
        c.flush()
    # every checkpoint begun after the flush holds the 64 items: three of
    # them mean pruning has run with more than checkpoint_keep to choose from
    wait_for(lambda: d.log().count("checkpoint of table per: 64 items") >= 3,
             "three periodic checkpoints of the 64 items", poll=0.05)
    # a clean stop lets a checkpoint being written finish (and prune), so
    # what is on disk now is final; the tables leave /dev/shm, as at a reboot
    assert d.stop() == 0
    kept = ckread.complete(ck)["per"]
    assert len(kept) == 2, kept
    assert not [n for n in os.listdir(ck) if n.startswith(".")]  # no temporaries left
    d.start()
    with d.connect() as c:
        assert len(c.table("per")) == 64
    assert "restored 64 items" in d.log()


QUEUE = {"name": "q", "capacity": 8, "sampler": "fifo", "remover": "fifo", "max_times_sampled": 1,
         "samples_per_insert": 1.0, "error_buffer": [0.0, 8.0], "fields": FIELDS}


def test_restored_rate_limiter_cannot_deadlock(start_daemon, tmp_path):
    """The checkpoint's counters promise 8 unsampled items, but all 8 were
    evicted while it was written.  Restored as saved, samples would wait for
    items and inserts for samples, for ever (Reverb #103)."""
    ck = str(tmp_path / "ck")
    d = start_daemon(tables=[QUEUE])
    with d.connect() as c:
        q = c.table("q")
        q.insert_batch(rows(np.arange(8)))
        with pytest.raises(shmreplay.RateLimited):
            q.insert(**{k: v[0] for k, v in rows([8]).items()}, timeout=0.2)  # full: inserts wait
        (rep,) = c.checkpoint(ck, "q")
    rewrite(rep["path"], "valid", lambda a: np.zeros_like(a))
    assert d.stop() == 0
    d.start(["--restore", ck])
    with d.connect() as c:
        q = c.table("q")
        assert len(q) == 0
        q.insert(**{k: v[0] for k, v in rows([100]).items()}, timeout=30)
        assert int(q.sample(1, timeout=30).data["id"][0]) == 100


@pytest.mark.parametrize("seed", range(4))
def test_restored_counters_always_let_one_side_move(seed):
    rng = np.random.default_rng(seed)
    for _ in range(500):
        spi = float(rng.choice([0.25, 1.0, 4.0, 32.0]))
        min_size = int(rng.integers(1, 50))
        width = 2 * max(1.0, spi) + float(rng.uniform(0, 100))
        lo = float(rng.uniform(-50, spi * min_size))
        spec = make_spec("t", 1000, {"x": ("int64", ())}, "uniform", min_size_to_sample=min_size,
                         samples_per_insert=spi, error_buffer=(lo, lo + width))
        inserts = int(rng.integers(0, 10_000))
        samples = int(rng.integers(0, 100_000))
        size = int(rng.integers(0, min(inserts, 1000) + 1))
        can_sample = bool(rng.integers(0, 2)) and size >= min_size
        s = ratelimiter.restored_samples(spec, inserts, samples, can_sample)
        may_insert = ratelimiter.insert_room(spec, size, inserts, 0, s, 1) == 1
        may_sample = can_sample and ratelimiter.sample_blocker(spec, size, inserts, s, 1) is None
        assert may_insert or may_sample, (spi, min_size, lo, width, inserts, samples, size, s)
