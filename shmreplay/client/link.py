"""A client's control link: the Unix socket to the daemon, around the sans-IO
``wire.control.ClientConnection``.

The link carries the handshake, table management and admin requests, and
is the client's lease: while it is open the daemon keeps the client's
reservations.  The daemon's last word before closing it (a bye notice:
shutdown, refusal, a protocol error) becomes the exception of every later
call.  One thread at a time (the ``Client``'s).
"""

from __future__ import annotations

import os
import pwd
import select
import socket
import time

from ..errors import DaemonUnavailable, PermissionDenied, ProtocolError, ReplayError, ReplayTimeout
from ..wire import peer
from ..wire.control import PROTOCOL_VERSION, ClientConnection


class ControlLink:
    def __init__(self, path: str, timeout: float):
        self.path = path
        self.timeout = timeout
        self.conn = ClientConnection()
        sock = connect_socket(path, timeout)
        try:
            check_daemon(sock, path)
        except ReplayError:  # (PermissionDenied is an OSError too)
            sock.close()
            raise
        except OSError as exc:  # the kernel could not say who answers
            sock.close()
            raise DaemonUnavailable(f"cannot read who answers on {path}: {exc}") from None
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.fds: list[int] = []  # descriptors the daemon passed (hello's)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)

    def hello(self, pid: int, resume: int = 0) -> tuple[dict, list[int]]:
        """The handshake's first half: the daemon creates this client's
        channel and doorbells and passes their descriptors with its reply.
        Returns the reply and the descriptors, which the caller owns."""
        reply = self.request("hello", protocol=PROTOCOL_VERSION, pid=pid, resume=resume)
        fds, self.fds = self.fds, []
        want = len(reply.get("fds", ()))
        if len(fds) != want or want != 3:
            for fd in fds:
                os.close(fd)
            raise ProtocolError(f"the daemon's hello passed {len(fds)} descriptors, expected 3")
        return reply, fds

    def admin_hello(self) -> dict:
        """An admin connection's handshake (the command line): no channel,
        no lease, no ``ready``; control requests may follow at once."""
        return self.request("hello", protocol=PROTOCOL_VERSION, pid=os.getpid(), channel=False)

    def ready(self) -> None:
        """The handshake's second half: the channel is mapped; the daemon
        unlinks its names and starts serving it."""
        self.request("ready")

    def request(self, op: str, **args) -> dict:
        """Send a request and wait for its reply; raises the error it names."""
        if self.conn.bye is not None:
            raise self.conn.bye
        rid, frame = self.conn.request(op, **args)
        try:
            self.sock.sendall(frame)
            while True:
                data = self._recv()
                if not data:
                    self._closed()
                self.conn.receive(data)
                msg = self.conn.result(rid)
                if msg is not None:
                    return self._rows_passed(op, msg)
                if self.conn.bye is not None:
                    raise self.conn.bye
        except ReplayError:  # the daemon's word (some are OSErrors too: ShmFull)
            raise
        except socket.timeout:
            raise ReplayTimeout(f"daemon did not answer {op!r} within {self.timeout} s") from None
        except OSError as exc:  # a broken pipe, a reset: never a raw OSError
            self._read_bye()  # a refused connection is closed with a reason; raise that
            raise DaemonUnavailable(f"daemon at {self.path} went away: {exc}") from None

    def _rows_passed(self, op: str, msg: dict) -> dict:
        """A create or open of a table only its creator writes, by its
        creator (not the daemon's user): the daemon passed a writable
        descriptor of its rows, which goes into the table's description
        (``rows_fd``: the table's to map and close).  Descriptors with any
        other reply but hello's are closed."""
        if op == "hello" or not self.fds:
            return msg
        fds, self.fds = self.fds, []
        if msg.get("fds") == ["rows"] and len(fds) == 1 and isinstance(msg.get("table"), dict):
            msg["table"]["rows_fd"] = fds[0]
            return msg
        for fd in fds:
            os.close(fd)
        raise ProtocolError(f"the daemon passed {len(fds)} descriptors with its {op!r} reply")

    def _recv(self) -> bytes:
        """Read bytes and any descriptors the daemon attached to them."""
        data, fds, flags, _ = socket.recv_fds(self.sock, 1 << 16, _MAX_FDS, socket.MSG_CMSG_CLOEXEC)
        self.fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("the daemon passed more descriptors than a hello carries")
        return data

    def _closed(self):
        if self.conn.bye is None:
            self.conn.bye = DaemonUnavailable(f"daemon at {self.path} closed the connection")
        raise self.conn.bye

    def _read_bye(self) -> None:
        """Raise the bye notice still buffered on a closed socket, if any."""
        try:
            self.conn.receive(self.sock.recv(1 << 16, socket.MSG_DONTWAIT))
        except (OSError, ProtocolError):
            pass
        if self.conn.bye is not None:
            raise self.conn.bye

    def live(self) -> None:
        """Raise DaemonUnavailable (or the daemon's bye reason) if the lease ended."""
        if self.conn.bye is not None:
            raise self.conn.bye
        if not self._poll.poll(0):
            return
        try:
            data = self.sock.recv(1 << 16, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError as exc:
            raise DaemonUnavailable(f"daemon at {self.path} went away: {exc}") from None
        if not data:
            self._closed()
        self.conn.receive(data)
        if self.conn.bye is not None:
            raise self.conn.bye

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []
        self.sock.close()


_MAX_FDS = 4
ENV_DAEMON_USER = "SHMREPLAY_DAEMON_USER"
# a full listen queue (a burst of clients connecting at once) is EAGAIN
# for a Unix socket: tried again after these pauses, doubling, until the
# connect's timeout; short, so a queue the daemon drains is joined at once
CONNECT_RETRY_S = (0.001, 0.05)


def connect_socket(path: str, timeout: float) -> socket.socket:
    """A socket connected to ``path`` within ``timeout``: a listen queue
    that stays full is ``ReplayTimeout``, every other failure a
    ``ReplayError`` that says what to do, never a raw OSError."""
    deadline = time.monotonic() + timeout
    pause = CONNECT_RETRY_S[0]
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(path)
            return sock
        except (BlockingIOError, InterruptedError):  # EAGAIN: the queue is full for now
            sock.close()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ReplayTimeout(f"connecting to {path} timed out after {timeout} s: the daemon's "
                                    "listen queue stayed full (a burst of connections)") from None
            time.sleep(min(pause, left))
            pause = min(2 * pause, CONNECT_RETRY_S[1])
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            sock.close()
            raise DaemonUnavailable(
                f"no shmreplay daemon at {path} ({exc.strerror}); start shmreplayd or "
                "set $SHMREPLAY_SOCKET") from None
        except PermissionError as exc:  # the socket's (or a directory's) mode keeps us out
            sock.close()
            raise PermissionDenied(
                f"user {os.getuid()} may not open the socket {path} ({exc.strerror}); the daemon's "
                "segment_mode and group decide who may connect") from None
        except socket.timeout:
            sock.close()
            raise ReplayTimeout(f"connecting to {path} timed out after {timeout} s") from None
        except OSError as exc:
            sock.close()
            raise DaemonUnavailable(f"cannot connect to {path}: {exc}; check the socket path "
                                    "(config socket, $SHMREPLAY_SOCKET)") from None


def check_daemon(sock: socket.socket, path: str) -> None:
    """Refuse, before a byte is sent, a peer that is not this user, root or
    a daemon user named in $SHMREPLAY_DAEMON_USER (names or uids, comma
    separated): anyone who took the socket path first could otherwise read
    every row we insert and feed us theirs."""
    pid, uid, _ = peer.credentials(sock)
    if uid in (os.getuid(), 0) or uid in daemon_uids():
        return
    raise PermissionDenied(
        f"the process answering on {path} (pid {pid}) runs as uid {uid}: not you, not root and not "
        f"${ENV_DAEMON_USER}; refusing to talk to it (did someone else take the socket path?)")


def daemon_uids() -> set[int]:
    out = set()
    for word in os.environ.get(ENV_DAEMON_USER, "").replace(",", " ").split():
        try:
            out.add(int(word) if word.isdigit() else pwd.getpwnam(word).pw_uid)
        except KeyError:
            raise PermissionDenied(f"${ENV_DAEMON_USER} names user {word!r}, who does not exist") from None
    return out
