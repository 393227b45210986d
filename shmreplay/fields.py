"""A table's fields: the forms a field definition may take and their
validation, and the words for a value that does not fit a field.

``fields`` (``parse_fields``) is one of

* a mapping ``{name: (dtype, shape)}`` (the pair a tuple or a list),
* a mapping ``{name: {"dtype": dtype, "shape": shape}}`` (no "shape": a scalar),
* a list of ``[name, dtype, shape]`` (the wire and segment form, ``Field.to_wire``),

where a name is a Python identifier of at most 64 characters; a dtype is
anything ``np.dtype`` reads as a plain number or bool ("float32", "<f4",
``np.float32``, ``np.dtype("uint8")``, ``bool``); a shape is a tuple or list
of positive ints (``()`` a scalar; an int n means ``(n,)``).  Anything else
is a ``SchemaError`` naming the field, what is wrong and the forms.  The
client's ``create_table``, the daemon's TOML config and the daemon's reading
of what a client sends (``schema.spec_from_wire``) all come through here, so
a client that skips its own checks gets the same refusal from the daemon,
whose control connection answers it and serves on.  Every check is of the
value's type first: nothing here trusts a byte a client sent.

``unconvertible`` and ``cannot_store`` word the client's refusal of a value
(``client/rows.py``, ``client/writers.py``, ``priorities.py``); they run
only once numpy has refused it, never on the insert path that succeeds.
Pure functions and frozen values; any thread.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .errors import SchemaError

MAX_FIELDS = 64
# numpy 1.x arrays have at most 32 dimensions, and the rows of a field add
# one (the slot, or the batch's items) to the field's shape
MAX_DIMS = 31
_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_ALLOWED_KINDS = "biufc"

FIELDS_FORMS = ('fields is a mapping {name: (dtype, shape)} or {name: {"dtype": dtype, '
                '"shape": shape}}, or a list of [name, dtype, shape]')
FIELD_FORMS = ('give a field as (dtype, shape), e.g. ("float32", (4,)), or as {"dtype": '
               'dtype, "shape": shape} (no "shape": a scalar)')
DTYPE_HINT = ("use a numeric or bool numpy dtype: a name such as 'float32', 'int64', "
              "'uint8' or 'bool', a numpy type such as np.float32, or an np.dtype")
SHAPE_HINT = "use a tuple or list of positive ints, e.g. (4, 84, 84), or () for a scalar"
# why a dtype numpy knows cannot be a field, by kind
_KIND_WHY = {"O": "Python objects cannot live in shared memory",
             "U": "strings: store them encoded, in a fixed-length uint8 field",
             "S": "strings: store them encoded, in a fixed-length uint8 field",
             "M": "datetimes: store them as int64 (value.view('int64'))",
             "m": "timedeltas: store them as int64 (value.view('int64'))",
             "V": "raw bytes: use a uint8 field with a shape"}


@dataclass(frozen=True)
class Field:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def item_bytes(self) -> int:
        return int(self.dtype.itemsize * math.prod(self.shape))

    def to_wire(self) -> list:
        return [self.name, self.dtype.str, list(self.shape)]


def brief(value, limit: int = 120) -> str:
    """repr for a message, cut short: a hostile client's value may be huge."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def parse_fields(fields) -> tuple[Field, ...]:
    """The fields in any of the forms above, validated, in the order given."""
    if isinstance(fields, Mapping):
        items = [(name, *_pair(_name(name), desc)) for name, desc in fields.items()]
    elif isinstance(fields, (list, tuple)):
        items = []
        for entry in fields:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise SchemaError(f"field entry {brief(entry)} is not [name, dtype, shape]; "
                                  f"{FIELDS_FORMS}")
            items.append(tuple(entry))
    else:
        raise SchemaError(f"fields must be a mapping or a list, got {type(fields).__name__}; "
                          f"{FIELDS_FORMS}")
    if not items:
        raise SchemaError(f"a table needs at least one field; {FIELDS_FORMS}")
    if len(items) > MAX_FIELDS:
        raise SchemaError(f"a table may have at most {MAX_FIELDS} fields, got {len(items)}")
    out, seen = [], set()
    for name, dtype, shape in items:
        name = _name(name)
        if name in seen:
            raise SchemaError(f"duplicate field name {name!r}: give each field its own name")
        seen.add(name)
        out.append(Field(name, _dtype(name, dtype), _shape(name, shape)))
    return tuple(out)


def _name(name) -> str:
    if not isinstance(name, str) or not _FIELD_NAME.fullmatch(name):
        raise SchemaError(f"invalid field name {brief(name)}: use a Python identifier of <= 64 "
                          "chars (letters, digits and '_', not starting with a digit)")
    return str(name)  # a str subclass (np.str_) would reach the wire and the segment as itself


def _pair(name: str, desc) -> tuple:
    """(dtype, shape) of one field of the mapping form."""
    if isinstance(desc, Mapping):
        unknown = [k for k in desc if k not in ("dtype", "shape")]
        if unknown:
            raise SchemaError(f"field {name!r}: unknown key(s) {brief(unknown)} in {brief(desc)}; "
                              'a field given as a mapping has "dtype" and, optionally, "shape"')
        if "dtype" not in desc:  # numpy would read a missing dtype as float64
            raise SchemaError(f"field {name!r}: {brief(desc)} has no \"dtype\" (there is no "
                              f"default); {FIELD_FORMS}")
        return desc["dtype"], desc.get("shape", ())
    if isinstance(desc, (tuple, list)) and len(desc) == 2:
        return desc[0], desc[1]
    if isinstance(desc, (str, np.dtype, type)):
        raise SchemaError(f"field {name!r}: {brief(desc)} has no shape; give ({brief(desc)}, ()) "
                          f"for a scalar, or ({brief(desc)}, (n, ...)); {FIELD_FORMS}")
    raise SchemaError(f"field {name!r}: {brief(desc)} is not a field definition; {FIELD_FORMS}")


def _dtype(name: str, dtype) -> np.dtype:
    if dtype is None:  # np.dtype(None) is float64: a forgotten dtype must not pass as one
        raise SchemaError(f"field {name!r}: no dtype given; {DTYPE_HINT}")
    try:
        dt = np.dtype(dtype)
    except Exception as exc:  # TypeError, ValueError, ...: whatever numpy cannot read
        raise SchemaError(f"field {name!r}: unknown dtype {brief(dtype)} ({exc}); "
                          f"{DTYPE_HINT}") from exc
    if dt.kind not in _ALLOWED_KINDS or dt.fields is not None or dt.subdtype is not None:
        if dt.subdtype is not None:
            why = f"a sub-array: put its shape {dt.shape} into the field's shape"
        elif dt.fields is not None:
            why = "a structured dtype: give each of its parts a field of its own"
        else:
            why = _KIND_WHY.get(dt.kind, f"kind {dt.kind!r}")
        raise SchemaError(f"field {name!r}: dtype {dt} is not a plain numeric or bool dtype "
                          f"({why}); {DTYPE_HINT}")
    return dt.newbyteorder("=") if dt.byteorder == ">" else dt


def _shape(name: str, shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (tuple, list)):
        raise SchemaError(f"field {name!r}: shape {brief(shape)} is not a tuple of ints; "
                          f"{SHAPE_HINT}")
    for d in shape:
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d <= 0:
            raise SchemaError(f"field {name!r}: shape {brief(shape)} must hold positive ints, "
                              f"and {brief(d)} is not one; {SHAPE_HINT}")
    if len(shape) > MAX_DIMS:
        raise SchemaError(f"field {name!r}: shape has {len(shape)} dimensions, at most "
                          f"{MAX_DIMS} (numpy's limit, less the axis of items)")
    return tuple(int(d) for d in shape)


# ---- values that do not fit a field (the failure path only) ----
def _attr(value, attr: str):
    """``value.attr`` or None, whatever the object's property raises."""
    try:
        return getattr(value, attr, None)
    except Exception:
        return None


def unconvertible(value, exc: BaseException, expect: str) -> str:
    """Why ``np.asarray(value)`` raised ``exc``, and what to do; ``expect``
    is the shape the field wants.  A tensor is known by its attributes, or,
    inside a list, by the error it raised; no framework is imported."""
    said = str(exc)
    cause = f"numpy: {type(exc).__name__}: {said}"
    what = f"a {type(value).__module__}.{type(value).__qualname__}".replace("builtins.", "")
    device = _attr(value, "device")
    where = str(_attr(device, "type") or device)
    off_cpu = device is not None and "cpu" not in where.lower()
    if not off_cpu and "device type tensor" in said:  # e.g. a list of CUDA tensors
        off_cpu, where, what = True, "another device", f"{what} holding a tensor"
    cpu = f" and .cpu() it (it is on {device if device is not None else where})" if off_cpu else ""
    if _attr(value, "requires_grad") is True:
        return f"{what} that requires grad cannot be stored: .detach() it first{cpu} ({cause})"
    if "requires grad" in said:  # a tensor inside a list or tuple
        return (f"{what} holding a tensor that requires grad cannot be stored: .detach() each "
                f"tensor first{cpu} ({cause})")
    if off_cpu:
        return (f"{what} on {device if device is not None else where}, not on the CPU, cannot "
                f"be stored: .cpu() it first ({cause})")
    if "inhomogeneous" in said:
        return (f"its nested sequences differ in length (a ragged list), so numpy cannot make "
                f"one array of it: give an array of shape {expect} ({cause})")
    return (f"numpy cannot convert {what}: give a numpy array (or a value np.asarray "
            f"converts) of shape {expect} ({cause})")


def cannot_store(have: np.dtype, want: np.dtype) -> str:
    """Why values of dtype ``have`` are refused for a ``want`` field, and what to do."""
    if have.kind == "O":
        why = ("an object array (Python objects: None, mixed or ragged values?) holds no "
               f"numbers numpy can cast; give numbers, e.g. np.asarray(value, dtype='{want}')")
    elif have.kind in "USV":
        why = "strings and raw bytes are not numbers; give numbers"
    else:
        why = ("numpy's same_kind rule casts within a kind or to a wider one (float64 -> "
               "float32, int -> float), not float -> int or signed -> unsigned; convert it "
               f"yourself if you mean to, e.g. value.astype('{want}')")
    return f"dtype {have} cannot be stored as {want}: {why}"
