"""Control-plane protocol, sans I/O: bytes in, messages out.

Rules (docs/protocol.md has the message sequences):

1. A frame is a 4-byte big-endian length followed by that many bytes of
   msgpack encoding one map.  A length of 0 or above MAX_FRAME, bytes that do
   not decode, or a value that is not a map is a protocol error, and the
   connection is closed after an error notice.
2. A request is ``{"op": str, "id": int, ...}``; the reply carries the same
   ``id`` and either ``"ok": true`` with results or ``"ok": false`` with
   ``"error"`` (an errors class name) and ``"message"`` (cut at
   MAX_MESSAGE characters).  Requests on one connection are answered in order.
3. The first request must be ``hello`` with this PROTOCOL_VERSION; a
   mismatch is refused.  Its reply carries three descriptors (SCM_RIGHTS,
   on the reply's first byte): the client's channel (a sealed memfd) and
   its two doorbells (eventfds: to the daemon, to the client), listed by
   name in the reply's ``fds``.  The second request must be ``ready`` (the
   client has mapped its channel).  After that any other op is allowed.
   An admin connection (the command line) sends ``hello`` with
   ``"channel": false``: no channel, no descriptors, no ``ready``; any
   other op may follow at once, and it is no client (no lease, not
   counted among the clients).
4. The daemon may send one unsolicited notice, ``{"op": "bye", "error":..,
   "message": ..}``, just before it closes the connection.
5. A connection is the client's lease: when it closes, for any reason, the
   daemon applies what the client's ring still holds and then reclaims every
   slot the client reserved but did not commit.

This module never touches a socket: the daemon (``server/control/connection.py``)
wraps ``ServerConnection`` and the client (``client/link.py``) wraps
``ClientConnection``; each feeds it bytes and sends what it returns.
Both classes are for one thread at a time.
"""

from __future__ import annotations

import struct

import msgpack

from ..errors import ProtocolError, ReplayError, error_from_name

PROTOCOL_VERSION = 8  # 2: checkpoint and shutdown ops; access control; 3: channel passed as fds; 4: sync op;
# 5: writers="creator" tables (spec keys writers, writer_uid; their rows passed as fds);
# 6: a ring's sleeping word ASLEEP_WAITING (requests parked: lazy records wake the daemon too),
# which lazy commits by default rely on; 7: the spec key row_layout (slot-by-slot rows);
# 8: the SAMPLE flag WIDE (the client gathers on every CPU: no learner spin for it)
MAX_FRAME = 1 << 20
# an error message may quote what the peer sent; cut it here so that the
# reply fits a frame whatever the request held (it could not be sent else)
MAX_MESSAGE = 16 << 10
_LEN = struct.Struct(">I")

# op -> {argument: type}; every listed argument is required
REQUESTS: dict[str, dict[str, type | tuple]] = {
    "hello": {"protocol": int, "pid": int},
    "ready": {},
    "create_table": {"spec": dict, "exist_ok": bool},
    "open_table": {"name": str},
    "drop_table": {"name": str},
    "list_tables": {},
    "stats": {},
    "status": {},
    "checkpoint": {"tables": list, "to": str},
    "sync": {"tables": list},
    "shutdown": {},
}
# ops only the daemon's user, root, or a member of the config's admin_group may send
ADMIN_OPS = frozenset({"drop_table", "checkpoint", "sync", "shutdown"})

EXPECT_HELLO, EXPECT_READY, READY, CLOSED = "EXPECT_HELLO", "EXPECT_READY", "READY", "CLOSED"


def encode(msg: dict) -> bytes:
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise ProtocolError(f"message of {len(body)} bytes exceeds the {MAX_FRAME}-byte frame limit")
    return _LEN.pack(len(body)) + body


class FrameDecoder:
    """Accumulates bytes and yields decoded maps."""

    def __init__(self, max_frame: int = MAX_FRAME):
        self.max_frame = max_frame
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[dict]:
        self.buf += data
        out = []
        while len(self.buf) >= 4:
            (n,) = _LEN.unpack_from(self.buf)
            if n == 0 or n > self.max_frame:
                raise ProtocolError(f"frame length {n} outside 1..{self.max_frame}")
            if len(self.buf) < 4 + n:
                break
            body = bytes(self.buf[4:4 + n])
            del self.buf[:4 + n]
            try:
                msg = msgpack.unpackb(body, raw=False, strict_map_key=True)
            except Exception as exc:  # msgpack raises several unrelated types
                raise ProtocolError(f"frame is not valid msgpack: {exc}") from exc
            if not isinstance(msg, dict):
                raise ProtocolError(f"frame holds a {type(msg).__name__}, expected a map")
            out.append(msg)
        return out


def check_request(msg: dict) -> tuple[str, int]:
    """Validate a request's op, id and argument types; return (op, id)."""
    op, rid = msg.get("op"), msg.get("id")
    if not isinstance(rid, int) or isinstance(rid, bool):
        raise ProtocolError(f"request lacks an integer 'id': {msg!r:.200}")
    if op not in REQUESTS:
        raise ProtocolError(f"unknown op {op!r}")
    for arg, typ in REQUESTS[op].items():
        v = msg.get(arg)
        if not isinstance(v, typ) or (typ is int and isinstance(v, bool)):
            raise ProtocolError(f"op {op!r}: argument {arg!r} must be {typ.__name__}, got {v!r:.100}")
    return op, rid


class ServerConnection:
    """Daemon-side state of one control connection (rules 1-3)."""

    def __init__(self):
        self.state = EXPECT_HELLO
        self.decoder = FrameDecoder()
        self.client_pid: int | None = None

    def receive(self, data: bytes) -> list[dict]:
        """Feed bytes; return the requests now complete, in order.  Raises
        ProtocolError for anything that breaks the rules (state -> CLOSED)."""
        try:
            out = []
            for msg in self.decoder.feed(data):
                op, _ = check_request(msg)
                if self.state == EXPECT_HELLO:
                    if op != "hello":
                        raise ProtocolError(f"first request must be 'hello', got {op!r}")
                    if msg["protocol"] != PROTOCOL_VERSION:
                        raise ProtocolError(
                            f"client speaks protocol {msg['protocol']}, daemon speaks {PROTOCOL_VERSION}")
                    self.client_pid = msg["pid"]
                    channel = msg.get("channel", True)
                    if not isinstance(channel, bool):
                        raise ProtocolError(f"hello: channel must be a bool, got {channel!r:.40}")
                    self.state = EXPECT_READY if channel else READY
                elif self.state == EXPECT_READY:
                    if op != "ready":
                        raise ProtocolError(f"second request must be 'ready', got {op!r}")
                    self.state = READY
                elif op in ("hello", "ready"):
                    raise ProtocolError(f"{op!r} sent twice")
                out.append(msg)
            return out
        except ProtocolError:
            self.state = CLOSED
            raise


def reply_ok(rid: int, **results) -> bytes:
    return encode({"id": rid, "ok": True, **results})


def _message(exc: BaseException) -> str:
    text = str(exc)
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + " [cut]"


def reply_error(rid: int, exc: BaseException) -> bytes:
    return encode({"id": rid, "ok": False, "error": type(exc).__name__, "message": _message(exc)})


def notice_bye(exc: BaseException) -> bytes:
    return encode({"op": "bye", "error": type(exc).__name__, "message": _message(exc)})


class ClientConnection:
    """Client-side state of one control connection: frames requests, files
    replies by id (rule 2) and keeps the daemon's bye notice (rule 4)."""

    def __init__(self):
        self.decoder = FrameDecoder()
        self.next_id = 1
        self.replies: dict[int, dict] = {}
        self.bye: ReplayError | None = None

    def request(self, op: str, **args) -> tuple[int, bytes]:
        """(request id, the frame to send)."""
        rid = self.next_id
        self.next_id += 1
        return rid, encode({"op": op, "id": rid, **args})

    def receive(self, data: bytes) -> None:
        """Feed bytes read from the socket.  Raises ProtocolError for a
        broken frame; a bye notice is kept in ``bye``."""
        for msg in self.decoder.feed(data):
            if msg.get("op") == "bye":
                self.bye = error_from_name(msg.get("error"), str(msg.get("message")))
            elif isinstance(msg.get("id"), int):
                self.replies[msg["id"]] = msg

    def result(self, rid: int) -> dict | None:
        """The reply to ``rid`` if it arrived (None if not yet); raises the
        error a failed reply names."""
        msg = self.replies.pop(rid, None)
        if msg is None or msg.get("ok"):
            return msg
        raise error_from_name(msg.get("error"), str(msg.get("message")))
