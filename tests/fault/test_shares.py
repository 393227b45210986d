"""Issue 34, items 4 and 6: what a user shares with others by default.

A ``shmreplay.Server`` is its user's alone; a member's file-backed tables
take at most their share of the storage filesystem; a durable table's sync
needs no new disk blocks; a stranger cannot take a user's runtime directory
first; ``status`` shows a member other users' clients only as counts.
Real users (``people.py``), real daemons, real files.
"""

import json
import mmap
import os
import shutil

import numpy as np
import pytest

import shmreplay
import shmreplay.statusview  # noqa: F401 (as_user's child, another user, may not read a checkout in a closed folder)
from daemons import segment_of
from people import ADMIN, ADMINS, GROUP, MEMBER, STRANGER, as_user, needs_root, shared_start, users  # noqa: F401
from test_durable import HEADROOM, assert_same, prio, reboot, rows, state, table_def
from test_sync_backoff import small_disk, tmpfs  # noqa: F401 (a fixture)
from test_user_limits import create
from userprocs import compile_kernels, finish, make_home, read, remove_home, spawn

pytestmark = needs_root

_n = iter(range(10**6))


@pytest.fixture(scope="module")
def warm():
    compile_kernels()


@pytest.fixture
def home_of(users, warm):
    """home_of(ident): a fresh home for that user (``userprocs.make_home``),
    removed at teardown."""
    made = []

    def make(ident):
        made.append(make_home(ident))
        return made[-1]
    yield make
    for h in made:
        remove_home(h)
    for uid in {users[u][0] for u in users}:  # where a runtime directory went before issue 34
        old = f"/tmp/shmreplay-{uid}"
        if os.path.isdir(old) and os.lstat(old).st_uid == uid:
            shutil.rmtree(old)


SERVE = """
import json, sys
import numpy as np
import shmreplay
instance, group = sys.argv[1], json.loads(sys.argv[2])
with shmreplay.Server(tables=[dict(name="t", capacity=64, fields={"x": ("float32", (100,))})],
                      instance=instance, group=group) as s, s.connect() as c:
    c.table("t").insert_batch({"x": np.ones((64, 100), np.float32)})
    c.flush()
    print(json.dumps({"socket": s.socket}), flush=True)
    sys.stdin.read()
"""


def probe(socket_path: str, rows: str, owner: int) -> dict:
    """What this user can do to a Server's tables: open its rows segment,
    write a float into it, connect (trusting a daemon of ``owner``, as
    docs/guide.md, "A daemon of the program's own", tells a group's members to)."""
    os.environ["SHMREPLAY_DAEMON_USER"] = str(owner)  # a forked child's own environment
    out = {}
    try:
        fd = os.open(rows, os.O_RDWR)
        with mmap.mmap(fd, 4096) as m:
            m[4096 - 4:] = np.float32(-1).tobytes()
        os.close(fd)
        out["rows"] = "written"
    except OSError as exc:
        out["rows"] = type(exc).__name__
    try:
        with shmreplay.connect(socket_path, timeout=10) as c:
            out["connect"] = c.list_tables()
    except shmreplay.ReplayError as exc:
        out["connect"] = type(exc).__name__
    return out


def test_a_servers_tables_are_its_users_alone_unless_it_names_a_group(users, home_of):
    """Item 4: the program's user runs a Server under a primary group it
    shares with another user; that user can neither write the rows nor
    connect.  With ``group=`` it can do both."""
    import grp
    gid = grp.getgrnam(GROUP).gr_gid
    owner = (users[MEMBER][0], gid, [gid])        # the member's uid, GROUP as its primary group
    home = home_of(owner)
    for group, expect in ((None, {"rows": "PermissionError", "connect": "PermissionDenied"}),
                          (GROUP, {"rows": "written", "connect": ["t"]})):
        instance = f"test{os.getpid()}srv{next(_n)}"
        proc = spawn(owner, home, SERVE, instance, json.dumps(group))
        try:
            sock = read(proc)["socket"]
            rows = "/dev/shm" + segment_of(instance, "t", "r")
            got = as_user(users[ADMIN], probe, sock, rows, owner[0])  # ADMIN is in GROUP too
            modes = oct(os.stat(rows).st_mode & 0o777), oct(os.stat(sock).st_mode & 0o777)
        finally:
            err = finish(proc)
        assert got == expect, (group, got, modes, err)
        assert modes == (("0o600", "0o600") if group is None else ("0o660", "0o660")), modes


def server_in(group) -> str:
    try:
        shmreplay.Server(instance=f"test{os.getpid()}never", group=group)
    except shmreplay.ReplayError as exc:
        return str(exc)
    return "started"


def test_a_server_refuses_a_group_its_user_is_not_in(users):
    """``group=`` of a group the program is not in: a clear error before
    anything starts (the daemon could not give its objects to it)."""
    assert shmreplay.Server  # imported here: a child of another user cannot read this interpreter's files
    why = as_user(users[STRANGER], server_in, GROUP)
    assert f"Server(group={GROUP!r}): this process is not in that group" in why, why
    assert "no such group" in as_user(users[STRANGER], server_in, "shmr-no-such-group")


DEFAULTS = """
import json, subprocess, sys, time
import shmreplay
from shmreplay.wire.names import default_socket_path
instance = sys.argv[1]
daemon = subprocess.Popen([sys.executable, "-m", "shmreplay.server.daemon", "--instance", instance],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
try:
    deadline = time.monotonic() + 120  # a hang guard
    while True:
        try:
            c = shmreplay.connect(timeout=10)  # no path, no $SHMREPLAY_SOCKET: the default
            break
        except shmreplay.DaemonUnavailable:
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("the daemon did not serve: " + daemon.stderr.read()[-2000:])
            time.sleep(0.05)
    with c:
        c.create_table("t", capacity=8, fields={"x": ("float32", ())})
        out = {"socket": default_socket_path(), "tables": c.list_tables()}
    with shmreplay.Server(instance=instance + "s") as s, s.connect() as c:
        out["server"] = [s.runtime_dir, c.list_tables()]
    print(json.dumps(out), flush=True)
finally:
    daemon.terminate()
    daemon.wait(60)
"""


def plant(uid: int) -> list[str]:
    """A stranger takes every /tmp name a user's runtime directory had."""
    made = []
    for name in (f"/tmp/shmreplay-{uid}", f"/tmp/shmreplay-{uid}.d"):
        os.mkdir(name)
        os.chmod(name, 0o777)
        os.symlink("/etc/passwd", os.path.join(name, "shmreplay.sock"))
        made.append(name)
    return made


def test_a_stranger_cannot_take_a_users_default_runtime_directory_first(users, home_of):
    """Item 6: with no XDG_RUNTIME_DIR and no configuration, a user's daemon
    and Server start although a stranger made /tmp/shmreplay-<uid> first,
    and a client with no socket configured finds the daemon."""
    owner = users[MEMBER]
    home = home_of(owner)
    planted = as_user(users[STRANGER], plant, owner[0])
    instance = f"test{os.getpid()}d{next(_n)}"
    try:
        proc = spawn(owner, home, DEFAULTS, instance)
        try:
            got = read(proc)
        finally:
            err = finish(proc)
    finally:
        for p in planted:
            shutil.rmtree(p)
    run = f"{home}/.cache/shmreplay/run"
    assert got == {"socket": f"{run}/shmreplay.sock", "tables": ["t"], "server": [run, []]}, (got, err)
    assert sorted(os.listdir(run)) == [], os.listdir(run)  # socket and locks gone with their daemons


def fill_fd(fd: int) -> None:
    """Take every free block of the filesystem through ``fd``."""
    block = b"\xff" * 65536
    try:
        while True:
            os.write(fd, block)
    except OSError:
        pass


def test_a_member_who_fills_the_storage_filesystem_stops_no_durable_sync(start_daemon, small_disk, users):
    """Item 6: right after the owner's durable table is made (synced once),
    a member takes every free block of the filesystem (a real 4 MiB tmpfs);
    the table fills and goes on taking inserts (four more wraps, each
    needing syncs) and syncing, and a reboot adopts exactly what the last
    sync held."""
    store = str(small_disk / "tables")
    theirs = small_disk / "theirs"
    theirs.mkdir()
    os.chown(theirs, users[MEMBER][0], users[MEMBER][1])
    d = start_daemon(tables=[table_def(store)], storage_dirs=[store], sync_interval_s=3600)
    with d.connect() as c:
        t = c.table("f")
        # the member's file, written by the member (pytest's directories are 0700: the
        # descriptor travels into its forked child)
        fd = os.open(theirs / "filler", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.fchown(fd, users[MEMBER][0], users[MEMBER][1])
        try:
            as_user(users[MEMBER], fill_fd, fd)
        finally:
            os.close(fd)
        assert os.statvfs(store).f_bavail == 0
        for lo in range(0, 64 + 4 * 64, 16):
            ids = np.arange(lo, lo + 16)
            t.insert_batch(rows(ids), priorities=prio(ids), timeout=120)  # each waits for a sync: a hang guard
        c.flush()
        synced = c.sync("f")[0]["items"]
        st = c.stats()["tables"]["f"]
        assert (st["sync_failures"], st["sync_error"]) == (0, None), st
        want = state(t)
    # fifo: the newest items, all but at most the sync headroom evicted ahead
    assert sorted(want["id"]) == list(range(5 * 64 - synced, 5 * 64)) and synced >= 64 - HEADROOM, synced
    reboot(d, store)
    d.start()
    with d.connect() as c:
        assert_same(state(c.table("f")), want)
        c.drop_table("f")
    os.unlink(theirs / "filler")


@pytest.fixture
def shared_disk(shared_start):
    """A 4 MiB tmpfs in ``shared_start``'s directory, which other users
    reach; unmounted at teardown (stop its daemon first)."""
    with tmpfs(shared_start.dir / "disk") as mnt:
        yield mnt


KIB512 = {"obs": ("uint8", (4096,))}  # 128 items: 512 KiB of rows and a page of header


def test_a_members_file_tables_stop_at_the_default_share(shared_start, shared_disk, users):
    """Item 6, with no file_quota_bytes_per_user in the config: on a 4 MiB
    filesystem each other user's rows files take at most 1 MiB (the second
    516 KiB table of the member is refused, naming the share), all of them
    together at most 2 MiB (a fourth user's first is refused); the admin
    group has no share; the owner's durable table, made first, takes
    inserts and syncs throughout."""
    import grp
    store = str(shared_disk / "tables")
    d = shared_start(admin_group=ADMINS, allowed_groups=[GROUP], storage_dirs=[store], sync_interval_s=3600)
    gid = grp.getgrnam(GROUP).gr_gid
    with d.connect() as c:
        c.create_table("own", capacity=64, fields=KIB512, storage_dir=store)
        own = c.table("own")
        made, why = as_user(users[MEMBER], create, d.socket, ["m1", "m2"], store, 128, KIB512)
        assert made == ["m1"], why
        assert (f"user {users[MEMBER][0]}'s file-backed tables there take 0.5 MiB" in why
                and "share of 1.0 MiB" in why and "a quarter of it per user" in why
                and "file_quota_bytes_per_user is unset" in why), why
        for uid in (4_000_001, 4_000_002):  # users the passwd file does not list: the kernel's word is the uid
            made, why = as_user((uid, gid, [gid]), create, d.socket, [f"u{uid}"], store, 128, KIB512)
            assert made == [f"u{uid}"], why
        made, why = as_user((4_000_003, gid, [gid]), create, d.socket, ["late"], store, 128, KIB512)
        assert made == [] and "together, 1.5 MiB of their share of 2.0 MiB" in why, why
        assert "half of it for them all" in why
        made, why = as_user(users[ADMIN], create, d.socket, ["a1", "a2", "a3"], store, 128, KIB512)
        assert made == ["a1", "a2", "a3"], why  # the admin group: no share
        own.insert_batch({"obs": np.ones((256, 4096), np.uint8)}, timeout=30)  # four wraps
        c.flush()
        assert c.sync("own")[0]["items"] > 0 and c.stats()["tables"]["own"]["sync_failures"] == 0
        for name in c.list_tables():
            c.drop_table(name)
    assert d.stop() == 0


def status_as(sock: str, owner: int) -> dict:
    """This user's view of ``status``: the daemon's reply, as ``shmreplay
    status --json`` prints it, and the status screen's lines."""
    from shmreplay.statusview import render
    os.environ["SHMREPLAY_DAEMON_USER"] = str(owner)
    with shmreplay.connect(sock, timeout=30) as c:
        st = c.stats()
    return {"st": st, "lines": render(st)}


def pids_in(x) -> list:
    """Every value of a "pid" key anywhere in ``x``."""
    if isinstance(x, dict):
        return [v for k, v in x.items() if k == "pid"] + [p for v in x.values() for p in pids_in(v)]
    if isinstance(x, list):
        return [p for v in x for p in pids_in(v)]
    return []


def test_status_shows_a_member_other_users_clients_only_as_counts(shared_start, users):
    """Item 6: the owner's client holds slots of its table; a member's
    status (the daemon's reply itself, not only the screen) lists the
    member's own client in full and the owner's only as counts: no pid, no
    uid, no creator of the owner's; an admin sees all of it."""
    d = shared_start(admin_group=ADMINS, allowed_groups=[GROUP])
    with d.connect() as c:
        t = c.create_table("t", capacity=64, fields={"x": ("float32", ())}, max_times_sampled=1)
        t.insert_batch({"x": np.arange(64, dtype=np.float32)})
        c.flush()
        t.sample_indices(8)  # drawn for the last time: held for the owner's client (test_holds.py)
        member = as_user(users[MEMBER], status_as, d.socket, 0)
        admin = as_user(users[ADMIN], status_as, d.socket, 0)
    st = member["st"]
    assert [c["uid"] for c in st["client_list"]] == [users[MEMBER][0]], st["client_list"]
    assert st["other_clients"] == 1 and os.getpid() not in pids_in(st), st
    assert st["tables"]["t"]["holders"] == [] and st["tables"]["t"]["other_holders"] == 1, st["tables"]["t"]
    assert st["tables"]["t"]["held"] == 8 and len(st["tables"]["t"]) > 10  # the table's numbers are everyone's
    assert st["creators"] == {"others": {"users": 1, "tables": 1, "file_bytes": 0}}, st["creators"]
    assert "1 clients of other users (an admin sees who)" in member["lines"]
    full = admin["st"]
    assert {c["uid"] for c in full["client_list"]} == {0, users[ADMIN][0]}, full["client_list"]
    assert os.getpid() in pids_in(full) and "0" in full["creators"] and "other_clients" not in full


NO_RUNTIME = """
import json, sys
import shmreplay
from shmreplay.wire.names import runtime_dir
try:
    runtime_dir()
    why = None
except shmreplay.ReplayError as exc:
    why = str(exc)
with shmreplay.Server(instance=sys.argv[1]) as s, s.connect() as c:
    print(json.dumps({"why": why, "server": [s.runtime_dir == s.dir, c.list_tables()]}), flush=True)
"""


def test_a_user_without_a_runtime_directory_is_told_what_to_set_and_a_server_still_starts(users, home_of):
    """No XDG_RUNTIME_DIR, no /run/user/<uid>, a $HOME that is not the
    user's: no default is guessed (an error names what to set), and a
    Server keeps its instance lock in its own private directory."""
    owner = users[MEMBER]
    home = home_of(owner)
    proc = spawn(owner, home, NO_RUNTIME, f"test{os.getpid()}nr{next(_n)}", env={"HOME": "/"})
    try:
        got = read(proc)
    finally:
        err = finish(proc)
    assert got["server"] == [True, []], (got, err)
    assert got["why"].startswith(f"no runtime directory for uid {owner[0]}") and "set XDG_RUNTIME_DIR" in got["why"]
