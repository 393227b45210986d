"""Who is on the other end of a Unix socket, as the kernel says.

``SO_PEERCRED`` gives the pid, uid and gid of the process that connected
(or, on the client's side, that listens), so no peer can claim to be
someone else; ``SO_PEERGROUPS`` (Linux >= 4.13) its supplementary groups.
Both sides decode them here: the daemon to decide who may connect
(``server/control/access.py``), the client to refuse a daemon of a
stranger (``client/link.py``).

Pure decoding around one ``getsockopt`` each; any thread.
"""

from __future__ import annotations

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
