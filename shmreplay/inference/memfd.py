"""The inference channel's memfd: making it, its address, and an env's opening of it.

A channel (``layout.py`` has its bytes) is one memfd the learner
process (the server) makes (``create_channel``): mode 0600, its pages
reserved, sealed against shrinking and growing (``F_SEAL_SHRINK |
F_SEAL_GROW | F_SEAL_SEAL``) before it is mapped, so no process, the
server's own user included, can ever truncate it under a mapping (a
SIGBUS).  It has no name in /dev/shm, nor anywhere else: its address is
the server's descriptor of it, ``/proc/<server pid>/fd/<fd>#<token>``
(``address``), which the kernel lets only processes that may read the
server's memory open (its own user, or root).  The token, 64 random bits
in 16 hex digits, is also header word 13 (``H_TOKEN``), so an env tells
the channel from whatever object that descriptor number holds later:
``open_channel`` reads the header with ``pread`` and refuses such an
object before anything is mapped.

Pure functions; any thread.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import pwd
import re
import secrets
import stat

from ..errors import InferenceClosed, LayoutError, PermissionDenied, ShmFull
from ..wire.segment import prefault
from .layout import HEADER_BYTES, H_TOKEN

MAX_PREFIX = 200   # a memfd's name: at most 249 bytes
DEFAULT_LABEL = "shmreplay.inf"
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW  # what an env requires: the size cannot change
_PREFIX = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_ADDRESS = re.compile(r"/proc/([1-9][0-9]{0,6})/fd/([0-9]{1,9})#([0-9a-f]{16})")


def channel_label(prefix: str | None) -> str:
    """A new channel's memfd name (``DEFAULT_LABEL`` for None): only a label
    in /proc/<pid>/maps and fd links, which nobody can open it by."""
    prefix = DEFAULT_LABEL if prefix is None else prefix
    if not isinstance(prefix, str) or len(prefix) > MAX_PREFIX or not _PREFIX.fullmatch(prefix):
        raise ValueError(f"prefix {prefix!r}: use at most {MAX_PREFIX} letters, digits, '_', '.' "
                         "or '-' (no '/'), e.g. 'shmreplay.inf.myrun'")
    return prefix


def new_token() -> int:
    """The address's token: 64 random bits, never 0 (a word nobody set)."""
    return secrets.randbits(64) or 1


def address(pid: int, fd: int, token: int) -> str:
    return f"/proc/{pid}/fd/{fd}#{token:016x}"


def check_address(addr) -> tuple[int, int, int]:
    """(server pid, descriptor, token) of an address; ValueError if it is none."""
    m = _ADDRESS.fullmatch(addr) if isinstance(addr, str) else None
    if m is None:
        raise ValueError(f"{addr!r} is not an inference channel's address: pass the InferenceServer's "
                         ".address (a str such as '/proc/123/fd/7#<16 hex digits>')")
    return int(m[1]), int(m[2]), int(m[3], 16)


def create_channel(label: str, size: int) -> tuple[int, mmap.mmap]:
    """(descriptor, mapping) of a new channel of ``size`` bytes: a memfd of
    this user, mode 0600, its pages reserved, sealed so that its size can
    never change (nor its seals) before it is mapped, then populated."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        try:
            os.posix_fallocate(fd, 0, size)  # all pages now, or ENOSPC/ENOMEM now, not SIGBUS later
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                raise ShmFull(f"no memory for an inference channel of {size / 2**20:.1f} MiB: "
                              f"{os.strerror(exc.errno)}; use fewer slots or smaller fields") from exc
            raise
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
        mm = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    prefault(mm, write=True)
    return fd, mm


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def _gone(addr: str, why: str) -> InferenceClosed:
    return InferenceClosed(f"no inference channel at {addr}: {why}; its server closed or sealed it "
                           "(a sealed channel takes no new envs), or died")


def _process_uid(pid: int) -> int | None:
    """The effective uid of process ``pid`` (/proc/<pid>/status, which anyone
    may read; /proc/<pid> itself reads as root's while it is not dumpable)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[2])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _refused(addr: str, pid: int, owner: int | None) -> PermissionDenied:
    me = _user(os.geteuid())
    if owner is not None and owner != os.geteuid():
        return PermissionDenied(
            f"{addr} is a descriptor of process {pid} of {_user(owner)} and this process runs as {me}: "
            "an inference channel is private to the user of its InferenceServer; run the env "
            "processes as the learner's user (InferenceClient never uses another user's channel)")
    if owner is None:  # its status unreadable too (/proc mounted hidepid=1)
        return PermissionDenied(
            f"{addr}: the kernel does not let {me} open the descriptors of process {pid} (another "
            "user's, or not dumpable); run the env processes as the learner's user, and keep the "
            "learner dumpable")
    return PermissionDenied(
        f"{addr}: the kernel does not let {me} open the descriptors of process {pid} (it is not "
        "dumpable: prctl(PR_SET_DUMPABLE, 0), or it changed its user); keep the learner dumpable, "
        "or run the env processes as its user")


def open_channel(addr: str) -> mmap.mmap:
    """An env's mapping of the channel at ``addr``, once it is checked to be
    one: a regular file whose header carries the address's token (checked
    by reading, before anything is mapped), this user's, sealed against
    shrinking and growing (only a memfd can be)."""
    pid, n, token = check_address(addr)
    path = f"/proc/{pid}/fd/{n}"
    try:
        st = os.stat(path)  # the target, unopened: a FIFO or a device is never opened
        if not stat.S_ISREG(st.st_mode):
            raise _gone(addr, "that descriptor holds no file now")
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise _gone(addr, f"process {pid} has no descriptor {n}") from None
    except PermissionError:
        raise _refused(addr, pid, _process_uid(pid)) from None
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino):
            raise _gone(addr, "its descriptor changed while this env opened it")
        h = os.pread(fd, HEADER_BYTES, 0)
        if len(h) < HEADER_BYTES or int.from_bytes(h[H_TOKEN * 8:H_TOKEN * 8 + 8], "little") != token:
            raise _gone(addr, f"descriptor {n} of process {pid} holds another object now (not its token)")
        if fst.st_uid != os.geteuid():  # only root gets this far with another user's
            raise _refused(addr, pid, fst.st_uid)
        try:
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        except OSError:
            seals = 0  # a file that cannot be sealed: no memfd
        if seals & SEALS != SEALS:
            raise LayoutError(f"{addr} is not sealed against shrinking and growing (seals {seals:#x}): "
                              "not a channel an InferenceServer made, and its size could change under "
                              "this env's mapping; refused")
        return mmap.mmap(fd, fst.st_size)
    finally:
        os.close(fd)
