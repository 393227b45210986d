"""Promise 7: only the users the config lets in can connect or map a table,
and only the daemon's user, root or the admin group can run admin
operations.  Real second and third users, made with useradd (root only)."""

import os
import pickle
import shutil
import stat
import subprocess
import tempfile
import traceback

import numpy as np
import pytest

import shmreplay

from faults import FIELDS, rows

GROUP, ADMINS = "shmrtest", "shmrtadm"
MEMBER, ADMIN, STRANGER = "shmrt1", "shmrt2", "shmrt3"

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd to make the second and third users")


def _run(*cmd):
    subprocess.run(cmd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def users():
    import grp
    import pwd
    made = []
    for g in (GROUP, ADMINS):
        try:
            grp.getgrnam(g)
        except KeyError:
            _run("groupadd", g)
            made.append(("groupdel", g))
    for u, groups in ((MEMBER, [GROUP]), (ADMIN, [GROUP, ADMINS]), (STRANGER, [])):
        try:
            pwd.getpwnam(u)
        except KeyError:
            _run("useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                 *(["--groups", ",".join(groups)] if groups else []), u)
            made.insert(0, ("userdel", u))
    yield {u: (pwd.getpwnam(u).pw_uid, pwd.getpwnam(u).pw_gid,
               [grp.getgrnam(g).gr_gid for g in groups])
           for u, groups in ((MEMBER, [GROUP]), (ADMIN, [GROUP, ADMINS]), (STRANGER, []))}
    for cmd in made:
        subprocess.run(cmd, capture_output=True)


def as_user(ident, fn, *args):
    """Run fn(*args) in a forked child that has become another user; return
    its result or raise what it raised."""
    uid, gid, groups = ident
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            os.setgroups(groups)
            os.setgid(gid)
            os.setuid(uid)
            out = ("ok", fn(*args))
        except BaseException as exc:
            out = ("err", exc, traceback.format_exc())
        with os.fdopen(w, "wb") as f:
            pickle.dump(out, f)
        os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        out = pickle.load(f)
    os.waitpid(pid, 0)
    if out[0] == "err":
        raise out[1]
    return out[1]


@pytest.fixture
def daemon(start_daemon, users, tmp_path):
    from pathlib import Path
    sockdir = Path(tempfile.mkdtemp(prefix="shmrsock"))
    os.chmod(sockdir, 0o755)  # pytest's tmp dirs are 0700: other users could not reach a socket there
    d = start_daemon(tables=[{"name": "t", "capacity": 64, "fields": FIELDS}], socket_dir=sockdir,
                     group=GROUP, allowed_groups=[GROUP], admin_group=ADMINS)
    yield d
    d.stop()
    shutil.rmtree(sockdir)


def test_socket_and_every_segment_are_0660_and_group_owned(daemon):
    import grp
    gid = grp.getgrnam(GROUP).gr_gid
    with daemon.connect():
        paths = [daemon.socket] + [os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")
                                   if f"shmreplay.{daemon.instance}." in n]
        assert any(".t.t" in p for p in paths) and any(".bell" in p for p in paths)
        assert any(p.endswith(".lock") for p in paths)
        for p in paths:
            st = os.stat(p)
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid, (p, oct(st.st_mode), st.st_gid)


def use_table(sock):
    c = shmreplay.connect(sock, timeout=60)
    t = c.table("t")
    t.insert_batch(rows(np.arange(5)))
    c.flush()
    got = sorted(t.sample(16).data["id"].tolist())
    denied = []
    for op in (lambda: c.drop_table("t"), lambda: c.checkpoint("/tmp/x"), c.shutdown):
        try:
            op()
        except shmreplay.PermissionDenied as exc:
            denied.append(str(exc))
    c.close()
    return got, denied


def test_a_group_member_uses_tables_but_may_not_administer(daemon, users):
    got, denied = as_user(users[MEMBER], use_table, daemon.socket)
    assert set(got) <= set(range(5)) and len(got) == 16
    assert len(denied) == 3 and all("admin operation" in m for m in denied), denied
    with daemon.connect() as c:  # still there, still served
        assert len(c.table("t")) == 5


def administer(sock, directory):
    c = shmreplay.connect(sock, timeout=60)
    c.table("t").insert_batch(rows(np.arange(3)))
    c.flush()
    rep = c.checkpoint(directory, "t")
    c.close()
    return rep[0]["items"]


def test_the_admin_group_may_administer(daemon, users, tmp_path):
    assert as_user(users[ADMIN], administer, daemon.socket, str(tmp_path / "ck")) == 3


def connect_only(sock):
    shmreplay.connect(sock, timeout=60).close()


def map_segment(name):
    return open(f"/dev/shm/{name}", "rb").read(16)


def test_a_stranger_is_refused_and_cannot_map_segments(daemon, users):
    # the socket's mode keeps it out first
    with pytest.raises(shmreplay.PermissionDenied,
                       match=f"user {users[STRANGER][0]} may not open the socket {daemon.socket}"):
        as_user(users[STRANGER], connect_only, daemon.socket)
    with pytest.raises(PermissionError):
        as_user(users[STRANGER], map_segment, f"shmreplay.{daemon.instance}.t.t")
    # with the socket open to all, SO_PEERCRED still says who it is
    os.chmod(daemon.socket, 0o666)
    with pytest.raises(shmreplay.PermissionDenied, match=f"user {users[STRANGER][0]} may not use"):
        as_user(users[STRANGER], connect_only, daemon.socket)
    assert "refused" in daemon.log()
    with daemon.connect() as c:
        assert c.list_tables() == ["t"]
