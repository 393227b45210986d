"""Byte layout of a table's two segments (docs/layout.md draws them), and typed access.

A table is two POSIX shared-memory objects, so that what the daemon decides
cannot be written by the clients it decides for:

* the **meta** segment ``shmreplay.<instance>.t.<table>``: header, live
  words, schema and every per-slot array.  Written by the daemon only;
  clients of other users may only read it (its mode has no group or other
  write bit) and every client maps it ``PROT_READ``.
* the **rows** segment ``shmreplay.<instance>.r.<table>``: a small header
  and the field rows.  Clients write the rows of slots they reserved and
  read the rest (a table only its creator writes, ``writers="creator"``:
  group read-only, so other users map it read-only); the daemon never
  touches it through a mapping once the table is served (checkpoints read it with ``pread``), so a client that
  truncates it cannot make the daemon fault.

``TableMap`` maps both as numpy views; ``LiveWords`` reads and writes the
live counter words by name.

Meta segment::

    0      fixed header (HEADER dtype, 120 bytes): magic, layout version,
           header size, capacity, creator pid, creation time, segment size,
           offsets of the first per-slot arrays, schema length, owner pid and
           the owner's start time (the daemon serving the table now), the
           rows segment's size
    192    live words, 16 x uint64 (daemon only): size, inserts, pending,
           samples, deletes, free, uses left, sampleable mass (float64
           bits), then the epoch, bumped each time a daemon adopts or
           restores the table
    320    schema: msgpack of TableSpec.to_wire() plus every offset
    H      gens        uint32[capacity]  generation stamp of each slot
           prios       float64[capacity] raw priority of each committed slot
           state       uint8[capacity]   FREE / RESERVED / COMMITTED / HELD
           times       uint32[capacity]  times the item in the slot was sampled
           seqno       uint64[capacity]  commit number of the item (1, 2, ...)
           lease_pid   uint32[capacity]  pid of the client a RESERVED slot is leased to
           lease_owner uint64[capacity]  the granting daemon's pid << 32 | the client's id there
           lease_start uint64[capacity]  the client process's start time (clock ticks)
           refs        uint32[capacity, references an item]  a frame table
                       only: the frames each slot's item references, the
                       daemon's copy (NO_REF: the slot holds none)

Rows segment::

    0      ROWS_HEADER: magic, layout version, capacity, the meta segment's
           creation time, size; written at create for a human and for
           ``shmreplay cleanup`` (which only ever keeps more for it), and
           never what anything else decides by: any client may write it
    4096   the rows, in the spec's ``row_layout``:
           "field": field 0  dtype[capacity, *shape]  (each array on a 4 KiB page)
                    field 1  ...
           "slot":  row 0, row 1, ... (``row_stride`` bytes each): every
                    field of the slot, in schema order, each aligned for
                    its dtype (``_in_row``)
           (a frame table's stacked fields are not in a slot)
    R      a frame table only (layout version 5): one frame ring a base
           field, each on a page of its own: frame f at ring + f * frame
           bytes (``framelayout.py``)

Nothing in the rows object decides whether a table can be attached,
adopted or restarted: its layout, capacity and creation stamp come from
the meta segment (daemon-written, read-only to clients) or the daemon's
metadata file.  Its size is the one thing a client can change that
matters (``ftruncate``): the daemon gives it back the layout's size when it
adopts the table and whenever a client opens it (``segment.restore_size``),
and clients map exactly the layout's size of an object at least that large.

``H`` is 320 + len(schema) rounded up to 4 KiB.  Every offset follows from
the schema, and the schema also stores them so a reader can check both
agree; a change to this map must bump its version (``headers.py``:
LAYOUT_VERSION for a table of rows, FRAME_LAYOUT_VERSION for a frame
table's).
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from ..errors import LayoutError
from ..schema import TableSpec
from .framelayout import NO_REF
from .headers import (HEADER, LAYOUT_VERSIONS, LIVE_OFF, MAGIC, ROWS_HEADER, ROWS_MAGIC, SCHEMA_OFF,
                      decode_schema, layout_version, meta_header, same_table, schema_span)
from .livewords import LIVE_WORDS, LiveWords
from .names import SHM_DIR
from .peer import process_start
from .rowfile import rows_location
from .segment import Segment
# the slot states and the offsets live in tablelayout.py; importers take them from here
from .tablelayout import COMMITTED, FREE, HELD, RESERVED, TableLayout  # noqa: F401


class TableMap:
    """numpy views over a table's mapped segments.

    The daemon's engine thread is the only writer of the meta segment;
    clients write field rows of slots they reserved and read everything
    else (their meta views are read-only).  Views are created once; hot
    paths index them directly.
    """

    def __init__(self, meta: Segment, rows: Segment, layout: TableLayout):
        self.meta, self.rows = meta, rows
        self.name = meta.name
        self.layout = layout
        self.spec = layout.spec
        buf = meta.buf
        c = self.spec.capacity
        self.header = np.ndarray((), HEADER, buffer=buf, offset=0)
        self.live = np.ndarray((LIVE_WORDS,), np.uint64, buffer=buf, offset=LIVE_OFF)
        lo = layout
        self.gens = np.ndarray((c,), np.uint32, buffer=buf, offset=lo.gens_off)
        self.prios = np.ndarray((c,), np.float64, buffer=buf, offset=lo.prios_off)
        self.state = np.ndarray((c,), np.uint8, buffer=buf, offset=lo.state_off)
        self.times = np.ndarray((c,), np.uint32, buffer=buf, offset=lo.times_off)
        self.seqno = np.ndarray((c,), np.uint64, buffer=buf, offset=lo.seqno_off)
        self.lease_pid = np.ndarray((c,), np.uint32, buffer=buf, offset=lo.lease_pid_off)
        self.lease_owner = np.ndarray((c,), np.uint64, buffer=buf, offset=lo.lease_owner_off)
        self.lease_start = np.ndarray((c,), np.uint64, buffer=buf, offset=lo.lease_start_off)
        self.words = LiveWords(self.live)
        # the fields a slot holds; a frame table's stacked fields are in its
        # rings (base field -> uint8[frames, frame bytes]) and its items'
        # references (uint32[capacity, references an item], daemon-written)
        self.fields = {f.name: field_view(rows.buf, lo, f) for f in lo.slot_fields}
        self.rings = {r.base: np.ndarray((r.frames, r.frame_bytes), np.uint8, buffer=rows.buf,
                                         offset=r.offset) for r in lo.rings}
        self.refs = (np.ndarray((c, self.spec.frames.refs_per_item), np.uint32, buffer=buf,
                                offset=lo.refs_off) if lo.refs_off is not None else None)

    @classmethod
    def create(cls, name: str, spec: TableSpec, gid: int = -1) -> "TableMap":
        """Daemon: both segments, mode 0600 until ``open_to_clients``, so
        nobody else maps them while they are filled (a restore)."""
        layout = TableLayout(spec)
        meta = Segment.create(name, layout.size, 0o600, (-1, gid))
        try:
            kind, where = rows_location(name, spec)
            rows = kind.create(where, layout.rows_size, 0o600, (-1, gid))
        except BaseException:
            meta.unlink()
            meta.close()
            raise
        tm = cls(meta, rows, layout)
        if tm.refs is not None:
            tm.refs[:] = NO_REF  # no slot holds a frame yet
        created = time.time_ns()
        h = tm.header
        h["layout_version"] = layout_version(spec)
        h["header_size"] = layout.header_size
        h["capacity"] = spec.capacity
        h["creator_pid"] = h["owner_pid"] = os.getpid()
        h["owner_start"] = process_start(os.getpid())
        h["created_ns"] = created
        h["segment_size"] = layout.size
        h["gens_off"], h["prios_off"], h["state_off"] = layout.gens_off, layout.prios_off, layout.state_off
        h["times_off"], h["seqno_off"] = layout.times_off, layout.seqno_off
        h["rows_size"] = layout.rows_size
        h["schema_len"] = len(layout.schema_bytes)
        meta.buf[SCHEMA_OFF:SCHEMA_OFF + len(layout.schema_bytes)] = layout.schema_bytes
        r = np.ndarray((), ROWS_HEADER, buffer=rows.buf, offset=0)
        r["layout_version"], r["capacity"], r["created_ns"] = layout_version(spec), spec.capacity, created
        r["segment_size"] = layout.rows_size
        r["magic"] = ROWS_MAGIC
        # magic last: a reader that sees it sees a complete header
        h["magic"] = MAGIC
        return tm

    def open_to_clients(self, mode: int, gid: int = -1) -> None:
        """Daemon: give the segments their final modes.  The meta segment
        never gets a group or other write bit, whatever ``mode`` says."""
        self.meta.set_mode(meta_mode(mode), gid)
        self.rows.set_mode(rows_mode(self.spec, mode), gid)

    @classmethod
    def adopt(cls, name: str, mode: int, gid: int = -1, check_spec=None) -> "TableMap":
        """Daemon: map the segments a dead daemon of this instance left,
        refusing any that this user did not make (``Segment.open_owned``).
        ``check_spec(spec)`` may refuse the stored definition (raise) before
        its rows are opened."""
        meta = Segment.open_owned(name, meta_mode(mode), gid)
        try:
            spec = read_spec(meta)
            if check_spec is not None:
                check_spec(spec)
            kind, where = rows_location(name, spec)
            # the rows' size is the layout's, whatever a client did to it
            rows = kind.open_owned(where, rows_mode(spec, mode), gid, size=TableLayout(spec).rows_size)
        except BaseException:
            meta.close()
            raise
        return cls._checked(meta, rows)

    @classmethod
    def attach(cls, name: str, expected: TableSpec | None = None, rows_fd: int | None = None) -> "TableMap":
        """Client: the meta segment read-only, the rows read-write, or
        read-only if the table is written only by its creator
        (``writers="creator"``: rows group read-only) and this user may not
        open them for writing.  ``rows_fd``: a writable descriptor of the
        rows the daemon passed (taken: closed once mapped)."""
        try:
            meta = Segment.attach(name, None if expected is None else TableLayout(expected).size,
                                  read_only=True)
        except BaseException:
            if rows_fd is not None:
                os.close(rows_fd)
            raise
        try:
            spec = read_spec(meta)
            kind, where = rows_location(name, spec)
            path = where if kind is not Segment else SHM_DIR + where
            read_only = rows_fd is None and spec.writer_only and not os.access(path, os.W_OK)
            map_size = TableLayout(spec).rows_size
            rows_fd, fd = None, rows_fd  # kind.attach's from here: it closes it on every path
            rows = kind.attach(where, map_size=map_size, read_only=read_only, fd=fd)
        except BaseException:
            if rows_fd is not None:
                os.close(rows_fd)
            meta.close()
            raise
        return cls._checked(meta, rows, expected)

    @classmethod
    def _checked(cls, meta: Segment, rows: Segment, expected: TableSpec | None = None) -> "TableMap":
        try:
            spec = read_spec(meta)
            if expected is not None and spec != expected:
                raise LayoutError(f"segment {meta.name} holds table {spec}, expected {expected}")
            layout = TableLayout(spec)
            if layout.size != meta.size:
                raise LayoutError(f"segment {meta.name} is {meta.size} bytes, layout says {layout.size}")
            if rows.size != layout.rows_size:  # mapped at the layout's size: defend anyway
                raise LayoutError(f"segment {rows.name} is {rows.size} bytes, layout says {layout.rows_size}")
            return cls(meta, rows, layout)
        except BaseException:
            meta.close()
            rows.close()
            raise

    def listed_in(self, image) -> np.ndarray | None:
        """Which slots a byte image of this table's meta segment (its
        metadata file's bytes) lists as committed; None if the image is not
        of this incarnation of this table (another magic, layout version,
        creation time or size)."""
        h = meta_header(image)
        if h is None or not same_table(h, self.header) or len(image) != self.layout.size:
            return None
        return self.layout.committed_in(image)

    def unlink(self) -> None:
        self.meta.unlink()
        self.rows.unlink()

    def release(self) -> None:
        """Drop the views and unmap (views handed to users keep it mapped)."""
        self.header = self.live = self.gens = self.prios = self.state = None
        self.times = self.seqno = self.words = None
        self.lease_pid = self.lease_owner = self.lease_start = None
        self.fields, self.rings, self.refs = {}, {}, None
        self.meta.close()
        self.rows.close()


def field_view(buf, layout: TableLayout, f) -> np.ndarray:
    """Field ``f``'s rows in a rows segment mapped at ``buf``: shape
    (capacity, *f.shape), each row C-contiguous, rows ``layout.strides``
    apart (a slot layout's view is not contiguous: gather it with fancy
    indexing or ``client/gather.py``, never ``ndarray.take``, which would
    first copy the whole field)."""
    inner = tuple(f.dtype.itemsize * math.prod(f.shape[i + 1:]) for i in range(len(f.shape)))  # C order
    return np.ndarray((layout.spec.capacity, *f.shape), f.dtype, buffer=buf,
                      offset=layout.field_offs[f.name], strides=(layout.strides[f.name], *inner))


def meta_mode(mode: int) -> int:
    """The meta segment's mode: ``mode`` without group or other write."""
    return (mode & ~0o022) | 0o600


def rows_mode(spec: TableSpec, mode: int) -> int:
    """The rows' mode: ``mode``, or the meta segment's (no group or other
    write) for a table only its creator writes: other users map its rows
    read-only, so none can put values under its writer's items."""
    return meta_mode(mode) if spec.writer_only else mode


def read_spec(seg: Segment) -> TableSpec:
    if seg.size < SCHEMA_OFF:
        raise LayoutError(f"segment {seg.name} is too small ({seg.size} bytes) to be a table")
    h = np.ndarray((), HEADER, buffer=seg.buf, offset=0)
    if bytes(h["magic"]) != MAGIC:
        raise LayoutError(f"segment {seg.name} is not a shmreplay table (magic {bytes(h['magic'])!r})")
    version = int(h["layout_version"])
    if version not in LAYOUT_VERSIONS:
        raise LayoutError(
            f"segment {seg.name} has layout version {version}, this build reads versions "
            f"{', '.join(map(str, LAYOUT_VERSIONS))}")
    span = schema_span(h, seg.size)
    if span is None:
        raise LayoutError(f"segment {seg.name} has a corrupt schema length {int(h['schema_len'])}")
    off, n = span
    spec, doc = decode_schema(seg.buf[off:off + n], f"segment {seg.name}")
    if layout_version(spec) != version:  # a frame table's map under a table of rows' version, or back
        raise LayoutError(f"segment {seg.name} has layout version {version}, but its schema "
                          f"{'declares' if spec.frames else 'declares no'} frames")
    layout = TableLayout(spec)
    if layout.offsets != doc.get("offsets") or layout.rows_offsets != doc.get("rows"):
        raise LayoutError(f"segment {seg.name}: stored offsets disagree with its schema")
    return spec
