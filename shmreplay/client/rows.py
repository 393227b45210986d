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


def check_one(fields: list, names: frozenset, data) -> list | None:
    """``check_rows(..., batch=False)``'s arrays for an item made of what a
    step-by-step actor passes (numpy arrays, Python and numpy scalars), or
    None for anything else, which ``check_rows`` then checks and explains.
    ``fields``: ``one_row_fields(spec)``; ``data``: a dict (an insert's
    keyword arguments).  Accepts only what ``check_rows``
    accepts and hands back values that store the same (``view[slot] =
    value``): a Python float or bool is what ``np.asarray`` makes float64
    or bool of, a Python int in int64's range what it makes int64 of, and
    a numpy scalar what it makes a 0-d array of its own dtype of; the
    ``np.asarray`` calls (~0.5 us each) are what it saves."""
    if data.keys() != names:
        return None
    out = []
    for name, dtype, shape, scalars in fields:
        v = data[name]
        t = type(v)
        if t is np.ndarray:
            if v.shape != shape or (v.dtype is not dtype and not same_kind(v.dtype, dtype)):
                return None
        elif t not in scalars or (t is int and not -_INT64_TOP <= v < _INT64_TOP):
            return None
        out.append(v)
    return out


class RowForm:
    """A table handle's view of its fields for checking what callers hand
    in (built once from the spec): their names as a set and in field
    order, and ``check_one``'s per-field view.  Read-only after it is made."""

    __slots__ = ("names", "order", "one")

    def __init__(self, spec: TableSpec):
        self.names = frozenset(f.name for f in spec.fields)
        self.order = tuple(f.name for f in spec.fields)
        self.one = one_row_fields(spec)

    def in_order(self, data: dict) -> tuple | None:
        """``in_order`` for these fields."""
        return in_order(data, self.order, self.names)

    def check_one(self, data) -> list | None:
        """``check_one`` for these fields."""
        return check_one(self.one, self.names, data)


def in_order(data: dict, order: tuple, names: frozenset) -> tuple | None:
    """``data``'s values in field order (``order``: the field names in it;
    ``names``: the same as a set), or None if its keys are not the fields.
    Keyword arguments come in the caller's order, most often the table's:
    that case costs one comparison."""
    if tuple(data) == order:
        return tuple(data.values())
    if data.keys() == names:
        return tuple(map(data.__getitem__, order))
    return None


def one_row_fields(spec: TableSpec) -> list:
    """``check_one``'s view of a table's fields: (name, dtype, shape, the
    scalar types it takes as they are) in field order.  A field of shape ()
    takes a Python float or bool when ``np.asarray``'s dtype for it casts to
    the field's by ``same_kind``, a numpy scalar when its dtype casts
    safely, and a Python int (int64 once in range) only when the field is
    int64: an int64 value cast to a narrower integer wraps, where a Python
    int (or numpy scalar) stored as it is overflows."""
    out = []
    for f in spec.fields:
        scalars = frozenset() if f.shape else frozenset(
            [t for t, dt in _PYTHON_DTYPES.items() if same_kind(dt, f.dtype)]
            + [t for t, dt in _NUMPY_DTYPES.items() if np.can_cast(dt, f.dtype, "safe")]
            + ([int] if f.dtype == _INT64 else []))
        out.append((f.name, f.dtype, f.shape, scalars))
    return out


# the scalars check_one takes, with the dtype np.asarray gives each: Python
# floats and bools, and numpy's scalars of the numeric dtypes (a Discrete
# space's sample() is an np.int64, a wrapper's reward often an np.float32),
# these only where the cast is safe: stored as they are, an np.int64 too
# large for an int32 field overflows, where the 0-d array check_rows makes
# of it wraps
_PYTHON_DTYPES = {float: np.dtype(np.float64), bool: np.dtype(np.bool_)}
_NUMPY_DTYPES = {np.dtype(c).type: np.dtype(c) for c in "?bhilqBHILQefd"}
_INT64, _INT64_TOP = np.dtype(np.int64), 2**63


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
            if a.shape == (1, *f.shape):  # a one-env vector env's step: its env's item
                a = a[0]
            else:
                raise FieldError(f"table {name!r}, field {f.name!r}: shape {a.shape}, "
                                 f"expected {f.shape} (or (1, {', '.join(map(str, f.shape))}) from a "
                                 "one-env vector env)".replace("(1, )", "(1,)"))
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
