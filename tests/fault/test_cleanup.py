"""Promise 4: ``shmreplay cleanup`` removes what dead daemons left and
never touches a live daemon's objects."""

import os
import subprocess
import sys

import numpy as np
import posix_ipc
import pytest

from shmreplay.wire.names import lock_path

from conftest import shm_entries, table_objects
from faults import FIELDS, rows

TABLE = [{"name": "t", "capacity": 16, "fields": FIELDS}]


def cleanup(*args):
    run = subprocess.run([sys.executable, "-m", "shmreplay.cli", "cleanup", *args],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_cleanup_removes_only_what_dead_daemons_left(start_daemon):
    live = start_daemon(tables=TABLE)
    dead = start_daemon(tables=TABLE)
    with dead.connect() as c:
        c.table("t").insert_batch(rows(np.arange(4)))
        c.flush()
    dead.crash()
    left = shm_entries(f"shmreplay.{dead.instance}.")
    assert len(left) == 2  # the table's meta and rows segments (channels have no names)
    assert os.path.exists(lock_path(dead.instance))  # in the runtime directory
    # an object of an instance with no lock whose creator pid is dead
    orphan = f"/shmreplay.{dead.instance}z.999999999.c1"
    posix_ipc.SharedMemory(orphan, posix_ipc.O_CREX, size=4096).close_fd()
    mine = shm_entries(f"shmreplay.{live.instance}.")

    out = cleanup("--dry-run", "--instance", live.instance)
    assert f"live daemon pid {live.pid}" in out
    out = cleanup("--dry-run", "--instance", dead.instance)
    assert "would remove 2 object(s)" in out
    assert shm_entries(f"shmreplay.{dead.instance}.") == left

    out = cleanup("--keep-tables", "--instance", dead.instance)
    assert table_objects(dead.instance) == {"t.t", "r.t"}
    dead.start()  # the kept table is adopted
    with dead.connect() as c:
        assert len(c.table("t")) == 4
    dead.crash()
    for inst in (live.instance, dead.instance, dead.instance + "z"):
        cleanup("--instance", inst)
    assert shm_entries(f"shmreplay.{dead.instance}.") == set()
    assert not os.path.exists(lock_path(dead.instance))
    assert shm_entries(f"shmreplay.{dead.instance}z.") == set()
    assert shm_entries(f"shmreplay.{live.instance}.") == mine  # never touched
    with live.connect() as c:
        c.table("t").insert(**{k: v[0] for k, v in rows([1]).items()})
        c.flush()
    dead.start()  # empty again: its table was removed
    with dead.connect() as c:
        assert len(c.table("t")) == 0


def test_cleanup_keeps_what_a_live_owner_holds_even_without_a_lock(start_daemon):
    """With no lock file to go by (someone emptied the runtime directory
    under a running daemon), cleanup decides by the owner each object names:
    a live daemon's tables and an object named by a live pid are kept, and
    so is a table-named segment whose header names no owner (unknown is
    never taken for dead)."""
    d = start_daemon(tables=TABLE)
    with d.connect() as c:
        c.table("t").insert_batch(rows(np.arange(4)))
        c.flush()
    tables = shm_entries(f"shmreplay.{d.instance}.")
    os.unlink(lock_path(d.instance))
    orphan = f"/shmreplay.{d.instance}y.{os.getpid()}.c1"  # this test's pid: alive
    posix_ipc.SharedMemory(orphan, posix_ipc.O_CREX, size=4096).close_fd()
    junk = f"/shmreplay.{d.instance}y.t.junk"  # zeros: no magic, no owner
    posix_ipc.SharedMemory(junk, posix_ipc.O_CREX, size=4096).close_fd()
    try:
        out = cleanup("--instance", d.instance)
        assert f"instance {d.instance}: live daemon pid {d.pid}, kept 2 object(s)" in out, out
        out = cleanup("--instance", d.instance + "y")
        assert f"live daemon pid {os.getpid()}, kept 1 object(s)" in out, out
        assert f"owner unknown (not a file of this user, or a header of another layout), " \
               f"kept 1 object(s): {junk[1:]}" in out, out
        assert shm_entries(f"shmreplay.{d.instance}.") == tables
        assert os.path.exists(f"/dev/shm{orphan}") and os.path.exists(f"/dev/shm{junk}")
    finally:
        posix_ipc.unlink_shared_memory(orphan)
        posix_ipc.unlink_shared_memory(junk)
    with d.connect() as c:
        assert len(c.table("t")) == 4


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a file to another user")
def test_cleanup_with_the_lock_leaves_what_another_user_planted(start_daemon):
    """A dead daemon's lock is free, so cleanup removes its objects; an
    object another user planted under the same instance name is not the
    dead daemon's, and is listed and left alone."""
    d = start_daemon(tables=TABLE)
    d.crash()
    name = f"shmreplay.{d.instance}.t.planted"
    planted = os.path.join("/dev/shm", name)
    with open(planted, "wb") as f:
        f.write(b"\0" * 4096)
    os.chown(planted, 65534, 65534)
    try:
        out = cleanup("--instance", d.instance)
        assert "owner dead, removed 2 object(s)" in out, out
        assert f"owner unknown (not a file of this user, or a header of another layout), " \
               f"kept 1 object(s): {name}" in out, out
        assert shm_entries(f"shmreplay.{d.instance}.") == {name}
    finally:
        os.unlink(planted)
