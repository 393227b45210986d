"""Issue 12, items 4 and 5: another local user may create any name in
/dev/shm or /tmp before the daemon or its clients do.  Nothing planted is
trusted: the daemon adopts only objects its own user made with its modes,
keeps its lock and socket where only its user can write, and a client
talks only to a daemon run by itself, root, or $SHMREPLAY_DAEMON_USER."""

import hashlib
import os
import socket
import stat
import tempfile

import pytest

import shmreplay
from shmreplay.schema import make_spec
from shmreplay.wire.layout import TableMap

from faults import FIELDS, rows
from people import STRANGER, as_user, needs_root, users  # noqa: F401 (a fixture)

pytestmark = needs_root

DEMO = {"name": "demo", "capacity": 64, "fields": FIELDS}


def plant_table(instance, table, token=""):
    """A stranger's own table segments under the daemon's names (as earlier
    builds made them, or with a token), open to all."""
    tm = TableMap.create(f"/shmreplay.{instance}.t.{table}{token}", make_spec(table, 64, FIELDS))
    tm.fields["id"][:] = 666
    for seg in (tm.meta, tm.rows):
        os.fchmod(seg.fd, 0o666)
    tm.release()


def planted(instance):
    return sorted(n for n in os.listdir("/dev/shm") if f"shmreplay.{instance}." in n)


def contents(name):
    """Owner, mode and a digest of the bytes of a /dev/shm object: all a stranger made."""
    path = os.path.join("/dev/shm", name)
    st = os.stat(path)
    with open(path, "rb") as f:
        return st.st_uid, oct(stat.S_IMODE(st.st_mode)), hashlib.sha256(f.read()).hexdigest()


def test_a_planted_table_is_never_adopted_and_blocks_nothing(start_daemon, users, tmp_path):
    """Issue 21, item 6: names are not guessable (a token the daemon draws
    for each table), and a planted object named like a table is not the
    daemon's: never opened beyond an lstat, never removed, and it stops
    nothing: not the daemon's start, not the config's table of that name,
    not a client's create of any name."""
    d = start_daemon(tables=[DEMO])
    d.kill()  # the instance is free; its prefix is known to everyone
    as_user(users[STRANGER], plant_table, d.instance, "demo")
    as_user(users[STRANGER], plant_table, d.instance, "demo", ".0123456789abcdef")
    as_user(users[STRANGER], plant_table, d.instance, "other")
    as_user(users[STRANGER], plant_table, d.instance, "later", ".fedcba9876543210")
    theirs = {n: contents(n) for n in planted(d.instance)}
    assert len(theirs) == 8
    try:
        d.start()  # starts, and makes the config's table beside the planted names
        with d.connect() as c:
            assert c.list_tables() == ["demo"] and len(c.table("demo")) == 0
            c.table("demo").insert_batch(rows([1, 2]))
            later = c.create_table("later", capacity=64, fields=FIELDS)  # a name planted ahead
            later.insert_batch(rows([3]))
            c.flush()
            assert len(later) == 1 and len(c.table("demo")) == 2
        log = d.log()
        for name in theirs:
            if ".t." in name:
                assert f"/dev/shm/{name} is named like a table of this instance but is not the " \
                       f"daemon's own file (uid {users[STRANGER][0]}); ignored" in log, name
        assert d.stop() == 0  # nor removed when the daemon removes its own tables
        assert {n: contents(n) for n in planted(d.instance)} == theirs
    finally:
        for n in planted(d.instance):
            if n in theirs:
                os.unlink(os.path.join("/dev/shm", n))


def test_a_planted_lock_symlink_is_not_followed(start_daemon, users, tmp_path):
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    os.chmod(target, 0o644)
    d = start_daemon(tables=[DEMO])
    d.kill()
    # where older builds kept the lock: a world-writable directory
    as_user(users[STRANGER], os.symlink, str(target), f"/dev/shm/shmreplay.{d.instance}.lock")
    try:
        d.start()
        with d.connect() as c:
            assert len(c.table("demo")) == 0
    finally:
        os.unlink(f"/dev/shm/shmreplay.{d.instance}.lock")
    assert target.read_bytes() == b"keep me" and stat.S_IMODE(os.stat(target).st_mode) == 0o644


def test_the_lock_and_socket_never_live_in_a_directory_others_can_write(start_daemon, tmp_path):
    open_dir = tempfile.mkdtemp(prefix="shmrshared")
    os.chmod(open_dir, 0o1777)
    try:
        with pytest.raises(RuntimeError, match="writable by others"):
            start_daemon(tables=[DEMO], socket_dir=__import__("pathlib").Path(open_dir))
    finally:
        os.rmdir(open_dir)
    from shmreplay.wire.names import default_socket_path, runtime_dir
    assert os.path.dirname(default_socket_path()) == runtime_dir()


def squat(path, ready_w, result_w):
    """A stranger's fake daemon: accept one client, count what it sends."""
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    os.chmod(path, 0o777)
    srv.listen(1)
    os.write(ready_w, b"x")
    conn, _ = srv.accept()
    conn.settimeout(30)
    got = 0
    try:
        while True:
            data = conn.recv(65536)
            if not data:
                break
            got += len(data)
    except OSError:
        pass
    os.write(result_w, str(got).encode())
    return got


def test_a_client_never_talks_to_a_daemon_another_user_runs(users):
    open_dir = tempfile.mkdtemp(prefix="shmrsquat")
    os.chmod(open_dir, 0o1777)
    path = os.path.join(open_dir, "shmreplay.sock")
    ready_r, ready_w = os.pipe()
    result_r, result_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            uid, gid, groups = users[STRANGER]
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            squat(path, ready_w, result_w)
        finally:
            os._exit(0)
    try:
        assert os.read(ready_r, 1) == b"x"
        with pytest.raises(shmreplay.PermissionDenied, match=f"runs as uid {users[STRANGER][0]}"):
            shmreplay.connect(path, timeout=30)
        assert os.read(result_r, 64) == b"0"  # not one byte reached the stranger
    finally:
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, result_r, result_w):
            os.close(fd)
        os.unlink(path)
        os.rmdir(open_dir)
