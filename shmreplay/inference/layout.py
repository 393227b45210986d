"""The inference channel's bytes: its layout, its slot words and bells.

An inference channel (``server.py`` and ``env.py``; docs/protocol.md,
"Inference channel") is one sealed memfd that the learner process (the
server) makes, reached through its descriptor (``memfd.py``:
making it, its address, an env's opening of it).  Its address's token is
header word 13, so an env tells it from whatever that descriptor number
holds later.  The bells are words of the channel (``futex.py``).

The segment (every offset a multiple of 64, ``Layout``)::

    0      header, 16 x uint64: MAGIC, VERSION, server pid, server start
           time, OPEN/CLOSED, slots, segment size, schema length, the
           offsets and strides of the three areas below; word 13 the
           address's token, word 14 zero; word 15 the
           doorbell: 1 while the server sleeps on it (an env that posts
           swaps it to 0 and wakes the server)
    128    schema: JSON {"request": [[name, dtype, shape], ...], "response": [...]}
    C      control: one 64-byte line per slot: word 0 its state word (also
           its env's reply bell: the env sleeps on it), word 1 its env's
           start time (clock ticks since boot), word 2 1 while its env sleeps
    R      requests: slot i's at R + i * req_stride, each field at its offset
    P      responses: slot i's at P + i * resp_stride

A state word is ``pid << 8 | code``: the env process holding the slot and
where its request is (``word``).  Who writes which transition is in the
protocol doc; every word the server reads may have been written by any
process of the user, so the server decides from its own books and takes
a word only as a claim to check (``parse``, ``alive``, the start time).
The header and the schema are the server's alone: it writes them back
whenever they differ from what it made (``Header``).

``check_values`` checks what a caller hands in against the fields (a
``FieldError`` saying what to do).  Pure functions and constants, and the
bells; the atomics over the words (``cas``, ``pause``, loads, stores) are
``wire/atomics.py``'s; any thread.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..errors import FieldError, LayoutError
from ..fields import Field, cannot_store, parse_fields, unconvertible
from ..wire.atomics import cas, store
from ..wire.peer import PID_MAX, process_state  # noqa: F401 (the inference wing's names for them)
from ..wire.peer import process_alive as alive  # noqa: F401
from . import futex

MAGIC = int.from_bytes(b"SHMRINF\x01", "little")
VERSION = 3  # 3: a sealed memfd reached through the server's descriptor (2: a /dev/shm name; 1 had semaphores)
HEADER_BYTES, LINE = 128, 64
# header words
H_MAGIC, H_VERSION, H_PID, H_START, H_STATE, H_SLOTS, H_SIZE, H_SCHEMA = range(8)
H_CTRL, H_REQ, H_REQ_STRIDE, H_RESP, H_RESP_STRIDE, H_TOKEN = range(8, 14)
H_SLEEPING = 15  # the doorbell: the server sets it (then looks once more) before it sleeps on it
OPEN, CLOSED = 1, 2
# a slot's control line: its state word (its reply bell), its env's start time, its env sleeps
SLOT_WORDS, W_STATE, W_START, W_SLEEPS = LINE // 8, 0, 1, 2
# state codes (the low byte of a state word); FREE is the whole word 0
FREE, ATTACHING, IDLE, POSTED, TAKEN, DONE = 0, 1, 2, 3, 4, 5
CODES = frozenset((ATTACHING, IDLE, POSTED, TAKEN, DONE))
CHECK_S = 0.05     # the longest sleep between two looks at whether the other side lives
MAX_SLOTS = 1024


def word(pid: int, code: int) -> int:
    return (int(pid) << 8) | code


def parse(w: int) -> tuple[int, int] | None:
    """(pid, code) of a state word that can be one: a pid a process can
    have and a known code; None for anything else (FREE included)."""
    pid, code = w >> 8, w & 0xFF
    return (pid, code) if 0 < pid < PID_MAX and code in CODES else None


def close_fds(fds: list, pid: int) -> None:
    """Close the descriptors in ``fds`` (a server's channel: its address
    names nothing from then on) and forget them; only in process ``pid``
    (a forked child's copies are its own, and go with it)."""
    if os.getpid() != pid:
        return
    while fds:
        try:
            os.close(fds.pop())
        except OSError:  # EBADF: closed behind its back (a closerange); nothing left to close
            pass


def shut(fds: list, pid: int, live: list) -> None:
    """A server's end (close, its object collected, or the interpreter's
    exit): mark the channel closed, wake every env (``live``: the header
    and control words, once serving), close its descriptor.  Only in
    process ``pid``: a forked child's exit ends nothing of its parent's."""
    if os.getpid() != pid:
        return
    if live:
        hdr, ctrl = live
        store(hdr, H_STATE, CLOSED)
        for k in range(len(ctrl) // SLOT_WORDS):
            futex.wake(futex.word_address(ctrl, k * SLOT_WORDS), futex.WAKE_ALL)
    close_fds(fds, pid)


def ring(hdr, bell) -> None:
    """An env's post: wake the server if it sleeps on its doorbell (the
    first env to swap the word from 1 to 0 wakes it; the others need not).
    ``bell``: ``futex.word_address(hdr, H_SLEEPING)``."""
    if cas(hdr, H_SLEEPING, 1, 0) == 1:
        futex.wake(bell)


def _align(x: int, a: int = LINE) -> int:
    return (x + a - 1) // a * a


def _field_offsets(fields: tuple[Field, ...]) -> tuple[dict[str, int], int]:
    """Each field's offset in a slot's area (16-aligned), and the area's stride."""
    offs, pos = {}, 0
    for f in fields:
        offs[f.name] = pos
        pos = _align(pos + f.item_bytes, 16)
    return offs, _align(max(pos, 1))


@dataclass(frozen=True)
class Layout:
    request: tuple[Field, ...]
    response: tuple[Field, ...]
    slots: int
    schema: bytes
    ctrl: int
    req: int
    req_stride: int
    resp: int
    resp_stride: int
    size: int
    req_offs: dict
    resp_offs: dict


def plan(request, response, slots) -> Layout:
    """The layout of a channel with these fields (any form ``fields.py`` reads)."""
    if isinstance(slots, bool) or not isinstance(slots, (int, np.integer)) or not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots={slots!r}: give the number of env processes, 1 to {MAX_SLOTS}")
    req, resp = parse_fields(request), parse_fields(response)
    schema = json.dumps({"request": [f.to_wire() for f in req],
                         "response": [f.to_wire() for f in resp]}).encode()
    req_offs, req_stride = _field_offsets(req)
    resp_offs, resp_stride = _field_offsets(resp)
    ctrl = _align(HEADER_BYTES + len(schema))
    req_at = ctrl + slots * LINE
    resp_at = req_at + slots * req_stride
    return Layout(req, resp, int(slots), schema, ctrl, req_at, req_stride, resp_at, resp_stride,
                  resp_at + slots * resp_stride, req_offs, resp_offs)


def write_header(buf, lay: Layout, pid: int, start: int, token: int) -> None:
    """The creator's header (before its address is published: no env reads it yet)."""
    h = np.ndarray((16,), np.uint64, buf)
    h[:] = 0
    h[[H_MAGIC, H_VERSION, H_PID, H_START, H_STATE, H_SLOTS, H_SIZE, H_SCHEMA, H_CTRL, H_REQ,
       H_REQ_STRIDE, H_RESP, H_RESP_STRIDE, H_TOKEN]] = [
        MAGIC, VERSION, pid, start, OPEN, lay.slots, lay.size, len(lay.schema), lay.ctrl, lay.req,
        lay.req_stride, lay.resp, lay.resp_stride, token]
    buf[HEADER_BYTES:HEADER_BYTES + len(lay.schema)] = lay.schema


class Header:
    """The server's copy of what it wrote before its header and schema:
    header words 0-14 (word 15, the doorbell, changes) and the schema's
    bytes.  ``mend`` writes them back where any process changed them."""

    def __init__(self, buf, lay: Layout):
        self._buf, self._end = buf, lay.ctrl
        self._words, self._rest = bytes(buf[:H_SLEEPING * 8]), bytes(buf[HEADER_BYTES:lay.ctrl])

    def mend(self) -> bool:
        """True if anything had to be written back."""
        buf, bad = self._buf, False
        if buf[:H_SLEEPING * 8] != self._words:
            buf[:H_SLEEPING * 8], bad = self._words, True
        if buf[HEADER_BYTES:self._end] != self._rest:
            buf[HEADER_BYTES:self._end], bad = self._rest, True
        return bad


def read_layout(buf, name: str) -> tuple[Layout, int, int]:
    """(layout, server pid, server start) of a mapped channel, checked: the
    layout its schema gives must be the one its header states."""
    if len(buf) < HEADER_BYTES:
        raise LayoutError(f"{name} is {len(buf)} bytes: not an inference channel")
    h = [int(x) for x in np.ndarray((16,), np.uint64, buf)]
    if h[H_MAGIC] != MAGIC or h[H_VERSION] != VERSION:
        raise LayoutError(f"{name} is not an inference channel of this build (magic/version "
                          f"{h[H_MAGIC]:#x}/{h[H_VERSION]}, expected {MAGIC:#x}/{VERSION})")
    try:
        n = h[H_SCHEMA]
        if not 0 < n <= len(buf) - HEADER_BYTES:
            raise ValueError(f"schema length {n}")
        schema = json.loads(bytes(buf[HEADER_BYTES:HEADER_BYTES + n]))
        lay = plan(schema["request"], schema["response"], h[H_SLOTS])
    except Exception as exc:  # whatever the bytes are, the answer is one error
        raise LayoutError(f"{name}: its schema does not read ({exc})") from None
    stated = (h[H_SIZE], h[H_CTRL], h[H_REQ], h[H_REQ_STRIDE], h[H_RESP], h[H_RESP_STRIDE])
    if stated != (lay.size, lay.ctrl, lay.req, lay.req_stride, lay.resp, lay.resp_stride) \
            or len(buf) != lay.size:
        raise LayoutError(f"{name}: its header does not match its schema (segment {len(buf)} bytes)")
    return lay, h[H_PID], h[H_START]


def views(buf, lay: Layout):
    """(words, control words, {request field: (slots, *shape) view},
    {response field: view}) over a mapped channel; ``words``: the header
    and everything up to the end of the control lines (slot k's state word
    is ``words[lay.ctrl // 8 + k * SLOT_WORDS]``), for atomics over both."""
    hdr = np.ndarray(((lay.ctrl + lay.slots * LINE) // 8,), np.uint64, buf)
    ctrl = np.ndarray((lay.slots * SLOT_WORDS,), np.uint64, buf, lay.ctrl)

    def area(fields, offs, at, stride):
        return {f.name: np.ndarray((lay.slots, *f.shape), f.dtype, buf, at + offs[f.name],
                                   (stride, *np.empty(f.shape, f.dtype).strides)) for f in fields}
    return (hdr, ctrl, area(lay.request, lay.req_offs, lay.req, lay.req_stride),
            area(lay.response, lay.resp_offs, lay.resp, lay.resp_stride))


def check_values(fields, data: dict, n, what: str) -> list:
    """[(name, array)] of ``data`` against ``fields``: one item's values
    (``n`` None) or n items' along a leading axis; FieldError otherwise."""
    names = {f.name for f in fields}
    if data.keys() != names:
        parts = [f"missing field(s) {sorted(names - data.keys())}"] if names - data.keys() else []
        parts += [f"unknown field(s) {sorted(data.keys() - names)}"] if data.keys() - names else []
        raise FieldError(f"{what}: {', '.join(parts)}; its fields are {sorted(names)}")
    out = []
    for f in fields:
        v, want = data[f.name], f.shape if n is None else (n, *f.shape)
        try:
            a = v if isinstance(v, np.ndarray) else np.asarray(v)
        except Exception as exc:
            raise FieldError(f"{what} field {f.name!r}: {unconvertible(v, exc, str(want))}") from exc
        if a.dtype != f.dtype and not np.can_cast(a.dtype, f.dtype, "same_kind"):
            raise FieldError(f"{what} field {f.name!r}: {cannot_store(a.dtype, f.dtype)}")
        if a.shape != want:
            raise FieldError(f"{what} field {f.name!r}: shape {a.shape}, expected {want}")
        out.append((f.name, a))
    return out


