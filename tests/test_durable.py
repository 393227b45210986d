"""Durable file-backed tables (issue 14, item 4): a reboot finds every item
committed before the last sync, bit-exact.

A reboot, as the daemon sees it: the daemon is gone (stopped, or SIGKILLed),
/dev/shm and the runtime directory are empty, and the page cache holds no
clean page of the table's files (``drop_cache``: POSIX_FADV_DONTNEED, so the
next daemon reads from the disk what was synced).  The test never syncs
anything itself: a reboot loses what was not synced, and DONTNEED keeps
dirty pages, so whether the DAEMON's sync put its rows and metadata on disk
is checked directly: right after a sync (or a clean stop), no page of any
file in the storage directory is dirty or under writeback
(``assert_on_disk``, Linux's cachestat: tests/pagecache.py)."""

import os
import stat
import subprocess
import sys

import numpy as np
import pytest

import shmreplay
from shmreplay.wire.layout import COMMITTED
from shmreplay.wire.livewords import LIVE_DELETES, LIVE_INSERTS, LIVE_SAMPLES, LIVE_SIZE, LIVE_USES
from shmreplay.wire.names import lock_path

from conftest import shm_entries
from pagecache import unsynced

FIELDS = {"obs": ("uint8", (3000,)), "id": ("int64", ())}  # a row spans a page boundary
# the sync headroom of a 64-item table (server/tables/slots/barrier.py; docs/guide.md, "Tables
# larger than RAM"): 1 % of 64 is 0, at least 64 makes 64, at most a quarter makes 16
HEADROOM = 16


def rows(ids):
    ids = np.asarray(ids, dtype=np.int64)
    obs = (ids[:, None] * 7 + np.arange(3000)[None, :]) % 251
    return {"obs": obs.astype(np.uint8), "id": ids}


def prio(ids):
    return 1.0 + (np.asarray(ids) % 13)


def table_def(store, capacity=64, **kw):
    return {"name": "f", "capacity": capacity, "fields": FIELDS, "storage_dir": store,
            "sampler": "prioritized", "remover": "fifo", **kw}


def state(t) -> dict:
    """Everything a table holds, read from its segments: per committed item
    in commit order its slot, stamp, priority, times sampled, commit number
    and row; and the limiter's counters."""
    m = t._map
    slots = np.flatnonzero(m.state == COMMITTED)
    slots = slots[np.argsort(m.seqno[slots])]
    out = {"slots": slots, "gens": m.gens[slots].copy(), "prios": m.prios[slots].copy(),
           "times": m.times[slots].copy(), "seqno": m.seqno[slots].copy(),
           "live": m.live[[LIVE_SIZE, LIVE_INSERTS, LIVE_SAMPLES, LIVE_DELETES, LIVE_USES]].copy()}
    out.update({f: v[slots].copy() for f, v in m.fields.items()})
    return out


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def reboot(d, store) -> None:
    """What a reboot leaves: only the storage directory."""
    if d.proc.poll() is None:
        d.crash()
    for name in shm_entries(f"shmreplay.{d.instance}."):
        os.unlink(f"/dev/shm/{name}")
    try:
        os.unlink(lock_path(d.instance))
    except FileNotFoundError:
        pass
    for name in os.listdir(store):
        drop_cache(os.path.join(store, name))


def drop_cache(path: str) -> None:
    # no fsync here: what the daemon left dirty must not be made durable by the test
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def assert_on_disk(store) -> None:
    """The daemon's sync made every file of the storage directory (rows and
    metadata) clean: no page dirty or under writeback.  Call it while
    nothing writes those files (no client activity, ``sync_interval_s=0``)."""
    files = sorted(os.listdir(store))
    assert any(".r." in n for n in files) and any(".t." in n for n in files), files
    left = unsynced(store)
    assert not left, f"pages the sync did not write to disk: {left}"


def busy_table(c, first: int, n: int):
    """Insert ids [first, first + n) with their priorities, sample (times
    sampled, limiter counters) and update some priorities."""
    t = c.table("f")
    t.insert_batch(rows(np.arange(first, first + n)), priorities=prio(np.arange(first, first + n)))
    c.flush()
    b = t.sample(20)
    t.update_priorities(b.keys[:5], [0.5, 2.5, 3.5, 4.5, 9.0])
    c.flush()
    return t


def test_a_reboot_finds_every_item_of_the_last_sync_bit_exact(start_daemon, tmp_path):
    """Items, stamps, priorities, times sampled, order, counters and rows as
    of ``sync``; what came after it (inserts, samples, updates) is not there."""
    store = str(tmp_path / "tables")
    d = start_daemon(tables=[table_def(store, max_times_sampled=100)], sync_interval_s=0, seed=3)
    with d.connect() as c:
        t = busy_table(c, 0, 40)
        [rep] = c.sync("f")
        assert_on_disk(store)  # before anything writes again
        assert rep["items"] == 40 and rep["table"] == "f"
        want = state(t)
        busy_table(c, 40, 8)  # after the sync: lost in the reboot
        assert len(t) == 48
    reboot(d, store)
    d.start()
    assert "adopted /shmreplay" in d.log() and "from its metadata file: 40 items" in d.log()
    with d.connect() as c:
        t = c.table("f")
        assert_same(state(t), want)
        assert c.stats()["tables"]["f"]["synced_items"] == 40  # synced again at once
        b = t.sample(64)  # and it serves: the sampler was rebuilt from the priorities
        assert set(b.data["id"].tolist()) <= set(range(40))
        assert np.array_equal(b.data["obs"], rows(b.data["id"])["obs"])


def test_a_clean_stop_keeps_the_table_through_a_reboot(start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    d = start_daemon(tables=[table_def(store, max_times_sampled=100)], sync_interval_s=0, seed=3)
    with d.connect() as c:
        t = busy_table(c, 0, 50)
        want = state(t)
    assert d.stop() == 0  # its last sync
    assert_on_disk(store)
    assert shm_entries(f"shmreplay.{d.instance}.") == set()
    meta = os.path.join(store, f"shmreplay.{d.instance}.t.f")
    assert stat.S_IMODE(os.stat(meta).st_mode) == 0o600
    reboot(d, store)
    d.start()
    with d.connect() as c:
        assert_same(state(c.table("f")), want)


def check_rows(t, lo: int, hi: int) -> np.ndarray:
    """Every item is whole and carries its own priority; ids are newest-first
    contiguous (fifo eviction) within [lo, hi).  Returns the ids."""
    s = state(t)
    ids = s["id"]
    assert np.array_equal(s["obs"], rows(ids)["obs"]), "a row holds another item's bytes"
    np.testing.assert_array_equal(s["prios"], prio(ids))
    assert np.array_equal(ids, np.arange(ids[0], ids[0] + len(ids))) and lo <= ids[0] and ids[-1] < hi
    return ids


def test_no_slot_listed_on_disk_is_written_before_the_next_sync(start_daemon, tmp_path):
    """The reuse barrier (server/tables/slots/barrier.py): a full table goes on evicting
    and overwriting, after a daemon SIGKILL and an adoption from /dev/shm
    too; whenever the box goes down, the file on disk lists only items whose
    rows are still theirs."""
    store = str(tmp_path / "tables")
    d = start_daemon(tables=[table_def(store)], sync_interval_s=0)
    with d.connect() as c:
        t = c.table("f")
        t.insert_batch(rows(np.arange(64)), priorities=prio(np.arange(64)))
        c.flush()
        assert c.sync("f")[0]["items"] == 64  # every slot is listed on disk now
    d.crash()
    d.start()  # adopts the /dev/shm segment; the file on disk still guards its slots
    with d.connect() as c:
        t = c.table("f")
        t.insert_batch(rows(np.arange(64, 72)), priorities=prio(np.arange(64, 72)))
        c.flush()
    reboot(d, store)  # right after the first overwrite
    d.start()
    with d.connect() as c:
        t = c.table("f")
        ids = check_rows(t, 0, 72)
        assert len(ids) >= 64 - HEADROOM - 8, ids
        first = int(ids[-1]) + 1
        for first in range(first, first + 104, 8):  # wraps the table one and a half times
            t.insert_batch(rows(np.arange(first, first + 8)), priorities=prio(np.arange(first, first + 8)))
            c.flush()
        last = first + 8
        check_rows(t, 0, last)
        st = c.stats()["tables"]["f"]
        assert st["sync_headroom"] == HEADROOM, st
        assert st["syncs"] >= 3 and st["evictions"] >= 104 - HEADROOM, st  # full: syncs asked for
        assert 64 - HEADROOM - 8 <= len(t) <= 64
    reboot(d, store)
    d.start()
    with d.connect() as c:
        t = c.table("f")
        ids = check_rows(t, 0, last)
        # what the last sync's copy listed: all but the free and retired
        # slots (the headroom, and up to a batch more: a writer evicts for
        # itself until the retired slots reach the headroom) and a batch
        # reserved and not yet committed.  The fresh-clone suite under load
        # saw 32 (on b4635de): the bound of 64 - HEADROOM - 8 held only when
        # the copy missed those moments.  The newest item listed lags the
        # last written by as much (a loaded run saw 143 of 167, on f7fa4d9)
        assert len(ids) >= 64 - HEADROOM - 2 * 8 and ids[-1] >= last - 2 * 8 - HEADROOM, ids


def test_sync_from_the_command_line_and_what_status_shows(start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    d = start_daemon(tables=[table_def(store), {"name": "ram", "capacity": 8, "fields": FIELDS}],
                     storage_dirs=[store], sync_interval_s=0)
    with d.connect() as c:
        c.table("f").insert_batch(rows(np.arange(10)))
        c.flush()
        out = cli("--socket", d.socket, "sync")
        path = os.path.join(store, f"shmreplay.{d.instance}.t.f")
        assert f"f: 10 items on disk in {path}" in out, out
        st = c.stats()["tables"]
        assert st["f"]["durable"] and st["f"]["synced_items"] == 10 and st["f"]["sync_failures"] == 0
        assert not st["ram"]["durable"]
        assert 10 * 3000 <= st["f"]["resident_bytes"] <= st["f"]["rows_bytes"], st["f"]
        out = cli("--socket", d.socket, "status")
        assert f"durable: 10 items on disk in {path}, synced " in out and "GiB of it in memory" in out, out
        with pytest.raises(shmreplay.ReplayError, match="'ram' is not a durable file-backed table"):
            c.sync("ram")
        with pytest.raises(shmreplay.UnknownTable):
            c.sync("nope")
        c.drop_table("f")  # dropping removes everything
        assert os.listdir(store) == []


def cli(*args) -> str:
    run = subprocess.run([sys.executable, "-m", "shmreplay.cli", *args], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.parametrize("plant", ["symlink", "mode"])
def test_a_metadata_file_the_daemon_did_not_make_is_left_alone(start_daemon, tmp_path, plant):
    """A client's table (not in the config) whose metadata file was replaced
    by a link, or given another mode: not adopted, not touched, logged."""
    store = str(tmp_path / "tables")
    d = start_daemon(storage_dirs=[store], sync_interval_s=0)
    with d.connect() as c:
        c.create_table("f", capacity=16, fields=FIELDS, storage_dir=store)
    assert d.stop() == 0
    meta = os.path.join(store, f"shmreplay.{d.instance}.t.f")
    if plant == "symlink":
        target = str(tmp_path / "elsewhere")
        os.rename(meta, target)
        os.symlink(target, meta)
    else:
        os.chmod(meta, 0o644)
    before = os.lstat(meta)
    reboot(d, store)
    d.start()
    assert "not adopted from" in d.log() and meta in d.log()
    after = os.lstat(meta)
    assert (after.st_mode, after.st_ino, after.st_mtime_ns) == (before.st_mode, before.st_ino, before.st_mtime_ns)
    with d.connect() as c:
        assert c.list_tables() == [] and "f" in c.stats()["set_aside"]  # its name kept for a human
    d.stop()
    for name in os.listdir(store):  # the test's own cleanup of what the daemon rightly kept
        os.unlink(os.path.join(store, name))


def test_a_durable_queue_never_evicts_an_item_nobody_sampled(start_daemon, tmp_path):
    """A queue's slots come back only by sampling; once the file on disk
    lists them they are retired, and a writer waits for the sync that frees
    them rather than evicting what is still unsampled.  Every item comes
    out exactly once, in order, through a reboot too."""
    store = str(tmp_path / "tables")
    d = start_daemon(storage_dirs=[store], sync_interval_s=0)
    with d.connect() as c:
        q = c.create_queue("f", 64, FIELDS, storage_dir=store)
        assert_on_disk(store)  # its first sync, a new file (no rename over an old one)
        q.insert_batch(rows(np.arange(64)))
        c.flush()
        assert c.sync("f")[0]["items"] == 64
        got = [q.sample(8).data["id"]]  # they leave; their slots are listed on disk
        q.insert_batch(rows(np.arange(64, 72)))  # needs those slots: waits for a sync
        c.flush()
        st = c.stats()["tables"]["f"]
        assert st["evictions"] == 0 and st["syncs"] >= 3 and len(q) == 64, st  # create, ours, the wait's
        got += [q.sample(8).data["id"] for _ in range(4)]
        c.sync("f")
        assert_on_disk(store)
    reboot(d, store)
    d.start()
    with d.connect() as c:
        q = c.table("f")
        while len(q):
            got.append(q.sample(8).data["id"])
    assert np.array_equal(np.concatenate(got), np.arange(72))


def synced(start_daemon, tmp_path, more: int = 0):
    """A durable table of 40 busy items, synced; then ``more`` items and a
    second sync.  Returns the daemon, its storage directory, the table's
    state at the first sync, its metadata file, and the meta segment's bytes
    at the last sync; the daemon is SIGKILLed."""
    store = str(tmp_path / "tables")
    d = start_daemon(tables=[table_def(store, max_times_sampled=100)], sync_interval_s=0, seed=3)
    with d.connect() as c:
        t = busy_table(c, 0, 40)
        c.sync("f")
        want = state(t)
        if more:
            busy_table(c, 40, more)
            c.sync("f")
            assert len(t) == 40 + more
        with open("/dev/shm" + d.segment("f"), "rb") as f:
            image = f.read()
    d.crash()
    return d, store, want, os.path.join(store, f"shmreplay.{d.instance}.t.f"), image


def test_a_format_1_metadata_file_is_adopted_and_converted(start_daemon, tmp_path):
    """Issue 34, item 6: builds before it wrote the file as the meta
    segment's bytes alone (format 1).  A start adopts such a file with every
    item it lists, and replaces it with a format-2 file: two copies, each a
    page of header and the bytes page-rounded, space reserved, the newest
    copy the old bytes."""
    d, store, want, meta, old = synced(start_daemon, tmp_path)  # old: what a format-1 sync wrote
    os.unlink(meta)
    fd = os.open(meta, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(old)
    reboot(d, store)
    d.start()
    assert "converting to format 2" in d.log()
    with d.connect() as c:
        assert_same(state(c.table("f")), want)
        with open(meta, "rb") as f:
            assert f.read(8) == b"SHMRMETA"
        st = os.stat(meta)
        assert st.st_size == 2 * (4096 + -(-len(old) // 4096) * 4096), (st.st_size, len(old))
        assert st.st_blocks * 512 >= st.st_size and stat.S_IMODE(st.st_mode) == 0o600  # reserved, not sparse
        c.drop_table("f")


def test_a_torn_newest_copy_falls_back_to_the_sync_before(start_daemon, tmp_path):
    """A crash in the middle of a sync leaves the copy it wrote torn; the
    file's other copy, the sync before, is whole and is what a reboot finds.
    The format (docs/layout.md): two halves, each a 4096-byte header page
    (magic, version, crc32, sequence number, size) and the bytes."""
    import struct
    d, store, want, meta, _ = synced(start_daemon, tmp_path, more=8)
    with open(meta, "r+b") as f:
        data = f.read()
        half = len(data) // 2
        seqs = [struct.unpack_from("<8sIIQQ", data, off)[3] for off in (0, half)]
        newer = (0, half)[seqs.index(max(seqs))]
        f.seek(newer + 4096 + 100)  # a sync cut off after its first bytes
        f.write(b"\0" * 4096)
    reboot(d, store)
    d.start()
    with d.connect() as c:
        assert_same(state(c.table("f")), want)
        c.drop_table("f")


def test_a_foreign_metadata_file_does_not_stop_a_live_table_from_being_adopted(start_daemon, tmp_path):
    """A SIGKILLed daemon's table is adopted from its live meta segment even
    when its metadata file is not one the daemon made (here: mode 0644): the
    file is logged, never read, and a new one replaces it, as the first
    sync of earlier builds replaced it."""
    d, store, want, meta, _ = synced(start_daemon, tmp_path)
    os.chmod(meta, 0o644)
    d.start()
    assert "is not a mode-0600 file of the daemon's user" in d.log() and "renamed over that name" in d.log()
    with d.connect() as c:
        assert_same(state(c.table("f")), want)
        assert stat.S_IMODE(os.stat(meta).st_mode) == 0o600 and c.stats()["tables"]["f"]["sync_failures"] == 0
        c.drop_table("f")
