"""Byte layout of a table segment (docs/layout.md draws it), and typed access to it.

``TableMap`` maps a segment as numpy views; ``LiveWords`` reads and writes
its live counter words by name.  Who writes what: the daemon's engine
thread writes the header's owner, the live words, gens, prios, state,
times and seqno; a client writes only the field rows of slots it reserved,
and reads the rest.

::

    0      fixed header (HEADER dtype, 112 bytes): magic, layout version,
           header size, capacity, creator pid, creation time, segment size,
           offsets of the per-slot arrays, schema length, owner pid and the
           owner's start time (the daemon serving the table now)
    128    live words, 16 x uint64 (written by the daemon only): size,
           inserts, pending, samples, deletes, free, uses left, sampleable
           mass (float64 bits) on the first cache line, which clients read
           for len() and the rate-limiter probes; then the epoch, bumped
           each time a daemon adopts or restores the table
    256    schema: msgpack of TableSpec.to_wire() plus the field offsets
    H      gens     uint32[capacity]   generation stamp of each slot
           prios    float64[capacity]  raw priority of each committed slot
           state    uint8[capacity]    FREE / RESERVED / COMMITTED / HELD
           times    uint32[capacity]   times the item in the slot was sampled
           seqno    uint64[capacity]   commit number of the item (1, 2, ...)
           field 0  dtype[capacity, *shape]   (each array starts on a 4 KiB page)
           field 1  ...

``H`` is 256 + len(schema) rounded up to 4 KiB.  Every offset follows from
the schema, and the header also stores them so a reader can check both
agree; a change to this map must bump LAYOUT_VERSION.
"""

from __future__ import annotations

import os
import time

import msgpack
import numpy as np

from ..errors import LayoutError
from ..schema import TableSpec, spec_from_wire
from .segment import Segment

MAGIC = b"SHMRTBL\x00"
LAYOUT_VERSION = 3  # 2: HELD state, times and seqno arrays, limiter live words; 3: owner, epoch
PAGE = 4096

HEADER = np.dtype([
    ("magic", "S8"), ("layout_version", "<u4"), ("header_size", "<u4"),
    ("capacity", "<u8"), ("creator_pid", "<u8"), ("created_ns", "<u8"),
    ("segment_size", "<u8"), ("gens_off", "<u8"), ("prios_off", "<u8"),
    ("state_off", "<u8"), ("schema_len", "<u4"), ("reserved", "<u4"),
    ("times_off", "<u8"), ("seqno_off", "<u8"),
    ("owner_pid", "<u8"), ("owner_start", "<u8"),
])
LIVE_OFF = 128
LIVE_WORDS = 16
LIVE_SIZE = 0      # committed items (what len(table) reports)
LIVE_INSERTS = 1   # items committed since creation
LIVE_PENDING = 2   # slots reserved by writers, not committed yet (count as inserts for the limiter)
LIVE_SAMPLES = 3   # items handed out by SAMPLE since creation
LIVE_DELETES = 4   # items that left: evicted, or removed after max_times_sampled
LIVE_FREE = 5      # slots on the free list
LIVE_USES = 6      # samples the committed items can still give (max_times_sampled tables)
LIVE_MASS = 7      # float64: the sampler's total mass; 0 means nothing can be drawn
# How many times a daemon adopted or restored this table.  A writer checks
# it before it copies into slots leased from a daemon: a changed epoch means
# that daemon died and its leases are void (recovery.py).
LIVE_EPOCH = 8
SCHEMA_OFF = 256



class LiveWords:
    """The live words by name.  Reads go through a memoryview, so each is a
    plain Python int (cheaper on a writer's hot path than a numpy scalar);
    the engine thread is the only writer."""

    __slots__ = ("_w", "_mass")

    def __init__(self, words: np.ndarray):
        self._w = memoryview(words).cast("B").cast("Q")
        self._mass = words[LIVE_MASS:LIVE_MASS + 1].view(np.float64)

    size = property(lambda self: self._w[LIVE_SIZE])
    inserts = property(lambda self: self._w[LIVE_INSERTS])
    pending = property(lambda self: self._w[LIVE_PENDING])
    samples = property(lambda self: self._w[LIVE_SAMPLES])
    deletes = property(lambda self: self._w[LIVE_DELETES])
    free = property(lambda self: self._w[LIVE_FREE])
    uses = property(lambda self: self._w[LIVE_USES])

    @property
    def epoch(self) -> int:
        return self._w[LIVE_EPOCH]

    @epoch.setter
    def epoch(self, value: int) -> None:
        self._w[LIVE_EPOCH] = int(value)

    @property
    def mass(self) -> float:
        return float(self._mass[0])

    @mass.setter
    def mass(self, value: float) -> None:
        self._mass[0] = value

    def publish(self, size: int, inserts: int, pending: int, samples: int, deletes: int,
                free: int, uses: int, mass: float) -> None:
        """Engine thread: the counters clients read for len() and the
        rate-limiter probes."""
        w = self._w
        w[LIVE_SIZE], w[LIVE_INSERTS], w[LIVE_PENDING] = size, inserts, pending
        w[LIVE_SAMPLES], w[LIVE_DELETES], w[LIVE_FREE], w[LIVE_USES] = samples, deletes, free, uses
        self._mass[0] = mass

    def set_counters(self, inserts: int, samples: int, deletes: int) -> None:
        """Checkpoint restore: the limiter counters a table restarts from."""
        w = self._w
        w[LIVE_INSERTS], w[LIVE_SAMPLES], w[LIVE_DELETES] = int(inserts), int(samples), int(deletes)


# HELD: sampled for the last time (max_times_sampled) and no longer in the
# table, but a learner may still be reading the row: the slot is reused only
# after that learner RELEASEs it (or its lease ends)
FREE, RESERVED, COMMITTED, HELD = 0, 1, 2, 3


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class TableLayout:
    """Offsets of every array of a table segment, derived from its spec."""

    def __init__(self, spec: TableSpec):
        self.spec = spec
        # the offsets depend on the header size, which depends on the schema
        # length, which includes the offsets: iterate to the fixed point
        offsets = _offsets(spec, PAGE)
        while True:
            self.schema_bytes = msgpack.packb(
                {"spec": spec.to_wire(), "offsets": offsets}, use_bin_type=True)
            self.header_size = _align(SCHEMA_OFF + len(self.schema_bytes), PAGE)
            if self.header_size == offsets[0]:
                break
            offsets = _offsets(spec, self.header_size)
        self.offsets = offsets
        self.gens_off, self.prios_off, self.state_off, self.times_off, self.seqno_off = offsets[:5]
        self.field_offs = dict(zip((f.name for f in spec.fields), offsets[5:-1]))
        self.size = offsets[-1]


def _offsets(spec: TableSpec, header_size: int) -> list[int]:
    c = spec.capacity
    pos = header_size
    out = [pos]                       # gens
    pos = _align(pos + 4 * c, 64)
    out.append(pos)                   # prios
    pos = _align(pos + 8 * c, 64)
    out.append(pos)                   # state
    pos = _align(pos + c, 64)
    out.append(pos)                   # times
    pos = _align(pos + 4 * c, 64)
    out.append(pos)                   # seqno
    pos = _align(pos + 8 * c, PAGE)
    for f in spec.fields:
        out.append(pos)
        pos = _align(pos + c * f.item_bytes, PAGE)
    out.append(pos)                   # segment size
    return out


class TableMap:
    """numpy views over a mapped table segment.

    The daemon's engine thread is the only writer of gens, prios, state and
    live words; clients write field rows of slots they reserved and read
    everything.  Views are created once; hot paths index them directly.
    """

    def __init__(self, seg: Segment, layout: TableLayout):
        self.seg = seg
        self.layout = layout
        self.spec = layout.spec
        buf = seg.buf
        c = self.spec.capacity
        self.header = np.ndarray((), HEADER, buffer=buf, offset=0)
        self.live = np.ndarray((LIVE_WORDS,), np.uint64, buffer=buf, offset=LIVE_OFF)
        self.gens = np.ndarray((c,), np.uint32, buffer=buf, offset=layout.gens_off)
        self.prios = np.ndarray((c,), np.float64, buffer=buf, offset=layout.prios_off)
        self.state = np.ndarray((c,), np.uint8, buffer=buf, offset=layout.state_off)
        self.times = np.ndarray((c,), np.uint32, buffer=buf, offset=layout.times_off)
        self.seqno = np.ndarray((c,), np.uint64, buffer=buf, offset=layout.seqno_off)
        self.words = LiveWords(self.live)
        self.fields = {
            f.name: np.ndarray((c, *f.shape), f.dtype, buffer=buf, offset=layout.field_offs[f.name])
            for f in self.spec.fields
        }

    @classmethod
    def create(cls, name: str, spec: TableSpec, mode: int = 0o600,
               gid: int = -1) -> "TableMap":
        layout = TableLayout(spec)
        seg = Segment.create(name, layout.size, mode, (-1, gid))
        tm = cls(seg, layout)
        h = tm.header
        h["layout_version"] = LAYOUT_VERSION
        h["header_size"] = layout.header_size
        h["capacity"] = spec.capacity
        h["creator_pid"] = h["owner_pid"] = os.getpid()
        h["owner_start"] = process_start(os.getpid())
        h["created_ns"] = time.time_ns()
        h["segment_size"] = layout.size
        h["gens_off"], h["prios_off"], h["state_off"] = layout.gens_off, layout.prios_off, layout.state_off
        h["times_off"], h["seqno_off"] = layout.times_off, layout.seqno_off
        h["schema_len"] = len(layout.schema_bytes)
        seg.buf[SCHEMA_OFF:SCHEMA_OFF + len(layout.schema_bytes)] = layout.schema_bytes
        # magic last: a reader that sees it sees a complete header
        h["magic"] = MAGIC
        return tm

    @classmethod
    def attach(cls, name: str, expected: TableSpec | None = None) -> "TableMap":
        seg = Segment.attach(name, None if expected is None else TableLayout(expected).size)
        try:
            spec = read_spec(seg)
            if expected is not None and spec != expected:
                raise LayoutError(f"segment {name} holds table {spec}, expected {expected}")
            layout = TableLayout(spec)
            if layout.size != seg.size:
                raise LayoutError(f"segment {name} is {seg.size} bytes, layout says {layout.size}")
            return cls(seg, layout)
        except BaseException:
            seg.close()
            raise

    def release(self) -> None:
        """Drop the views and unmap (views handed to users keep it mapped)."""
        self.header = self.live = self.gens = self.prios = self.state = None
        self.times = self.seqno = self.words = None
        self.fields = {}
        self.seg.close()


def process_start(pid: int) -> int:
    """The process's start time in clock ticks since boot (0 if it is gone):
    with the pid it names one process even after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def read_spec(seg: Segment) -> TableSpec:
    if seg.size < SCHEMA_OFF:
        raise LayoutError(f"segment {seg.name} is too small ({seg.size} bytes) to be a table")
    h = np.ndarray((), HEADER, buffer=seg.buf, offset=0)
    if bytes(h["magic"]) != MAGIC:
        raise LayoutError(f"segment {seg.name} is not a shmreplay table (magic {bytes(h['magic'])!r})")
    if int(h["layout_version"]) != LAYOUT_VERSION:
        raise LayoutError(
            f"segment {seg.name} has layout version {int(h['layout_version'])}, "
            f"this build reads version {LAYOUT_VERSION}")
    n = int(h["schema_len"])
    if not 0 < n <= seg.size - SCHEMA_OFF:
        raise LayoutError(f"segment {seg.name} has a corrupt schema length {n}")
    try:
        doc = msgpack.unpackb(bytes(seg.buf[SCHEMA_OFF:SCHEMA_OFF + n]), raw=False)
        spec = spec_from_wire(doc["spec"])
    except Exception as exc:  # any decoding failure means a corrupt header
        raise LayoutError(f"segment {seg.name} has an unreadable schema: {exc}") from exc
    if TableLayout(spec).offsets != doc.get("offsets"):
        raise LayoutError(f"segment {seg.name}: stored offsets disagree with its schema")
    return spec
