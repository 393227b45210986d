"""The metrics process: answers ``GET /metrics`` on the endpoints the
daemon bound (``metrics.py``), from the views the daemon pushes.

    python -m shmreplay.server.control.scrapes '<json spec>'

Started by the daemon only, with its listening sockets and one end of a
socket pair as inherited descriptors (their numbers in the spec); it exits
when that pair closes, so it never outlives the daemon (a SIGKILLed one
included), and ignores SIGINT and SIGTERM (SIGKILL ends it; the daemon
then starts another).  One thread, one ``epoll`` loop, non-blocking sockets, and
everything bounded, whoever connects:

* at most ``MAX_CONNECTIONS`` open at once.  One more evicts the oldest
  that has not yet sent its request (a flood of half-open connections
  pushes out its own, and a scraper, which sends at once, gets in); when
  every one is sending its answer, the newcomer is closed at once;
* ``HEAD_S`` from accept to send the request head, at most ``HEAD_MAX``
  bytes of it (408 and 431 otherwise), ``SEND_S`` to take the answer;
* only ``GET /metrics`` is answered (404, 405, 400 otherwise), with
  ``Connection: close``;
* it runs ``NICE`` below the daemon's priority, so what a flood makes it
  do takes CPU time the data path leaves;
* the answer is rendered at most once per pushed view (the daemon pushes
  one a second), however many scrapes come, and shared by all of them;
* on the Unix socket, a peer the control socket's rule would refuse
  (``access.may_connect``: ``SO_PEERCRED``/``SO_PEERGROUPS``, asked at
  accept) gets 403 to its request, under the same bounds as anyone.

So a flood costs this process at most ``MAX_CONNECTIONS`` descriptors and
``MAX_CONNECTIONS * HEAD_MAX`` bytes of buffers, and the daemon nothing.
Single-threaded; nothing here is shared with any other thread.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import socket
import sys
import time

from . import access

log = logging.getLogger("shmreplayd.metrics")

MAX_CONNECTIONS = 64
HEAD_MAX = 8192
HEAD_S = 2.0
SEND_S = 5.0
ACCEPT_BATCH = 64        # accepts per wake-up, then the connections' own work
FRAME_MAX = 64 << 20     # a pushed view larger than this is the daemon's bug: stop
NICE = 10                # added to the daemon's niceness
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def reply(status: str, body: bytes = b"", ctype: str = "text/plain; charset=utf-8") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


BAD = reply("400 Bad Request", b"not an HTTP request\n")
FORBIDDEN = reply("403 Forbidden", b"the daemon's access rules do not let this user read its metrics\n")
NOT_FOUND = reply("404 Not Found", b"only /metrics is served here\n")
NOT_ALLOWED = reply("405 Method Not Allowed", b"only GET /metrics is served here\n")
TIMEOUT = reply("408 Request Timeout", f"no complete request within {HEAD_S:g} s\n".encode())
TOO_LARGE = reply("431 Request Header Fields Too Large", f"request head over {HEAD_MAX} bytes\n".encode())


class Conn:
    __slots__ = ("sock", "tcp", "allowed", "deadline", "head", "out")

    def __init__(self, sock: socket.socket, tcp: bool, allowed: bool, now: float):
        self.sock, self.tcp, self.allowed, self.deadline = sock, tcp, allowed, now + HEAD_S
        self.head = bytearray()
        self.out: memoryview | None = None  # the answer left to send, once there is one


class Rule:
    """What ``access.may_connect`` reads of the daemon's config."""

    def __init__(self, uids, gids):
        self.allowed_uids, self.allowed_gids = set(uids), set(gids)


class Scrapes:
    def __init__(self, spec: dict):
        self.sel = selectors.DefaultSelector()
        self.rule = Rule(spec["uids"], spec["gids"])
        self.tcp_tables = spec["tcp_tables"]
        self.listeners = {}
        for key, tcp in (("tcp", True), ("unix", False)):
            if spec[key] >= 0:
                s = socket.socket(fileno=spec[key])
                s.setblocking(False)
                self.listeners[s.fileno()] = (s, tcp)
                self.sel.register(s, selectors.EVENT_READ, "listen")
        self.feed = socket.socket(fileno=spec["feed"])
        self.feed.setblocking(False)
        self.sel.register(self.feed, selectors.EVENT_READ, "feed")
        self.pending = bytearray()
        self.view: dict | None = None
        self.answers: dict[bool, bytes] = {}  # with tables or not -> the rendered answer
        self.conns: dict[int, Conn] = {}      # fd -> connection, oldest first

    def run(self) -> None:
        while True:
            now = time.monotonic()
            wait = min((c.deadline for c in self.conns.values()), default=now + 60.0) - now
            for key, mask in self.sel.select(max(wait, 0.0)):
                if key.data == "feed":
                    if not self._read_feed():
                        return
                elif key.data == "listen":
                    self._accept(*self.listeners[key.fd])
                else:
                    conn = self.conns.get(key.fd)
                    if conn is not None:
                        self._serve(conn, mask)
            self._expire(time.monotonic())

    # ---- the daemon's views ----
    def _read_feed(self) -> bool:
        """Take what the daemon pushed; False once it has closed the pair."""
        try:
            data = self.feed.recv(1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        self.pending += data
        while len(self.pending) >= 4:
            n = int.from_bytes(self.pending[:4], "little")
            if n > FRAME_MAX:
                log.error("metrics: a pushed view of %d bytes; stopping", n)
                return False
            if len(self.pending) < 4 + n:
                break
            self.view = json.loads(bytes(self.pending[4:4 + n]))
            del self.pending[:4 + n]
            self.answers.clear()  # rendered again at the next scrape
        return True

    def answer(self, tables: bool) -> bytes:
        got = self.answers.get(tables)
        if got is None:
            from prometheus_client import CollectorRegistry, generate_latest
            from .metrics import Collector
            registry = CollectorRegistry(auto_describe=False)
            registry.register(Collector(lambda: self.view, tables))
            got = self.answers[tables] = reply("200 OK", generate_latest(registry), CONTENT_TYPE)
        return got

    # ---- connections ----
    def _accept(self, lsock: socket.socket, tcp: bool) -> None:
        for _ in range(ACCEPT_BATCH):
            if len(self.conns) >= MAX_CONNECTIONS:
                self._evict()  # room first: never more than MAX_CONNECTIONS open, not even for a moment
            try:
                sock, _ = lsock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors or memory: the kernel keeps the rest queued
                log.warning("metrics: accept failed: %s", exc)
                return
            sock.setblocking(False)
            if len(self.conns) >= MAX_CONNECTIONS:  # every one is being answered: no room
                sock.close()
                continue
            # refused peers are answered 403 once they ask (curl shows them
            # that, not a broken pipe); until then they are bounded as anyone
            conn = Conn(sock, tcp, tcp or self._allowed(sock), time.monotonic())
            self.conns[sock.fileno()] = conn
            self.sel.register(sock, selectors.EVENT_READ, "conn")

    def _allowed(self, sock: socket.socket) -> bool:
        try:
            return access.may_connect(self.rule, access.peer_of(sock))
        except OSError:
            return False

    def _evict(self) -> bool:
        """Make room: close the oldest connection still to send its
        request; False if every one is being answered."""
        for conn in self.conns.values():
            if conn.out is None:
                self._close(conn)
                return True
        return False

    def _serve(self, conn: Conn, mask: int) -> None:
        if conn.out is None:
            try:
                data = conn.sock.recv(HEAD_MAX + 1 - len(conn.head))
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._close(conn)
                return
            conn.head += data
            end = conn.head.find(b"\r\n\r\n")
            if end < 0:
                if len(conn.head) > HEAD_MAX:
                    self._respond(conn, TOO_LARGE)
                return
            self._respond(conn, self._route(bytes(conn.head[:end]), conn))
            return
        self._send(conn)

    def _route(self, head: bytes, conn: Conn) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return BAD
        if not conn.allowed:
            return FORBIDDEN
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if target != b"/metrics":
            return NOT_FOUND
        if method != b"GET":
            return NOT_ALLOWED
        return self.answer(self.tcp_tables or not conn.tcp)

    def _respond(self, conn: Conn, data: bytes) -> None:
        conn.out = memoryview(data)
        conn.head = bytearray()
        conn.deadline = time.monotonic() + SEND_S
        self.sel.modify(conn.sock, selectors.EVENT_WRITE, "conn")
        self._send(conn)

    def _send(self, conn: Conn) -> None:
        try:
            n = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        conn.out = conn.out[n:]
        if not conn.out:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._close(conn)

    def _expire(self, now: float) -> None:
        late = [c for c in self.conns.values() if c.deadline <= now]
        for conn in late:
            if conn.out is None:
                _say(conn.sock, TIMEOUT)
            self._close(conn)

    def _close(self, conn: Conn) -> None:
        self.conns.pop(conn.sock.fileno(), None)
        self.sel.unregister(conn.sock)
        conn.sock.close()


def _say(sock: socket.socket, data: bytes) -> None:
    """A short answer, if the socket takes it now; never waits."""
    try:
        sock.send(data)
    except OSError:
        pass


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # the daemon decides when this process ends (it closes the pair): not
    # Ctrl-C at a terminal, which reaches the whole process group, nor the
    # SIGTERM systemd sends every process of the unit at a stop, which would
    # end it while the daemon still serves, and have it started again
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    # below the daemon (and the learners and actors beside it): a flood
    # makes this process busy, and the CPU it then takes is what they leave
    try:
        os.nice(NICE)
    except OSError as exc:  # a seccomp filter without setpriority: serve at the daemon's priority
        log.warning("metrics: cannot lower this process's priority: %s", exc)
    Scrapes(json.loads(argv[0])).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
