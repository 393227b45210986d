"""``FrameStore``: one writer's frames in a frame table (docs/frames.md,
"What a writer stores").

A writer (a table handle's plain inserts, an ``NStepWriter``) turns each
item's stacks into frame references here: ``item_refs`` hands every stack
to the ring's ``FrameWindow``, which references again the frames the
writer stored lately with the same bytes and stores the others into
frames of the writer's own **frame leases** (FRAMES, a round trip for a
``chunk`` of frames at a time).  The writer sends the references with its
item's commit (FCOMMIT), then calls ``settle``.

Why references are safe to send: a writer references only frames its own
leases hold (every frame its window remembers is in one; a lease goes
back only after its frames left the window, and only in ``settle``, after
the commit that referenced them was sent, so the daemon counts the
item's references before the lease's count goes).  A frame the daemon
counts is never leased to another writer (``server/tables/frames/book.py``).

What it owns: per ring (base field), the window, the leases held as
chunks (lease id, frames, how many used, the stored number of the last),
and the table as mapped now (``bind``: the daemon's id, the rings, the
live words and the epoch the leases were taken under).  A daemon that
restarted voided every lease: a frame is written only while the epoch
holds, and ``void`` (the connection went) drops everything without a word
to the daemon, which ended the leases with the connection.

Who calls it: its writer, one call at a time on the writer's thread, and
its table handle (``bind``, ``void``), which makes it (``FrameTable.frame_store``).
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ..errors import DaemonUnavailable, ReplayTimeout
from ..wire import framerecords as FR
from .framestream import FrameWindow

# a writer's lease asks for at most this many frames: one round trip per
# CHUNK_MAX steps of a stream (a frame a step), a 256-slot Atari lease's
# worth of frames in 4 trips
CHUNK_MAX = 64
# waits for a frame when every free frame is held (other writers' leases,
# slots held for learners): polled, from 1 ms doubling to 50 ms
POLL_MIN_S, POLL_MAX_S = 1e-3, 50e-3


def chunk_size(spec) -> int:
    """Frames one lease asks for: a 32nd of what one client may hold
    (``FrameLeases``' cap: half the ring's slack), 2 to CHUNK_MAX.  A
    writer holds its window's frames (an n-step writer's: depth + n + 2)
    in the leases they came from, and the next chunk: small chunks let
    several writers of one client (a vector env's streams) share the cap,
    at a round trip per chunk of steps."""
    per_owner = (spec.frames.ring_frames(spec.capacity) - spec.capacity * spec.frames.per_item) // 2
    return max(2, min(CHUNK_MAX, per_owner // 32))


class FrameStore:
    """One writer's frames: windows and frame leases, per ring."""

    def __init__(self, spec, session, window: int, timeout: float | None = None):
        self.name = spec.name
        self.frames = spec.frames
        self.timeout = timeout  # how long a lease may wait for free frames (None: the client's)
        self._session = session
        self._bases = spec.frames.bases
        by_name = {f.name: f for f in spec.fields}
        self._frame_shape = {b: by_name[b].shape[1:] for b in self._bases}
        self._dtype = {b: by_name[b].dtype for b in self._bases}
        self._cols = [(name, self._bases.index(base)) for name, base, _, _ in spec.frames.columns]
        self.chunk = chunk_size(spec)
        self._windows = [FrameWindow(window) for _ in self._bases]
        self._chunks: list[deque] = [deque() for _ in self._bases]  # [lid, frames, used, last no]
        self._stored = [0] * len(self._bases)  # frames stored so far, per ring
        self._table_id, self._rings, self._words, self._epoch = 0, [], None, None

    # ---- the table as mapped now (its handle) ----
    def bind(self, table_id: int, rings: dict, words, epoch: int) -> None:
        self._table_id = table_id
        self._rings = [rings[b] for b in self._bases]
        self._words, self._epoch = words, epoch

    def void(self) -> None:
        """The connection went: its leases ended with it; forget them and
        every frame they held."""
        for r in range(len(self._bases)):
            self._chunks[r].clear()
            self._windows[r] = FrameWindow(self._windows[r].size)

    # ---- a writer's item ----
    def item_refs(self, stacks: dict, deadline: float | None) -> np.ndarray:
        """The references of one item, uint32[1, references an item], its
        framed fields' ``stacks`` (name -> array of the field's shape)
        stored as needed.  Send them with the item's commit, then ``settle``."""
        out = np.empty((1, self.frames.refs_per_item), dtype=np.uint32)
        col = 0
        for name, r in self._cols:
            stack = np.asarray(stacks[name], dtype=self._dtype[self._bases[r]])  # compared as stored
            d = stack.shape[0]
            out[0, col:col + d] = self._windows[r].refs(
                stack, lambda frame, r=r: self._store(r, frame, deadline),
                lambda ref, r=r: self._rings[r][ref])
            col += d
        return out

    def settle(self) -> None:
        """After the commit of the references ``item_refs`` gave: give
        back every lease whose frames are all used and out of the window."""
        for r, chunks in enumerate(self._chunks):
            oldest = self._stored[r] - self._windows[r].size  # frames stored before it left the window
            while len(chunks) > 1 and chunks[0][2] == chunks[0][1].shape[0] and chunks[0][3] < oldest:
                lid, frames, _, _ = chunks.popleft()
                self._windows[r].forget(frames)  # none is there: its frames left (asserted by tests)
                self._send_back(lid)

    def release(self) -> None:
        """Give back every lease (the writer is done; nothing it has yet
        to commit references a frame)."""
        session = self._session
        if session.pipe is None or session.pid == 0:
            return
        for r, chunks in enumerate(self._chunks):
            while chunks:
                self._send_back(chunks.popleft()[0])
            self._windows[r] = FrameWindow(self._windows[r].size)

    # ---- frames ----
    def _store(self, r: int, frame: np.ndarray, deadline: float | None) -> int:
        """Write ``frame`` into the next frame of ring ``r``'s lease (a new
        lease when it is used up); returns its reference.  ``frame`` has the
        ring's dtype already (``item_refs`` cast its stack)."""
        chunks = self._chunks[r]
        if not chunks or chunks[-1][2] == chunks[-1][1].shape[0]:
            chunks.append(self._lease(r, deadline))
        if self._words.epoch != self._epoch:  # a restarted daemon took the table over
            raise DaemonUnavailable(f"table {self.name!r} was taken over by a restarted daemon; "
                                    "this writer's frame leases died with the old one")
        c = chunks[-1]
        ref = int(c[1][c[2]])
        self._rings[r][ref] = frame.reshape(-1).view(np.uint8)
        c[2] += 1
        self._stored[r] += 1
        c[3] = self._stored[r]
        return ref

    def _lease(self, r: int, deadline: float | None) -> list:
        """A new lease of ring ``r``: a round trip; while none is free, ask
        again (1 ms doubling to 50 ms) until ``deadline`` (the client's
        timeout when None)."""
        pipe = self._session.pipe
        if deadline is None:
            deadline = time.monotonic() + (pipe.timeout if self.timeout is None else self.timeout)
        pause = POLL_MIN_S
        while True:
            seq = pipe.send(FR.put_frames, self._table_id, r, self.chunk)
            lid, frames = pipe.wait(seq, FR.read_frames_reply)
            if lid:
                return [lid, frames, 0, self._stored[r]]
            if time.monotonic() + pause > deadline:
                raise ReplayTimeout(
                    f"table {self.name!r}: no frame of its {self._bases[r]!r} ring came free in "
                    "time; every frame is referenced by slots being read or written, or held by "
                    "writers' frame leases: close writers you no longer use, or give the table "
                    "a larger capacity")
            time.sleep(pause)
            pause = min(POLL_MAX_S, 2 * pause)

    def _send_back(self, lid: int) -> None:
        self._session.pipe.send(FR.put_frames_back, self._table_id, lid, wake=False)
