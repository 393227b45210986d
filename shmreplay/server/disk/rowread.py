"""Reading a table's rows from the daemon, without mapping them.

Clients may write the rows segment, so one of them may also truncate it.
A process that touches a truncated mapping dies of SIGBUS; ``pread`` of a
truncated object just returns fewer bytes.  So the daemon, which must
survive any client, reads rows (for checkpoints) only through
``RowSource`` and never through a mapping once the table is served.

Any thread; one ``RowSource`` per reader.
"""

from __future__ import annotations

import os

import numpy as np

from ...errors import ReplayError


class RowSource:
    """The rows of one table, read by ``pread`` from its own descriptor (a
    dup, so a table dropped meanwhile does not close it under the reader)."""

    def __init__(self, tmap):
        self.name = tmap.rows.name
        self.fd = os.dup(tmap.rows.fd)
        self.layout = tmap.layout

    def take(self, field, slots: np.ndarray) -> np.ndarray:
        """``field``'s rows of ``slots``, in that order.  Slots next to each
        other are read in one call (a FIFO table's oldest items usually are);
        in a slot layout that call reads their whole rows, and the field is
        cut out of them."""
        n = slots.shape[0]
        base, stride, ib = self.layout.row_span(field.name)
        order = np.argsort(slots, kind="stable")
        s = slots[order]
        raw = np.empty((n, stride), np.uint8)
        starts = np.flatnonzero(np.diff(s, prepend=-2) != 1)
        ends = np.append(starts[1:], n)
        flat = memoryview(raw.reshape(-1))
        for a, b in zip(starts.tolist(), ends.tolist()):
            # from this field's first byte: the last slot's read ends at its
            # own field's end, inside the segment
            self._read(flat[a * stride:b * stride - (stride - ib)], base + int(s[a]) * stride)
        out = np.empty((n, ib), np.uint8)
        out[order] = raw[:, :ib]
        return out.view(field.dtype).reshape(n, *field.shape)

    def take_frames(self, base: str, frames: np.ndarray) -> np.ndarray:
        """Frames ``frames`` (sorted, distinct) of ``base``'s ring, as
        uint8[n, frame bytes]; runs of frames next to each other in one call."""
        ring = next(r for r in self.layout.rings if r.base == base)
        n, fb = frames.shape[0], ring.frame_bytes
        out = np.empty((n, fb), np.uint8)
        flat = memoryview(out.reshape(-1))
        starts = np.flatnonzero(np.diff(frames, prepend=-2) != 1)
        for a, b in zip(starts.tolist(), np.append(starts[1:], n).tolist()):
            self._read(flat[a * fb:b * fb], ring.offset + int(frames[a]) * fb)
        return out

    def _read(self, into: memoryview, offset: int) -> None:
        while into.nbytes:
            got = os.preadv(self.fd, [into], offset)
            if got <= 0:
                raise ReplayError(f"rows segment {self.name} is shorter than its table "
                                  "(truncated by a client with write access?)")
            into, offset = into[got:], offset + got

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
