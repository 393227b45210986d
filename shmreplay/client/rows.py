"""Checking the rows a caller hands in against the table's fields.

Values are cast when numpy's ``same_kind`` rule allows (float64 -> float32,
int64 -> int32); anything else, a missing or unknown field, or a wrong shape
is a ``FieldError`` naming the field.  Pure functions; any thread.
"""

from __future__ import annotations

import numpy as np

from ..errors import FieldError
from ..schema import TableSpec


def check_rows(spec: TableSpec, names: frozenset, data, batch: bool) -> tuple[list, int]:
    """(arrays in field order, n): ``data`` maps every field (``names``: the
    spec's field names) to one item's value (``batch=False``) or to n items'
    values along a leading axis."""
    name = spec.name
    if not isinstance(data, dict):
        raise FieldError(f"table {name!r}: data must be a dict of field -> array")
    if data.keys() != names:
        missing = sorted(names - data.keys())
        unknown = sorted(data.keys() - names)
        parts = ([f"missing field(s) {missing}"] if missing else []) + (
            [f"unknown field(s) {unknown}"] if unknown else [])
        raise FieldError(f"table {name!r}: {', '.join(parts)}; "
                         f"its fields are {sorted(names)}")
    arrays, n = [], None
    for f in spec.fields:
        v = data[f.name]
        a = v if isinstance(v, np.ndarray) else np.asarray(v)
        if a.dtype != f.dtype and not np.can_cast(a.dtype, f.dtype, "same_kind"):
            raise FieldError(f"table {name!r}, field {f.name!r}: dtype {a.dtype} "
                             f"cannot be stored as {f.dtype}")
        if batch:
            if a.ndim != len(f.shape) + 1 or a.shape[1:] != f.shape:
                expect = "(n" + "".join(f", {d}" for d in f.shape) + ")"
                raise FieldError(f"table {name!r}, field {f.name!r}: shape {a.shape}, "
                                 f"expected {expect}")
            if n is None:
                n = a.shape[0]
            elif a.shape[0] != n:
                raise FieldError(f"table {name!r}: field {f.name!r} has {a.shape[0]} "
                                 f"items, earlier fields have {n}")
        elif a.shape != f.shape:
            raise FieldError(f"table {name!r}, field {f.name!r}: shape {a.shape}, "
                             f"expected {f.shape}")
        arrays.append(a)
    return arrays, (n if batch else 1)
