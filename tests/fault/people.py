"""Real second and third users for the access tests (root only: useradd),
and running a function as one of them in a forked child.

The names carry this process's pid, so two runs of the suite on one box
(or two pytest-xdist workers) never make, use or delete each other's
users; each module that needs them makes them and deletes them again, and
checks at its end that none is left (``leftover_people``).
"""

import os
import pickle
import shutil
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

from shmreplay.client import rowcopy
from shmreplay.priorities import first_invalid_priority, priorities_fit

PREFIX = f"shmr{os.getpid()}"  # at most 12 characters: useradd takes 32
GROUP, ADMINS = f"{PREFIX}g", f"{PREFIX}a"
MEMBER, ADMIN, STRANGER = f"{PREFIX}m", f"{PREFIX}d", f"{PREFIX}s"

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("useradd") is None,
    reason="needs root and useradd to make the second and third users")


LOCK_WAIT_S = 60.0  # a hang guard: another run's useradd holds /etc/passwd for milliseconds


def run(*cmd):
    """Run a user or group tool; when another run's tool holds the lock on
    /etc/passwd or /etc/group (they fail at once, saying so), try again,
    up to LOCK_WAIT_S."""
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode == 0:
            return
        if "lock" not in p.stderr.lower() or time.monotonic() > deadline:
            raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr.strip()}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def users():
    import grp
    import pwd
    # a name of ours left by a killed run of an earlier process with this
    # pid would carry other groups: remove it, then make every one afresh
    remove_people()
    try:
        for g in (GROUP, ADMINS):
            run("groupadd", g)
        for u, groups in ((MEMBER, [GROUP]), (ADMIN, [GROUP, ADMINS]), (STRANGER, [])):
            run("useradd", "--no-create-home", "--shell", "/usr/sbin/nologin",
                *(["--groups", ",".join(groups)] if groups else []), u)
    except BaseException:  # a setup error runs no teardown: remove what was made
        remove_people()
        raise
    yield {u: (pwd.getpwnam(u).pw_uid, pwd.getpwnam(u).pw_gid,
               [grp.getgrnam(g).gr_gid for g in groups])
           for u, groups in ((MEMBER, [GROUP]), (ADMIN, [GROUP, ADMINS]), (STRANGER, []))}
    remove_people()
    left = leftover_people()
    assert not left, f"users or groups the test made are still there: {left}"


def leftover_people() -> list[str]:
    """This process's users and groups still in /etc/passwd or /etc/group."""
    left = []
    for path in ("/etc/passwd", "/etc/group"):
        try:
            with open(path) as f:
                left += [f"{path}: {line.split(':')[0]}" for line in f
                         if line.split(":")[0] in (GROUP, ADMINS, MEMBER, ADMIN, STRANGER)]
        except OSError:
            pass
    return left


def remove_people() -> None:
    """Delete whichever of this process's users and groups exist."""
    import grp
    import pwd
    for u in (MEMBER, ADMIN, STRANGER):
        try:
            pwd.getpwnam(u)
        except KeyError:
            continue
        run("userdel", u)
    for g in (GROUP, ADMINS):
        try:
            grp.getgrnam(g)
        except KeyError:
            continue
        run("groupdel", g)


def as_user(ident, fn, *args):
    """Run fn(*args) in a forked child that has become another user; return
    its result or raise what it raised."""
    uid, gid, groups = ident
    # the child may not read root's Python (under /root here) nor write
    # numba's cache, so it cannot compile what the parent has not: load the
    # client's gather kernels and its priority checks first (compiled once
    # per machine)
    rowcopy.warm()
    priorities_fit(np.ones(1), 1.0)
    first_invalid_priority(np.ones(1))
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

