"""Who owns the shared objects of an instance, and removing those of dead owners.

Every shared object a daemon makes lives in /dev/shm under its instance
name, and its instance lock in its runtime directory (``wire.names`` lists
them).  A daemon holds an exclusive ``flock`` on the instance lock from before it
makes or adopts anything until after it removed everything.  The kernel
drops the lock when the process dies, however it dies, so "the lock can be
taken" is exactly "no live daemon serves this instance": no pid files that
outlive their process, no pid-reuse guesses.  A second daemon of the same
instance is refused, and ``cleanup`` removes only objects of instances whose
lock is free, holding the lock while it does, so it never races a daemon.

Objects of an instance with no lock file at all (left by a build without
it, or by hand, or the runtime directory was emptied under a live daemon)
count as stale only if the pid in their name, or the owner in a table's
header, is a dead process.  An owner that cannot be read (not a regular file
of this user, a header of another layout) is unknown, and unknown means
kept: cleanup never guesses data away.  With the lock too, only regular
files of this user are removed: what another user planted under the
instance's name is listed and left alone.
"""

from __future__ import annotations

import fcntl
import os
import stat
import time
from dataclasses import dataclass

from ...errors import ForeignObject, ReplayError
from ...wire import headers
from ...wire.names import (SHM_DIR, instance_of, is_table, lock_path, pid_in_name, storage_names,
                           table_of_segment, table_prefix)
from ...wire.peer import process_alive, process_start
from ...wire.rowfile import RowFile, meta_name, rows_location, unlink_file_quiet
from ...wire.segment import check_owned
from .safedir import secure_dir


class InstanceLock:
    """The exclusive claim of one daemon on an instance.  Daemon startup and
    shutdown only; not thread-safe."""

    def __init__(self, instance: str, fd: int, path: str):
        self.instance = instance
        self.fd = fd
        self.path = path

    @classmethod
    def acquire(cls, instance: str, wait_s: float = 2.0) -> "InstanceLock":
        """The lock file lives in the runtime directory (``safedir.secure_dir``
        checks only this user can write it, and every directory above it) and is opened without following
        a symlink and checked to be this user's, so nobody can plant one."""
        path = lock_path(instance)
        secure_dir(os.path.dirname(path))
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                             | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise ForeignObject(f"cannot open the instance lock {path}: {exc.strerror}") from None
            try:
                check_owned(path, os.fstat(fd), 0o600)
            except BaseException:
                os.close(fd)
                raise
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_owner(fd)
                os.close(fd)
                # a cleanup briefly holds the lock of a dead instance: wait it out
                if time.monotonic() < deadline and not process_alive(*holder):
                    time.sleep(0.05)
                    continue
                raise ReplayError(
                    f"instance {instance!r} is served by a live daemon (pid {holder[0]}); "
                    "stop it first, or give this daemon another instance name") from None
            # cleanup may have unlinked the file between our open and flock:
            # then we hold a lock on nothing; open the new one and try again
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {process_start(os.getpid())}\n".encode(), 0)
        return cls(instance, fd, path)

    def release(self) -> None:
        """Unlink, then unlock (by closing): nobody can find a file we no longer hold."""
        unlink_file_quiet(self.path)
        os.close(self.fd)


def _read_owner(fd: int) -> tuple[int, int]:
    try:
        pid, start = os.pread(fd, 64, 0).split()[:2]
        return int(pid), int(start)
    except (OSError, ValueError):
        return 0, 0


@dataclass
class StaleReport:
    instance: str
    owner: int | None      # pid of the live daemon, None if the owner is dead
    objects: list[str]     # file names in /dev/shm
    unknown: bool = False  # owner unknown: kept, for a human to look at


def scan(shm_dir: str = SHM_DIR) -> dict[str, list[str]]:
    """Every shmreplay object in /dev/shm, by instance."""
    out: dict[str, list[str]] = {}
    for name in sorted(os.listdir(shm_dir)):
        inst = instance_of(name)
        if inst is not None:
            out.setdefault(inst, []).append(name)
    return out


def remove_dead_channels(instance: str, shm_dir: str = SHM_DIR) -> int:
    """With the instance lock held: remove the channels and doorbells a dead
    daemon of this instance left.  Only regular files of this user: a name
    someone else planted is none of ours to remove (or follow)."""
    n = 0
    for name in scan(shm_dir).get(instance, []):
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if is_table(name) or st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
            continue
        os.unlink(path)
        n += 1
    return n


def _object_owner(name: str, shm_dir: str = SHM_DIR) -> tuple[int, int] | None:
    """(pid, start) named by an object without an instance lock: the pid in
    a channel's or doorbell's name, the owner in a table's header (a rows
    segment's owner is its meta segment's).  None: unknown (not a regular
    file of this user, or no header this build can read)."""
    if not _mine(os.path.join(shm_dir, name)):
        return None
    if not is_table(name):
        return pid_in_name(name), 0
    meta = os.path.join(shm_dir, meta_name(name) or name)
    if not _mine(meta):
        return None
    try:
        h = headers.meta_header(_pread(meta, 0, headers.HEADER.itemsize))
    except OSError:
        return None
    return None if h is None else headers.owner(h)


def _pread(path: str, offset: int, n: int) -> bytes:
    """``n`` bytes at ``offset`` of ``path`` (no link followed, no FIFO
    waited on).  OSError if they cannot be read whole."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        raw = os.pread(fd, n, offset)
    finally:
        os.close(fd)
    if len(raw) < n:
        raise OSError(f"{path} is shorter than its header")
    return raw


def _rows_file(meta_seg: str, shm_dir: str) -> list[str]:
    """The rows file (and the metadata file beside it, if any) of a
    file-backed table whose meta segment this is, if
    it is a regular file of this user whose header names this meta segment
    (capacity and creation time): [] for a /dev/shm table, or when anything
    cannot be read or does not match.  Never guess a path to remove."""
    try:
        meta = os.path.join(shm_dir, meta_seg)
        h, spec = headers.stored_table(lambda off, n: _pread(meta, off, n), meta)
        kind, path = rows_location("/" + meta_seg, spec)
        if kind is not RowFile or not _mine(path):
            return []
        r = headers.rows_header(_pread(path, 0, headers.ROWS_HEADER.itemsize))
    except Exception:  # unreadable: not ours to interpret
        return []
    if not headers.rows_belong(r, h):
        return []
    # its metadata file (server/disk/durable.py)
    durable = os.path.join(os.path.dirname(path), storage_names(instance_of(meta_seg), spec.name)[0])
    return [path] + ([durable] if _mine(durable) else [])


def orphan_rows_files(storage_dirs, shm_dir: str = SHM_DIR) -> dict[str, list[str]]:
    """Rows files in ``storage_dirs`` whose meta segment is gone (a reboot,
    an emptied /dev/shm) and that have no metadata file beside them (a
    durable table's, which the next start adopts): instance -> absolute
    paths.  Only regular files of this user; nothing could ever adopt them."""
    out: dict[str, list[str]] = {}
    # the tables with a meta segment in /dev/shm (any token; anyone's: a
    # name that looks like a live table's keeps its rows, never removes them)
    live = {(inst, table_of_segment(n)) for inst, ns in scan(shm_dir).items() for n in ns
            if n.startswith(table_prefix(inst))}
    for d in storage_dirs:
        try:
            entries = sorted(os.listdir(d))
        except OSError:
            continue
        for n in entries:
            inst, meta = instance_of(n), meta_name(n)
            if inst and meta and (inst, table_of_segment(meta)) not in live \
                    and not os.path.lexists(os.path.join(d, meta)) and _mine(os.path.join(d, n)):
                out.setdefault(inst, []).append(os.path.join(d, n))
    return out


def _mine(path: str) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def cleanup(dry_run: bool = False, keep_tables: bool = False, only: str | None = None,
            shm_dir: str = SHM_DIR, storage_dirs=()) -> list[StaleReport]:
    """Remove the objects of every instance (or of ``only``) whose daemon is
    dead.  Live instances are listed, never touched.  ``keep_tables`` leaves
    table segments for the next daemon to adopt.  ``storage_dirs``: also
    rows files there whose meta segment is gone (``orphan_rows_files``)."""
    reports = []
    found = scan(shm_dir)
    for inst, paths in orphan_rows_files(storage_dirs, shm_dir).items():
        found.setdefault(inst, []).extend(paths)
    for inst, names in found.items():
        if only is not None and inst != only:
            continue
        lock = lock_path(inst)
        fd = None
        try:
            fd = os.open(lock, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            fd = None  # no lock (or not ours to take): decide by the owners' pids
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                reports.append(StaleReport(inst, _read_owner(fd)[0], names))
                os.close(fd)
                continue
        try:
            names = [n for n in names if not (keep_tables and is_table(n))]
            if fd is not None:  # a dead daemon's, if it made them: planted ones are not ours
                stale = [n for n in names if _mine(os.path.join(shm_dir, n))]
                if unknown := [n for n in names if n not in stale]:
                    reports.append(StaleReport(inst, None, unknown, unknown=True))
            else:  # no lock to go by: each object's owner decides
                # (a rows file without its meta segment names no owner: with
                # no lock, no daemon of its instance is alive to adopt it)
                owners = {n: (0, 0) if n.startswith("/") else _object_owner(n, shm_dir) for n in names}
                stale = [n for n in names if owners[n] is not None and not process_alive(*owners[n])]
                live = [n for n in names if owners[n] is not None and n not in stale]
                unknown = [n for n in names if owners[n] is None]
                if live:
                    reports.append(StaleReport(inst, owners[live[0]][0], live))
                if unknown:
                    reports.append(StaleReport(inst, None, unknown, unknown=True))
            # a file-backed table's rows file goes with its meta segment
            stale += [p for n in stale if ".t." in n for p in _rows_file(n, shm_dir)]
            if stale:
                reports.append(StaleReport(inst, None, stale))
            if not dry_run:
                for n in stale:
                    unlink_file_quiet(os.path.join(shm_dir, n))  # n itself when absolute
                if fd is not None:  # last, while we hold it
                    unlink_file_quiet(lock)
        finally:
            if fd is not None:
                os.close(fd)
    return reports
