"""Directories the daemon writes in: checked, made, and walked without following a link.

Every directory the daemon creates files in or removes files from goes
through here: a table's ``storage_dir`` (rows files and durable metadata
files: storage.py, durable.py), checkpoint directories (``checkpoint_dir``,
``shmreplay checkpoint --to``, ``--restore``: checkpoint.py, ckread.py) and
the runtime directory (the instance lock and the default socket:
ownership.py, control/server.py).  Any local user may create a missing
directory, or any name in /tmp, first, and plant links in what they made;
a root daemon that followed one would write, chmod or delete files
anywhere.  So a directory is:

* **checked**: its path is walked from / one component at a time, each
  opened ``O_PATH|O_NOFOLLOW`` relative to the one before and checked
  through that descriptor: a real directory (not a link: configure the
  real path), owned by root or the daemon's user, and writable by no one
  else, except for a sticky ancestor such as /tmp (whose entries only
  their owner may rename or remove; never the directory itself).  The
  caller gets a descriptor of the last one and works relative to it, so
  nothing can be swapped between the check and the use;
* **made**: a missing component is made 0700 by the daemon, then given
  its mode and group through its descriptor, whatever the umask;
* **walked without following a link**: entries are looked at with
  ``fstatat(AT_SYMLINK_NOFOLLOW)``, opened ``O_NOFOLLOW`` and removed with
  ``unlinkat``/``rmdir`` relative to their directory's descriptor; only
  regular files and directories of the daemon's user are removed or read,
  anything else is logged and left.

An unsafe directory is a ``ForeignObject`` naming the component, what is
wrong with it and what to do.  Who may call: the other modules of
``server/disk`` and ``server/control``, on executor threads or at
startup; there is no state.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
from dataclasses import dataclass

from ...errors import ForeignObject, ReplayError

log = logging.getLogger("shmreplayd.paths")

_WALK = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC  # no read permission needed to pass through
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO must not block us
MAX_DEPTH = 8  # removal descends no deeper: checkpoints are one level


@dataclass(frozen=True)
class Place:
    """What a directory is for, in the words its errors use."""
    what: str    # "is not a safe place for <what>"
    label: str   # what the config or command line calls it
    risk: str    # what anyone who can write there could do
    hint: str    # where to put it instead


ROWS = Place("tables' rows files", "storage_dir",
             "take a rows file's name first or swap the directory", "StateDirectory= in the unit")
CHECKPOINTS = Place("checkpoints", "checkpoint directory",
                    "plant links that pruning would follow, swap the directory, or read every row",
                    "StateDirectory= in the unit")
RUNTIME = Place("a lock or socket", "directory", "take the name first",
                "$XDG_RUNTIME_DIR, or RuntimeDirectory= in the unit")


def dir_mode(file_mode: int) -> int:
    """A directory for files of ``file_mode``: the same bits, plus search
    for whoever may read them (0640 -> 0750)."""
    m = file_mode & 0o777
    return m | ((m & 0o444) >> 2)


def _ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid()


def _what(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return f"a symlink of uid {st.st_uid}"
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return f"neither a file nor a directory (mode {st.st_mode:o}, uid {st.st_uid})"
    return f"owned by uid {st.st_uid}"


def open_dir(path: str, place: Place, make: tuple[int, int] | None = None,
             missing_ok: bool = False) -> int | None:
    """A descriptor (``O_RDONLY|O_DIRECTORY``) of ``path`` once every
    component passed the checks (module docstring); the caller closes it.
    ``make=(mode, gid)``: missing components are made and given them.
    Otherwise a missing one is a ReplayError, or None if ``missing_ok``."""
    if not os.path.isabs(path):
        raise ReplayError(f"{place.label} {path!r} must be an absolute path")
    norm = os.path.normpath(path)
    parts = [p for p in norm.split("/") if p]
    fd = os.open("/", _WALK | os.O_DIRECTORY)
    try:
        _check(fd, "/", norm, place, leaf=not parts)
        for i, name in enumerate(parts):
            p = "/" + "/".join(parts[:i + 1])
            nxt = _step(fd, name, p, norm, place, make)
            os.close(fd)
            fd = nxt
            if fd is None:
                if missing_ok:
                    return None
                raise ReplayError(f"{place.label} {norm}: {p} does not exist")
            _check(fd, p, norm, place, leaf=i == len(parts) - 1)
        return os.open(".", _DIR, dir_fd=fd)
    finally:
        if fd is not None:
            os.close(fd)


@contextlib.contextmanager
def opened(path: str, place: Place, make: tuple[int, int] | None = None, missing_ok: bool = False):
    """``open_dir`` as a context: the descriptor (or None) is closed after."""
    fd = open_dir(path, place, make, missing_ok)
    try:
        yield fd
    finally:
        if fd is not None:
            os.close(fd)


def check_dir(path: str, place: Place) -> str:
    """Raise unless ``path`` exists and passes the checks; return it."""
    with opened(path, place):
        return path


def _step(pfd: int, name: str, p: str, norm: str, place: Place, make) -> int | None:
    """The next component, opened without following it; made if missing
    and ``make``; None if missing otherwise."""
    for _ in range(2):  # made by someone else between our look and our mkdir: look again
        try:
            return os.open(name, _WALK, dir_fd=pfd)
        except FileNotFoundError:
            if make is None:
                return None
        except OSError as exc:
            raise ReplayError(f"{place.label} {norm}: {p}: {exc.strerror}") from None
        try:
            os.mkdir(name, 0o700, dir_fd=pfd)
        except FileExistsError:
            continue
        except OSError as exc:
            raise ReplayError(f"cannot create {place.label} {norm}: {p}: {exc.strerror}") from None
        fd = os.open(name, _WALK, dir_fd=pfd)
        try:
            st = os.fstat(fd)
            if not (stat.S_ISDIR(st.st_mode) and _ours(st)):
                raise ForeignObject(f"{p}, which the daemon just made, was swapped for something "
                                    f"{_what(st)}; not using it")
            set_mode(fd, *make)
        except BaseException:
            os.close(fd)
            raise
        log.info("made %s %s (mode %04o)", place.label, p, make[0])
        return fd
    raise ReplayError(f"{place.label} {norm}: {p} keeps appearing and disappearing; not using it")


def _check(fd: int, p: str, norm: str, place: Place, leaf: bool) -> None:
    st = os.fstat(fd)
    if stat.S_ISLNK(st.st_mode) and st.st_uid in (0, os.geteuid()):
        raise ForeignObject(f"{place.label} {norm} goes through a symlink; configure its real path "
                            f"{os.path.realpath(norm)} ({p} is a symlink)")
    sticky = bool(st.st_mode & stat.S_ISVTX) and not leaf
    problems = []
    if stat.S_ISLNK(st.st_mode):
        problems.append("a symlink")
    elif not stat.S_ISDIR(st.st_mode):
        problems.append("not a directory")
    if st.st_uid not in (0, os.geteuid()):
        problems.append(f"owned by uid {st.st_uid}")
    if st.st_mode & 0o022 and not sticky and not stat.S_ISLNK(st.st_mode):
        problems.append(f"writable by others (mode {stat.S_IMODE(st.st_mode):04o})")
    if problems:
        raise ForeignObject(
            f"{p} is not a safe place for {place.what}: {', '.join(problems)}; anyone who can "
            f"write there could {place.risk}.  Use a directory only the daemon's user can write "
            f"(e.g. {place.hint})")


def set_mode(fd: int, mode: int, gid: int = -1) -> None:
    """Group, then mode (a chown may clear bits), through a descriptor of
    something the daemon made: exactly ``mode``, whatever the umask."""
    if stat.S_ISDIR(os.fstat(fd).st_mode):  # O_PATH descriptors take neither call
        fd = os.open(".", _DIR, dir_fd=fd)
    else:
        fd = os.dup(fd)
    try:
        os.fchown(fd, -1, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def make_subdir(dfd: int, name: str) -> int:
    """A new directory ``name`` in ``dfd`` (0700 until the caller gives it
    its mode), opened; FileExistsError if the name is taken."""
    os.mkdir(name, 0o700, dir_fd=dfd)
    fd = os.open(name, _DIR, dir_fd=dfd)
    st = os.fstat(fd)
    if not _ours(st):  # only the daemon's user can write dfd: cannot happen, and must not
        os.close(fd)
        raise ForeignObject(f"the directory {name} the daemon just made is {_what(st)}")
    return fd


def open_subdir(dfd: int, name: str, where: str) -> int:
    """An existing directory ``name`` of the daemon's user in ``dfd``,
    opened without following a link; ForeignObject if it is anything else."""
    try:
        fd = os.open(name, _DIR, dir_fd=dfd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # a link, or not a directory
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            raise ForeignObject(f"{where}/{name} is not a directory the daemon made "
                                f"({_what(st)}); left alone") from None
        raise
    st = os.fstat(fd)
    if not _ours(st):
        os.close(fd)
        raise ForeignObject(f"{where}/{name} is not a directory the daemon made ({_what(st)}); "
                            "left alone")
    return fd


def create_file(dfd: int, name: str) -> int:
    """A new file ``name`` in ``dfd``, mode 0600 until the caller gives it
    its mode: never an existing name, never through a link."""
    return os.open(name, _NEW, 0o600, dir_fd=dfd)


def open_file(dfd: int, name: str, where: str) -> int:
    """A regular file of the daemon's user, opened read-only without
    following a link; anything else is ForeignObject and is not read.
    FileNotFoundError if there is none."""
    try:
        fd = os.open(name, _READ, dir_fd=dfd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a symlink
            raise ForeignObject(f"{where}/{name} is a symlink; not read") from None
        raise
    st = os.fstat(fd)
    if not (stat.S_ISREG(st.st_mode) and _ours(st)):
        os.close(fd)
        raise ForeignObject(f"{where}/{name} is not a file the daemon made ({_what(st)}); not read")
    return fd


def entry(dfd: int, name: str) -> os.stat_result | None:
    """``name`` in ``dfd`` as it is, a link not followed; None if absent."""
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def is_ours(st: os.stat_result | None, kind=stat.S_ISDIR) -> bool:
    """Is ``st`` a directory (or ``kind``) of the daemon's user?"""
    return st is not None and kind(st.st_mode) and _ours(st)


def remove(dfd: int, name: str, where: str, depth: int = 0) -> bool:
    """Remove ``name`` from directory ``dfd`` (``where`` names it in the
    log) if it is a regular file or a directory of the daemon's user, a
    directory with all it holds; anything else, here or inside, is logged
    and left (and so is the directory holding it).  True if it is gone."""
    st = entry(dfd, name)
    if st is None:
        return True
    if not (_ours(st) and (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode))):
        log.warning("left %s/%s alone: %s, not a file or directory of the daemon's user",
                    where, name, _what(st))
        return False
    try:
        if stat.S_ISREG(st.st_mode):
            os.unlink(name, dir_fd=dfd)  # unlinkat: a link swapped in meanwhile goes, not its target
            return True
        if depth >= MAX_DEPTH:
            log.warning("left %s/%s alone: nested deeper than a checkpoint is", where, name)
            return False
        sub = os.open(name, _DIR, dir_fd=dfd)
        try:
            now = os.fstat(sub)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                log.warning("left %s/%s alone: it changed while it was being removed", where, name)
                return False
            inside = [remove(sub, e, f"{where}/{name}", depth + 1) for e in os.listdir(sub)]
        finally:
            os.close(sub)
        if all(inside):
            os.rmdir(name, dir_fd=dfd)
        return all(inside)
    except OSError as exc:
        log.warning("could not remove %s/%s: %s", where, name, exc.strerror)
        return False


def secure_dir(path: str) -> str:
    """The runtime directory (or a configured socket's): checked, made
    0700 if missing (the lock and the default socket live there)."""
    with opened(path, RUNTIME, make=(0o700, -1)):
        return path
