"""What a writer keeps of the items it has begun (``writers.py``): an open
item's slot and steps (``OpenItem``, ``OpenTransition``), a step's value
checked against its field (``as_step``), a writer's role map
(``roles_of``), and on a frame table its frame store and an item's
references (``frame_store``, ``frame_refs``; docs/frames.md).  Pure
helpers and plain records; the writer's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import FieldError
from ..fields import cannot_store, unconvertible
from .pipe import deadline_of


def as_step(table, field, value, shape) -> np.ndarray:
    try:  # as client/rows.py: the words only once numpy has refused the value
        a = np.asarray(value)
    except Exception as exc:
        raise FieldError(f"table {table.name!r}, field {field!r}: "
                         f"{unconvertible(value, exc, str(shape))}") from exc
    if a.shape != shape:
        raise FieldError(f"table {table.name!r}, field {field!r}: step shape {a.shape}, "
                         f"expected {shape}")
    dtype = table.spec.field(field).dtype
    if a.dtype != dtype and not np.can_cast(a.dtype, dtype, "same_kind"):
        raise FieldError(f"table {table.name!r}, field {field!r}: {cannot_store(a.dtype, dtype)}")
    return a


@dataclass(slots=True)
class OpenItem:
    """An item a writer has begun in a slot of its lease and not committed:
    where the slot came from (``rid``, ``pos``: what the lease commits or
    hands back) and how many steps it holds so far."""
    rid: int
    pos: int
    slot: int
    steps: int = 0
    # a frame table's: the item's framed fields, kept here (not in the slot)
    # until it commits, when their frames are stored (``_frame_refs``)
    stacks: dict | None = None


@dataclass(slots=True)
class OpenTransition(OpenItem):
    """An n-step transition begun: also its discounted reward so far."""
    ret: float = 0.0


def frame_store(table, window: int, timeout):
    """A writer's ``framestore.FrameStore`` on a frame table (None on a
    table of rows) and the names of its framed fields."""
    frames = table.spec.frames
    if not frames:
        return None, frozenset()
    return table.frame_store(window, timeout), frozenset(name for name, _ in frames.decl)


def frame_refs(writer, item: OpenItem) -> np.ndarray:
    """The references of a finished item's stacks, its frames stored as the
    writer's window lacks them.  If that fails the item is not committed:
    it and every later open one go back (none precedes a committed one)."""
    try:
        return writer.frames.item_refs(item.stacks, deadline_of(writer.timeout))
    except BaseException:
        writer.lease.release([(o.rid, o.pos, o.slot) for o in (item, *writer.open)])
        writer.open.clear()
        raise


def roles_of(table, roles, given) -> dict:
    """A writer's role -> field name map: ``given`` overrides the defaults
    (each role's own name)."""
    given = dict(given or {})
    unknown = sorted(set(given) - set(roles))
    if unknown:
        raise FieldError(f"table {table.name!r}: unknown writer role(s) {unknown}; the roles are {list(roles)}")
    return {r: str(given.get(r, r)) for r in roles}
