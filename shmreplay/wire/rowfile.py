"""A file-backed table's rows: a file in the table's ``storage_dir``, mapped shared.

The same roles as ``segment.Segment`` (the daemon creates and adopts, a
client attaches), for a table larger than RAM.  What differs from /dev/shm:

* The file is made ``O_CREAT|O_EXCL|O_NOFOLLOW`` in a directory only the
  daemon's user (or root) can write (``server/disk/storage.py`` checks it), so no
  one can plant it first or swap it for a link.
* Its space is reserved with ``posix_fallocate`` after a ``statvfs`` check:
  a full disk is a ``DiskFull`` at create, never a SIGBUS later in a client
  whose store into a hole the filesystem could not fill.
* It is never populated, and never advised onto huge pages: the point is
  that the rows need not fit in memory; pages come and go through the page
  cache, and only what is read or written is resident.

Same ownership rule as segments: every mapping holds the file open, the
descriptor is closed once mapped (the daemon keeps its own, for ``pread``
in checkpoints and for ``set_mode``).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat

import numpy as np

from ..errors import DiskFull, LayoutError, PermissionDenied, ReplayError
from ..schema import TableSpec
from .names import instance_of, storage_names
from .segment import Segment, check_owned, check_size


def disk_free_bytes(directory: str) -> int | None:
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class RowFile(Segment):
    """A mapped rows file.  Not thread-safe; close() once."""

    @classmethod
    def create(cls, path: str, size: int, mode: int = 0o600,
               owner: tuple[int, int] = (-1, -1)) -> "RowFile":
        directory = os.path.dirname(path)
        free = disk_free_bytes(directory)
        if free is not None and size > free:
            raise DiskFull(f"{directory} has {free / 2**30:.2f} GiB free but the rows file "
                           f"{os.path.basename(path)} needs {size / 2**30:.2f} GiB")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            try:
                st = os.lstat(path)
            except OSError:
                st = None
            if st is not None and (st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode)):
                check_owned(path, st, stat.S_IMODE(st.st_mode))  # raises, naming the owner
            meta = meta_name(os.path.basename(path))
            if meta and os.path.lexists(os.path.join(directory, meta)):
                raise ReplayError(
                    f"rows file {path} exists already, with its metadata file {meta} beside it, "
                    "which this start did not adopt (the log says why: durable_file_tables off, "
                    "a file not made by this daemon's user, another table's); fix that, or drop "
                    "the table under a daemon that adopts it, or move both files away") from None
            raise ReplayError(
                f"rows file {path} exists already: another daemon uses it, or a dead one left it "
                f"behind without its metadata (a reboot, an emptied /dev/shm), so it cannot be "
                f"adopted; `shmreplay cleanup --storage-dir {directory}` lists and removes such "
                f"files, or move it away") from None
        except OSError as exc:
            raise ReplayError(f"cannot create rows file {path}: {exc.strerror}") from None
        try:
            os.fchmod(fd, mode)
            if owner != (-1, -1):
                os.fchown(fd, *owner)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise DiskFull(f"{directory} could not reserve {size / 2**30:.2f} GiB for "
                                   f"{os.path.basename(path)}: {os.strerror(exc.errno)}") from exc
                raise
            mm = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            unlink_file_quiet(path)
            raise
        return cls(path, mm, size, fd)

    @classmethod
    def attach(cls, path: str, expected_size: int | None = None,
               read_only: bool = False, map_size: int | None = None, fd: int | None = None) -> "RowFile":
        """A client's mapping of the rows file (``map_size``, ``fd``: as for
        ``Segment.attach``)."""
        flags = (os.O_RDONLY if read_only else os.O_RDWR) | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(path, flags) if fd is None else fd
        except FileNotFoundError:
            raise LayoutError(f"rows file {path} does not exist") from None
        except PermissionError:
            raise PermissionDenied(f"this user may not open the rows file {path}: the daemon's "
                                   "group (segment_mode) must include it") from None
        except OSError as exc:
            raise LayoutError(f"rows file {path} cannot be opened: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            size = st.st_size
            if not stat.S_ISREG(st.st_mode):
                raise LayoutError(f"rows file {path} is not a regular file")
            size = check_size(f"rows file {path}", size, expected_size, map_size)
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ if read_only else
                           mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        # a fault on a page not in the cache reads just that page, not the
        # disk's read-ahead around it (8 MiB here: FACTS.md); the daemon's
        # prefetch brings in whole rows ahead of the faults
        mm.madvise(mmap.MADV_RANDOM)
        return cls(path, mm, size)

    @classmethod
    def open_owned(cls, path: str, mode: int, gid: int = -1, size: int | None = None) -> "RowFile":
        """The daemon's re-opening of a rows file it made (adoption): only a
        regular file of this user with exactly ``mode`` (and group ``gid``);
        ``size``: as for ``Segment.open_owned``."""
        return cls.map_owned(path, Segment.open_owned_fd(path, mode, gid, "rows file",
                                                         empty_ok=size is not None), size)

    def unlink(self) -> None:
        unlink_file_quiet(self.name)


def unlink_file_quiet(path: str) -> None:
    """Remove a file by its path; gone already is fine."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


_LIBC = ctypes.CDLL(None, use_errno=True)


def resident_bytes(seg: Segment) -> int | None:
    """How many bytes of a mapping are in memory now (``mincore``); None if
    it cannot be asked.  Its cost grows with the mapping (a byte per page):
    for ``status``, not for a hot path."""
    try:
        view = np.frombuffer(seg.buf, np.uint8)
        pages = (seg.size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
        vec = np.zeros(pages, np.uint8)
        rc = _LIBC.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(seg.size),
                          ctypes.c_void_p(vec.ctypes.data))
        del view
    except (OSError, AttributeError, ValueError, TypeError):
        return None
    return None if rc != 0 else int(np.count_nonzero(vec & 1)) * mmap.PAGESIZE


def rows_name(meta_name: str) -> str:
    """The rows segment that goes with a meta segment
    (``/shmreplay.<instance>.t.<table>``: the instance has no dot, a table
    name may hold ".t." or ".r." itself)."""
    parts = meta_name.split(".", 3)
    if len(parts) == 4 and parts[2] == "t":
        return f"{parts[0]}.{parts[1]}.r.{parts[3]}"
    return meta_name + ".r"


def meta_name(rows: str) -> str | None:
    """The meta segment of a rows segment or file name (``rows_name``'s
    inverse); None for any other name."""
    parts = rows.split(".", 3)
    return f"{parts[0]}.{parts[1]}.t.{parts[3]}" if len(parts) == 4 and parts[2] == "r" else None


def rows_location(meta_name: str, spec: TableSpec) -> tuple[type[Segment], str]:
    """Where a table's rows live: a /dev/shm segment named like its meta
    segment, or (``storage_dir``) a file of a stable name in that directory
    (``names.storage_names``)."""
    if spec.file_backed:
        return RowFile, os.path.join(spec.storage_dir, storage_names(instance_of(meta_name.lstrip("/")),
                                                                    spec.name)[1])
    return Segment, rows_name(meta_name)
