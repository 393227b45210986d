"""Which frames of a stacked observation a writer must store (docs/frames.md,
"Writers do it for the user").

A stream's observations are stacks of frames, as gymnasium's
``FrameStackObservation`` returns them: each step's stack is the last
one's shifted by a frame, plus the new one; an episode's first stack is
its first frame repeated (``padding_type="reset"``, gymnasium's default)
or zero frames and then it (``"zero"``).  ``FrameWindow`` remembers the
frames a writer stored lately by their contents: each frame of a new
stack that equals one of them, byte for byte, is referenced again, and
only the others are stored.  So a stream stores one frame a step, an
episode's padding once, an R2D2 sequence's overlap with the last one
never again, and a plain insert of ``obs`` and ``next_obs`` stacks one
frame a transition; whatever the user gives, the stack rebuilt from the
references is the one given, byte for byte (a checksum finds candidates,
a full comparison decides).  A window is one writer's: frames of two
writers are never mixed, nor two episodes' unless their bytes are equal.

Who calls it: a writer (``NStepWriter``, ``SequenceWriter``) or a table
handle's plain inserts, through its ``framestore.FrameStore``, with the
frames its own leases hold: ``forget`` the frames of a lease before
giving it back.  One thread at a time, the writer's.
"""

from __future__ import annotations

from collections import deque

import numba
import numpy as np

from ..numbaconf import JIT

_PRIME = np.uint64(0x100000001B3)
_BASIS = np.uint64(0xCBF29CE484222325)


@numba.njit(**JIT)
def frame_checksum(b) -> np.uint64:
    """FNV-1a over a frame's bytes (uint8, 1-D), eight at a time: which
    stored frames may equal it (equal frames have equal sums; a comparison
    decides).  Twin: ``tests/test_frame_stream.py``."""
    h = _BASIS
    n8 = b.shape[0] // 8
    w = b[:n8 * 8].view(np.uint64)
    for i in range(n8):
        h = (h ^ w[i]) * _PRIME
    for i in range(n8 * 8, b.shape[0]):
        h = (h ^ np.uint64(b[i])) * _PRIME
    return h


class FrameWindow:
    """The last ``size`` frames a writer stored, by checksum."""

    def __init__(self, size: int):
        self.size = size
        self._by_sum: dict[int, list[int]] = {}
        self._order: deque[tuple[int, int]] = deque()  # (checksum, frame), oldest first

    def __len__(self) -> int:
        return len(self._order)

    def refs(self, stack: np.ndarray, store, fetch) -> np.ndarray:
        """The references of ``stack`` (its frames along the first axis):
        each frame found in the window is referenced again, each other one
        stored with ``store(frame) -> reference`` (a frame the writer's
        lease holds) and remembered.  ``fetch(reference)`` gives back a
        stored frame's bytes for the comparison."""
        out = np.empty(stack.shape[0], dtype=np.uint32)
        for d in range(stack.shape[0]):
            frame = np.ascontiguousarray(stack[d])
            flat = frame.reshape(-1).view(np.uint8)
            key = int(frame_checksum(flat))
            ref = None
            for cand in self._by_sum.get(key, ()):
                if np.array_equal(fetch(cand).reshape(-1).view(np.uint8), flat):
                    ref = cand
                    break
            if ref is None:
                ref = store(frame)
                self._remember(key, ref)
            out[d] = ref
        return out

    def _remember(self, key: int, ref: int) -> None:
        self._by_sum.setdefault(key, []).append(ref)
        self._order.append((key, ref))
        while len(self._order) > self.size:
            self._drop(*self._order.popleft())

    def _drop(self, key: int, ref: int) -> None:
        refs = self._by_sum[key]
        refs.remove(ref)
        if not refs:
            del self._by_sum[key]

    def forget(self, refs) -> None:
        """Frames no longer held (their lease is being given back): never
        referenced again from here."""
        gone = {int(r) for r in refs}
        kept = deque()
        for key, ref in self._order:
            if ref in gone:
                self._drop(key, ref)
            else:
                kept.append((key, ref))
        self._order = kept
