"""Issue 12: a permitted client (a member of the daemon's group, another
uid) writes whatever it can into every shared object of the instance.  It
may damage rows (they are its to write); it may not change anything the
daemon decides with, cut off another client, or stop the daemon."""

import errno
import os
import tempfile

import pytest

from faults import FIELDS
from people import GROUP, MEMBER, as_user, needs_root, users  # noqa: F401 (a fixture)

pytestmark = needs_root

TABLES = [{"name": "victim", "capacity": 4096, "fields": FIELDS},
          {"name": "shared", "capacity": 256, "fields": FIELDS}]


@pytest.fixture
def daemon(start_daemon, users):
    from pathlib import Path
    sockdir = Path(tempfile.mkdtemp(prefix="shmrsock"))
    os.chmod(sockdir, 0o755)  # other users must reach the socket
    d = start_daemon(tables=TABLES, socket_dir=sockdir, group=GROUP, allowed_groups=[GROUP])
    yield d
    d.stop()
    os.unlink(sockdir / os.path.basename(d.socket)) if os.path.exists(d.socket) else None
    os.rmdir(sockdir)


def instance_objects(instance: str) -> list[str]:
    return sorted(os.path.join("/dev/shm", n) for n in os.listdir("/dev/shm")
                  if f"shmreplay.{instance}." in n)


def try_to_write_meta(path):
    """What a member can do to a table's meta segment."""
    out = {}
    try:
        os.close(os.open(path, os.O_RDWR))
        out["open_rw"] = "allowed"
    except OSError as exc:
        out["open_rw"] = errno.errorcode[exc.errno]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.ftruncate(fd, 0)
        out["truncate"] = "allowed"
    except OSError as exc:
        out["truncate"] = errno.errorcode[exc.errno]
    finally:
        os.close(fd)
    return out


def test_a_member_can_read_but_never_write_the_daemons_metadata(daemon, users):
    meta = f"/dev/shm/shmreplay.{daemon.instance}.t.victim"
    got = as_user(users[MEMBER], try_to_write_meta, meta)
    assert got == {"open_rw": "EACCES", "truncate": "EINVAL"}, got
