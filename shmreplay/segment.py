"""POSIX shared-memory segments: create (reserved up front), attach, unlink.

Creation uses O_CREX, so a leftover segment of the same name is an error
rather than silently shared, and reserves every page with
``posix_fallocate``: on tmpfs that either allocates the whole size or fails
with ENOSPC now, instead of a SIGBUS in some client hours later.  A statvfs
check first turns the obvious case (far too big) into an instant error
without making the kernel allocate and free gigabytes.

The file descriptor is closed right after mapping; the mapping keeps the
segment alive until it is closed, even after unlink.
"""

from __future__ import annotations

import errno
import mmap
import os

import posix_ipc

from .errors import LayoutError, ReplayError, ShmFull

SHM_DIR = "/dev/shm"


class Segment:
    """A mapped shared-memory object.  Not thread-safe; close() once."""

    def __init__(self, name: str, mm: mmap.mmap, size: int):
        self.name = name
        self.buf = mm
        self.size = size

    @classmethod
    def create(cls, name: str, size: int, mode: int = 0o600) -> "Segment":
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
            raise ReplayError(
                f"shared-memory segment {name} exists already: another daemon uses it, "
                f"or a dead one left it behind (remove it with rm /dev/shm{name})"
            ) from exc
        try:
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
        except BaseException:
            shm.close_fd()
            _unlink_quiet(name)
            raise
        shm.close_fd()
        return cls(name, mm, size)

    @classmethod
    def attach(cls, name: str, expected_size: int | None = None) -> "Segment":
        try:
            shm = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError as exc:
            raise LayoutError(f"shared-memory segment {name} does not exist") from exc
        try:
            size = shm.size
            if expected_size is not None and size != expected_size:
                raise LayoutError(f"segment {name} is {size} bytes, expected {expected_size}")
            mm = mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(name, mm, size)

    def close(self) -> bool:
        """Unmap.  Returns False if numpy views still hold the buffer; the
        mapping is then released when the last view goes away."""
        try:
            self.buf.close()
            return True
        except BufferError:
            return False

    def unlink(self) -> None:
        _unlink_quiet(self.name)


def _unlink_quiet(name: str) -> None:
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


def unlink_semaphore_quiet(name: str) -> None:
    try:
        posix_ipc.unlink_semaphore(name)
    except posix_ipc.ExistentialError:
        pass
