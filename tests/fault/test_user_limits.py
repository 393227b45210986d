"""Issue 21: one user other than the daemon's own cannot take a shared place
from everyone else: tables (per user, and a reserve kept for the daemon's
user and root), file-backed tables' bytes (a quota), refused connections
(a few linger, the rest are closed at once) and descriptors (a reserve for
root, the daemon's user and the admin group).  Real users (``people.py``):
the member and the admin are other users, the test itself (root) is the
daemon's user."""

import os
import re
import socket
import sys
import threading

import numpy as np
import pytest

import shmreplay
from shmreplay.server.control.config import parse_config
from shmreplay.wire.control import ClientConnection

from faults import FIELDS, HANG_S, rows, wait_for
from people import ADMIN, ADMINS, GROUP, MEMBER, STRANGER, as_user, needs_root, shared_start, users  # noqa: F401 (fixtures)

SMALL = {"x": ("int64", ())}


def test_the_limits_config_is_checked():
    """No daemon: every new key is checked, with an error that says what is wrong."""
    cfg = parse_config({"daemon": {"max_tables": 32}})
    assert (cfg.reserved_tables, cfg.max_tables_per_user, cfg.file_quota_bytes_per_user) == (2, 16, None)
    for bad, says in (({"max_tables": 4, "reserved_tables": 5}, "reserved_tables (5) may not exceed"),
                      ({"reserved_tables": 0}, "reserved_tables must be a number >= 1"),
                      ({"max_tables_per_user": 0}, "max_tables_per_user must be a number >= 1"),
                      ({"file_quota_bytes_per_user": -1}, "file_quota_bytes_per_user must be"),
                      ({"max_lingering_refusals": "16"}, "max_lingering_refusals must be"),
                      ({"reserved_descriptors": -8}, "reserved_descriptors must be"),
                      ({"max_clients": 2, "reserved_clients": 3}, "reserved_clients (3) may not exceed")):
        with pytest.raises(shmreplay.SchemaError, match=re.escape(says)):
            parse_config({"daemon": bad})


@pytest.fixture
def shared(shared_start):
    """start(**options): a daemon whose socket (and storage) other users reach."""
    def start(**options):
        return shared_start(admin_group=ADMINS, allowed_groups=[GROUP], **options)
    start.dir = shared_start.dir
    return start


def create(sock, names, storage_dir=None, capacity=8, fields=SMALL):
    """As another user: create tables until one is refused; (made, error)."""
    made = []
    with shmreplay.connect(sock, timeout=60) as c:
        for name in names:
            try:
                c.create_table(name, capacity=capacity, fields=fields, storage_dir=storage_dir)
            except shmreplay.CapacityError as exc:
                return made, str(exc)
            made.append(name)
    return made, None


@needs_root
def test_a_members_tables_stop_at_its_limit_and_the_owner_can_always_create(shared, users):
    """max_tables 7, 3 per user, 2 kept for the daemon's user: the config's
    table is the daemon's user's; the member stops at 3, the admin (another
    user too) at the 2 the others have left; root still creates one."""
    d = shared(max_tables=7, max_tables_per_user=3, reserved_tables=2,
               tables=[{"name": "cfg", "capacity": 8, "fields": SMALL}])
    made, why = as_user(users[MEMBER], create, d.socket, ["m1", "m2", "m3", "m4"])
    assert made == ["m1", "m2", "m3"] and "max_tables_per_user 3" in why, why
    assert f"user {users[MEMBER][0]} holds 3 tables" in why
    made, why = as_user(users[ADMIN], create, d.socket, ["a1", "a2", "a3"])
    assert made == ["a1", "a2"] and "reserved_tables 2" in why and "hold 5 tables" in why, why
    with d.connect() as c:
        c.create_table("own", capacity=8, fields=SMALL)  # the reserve: 1 + 5 + 1 = max_tables
        with pytest.raises(shmreplay.CapacityError, match="max_tables 7"):
            c.create_table("own2", capacity=8, fields=SMALL)
        creators = c.stats()["creators"]
        assert creators[str(users[MEMBER][0])]["tables"] == 3 and creators["0"]["tables"] == 2
        c.drop_table("m1")  # a dropped table is the member's no more
        c.drop_table("own")
    made, why = as_user(users[MEMBER], create, d.socket, ["m5", "m6"])
    assert made == ["m5"] and "max_tables_per_user 3" in why, why


@needs_root
def test_a_members_tables_count_against_its_limit_after_a_restart(shared, users):
    """A table another user made stays its creator's across a SIGKILL and
    the adoption after it (``creator_uid`` in its definition): the member,
    at its limit of 2 before, is still at it after; the owner's table
    stays the owner's.  (Before: every adopted table was booked to the
    daemon's user, and each restart gave the member a fresh limit.)"""
    d = shared(max_tables_per_user=2)
    made, why = as_user(users[MEMBER], create, d.socket, ["m1", "m2", "m3"])
    assert made == ["m1", "m2"] and "max_tables_per_user 2" in why, why
    with d.connect() as c:
        c.create_table("own", capacity=8, fields=SMALL)
    d.crash()
    d.start()
    made, why = as_user(users[MEMBER], create, d.socket, ["m3"])
    assert made == [] and f"user {users[MEMBER][0]} holds 2 tables" in str(why), why
    with d.connect() as c:
        assert sorted(c.list_tables()) == ["m1", "m2", "own"]
        creators = c.stats()["creators"]
        assert creators[str(users[MEMBER][0])]["tables"] == 2 and creators["0"]["tables"] == 1
        assert c.table("m1").spec.creator_uid == users[MEMBER][0] and c.table("own").spec.creator_uid is None


@needs_root
def test_a_members_file_tables_stop_at_its_quota_and_the_refusal_names_it(shared, users):
    """file_quota_bytes_per_user: the second 2 MiB table of a member with a
    3 MiB quota is refused before anything is made; the owner is exempt;
    a /dev/shm table is not the quota's."""
    store = str(shared.dir / "tables")
    quota = 3 * 2**20
    d = shared(storage_dirs=[store], file_quota_bytes_per_user=quota)
    big = {"obs": ("uint8", (4096,))}  # 512 x 4 KiB: 2 MiB of rows (and a page of header)
    made, why = as_user(users[MEMBER], create, d.socket, ["f1", "f2"], store, 512, big)
    assert made == ["f1"], why
    assert f"file_quota_bytes_per_user {quota}" in why and "quota of 3.0 MiB" in why, why
    assert f"user {users[MEMBER][0]}'s file-backed tables take 2.0 MiB" in why, why
    assert "drop one of yours" in why and "/dev/shm" in why
    assert sorted(os.listdir(store)) == [f"shmreplay.{d.instance}.r.f1", f"shmreplay.{d.instance}.t.f1"]
    assert not [n for n in os.listdir("/dev/shm") if n.endswith(f"{d.instance}.t.f2")]
    made, why = as_user(users[MEMBER], create, d.socket, ["s1"], "", 512, big)
    assert made == ["s1"], why  # in /dev/shm: not the quota's
    with d.connect() as c:
        for name in ("o1", "o2"):  # the daemon's user: no quota
            c.create_table(name, capacity=512, fields=big, storage_dir=store)
        t = c.table("f1")
        assert len(t) == 0 and c.stats()["creators"][str(users[MEMBER][0])]["file_bytes"] > 2 * 2**20


def daemon_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def read_notice(sock: socket.socket, wait: bool) -> str:
    """The daemon's bye notice on a refused connection, 'Class: message'; ""
    if none is there (``wait``: wait for it)."""
    conn = ClientConnection()
    if not wait:  # (a timeout would make Python wait even with MSG_DONTWAIT)
        sock.setblocking(False)
    while conn.bye is None:
        try:
            data = sock.recv(1 << 16)
        except BlockingIOError:
            return ""
        assert data, "closed without a notice"
        conn.receive(data)
    return f"{type(conn.bye).__name__}: {conn.bye}"


def flood(path, n, ready_w, go_r):
    """As another user (``Beside``): ``n`` silent connections.  The daemon accepts and
    decides them in order, and writes a refusal's notice at once, so once
    the last one's notice is here (it must be refused) each of the others
    has its notice, or was let in ("").  Tell the test, wait for its word,
    then count the refused connections the daemon has closed."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(path)  # blocking: a full listen queue is waited out
        s.settimeout(HANG_S)
        socks.append(s)
    last = read_notice(socks[-1], wait=True)
    said = [read_notice(s, wait=False) for s in socks[:-1]] + [last]
    os.write(ready_w, b"r")
    os.read(go_r, 1)
    closed = 0
    for s, what in zip(socks, said):
        if what:
            s.setblocking(False)
            try:  # the notice was read: what is left is the end
                closed += s.recv(1) == b""
            except BlockingIOError:
                pass
    for s in socks:
        s.close()
    return said, closed


class Beside:
    """``fn(*args, ready_w, go_r)`` run as ``user`` in a forked child, from
    a thread of the test: it writes a byte to ``ready_w`` when its state is
    in place, then waits for a byte on ``go_r`` (``finish``)."""

    def __init__(self, user, fn, *args):
        r, self.ready_w = os.pipe()
        self.go_r, self.go_w = os.pipe()
        self.out = {}
        self.th = threading.Thread(target=self._run, args=(user, fn, args), daemon=True)
        self.th.start()
        self.ready = os.read(r, 1)  # empty: the child failed before it was ready
        os.close(r)

    def _run(self, user, fn, args):
        try:
            self.out["result"] = as_user(user, fn, *args, self.ready_w, self.go_r)
        except BaseException as exc:
            self.out["error"] = exc
        finally:
            os.close(self.ready_w)  # the child's copy is closed too: a failed child wakes the test

    def finish(self):
        os.write(self.go_w, b"g")
        self.th.join(HANG_S)
        for fd in (self.go_r, self.go_w):
            os.close(fd)
        if "error" in self.out:
            raise self.out["error"]
        return self.out["result"]


@needs_root
def test_a_refused_flood_holds_only_the_lingering_few_and_the_owner_connects(shared, users):
    """A member past max_clients_per_user, then a stranger, each refused 40
    times: at most 2 refusals of a user, 3 in all, stay open to deliver
    their reason (refusal_linger_s made longer than the test, so nothing
    but the caps can close the rest); the others are closed right after
    their notice, which every client still reads.  Counted in the daemon's
    /proc/<pid>/fd."""
    d = shared(max_clients_per_user=2, max_lingering_refusals=3, max_lingering_refusals_per_user=2,
               refusal_linger_s=600.0, handshake_timeout_s=600.0)
    os.chmod(d.socket, 0o666)  # the stranger reaches the daemon: SO_PEERCRED keeps it out
    with d.connect() as c:
        c.create_table("t", capacity=64, fields=FIELDS)
        wait_for(lambda: c.stats()["connections"] == 1, "the daemon to end wait_ready's connection")
        before = daemon_fds(d.pid)
        member = Beside(users[MEMBER], flood, d.socket, 42)
        stranger = Beside(users[STRANGER], flood, d.socket, 40)
        assert member.ready and stranger.ready, (member.out, stranger.out)
        # the member's 2 silent places, 2 of its refusals and 1 of the stranger's
        wait_for(lambda: daemon_fds(d.pid) == before + 5, "the daemon to close all but 3 refusals")
        with d.connect() as owner:  # the owner is let in and served meanwhile
            owner.table("t").insert_batch(rows(np.arange(4)))
            owner.flush()
            assert len(owner.table("t")) == 4
        status = c.stats()["descriptors"]
        assert status["lingering_refusals"] == 3 and status["refused_connections"] == 80, status
        (m_said, m_closed), (s_said, s_closed) = member.finish(), stranger.finish()
        assert m_said[:2] == ["", ""], m_said[:3]  # let in
        assert all("max_clients_per_user 2" in m for m in m_said[2:]), m_said[:3]
        assert all(f"user {users[STRANGER][0]} may not use" in m for m in s_said), s_said[:3]
        assert (m_closed, s_closed) == (38, 39)
        # the lingering ones end when their client does, and the silent places are freed
        wait_for(lambda: daemon_fds(d.pid) == before, "the lingering refusals to be closed")


@needs_root
def test_other_users_leave_root_a_place_under_max_clients(shared, users):
    """max_clients 5, 2 kept for root, its user and the admin group: with
    root's client in, a member's 2 places and a stranger's (let in by
    name) take the 3 the others have; the stranger's next is refused
    naming reserved_clients, and a second root client still gets in."""
    d = shared(max_clients=5, reserved_clients=2, max_clients_per_user=2, allowed_users=[STRANGER],
               handshake_timeout_s=600.0)
    os.chmod(d.socket, 0o666)  # the stranger is in no group of the socket's
    with d.connect() as c:
        wait_for(lambda: c.stats()["connections"] == 1, "the daemon to end wait_ready's connection")
        member = Beside(users[MEMBER], flood, d.socket, 3)
        stranger = Beside(users[STRANGER], flood, d.socket, 2)
        assert member.ready and stranger.ready, (member.out, stranger.out)
        with d.connect() as c2:
            assert c2.stats()["connections"] == 5
        (m_said, _), (s_said, _) = member.finish(), stranger.finish()
    assert m_said[:2] == ["", ""] and "max_clients_per_user 2" in m_said[2], m_said
    assert s_said[0] == "" and "reserved_clients 2" in s_said[1] and "hold 3 connections" in s_said[1], s_said


RLIMIT = 256
RESERVE = 64


def low_limit_daemon():
    """shmreplayd started with RLIMIT_NOFILE soft 64, hard 256: the daemon
    must raise the soft limit itself."""
    code = ("import resource, runpy; "
            f"resource.setrlimit(resource.RLIMIT_NOFILE, (64, {RLIMIT})); "
            "runpy.run_module('shmreplay.server.daemon', run_name='__main__')")
    return [sys.executable, "-c", code]


def client_then_create(path, ready_w, go_r):
    """As another user (``Beside``): a client; on the test's word, a table."""
    with shmreplay.connect(path, timeout=60) as c:
        os.write(ready_w, b"r")
        os.read(go_r, 1)
        try:
            c.create_table("late", capacity=8, fields=SMALL)
        except shmreplay.CapacityError as exc:
            return str(exc)
        return "created"


def connect_and_use(sock):
    with shmreplay.connect(sock, timeout=60) as c:
        return len(c.table("t"))


@needs_root
def test_with_few_descriptors_a_members_flood_cannot_keep_the_owner_out(shared, users):
    """A daemon with RLIMIT_NOFILE 256: a member opens 256 silent
    connections (every one would be admitted by the client limits).  The
    daemon admits them only while the reserve of 64 stays free, refuses the
    rest with a reason and closes them at once; root and the admin group
    then connect and work, and the member's table is refused too.  Before the reserve, the flood ran the daemon out
    of descriptors and the owner's connect failed with a broken pipe."""
    d = shared(command=low_limit_daemon(), reserved_descriptors=RESERVE, max_clients=1000,
               max_clients_per_user=1000, handshake_timeout_s=600.0,
               tables=[{"name": "t", "capacity": 64, "fields": FIELDS}])
    assert f"soft limit raised from 64 to {RLIMIT}" in d.log()
    limits = open(f"/proc/{d.pid}/limits").read()
    assert [ln.split()[3] for ln in limits.splitlines() if ln.startswith("Max open files")] == [str(RLIMIT)]
    creator = Beside(users[MEMBER], client_then_create, d.socket)
    member = Beside(users[MEMBER], flood, d.socket, RLIMIT)
    assert creator.ready and member.ready, (creator.out, member.out)
    assert daemon_fds(d.pid) <= RLIMIT - RESERVE  # the reserve is untouched
    with d.connect() as owner, d.connect() as owner2:
        owner.table("t").insert_batch(rows(np.arange(3)))
        owner.flush()
        assert len(owner2.table("t")) == 3
        assert as_user(users[ADMIN], connect_and_use, d.socket) == 3
        # a table's segments would eat into the reserve too
        assert f"reserved_descriptors {RESERVE}" in creator.finish()
    said, closed = member.finish()
    refused = [m for m in said if m]
    assert refused and all(f"reserved_descriptors {RESERVE}" in m for m in refused), refused[:3]
    assert len(refused) < RLIMIT and closed == len(refused)  # some got in; every refusal was closed at once
