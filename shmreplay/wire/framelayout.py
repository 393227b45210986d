"""Where a frame table's frames and references lie (docs/frames.md), for
``tablelayout.TableLayout`` to place:

* in the rows object, after the slots' rows, one **frame ring** a base
  field (``FrameRing``): ``frames`` frames of ``frame_bytes`` each, the
  first on a page of its own, frame ``f`` at ``offset + f * frame_bytes``;
  a framed field takes no room in a slot (``framespec.slot_fields``);
* in the meta segment, after the per-slot arrays, the daemon's copy of
  every item's references: uint32[capacity, refs an item], 64-byte
  aligned (``refs_span``); ``NO_REF`` in a slot that holds none.

Pure functions of a table's fields and declaration; any thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..fields import Field
from ..framespec import Frames, frame_bytes
from .headers import PAGE, align

# a slot that holds no frame references has this in every column: no
# ring's frame (a ring holds at most 2**32 - 1 frames, framespec.MAX_FRAMES:
# 0 .. 2**32 - 2).  A new table's references are all NO_REF
NO_REF = np.uint32(0xFFFFFFFF)


@dataclass(frozen=True)
class FrameRing:
    base: str                  # the field whose frames it holds
    offset: int                # byte offset of frame 0 in the rows object
    frames: int                # frames it holds
    frame_bytes: int           # bytes of one frame
    dtype: np.dtype
    frame_shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.frames * self.frame_bytes


def frame_rings(fields: tuple[Field, ...], frames: Frames, capacity: int,
                start: int) -> tuple[FrameRing, ...]:
    """Each base's ring, in field order, from ``start`` (the end of the
    slots' rows in the rows object), each on a page of its own."""
    by_name = {f.name: f for f in fields}
    rings, pos = [], align(start, PAGE)
    for base in frames.bases:
        f = by_name[base]
        ring = FrameRing(base, pos, frames.ring_frames(capacity), frame_bytes(f), f.dtype, f.shape[1:])
        rings.append(ring)
        pos = align(ring.end, PAGE)
    return tuple(rings)


def rows_end(rings: tuple[FrameRing, ...], start: int) -> int:
    """The rows object's size once its rings follow the rows ending at ``start``."""
    return align(rings[-1].end, PAGE) if rings else start


def refs_span(capacity: int, frames: Frames, start: int) -> tuple[int, int]:
    """(offset, bytes) of the references in the meta segment, from ``start``."""
    off = align(start, 64)
    return off, capacity * frames.refs_per_item * 4
