"""Where a file-backed table's rows file may go (``storage_dir``).

The daemon creates rows files only in directories its config names
(``DaemonConfig.place``), and only in a directory no other user could swap
or write into: every component of its path must be a real directory (no
symlink: configure the real path), owned by root or the daemon's user, and
writable by no one else, except for a sticky ancestor such as /tmp (whose
entries only their owner may rename).  Otherwise someone could take a rows
file's name first, or replace the directory with a link between the check
and the create, and make a root daemon write or chown files elsewhere.  A
missing last component is made 0750, group the daemon's ``group`` (set
through the descriptor, whatever the umask), so the clients that may map
tables can reach the files.  A copy-on-write filesystem (btrfs, ZFS,
bcachefs) is refused: there ``posix_fallocate`` does not reserve the space
an overwrite needs, so a full disk would be a SIGBUS in a writer instead of
``DiskFull`` at create.  Runs on the control plane's executor threads.
"""

from __future__ import annotations

import os
import stat

from ...errors import ForeignObject, ReplayError


def prepare_dir(path: str, gid: int = -1) -> str:
    """Check ``path`` (see the module docstring), making its last component
    if it is missing; return it."""
    check_dir(os.path.dirname(path) or "/", leaf=False)
    try:
        os.mkdir(path, 0o700)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fchown(fd, -1, gid)
            os.fchmod(fd, 0o750)
        finally:
            os.close(fd)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ReplayError(f"cannot create storage_dir {path}: {exc.strerror}") from None
    check_dir(path)
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


def check_dir(path: str, leaf: bool = True) -> str:
    """Raise ForeignObject unless every component of ``path`` is safe."""
    if os.path.realpath(path) != os.path.normpath(path):
        raise ForeignObject(f"storage_dir {path} goes through a symlink; configure its real path "
                            f"{os.path.realpath(path)}")
    parts = os.path.normpath(path).split("/")
    for i in range(1, len(parts)):
        p = "/".join(parts[:i + 1]) or "/"
        try:
            st = os.lstat(p)
        except OSError as exc:
            raise ReplayError(f"storage_dir {path}: {p}: {exc.strerror}") from None
        sticky = bool(st.st_mode & stat.S_ISVTX) and not (leaf and p == path)
        problems = []
        if not stat.S_ISDIR(st.st_mode):
            problems.append("not a directory")
        if st.st_uid not in (0, os.geteuid()):
            problems.append(f"owned by uid {st.st_uid}")
        if st.st_mode & 0o022 and not sticky:
            problems.append(f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})")
        if problems:
            raise ForeignObject(
                f"{p} is not a safe place for tables' rows files: {', '.join(problems)}; anyone who "
                "can write there could take a rows file's name first or swap the directory.  Use a "
                "directory only the daemon's user can write (e.g. StateDirectory= in the unit)")
    return path
