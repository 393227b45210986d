"""The bytes of a durable table's metadata file (format 2): two copies, each
written in place in space reserved when the table was made.

    offset 0       copy A: a page of header, then the meta segment's bytes
    offset H       copy B: the same (H = a page + the meta size, page-rounded)

Each copy's header (``HEADER``): magic ``SHMRMETA``, ``VERSION``, a crc32
of the version, sequence number, size and the bytes, the sequence number
(1, 2, ...: sync n goes to copy ``n % 2``), and the bytes' size.  A sync
writes the copy the older sequence number holds, bytes then header, and
``fdatasync``s; a crash in the middle leaves that copy failing its crc and
the other, the sync before, whole.  Reading takes the valid copy with the
highest sequence number.

Why two copies in place, not a new file renamed over the old one: a rename
needs new blocks at every sync, and another user's files may have taken
every free block of a shared storage filesystem; ``reserve`` takes all the
file will ever need with ``posix_fallocate`` when the table is made (a
full disk is ``DiskFull`` then, as for its rows), and a sync writes only
into it.

Format 1 (every build before issue 34) was the meta segment's bytes alone,
rewritten by rename at each sync.  Such a file is read as it is (its one
copy) and ``reserve`` converts it once, when its table is adopted: a new
file of format 2, its space reserved, the old bytes as copy 1, renamed over
the old (that once needs new blocks; a full disk then sets the table aside
with its files kept, saying so).

Executor threads (one sync at a time per table: ``control/syncs.py``) and
startup; every file is opened relative to its checked directory's
descriptor (``safedir``), without following a link, and checked to be a
regular mode-0600 file of the daemon's user before a byte is read or
written.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
import zlib

from ...errors import DiskFull, ForeignObject, LayoutError
from ...wire import headers
from . import safedir

log = logging.getLogger("shmreplayd.durable")

MAGIC = b"SHMRMETA"
VERSION = 2
HEADER = struct.Struct("<8sIIQQ")  # magic, version, crc32, sequence number, size
PAGE = headers.PAGE
FILE_MODE = 0o600  # clients read the meta segment, never this file


def half(meta_size: int) -> int:
    """The bytes one copy takes: its header page and the meta bytes, page-rounded."""
    return PAGE + -(-meta_size // PAGE) * PAGE


def file_size(meta_size: int) -> int:
    return 2 * half(meta_size)


def _crc(seq: int, data) -> int:
    return zlib.crc32(data, zlib.crc32(struct.pack("<IQQ", VERSION, seq, len(data))))


def _copy(data: bytes, off: int, limit: int) -> tuple[int, memoryview] | None:
    """(sequence number, bytes) of the copy at ``off``, None unless whole."""
    if off + PAGE > len(data):
        return None
    magic, version, crc, seq, size = HEADER.unpack_from(data, off)
    if magic != MAGIC or version != VERSION or seq == 0 or size > limit:
        return None
    body = memoryview(data)[off + PAGE:off + PAGE + size]
    if len(body) != size or _crc(seq, body) != crc:
        return None
    return seq, body


def newest(data: bytes) -> tuple[int, bytes] | None:
    """The newest whole copy a format-2 file's bytes hold, as (sequence
    number, bytes); None if neither copy is whole (nothing synced yet).
    LayoutError if ``data`` is no format-2 file."""
    h = len(data) // 2
    if len(data) % (2 * PAGE) or h < PAGE:
        raise LayoutError(f"not a metadata file of format {VERSION} ({len(data)} bytes)")
    found = [c for c in (_copy(data, 0, h - PAGE), _copy(data, h, h - PAGE)) if c is not None]
    if not found:
        return None
    seq, body = max(found, key=lambda c: c[0])
    return seq, bytes(body)


def is_format_1(data: bytes) -> bool:
    """A file of the builds before format 2: the meta segment's bytes."""
    return len(data) >= PAGE and headers.meta_header(data) is not None


def payload(data: bytes, path: str) -> bytes:
    """The meta bytes of the newest sync a file's bytes hold (either format)."""
    if is_format_1(data):
        return data
    got = newest(data)
    if got is None:
        raise LayoutError(f"metadata file {path} holds no complete sync (its table was made, and "
                          "never synced, before the daemon stopped)")
    return got[1]


def _open(dfd: int, base: str, path: str, flags: int) -> int:
    """``base`` in ``dfd``: a regular mode-0600 file of the daemon's user,
    opened without following a link; else ForeignObject (nothing read)."""
    try:
        fd = os.open(base, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ForeignObject(f"metadata file {path} cannot be opened ({exc.strerror}); left alone") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != FILE_MODE:
        os.close(fd)
        raise ForeignObject(f"metadata file {path} is not a mode-0600 file of the daemon's user "
                            f"(uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); left alone")
    return fd


def read_all(fd: int) -> bytes:
    chunks, size = [], os.fstat(fd).st_size
    while size > 0:
        b = os.read(fd, min(size, 1 << 24))
        if not b:
            break
        chunks.append(b)
        size -= len(b)
    return b"".join(chunks)


def read(dfd: int, base: str, path: str) -> bytes:
    """The whole file (checked as ``_open`` says)."""
    fd = _open(dfd, base, path, os.O_RDONLY)
    try:
        return read_all(fd)
    finally:
        os.close(fd)


def reserve(dfd: int, base: str, path: str, meta_size: int, tmp: str, fresh: bool) -> int:
    """Make sure ``base`` is a format-2 file for ``meta_size`` bytes with all
    its space reserved; returns the newest whole copy's sequence number (0:
    none).  ``fresh`` (a table just made, not adopted): any file there is
    an older table's and is replaced by an empty one, unread.  Else a file
    of that form is kept as it is; a missing one, or one that is not the
    daemon's (logged), is replaced by an empty one; a
    format-1 file, or one for another size, is replaced by one that holds
    its newest bytes (if they are ``meta_size`` long) as copy 1.  The new
    file is written as ``tmp`` (``O_EXCL``), fsynced and renamed, so a
    crash leaves the old.  DiskFull if the filesystem has no room."""
    keep, data = None, None
    try:
        data = None if fresh else read(dfd, base, path)
    except FileNotFoundError:
        pass
    except ForeignObject as exc:  # as a sync of earlier builds did: the live table is in /dev/shm
        log.error("%s; the table is served from its live meta segment, and a new metadata file "
                  "is renamed over that name", exc)
    if data is not None:
        if not is_format_1(data) and len(data) == file_size(meta_size):
            got = newest(data)
            return 0 if got is None else got[0]
        try:
            keep = payload(data, path)
        except LayoutError:
            keep = None
        if keep is not None and len(keep) != meta_size:
            log.warning("metadata file %s holds %d bytes, not the table's %d; replaced by an empty one",
                        path, len(keep), meta_size)
            keep = None
        log.info("metadata file %s: converting to format %d (space reserved, copies written in place)",
                 path, VERSION)
    safedir.remove(dfd, tmp, os.path.dirname(path))  # a dead daemon's half-made file
    fd = safedir.create_file(dfd, tmp)
    try:
        os.fchmod(fd, FILE_MODE)
        try:
            os.posix_fallocate(fd, 0, file_size(meta_size))
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise DiskFull(f"{os.path.dirname(path)} could not reserve {file_size(meta_size)} bytes "
                               f"for the metadata file {base}: {os.strerror(exc.errno)}; free room on "
                               "that disk") from None
            raise
        if keep is not None:
            write_copy(fd, keep, 1)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        safedir.remove(dfd, tmp, os.path.dirname(path))
        raise
    os.close(fd)
    os.rename(tmp, base, src_dir_fd=dfd, dst_dir_fd=dfd)
    os.fsync(dfd)
    return 0 if keep is None else 1


def write_copy(fd: int, data, seq: int) -> None:
    """Copy ``seq % 2`` := ``data`` as sync ``seq``: the bytes, then the
    header that makes them whole, each in place (no new block)."""
    off = (seq % 2) * half(len(data))
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], off + PAGE + done)
    os.pwrite(fd, HEADER.pack(MAGIC, VERSION, _crc(seq, view), seq, len(view)), off)


def write(dfd: int, base: str, path: str, data, seq: int) -> None:
    """Sync ``seq``'s bytes into the file ``reserve`` made, and ``fdatasync``."""
    fd = _open(dfd, base, path, os.O_WRONLY)
    try:
        size = os.fstat(fd).st_size
        if size != file_size(len(data)):
            raise ForeignObject(f"metadata file {path} is {size} bytes, not the {file_size(len(data))} "
                                "its table reserved; left alone")
        write_copy(fd, data, seq)
        os.fdatasync(fd)
    finally:
        os.close(fd)
