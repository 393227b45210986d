"""Where a file-backed table's rows file may go (``storage_dir``).

The daemon creates rows files only in directories its config names
(``DaemonConfig.place``), and only in a directory no other user could swap
or write into: safedir.py's rule, which every directory the daemon writes
in follows (every component a real directory of root or the daemon's user,
writable by no one else but for a sticky ancestor such as /tmp).
Otherwise someone could take a rows file's name first, or replace the
directory with a link between the check and the create, and make a root
daemon write or chown files elsewhere.  A missing directory is made 0750,
group the daemon's ``group`` (set through the descriptor, whatever the
umask), so the clients that may map tables can reach the files.  A
copy-on-write filesystem (btrfs, ZFS, bcachefs) is refused: there
``posix_fallocate`` does not reserve the space an overwrite needs, so a
full disk would be a SIGBUS in a writer instead of ``DiskFull`` at create.
Runs on the control plane's executor threads.
"""

from __future__ import annotations

import os

from ...errors import ReplayError
from . import safedir

DIR_MODE = 0o750  # clients of the group search it; only the daemon writes in it


def prepare_dir(path: str, gid: int = -1) -> str:
    """Check ``path`` (see the module docstring), making it if it is
    missing; return it."""
    with safedir.opened(path, safedir.ROWS, make=(DIR_MODE, gid)):
        pass
    fs = fs_type(path)
    if fs in COPY_ON_WRITE:
        raise ReplayError(f"storage_dir {path} is on {fs}, a copy-on-write filesystem: a "
                          "reservation there does not cover overwrites, so a full disk would "
                          "kill a writer with SIGBUS instead of failing at create; use ext4 or xfs")
    return path


COPY_ON_WRITE = frozenset({"btrfs", "zfs", "bcachefs"})


def fs_type(path: str, mountinfo: str | None = None) -> str | None:
    """The type of the filesystem ``path`` is on: the mount whose mount
    point is the longest prefix of it in ``mountinfo`` (default: this
    process's /proc/self/mountinfo); None if it cannot be told."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo") as f:
                mountinfo = f.read()
        except OSError:
            return None
    path = os.path.normpath(path)
    best, kind = -1, None
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = fields[4].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) > best:
            best, kind = len(point), right.split()[0]
    return kind


def check_dir(path: str) -> str:
    """Raise ForeignObject unless every component of ``path`` is safe
    (``safedir``); a missing one is a ReplayError."""
    return safedir.check_dir(path, safedir.ROWS)
