"""The fixed headers of a table's two segments, and reading them from bytes
nobody vouches for.

A table's meta segment starts with ``HEADER`` (its byte map is in
``layout.py``'s docstring and docs/layout.md), its rows segment or rows
file with ``ROWS_HEADER``.  Besides the live mappings (``layout.TableMap``),
the daemon reads these headers from bytes no mapping backs: a metadata file
on disk (server/disk/durable.py), the first bytes of a dead daemon's
segment read with ``pread`` (server/disk/ownership.py).  Every offset and
field of that reading is here, so that no other module knows where a
header keeps what: callers hand over bytes (or a ``read(offset, n)`` of
their own, which opens the file as safely as they must) and get values or
None back.  Anything that does not parse is None or a ``LayoutError``,
never another exception.

Pure functions; any thread.
"""

from __future__ import annotations

import msgpack
import numpy as np

from ..errors import LayoutError
from ..schema import TableSpec, spec_from_wire

MAGIC = b"SHMRTBL\x00"
LAYOUT_VERSION = 4  # 2: HELD, times, seqno, limiter words; 3: owner, epoch; 4: meta/rows split, leases
# a frame table's map (docs/frames.md): version 4's, plus its frame rings
# after the rows and its references after the per-slot arrays.  A table of
# rows stays at 4, so builds from before frame tables still adopt it, and
# refuse a frame table by its version
FRAME_LAYOUT_VERSION = 5
LAYOUT_VERSIONS = (LAYOUT_VERSION, FRAME_LAYOUT_VERSION)
PAGE = 4096


def align(x: int, a: int) -> int:
    """``x`` rounded up to a multiple of ``a`` (an offset in a segment)."""
    return (x + a - 1) // a * a

HEADER = np.dtype([
    ("magic", "S8"), ("layout_version", "<u4"), ("header_size", "<u4"),
    ("capacity", "<u8"), ("creator_pid", "<u8"), ("created_ns", "<u8"),
    ("segment_size", "<u8"), ("gens_off", "<u8"), ("prios_off", "<u8"),
    ("state_off", "<u8"), ("schema_len", "<u4"), ("reserved", "<u4"),
    ("times_off", "<u8"), ("seqno_off", "<u8"),
    ("owner_pid", "<u8"), ("owner_start", "<u8"), ("rows_size", "<u8"),
])
ROWS_MAGIC = b"SHMRROW\x00"
ROWS_HEADER = np.dtype([
    ("magic", "S8"), ("layout_version", "<u4"), ("reserved", "<u4"),
    ("capacity", "<u8"), ("created_ns", "<u8"), ("segment_size", "<u8"),
])
ROWS_OFF = 4096   # the first field's rows in a rows segment
LIVE_OFF = 192    # the live words in a meta segment (layout.LiveWords)
SCHEMA_OFF = 320  # the schema in a meta segment
MAX_SCHEMA = 1 << 20


def _view(image, dtype: np.dtype):
    """The ``dtype`` record at the start of ``image`` as a 0-d view (not
    frombuffer()[0], whose S8 field drops a magic's trailing NUL); None if
    ``image`` is shorter."""
    if len(image) < dtype.itemsize:
        return None
    return np.ndarray((), dtype, buffer=image)


def meta_header(image):
    """The meta header at the start of ``image`` (a mapping, a file's bytes,
    or a read of at least ``HEADER.itemsize`` bytes), as a writable 0-d view
    where ``image`` is writable; None unless it carries the magic."""
    h = _view(image, HEADER)
    return h if h is not None and bytes(h["magic"]) == MAGIC else None


def rows_header(image):
    """The rows header at the start of ``image``; None unless it carries
    the magic (its layout version is the caller's to check)."""
    r = _view(image, ROWS_HEADER)
    return r if r is not None and bytes(r["magic"]) == ROWS_MAGIC else None


def owner(header) -> tuple[int, int]:
    """(pid, start time) of the daemon serving the table (0, 0: none)."""
    return int(header["owner_pid"]), int(header["owner_start"])


def clear_owner(header) -> None:
    """No daemon serves this table (a copy a reboot left: the old boot's
    pid and start time could name a process of this one)."""
    header["owner_pid"] = header["owner_start"] = 0


def schema_span(header, size: int | None = None) -> tuple[int, int] | None:
    """(offset, length) of the schema in a meta segment of ``size`` bytes
    (None: unknown, bounded by MAX_SCHEMA); None if the header's length
    cannot be right."""
    n = int(header["schema_len"])
    top = MAX_SCHEMA if size is None else size - SCHEMA_OFF
    return (SCHEMA_OFF, n) if 0 < n <= top else None


def decode_schema(raw: bytes, where: str) -> tuple[TableSpec, dict]:
    """The spec a schema's bytes define, and the whole document (which also
    stores every offset); LayoutError naming ``where`` if they do not decode."""
    try:
        doc = msgpack.unpackb(bytes(raw), raw=False)
        return spec_from_wire(doc["spec"]), doc
    except Exception as exc:  # any decoding failure means a corrupt header
        raise LayoutError(f"{where} has an unreadable schema: {exc}") from exc


def stored_table(read, where: str) -> tuple[np.ndarray, TableSpec]:
    """The header and spec of the meta segment or file that ``read(offset,
    n) -> bytes`` reads from; LayoutError if it holds none."""
    h = meta_header(read(0, HEADER.itemsize))
    span = None if h is None else schema_span(h)
    if span is None:
        raise LayoutError(f"{where} is not a shmreplay table")
    return h, decode_schema(read(*span), where)[0]


def layout_version(spec: TableSpec) -> int:
    """The layout version a table of ``spec`` is stored under."""
    return FRAME_LAYOUT_VERSION if spec.frames else LAYOUT_VERSION


def same_table(header, other) -> bool:
    """Do two meta headers (a file's, a live segment's) describe the same
    incarnation of one table: this layout version, the same creation time?"""
    return (int(header["layout_version"]) in LAYOUT_VERSIONS
            and int(header["layout_version"]) == int(other["layout_version"])
            and int(header["created_ns"]) == int(other["created_ns"]))


def rows_belong(rows, header) -> bool:
    """Does a rows header (``rows_header``) belong to the table whose meta
    header this is (same capacity and creation time)?"""
    return (rows is not None and int(rows["capacity"]) == int(header["capacity"])
            and int(rows["created_ns"]) == int(header["created_ns"]))
