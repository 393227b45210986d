"""Promise 7: only the users the config lets in can connect or map a table,
and only the daemon's user, root or the admin group can run admin
operations.  Real second and third users, made with useradd (root only)."""

import os
import stat

import numpy as np
import pytest

import shmreplay

from faults import FIELDS, rows
from waiting import wait_for
from people import (ADMIN, ADMINS, GROUP, MEMBER, STRANGER, as_user, needs_root,  # noqa: F401 (fixtures)
                    shared_start, users)

pytestmark = needs_root


@pytest.fixture
def shared_daemon(shared_start):
    """start(**access options): a daemon of table t whose socket other users can reach."""
    def start(**access):
        return shared_start(tables=[{"name": "t", "capacity": 64, "fields": FIELDS}],
                            admin_group=ADMINS, **access)
    start.dir = shared_start.dir
    return start


@pytest.fixture
def daemon(shared_daemon):
    return shared_daemon(allowed_groups=[GROUP])


def test_socket_and_every_segment_are_group_owned_and_metadata_read_only(daemon):
    import grp
    gid = grp.getgrnam(GROUP).gr_gid
    with daemon.connect():
        paths = [daemon.socket] + [os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")
                                   if f"shmreplay.{daemon.instance}." in n]
        # a table's two segments, and nothing else: channels and doorbells have no names
        assert sorted(os.path.basename(p) for p in paths[1:]) == [
            daemon.segment("t", "r")[1:], daemon.segment("t")[1:]]
        for p in paths:
            st = os.stat(p)
            # clients of other users may read the daemon's metadata, never write it
            mode = 0o640 if ".t.t." in p else 0o660
            assert stat.S_IMODE(st.st_mode) == mode and st.st_gid == gid, (p, oct(st.st_mode), st.st_gid)


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
        as_user(users[STRANGER], map_segment, daemon.segment("t")[1:])
    # with the socket open to all, SO_PEERCRED still says who it is
    os.chmod(daemon.socket, 0o666)
    with pytest.raises(shmreplay.PermissionDenied, match=f"user {users[STRANGER][0]} may not use"):
        as_user(users[STRANGER], connect_only, daemon.socket)
    assert "refused" in daemon.log()
    with daemon.connect() as c:
        assert c.list_tables() == ["t"]


def test_allowed_users_lets_in_exactly_the_users_it_names(shared_daemon, users):
    """allowed_users alone (no allowed_groups): the named second user gets a
    channel of its own and uses tables; a user of the segments' group whom
    it does not name is refused at the handshake, and says why."""
    d = shared_daemon(allowed_users=[MEMBER])
    got, denied = as_user(users[MEMBER], use_table, d.socket)
    assert set(got) <= set(range(5)) and len(got) == 16
    assert len(denied) == 3
    with pytest.raises(shmreplay.PermissionDenied, match=f"user {users[ADMIN][0]} may not use"):
        as_user(users[ADMIN], connect_only, d.socket)
    with d.connect() as c:
        assert len(c.table("t")) == 5
        wait_for(lambda: c.stats()["clients"] == 1, "the other users' connections to end")


def use_file_table(sock):
    c = shmreplay.connect(sock, timeout=60)
    t = c.table("f")
    t.insert_batch(rows(np.arange(7)))
    c.flush()
    got = sorted(set(t.sample(32).data["id"].tolist()))
    c.close()
    return got


def test_a_file_backed_tables_rows_file_is_the_groups_and_no_one_elses(shared_daemon, users):
    store = str(shared_daemon.dir / "tables")  # made by the daemon: 0750, the daemon's group
    d = shared_daemon(allowed_groups=[GROUP], storage_dirs=[store])
    with d.connect() as c:
        c.create_table("f", capacity=64, fields=FIELDS, storage_dir=store)
    path = os.path.join(store, f"shmreplay.{d.instance}.r.f")
    import grp
    gid = grp.getgrnam(GROUP).gr_gid
    for p, mode in ((store, 0o750), (path, 0o660)):
        st = os.stat(p)
        assert (stat.S_IMODE(st.st_mode), st.st_gid) == (mode, gid), (p, oct(st.st_mode), st.st_gid)
    assert as_user(users[MEMBER], use_file_table, d.socket) == list(range(7))
    with pytest.raises(PermissionError):
        as_user(users[STRANGER], lambda: open(path, "rb").read(16))
