"""Issue 33, item 4: ``admin_group`` may drop tables and shut the daemon down
(docs/operations.md: the ``admin_group`` row of the config table, "who may
drop tables, checkpoint and shut down besides root and shmreplay"; and
"Admin commands (checkpoint, drop, shutdown, ...) need the daemon's user,
root or admin_group (exit code 4 otherwise)").

Real users (people.py, root only): MEMBER is in the daemon's group only,
ADMIN in it and in ADMINS, the daemon's admin_group.  The command line runs
as each of them in a forked child (its ``main``, as the ``shmreplay``
script calls it: another user cannot start this interpreter).
test_access.py checks the client API's refusals; this module the admin's
powers over another user's table and the daemon, and the command line's
exit code 4."""

import contextlib
import io

import numpy as np
import pytest

import shmreplay
import shmreplay.cli
from faults import FIELDS, rows
from people import (ADMIN, ADMINS, GROUP, MEMBER, as_user, needs_root,  # noqa: F401 (fixtures)
                    shared_start, users)
from waiting import HANG_S

pytestmark = needs_root


@pytest.fixture
def daemon(shared_start):
    return shared_start(admin_group=ADMINS, allowed_groups=[GROUP])


def command(argv):
    """``shmreplay ARGV``'s exit code and what it printed (stdout + stderr)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = shmreplay.cli.main(argv)
    return code, out.getvalue()


def create_table(sock, name):
    with shmreplay.connect(sock, timeout=HANG_S) as c:
        t = c.create_table(name, capacity=16, fields=FIELDS)
        t.insert_batch(rows(np.arange(4)))
        c.flush()


def drop_table(sock, name):
    with shmreplay.connect(sock, timeout=HANG_S) as c:
        c.drop_table(name)
        return c.list_tables()


def test_a_plain_member_may_neither_drop_a_table_nor_shut_down_from_the_command_line(daemon, users):
    """exit code 4 and the daemon's reason, for the member's own table too;
    the table and the daemon stay."""
    as_user(users[MEMBER], create_table, daemon.socket, "mine")
    for argv in (["drop", "mine"], ["shutdown", "--wait", "0"]):
        code, out = as_user(users[MEMBER], command, ["--socket", daemon.socket, *argv])
        assert code == 4, (argv, out)
        assert "admin operation" in out, (argv, out)
    with daemon.connect() as c:
        assert c.list_tables() == ["mine"] and len(c.table("mine")) == 4
    assert daemon.proc.poll() is None


def test_the_admin_group_drops_another_users_tables_and_shuts_the_daemon_down(daemon, users):
    """ADMIN drops tables MEMBER made, with the client API and with
    ``shmreplay drop``, then stops the daemon with ``shmreplay shutdown``,
    which exits 0 once it has: the daemon stopped cleanly."""
    member_uid = users[MEMBER][0]
    as_user(users[MEMBER], create_table, daemon.socket, "first")
    as_user(users[MEMBER], create_table, daemon.socket, "second")
    with daemon.connect() as c:
        assert c.stats()["creators"] == {str(member_uid): {"tables": 2, "file_bytes": 0}}  # the member's
    assert as_user(users[ADMIN], drop_table, daemon.socket, "first") == ["second"]
    code, out = as_user(users[ADMIN], command, ["--socket", daemon.socket, "drop", "second", "--json"])
    assert code == 0 and '"dropped": "second"' in out, out
    with daemon.connect() as c:
        assert c.list_tables() == []
    code, out = as_user(users[ADMIN], command, ["--socket", daemon.socket, "shutdown"])
    assert code == 0, out
    assert f"shmreplayd pid {daemon.pid} (instance {daemon.instance}) stopped" in out, out
    assert daemon.proc.wait(HANG_S) == 0
    assert "shutdown requested by pid" in daemon.log() and f"(uid {users[ADMIN][0]})" in daemon.log()
