"""Clairvoyant prefetch of file-backed tables (issue 14, item 2): the
daemon reads the rows of drawn and reserved slots into the page cache
ahead of the clients, writes committed rows back in the background, keeps
its queue bounded, and stops its readers at shutdown.

Counters are compared once the prefetcher is idle (nothing queued, no
reader busy): a state the daemon reports, never a moment on the clock."""

import os
import threading

import numpy as np
import pytest

import shmreplay
from shmreplay.schema import make_spec
from shmreplay.server.control.config import parse_config
from shmreplay.server.disk.prefetch import Prefetcher
from shmreplay.wire.rowranges import ranges_of
from shmreplay.wire.layout import TableLayout
from shmreplay.wire.records import key_slots

from waiting import wait_for

ROW = 3 * 4096 + 100  # an obs row spans pages, so ranges merge only for neighbouring slots
FIELDS = {"obs": ("uint8", (ROW,)), "id": ("int64", ())}


def rows(ids):
    """Rows whose every byte follows from the id: a torn or stale row shows."""
    ids = np.asarray(ids, dtype=np.int64)
    obs = (ids[:, None] * 7 + np.arange(ROW)[None, :]) % 251
    return {"obs": obs.astype(np.uint8), "id": ids}


def exact(data) -> bool:
    return bool(np.array_equal(data["obs"], rows(data["id"])["obs"]))


def fields_of(store, capacity):
    """(offsets, widths) of the table's fields in its rows file, as the daemon computes them."""
    lo = TableLayout(make_spec("f", capacity, FIELDS, storage_dir=store))
    spec = lo.spec
    return (np.array([lo.field_offs[f.name] for f in spec.fields], np.int64),
            np.array([f.item_bytes for f in spec.fields], np.int64))


def ranges_by_hand(slots, offs, widths) -> int:
    """How many reads the daemon makes for ``slots``: wire/rowranges.py's
    rule worked out another way, in plain Python.  Per field, the 4 KiB
    pages the slots' rows touch (field f's row of slot s is bytes
    [offs[f] + s * widths[f], offs[f] + (s + 1) * widths[f])); each run of
    consecutive pages is one range (neighbouring rows, and rows that share
    or touch a page, merge), split into pieces of at most 1 MiB (256 pages)."""
    n = 0
    for off, w in zip(offs.tolist(), widths.tolist()):
        pages = set()
        for s in set(slots.tolist()):
            pages.update(range((off + s * w) // 4096, -(-(off + (s + 1) * w) // 4096)))
        runs, last = [], None
        for p in sorted(pages):
            if last is not None and p == last + 1:
                runs[-1] += 1
            else:
                runs.append(1)
            last = p
        n += sum(-(-r // 256) for r in runs)
    return n


def idle_stats(c, name="f"):
    """The table's counters once nothing is queued or being read."""
    def idle():
        st = c.stats()
        return st if st["prefetch"]["queued"] == 0 and st["prefetch"]["busy"] == 0 else None
    return wait_for(idle, "the prefetcher to go idle")["tables"][name]


def test_ranges_merge_neighbouring_slots_and_cover_whole_pages():
    offs, widths = np.array([4096, 16 << 20], np.int64), np.array([ROW, 8], np.int64)
    o, n = ranges_of(np.array([7, 5, 6, 6, 40]), offs, widths)

    def pages(lo, hi):  # [lo, hi) widened to whole pages, as (offset, length)
        lo, hi = lo // 4096 * 4096, (hi + 4095) // 4096 * 4096
        return lo, hi - lo
    # slots 5-7 make one range per field, 40 its own; the id field's rows share a page
    assert [(int(a), int(b)) for a, b in zip(o, n)] == [
        pages(4096 + 5 * ROW, 4096 + 8 * ROW), pages(4096 + 40 * ROW, 4096 + 41 * ROW), (16 << 20, 4096)]
    assert all(a % 4096 == 0 and b % 4096 == 0 for a, b in zip(o, n))
    assert ranges_by_hand(np.array([7, 5, 6, 6, 40]), offs, widths) == 3  # the tests' own count agrees
    o, n = ranges_of(np.arange(1000), offs, widths, align=1, max_len=1 << 20)
    assert n.max() == 1 << 20 and int(n.sum()) == 1000 * (ROW + 8)  # split, nothing lost
    assert ranges_of(np.zeros(0, np.int64), offs, widths)[0].shape == (0,)


def test_drawn_and_reserved_rows_are_read_ahead_and_committed_rows_written_back(start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    cap = 400
    d = start_daemon(storage_dirs=[store], seed=3, prefetch_threads=4)
    with d.connect() as c:
        t = c.create_table("f", capacity=cap, fields=FIELDS, storage_dir=store)
        t.insert_batch(rows(np.arange(cap)))
        c.flush()
        st = idle_stats(c)
        # every reserved slot's row was read once at least (its pages, whole)
        assert st["prefetch_bytes"] >= cap * ROW and st["prefetch_errors"] == 0
        # the inserts start a writeback of the file within a period (0.25 s)
        wait_for(lambda: c.stats()["tables"]["f"]["writeback_calls"] > 0, "a writeback")
        offs, widths = fields_of(store, cap)
        for _ in range(3):
            before = st["prefetch_reads"]
            b = t.sample(64)
            st = idle_stats(c)
            # exactly the ranges of the drawn slots were read
            assert st["prefetch_reads"] - before == ranges_by_hand(key_slots(b.keys), offs, widths)
        assert st["prefetch_dropped"] == 0
        assert c.stats()["prefetch"]["threads"] == 4


@pytest.mark.parametrize("method", ["fadvise", "pread"])
def test_rows_stay_exact_while_prefetch_and_writers_run(start_daemon, tmp_path, method):
    """A writer overwrites the ring while a learner iterates 3 batches ahead:
    every row gathered is one some writer wrote, byte for byte."""
    store = str(tmp_path / "tables")
    d = start_daemon(storage_dirs=[store], seed=5, prefetch_method=method)
    with d.connect() as c:
        t = c.create_table("f", capacity=300, fields=FIELDS, storage_dir=store)
        t.insert_batch(rows(np.arange(300)))
        c.flush()
        stop, failures, written = threading.Event(), [], []

        def write():
            try:
                with d.connect() as w:
                    wt, i = w.table("f"), 300
                    while not stop.is_set():
                        wt.insert_batch(rows(np.arange(i, i + 16)))
                        i += 16
                    w.flush()
                written.append(i - 300)
            except BaseException as exc:  # a writer that died must fail the test, not pass it quietly
                failures.append(f"writer: {exc!r}")

        th = threading.Thread(target=write)
        th.start()
        try:
            with t.iterate(32, prefetch=3) as it:
                for _, b in zip(range(60), it):
                    if not exact(b.data):
                        failures.append(b.data["id"].tolist())
            for _ in range(20):
                if not exact(t.sample(32).data):
                    failures.append("sample")
        finally:
            stop.set()
            th.join(60)
        assert not failures and not th.is_alive() and written and written[0] > 0, (failures, written)
        assert idle_stats(c)["prefetch_reads"] > 0
    # and the file holds what the writers wrote, past the writeback
    with d.connect() as c:
        t = c.table("f")
        assert exact(t.sample(300).data)


def test_a_full_queue_drops_its_oldest_ranges_instead_of_growing(start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    cap, bound = 500, 8
    d = start_daemon(storage_dirs=[store], seed=11, prefetch_threads=1, prefetch_queue=bound)
    with d.connect() as c:
        t = c.create_table("f", capacity=cap, fields=FIELDS, storage_dir=store)
        t.insert_batch(rows(np.arange(cap)))
        c.flush()
        offs, widths = fields_of(store, cap)
        st = idle_stats(c)
        dropped = st["prefetch_dropped"]
        b = t.sample(128)
        n = ranges_by_hand(key_slots(b.keys), offs, widths)
        assert n > bound
        st = idle_stats(c)
        # the draw's ranges met a queue of at most `bound`: all but `bound` went at once
        assert st["prefetch_dropped"] - dropped >= n - bound
        assert c.stats()["prefetch"]["queued_max"] == bound  # filled to its bound, never past it
        assert exact(b.data)


def test_prefetch_off_leaves_tables_alone(start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    d = start_daemon(storage_dirs=[store], prefetch_threads=0)
    with d.connect() as c:
        t = c.create_table("f", capacity=50, fields=FIELDS, storage_dir=store)
        t.insert_batch(rows(np.arange(50)))
        assert exact(t.sample(50).data)
        st = c.stats()
        assert st["prefetch"]["threads"] == 0 and "prefetch_reads" not in st["tables"]["f"]


def test_a_client_maps_rows_files_for_random_access(start_daemon, tmp_path):
    """A fault in a client reads one page, not the disk's read-ahead around it."""
    store = str(tmp_path / "tables")
    d = start_daemon(storage_dirs=[store])
    with d.connect() as c:
        c.create_table("f", capacity=50, fields=FIELDS, storage_dir=store)
        path = os.path.join(store, f"shmreplay.{d.instance}.r.f")
        with open("/proc/self/smaps") as f:
            maps = f.read().split("\n")
        starts = [i for i, line in enumerate(maps) if line.endswith(" " + path)]
        assert starts
        for i in starts:
            flags = next(line for line in maps[i:] if line.startswith("VmFlags:"))
            assert " rr" in flags


@pytest.mark.parametrize("method", ["pread", "fadvise"])
def test_readers_read_and_are_joined_at_stop(tmp_path, method):
    """The pool on its own, in this process: reads land, stop joins every
    reader and closes the descriptors it held."""
    path = tmp_path / "rows"
    data = np.random.default_rng(0).integers(0, 256, 64 * 8192, dtype=np.uint8)
    path.write_bytes(data.tobytes())
    before = {t.ident for t in threading.enumerate()}
    pf = Prefetcher(threads=3, bound=1000, method=method)
    fd = os.open(path, os.O_RDWR)
    try:
        src = pf.source("t", fd, [(0, 8192)])
        pf.read_rows(src, np.arange(0, 64, 3))
        wait_for(lambda: pf.table_stats(0, src)["prefetch_reads"] == 22 and pf.stats()["busy"] == 0,
                 "22 ranges read")
        assert pf.table_stats(0, src)["prefetch_bytes"] == 22 * 8192
        wait_for(lambda: pf.table_stats(0, src)["writeback_calls"] > 0, "a writeback (no counter: always due)")
        own = src.fd
        assert pf.stats()["threads"] == 3
    finally:
        pf.stop()
        os.close(fd)
    assert not [t for t in threading.enumerate() if t.ident not in before]
    assert pf.stats()["threads"] == 0
    with pytest.raises(OSError):
        os.fstat(own)
    pf.read_rows(src, np.arange(4))  # after stop: ignored, never queued
    assert pf.stats()["queued"] == 0
    with pytest.raises(shmreplay.ReplayError, match="prefetch_method"):
        parse_config({"daemon": {"prefetch_method": "mmap"}})


def test_a_small_field_is_not_read_ahead_beside_a_large_one(start_daemon, tmp_path):
    """A field whose whole array is at most 64 MiB (ids, actions, rewards)
    stays in the page cache by use: only the large field's ranges are read
    ahead, one call fewer per row for a warm learner."""
    store = str(tmp_path / "tables")
    big = {"obs": ("uint8", (65536,)), "id": ("int64", ())}
    cap = 1100  # obs: 72 MB, over the 64 MiB line; id: 8.8 KB
    d = start_daemon(storage_dirs=[store], seed=3, prefetch_threads=2)
    with d.connect() as c:
        t = c.create_table("f", capacity=cap, fields=big, storage_dir=store)
        ids = np.arange(100)
        t.insert_batch({"obs": np.repeat((ids % 251).astype(np.uint8)[:, None], 65536, axis=1), "id": ids})
        c.flush()
        lo = TableLayout(make_spec("f", cap, big, storage_dir=store))
        offs, widths = np.array([lo.field_offs["obs"]], np.int64), np.array([65536], np.int64)
        before = idle_stats(c)["prefetch_reads"]
        b = t.sample(64)
        st = idle_stats(c)
        assert st["prefetch_reads"] - before == ranges_by_hand(key_slots(b.keys), offs, widths)
        assert np.array_equal(b.data["obs"][:, 0], (b.data["id"] % 251).astype(np.uint8))


def test_a_frame_tables_draw_reads_its_items_frames_ahead(start_daemon, tmp_path):
    """Issue 37: a draw from a file-backed frame table reads ahead its
    slots' fields and the frames its items reference (the daemon's
    references), each ring's frames next to each other as one range."""
    from framestreams import FIELDS as PX, FRAMES, stack, tag
    store = str(tmp_path / "tables")
    d = start_daemon(storage_dirs=[store], seed=3, prefetch_threads=4)
    with d.connect() as c:
        t = c.create_table("f", capacity=300, fields=PX, frames=FRAMES, storage_dir=store)
        for i in range(200):
            t.insert(obs=stack(0, 0, i), next_obs=stack(0, 0, i + 1), action=i, reward=0.0, discount=1.0,
                     tag=tag(0, 0, i))
        c.flush()
        st = idle_stats(c)
        lo = t.mapped.layout
        offs, widths = lo.row_spans()
        [ring] = lo.rings
        for _ in range(3):
            before = st["prefetch_reads"]
            b = t.sample(16)
            st = idle_stats(c)
            slots = key_slots(b.keys)
            frames = np.unique(t.mapped.refs[slots])
            want = (ranges_by_hand(slots, offs, widths)
                    + ranges_by_hand(frames.astype(np.int64), np.array([ring.offset]), np.array([ring.frame_bytes])))
            assert st["prefetch_reads"] - before == want
        assert st["prefetch_errors"] == 0
