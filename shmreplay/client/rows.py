"""Checking the rows a caller hands in against the table's fields.

Values are numpy arrays or anything ``np.asarray`` converts, cast when
numpy's ``same_kind`` rule allows (float64 -> float32, int64 -> int32);
anything else (a tensor that requires grad or lives on a GPU, a ragged list,
an object array), a missing or unknown field, or a wrong shape is a
``FieldError`` naming the field and what to do.  The words are found only
once numpy has refused a value (``fields.unconvertible``): a well-formed
array costs no more than before.  Called by ``table.py``'s insert and
insert_batch; pure functions, any thread.
"""

from __future__ import annotations

import numpy as np

from ..errors import FieldError
from ..fields import cannot_store, unconvertible
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
        try:  # free on success (zero-cost try); the except explains numpy's refusal
            a = v if isinstance(v, np.ndarray) else np.asarray(v)
        except Exception as exc:
            raise FieldError(f"table {name!r}, field {f.name!r}: "
                             f"{unconvertible(v, exc, _expected(f.shape, batch))}") from exc
        if a.dtype != f.dtype and not np.can_cast(a.dtype, f.dtype, "same_kind"):
            raise FieldError(f"table {name!r}, field {f.name!r}: {cannot_store(a.dtype, f.dtype)}")
        if batch:
            if a.ndim != len(f.shape) + 1 or a.shape[1:] != f.shape:
                raise FieldError(f"table {name!r}, field {f.name!r}: shape {a.shape}, "
                                 f"expected {_expected(f.shape, batch)}")
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


def _expected(shape: tuple, batch: bool) -> str:
    """The shape a value must have, as a message shows it: (n, 4, 8) for a batch."""
    return ("(n" + "".join(f", {d}" for d in shape) + ")") if batch else str(shape)
