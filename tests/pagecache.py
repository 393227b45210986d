"""What the page cache holds of a file: Linux's ``cachestat`` system call
(kernel 6.5 and later), for tests that must see whether a process synced
its files, not only that the bytes read back.

A file whose pages are all clean and none under writeback is on the disk
as far as the kernel knows: an ``fsync``/``fdatasync``/``msync(MS_SYNC)``
by anyone left nothing to write.  A page still dirty is one a reboot would
lose (``POSIX_FADV_DONTNEED`` drops only clean pages, so dropping the cache
cannot stand in for that loss by itself)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform

# arch/x86/entry/syscalls/syscall_64.tbl (and the generic table): 451 cachestat
CACHESTAT_NR = {"x86_64": 451, "aarch64": 451}


class PageCacheUnavailable(RuntimeError):
    """This kernel (or architecture) has no ``cachestat``: the check cannot
    be made here.  Raised, never swallowed: whoever calls decides whether
    that fails the run or skips the test."""


class _Range(ctypes.Structure):  # struct cachestat_range (include/uapi/linux/mman.h)
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Stat(ctypes.Structure):  # struct cachestat
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def cachestat(path: str) -> dict[str, int]:
    """The page-cache counters of the whole file ``path`` (pages of it in
    the cache, dirty, under writeback, ...)."""
    nr = CACHESTAT_NR.get(platform.machine())
    if nr is None:
        raise PageCacheUnavailable(f"no cachestat syscall number known for {platform.machine()}")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if _memory_backed(fd):
            raise PageCacheUnavailable(f"{path} is on a memory filesystem (tmpfs): there is no disk to "
                                       "sync to, and its pages never turn clean; run the suite with "
                                       "TMPDIR on a disk filesystem")
        rng, st = _Range(0, 0), _Stat()  # len 0: to the end of the file
        rc = _libc.syscall(ctypes.c_long(nr), ctypes.c_int(fd), ctypes.byref(rng), ctypes.byref(st),
                           ctypes.c_uint(0))
        if rc != 0:
            err = ctypes.get_errno()
            if err == errno.ENOSYS:
                raise PageCacheUnavailable(f"the kernel ({platform.release()}) has no cachestat "
                                           "syscall (Linux 6.5 or later has it)")
            raise OSError(err, f"cachestat({path}): {os.strerror(err)}")
        return {n: int(getattr(st, n)) for n, _ in _Stat._fields_}
    finally:
        os.close(fd)


def unsynced(directory: str) -> dict[str, dict[str, int]]:
    """Every regular file in ``directory`` with a page dirty or under
    writeback, with its counters; empty when all of them are on disk."""
    out = {}
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            continue
        st = cachestat(path)
        if st["nr_dirty"] or st["nr_writeback"]:
            out[name] = st
    return out


TMPFS_MAGIC, RAMFS_MAGIC = 0x01021994, 0x858458F6  # include/uapi/linux/magic.h


class _Statfs(ctypes.Structure):  # struct statfs (x86-64 and aarch64: f_type first, a long)
    _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]


def _memory_backed(fd: int) -> bool:
    st = _Statfs()
    if _libc.fstatfs(ctypes.c_int(fd), ctypes.byref(st)) != 0:
        return False  # cannot tell: cachestat then says what it sees
    return (st.f_type & 0xFFFFFFFF) in (TMPFS_MAGIC, RAMFS_MAGIC)
