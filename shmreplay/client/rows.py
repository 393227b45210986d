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
        if a.dtype is not f.dtype and not same_kind(a.dtype, f.dtype):  # numpy's own dtypes are singletons
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


# np.can_cast costs ~1.4 us a call, a dict lookup ~0.2: an insert of one
# row whose reward comes as a Python float and done as a bool asked it twice
# per call.  Bounded: a caller can make any number of distinct dtypes.
_SAME_KIND: dict = {}
SAME_KIND_CACHED = 256


def same_kind(src: np.dtype, dst: np.dtype) -> bool:
    """``np.can_cast(src, dst, "same_kind")``, remembered."""
    key = (src, dst)
    ok = _SAME_KIND.get(key)
    if ok is None:
        ok = bool(np.can_cast(src, dst, "same_kind"))
        if len(_SAME_KIND) < SAME_KIND_CACHED:
            _SAME_KIND[key] = ok
    return ok


def _expected(shape: tuple, batch: bool) -> str:
    """The shape a value must have, as a message shows it: (n, 4, 8) for a batch."""
    return ("(n" + "".join(f", {d}" for d in shape) + ")") if batch else str(shape)
