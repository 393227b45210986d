"""Issue 21, item 3: every directory the daemon creates, writes or removes
in is checked (server/disk/safedir.py), removal never follows a link, and
a checkpoint is never wider open than its table.

A real stranger (``people.py``) squats the checkpoint directory under a
sticky world-writable parent and plants links in it; links are planted in
the daemon's own directory too (as only its user could); a member and the
stranger try to read a checkpoint.  Each state is arranged before the
daemon acts on it, and each wait is on the daemon's log or files, never
on the clock."""

import hashlib
import os
import shutil
import stat
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest

import shmreplay
from shmreplay.errors import LayoutError
from shmreplay.server.disk import ckread

from faults import FIELDS, HANG_S, rows, wait_for
from people import GROUP, MEMBER, STRANGER, as_user, needs_root, users  # noqa: F401 (a fixture)

pytestmark = needs_root

HERE = os.path.dirname(os.path.abspath(__file__))
TABLE = {"name": "t", "capacity": 64, "fields": FIELDS}
LONG_AGO, FAR_AHEAD = "t@19700101T000000.000000000Z", "t@29991231T000000.000000000Z"
STALE_TMP = ".t@x.tmp999999999"  # named like a dead daemon's temporary checkpoint


def tree(*roots) -> dict:
    """Every entry under ``roots`` as it is, links not followed: a link's
    target, a file's owner, mode and digest, a directory's owner and mode."""
    out = {}
    for root in roots:
        inside = [] if os.path.islink(root) else [os.path.join(d, n) for d, ds, fs in os.walk(root)
                                                   for n in ds + fs]
        for path in [root, *inside]:
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[path] = ("link", os.readlink(path))
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    out[path] = ("file", st.st_uid, st.st_mode, hashlib.sha256(f.read()).hexdigest())
            else:
                out[path] = ("dir", st.st_uid, st.st_mode)
    return out


def victim(path: Path) -> str:
    """A directory that looks like a complete checkpoint to whoever follows a link to it."""
    path.mkdir()
    (path / "DONE").write_text("0\n")
    (path / "keep").write_bytes(b"keep me")
    return str(path)


def open_parent() -> str:
    """A world-writable sticky directory, as /tmp is, that every user can reach."""
    d = tempfile.mkdtemp(prefix="shmrpaths")
    os.chmod(d, 0o1777)
    return d


def squat(ck: str, links: dict, as_link: str | None) -> None:
    """The stranger's move: take the checkpoint directory's name first."""
    if as_link:
        os.symlink(as_link, ck)
        return
    os.mkdir(ck, 0o755)  # only theirs to write: a careful squatter
    os.chmod(ck, 0o755)
    for name, target in links.items():
        os.symlink(target, os.path.join(ck, name))


@pytest.mark.parametrize("how", ["directory", "symlink"])
def test_a_squatted_checkpoint_directory_is_refused_and_nothing_is_deleted(start_daemon, users,
                                                                        tmp_path, how):
    store = tmp_path / "tables"
    parent = open_parent()
    ck = os.path.join(parent, "ck")
    d = None
    try:
        # first, as the hostile-user review found it: the configured name was free
        links = {STALE_TMP: str(store), LONG_AGO: victim(tmp_path / "old"),
                 FAR_AHEAD: victim(tmp_path / "new")}
        as_user(users[STRANGER], squat, ck, links, victim(tmp_path / "into") if how == "symlink" else None)
        d = start_daemon(tables=[{**TABLE, "storage_dir": str(store)}], sync_interval_s=0,
                         checkpoint_dir=ck, checkpoint_interval_s=0.05, checkpoint_keep=1,
                         args=("--restore", str(tmp_path / "none")))  # not ck: its start reads nothing there
        with d.connect() as c:
            c.table("t").insert_batch(rows(np.arange(20)))
            c.flush()
        roots = [str(store), str(tmp_path / "old"), str(tmp_path / "new"), str(tmp_path / "into"), ck]
        before = tree(*(r for r in roots if os.path.lexists(r)))
        mark = d.log().count("periodic checkpoint failed")
        wait_for(lambda: d.log().count("periodic checkpoint failed") >= mark + 2,
                 "two periodic checkpoints to fail after the squat", poll=0.05)
        uid = users[STRANGER][0]
        what = "a symlink, owned" if how == "symlink" else "owned"
        with d.connect() as c:
            with pytest.raises(shmreplay.ReplayError, match=f"{ck} is not a safe place for checkpoints: "
                                                            f"{what} by uid {uid}; .*StateDirectory="):
                c.checkpoint(ck, "t")
            # nothing deleted, written or made, here or at any target
            assert tree(*(r for r in roots if os.path.lexists(r))) == before
            assert f"{ck} is not a safe place for checkpoints" in d.log()
            t = c.table("t")  # and the daemon serves on
            t.insert_batch(rows(np.arange(20, 30)))
            c.flush()
            assert len(t) == 30 and len(t.sample(8)) == 8
    finally:
        if d is not None:  # first: its periodic checkpoint makes ck anew once the squat is gone
            d.stop()
        shutil.rmtree(parent)  # does not follow the links


def test_prune_never_follows_a_link_planted_in_the_daemons_own_directory(start_daemon, users, tmp_path):
    store, ck = tmp_path / "tables", tmp_path / "ck"
    d = start_daemon(tables=[{**TABLE, "storage_dir": str(store)}], sync_interval_s=0,
                     checkpoint_dir=str(ck), checkpoint_interval_s=0.05, checkpoint_keep=1)
    with d.connect() as c:
        c.table("t").insert_batch(rows(np.arange(20)))
        c.flush()
    wait_for(lambda: "checkpoint of table t: 20 items" in d.log(), "a first periodic checkpoint")
    rows_file = store / f"shmreplay.{d.instance}.r.t"
    # what only the daemon's user could put in its own directory: links named
    # like checkpoints, a stale temporary holding a link, and another user's
    # directory named like a checkpoint
    os.symlink(store, ck / STALE_TMP)
    os.symlink(victim(tmp_path / "old"), ck / LONG_AGO)
    os.symlink(victim(tmp_path / "new"), ck / FAR_AHEAD)
    (ck / ".t@y.tmp999999998").mkdir()
    os.symlink(rows_file, ck / ".t@y.tmp999999998" / "f.obs.bin")
    theirs = victim(ck / "t@19700102T000000.000000000Z")
    for p in (theirs, *(os.path.join(theirs, n) for n in os.listdir(theirs))):
        os.chown(p, users[STRANGER][0], users[STRANGER][1])
    roots = [str(store), str(tmp_path / "old"), str(tmp_path / "new"), theirs, str(ck / STALE_TMP),
             str(ck / LONG_AGO), str(ck / FAR_AHEAD), str(ck / ".t@y.tmp999999998")]
    planted = tree(*roots)
    n = d.log().count("checkpoint of table t:")
    # the second one to end began after the links were there, and pruned
    wait_for(lambda: d.log().count("checkpoint of table t:") >= n + 2,
             "two periodic checkpoints after the plant", poll=0.05)
    assert tree(*roots) == planted  # every link, its target and the other user's directory
    assert d.stop() == 0  # (its last sync rewrites the metadata file) a checkpoint being written ends first
    ours = ckread.complete(str(ck))["t"]
    assert len(ours) == 1 and os.path.basename(ours[0]) not in (LONG_AGO, FAR_AHEAD), ours
    for name in (LONG_AGO, FAR_AHEAD):  # nor is one restored: load refuses a link
        with pytest.raises(LayoutError, match="is not a directory the daemon made"):
            ckread.load(str(ck / name))
    log = d.log()
    assert f"left {ck}/{STALE_TMP} alone: a symlink" in log
    assert f"left {ck}/.t@y.tmp999999998/f.obs.bin alone: a symlink" in log
    assert f"{ck}/t@19700102T000000.000000000Z is not a checkpoint the daemon wrote" in log



def test_a_failed_writes_cleanup_never_follows_a_link(start_daemon, tmp_path):
    """A checkpoint's write is held before its first file is made
    (``pausing_daemon.py``); meanwhile links named like its row files are
    put in its temporary directory, pointing at the table's rows file.  The
    write must fail on them (never open a file through a link), and its
    cleanup must leave them and their target alone."""
    store, ck, pause = tmp_path / "tables", tmp_path / "ck", tmp_path / "pause"
    pause.mkdir()
    d = start_daemon(tables=[{**TABLE, "storage_dir": str(store)}], sync_interval_s=0,
                     command=[sys.executable, os.path.join(HERE, "pausing_daemon.py")],
                     env={"SHMREPLAY_TEST_PAUSE_DIR": str(pause)})
    rows_file = str(store / f"shmreplay.{d.instance}.r.t")
    outcome = []

    def take_checkpoint(admin):
        try:
            outcome.append(admin.checkpoint(str(ck), "t"))
        except BaseException as exc:
            outcome.append(exc)

    with d.connect(timeout=HANG_S) as c, d.connect(timeout=HANG_S) as admin:
        c.table("t").insert_batch(rows(np.arange(20)))
        c.flush()
        before = tree(str(store))
        th = threading.Thread(target=take_checkpoint, args=(admin,), daemon=True)
        th.start()
        try:
            wait_for(lambda: (pause / "copying").exists(), "the checkpoint to start copying rows")
            (tmp,) = [n for n in os.listdir(ck) if n.startswith(".t@")]
            for field in FIELDS:
                os.symlink(rows_file, ck / tmp / f"f.{field}.bin")
        finally:
            (pause / "go").touch()
            th.join(HANG_S)
        assert len(outcome) == 1 and isinstance(outcome[0], shmreplay.ReplayError), outcome
        assert "File exists" in str(outcome[0])
        assert tree(str(store)) == before  # the rows file was neither written nor removed
        assert sorted(os.listdir(ck / tmp)) == sorted(f"f.{f}.bin" for f in FIELDS)
        assert all(os.readlink(ck / tmp / f"f.{f}.bin") == rows_file for f in FIELDS)
        assert f"left {ck}/{tmp}/f.obs.bin alone: a symlink" in d.log()
        (rep,) = admin.checkpoint(str(ck), "t")  # the next one is written, the table serves on
        assert rep["items"] == 20 and len(c.table("t").sample(4)) == 4
    shutil.rmtree(ck / tmp)


def read_all(paths):
    """As another user: each file's bytes, or the error opening it raised."""
    out = {}
    for p in paths:
        try:
            with open(p, "rb") as f:
                out[p] = hashlib.sha256(f.read()).hexdigest()
        except OSError as exc:
            out[p] = type(exc).__name__
    return out


def test_a_checkpoint_has_its_tables_mode_whatever_the_umask(start_daemon, users, tmp_path):
    """Under umask 0 (where the old code made 0777 directories and 0666
    files): the daemon's group may read a checkpoint, as it may map the
    table's meta segment; a stranger cannot; no one else may write it."""
    import grp
    parent = tempfile.mkdtemp(prefix="shmrckpt")
    os.chmod(parent, 0o755)  # other users can reach what the daemon makes here
    ck = os.path.join(parent, "ck")
    try:
        d = start_daemon(tables=[TABLE], group=GROUP,
                         command=["sh", "-c", 'umask 000 && exec "$@"', "sh", sys.executable, "-m",
                                  "shmreplay.server.daemon"])
        with d.connect() as c:
            c.table("t").insert_batch(rows(np.arange(20)))
            c.flush()
            (rep,) = c.checkpoint(ck, "t")
        gid = grp.getgrnam(GROUP).gr_gid
        files = sorted(os.path.join(rep["path"], n) for n in os.listdir(rep["path"]))
        assert "DONE" in {os.path.basename(f) for f in files} and len(files) == 10
        for p in (ck, rep["path"]):
            st = os.stat(p)
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o750, gid), p
        for p in files:
            st = os.stat(p)
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o640, gid), p
        mine = read_all(files)
        assert as_user(users[MEMBER], read_all, files) == mine
        assert set(as_user(users[STRANGER], read_all, files).values()) == {"PermissionError"}
        with pytest.raises(PermissionError):
            as_user(users[STRANGER], os.listdir, ck)
    finally:
        shutil.rmtree(parent)


@pytest.mark.parametrize("how", ["symlink", "stranger"])
def test_a_runtime_directory_through_a_link_or_in_a_strangers_directory_is_refused(
        start_daemon, users, tmp_path, how):
    """The lock's directory meets storage's bar: no component a link, every
    one root's or the daemon user's (the old check looked at the last one)."""
    if how == "symlink":
        real = tmp_path / "real"
        real.mkdir()
        (tmp_path / "link").symlink_to(real)
        rundir, match, theirs = tmp_path / "link" / "run", f"goes through a symlink; configure its real path {real}/run", None
    else:
        theirs = as_user(users[STRANGER], tempfile.mkdtemp, None, "shmrtheirs")
        real = Path(theirs) / "run"
        real.mkdir(mode=0o700)  # the daemon's user's own, but the stranger may rename it away
        rundir, match = real, f"{theirs} is not a safe place for a lock or socket: owned by uid {users[STRANGER][0]}"
    try:
        with pytest.raises(RuntimeError, match=match):
            start_daemon(tables=[TABLE], env={"RUNTIME_DIRECTORY": str(rundir)})
        assert os.listdir(real) == []  # no lock made there
    finally:
        if theirs:
            shutil.rmtree(theirs)


def test_a_storage_dir_in_a_strangers_directory_or_through_a_link_is_refused(start_daemon, users,
                                                                               tmp_path):
    theirs = as_user(users[STRANGER], tempfile.mkdtemp, None, "shmrtheirs")
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    under_theirs, through_link = os.path.join(theirs, "tables"), str(tmp_path / "link" / "tables")
    try:
        d = start_daemon(storage_dirs=[under_theirs, through_link])
        with d.connect() as c:
            with pytest.raises(shmreplay.ReplayError, match=f"{theirs} is not a safe place for tables' "
                                                            f"rows files: owned by uid {users[STRANGER][0]}"):
                c.create_table("f", capacity=10, fields=FIELDS, storage_dir=under_theirs)
            with pytest.raises(shmreplay.ReplayError, match=f"storage_dir {through_link} goes through a "
                                                            f"symlink; configure its real path {real}/tables"):
                c.create_table("f", capacity=10, fields=FIELDS, storage_dir=through_link)
            assert os.listdir(theirs) == [] and os.listdir(real) == [] and c.list_tables() == []
            c.create_table("f", capacity=10, fields=FIELDS, storage_dir="")  # serving on
    finally:
        shutil.rmtree(theirs)
