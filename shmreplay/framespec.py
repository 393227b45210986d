"""A frame table's declaration (``frames=``), its checks and its sizes
(docs/frames.md).

``frames`` maps fields of the table to how they are stored:

* an int, the depth: the field is a stack of frames along its first axis
  (``"obs": 4`` for a ``(4, 84, 84)`` field), each frame stored once in the
  field's frame ring;
* a string, a base: the field is a follow-on stack of that field
  (``"next_obs": "obs"``), the same stream's frames, no ring of its own.

Fields it does not name are rows as in any table.  ``parse_frames``
checks a declaration against the table's fields and gives its canonical
form, ``Frames``; a wrong one is a ``SchemaError`` that says what to
write.  Every check is of the value's type first: nothing here trusts a
byte a client sent.  Pure functions and frozen values; any thread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from .errors import SchemaError
from .fields import Field, brief

# a frame reference is a uint32 index into its base's ring
MAX_FRAMES = 2**32 - 1
MAX_DEPTH = 1024
# frames a table keeps beyond one per item: for frames writers hold while
# their streams still need them (a lease each, given back as the stream
# moves on) and for what out-of-order removers leave alive (docs/frames.md)
FRAME_SLACK_DIV, FRAME_SLACK_MIN, FRAME_SLACK_STACKS = 16, 64, 8
FRAMES_FORM = ('frames maps field names to a depth (an int: the field is a stack of that many '
               'frames along its first axis) or to another field\'s name (a follow-on stack of '
               'that field), e.g. frames={"obs": 4, "next_obs": "obs"}')


@dataclass(frozen=True)
class Frames:
    """A checked declaration: ``decl`` holds (field, depth or base field)
    pairs in the table's field order, empty for a table of rows only."""

    decl: tuple[tuple[str, int | str], ...] = ()
    # frames a ring keeps an item: 1 for transitions of one stream (each
    # adds a frame); a sequence table's period (an R2D2 sequence of 80
    # steps every 40 adds 40 frames); the table's ``frames_per_item``
    per_item: int = 1

    def ring_frames(self, capacity: int) -> int:
        """Frames each ring of a table of ``capacity`` items holds."""
        return frame_capacity(capacity, self.per_item,
                              max((how for _, how in self.decl if isinstance(how, int)), default=1))

    def __bool__(self) -> bool:
        return bool(self.decl)

    @property
    def bases(self) -> tuple[str, ...]:
        """Fields with a frame ring of their own, in field order."""
        return tuple(name for name, how in self.decl if isinstance(how, int))

    def base_of(self, name: str) -> str:
        """The field whose ring holds ``name``'s frames (itself for a base)."""
        how = dict(self.decl)[name]
        return name if isinstance(how, int) else how

    def depth(self, name: str) -> int:
        """How many frames a stack of ``name`` holds."""
        return dict(self.decl)[self.base_of(name)]

    @property
    def columns(self) -> tuple[tuple[str, str, int, int], ...]:
        """(field, base field, first column, depth) of each framed field: an
        item's references hold each field's stack in columns first ..
        first + depth - 1, in the declaration's order."""
        out, col = [], 0
        for name, _ in self.decl:
            depth = self.depth(name)
            out.append((name, self.base_of(name), col, depth))
            col += depth
        return tuple(out)

    @property
    def refs_per_item(self) -> int:
        """Frame references an item holds: a depth for every framed field."""
        return sum(self.depth(name) for name, _ in self.decl)

    def to_wire(self) -> list:
        return [[name, how] for name, how in self.decl]


def parse_frames(frames, fields: tuple[Field, ...], per_item=1) -> Frames:
    """Check ``frames`` (a mapping, its TOML table, or the wire form, a
    list of [field, depth or base] pairs; None or empty: no frames)
    against the table's parsed ``fields``; ``per_item``: the table's
    ``frames_per_item`` (1..the deepest stack)."""
    if frames is None or (isinstance(frames, (Mapping, list, tuple)) and not frames):
        if per_item != 1:
            raise SchemaError(f"frames_per_item is {brief(per_item)} but the table declares no "
                              "frames: give frames={...} too, or leave frames_per_item out")
        return Frames()
    if isinstance(frames, Mapping):
        pairs = list(frames.items())
    elif isinstance(frames, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 for p in frames):
        pairs = [tuple(p) for p in frames]
    else:
        raise SchemaError(f"frames must be a mapping, got {brief(frames)}: {FRAMES_FORM}")
    by_name = {f.name: f for f in fields}
    given: dict[str, int | str] = {}
    for name, how in pairs:
        if not isinstance(name, str) or name not in by_name:
            raise SchemaError(f"frames names {brief(name)}, which is not a field of the table; "
                              f"its fields are {', '.join(by_name)}")
        if name in given:
            raise SchemaError(f"frames names field {name!r} twice; give it once")
        given[name] = _how(name, how, by_name[name])
    for name, how in given.items():
        if isinstance(how, str):
            _check_follow_on(name, how, given, by_name)
    decl = tuple((f.name, given[f.name]) for f in fields if f.name in given)
    deepest = max((how for _, how in decl if isinstance(how, int)), default=1)
    if isinstance(per_item, bool) or not isinstance(per_item, (int, np.integer)) or not (
            1 <= per_item <= deepest):
        raise SchemaError(f"frames_per_item is {brief(per_item)}: the frames an item adds to its "
                          f"rings, 1..{deepest} (the deepest stack): 1 for transitions, a "
                          "sequence writer's period for sequences (80 steps every 40: 40)")
    return Frames(decl, int(per_item))


def _how(name: str, how, f: Field) -> int | str:
    if isinstance(how, str):
        return how
    if isinstance(how, bool) or not isinstance(how, (int, np.integer)):
        raise SchemaError(f"frames[{name!r}] is {brief(how)}: give the stack's depth (an int) or "
                          f"the name of the field it follows on from; {FRAMES_FORM}")
    depth = int(how)
    if len(f.shape) < 2:
        raise SchemaError(f"field {name!r} has shape {f.shape}: a stack of frames has the stack "
                          f"along its first axis and a frame of at least one axis after it, "
                          f"e.g. (4, 84, 84) for frames={{{name!r}: 4}}")
    if depth != f.shape[0]:
        raise SchemaError(f"frames[{name!r}] is {depth}, but field {name!r} has shape {f.shape}: "
                          f"its first axis is the stack, so write frames={{{name!r}: "
                          f"{f.shape[0]}}} (or give the field the shape "
                          f"{(depth, *f.shape[1:])})")
    if not 1 <= depth <= MAX_DEPTH:
        raise SchemaError(f"frames[{name!r}]: a depth is 1..{MAX_DEPTH}, got {depth}")
    return depth


def _check_follow_on(name: str, base: str, given: dict, by_name: dict) -> None:
    if base not in by_name:
        raise SchemaError(f"frames[{name!r}] is {base!r}, which is not a field of the table; "
                          f"a follow-on names the stacked field it follows, e.g. "
                          f"frames={{\"obs\": 4, {name!r}: \"obs\"}}")
    if base == name:
        raise SchemaError(f"frames[{name!r}] follows on from itself: give {name!r} its depth "
                          f"(frames={{{name!r}: N}}) or name another stacked field")
    f, b = by_name[name], by_name[base]
    if f.dtype != b.dtype or f.shape != b.shape:
        raise SchemaError(f"field {name!r} ({f.dtype}, shape {f.shape}) follows on from {base!r} "
                          f"({b.dtype}, shape {b.shape}): a follow-on stack holds its base's "
                          f"frames, so give {name!r} the dtype {b.dtype} and the shape {b.shape}")
    if not isinstance(given.get(base), int):
        shape = by_name[base].shape
        raise SchemaError(f"frames[{name!r}] follows on from {base!r}, which frames gives no "
                          f"depth: declare it too, e.g. frames={{{base!r}: "
                          f"{shape[0] if shape else 'N'}, {name!r}: {base!r}}}")


def slot_fields(fields: tuple[Field, ...], frames: Frames) -> tuple[Field, ...]:
    """The fields a slot holds: all but the framed ones (their stacks are
    in frame rings)."""
    framed = {name for name, _ in frames.decl}
    return tuple(f for f in fields if f.name not in framed)


def frame_capacity(capacity: int, per_item: int = 1, depth: int = 1) -> int:
    """Frames a base's ring holds for a table of ``capacity`` items:
    ``per_item`` an item, and a 16th more for frames writers hold and
    frames out-of-order removals leave alive (docs/frames.md): at least 64,
    and at least 8 stacks of ``depth`` (the deepest), so a writer's window
    over a stack and its next lease fit what one client may hold."""
    need = capacity * per_item
    return need + max(FRAME_SLACK_MIN, need // FRAME_SLACK_DIV, FRAME_SLACK_STACKS * depth)


def frame_bytes(f: Field) -> int:
    """Bytes of one frame of the stacked field ``f``."""
    return int(f.dtype.itemsize * math.prod(f.shape[1:]))


def check_frame_capacity(name: str, capacity: int, frames: Frames) -> None:
    """Refuse a frame table whose rings would need references past uint32."""
    if frames and frames.ring_frames(capacity) > MAX_FRAMES:
        raise SchemaError(f"table {name!r}: a frame table holds at most "
                          f"{most_frame_items(frames.per_item)} items of {frames.per_item} frames "
                          f"(its frame references are 32-bit); give it a capacity of at most that")


def most_frame_items(per_item: int = 1) -> int:
    """The largest capacity whose frame rings fit 32-bit references."""
    c = MAX_FRAMES * FRAME_SLACK_DIV // ((FRAME_SLACK_DIV + 1) * per_item)
    while frame_capacity(c + 1, per_item) <= MAX_FRAMES:
        c += 1
    while frame_capacity(c, per_item) > MAX_FRAMES:
        c -= 1
    return c
