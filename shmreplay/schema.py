"""Table definitions: names, fields, sampler, and their validation.

A ``TableSpec`` is immutable and round-trips through a plain dict (msgpack,
TOML and the segment header all carry that dict), so the client, the daemon
and the segment agree on one canonical form.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from .errors import SchemaError

SAMPLERS = ("uniform", "prioritized")
MAX_CAPACITY = 2**32 - 1  # keys carry the slot in their low 32 bits
MAX_FIELDS = 64
_TABLE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_FIELD_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
_ALLOWED_KINDS = "biufc"


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


@dataclass(frozen=True)
class TableSpec:
    name: str
    capacity: int
    fields: tuple[Field, ...]
    sampler: str = "prioritized"
    alpha: float = 0.6

    @property
    def item_bytes(self) -> int:
        return sum(f.item_bytes for f in self.fields)

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def to_wire(self) -> dict:
        return {
            "name": self.name,
            "capacity": self.capacity,
            "fields": [f.to_wire() for f in self.fields],
            "sampler": self.sampler,
            "alpha": self.alpha,
        }


def check_table_name(name) -> str:
    if not isinstance(name, str) or not _TABLE_NAME.match(name):
        raise SchemaError(
            f"invalid table name {name!r}: use 1-64 characters from [A-Za-z0-9_.-], "
            "not starting with '.' or '-'"
        )
    return name


def _parse_dtype(fname: str, dtype) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise SchemaError(f"field {fname!r}: unknown dtype {dtype!r}") from exc
    if dt.kind not in _ALLOWED_KINDS or dt.fields is not None or dt.subdtype is not None:
        raise SchemaError(
            f"field {fname!r}: dtype {dt} is not a plain numeric or bool dtype"
        )
    return dt.newbyteorder("=") if dt.byteorder == ">" else dt


def _parse_shape(fname: str, shape) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        shp = tuple(shape)
    except TypeError as exc:
        raise SchemaError(f"field {fname!r}: shape {shape!r} is not a tuple of ints") from exc
    for d in shp:
        if not isinstance(d, (int, np.integer)) or isinstance(d, bool) or d <= 0:
            raise SchemaError(f"field {fname!r}: shape {shape!r} must hold positive ints")
    return tuple(int(d) for d in shp)


def parse_fields(fields) -> tuple[Field, ...]:
    """Accept ``{name: (dtype, shape)}``, ``{name: {"dtype":..,"shape":..}}``
    or a list of ``[name, dtype, shape]``."""
    if isinstance(fields, dict):
        items = []
        for name, desc in fields.items():
            if isinstance(desc, dict):
                items.append((name, desc.get("dtype"), desc.get("shape", ())))
            elif isinstance(desc, (tuple, list)) and len(desc) == 2:
                items.append((name, desc[0], desc[1]))
            else:
                raise SchemaError(
                    f"field {name!r}: expected (dtype, shape) or {{dtype=, shape=}}, got {desc!r}"
                )
    elif isinstance(fields, (list, tuple)):
        items = []
        for entry in fields:
            if not isinstance(entry, (list, tuple)) or len(entry) != 3:
                raise SchemaError(f"field entry {entry!r} is not [name, dtype, shape]")
            items.append(tuple(entry))
    else:
        raise SchemaError(f"fields must be a dict or list, got {type(fields).__name__}")
    if not items:
        raise SchemaError("a table needs at least one field")
    if len(items) > MAX_FIELDS:
        raise SchemaError(f"a table may have at most {MAX_FIELDS} fields, got {len(items)}")
    out, seen = [], set()
    for name, dtype, shape in items:
        if not isinstance(name, str) or not _FIELD_NAME.match(name):
            raise SchemaError(f"invalid field name {name!r}: use a Python identifier of <= 64 chars")
        if name in seen:
            raise SchemaError(f"duplicate field name {name!r}")
        seen.add(name)
        out.append(Field(name, _parse_dtype(name, dtype), _parse_shape(name, shape)))
    return tuple(out)


def make_spec(name, capacity, fields, sampler="prioritized", alpha=0.6) -> TableSpec:
    """Validate every part of a table definition; raise SchemaError naming the problem."""
    check_table_name(name)
    if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool):
        raise SchemaError(f"table {name!r}: capacity must be an int, got {capacity!r}")
    if not 1 <= int(capacity) <= MAX_CAPACITY:
        raise SchemaError(f"table {name!r}: capacity {capacity} outside 1..{MAX_CAPACITY}")
    if sampler not in SAMPLERS:
        raise SchemaError(f"table {name!r}: sampler {sampler!r} is not one of {SAMPLERS}")
    try:
        alpha = float(alpha)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"table {name!r}: alpha {alpha!r} is not a number") from exc
    if not (0.0 <= alpha < math.inf):
        raise SchemaError(f"table {name!r}: alpha must be finite and >= 0, got {alpha}")
    return TableSpec(str(name), int(capacity), parse_fields(fields), str(sampler), alpha)


def spec_from_wire(d) -> TableSpec:
    if not isinstance(d, dict):
        raise SchemaError(f"table definition must be a map, got {type(d).__name__}")
    unknown = set(d) - {"name", "capacity", "fields", "sampler", "alpha"}
    if unknown:
        raise SchemaError(f"table definition has unknown keys {sorted(unknown)}")
    for key in ("name", "capacity", "fields"):
        if key not in d:
            raise SchemaError(f"table definition lacks {key!r}")
    return make_spec(d["name"], d["capacity"], d["fields"], d.get("sampler", "prioritized"),
                     d.get("alpha", 0.6))
