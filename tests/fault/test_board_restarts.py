"""Issue 34 item 2: a ParameterBoard's write rule across a daemon's
crash, restart and checkpoint restore (real users, ``people.py``): the
rule and the writer come back with the table, a member's board is its own
again, and a table that came back changed leaks no rows descriptor."""

import os
import select
import threading

import pytest

import shmreplay
from faults import HANG_S
from people import ADMIN, MEMBER, as_user, needs_root, shared_start, users  # noqa: F401 (fixtures)
from test_boards import LIKE, daemon, forge, other_member_tries, params, read_newer  # noqa: F401 (a fixture)

pytestmark = needs_root


def rows_mode(daemon) -> int:
    return os.stat("/dev/shm" + daemon.segment("policy", "r")).st_mode & 0o777


@pytest.mark.parametrize("how", ["adopted", "restored"])
def test_the_write_rule_survives_a_crash_and_a_checkpoint(daemon, users, how, tmp_path):
    """The rule and its writer are part of the table's definition, so they
    come back with the table: adopted after a SIGKILL (the meta segment's
    schema), or restored from a checkpoint (its spec): the rows are group
    read-only again, the member is refused again, and the versions go on
    from the newest (the daemon's commit numbers)."""
    with daemon.connect() as owner:
        board = shmreplay.ParameterBoard.create(owner, "policy", like=LIKE)
        for v in (1, 2, 3):
            board.publish(params(v))
        if how == "restored":
            ck = str(tmp_path / "ck")
            owner.checkpoint(ck, ["policy"])
    if how == "adopted":
        daemon.crash()
        daemon.start()
    else:
        assert daemon.stop() == 0  # the table goes with a clean stop
        daemon.start(["--restore", ck])
    assert rows_mode(daemon) == 0o640
    with daemon.connect() as owner:
        assert owner.table("policy").spec.writer_uid == os.geteuid()
        got = as_user(users[MEMBER], forge, daemon.socket)
        assert all("only by its creator" in why for why in got.values()), got
        board = shmreplay.ParameterBoard.create(owner, "policy", like=LIKE)
        assert board.version == 3 and board.publish(params(4)) == 4
        assert as_user(users[MEMBER], read_newer, daemon.socket, 3) == (4, True)


def publish_across_a_restart(sock, published, restarted):
    """A member's learner with a reconnecting client: publishes, waits for
    the daemon's SIGKILL and restart, publishes again."""
    with shmreplay.connect(sock, timeout=30, reconnect=True) as c:
        board = shmreplay.ParameterBoard.create(c, "mine", like=LIKE)
        first = board.publish(params(1))
        os.write(published, b"1")
        assert os.read(restarted, 1) == b"1"
        return first, board.publish(params(2)), board.table.mapped.fields["blob"].flags.writeable


def member_across_a_restart(daemon, users, fn, between=lambda: None) -> list:
    """Run ``fn(socket, ready, restarted)`` as the member, on a thread:
    once it writes ``ready`` the daemon is SIGKILLed, ``between()`` runs,
    the daemon starts again and ``restarted`` is written.  [its result] or
    [what it raised]."""
    published, restarted = os.pipe(), os.pipe()
    out = []
    def member():
        try:
            out.append(as_user(users[MEMBER], fn, daemon.socket, published[1], restarted[0]))
        except BaseException as exc:  # shown by the caller's assert
            out.append(exc)
    th = threading.Thread(target=member)
    th.start()
    try:
        assert select.select([published[0]], [], [], HANG_S)[0], "the member did not get ready"
        os.read(published[0], 1)
        daemon.crash()
        between()
        daemon.start()
        os.write(restarted[1], b"1")
        th.join(HANG_S)
    finally:
        for fd in (*published, *restarted):
            os.close(fd)
    return out


def test_a_members_board_is_its_own_again_after_the_daemon_restarts(daemon, users):
    """The writer is part of the adopted table's definition, and the
    member's reconnecting client gets its writable rows again when it
    reopens the table: it publishes version 2 after the restart; another
    member is still refused."""
    out = member_across_a_restart(daemon, users, publish_across_a_restart)
    assert out == [(1, 2, True)], out
    with daemon.connect() as owner:  # still the member's table, counted against its limits
        assert owner.stats()["creators"][str(users[MEMBER][0])]["tables"] == 1
    rows = "/dev/shm" + daemon.segment("mine", "r")
    other = as_user(users[ADMIN], other_member_tries, daemon.socket, rows)
    assert other["open_rw"] == "EACCES" and "only by its creator" in other["publish"], other
    assert other["read"] == 2


def rows_descriptors() -> list[str]:
    """What this process's descriptors of rows objects of tables named
    "mine" name, after a collection: the mappings of table handles still
    alive hold one each (``mmap`` keeps a copy of its descriptor)."""
    import gc
    gc.collect()
    links = []
    for n in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{n}"))
        except OSError:  # the listing's own descriptor, closed since
            pass
    return sorted(link for link in links if ".r.mine." in link)


def reconnect_to_a_changed_table(sock, ready, restarted):
    """A member's reconnecting client with a table only it writes; after
    the restart the table is made again by the member, with another
    capacity; the first client's next call reconnects and finds it changed.
    (its error; its descriptors of rows before and after the call)."""
    fields = {"x": ("int64", ())}
    with shmreplay.connect(sock, timeout=30, reconnect=True, reconnect_timeout=HANG_S) as c:
        c.create_table("mine", 4, fields, writers="creator")
        os.write(ready, b"1")
        assert os.read(restarted, 1) == b"1"
        with shmreplay.connect(sock, timeout=30) as again:  # its rows come to this member too
            again.create_table("mine", 8, fields, writers="creator")
        before = rows_descriptors()
        with pytest.raises(shmreplay.ReplayError) as e:
            c.list_tables()
        return str(e.value), before, rows_descriptors()


def test_a_table_that_came_back_changed_leaves_no_rows_descriptor(daemon, users):
    """A reconnect that finds the member's table made again with another
    definition refuses it, and closes the writable rows descriptor the
    daemon passed with the reply.  (Before: one descriptor of the new
    table's rows left open per failed reconnect.)"""
    def gone_for_good():
        for part in "tr":
            os.unlink("/dev/shm" + daemon.segment("mine", part))
    out = member_across_a_restart(daemon, users, reconnect_to_a_changed_table, gone_for_good)
    assert len(out) == 1 and not isinstance(out[0], BaseException), out
    why, before, after = out[0]
    assert "came back with another definition" in why and after == before, out
