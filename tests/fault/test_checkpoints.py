"""Promise 3: checkpoints are atomic, versioned, bit-exact on round trip,
taken while inserts and samples go on, periodic if configured, restored at
start, and leave the rate limiter able to move (Reverb issue #103)."""

import multiprocessing as mp
import os
import queue
import shutil
import subprocess
import sys
import time
import traceback
import zlib

import msgpack
import numpy as np
import pytest

import shmreplay
from shmreplay import ratelimiter
from shmreplay.server import checkpoint
from shmreplay.schema import make_spec
from shmreplay.wire.layout import COMMITTED, TableMap

from faults import FIELDS, HANG_S, reap, rows, table_state, wait_for

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
    segs = {t: f"/shmreplay.{d.instance}.t.{t}" for t in ("per", "uses")}
    before = {t: table_state(s) for t, s in segs.items()}
    out = cli(d, "checkpoint", "--to", str(tmp_path / "ck"))
    assert "per: 512 items" in out and "paused" in out
    assert sorted(checkpoint.complete(str(tmp_path / "ck"))) == ["per", "uses"]
    assert d.stop() == 0  # the tables are gone with it
    d.start(["--restore", str(tmp_path / "ck")])
    after = {t: table_state(s) for t, s in segs.items()}
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
    # a newer checkpoint that never got its DONE marker, and a flipped byte
    os.makedirs(os.path.join(ck, "per@29991231T000000.000000000Z"))
    flip_byte(os.path.join(newest, "f.obs.bin"))
    assert d.stop() == 0
    d.start(["--restore", ck])
    with d.connect() as c:
        assert len(c.table("per")) == 100  # the older, intact checkpoint
    assert "fails its CRC-32 check" in d.log()
    # none intact: refuse to start rather than start empty
    for path in checkpoint.complete(ck)["per"]:
        with open(os.path.join(path, "DONE"), "w") as f:
            f.write("0\n")
    assert d.stop() == 0
    with pytest.raises(RuntimeError, match="no checkpoint of table 'per' could be restored"):
        d.start(["--restore", ck])
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
    seg = f"/shmreplay.{d.instance}.t.per"
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
    assert_same(held, table_state(seg))
    log = d.log()
    assert f"checkpoint {newest} cannot be restored" in log, log[-2000:]
    assert f"restored 100 items from {older}" in log


def worker(sock, kind, stop, out):
    """Insert one item and flush (actor) or sample 8 (learner), over and
    over until stopped; report the (start, end) times of each operation,
    every 50 ms, and how many sampled rows were not whole."""
    try:
        c = shmreplay.connect(sock, timeout=30)
        t = c.table("big")
        ops, i, torn, reported = [], 0, 0, time.monotonic()
        while not stop.is_set():
            start = time.monotonic()
            if kind == "actor":
                t.insert(obs=np.full((64, 1024), (3000 + i) % 251, np.uint8), id=3000 + i)
                c.flush()
            else:
                b = t.sample(8).data
                torn += int(np.sum(np.any(b["obs"] != (b["id"] % 251).astype(np.uint8)[:, None, None],
                                          axis=(1, 2))))
            end = time.monotonic()
            ops.append((start, end))
            i += 1
            if end - reported > 0.05:
                out.put((kind, ops, torn))
                ops, reported = [], end
            if kind == "actor":
                time.sleep(0.002)
        out.put((kind, ops, torn))
        out.put((kind, None, torn))  # the last report
        c.close()
    except BaseException:
        out.put((kind, "failed", traceback.format_exc()))


MAX_ATTEMPTS = 10  # checkpoints of 128 MiB each, taken until one encloses both kinds


def enclosed(ops: list, lo: float, hi: float) -> int:
    """How many (start, end) of one worker (in order) lie within [lo, hi]."""
    n = 0
    for start, end in reversed(ops):
        if start < lo:
            break
        n += end <= hi
    return n


def test_inserts_and_samples_flow_during_a_checkpoint(start_daemon, tmp_path, capsys):
    """An insert (with its flush) and a sample each start and end inside a
    checkpoint's write, the phase that copies the rows: the engine serves
    while it runs.  A window is only counted where it is sure: the write
    lasted ``write_s`` and ran between the request (t0) and the reply (t1),
    so it covered [t1 - write_s, t0 + write_s] whatever the delays around
    it.  Checkpoints are taken until one enclosed both kinds of operation
    (on a loaded 2-core box the first encloses hundreds); if the engine
    stopped for the rows, none ever would."""
    fields = {"obs": ("uint8", (64, 1024)), "id": ("int64", ())}
    d = start_daemon(tables=[{"name": "big", "capacity": 2048, "sampler": "uniform", "fields": fields}])
    ops = {"actor": [], "learner": []}
    torn = {"actor": 0, "learner": 0}
    finished = set()
    ctx = mp.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=worker, args=(d.socket, k, stop, out), daemon=True) for k in ops]

    def take(deadline: float) -> None:
        try:
            kind, got, extra = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no report from the workers within {HANG_S} s") from None
        if got == "failed":
            raise AssertionError(f"the {kind} failed:\n{extra}")
        torn[kind] = extra
        if got is None:
            finished.add(kind)
        else:
            ops[kind].extend(got)

    def reported_after(t: float) -> None:
        """Wait until both workers reported an operation begun after t."""
        deadline = time.monotonic() + HANG_S
        while not all(v and v[-1][0] > t for v in ops.values()):
            take(deadline)

    try:
        with d.connect(timeout=HANG_S) as c:
            t = c.table("big")
            for lo in range(0, 2048, 256):
                ids = np.arange(lo, lo + 256)
                t.insert_batch({"obs": np.broadcast_to((ids % 251).astype(np.uint8)[:, None, None],
                                                       (256, 64, 1024)), "id": ids})
            c.flush()
            for p in procs:
                p.start()
            reported_after(time.monotonic())  # both at work
            attempts = []
            give_up = time.monotonic() + 2 * HANG_S
            rep = None
            while True:
                if rep is not None:
                    shutil.rmtree(rep["path"])  # 128 MiB each: keep the disk clear (the last stays)
                t0 = time.monotonic()
                (rep,) = c.checkpoint(str(tmp_path / "ck"), "big")
                t1 = time.monotonic()
                # the table stays full (each insert evicts one item) but for the
                # slots the actor's lease holds reserved (two reservations of 8 at
                # most): every other item of the snapshot is either written or left
                # out as evicted during the copy
                assert rep["items"] > 0 and 2048 - 16 <= rep["items"] + rep["dropped"] <= 2048, rep
                lo, hi = t1 - rep["write_s"], t0 + rep["write_s"]
                reported_after(t1)
                during = {k: enclosed(v, lo, hi) for k, v in ops.items()}
                attempts.append((round(rep["write_s"], 3), round(t1 - t0, 3), during))
                if all(during.values()):
                    break
                assert len(attempts) < MAX_ATTEMPTS and time.monotonic() < give_up, (
                    f"no checkpoint write enclosed both an insert+flush and a sample: (write_s, "
                    f"request s, operations inside) of each: {attempts}")
        stop.set()
        deadline = time.monotonic() + HANG_S
        while len(finished) < len(procs):
            take(deadline)
        for p in procs:
            p.join(30)
    finally:
        stop.set()
        reap(procs)
    assert torn == {"actor": 0, "learner": 0}, torn
    # what the checkpoint wrote under churn restores, every row whole
    d.stop()
    r = start_daemon(tables=[{"name": "big", "capacity": 2048, "sampler": "uniform", "fields": fields}],
                     args=("--restore", str(tmp_path / "ck")))
    with r.connect(timeout=HANG_S) as c:
        assert len(c.table("big")) == rep["items"]
    tm = TableMap.attach(f"/shmreplay.{r.instance}.t.big")
    try:
        slots = np.flatnonzero(tm.state == COMMITTED)
        assert slots.shape[0] == rep["items"]
        for part in np.array_split(slots, 8):
            obs, got = tm.fields["obs"][part], tm.fields["id"][part]
            assert np.all(obs == (got % 251).astype(np.uint8)[:, None, None])
    finally:
        tm.release()
    with capsys.disabled():
        print(f"\n[checkpoint figures] {rep['bytes'] / 2**20:.0f} MiB written in {rep['write_s']:.2f} s, "
              f"engine paused {1e3 * rep['pause_s']:.2f} ms; inside the write {during['actor']} inserts "
              f"(each flushed) and {during['learner']} samples of 8 began and ended; "
              f"{rep['dropped']} items evicted during the copy left out; attempts {len(attempts)}")


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
    kept = checkpoint.complete(ck)["per"]
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
