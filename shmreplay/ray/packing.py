"""A small chunk's wire form: its rows packed into one byte array.

Ray pickles each numpy array of a call's arguments apart: a 64-row
sac-mujoco chunk as a dict of five arrays took 100 us to serialize,
packed into one (64, 165) uint8 array 38 us (measured in-process, warm),
and about 27 us less to read back.  Packing costs the producer ~10 us
(one copy of 10 KB, field by field) and the ingest ~5 us (views, no
copy).  A large chunk is sent as it is: its per-array cost is nothing next
to its bytes, and packing would copy them all once more.

A packed row is the table's fields, in the table's order, each in the
table's dtype and shape, with no padding (``row_dtype``): the writer learns
them from the ingest (``Ingest.fields``) and sends, with each packed chunk,
the layout's fingerprint (``layout_id``); the ingest reads the rows back
as views of the array (``unpack``), refusing any other width or layout
(a writer that outlived its table's re-creation with other fields).

Who calls it: ``RemoteWriter`` (``pack``) and the ingest (``unpack``).
"""

from __future__ import annotations

import zlib

import numpy as np

from ..errors import FieldError

# chunks of at most this many bytes travel packed
PACK_BYTES = 64 << 10


def row_dtype(fields: dict) -> np.dtype:
    """The packed row of ``fields`` (name -> (dtype, shape), the table's
    order): a structured dtype without padding."""
    return np.dtype([(name, np.dtype(dt), tuple(shape)) for name, (dt, shape) in fields.items()])


def layout_id(row: np.dtype) -> int:
    """A fingerprint of a packed row's fields, dtypes, shapes and offsets."""
    return zlib.crc32(repr(row.descr).encode())


def pack(part: dict, row: np.dtype) -> np.ndarray | None:
    """``part`` (field -> n rows) as an (n, row.itemsize) uint8 array, or
    None where it does not fit ``row`` as the table's own check would pass
    it (other fields or shapes, a dtype numpy's same_kind rule does not
    cast, more than PACK_BYTES): it then travels as it is, and the ingest
    says what is wrong with it."""
    if part.keys() != row.fields.keys():
        return None
    n = len(next(iter(part.values())))
    if n * row.itemsize > PACK_BYTES:
        return None
    out = np.empty((n, row.itemsize), np.uint8)
    rec = out.view(row).reshape(n)  # each field a view into out
    for name, (dt, _) in row.fields.items():
        v = part[name]
        if not isinstance(v, np.ndarray) or v.shape[1:] != dt.shape or v.shape[0] != n or not (
                v.dtype == dt.base or np.can_cast(v.dtype, dt.base, "same_kind")):
            return None
        rec[name] = v
    return out


def unpack(packed: np.ndarray, row: np.dtype, row_id: int, table: str, layout) -> dict:
    """The rows of a packed chunk as views, field -> (n, *shape);
    ``layout``: the fingerprint the writer packed it for, ``row_id``:
    ``layout_id(row)`` (the caller keeps it: it costs ~10 us)."""
    if packed.dtype != np.uint8 or packed.ndim != 2 or packed.shape[1] != row.itemsize:
        raise FieldError(f"table {table!r}: a packed chunk has rows of {row.itemsize} bytes "
                         f"(the table's fields {list(row.fields)}), got a {packed.dtype} array of shape "
                         f"{packed.shape}: send rows as a dict of field -> array (RemoteWriter packs them)")
    if layout != row_id:
        raise FieldError(f"table {table!r}: a chunk packed for other fields than the table's "
                         f"{list(row.fields)} (made anew since the writer started?): make the RemoteWriter anew")
    rec = np.ascontiguousarray(packed).view(row).reshape(packed.shape[0])
    return {name: rec[name] for name in row.fields}
