"""POSIX shared-memory segments: create (reserved up front), attach, unlink.

Creation uses O_CREX, so a leftover segment of the same name is an error
rather than silently shared, and reserves every page with
``posix_fallocate``: on tmpfs that either allocates the whole size or fails
with ENOSPC now, instead of a SIGBUS in some client hours later.  A statvfs
check first turns the obvious case (far too big) into an instant error
without making the kernel allocate and free gigabytes.

The creator then zeroes every page (``MADV_POPULATE_WRITE``) and every
attaching process maps them all (``MADV_POPULATE_READ``), so no insert or
gather ever takes a page fault.  Measured on this VM with a 2.8 GB ring of
28 KB rows: the first pass of writes over a ring left to fault page by page
ran at 70-95k rows/s (one ~1.5-2 us write fault per 4 KiB page); after the
two populates it ran at 540-840k rows/s.  A read populate maps 16 pages per
fault (the kernel's fault-around), which per-page write faults never do, so
it costs a client 0.23 s per 2.8 GB at attach instead of seconds mid-run.

The file descriptor is closed right after mapping; the mapping keeps the
segment alive until it is unmapped, even after unlink.  Mappings are never
closed explicitly (``Segment.close``): the last view to go unmaps them.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat

import posix_ipc

from ..errors import ForeignObject, LayoutError, ReplayError, ShmFull

from .names import SHM_DIR

log = logging.getLogger("shmreplay.segment")

# madvise(2) advice numbers (Linux >= 5.14); older kernels answer EINVAL and
# the pages fault in on first use as before
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23


class Segment:
    """A mapped shared-memory object.  Not thread-safe; close() once."""

    def __init__(self, name: str, mm: mmap.mmap, size: int, fd: int | None = None):
        self.name = name
        self.buf = mm
        self.size = size
        # the daemon keeps its segments open: to set their modes once they are
        # ready, and to read rows with pread (a mapping would SIGBUS if a
        # client with write access truncated the object)
        self.fd = fd

    @classmethod
    def create(cls, name: str, size: int, mode: int = 0o600,
               owner: tuple[int, int] = (-1, -1)) -> "Segment":
        """``mode`` is applied exactly (not masked by the umask); ``owner``
        (uid, gid), -1 for unchanged, is set before anyone can map it."""
        free = shm_free_bytes()
        if free is not None and size > free:
            raise ShmFull(
                f"/dev/shm has {free / 2**20:.1f} MiB free but segment {name} needs "
                f"{size / 2**20:.1f} MiB; free space in /dev/shm or enlarge it "
                "(mount -o remount,size=... /dev/shm)"
            )
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=mode, size=0)
        except posix_ipc.ExistentialError as exc:
            try:
                st = os.lstat(SHM_DIR + name)
            except OSError:
                st = None
            if st is not None and (st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode)):
                check_owned(SHM_DIR + name, st, stat.S_IMODE(st.st_mode))  # raises, naming the owner
            raise ReplayError(
                f"shared-memory segment {name} exists already: another daemon uses it, "
                f"or a dead one left it behind (remove it with rm /dev/shm{name})"
            ) from exc
        mm = None
        try:
            os.fchmod(shm.fd, mode)
            if owner != (-1, -1):
                os.fchown(shm.fd, *owner)
            try:
                os.posix_fallocate(shm.fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise ShmFull(
                        f"/dev/shm could not reserve {size / 2**20:.1f} MiB for {name}: "
                        f"{os.strerror(exc.errno)}"
                    ) from exc
                raise
            mm = mmap.mmap(shm.fd, size)
            advise_huge_pages(mm)
            prefault(mm, write=True)
        except BaseException:
            if mm is not None:
                mm.close()
            shm.close_fd()
            unlink_quiet(name)
            raise
        return cls(name, mm, size, shm.fd)

    @classmethod
    def attach(cls, name: str, expected_size: int | None = None,
               read_only: bool = False, map_size: int | None = None, fd: int | None = None) -> "Segment":
        """A client's mapping (``read_only``: PROT_READ, of an object it may
        only read).  ``map_size``: map exactly that many bytes of an object
        at least that large (a rows object, whose size any writer could
        change: bytes past the table's are none of ours).  ``fd``: the
        object's descriptor, passed by the daemon, instead of its name.  The
        descriptor is closed once mapped."""
        if fd is None:
            try:
                shm = posix_ipc.SharedMemory(name, read_only=read_only)
            except posix_ipc.ExistentialError as exc:
                raise LayoutError(f"shared-memory segment {name} does not exist") from exc
            fd = shm.fd
        try:
            size = check_size(name, os.fstat(fd).st_size, expected_size, map_size)
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ if read_only else
                           mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        advise_huge_pages(mm)
        try:
            prefault(mm, write=False)
        except BaseException:
            mm.close()
            raise
        return cls(name, mm, size)

    @classmethod
    def open_owned(cls, name: str, mode: int, gid: int = -1, size: int | None = None) -> "Segment":
        """The daemon's re-opening of an object it made (adoption): refused
        unless it is a regular file (no symlink followed, no FIFO waited on)
        owned by this user with exactly ``mode`` (and group ``gid``), since
        anyone may create a name in /dev/shm first.  ``size``: the size its
        table's layout gives it (a rows object's: ``restore_size``)."""
        return cls.map_owned(name, cls.open_owned_fd(SHM_DIR + name, mode, gid, "shared-memory segment",
                                                     empty_ok=size is not None), size)

    @classmethod
    def map_owned(cls, name: str, fd: int, size: int | None = None):
        """Map ``fd`` (taken: closed if mapping fails, else kept): all of it,
        or, given ``size``, exactly that after ``restore_size``."""
        try:
            if size is not None:
                restore_size(fd, name, size)
            mm = mmap.mmap(fd, size if size is not None else os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, mm, len(mm), fd)

    @staticmethod
    def open_owned_fd(path: str, mode: int, gid: int, what: str, empty_ok: bool = False) -> int:
        """An open descriptor of ``path`` once it is checked to be this
        daemon's own regular file (``check_owned``), nonempty unless
        ``empty_ok`` (a rows object whose size the daemon restores)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            raise LayoutError(f"{what} {path} does not exist") from None
        except OSError as exc:
            raise ForeignObject(f"{path} cannot be opened as this daemon's own object "
                                f"({os.strerror(exc.errno)}): not adopting it") from None
        try:
            st = os.fstat(fd)
            check_owned(path, st, mode, gid)
            if st.st_size == 0 and not empty_ok:
                raise LayoutError(f"{what} {path} is 0 bytes, expected a nonzero size (truncated?)")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def set_mode(self, mode: int, gid: int = -1) -> None:
        """Daemon: open the object to its clients, once it is complete."""
        os.fchown(self.fd, -1, gid)
        os.fchmod(self.fd, mode)

    def close(self) -> None:
        """Let go of the mapping.  It is unmapped when the last numpy view
        of it dies, never before: numpy arrays over an mmap keep the mmap
        object alive but do not pin its buffer, so ``mmap.close()`` with
        views alive would unmap memory they still point at (a crash in
        whichever thread touches them next)."""
        self.buf = None
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def unlink(self) -> None:
        unlink_quiet(self.name)


def check_size(name: str, size: int, expected: int | None, at_least: int | None = None) -> int:
    """The bytes to map of object ``name`` (``size`` bytes now): exactly
    ``expected``, at least ``at_least`` (then that many), or any nonzero
    size; else LayoutError saying so."""
    if at_least is not None:
        if size >= at_least > 0:
            return at_least
        raise LayoutError(f"{name} is {size} bytes, its table needs {at_least}: a client with "
                          "write access truncated it; the daemon gives it its size back when a "
                          "client opens the table, so open it again")
    if size == 0 or (expected is not None and size != expected):  # 0: truncated
        raise LayoutError(f"segment {name} is {size} bytes, expected "
                          f"{'a nonzero size' if expected is None else expected}")
    return size


def restore_size(fd: int, name: str, size: int) -> bool:
    """Give the object behind ``fd`` (the daemon's own descriptor) exactly
    ``size`` bytes, reserved, whatever size a client with write access gave
    it: longer is cut back (those bytes are nobody's), shorter is extended
    with zeros (the rows that were cut off are lost, as if a client had
    scribbled over them) and reserved again, so no mapping faults past the
    end.  True if the size was wrong.  Only the daemon calls it."""
    now = os.fstat(fd).st_size
    if now == size:
        return False
    if now > size:
        os.ftruncate(fd, size)
    else:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            raise ShmFull(f"{name} was cut to {now} bytes by a client; giving it back its {size} "
                          f"bytes failed: {os.strerror(exc.errno)}") from exc
    log.warning("%s was %d bytes, its table's layout says %d (a client with write access changed "
                "its size); %s", name, now, size,
                "cut back" if now > size else "extended with zeros: the rows past the old end are lost")
    return True


def prefault(buf: mmap.mmap, write: bool) -> bool:
    """Populate a whole mapping now rather than fault it in page by page
    later.  ``write=True`` (the creator) allocates and zeroes the pages;
    ``write=False`` (everyone else) only maps pages that exist.  Returns
    False where the kernel lacks the advice; that is slower, never wrong."""
    try:
        buf.madvise(MADV_POPULATE_WRITE if write else MADV_POPULATE_READ)
        return True
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.ENOSYS):
            return False
        if exc.errno == errno.ENOMEM and write:
            raise ShmFull(f"/dev/shm could not back {len(buf) / 2**20:.1f} MiB: "
                          f"{os.strerror(exc.errno)}") from exc
        raise


HUGE_PAGE_BYTES = 2 << 20  # a mapping smaller than one huge page gets none


def advise_huge_pages(buf) -> None:
    """Ask for transparent huge pages on a table mapping.  A learner gathers
    random rows from gigabytes; with 4 KiB pages each row costs TLB misses
    (dqn-atari gather: 10.6 GB/s on 4 KiB pages, 14.9 GB/s on 2 MiB pages,
    as fast as anonymous memory).  Takes effect only where the kernel allows
    it for shared memory: /sys/kernel/mm/transparent_hugepage/shmem_enabled
    set to "advise" (or "always"); otherwise it is a no-op.  The daemon's
    sum trees (private memory, ``sumtree.py``) ask the same way, under
    .../transparent_hugepage/enabled."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and len(buf) >= HUGE_PAGE_BYTES:
        try:
            buf.madvise(advice)
        except OSError:
            pass


def shmem_huge_pages() -> str:
    """The kernel's shmem THP mode (the bracketed word), or "unknown"."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            return f.read().split("[", 1)[1].split("]", 1)[0]
    except (OSError, IndexError):
        return "unknown"


def check_owned(path: str, st: os.stat_result, mode: int, gid: int = -1) -> None:
    """Raise ForeignObject unless ``st`` is a regular file of this user
    with exactly ``mode`` (and group ``gid``, unless -1)."""
    problems = []
    if not stat.S_ISREG(st.st_mode):
        problems.append("not a regular file")
    if st.st_uid != os.geteuid():
        problems.append(f"owned by uid {st.st_uid}, not {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != mode:
        problems.append(f"mode {stat.S_IMODE(st.st_mode):04o}, not {mode:04o}")
    if gid != -1 and st.st_gid != gid:
        problems.append(f"group {st.st_gid}, not {gid}")
    if problems:
        raise ForeignObject(f"{path} is not an object this daemon made ({', '.join(problems)}); "
                            "not using it: remove it, or find out who created it")


def unlink_quiet(name: str) -> None:
    try:
        posix_ipc.unlink_shared_memory(name)
    except posix_ipc.ExistentialError:
        pass


def shm_free_bytes() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize
