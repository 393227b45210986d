"""``TableLayout``: the offsets of every array of a table's two segments,
derived from its spec (``layout.py`` draws the map and maps it).

A frame table (``spec.frames``, docs/frames.md) also has, placed by
``framelayout.py``: its frame rings in the rows object after the slots'
rows, and the daemon's copy of every item's frame references in the meta
segment after the per-slot arrays; its framed fields take no room in a
slot.  A table of rows lies exactly as it did before frame tables.

Pure functions of a spec; any thread.
"""

from __future__ import annotations

import msgpack
import numpy as np

from ..schema import TableSpec
from ..framespec import slot_fields
from .framelayout import frame_rings, refs_span, rows_end
from .headers import PAGE, ROWS_OFF, SCHEMA_OFF, align

# a slot's state (the meta segment's ``state`` array).  HELD: sampled for
# the last time (max_times_sampled) and no longer in the table, but a
# learner may still be reading the row: the slot is reused only after that
# learner RELEASEs it (or its lease ends)
FREE, RESERVED, COMMITTED, HELD = 0, 1, 2, 3


class TableLayout:
    """Offsets of every array of a table's two segments, derived from its spec."""

    def __init__(self, spec: TableSpec):
        self.spec = spec
        self.slot_fields = slot_fields(spec.fields, spec.frames)
        slot_rows = _rows_offsets(spec, self.slot_fields)
        self.rings = frame_rings(spec.fields, spec.frames, spec.capacity, slot_rows[-1])
        self.rows_offsets = slot_rows[:-1] + [rows_end(self.rings, slot_rows[-1])]
        # the offsets depend on the header size, which depends on the schema
        # length, which includes the offsets: iterate to the fixed point
        offsets = _meta_offsets(spec, PAGE)
        while True:
            self.schema_bytes = msgpack.packb(
                {"spec": spec.to_wire(), "offsets": offsets, "rows": self.rows_offsets},
                use_bin_type=True)
            self.header_size = align(SCHEMA_OFF + len(self.schema_bytes), PAGE)
            if self.header_size == offsets[0]:
                break
            offsets = _meta_offsets(spec, self.header_size)
        self.offsets = offsets
        (self.gens_off, self.prios_off, self.state_off, self.times_off, self.seqno_off,
         self.lease_pid_off, self.lease_owner_off, self.lease_start_off) = offsets[:8]
        # a frame table's references: uint32[capacity, refs an item] (None: a table of rows)
        self.refs_off = offsets[8] if spec.frames else None
        self.size = offsets[-1]
        # field f's row of slot s: field_offs[f] + s * strides[f], item_bytes long
        self.field_offs = dict(zip((f.name for f in self.slot_fields), slot_rows[:-1]))
        self.row_stride = (_row_stride(self.slot_fields)
                           if spec.row_layout == "slot" and self.slot_fields else 0)
        self.strides = {f.name: self.row_stride or f.item_bytes for f in self.slot_fields}
        self.rows_size = self.rows_offsets[-1]

    def row_span(self, field: str) -> tuple[int, int, int]:
        """(offset, stride, width): ``field``'s row of slot s lies at
        offset + s * stride in the rows segment, ``width`` bytes long."""
        return self.field_offs[field], self.strides[field], self.spec.field(field).item_bytes

    def row_spans(self, fields=None) -> tuple[np.ndarray, np.ndarray]:
        """Where the rows of ``fields`` (names; None: all a slot holds) lie,
        as two int64 arrays (offsets, widths) for ``rowranges.ranges_of``:
        one span a field, slot s's row at offset + s * width; for a slot
        layout one span, the whole rows."""
        if self.row_stride:
            return np.array([ROWS_OFF], np.int64), np.array([self.row_stride], np.int64)
        names = fields if fields is not None else self.field_offs
        return (np.array([self.field_offs[f] for f in names], np.int64).reshape(-1),
                np.array([self.strides[f] for f in names], np.int64).reshape(-1))

    def committed_in(self, image) -> np.ndarray:
        """Which slots a byte image of a meta segment of this layout (a copy,
        a file's bytes) lists as committed."""
        return np.frombuffer(image, np.uint8, self.spec.capacity, self.state_off) == COMMITTED


_PER_SLOT = (4, 8, 1, 4, 8, 4, 8, 8)  # bytes a slot in gens ... lease_start


def _meta_offsets(spec: TableSpec, header_size: int) -> list[int]:
    pos, out = header_size, []
    for width in _PER_SLOT:
        out.append(pos)
        pos = align(pos + width * spec.capacity, 64)
    if spec.frames:  # a frame table's references
        off, n = refs_span(spec.capacity, spec.frames, pos)
        out.append(off)
        pos = align(off + n, 64)
    out.append(align(pos, PAGE))     # segment size
    return out


def _rows_offsets(spec: TableSpec, fields) -> list[int]:
    """Each of ``fields``' first row (those a slot holds), then where they
    end.  "field": each field's rows in an array of their own, on a page of
    its own; "slot": every field of a slot together (``_in_row``), one row
    after another."""
    if spec.row_layout == "slot" and fields:
        return ([ROWS_OFF + o for o in _in_row(fields)]
                + [align(ROWS_OFF + spec.capacity * _row_stride(fields), PAGE)])
    pos, out = ROWS_OFF, []
    for f in fields:
        out.append(pos)
        pos = align(pos + spec.capacity * f.item_bytes, PAGE)
    out.append(pos)                   # where the rows end
    return out


def _in_row(fields) -> list[int]:
    """A slot layout's field offsets inside a row, in the fields' order, each
    aligned for its dtype (numpy copies misaligned elements slowly)."""
    pos, out = 0, []
    for f in fields:
        pos = align(pos, f.dtype.alignment)
        out.append(pos)
        pos += f.item_bytes
    return out


def _row_stride(fields) -> int:
    """Bytes from one slot's row to the next in a slot layout: the fields
    and their padding, rounded up so every row's fields stay aligned."""
    end = _in_row(fields)[-1] + fields[-1].item_bytes
    return align(end, max(f.dtype.alignment for f in fields))
