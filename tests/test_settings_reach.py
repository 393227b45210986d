"""Settings that cannot work are refused or warned at create
(``shmreplay/leasing.py``, ``schema._check_limits``; docs/guide.md, Tables).

Each writer here is a real client process against a real daemon.  A writer
that samples its own table after each insert (CleanRL's loop: one process
inserts a step, then samples) sees the table exactly as its own commands
left it: the daemon applies one client's commands in order, so the SAMPLE
after an insert finds that insert committed and its next lease reserved.
No timing decides anything: every sample is ``timeout=0``.

The numbers, by hand from client/lease.py: a 10,000-item table's lease is
10,000 // 256 = 39 slots; the next one is asked for when fewer than
39 // 2 = 19 are left.  So between calls a writer of single items keeps 19
(19 left, none asked for) to 18 + 39 = 57 (18 left and the next 39)
slots reserved, and the table holds 9,943 to 9,981 items.
"""

import queue
import warnings

import numpy as np
import pytest

import shmreplay
from waiting import HANG_S, wait_for, worker_context

FIELDS = {"v": ("int64", ())}
CAPACITY = 10_000
LEASE = 39
FULLEST = CAPACITY - 19        # with one writer of single items: at most
LARGEST_QUIET = CAPACITY - 57  # and at least: the largest min_size_to_sample not warned


def write_and_sample(sock, out, capacity, mss, count, batch=1, **limits):
    """A writer process: create the table (the warnings it gets), insert
    ``count`` items ``batch`` at a time, and after each call past the
    table's capacity, try a sample of one at once.  Puts (warnings, [sampled
    or not per try], items in the table, reserved slots)."""
    with shmreplay.connect(sock) as c:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            t = c.create_table("t", capacity, FIELDS, min_size_to_sample=mss, **limits)
        tries = []
        for lo in range(0, count, batch):
            if batch == 1:
                t.insert(v=lo)
            else:
                t.insert_batch({"v": np.arange(lo, lo + batch)})
            if lo + batch > capacity:
                try:
                    t.sample(1, timeout=0)
                    tries.append(True)
                except shmreplay.RateLimited:
                    tries.append(False)
        st = c.stats()["tables"]["t"]
        out.put(([(w.category.__name__, str(w.message)) for w in said], tries, st["size"], st["reserved"]))


def run_writer(daemon, capacity, mss, count, batch=1, **limits):
    return in_process(write_and_sample, daemon.socket, capacity, mss, count, batch, **limits)


def in_process(target, *args, **kwargs):
    """Run ``target(*args, out, **kwargs)`` in a client process; what it put."""
    ctx = worker_context()
    out = ctx.Queue()
    p = ctx.Process(target=target, args=(args[0], out, *args[1:]), kwargs=kwargs)
    p.start()
    try:
        got = wait_for(lambda: poll(out, p), "the writer process's result", timeout=HANG_S * 2)
        p.join(HANG_S)
        assert p.exitcode == 0
        return got
    finally:
        if p.is_alive():
            p.kill()
            p.join()


def poll(out, p):
    try:
        return out.get(timeout=0.2)
    except queue.Empty:
        assert p.is_alive() or not out.empty(), f"the writer process exited with {p.exitcode}"
        return None


def test_cleanrls_min_size_equal_to_capacity_is_warned_and_never_samples(daemon):
    """CleanRL's defaults (buffer_size 10,000, learning_starts 10,000): the
    creating client gets a UserWarning that says what to set, the daemon
    logs it, and a writer of single items indeed never lets the table reach
    10,000 items, in any phase of its leases (two leases' worth of tries)."""
    said, tries, size, reserved = run_writer(daemon, CAPACITY, CAPACITY, CAPACITY + 2 * LEASE + 2)
    assert len(said) == 1 and said[0][0] == "UserWarning", said
    msg = said[0][1]
    assert "min_size_to_sample 10000 of capacity 10000 is never reached" in msg
    assert f"at most {FULLEST} items" in msg and f"Set min_size_to_sample to at most {LARGEST_QUIET}" in msg
    assert "insert in batches of more than 39 items" in msg
    assert msg in daemon.log()
    assert len(tries) == 2 * LEASE + 2 and not any(tries), tries
    assert size + reserved == CAPACITY and size < CAPACITY


def test_the_largest_unwarned_min_size_samples_in_every_phase_of_a_writers_leases(daemon):
    """min_size_to_sample = capacity - 57 draws no warning, and once the
    writer has inserted a table's worth, every sample after every insert
    runs, through two whole leases (each phase of the lease once at least):
    the table never holds fewer items than that.  One more and it would not."""
    said, tries, size, _ = run_writer(daemon, CAPACITY, LARGEST_QUIET, CAPACITY + 2 * LEASE + 2)
    assert said == []
    assert len(tries) == 2 * LEASE + 2 and all(tries), [i for i, ok in enumerate(tries) if not ok]
    assert LARGEST_QUIET <= size <= FULLEST
    with daemon.connect() as c:
        c.drop_table("t")
    said, tries, _, _ = run_writer(daemon, CAPACITY, LARGEST_QUIET + 1, CAPACITY + 2 * LEASE + 2)
    assert len(said) == 1 and "is not always reached" in said[0][1] and "sampling stalls" in said[0][1]
    assert not all(tries) and any(tries), "the worst phase of each lease (57 reserved) refuses it"


def test_a_warned_min_size_is_reached_by_a_writer_of_batches_larger_than_its_lease(daemon):
    """Why equal to capacity is warned, not refused: a writer of batches
    larger than its lease (40 > 39) reserves each batch exactly and keeps
    nothing reserved between calls, so the table fills and samples."""
    said, tries, size, reserved = run_writer(daemon, CAPACITY, CAPACITY, CAPACITY + 4 * 40, batch=40)
    assert len(said) == 1 and "never reached" in said[0][1]
    assert len(tries) == 4 and all(tries), tries
    assert size == CAPACITY and reserved == 0


def test_a_rate_limited_table_full_to_min_size_is_not_warned_and_samples(daemon):
    """A rate-limited table's writers are stopped by its limiter, and then
    their leases run dry: every reserved slot is written and the table
    fills.  So min_size_to_sample = capacity is not warned there, and a
    writer of single items that inserts until the limiter stops it leaves
    a full table that samples (1,024 items: a lease of 16)."""
    said, inserted, sampled, size = in_process(fill_until_limited, daemon.socket)
    assert said == [] and sampled and size == 1024
    assert inserted == 1100  # the limiter's max_diff: 1,100 inserts before a sample


def fill_until_limited(sock, out):
    with shmreplay.connect(sock) as c:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            t = c.create_table("q", 1024, FIELDS, min_size_to_sample=1024, samples_per_insert=1.0,
                               error_buffer=(0.0, 1100.0))
        assert t.lease_size == 16
        inserted = 0
        while inserted < 2000:  # bounded: the limiter stops it at 1,100
            try:
                t.insert(v=inserted, timeout=0)
            except shmreplay.RateLimited:
                break
            inserted += 1
        t.sample(1, timeout=0)
        out.put(([str(w.message) for w in said], inserted, True, c.stats()["tables"]["q"]["size"]))


def test_a_durable_table_is_warned_for_its_sync_headroom(start_daemon, tmp_path):
    """A durable file-backed table keeps half to all of its sync headroom
    (1,000 items: 64) out of use once it has synced, besides the writers'
    leases (16: 8 to 23 reserved): min_size_to_sample 977 is quiet in
    /dev/shm and warned on disk, naming 1,000 - 23 - 64 = 913."""
    store = str(tmp_path / "store")
    d = start_daemon(storage_dirs=[store])
    with d.connect() as c:
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            c.create_table("shm", 1000, FIELDS, min_size_to_sample=977, storage_dir="")
            assert said == []
            c.create_table("disk", 1000, FIELDS, min_size_to_sample=977, storage_dir=store)
            c.create_table("disk2", 1000, FIELDS, min_size_to_sample=913, storage_dir=store)
        assert len(said) == 1, [str(w.message) for w in said]
        msg = str(said[0].message)
        assert "table 'disk'" in msg and "keeps 33 to 64 slots evicted ahead of its next sync" in msg
        assert "Set min_size_to_sample to at most 913" in msg
        assert msg in d.log()
        c.drop_table("shm")
        c.drop_table("disk")
        c.drop_table("disk2")


def write_through_syncs(sock, out, store, mss):
    """A writer process: fill a durable 1,000-item table, sync it (from now
    on its file lists items, and slots freed are retired until the next
    sync, which a full table forces: sync_interval_s 0), then insert 600
    more one at a time, sampling after each.  Puts [sampled or not]."""
    with shmreplay.connect(sock) as c:
        t = c.create_table("d", 1000, FIELDS, min_size_to_sample=mss, storage_dir=store)
        for i in range(1000):
            t.insert(v=i)
        c.sync()
        tries = []
        for i in range(600):
            t.insert(v=i)
            try:
                t.sample(1, timeout=0)
                tries.append(True)
            except shmreplay.RateLimited:
                tries.append(False)
        out.put((tries, c.stats()["tables"]["d"]["syncs"]))


def test_the_largest_unwarned_min_size_of_a_durable_table_samples_through_its_syncs(start_daemon,
                                                                                      tmp_path):
    """913 of 1,000 samples after every insert while retired slots pile up
    and forced syncs free them (600 inserts: several syncs): the table
    never holds fewer.  968 is more than it ever holds (1,000 less half
    the headroom and one: its writer may wait for a sync with no slot
    reserved) and no sample runs."""
    store = str(tmp_path / "store")
    d = start_daemon(storage_dirs=[store], sync_interval_s=0)
    tries, syncs = in_process(write_through_syncs, d.socket, store, 913)
    assert all(tries), [i for i, ok in enumerate(tries) if not ok]
    assert syncs >= 5, "the inserts went through several syncs"
    with d.connect() as c:
        c.drop_table("d")
    tries, _ = in_process(write_through_syncs, d.socket, store, 968)
    assert not any(tries)


def test_min_size_past_capacity_is_refused_saying_what_to_set(client):
    with pytest.raises(shmreplay.SchemaError, match=r"min_size_to_sample 101 outside 1\.\.capacity "
                       r"\(100\); the table could never be sampled: set it to at least 1 and at most"):
        client.create_table("t", 100, FIELDS, min_size_to_sample=101)
    assert client.list_tables() == []
