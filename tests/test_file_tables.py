"""File-backed tables (issue 14, item 1): the rows of a table with a
``storage_dir`` live in a file there, mapped by actors and learners as a
/dev/shm segment is; the metadata stays in /dev/shm."""

import os
import re
import stat
import subprocess
import sys

import numpy as np
import pytest

import shmreplay
from shmreplay.wire.layout import TableLayout

from conftest import nested_env, shm_entries, table_objects, write_config
from shmreplay.wire.names import lock_path

FIELDS = {"obs": ("uint8", (64,)), "id": ("int64", ())}


def rows(ids):
    ids = np.asarray(ids, dtype=np.int64)
    return {"obs": np.repeat((ids % 251).astype(np.uint8)[:, None], 64, axis=1), "id": ids}


def torn(data) -> int:
    return int(np.sum(np.any(data["obs"] != (data["id"] % 251).astype(np.uint8)[:, None], axis=1)))


def table_def(name, capacity, storage_dir=None, **kw):
    d = {"name": name, "capacity": capacity, "fields": FIELDS, **kw}
    if storage_dir is not None:
        d["storage_dir"] = str(storage_dir)
    return d


def rows_file(d, store, table):
    return os.path.join(store, f"shmreplay.{d.instance}.r.{table}")


def test_a_file_backed_table_keeps_its_rows_on_disk_and_serves_like_any_other(start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    d = start_daemon(storage_dirs=[store], seed=7)
    with d.connect() as c:
        t = c.create_table("f", capacity=500, fields=FIELDS, storage_dir=store)
        path = rows_file(d, store, "f")
        st = os.stat(path)
        spec = shmreplay.schema.make_spec("f", 500, FIELDS, storage_dir=store)
        assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_size == TableLayout(spec).rows_size
        # the metadata is in /dev/shm, the rows are not
        assert table_objects(d.instance) == {"t.f"}
        t.insert_batch(rows(np.arange(700)), priorities=np.full(700, 2.0))  # wraps: 200 evicted
        t.insert(**{k: v[0] for k, v in rows([700]).items()})
        c.flush()
        # a single insert's leased slot handed back at flush was evicted when
        # leased; a durable table evicts up to its headroom ahead (barrier.py)
        # headroom: 1 % of 500 is 5, at least 64 makes 64, at most a quarter (125) keeps 64;
        # lease (client/leases.py lease_size): 500 // 256 is 1, at least 16 makes 16
        assert c.stats()["tables"]["f"]["sync_headroom"] == 64 and t.lease_size == 16
        room = 64 + 2 * 16
        assert 500 - room <= len(t) <= 500
        b = t.sample(256)
        assert torn(b.data) == 0 and set(b.data["id"].tolist()) <= set(range(201 - room, 701))
        t.update_priorities(b.keys[:1], [50.0])
        c.flush()
        assert c.stats()["tables"]["f"]["priority_updates"] == 1
    # what a learner gathered is what the file holds
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:8] == b"SHMRROW\0"
    with d.connect() as c:
        c.drop_table("f")
    assert not os.path.exists(path)


def test_the_daemon_default_puts_tables_on_disk_and_empty_asks_for_dev_shm(start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    d = start_daemon(storage_dir=store)
    with d.connect() as c:
        c.create_table("disk", capacity=10, fields=FIELDS)
        c.create_table("ram", capacity=10, fields=FIELDS, storage_dir="")
        assert os.path.exists(rows_file(d, store, "disk"))
        assert not os.path.exists(rows_file(d, store, "ram"))
        assert table_objects(d.instance) == {"t.disk", "t.ram", "r.ram"}
        # the same definition is the same table, whichever way it was asked for
        assert c.create_table("disk", capacity=10, fields=FIELDS, storage_dir=store, exist_ok=True).name == "disk"
    assert d.stop() == 0
    # a clean stop keeps a durable table's rows and metadata for the next start
    # (test_durable.py); the /dev/shm table is gone with its segments
    assert sorted(os.listdir(store)) == [f"shmreplay.{d.instance}.r.disk", f"shmreplay.{d.instance}.t.disk"]
    assert shm_entries(f"shmreplay.{d.instance}.") == set()


def test_a_directory_the_config_does_not_name_is_refused(start_daemon, tmp_path):
    store, other = tmp_path / "tables", tmp_path / "elsewhere"
    other.mkdir()
    d = start_daemon(storage_dirs=[str(store)])
    with d.connect() as c:
        with pytest.raises(shmreplay.PermissionDenied, match=f"storage_dir {other} is not one the "
                                                             "daemon's config allows"):
            c.create_table("f", capacity=10, fields=FIELDS, storage_dir=str(other))
        with pytest.raises(shmreplay.SchemaError, match="storage_dir must be an absolute path"):
            c.create_table("f", capacity=10, fields=FIELDS, storage_dir="relative/dir")
        assert c.list_tables() == [] and os.listdir(other) == []
    assert shm_entries(f"shmreplay.{d.instance}.") == set()


def test_a_storage_dir_others_can_write_is_refused(start_daemon, tmp_path):
    store = tmp_path / "open"
    store.mkdir()
    os.chmod(store, 0o777)
    d = start_daemon(storage_dirs=[str(store)])
    with d.connect() as c:
        with pytest.raises(shmreplay.ReplayError, match="is not a safe place for tables' rows files: "
                                                        "writable by others"):
            c.create_table("f", capacity=10, fields=FIELDS, storage_dir=str(store))
        assert os.listdir(store) == [] and c.list_tables() == []


def test_a_table_larger_than_the_disk_is_disk_full_at_create(start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    item = max(1 << 20, free // 64)  # few slots: the metadata stays small on any disk
    capacity = int(2 * free // item) + 1
    if capacity * item > 2**47:
        pytest.skip("this disk is larger than the largest table")
    d = start_daemon(storage_dirs=[store])
    with d.connect() as c:
        with pytest.raises(shmreplay.DiskFull, match="GiB free but the rows file"):
            c.create_table("huge", capacity=capacity, fields={"x": ("uint8", (item,))}, storage_dir=store)
        assert os.listdir(store) == [] and c.list_tables() == []
        c.create_table("small", capacity=10, fields=FIELDS, storage_dir=store)  # still serving
    assert shm_entries(f"shmreplay.{d.instance}.t.huge") == set()


def test_a_rows_file_already_there_is_never_opened_or_removed(start_daemon, tmp_path):
    store = tmp_path / "tables"
    store.mkdir(mode=0o700)
    d = start_daemon(storage_dirs=[str(store)])
    planted = rows_file(d, str(store), "f")
    with open(planted, "wb") as f:
        f.write(b"not yours")
    with d.connect() as c:
        with pytest.raises(shmreplay.ReplayError, match=f"rows file {planted} exists already"):
            c.create_table("f", capacity=10, fields=FIELDS, storage_dir=str(store))
    with open(planted, "rb") as f:
        assert f.read() == b"not yours"
    assert shm_entries(f"shmreplay.{d.instance}.") == set()


def test_a_file_backed_table_survives_a_daemon_sigkill(start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    # no periodic sync: one listing the items would make the overflow evict ahead
    d = start_daemon(tables=[table_def("f", 256, store, sampler="fifo")], sync_interval_s=0)
    with d.connect() as c:
        t = c.table("f")
        t.insert_batch(rows(np.arange(300)))
        c.flush()
    d.crash()
    d.start()
    with d.connect() as c:
        t = c.table("f")
        assert len(t) == 256
        got = t.sample(256).data
        assert torn(got) == 0 and got["id"][0] == 44  # fifo order survived: the oldest first
    status = run_cli("--socket", d.socket, "status")
    assert f"rows: 0.00 GiB in file {rows_file(d, store, 'f')}" in status, status
    # a crash leaves both parts; cleanup removes the rows file with its meta segment
    d.crash()
    out = run_cli("cleanup", "--keep-tables", "--instance", d.instance)
    assert os.path.exists(rows_file(d, store, "f")), out
    out = run_cli("cleanup", "--instance", d.instance)
    meta_file = os.path.join(store, f"shmreplay.{d.instance}.t.f")
    assert re.search(rf"removed 3 object\(s\): shmreplay\.{d.instance}\.t\.f\.[0-9a-f]{{16}} "
                     rf"{re.escape(rows_file(d, store, 'f'))} {re.escape(meta_file)}", out), out
    assert os.listdir(store) == [] and shm_entries(f"shmreplay.{d.instance}.") == set()


def run_cli(*args) -> str:
    run = subprocess.run([sys.executable, "-m", "shmreplay.cli", *args], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_a_checkpoint_moves_a_table_from_dev_shm_to_disk(start_daemon, tmp_path):
    """Where rows live is the config's to say: a table checkpointed from
    /dev/shm is restored into a file when the config now gives it a
    storage_dir, every item and priority intact."""
    store, ck = str(tmp_path / "tables"), str(tmp_path / "ck")
    d = start_daemon(tables=[table_def("f", 128)])
    with d.connect() as c:
        t = c.table("f")
        t.insert_batch(rows(np.arange(100)), priorities=np.arange(1, 101, dtype=float))
        c.flush()
        c.checkpoint(ck, "f")
    assert d.stop() == 0
    write_config(d.config, [table_def("f", 128, store)], instance=d.instance, socket=d.socket)
    d.start(["--restore", ck])
    assert os.path.exists(rows_file(d, store, "f"))
    assert table_objects(d.instance) == {"t.f"}
    with d.connect() as c:
        t = c.table("f")
        assert len(t) == 100
        b = t.sample(512)
        assert torn(b.data) == 0
        p = (b.data["id"] + 1.0) ** 0.6
        np.testing.assert_allclose(b.probabilities, p / ((np.arange(1, 101) ** 0.6).sum()), rtol=1e-9)


def test_the_api_writer_and_semantics_tests_pass_on_file_backed_tables():
    """Everything a /dev/shm table does, a file-backed one does: the tests
    that move or choose rows rerun with every table's rows in a file
    (conftest's daemon fixture under SHMREPLAY_TEST_ROWS=file; the client
    fixture checks each table really was file-backed)."""
    here = os.path.dirname(os.path.abspath(__file__))
    # the tests that move rows or choose them: writers, iterators, the API's
    # inserts and gathers, samplers and removers, reuse limits, queues and
    # redraws (limiter, waiting and admin tests never look at a row, and
    # take most of the time; nor does a writer's close under a closed limiter)
    pick = ("(test_writers and not close_never_waits) or test_iterate or (test_api and (round_trip or attaches_by_name or "
            "ring_overwrites or update_priorities_changes or preallocated or larger_than_one_command "
            "or are_cast or large_rows)) or (test_selectors and (sampler_returns or draws_every_item "
            "or remover)) or (test_reuse_limits and max_times_sampled) or test_queues or "
            "(test_redraw and overwritten)")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                          "-k", pick, *(os.path.join(here, m) for m in FILE_MODULES)],
                         cwd=os.path.dirname(here), capture_output=True, text=True, timeout=1200,
                         env=nested_env(SHMREPLAY_TEST_ROWS="file"))
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1] and "skipped" not in run.stdout.splitlines()[-1]


FILE_MODULES = ("test_api.py", "test_writers.py", "test_iterate.py", "test_selectors.py", "test_reuse_limits.py",
                "test_queues.py", "test_redraw.py")


def test_rows_left_without_their_metadata_are_refused_clearly_and_cleaned_on_request(start_daemon, tmp_path):
    """How a reboot looks to a table that keeps no metadata on disk
    (``durable_file_tables = false``; a durable one is adopted, see
    test_durable.py): /dev/shm and the runtime directory are empty, the rows
    file is still on disk.  Nothing can adopt it; the daemon says so and
    names the command, which removes it only when asked."""
    store = str(tmp_path / "tables")
    d = start_daemon(tables=[table_def("f", 64, store)], durable_file_tables=False)
    with d.connect() as c:
        c.table("f").insert_batch(rows(np.arange(10)))
        c.flush()
    d.crash()
    path = rows_file(d, store, "f")
    os.unlink("/dev/shm" + d.segment("f"))
    os.unlink(lock_path(d.instance))
    d.start()  # serves, with the table set aside: nothing is made over the file, nor removed
    with d.connect() as c:
        why = c.stats()["set_aside"]["f"]["reason"]
        assert re.search(f"rows file {path} exists already.*shmreplay cleanup --storage-dir {store}",
                         why), why
        assert c.list_tables() == []
    assert d.stop() == 0
    assert os.path.exists(path)
    out = run_cli("cleanup", "--instance", d.instance)  # without --storage-dir: not looked at
    assert os.path.exists(path), out
    # --instance: a cleanup of every dead instance would also take what a
    # suite running beside this one left on purpose (a crashed daemon's tables)
    out = run_cli("cleanup", "--dry-run", "--storage-dir", store, "--instance", d.instance)
    assert f"would remove 1 object(s): {path}" in out and os.path.exists(path), out
    run_cli("cleanup", "--storage-dir", store, "--instance", d.instance)
    assert not os.path.exists(path)
    d.start()
    with d.connect() as c:
        assert len(c.table("f")) == 0


def test_a_crashed_file_table_is_adopted_where_it_is_while_its_directory_is_allowed(start_daemon, tmp_path):
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    d = start_daemon(tables=[table_def("f", 64, old)])
    with d.connect() as c:
        c.table("f").insert_batch(rows(np.arange(10)))
        c.flush()
    d.crash()
    # the config now puts the table elsewhere: adopted where it is, and said so
    write_config(d.config, [table_def("f", 64, new)], instance=d.instance, socket=d.socket,
                 storage_dirs=[old])
    d.start()
    assert f"table f: its rows are in {old}, the config says {new}; adopted where they are" in d.log()
    with d.connect() as c:
        t = c.table("f")
        assert len(t) == 10 and torn(t.sample(10).data) == 0
        # asked without a place, the table is the same wherever it lives
        assert len(c.create_table("f", capacity=64, fields=FIELDS, exist_ok=True)) == 10
        with pytest.raises(shmreplay.TableExists, match="different schema"):
            c.create_table("f", capacity=64, fields=FIELDS, storage_dir=new, exist_ok=True)
    d.crash()
    # a directory the config no longer allows: refused, and nothing is lost
    write_config(d.config, [table_def("f", 64, new)], instance=d.instance, socket=d.socket)
    why = d.start_set_aside("f")["reason"]
    assert f"keeps its rows in {old}, which the config no longer allows" in why, why
    assert os.path.exists(rows_file(d, old, "f"))
    assert os.path.exists("/dev/shm" + d.segment("f"))
    write_config(d.config, [table_def("f", 64, old)], instance=d.instance, socket=d.socket)
    d.start()
    with d.connect() as c:
        assert len(c.table("f")) == 10


def test_a_storage_dir_through_a_symlink_is_refused(start_daemon, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)
    d = start_daemon(storage_dirs=[str(link)])
    with d.connect() as c:
        with pytest.raises(shmreplay.ReplayError, match=f"storage_dir {link} goes through a symlink; "
                                                        f"configure its real path {real}"):
            c.create_table("f", capacity=10, fields=FIELDS, storage_dir=str(link))
    assert os.listdir(real) == []


MOUNTINFO = """\
27 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 27 0:25 / /dev/shm rw,nosuid,nodev shared:4 - tmpfs tmpfs rw
41 27 8:16 / /var/lib/replay rw,relatime shared:9 - btrfs /dev/sdb rw,space_cache=v2
42 41 8:32 / /var/lib/replay/nvme rw,relatime shared:10 - xfs /dev/nvme0n1 rw
43 27 8:48 / /mnt/my\\040disk rw,relatime shared:11 - zfs tank/replay rw
"""


def test_the_filesystem_under_a_storage_dir_is_its_longest_mount_point():
    """Which filesystem a storage_dir is on decides whether it is refused as
    copy-on-write (storage.prepare_dir): the innermost mount wins, a name
    that only starts like a mount point is not under it, spaces are escaped."""
    from shmreplay.server.disk.storage import COPY_ON_WRITE, fs_type
    assert fs_type("/var/lib/replay/tables", MOUNTINFO) == "btrfs"
    assert fs_type("/var/lib/replay/nvme/tables", MOUNTINFO) == "xfs"
    assert fs_type("/var/lib/replayer", MOUNTINFO) == "ext4"
    assert fs_type("/mnt/my disk/t", MOUNTINFO) == "zfs"
    assert fs_type("/dev/shm", MOUNTINFO) == "tmpfs"
    assert {"btrfs", "zfs"} <= COPY_ON_WRITE and "xfs" not in COPY_ON_WRITE
    assert fs_type(str(os.getcwd())) is not None  # this machine's own table reads
