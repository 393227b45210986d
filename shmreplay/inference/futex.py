"""Sleeping on, and waking, a 32-bit word in shared memory: the raw futex syscall.

The inference channel's bells (``layout.py``) are words of its
segment, not semaphores.  A glibc semaphore keeps its own bookkeeping in
the bytes it shares (its count, its waiters, and whether it is private),
and aborts the process (``The futex facility returned an unexpected error
code``) when another process has written nonsense there; a named one can
also be created first by anyone.  The kernel's futex keeps no state in the
word: ``wait`` sleeps only while the word still holds the value the caller
read, and ``wake`` wakes whoever sleeps on it.  So a word anyone wrote
anything into gives at most a wake-up too many or one missed, and every
wait here has a timeout.

Shared futexes (no ``FUTEX_PRIVATE_FLAG``): the mapping is shared between
processes, and the kernel keys such a futex on the page, not on the
address space.  The futex word is the first 4 bytes of a 64-bit word of
the segment: its low half on the little-endian machines this knows.

``wait`` and ``wake`` never raise: every error the kernel can answer
(EAGAIN: the word changed; ETIMEDOUT; EINTR: a signal) means "look
again", which every caller does.  Any thread; ctypes releases the GIL for
the call.
"""

from __future__ import annotations

import ctypes
import platform
import sys

# syscall numbers of futex(2): asm/unistd.h of each architecture
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
FUTEX_WAIT, FUTEX_WAKE = 0, 1
WAKE_ALL = 0x7FFFFFFF

_NR = _SYS_FUTEX.get(platform.machine().lower())
if _NR is None or sys.byteorder != "little":
    raise ImportError(f"shmreplay's inference channel knows the futex syscall of x86_64 and aarch64 "
                      f"(little-endian) only, not of {platform.machine()} ({sys.byteorder}-endian)")

_libc = ctypes.CDLL(None, use_errno=True)
# no argtypes: ctypes converting seven declared arguments costs ~3x the
# syscall on the round trip's path; every argument is passed ready-made
# instead (addresses as c_void_p made once, small ints as C ints)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_NULL = None


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Waiter:
    """One thread's waits (its own timespec, reused): ``wait(addr, value, s)``."""

    def __init__(self):
        self._ts = _Timespec()
        self._ref = ctypes.byref(self._ts)

    def wait(self, addr: ctypes.c_void_p, value: int, seconds: float) -> None:
        """Sleep while the 32-bit word at ``addr`` reads ``value`` (its low
        32 bits), at most ``seconds`` (at least 1 µs), or until a ``wake``."""
        ns = max(1_000, int(seconds * 1e9))
        self._ts.tv_sec, self._ts.tv_nsec = divmod(ns, 1_000_000_000)
        v = int(value) & 0xFFFFFFFF
        _syscall(_NR, addr, FUTEX_WAIT, v - (1 << 32) if v >= 1 << 31 else v, self._ref, _NULL, 0)


def wake(addr: ctypes.c_void_p, n: int = 1) -> None:
    """Wake up to ``n`` sleepers on the word at ``addr`` (none: nothing)."""
    _syscall(_NR, addr, FUTEX_WAKE, n, _NULL, _NULL, 0)


def word_address(words, i: int) -> ctypes.c_void_p:
    """The address of 64-bit word ``i`` of ``words`` (a uint64 array over
    the shared mapping), whose low half is the futex word; made once per
    word and handed to ``wait``/``wake`` as it is."""
    return ctypes.c_void_p(words.ctypes.data + 8 * int(i))
