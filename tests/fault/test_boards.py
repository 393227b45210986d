"""Issue 34 item 2: a ParameterBoard under a hostile member of the daemon's
group (real users, ``people.py``).  The owner's learner publishes; a member
tries to publish a version from the future, to write the board's rows, and
reads while the learner publishes on two slots."""

import errno
import mmap
import multiprocessing
import os

import numpy as np
import pytest

import shmreplay

from people import ADMIN, GROUP, MEMBER, as_user, needs_root, shared_start, users  # noqa: F401 (fixtures)
from shmreplay.priorities import first_invalid_priority

# as_user's children (other users) update priorities; they may not read the
# numba cache of a checkout in a closed folder (a fresh clone under
# mktemp -d, 0700), so the kernel is compiled here, before they fork
first_invalid_priority(np.ones(1))

pytestmark = needs_root

LIKE = {"w": np.zeros((32, 16), np.float32), "b": np.zeros(16, np.float64)}


def params(v) -> dict:
    return {k: np.full(a.shape, v, a.dtype) for k, a in LIKE.items()}


def whole(v, arrays) -> bool:
    """Every array holds the learner's values for version v."""
    return all(arrays[k].dtype == a.dtype and (arrays[k] == v).all() for k, a in LIKE.items())


@pytest.fixture
def daemon(shared_start):
    return shared_start(allowed_groups=[GROUP])


def forge(sock):
    """The reported attack: a member attaches to the owner's board, sets its
    next version to 2**52 and publishes its own weights; then it tries the
    table's own insert, and a priority update.  Returns what each did."""
    out = {}
    with shmreplay.connect(sock, timeout=30) as c:
        board = shmreplay.ParameterBoard.attach(c, "policy", like=LIKE)
        board.version = 2**52
        for what, call in (("publish", lambda: board.publish(params(-1))),
                           ("insert", lambda: (board.table.insert(**_raw_item(board)), c.flush())),
                           ("update", lambda: (board.table.update_priorities(np.array([1], np.uint64), [5.0]),
                                               c.flush()))):
            try:
                call()
                out[what] = "accepted"
            except shmreplay.PermissionDenied as exc:
                out[what] = str(exc)
    return out


def _raw_item(board) -> dict:
    """An item of the board's table as a client would write it (any
    version field the old board had included)."""
    names = {f.name for f in board.table.spec.fields}
    item = {"layout": board.layout, "blob": np.full(board.nbytes, 0xFF, np.uint8)}
    if "version" in names:  # the board before issue 34: the publisher chose the version
        item["version"] = 2**52 + 1
    return item


def read_newer(sock, seen):
    with shmreplay.connect(sock, timeout=30) as c:
        got = shmreplay.ParameterBoard.attach(c, "policy", like=LIKE).latest(newer_than=seen)
        return None if got is None else (got[0], whole(got[0], got[1]))


def test_a_member_cannot_publish_into_the_owners_board_nor_freeze_its_readers(daemon, users):
    """Reported: a member published version 2**52+1; the owner's actors
    loaded its weights, then ignored the learner's later versions.  Now the
    daemon refuses every write of the board from anyone but its creator and
    admins, and numbers the versions itself: the actors read the learner's
    next version."""
    with daemon.connect() as owner:
        board = shmreplay.ParameterBoard.create(owner, "policy", like=LIKE)
        assert [board.publish(params(v)) for v in (1, 2, 3)] == [1, 2, 3]
        got = as_user(users[MEMBER], forge, daemon.socket)
        assert all("written only by its creator" in why or "published only by its creator" in why
                   for why in got.values()), got
        assert as_user(users[MEMBER], read_newer, daemon.socket, 0) == (3, True)
        assert board.publish(params(4)) == 4
        # the member's actor, and the owner's, read the learner's version 4
        assert as_user(users[MEMBER], read_newer, daemon.socket, 3) == (4, True)
        v, arrays = shmreplay.ParameterBoard.attach(owner.clone(), "policy", like=LIKE).latest(newer_than=3)
        assert v == 4 and whole(4, arrays)
        assert owner.table("policy").inserts == 4  # nothing of the member's went in


def overwrite_rows(path):
    """The reported attack: map the board's rows read-write and write the
    member's values over every byte.  Returns what the kernel said."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        return errno.errorcode[exc.errno]
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size)
        mm[4096:] = b"\x7f" * (size - 4096)  # after the rows header: every field row
        mm.close()
    finally:
        os.close(fd)
    return "written"


def write_through_own_mapping(sock):
    with shmreplay.connect(sock, timeout=30) as c:
        rows = c.table("policy").mapped.fields["blob"]
        try:
            rows[:] = 0x7F
            return "written"
        except ValueError as exc:
            return str(exc)


def test_a_member_cannot_write_the_boards_rows(daemon, users):
    """Reported: a member wrote the board's rows directly (mode 0660, the
    daemon's group); a fresh actor read the member's values labelled as the
    learner's version 30.  The rows of a board are group read-only now: the
    member can neither open them for writing nor write through its own
    client's mapping, and a fresh actor reads version 30 as published."""
    with daemon.connect() as owner:
        board = shmreplay.ParameterBoard.create(owner, "policy", like=LIKE)
        for v in range(1, 31):
            board.publish(params(v))
        rows = "/dev/shm" + daemon.segment("policy", "r")
        assert as_user(users[MEMBER], overwrite_rows, rows) == "EACCES"
        assert "read-only" in as_user(users[MEMBER], write_through_own_mapping, daemon.socket)
        assert as_user(users[MEMBER], read_newer, daemon.socket, 0) == (30, True)
        v, arrays = shmreplay.ParameterBoard.attach(owner.clone(), "policy", like=LIKE).latest()
        assert v == 30 and whole(30, arrays)


def _publish_until(sock, stop, made):
    with shmreplay.connect(sock, timeout=30) as c:
        board = shmreplay.ParameterBoard.create(c, "policy", like=LIKE, slots=2)
        v = board.publish(params(1))
        made.set()
        while not stop.is_set():
            v = board.publish(params(v + 1))
            assert v == board.version


READS = 2000


def read_while_publishing(sock):
    """A member's actor: READS calls of latest() while the learner publishes;
    counts the answers without a version, and the torn or older ones."""
    with shmreplay.connect(sock, timeout=30) as c:
        board = shmreplay.ParameterBoard.attach(c, "policy", like=LIKE)
        none, bad, seen = 0, 0, 0
        for _ in range(READS):
            got = board.latest()
            if got is None:
                none += 1
                continue
            v, arrays = got
            bad += (not whole(v, arrays)) or v < seen
            seen = v
        return none, bad, seen


def test_latest_finds_the_newest_version_on_two_slots_while_the_learner_publishes(daemon, users):
    """Reported: with two slots, latest() answered "no version" 10-30 times
    per real read while the learner published (a reader's pinned redraw
    made a publish evict both slots).  The learner publishes without pause;
    a member's actor asks 2,000 times: every answer is a whole version, none
    older than one it read before, none missing.  (Whether a copy and a
    publish meet is the scheduler's: nothing counts on it; one publisher
    holds at most one of the two slots, so one version is always committed,
    and a reader pins nothing unless its copies are torn READ_TRIES times.)"""
    ctx = multiprocessing.get_context("fork")
    stop, made = ctx.Event(), ctx.Event()
    pub = ctx.Process(target=_publish_until, args=(daemon.socket, stop, made))
    pub.start()
    try:
        assert made.wait(60)
        none, bad, seen = as_user(users[MEMBER], read_while_publishing, daemon.socket)
    finally:
        stop.set()
        pub.join(60)
        if pub.is_alive():
            pub.kill()
            pub.join()
    assert pub.exitcode == 0
    assert (none, bad) == (0, 0), (none, bad, seen)
    assert seen >= 1


def members_board(sock, versions):
    """The member's learner: make (or reuse) its own board, publish
    ``versions``; returns what publish answered, and how its rows object
    is mapped (the daemon passed it a writable descriptor)."""
    with shmreplay.connect(sock, timeout=30) as c:
        board = shmreplay.ParameterBoard.create(c, "mine", like=LIKE)
        got = [board.publish(params(v)) for v in versions]
        again = shmreplay.ParameterBoard.attach(c.clone(), "mine", like=LIKE)  # open_table passes it too
        got.append(again.publish(params(len(got) + 1)))
        return got, board.table.mapped.fields["blob"].flags.writeable


def other_member_tries(sock, rows):
    out = {"open_rw": overwrite_rows(rows)}
    with shmreplay.connect(sock, timeout=30) as c:
        board = shmreplay.ParameterBoard.attach(c, "mine", like=LIKE, publisher=MEMBER)
        try:
            board.publish(params(-1))
            out["publish"] = "accepted"
        except shmreplay.PermissionDenied as exc:
            out["publish"] = str(exc)
        out["read"] = board.latest()[0]
    return out


def test_a_members_board_is_written_by_that_member_only(daemon, users):
    """A member's own board: the daemon passes the member (its creator) a
    writable descriptor of the rows at each create and open, since the rows
    are the daemon user's and group read-only; another member can neither
    open them for writing nor publish, and the owner's reader trusts the
    board only when told who publishes it."""
    got, writable = as_user(users[MEMBER], members_board, daemon.socket, (1, 2))
    assert got == [1, 2, 3] and writable
    rows = "/dev/shm" + daemon.segment("mine", "r")
    st = os.stat(rows)
    assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o640)
    other = as_user(users[ADMIN], other_member_tries, daemon.socket, rows)  # no admin_group here
    assert other["open_rw"] == "EACCES" and "only by its creator" in other["publish"], other
    assert other["read"] == 3
    with daemon.connect() as owner:
        with pytest.raises(shmreplay.PermissionDenied, match="publisher="):
            shmreplay.ParameterBoard.attach(owner, "mine", like=LIKE)
        v, arrays = shmreplay.ParameterBoard.attach(owner, "mine", like=LIKE, publisher=users[MEMBER][0]).latest()
        assert v == 3 and whole(3, arrays)


def test_a_board_a_member_made_first_under_the_learners_name_is_refused(daemon, users):
    """A member makes "policy" before the learner: the learner's create and
    the owner's readers refuse it, naming its publisher, instead of
    publishing into, or reading, the member's board."""
    with daemon.connect() as owner:
        as_user(users[MEMBER], squat, daemon.socket)
        with pytest.raises(shmreplay.PermissionDenied, match=f"published by uid {users[MEMBER][0]}"):
            shmreplay.ParameterBoard.create(owner, "policy", like=LIKE)
        with pytest.raises(shmreplay.PermissionDenied, match="publisher="):
            shmreplay.ParameterBoard.attach(owner, "policy", like=LIKE)


def squat(sock):
    with shmreplay.connect(sock, timeout=30) as c:
        shmreplay.ParameterBoard.create(c, "policy", like=LIKE).publish(params(666))


def forge_writer(sock, owner_uid):
    """A member's create that names another user (the owner) as the writer."""
    with shmreplay.connect(sock, timeout=30) as c:
        t = c.create_table("forged", 4, {"x": ("int64", ())}, writers="creator", writer_uid=owner_uid)
        return t.spec.writer_uid


def test_the_daemon_records_the_creator_whatever_the_request_says(daemon, users):
    """The writer is the kernel's word on who asked (SO_PEERCRED): a member
    that sends the owner's uid as ``writer_uid`` is recorded as itself; a
    malformed rule is a SchemaError naming it."""
    assert as_user(users[MEMBER], forge_writer, daemon.socket, os.geteuid()) == users[MEMBER][0]
    with daemon.connect() as owner:
        assert owner.table("forged").spec.writer_uid == users[MEMBER][0]
        with pytest.raises(shmreplay.SchemaError, match="writers must be one of"):
            owner.create_table("bad", 4, {"x": ("int64", ())}, writers="everyone")
        with pytest.raises(shmreplay.SchemaError, match="writer_uid must be a uid"):
            owner.create_table("bad", 4, {"x": ("int64", ())}, writer_uid=5)
