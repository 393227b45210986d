"""The control socket's front door: listening, accepting, and deciding at
once who comes in.

The gate accepts connections itself, one at a time, and decides each
before anything is built for it, from the kernel's word on who it is
(``SO_PEERCRED``, ``access.py``):

* a user the config does not let in: ``PermissionDenied``;
* past ``max_clients`` or ``max_clients_per_user``: ``CapacityError``;
* anyone but root, the daemon's user and the admin group, past
  ``max_clients`` less ``reserved_clients`` (all of them together), or when
  the connection would eat into the descriptor reserve
  (``descriptors.py``): ``CapacityError``.  So those three can always
  connect, whatever other users hold.

A refused connection gets its reason (a ``bye`` notice) written at once.
A few of them stay open until the client speaks, or ``refusal_linger_s``
at most, so that a client that has not read yet still finds the reason
with no reset in the way (``max_lingering_refusals``, and
``max_lingering_refusals_per_user``, so one user cannot take them all);
every other one is closed right after the write: the reason is in the
client's receive queue already, and ``client/link.py`` reads it after a
broken pipe.  So a flood of refused connections holds at most that many
descriptors, whatever its size.

Accepting one connection at a time (``ACCEPT_BATCH`` a wake-up, then the
loop serves the connections' own work) means a refusal frees its
descriptor before the next accept: a flood never holds a pile of
descriptors for connections not yet looked at, which would reach
RLIMIT_NOFILE and drop the next connection, the owner's too, without a
word.  Should an accept fail for want of descriptors anyway, the
connection waits in the listen queue (``LISTEN_BACKLOG``) and the gate
tries again ``ACCEPT_RETRY_S`` later.

An admitted connection becomes a ``ControlConnection`` (connection.py)
at once, so the limits count it (connections.py) before its transport
exists.

Event-loop thread only; the ``ControlServer`` (server.py) owns the gate.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
from collections import Counter

from ...errors import CapacityError, PermissionDenied
from ...wire import control as protocol
from . import access
from .connection import ControlConnection
from .descriptors import PER_CONNECTION, Descriptors

log = logging.getLogger("shmreplayd.control")

# the kernel's queue of connections not yet accepted (capped by
# net.core.somaxconn): a burst of this many clients connecting at once waits
# there; past it a client's connect() gets EAGAIN and tries again (link.py)
LISTEN_BACKLOG = 1024
ACCEPT_BATCH = 64      # accepts per wake-up, then the loop serves everyone else
ACCEPT_RETRY_S = 0.05  # after an accept failed (for want of descriptors or memory)


class Gate:
    def __init__(self, srv):  # a control.ControlServer
        self.srv = srv
        self.cfg = srv.cfg
        self.sock: socket.socket | None = None
        self.fds = Descriptors(resource.getrlimit(resource.RLIMIT_NOFILE)[0], self.cfg.reserved_descriptors)
        self.live: dict[int, ControlConnection] = {}  # admitted; until its lease has ended
        self.lingering: dict[int, tuple] = {}          # fd -> (socket, uid, timer)
        self.lingering_by_uid: Counter = Counter()
        self.opening: set[asyncio.Task] = set()        # transports being made
        self.retry: asyncio.TimerHandle | None = None
        self.failing = 0  # accepts failed in a row
        self.closed = False
        self.refused = 0

    def listen(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.recount()
        free = self.fds.limit - self.fds.base - self.fds.reserve
        if free < PER_CONNECTION * self.cfg.max_clients:
            log.warning("descriptors: %d of %d in use, %d reserved: room for %d clients of other users "
                        "(max_clients %d); raise LimitNOFILE for more", self.fds.base, self.fds.limit,
                        self.fds.reserve, max(0, free // PER_CONNECTION), self.cfg.max_clients)
        self.srv.loop.add_reader(sock.fileno(), self._accept)

    def recount(self) -> None:
        """Count the descriptors of everything but connections again (after
        a table came or went: descriptors.py)."""
        held = sum(c.descriptors() for c in self.live.values()) + len(self.lingering)
        self.fds.recount(held)

    def in_use(self) -> int:
        return self.fds.in_use(len(self.live), len(self.lingering))

    def left(self, conn: ControlConnection) -> None:
        """A connection's lease has ended: its descriptors are closed."""
        self.live.pop(conn.cid, None)

    async def close(self) -> None:
        """Stop accepting; close the lingering refusals; wait for the
        transports being made (their connections are then kicked with the rest)."""
        self.closed = True
        if self.retry is not None:
            self.retry.cancel()
        if self.sock is not None:
            self.srv.loop.remove_reader(self.sock.fileno())
            self.sock.close()
        for fd in list(self.lingering):
            self._end_linger(fd)
        while self.opening:
            await asyncio.gather(*self.opening, return_exceptions=True)

    # ---- accepting ----
    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno == errno.ECONNABORTED:
                    continue
                # out of descriptors or memory (or worse): the connection waits
                # in the listen queue; try again shortly, never in a hot loop,
                # and say so once, not every retry
                if not self.failing:
                    log.error("accept failed (%s); trying again every %g s", exc, ACCEPT_RETRY_S)
                self.failing += 1
                self._pause()
                return
            if self.failing:
                log.warning("accept works again after %d failed tries", self.failing)
                self.failing = 0
            self._admit(sock)

    def _pause(self) -> None:
        self.srv.loop.remove_reader(self.sock.fileno())
        self.retry = self.srv.loop.call_later(ACCEPT_RETRY_S, self._resume)

    def _resume(self) -> None:
        self.retry = None
        if not self.closed:
            self.srv.loop.add_reader(self.sock.fileno(), self._accept)

    def _admit(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(False)
            peer = access.peer_of(sock)
        except OSError as exc:
            log.warning("a connection's credentials cannot be read (%s); closing it", exc)
            sock.close()
            return
        why, may_linger = self._refusal(peer)
        if why is not None:
            self._refuse(sock, peer, why, may_linger)
            return
        conn = ControlConnection(self.srv, peer)
        self.live[conn.cid] = conn
        task = self.srv.loop.create_task(self._open(conn, sock))
        self.opening.add(task)
        task.add_done_callback(self.opening.discard)

    async def _open(self, conn: ControlConnection, sock: socket.socket) -> None:
        try:
            await self.srv.loop.connect_accepted_socket(lambda: conn, sock)
        except Exception as exc:
            log.warning("connection %d: its transport could not be made (%s); closing it", conn.cid, exc)
            sock.close()
            conn.abandon()

    def _refusal(self, peer) -> tuple[Exception | None, bool]:
        """Why ``peer`` may not connect (None: it may), and whether the
        refusal may linger to deliver its reason."""
        srv, cfg = self.srv, self.cfg
        if not access.may_connect(cfg, peer):
            return PermissionDenied(
                f"user {peer.uid} may not use this daemon (not its user, not in allowed_users, "
                "not in allowed_groups)"), True
        if len(srv.connections) >= cfg.max_clients:
            return CapacityError(f"the daemon serves {len(srv.connections)} clients, its limit "
                                 f"(max_clients {cfg.max_clients})"), True
        mine = sum(c.peer.uid == peer.uid for c in srv.connections)
        if mine >= cfg.max_clients_per_user:
            return CapacityError(f"user {peer.uid} has {mine} connections, the limit per user "
                                 f"(max_clients_per_user {cfg.max_clients_per_user})"), True
        if access.may_administer(cfg, peer):
            return None, False
        others = sum(not access.may_administer(cfg, c.peer) for c in srv.connections)
        if others >= cfg.max_clients - cfg.reserved_clients:
            return CapacityError(f"users other than root, the daemon's and the admin group hold {others} "
                                 f"connections, all that max_clients {cfg.max_clients} leaves them "
                                 f"(reserved_clients {cfg.reserved_clients})"), True
        # closed at once: lingering would hold a descriptor of the reserve
        return self.fds.refusal(PER_CONNECTION, self.in_use(), "connection"), False

    # ---- refusing ----
    def _refuse(self, sock: socket.socket, peer, why: Exception, may_linger: bool) -> None:
        self.refused += 1
        log.warning("connection from pid %d (uid %d) refused: %s", peer.pid, peer.uid, why)
        try:  # a fresh socket's buffer takes the notice whole
            sock.send(protocol.notice_bye(why))
        except OSError:
            pass  # the client is gone already
        if may_linger and self._may_linger(peer):
            fd = sock.fileno()
            timer = self.srv.loop.call_later(self.cfg.refusal_linger_s, self._end_linger, fd)
            self.lingering[fd] = (sock, peer.uid, timer)
            self.lingering_by_uid[peer.uid] += 1
            # the client's first bytes (its hello) end the wait: it has the notice
            self.srv.loop.add_reader(fd, self._end_linger, fd)
        else:
            sock.close()

    def _may_linger(self, peer) -> bool:
        cfg = self.cfg
        return (len(self.lingering) < cfg.max_lingering_refusals
                and self.lingering_by_uid[peer.uid] < cfg.max_lingering_refusals_per_user
                and cfg.refusal_linger_s > 0
                and (access.may_administer(cfg, peer) or self.fds.fits(1, self.in_use())))

    def _end_linger(self, fd: int) -> None:
        sock, uid, timer = self.lingering.pop(fd, (None, 0, None))
        if sock is None:
            return
        timer.cancel()
        self.srv.loop.remove_reader(fd)
        self.lingering_by_uid[uid] -= 1
        if not self.lingering_by_uid[uid]:
            del self.lingering_by_uid[uid]
        try:  # read what the client said, so the close is no reset that could hide the notice
            sock.recv(1 << 16)
        except OSError:
            pass
        sock.close()

    def status(self) -> dict:
        return {"limit": self.fds.limit, "reserved": self.fds.reserve, "in_use": self.in_use(),
                "refused_connections": self.refused, "lingering_refusals": len(self.lingering)}
