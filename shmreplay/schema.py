"""Table definitions: names, selectors, limits, and their validation (the
fields' forms and checks: ``fields.py``).

A ``TableSpec`` is immutable and round-trips through a plain dict (msgpack,
TOML and the segment header all carry that dict), so the client, the daemon
and the segment agree on one canonical form.  Shared by both wings; pure
functions and frozen values, any thread.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import numpy as np

from .errors import SchemaError
from .fields import Field, brief, parse_fields
from .framespec import (Frames, check_frame_capacity, frame_bytes, parse_frames,
                        slot_fields)

SAMPLERS = ("uniform", "prioritized", "fifo", "lifo")
REMOVERS = ("fifo", "lifo", "uniform")
# keys of the wire/TOML form, in order; the first three are required
SPEC_KEYS = ("name", "capacity", "fields", "sampler", "alpha", "remover", "max_times_sampled",
             "min_size_to_sample", "samples_per_insert", "error_buffer", "storage_dir", "writers",
             "writer_uid", "creator_uid", "row_layout", "frames", "frames_per_item")
# who may write a table's items: "any" client the daemon lets in, or only its
# "creator" (and the daemon's admins), which the daemon enforces and records
# as ``writer_uid`` (docs/reliability.md, section 10)
WRITERS = ("any", "creator")
# how a table's rows lie in memory (wire/layout.py draws both): "slot", all
# fields of a slot together, so a sampled row is one read; or "field", each
# field's rows in one array of their own.  "auto" asks for the one that
# gathers faster for the row size (ROW_LAYOUT_AUTO_BYTES, measured in
# docs/performance.md): whole small rows read once instead of one cache line
# per field; large rows copy at memory speed either way, and one field's
# array stays contiguous for what reads it alone
ROW_LAYOUTS = ("slot", "field")
ROW_LAYOUT_AUTO_BYTES = 4096
MAX_CAPACITY = 2**32 - 1  # keys carry the slot in their low 32 bits
# a table's rows must fit one mapping: x86-64 gives a process 2**47 bytes
# (128 TiB) of address space, so a larger table could never be attached
MAX_TABLE_BYTES = 2**47
# fullmatch, not match with "$": "$" matches before a trailing newline
_TABLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class TableSpec:
    name: str
    capacity: int
    fields: tuple[Field, ...]
    sampler: str = "prioritized"
    alpha: float = 0.6
    remover: str = "fifo"            # which item leaves when the table is full
    max_times_sampled: int = 0       # remove an item after its N-th sample; 0: never
    min_size_to_sample: int = 1
    samples_per_insert: float | None = None   # None: no ratio limit (Reverb's MinSize)
    error_buffer: float | tuple[float, float] | None = None
    # rows in a file in this directory instead of /dev/shm (None: the
    # daemon's default; "" asks for /dev/shm even when there is a default)
    storage_dir: str | None = None
    # "creator": only ``writer_uid`` (the creating user, filled in by the
    # daemon whatever a client sends) and the daemon's admins may reserve,
    # commit or update priorities, and the rows are group read-only
    writers: str = "any"
    writer_uid: int | None = None
    # who created it, when that was a user other than root and the daemon's
    # own (the kernel's word, filled in by the daemon): kept with the table
    # so its creator's limits and storage share still count it after a
    # restart (server/control/quotas.py).  Not part of what the table is:
    # equal definitions of two creators compare equal
    creator_uid: int | None = field(default=None, compare=False)
    # ROW_LAYOUTS; make_spec resolves "auto".  The default here is "field":
    # what every table stored before row layouts existed has
    row_layout: str = "field"
    # fields stored as frames, each once in a frame ring (framespec.py,
    # docs/frames.md); empty: a table of rows
    frames: Frames = Frames()

    @property
    def writer_only(self) -> bool:
        """True if the daemon lets only ``writer_uid`` and its admins write."""
        return self.writers == "creator"

    @property
    def file_backed(self) -> bool:
        return bool(self.storage_dir)

    @property
    def rate_limited(self) -> bool:
        """True if inserts may have to wait (a samples-per-insert ratio is set)."""
        return self.samples_per_insert is not None

    @property
    def diff_bounds(self) -> tuple[float, float]:
        """(min_diff, max_diff) of ``inserts * samples_per_insert - samples``,
        Reverb's SampleToInsertRatio: a number ``e`` means ``offset -+ e``
        with ``offset = samples_per_insert * min_size_to_sample``."""
        if self.samples_per_insert is None:
            return -math.inf, math.inf
        if isinstance(self.error_buffer, tuple):
            return self.error_buffer
        offset = self.samples_per_insert * self.min_size_to_sample
        return offset - self.error_buffer, offset + self.error_buffer

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
            "remover": self.remover,
            "max_times_sampled": self.max_times_sampled,
            "min_size_to_sample": self.min_size_to_sample,
            "samples_per_insert": self.samples_per_insert,
            "error_buffer": list(self.error_buffer) if isinstance(self.error_buffer, tuple)
            else self.error_buffer,
            # only when set: a /dev/shm table's schema reads as it did before
            # file-backed tables existed (layout 4 segments and checkpoints)
            **({} if self.storage_dir is None else {"storage_dir": self.storage_dir}),
            # likewise only when set: a table any client writes reads as before
            **({} if self.writers == "any" else {"writers": self.writers, "writer_uid": self.writer_uid}),
            **({} if self.creator_uid is None else {"creator_uid": self.creator_uid}),
            # only when not "field", the layout of every table stored before
            # row layouts existed: its schema reads as before, and a stored
            # form without the key means "field" (spec_from_dict)
            **({} if self.row_layout == "field" else {"row_layout": self.row_layout}),
            # only when set: a table of rows reads as before frame tables existed
            **({"frames": self.frames.to_wire()} if self.frames else {}),
            **({"frames_per_item": self.frames.per_item} if self.frames.per_item != 1 else {}),
        }

    def to_request(self) -> dict:
        """``to_wire`` for a create request: the layout always named, since a
        request without one asks for "auto"."""
        return {**self.to_wire(), "row_layout": self.row_layout}


def check_table_name(name) -> str:
    if not isinstance(name, str) or not _TABLE_NAME.fullmatch(name):
        raise SchemaError(
            f"invalid table name {brief(name)}: use 1-64 characters from [A-Za-z0-9_.-], "
            "not starting with '.' or '-'"
        )
    return name


def _real(value) -> float | None:
    """``value`` as a finite float, or None: bools, strings, NaN, infinities
    and ints past a float's range are not numbers here."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return None
    try:
        f = float(value)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def _number(name, key, value, integer=False) -> float:
    if integer and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    f = None if integer else _real(value)
    if f is None:
        kind = "an int" if integer else "a finite number"
        raise SchemaError(f"table {name!r}: {key} must be {kind}, got {brief(value)}")
    return f


def make_spec(name, capacity, fields, sampler="prioritized", alpha=0.6, remover="fifo",
              max_times_sampled=0, min_size_to_sample=1, samples_per_insert=None,
              error_buffer=None, storage_dir=None, writers="any", writer_uid=None,
              creator_uid=None, row_layout="auto", frames=None, frames_per_item=1) -> TableSpec:
    """Validate every part of a table definition; raise SchemaError naming the problem.

    Configurations the rate limiter could deadlock on are refused here, at
    creation, not discovered by a hung learner (see ``_check_limits``)."""
    check_table_name(name)
    if not isinstance(capacity, (int, np.integer)) or isinstance(capacity, bool):
        raise SchemaError(f"table {name!r}: capacity must be an int, got {brief(capacity)}")
    if not 1 <= int(capacity) <= MAX_CAPACITY:
        raise SchemaError(f"table {name!r}: capacity {capacity} outside 1..{MAX_CAPACITY}")
    if not isinstance(sampler, str) or sampler not in SAMPLERS:
        raise SchemaError(f"table {name!r}: sampler {brief(sampler)} is not one of {SAMPLERS}")
    if not isinstance(remover, str) or remover not in REMOVERS:
        raise SchemaError(f"table {name!r}: remover {brief(remover)} is not one of {REMOVERS}")
    if _real(alpha) is None or alpha < 0:
        raise SchemaError(f"table {name!r}: alpha must be finite and >= 0 (a number), "
                          f"got {brief(alpha)}")
    alpha = float(alpha)
    mts = _number(name, "max_times_sampled", max_times_sampled, integer=True)
    if not 0 <= mts < 2**32:
        raise SchemaError(f"table {name!r}: max_times_sampled must be 0 (no limit) or 1..2**32-1, "
                          f"got {mts}")
    mss = _number(name, "min_size_to_sample", min_size_to_sample, integer=True)
    spi = None if samples_per_insert is None else _number(name, "samples_per_insert",
                                                          samples_per_insert)
    eb = error_buffer
    if spi is None and eb is not None:
        raise SchemaError(f"table {name!r}: error_buffer needs samples_per_insert")
    if spi is not None:
        if eb is None:
            raise SchemaError(f"table {name!r}: samples_per_insert needs an error_buffer "
                              "(a number, or [min_diff, max_diff])")
        if isinstance(eb, (list, tuple)):
            if len(eb) != 2:
                raise SchemaError(f"table {name!r}: error_buffer pair must be [min_diff, max_diff], "
                                  f"got {brief(eb)}")
            eb = (_number(name, "error_buffer[0]", eb[0]), _number(name, "error_buffer[1]", eb[1]))
        else:
            eb = _number(name, "error_buffer", eb)
    try:
        fields = parse_fields(fields)
        framed = parse_frames(frames, fields, frames_per_item)
    except SchemaError as exc:  # name the table too: a config may define several
        raise SchemaError(f"table {name!r}: {exc}") from None
    check_frame_capacity(name, int(capacity), framed)
    spec = TableSpec(str(name), int(capacity), fields, str(sampler), alpha,
                     str(remover), mts, mss, spi, eb, _storage_dir(name, storage_dir),
                     *_writers(name, writers, writer_uid), _uid(name, "creator_uid", creator_uid),
                     _row_layout(name, row_layout, slot_fields(fields, framed)), framed)
    _check_size(spec)
    _check_limits(spec)
    return spec


def _storage_dir(name, d) -> str | None:
    if d is None or d == "":
        return d
    if not isinstance(d, str) or not d.startswith("/") or "\0" in d or len(d) > 1024:
        raise SchemaError(f"table {name!r}: storage_dir must be an absolute path (at most 1024 "
                          f"characters), \"\" for /dev/shm, or None for the daemon's default; "
                          f"got {brief(d)}")
    return d.rstrip("/") or "/"


def _row_layout(name, layout, fields) -> str:
    if layout == "auto":
        return "slot" if sum(f.item_bytes for f in fields) <= ROW_LAYOUT_AUTO_BYTES else "field"
    if not isinstance(layout, str) or layout not in ROW_LAYOUTS:
        raise SchemaError(f"table {name!r}: row_layout must be \"auto\" (the default), \"slot\" (all "
                          f"fields of a slot together) or \"field\" (each field's rows apart), got "
                          f"{brief(layout)}")
    return layout


def _writers(name, writers, uid) -> tuple[str, int | None]:
    if not isinstance(writers, str) or writers not in WRITERS:
        raise SchemaError(f"table {name!r}: writers must be one of {WRITERS}, got {brief(writers)}")
    if uid is not None and (writers == "any" or isinstance(uid, bool)
                            or not isinstance(uid, (int, np.integer)) or not 0 <= uid < 2**32):
        raise SchemaError(f"table {name!r}: writer_uid must be a uid (0..2**32-1) and goes with "
                          f"writers=\"creator\" only, got {brief(uid)}")
    return writers, None if uid is None else int(uid)


def _uid(name, key, uid) -> int | None:
    if uid is not None and (isinstance(uid, bool) or not isinstance(uid, (int, np.integer))
                            or not 0 <= uid < 2**32):
        raise SchemaError(f"table {name!r}: {key} must be a uid (0..2**32-1), got {brief(uid)}")
    return None if uid is None else int(uid)


def _check_size(spec: TableSpec) -> None:
    """Refuse, naming the field, rows (a stacked field's: its frame ring)
    no segment could hold (sizes are Python ints here: nothing overflows
    before the check)."""
    total = 0
    framed = dict(spec.frames.decl)
    for f in spec.fields:
        how = framed.get(f.name)
        if isinstance(how, str):
            continue  # a follow-on stack: its base's frames
        rows = (spec.frames.ring_frames(spec.capacity) * frame_bytes(f) if how is not None
                else spec.capacity * f.item_bytes)
        total += rows
        if total > MAX_TABLE_BYTES:
            raise SchemaError(
                f"table {spec.name!r}: field {f.name!r} ({f.dtype}, shape {f.shape}: "
                f"{f.item_bytes} bytes an item) brings the rows of {spec.capacity} items to "
                f"{total} bytes; a table holds at most 2**47 ({MAX_TABLE_BYTES}) bytes")


def _check_limits(spec: TableSpec) -> None:
    """Refuse reuse and rate limits under which inserts and samples could
    both end up waiting for each other forever."""
    name, spi = spec.name, spec.samples_per_insert
    if not 1 <= spec.min_size_to_sample <= spec.capacity:
        raise SchemaError(f"table {name!r}: min_size_to_sample {spec.min_size_to_sample} outside "
                          f"1..capacity ({spec.capacity}); the table could never be sampled: set it to at "
                          "least 1 and at most the capacity, less what writers keep reserved "
                          "(docs/guide.md, Tables)")
    if spi is None:
        return
    if not spi > 0:
        raise SchemaError(f"table {name!r}: samples_per_insert must be > 0, got {spi}")
    lo, hi = spec.diff_bounds
    if isinstance(spec.error_buffer, float) and spec.error_buffer < 0:
        raise SchemaError(f"table {name!r}: error_buffer must be >= 0, got {spec.error_buffer}")
    if hi - lo < 2 * max(1.0, spi):
        raise SchemaError(
            f"table {name!r}: the error buffer [{lo:g}, {hi:g}] is narrower than "
            f"2 * max(1, samples_per_insert) = {2 * max(1.0, spi):g}; an insert or a sample "
            "could be blocked for ever")
    if lo > spi * spec.min_size_to_sample:
        raise SchemaError(
            f"table {name!r}: min_diff {lo:g} is above samples_per_insert * min_size_to_sample "
            f"= {spi * spec.min_size_to_sample:g}; once min_size_to_sample items are in, no "
            "sample could ever run and inserts would block for ever")
    if spec.max_times_sampled and spi > spec.max_times_sampled:
        raise SchemaError(
            f"table {name!r}: samples_per_insert {spi:g} exceeds max_times_sampled "
            f"{spec.max_times_sampled}; items leave after {spec.max_times_sampled} samples, so "
            "the ratio can never be reached and inserts would block for ever")


def spec_from_wire(d, asked: bool = False) -> TableSpec:
    if not isinstance(d, dict):
        raise SchemaError(f"table definition must be a map, got {type(d).__name__}")
    return spec_from_dict(d, "table definition", asked)


def spec_from_dict(d: dict, where: str, asked: bool = True) -> TableSpec:
    """The wire/TOML form: every SPEC_KEYS key, the first three required.

    ``asked``: a definition someone asks for (a config, a create request),
    whose missing ``row_layout`` means "auto".  Otherwise a stored or
    described one (a segment's schema, a checkpoint, the daemon's answer),
    where it means "field": the layout of everything stored before
    ``row_layout`` existed, which ``to_wire`` still leaves out."""
    unknown = set(d) - set(SPEC_KEYS)
    if unknown:
        raise SchemaError(f"{where} has unknown keys {brief(sorted(map(str, unknown)))}; "
                          f"a table definition has only {', '.join(SPEC_KEYS)}")
    for key in SPEC_KEYS[:3]:
        if key not in d:
            raise SchemaError(f"{where} lacks {key!r}")
    if not asked and "row_layout" not in d:
        d = {**d, "row_layout": "field"}
    return make_spec(**d)
