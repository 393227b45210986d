"""Who a peer process is, as the kernel says: its credentials on a Unix
socket, its start time.

``SO_PEERCRED`` gives the pid, uid and gid of the process that connected
(or, on the client's side, that listens), so no peer can claim to be
someone else; ``SO_PEERGROUPS`` (Linux >= 4.13) its supplementary groups.
Both sides decode them here: the daemon to decide who may connect
(``server/control/access.py``), the client to refuse a daemon of a
stranger (``client/link.py``).

``process_start`` names a process across pid reuse: with its pid, the
start time the kernel records in /proc tells the process that leased slots
or serves a table from a later one that got the same pid;
``process_alive`` says whether that process still runs (a zombie does not).

Pure decoding around one ``getsockopt`` or /proc read each; any thread.
"""

from __future__ import annotations

import os
import socket
import struct

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
_GID = 4                     # bytes of one gid_t in SO_PEERGROUPS


def credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the peer of ``sock``.  OSError if the kernel cannot say."""
    pid, uid, gid = _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return pid, uid, gid


def groups(sock: socket.socket, most: int = 1024) -> set[int]:
    """The peer's supplementary groups (up to ``most``).  OSError on a
    kernel without ``SO_PEERGROUPS``."""
    raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _GID * most)
    n = len(raw) // _GID
    return set(struct.unpack(f"{n}I", raw[:n * _GID]))


PID_MAX = 1 << 22  # the kernel's largest pid_max
EXITED = ("Z", "X", "x")  # /proc states of a process that runs no more: a zombie, dead


def process_state(pid: int) -> tuple[str, int]:
    """(state letter, start time in clock ticks since boot) of process
    ``pid``; ("", 0) when there is none."""
    if not 0 < pid < PID_MAX:
        return "", 0
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
        try:
            stat = os.read(fd, 4096)
        finally:
            os.close(fd)
        rest = stat[stat.rindex(b")") + 2:].split()
        return rest[0].decode(), int(rest[19])
    except (OSError, ValueError, IndexError):
        return "", 0


def process_start(pid: int) -> int:
    """The process's start time in clock ticks since boot (0 if it is gone):
    with the pid it names one process even after the pid is reused."""
    return process_state(pid)[1]


def process_alive(pid: int, start: int = 0) -> bool:
    """Is ``pid`` a live process (and, when ``start`` is known, the same one
    that had that start time)?  A zombie (exited, not yet reaped) is not:
    it maps no memory, holds no lock and runs no more code, and where the
    parent or init reaps nothing (a container without one) it stays a
    zombie for good, which must not keep its slots or tables held."""
    state, now = process_state(pid)
    return now != 0 and state not in EXITED and (start == 0 or now == start)
