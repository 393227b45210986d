"""Issue 12: a permitted client (a member of the daemon's group, another
uid) writes whatever it can into every shared object of the instance.  It
may damage rows (they are its to write); it may not change anything the
daemon decides with, cut off another client, or stop the daemon."""

import errno
import mmap
import os
import tempfile
import threading

import numpy as np
import pytest

import shmreplay

from conftest import segment_of
from faults import FIELDS, HANG_S, rows, torn
from people import GROUP, MEMBER, as_user, needs_root, users  # noqa: F401 (a fixture)

pytestmark = needs_root

TABLES = [{"name": "victim", "capacity": 1 << 16, "fields": FIELDS},
          {"name": "still", "capacity": 4096, "fields": FIELDS},
          {"name": "shared", "capacity": 256, "fields": FIELDS}]


@pytest.fixture
def daemon(start_daemon, users):
    """The tables above in /dev/shm, and "ondisk" with its rows in a file
    (a directory the members' group may search: a tmp_path is not)."""
    from pathlib import Path
    sockdir = Path(tempfile.mkdtemp(prefix="shmrsock"))
    os.chmod(sockdir, 0o755)  # other users must reach the socket and the rows file
    store = str(sockdir / "tables")
    tables = TABLES + [{"name": "ondisk", "capacity": 512, "fields": FIELDS, "storage_dir": store}]
    d = start_daemon(tables=tables, socket_dir=sockdir, group=GROUP, allowed_groups=[GROUP],
                     storage_dirs=[store], durable_file_tables=False)
    d.store = store
    yield d
    d.stop()
    os.unlink(sockdir / os.path.basename(d.socket)) if os.path.exists(d.socket) else None
    for n in os.listdir(store) if os.path.isdir(store) else ():
        os.unlink(os.path.join(store, n))  # the rows file of a table the clean stop removed is gone
    if os.path.isdir(store):
        os.rmdir(store)
    os.rmdir(sockdir)


def instance_objects(instance: str, store: str) -> list[str]:
    """Every object of the instance: /dev/shm, and the rows files in ``store``."""
    return sorted([os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")
                   if f"shmreplay.{instance}." in n]
                  + [os.path.join(store, n) for n in os.listdir(store) if f"shmreplay.{instance}." in n])


def try_to_write_meta(path):
    """What a member can do to a table's meta segment."""
    out = {}
    try:
        os.close(os.open(path, os.O_RDWR))
        out["open_rw"] = "allowed"
    except OSError as exc:
        out["open_rw"] = errno.errorcode[exc.errno]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.ftruncate(fd, 0)
        out["truncate"] = "allowed"
    except OSError as exc:
        out["truncate"] = errno.errorcode[exc.errno]
    finally:
        os.close(fd)
    return out


def test_a_member_can_read_but_never_write_the_daemons_metadata(daemon, users):
    meta = "/dev/shm" + daemon.segment("victim")
    got = as_user(users[MEMBER], try_to_write_meta, meta)
    assert got == {"open_rw": "EACCES", "truncate": "EINVAL"}, got


def scribble(sock, instance, store, seed):
    """Attach as a client, then write random bytes over every byte of every
    object of the instance this user can open for writing (rows segments and
    rows files, their headers included)."""
    c = shmreplay.connect(sock, timeout=60)
    c.table("shared").insert_batch(rows(np.arange(8)))
    c.flush()
    rng = np.random.default_rng(seed)
    wrote, refused = [], []
    for path in instance_objects(instance, store):
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            refused.append(path)
            continue
        try:
            size = os.fstat(fd).st_size
            if size:
                mm = mmap.mmap(fd, size)
                mm[:] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                mm.close()
            wrote.append(path)
        finally:
            os.close(fd)
    # the daemon's descriptors (other clients' channels among them) are
    # out of reach: /proc/<pid>/fd of another user's process
    daemon_pid = c.daemon_pid
    try:
        for fd in os.listdir(f"/proc/{daemon_pid}/fd"):
            os.close(os.open(f"/proc/{daemon_pid}/fd/{fd}", os.O_RDWR))
            wrote.append(f"/proc/{daemon_pid}/fd/{fd}")
    except OSError:
        refused.append(f"/proc/{daemon_pid}/fd")
    # its own channel and doorbells: anything it writes there cuts off itself only
    pipe = c._session.pipe
    buf = np.frombuffer(pipe.chan.seg.buf, np.uint8)
    buf[:] = rng.integers(0, 256, buf.shape[0], dtype=np.uint8)
    for fd in (pipe.to_daemon, pipe.to_client):
        try:
            os.eventfd_write(fd, 2**64 - 2)
        except OSError:
            pass
    try:
        c.table("shared").insert_batch(rows(np.arange(8, 16)))
        c.flush()
    except shmreplay.ReplayError:
        pass  # it may have cut itself off; others must not notice
    try:
        c.close()
    except shmreplay.ReplayError:
        pass
    return wrote, refused


def meta_bytes(instance: str, table: str) -> bytes:
    with open("/dev/shm" + segment_of(instance, table), "rb") as f:
        return f.read()


def innocent(sock, stop, out):
    """An actor and learner of another user's table, running through the scribble."""
    try:
        with shmreplay.connect(sock, timeout=60) as c:
            t, i = c.table("victim"), 10_000
            while not stop.is_set():
                if i < 10_000 + 32_000:  # a budget: nothing is ever evicted, however long it runs
                    t.insert_batch(rows(np.arange(i, i + 16)))
                    c.flush()
                    i += 16
                t.sample(16)
            out.append(i - 10_000)
    except BaseException as exc:
        out.append(exc)


BOARD = {"w": np.zeros((16, 8), np.float32), "n": np.zeros((), np.int64)}


def board_params(v) -> dict:
    return {k: np.full(a.shape, v, a.dtype) for k, a in BOARD.items()}


def read_board(sock):
    """A fresh reader of the owner's board: (version, whether every value
    is the learner's for that version)."""
    with shmreplay.connect(sock, timeout=60) as c:
        v, got = shmreplay.ParameterBoard.attach(c, "policy", like=BOARD).latest()
        return v, all((got[k] == v).all() for k in BOARD)


def test_random_scribble_by_a_member_changes_no_metadata_and_loses_no_item(daemon, users):
    """Issue 12, and issue 21 item 9: the scribble covers every rows object
    and rows file from their first byte (the header no longer decides
    anything); after it, and after a SIGKILL and a restart, every table is
    served with every item (rows damaged where they were written, nothing
    else).  Issue 34 item 7: a board's rows are out of the member's reach,
    and every reader gets the learner's versions and values."""
    with daemon.connect() as owner:
        owner.table("still").insert_batch(rows(np.arange(3000)))
        owner.table("victim").insert_batch(rows(np.arange(1000)))
        owner.table("ondisk").insert_batch(rows(np.arange(300)))
        owner.flush()
        board = shmreplay.ParameterBoard.create(owner, "policy", like=BOARD)  # issue 34 item 7
        for v in range(1, 6):
            board.publish(board_params(v))
        before = meta_bytes(daemon.instance, "still")
        stop, out = threading.Event(), []
        th = threading.Thread(target=innocent, args=(daemon.socket, stop, out), daemon=True)
        th.start()
        try:
            wrote, refused = as_user(users[MEMBER], scribble, daemon.socket, daemon.instance,
                                     daemon.store, 7)
        finally:
            stop.set()
            th.join(HANG_S)
        # rows are writable (damage allowed); metadata and the daemon's descriptors never
        assert any(".r.still" in p for p in wrote), (wrote, refused)
        assert any(p.startswith(daemon.store) for p in wrote), (wrote, refused)
        assert not any(".t." in p or "/proc/" in p for p in wrote), wrote
        assert any("/proc/" in p for p in refused)
        assert meta_bytes(daemon.instance, "still") == before
        assert daemon.proc.poll() is None
        # the innocent client was never cut off, and no table lost an item
        assert len(out) == 1 and isinstance(out[0], int), out
        assert len(owner.table("still")) == 3000
        assert len(owner.table("victim")) == 1000 + out[0]
        owner.table("still").insert_batch(rows(np.arange(3000, 3100)))
        owner.flush()
        assert len(owner.table("still")) == 3100
        sizes = {name: len(owner.table(name)) for name in ("victim", "still", "shared", "ondisk")}
        # a board's rows were out of the member's reach: every reader gets the learner's versions
        assert any(".r.policy" in p for p in refused) and not any(".r.policy" in p for p in wrote)
        assert board.publish(board_params(6)) == 6
        assert as_user(users[MEMBER], read_board, daemon.socket) == (6, True)
        assert read_board(daemon.socket) == (6, True)
    daemon.crash()
    daemon.start()  # adopts every table: no byte a member wrote decides whether it can
    with daemon.connect() as owner:
        assert owner.stats()["set_aside"] == {}
        assert {name: len(owner.table(name)) for name in sizes} == sizes
        assert len(owner.table("still").sample(64)) == 64  # rows scribbled, the table served
        assert as_user(users[MEMBER], read_board, daemon.socket) == (6, True)  # adopted whole


def truncate(path):
    fd = os.open(path, os.O_RDWR)
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


def test_a_member_truncating_rows_cannot_bring_the_daemon_down(daemon, users, tmp_path):
    """Rows are the members' to write, so a member can also truncate them:
    that table's rows are lost, but the daemon never maps rows once a table
    is served (checkpoints read them with pread), so it does not fault."""
    with daemon.connect() as owner:
        owner.table("victim").insert_batch(rows(np.arange(100)))
        owner.table("still").insert_batch(rows(np.arange(100)))
        owner.flush()
        as_user(users[MEMBER], truncate, "/dev/shm" + daemon.segment("victim", "r"))
        with pytest.raises(shmreplay.ReplayError, match="shorter than its table"):
            owner.checkpoint(str(tmp_path / "ck"), "victim")
        assert daemon.proc.poll() is None
        rep = owner.checkpoint(str(tmp_path / "ck"), "still")  # the other table is whole
        assert rep[0]["items"] == 100
        owner.table("still").insert_batch(rows(np.arange(100, 110)))
        owner.flush()
        assert len(owner.table("still")) == 110


def zero_header_and_resize(path, grow):
    """What the review did: 8 zero bytes at offset 0, then the size changed:
    4 KiB more (``grow``), or cut to half."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes(8), 0)
        size = os.fstat(fd).st_size
        os.ftruncate(fd, size + 4096 if grow else size // 2)
    finally:
        os.close(fd)


@pytest.mark.parametrize("grow", [True, False])
def test_a_members_rows_header_or_size_locks_nobody_out(daemon, users, grow):
    """Issue 21, item 1: the rows header is client-writable, so nothing
    decides by it; a rows object's size (grown, or cut) is given back by the
    daemon when a client opens the table and when it adopts it.  Neither the
    owner's attach nor a restart after a SIGKILL is refused; every other
    table is served throughout."""
    with daemon.connect() as owner:
        owner.table("still").insert_batch(rows(np.arange(100)))
        owner.table("ondisk").insert_batch(rows(np.arange(100)))
        owner.flush()
    rows_file = os.path.join(daemon.store, f"shmreplay.{daemon.instance}.r.ondisk")
    for path in ("/dev/shm" + daemon.segment("victim", "r"), rows_file):
        as_user(users[MEMBER], zero_header_and_resize, path, grow)
    with daemon.connect() as owner:  # a fresh attach: the daemon gave the sizes back
        owner.create_table("victim", capacity=1 << 16, fields=FIELDS, exist_ok=True)  # that way too
        for name in ("victim", "ondisk", "still"):
            t = owner.table(name)
            t.insert_batch(rows(np.arange(1000, 1010)))
        owner.flush()
        assert (len(owner.table("victim")), len(owner.table("ondisk"))) == (10, 110)
    for path in ("/dev/shm" + daemon.segment("victim", "r"), rows_file):
        as_user(users[MEMBER], zero_header_and_resize, path, grow)
    daemon.crash()
    daemon.start()  # adoption gives the sizes back too
    with daemon.connect() as owner:
        assert owner.stats()["set_aside"] == {}
        assert {n: len(owner.table(n)) for n in ("victim", "ondisk", "still")} == \
            {"victim": 10, "ondisk": 110, "still": 110}
        b = owner.table("still").sample(110)  # untouched: every row whole
        assert set(b.data["id"].tolist()) <= set(range(100)) | set(range(1000, 1010))
        assert not torn(b.data)

