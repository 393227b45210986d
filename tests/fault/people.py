"""Real second and third users for the access tests (root only: useradd),
and running a function as one of them in a forked child."""

import os
import pickle
import shutil
import subprocess
import tempfile
import traceback
from pathlib import Path

import pytest

GROUP, ADMINS = "shmrtest", "shmrtadm"
MEMBER, ADMIN, STRANGER = "shmrt1", "shmrt2", "shmrt3"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd to make the second and third users")


def run(*cmd):
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
            run("groupadd", g)
            made.append(("groupdel", g))
    for u, groups in ((MEMBER, [GROUP]), (ADMIN, [GROUP, ADMINS]), (STRANGER, [])):
        try:
            pwd.getpwnam(u)
        except KeyError:
            run("useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
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
def shared_start(start_daemon, users):
    """start(**options): a daemon of the group GROUP whose socket (and any
    storage under ``start.dir``) other users can reach: pytest's tmp dirs are
    0700.  Stopped, then its directory removed, at teardown (a clean stop
    syncs durable tables into it: before it goes)."""
    top = Path(tempfile.mkdtemp(prefix="shmrshared"))
    os.chmod(top, 0o755)
    started = []

    def start(**options):
        started.append(start_daemon(socket_dir=top, group=GROUP, **options))
        return started[-1]
    start.dir = top
    yield start
    for d in started:
        d.stop()
    shutil.rmtree(top)

