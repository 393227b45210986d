"""``TableFrames``: a frame table's frame side, as its ``Table`` uses it
at four points (docs/frames.md).

It owns the table's ``FrameBook`` and makes its moves whole for the
table: a reservation's slots let go of their items' references
(``reserved``, called once their stamps are bumped), a commit takes a
part's references all or none (``commit``), a frame lease that finds its
ring short first asks the table to free frames (``lease``'s ``reclaim``:
free slots' references, then evictions; only the table knows its slots
and its remover) and then takes what is free, and a gone owner's leases
end (``release_owner``).  ``reclaim_from`` lets go of the references of
slots the table has freed and re-stamped for it.

Who calls it: the table (engine thread only), and the engine's frame
lease handlers through it.  Nothing here is safe to call concurrently.
"""

from __future__ import annotations

import numpy as np

from ....errors import FieldError, LayoutError, ProtocolError
from ....framespec import Frames
from ....wire.framelayout import NO_REF
from ....wire.framerecords import MAX_LEASE_FRAMES
from .book import FrameBook


class TableFrames:
    """The frames of one table, for that table."""

    def __init__(self, name: str, frames: Frames, capacity: int, refs: np.ndarray,
                 cap_per_owner: int | None = None):
        self.name = name
        self.book = FrameBook(frames, capacity, refs, cap_per_owner)
        self.refs_per_item = frames.refs_per_item
        self.stats = {"frames_leased": 0, "frames_reclaimed": 0, "evicted_for_frames": 0}

    # ---- the table's moves ----
    def reserved(self, slots: np.ndarray) -> None:
        """``slots`` were just reserved (their stamps bumped): they let go
        of the references their last items held."""
        self.book.let_go(slots)

    def commit(self, part: np.ndarray, refs) -> None:
        """The items of ``part`` (slots, in order) take their references,
        ``refs`` uint32[len(part), references an item] (a COMMIT's payload:
        each row read once).  All or none: a bad row is a ``FieldError``
        with no row counted; a payload of another shape or type a
        ``ProtocolError``."""
        n = part.shape[0]
        if (not isinstance(refs, np.ndarray) or refs.dtype != np.uint32
                or refs.shape != (n, self.refs_per_item)):
            got = "none" if refs is None else f"{getattr(refs, 'dtype', type(refs).__name__)}" \
                f"{getattr(refs, 'shape', '')}"
            raise ProtocolError(f"a COMMIT of {n} items to frame table {self.name!r} carries "
                                f"uint32[{n}, {self.refs_per_item}] frame references; got {got}")
        for k in range(n):
            try:
                self.book.commit(int(part[k]), refs[k])
            except FieldError:
                self.book.let_go(part[:k].astype(np.int64))
                raise

    def lease(self, owner: int, ring: int, n: int, reclaim) -> tuple[int, np.ndarray]:
        """Up to ``n`` frames of ring ``ring`` for ``owner`` (``FrameBook.lease``).
        If fewer are free, ``reclaim(short)`` asks the table to free that
        many first (its free slots' references, then evictions); it may
        free fewer, and the lease then holds what there is."""
        if not 0 <= ring < len(self.book.rings) or not 1 <= n <= MAX_LEASE_FRAMES:
            raise ProtocolError(f"a frame lease on table {self.name!r} asks for ring {ring} of "
                                f"{len(self.book.rings)} and {n} frames (1..{MAX_LEASE_FRAMES})")
        short = min(n, self.book.leases.room(owner)) - self.book.free(ring)
        if short > 0:
            reclaim(short)
        lid, frames = self.book.lease(owner, ring, n)
        self.stats["frames_leased"] += frames.shape[0]
        return lid, frames

    def holding(self, slots: np.ndarray) -> np.ndarray:
        """Those of ``slots`` whose references are not let go yet."""
        return slots[self.book.refs[slots, 0] != NO_REF]

    def reclaim_from(self, slots: np.ndarray) -> int:
        """The table freed ``slots`` and bumped their stamps for frames:
        they let go of their references.  Returns how many frames that
        freed."""
        freed = self.book.let_go(slots.astype(np.int64))
        self.stats["frames_reclaimed"] += freed
        return freed

    def give_back(self, owner: int, lid: int) -> int:
        return self.book.give_back(owner, lid)

    def release_owner(self, owner: int) -> int:
        return self.book.release_owner(owner)

    def report(self, size: int) -> dict:
        """The frame side's numbers for ``stats``/``shmreplay status``: per
        ring its frames, those held (by items or leases), those in leases,
        and frames held an item held (``size``: the table's items)."""
        book = self.book
        rings = {}
        for r, base in enumerate(book.rings):
            held = book.held(r)
            rings[base] = {"frames": book.size, "held": held, "free": book.free(r),
                           "frames_per_item": round(held / size, 3) if size else None}
        return {"rings": rings, "in_leases": book.leases.held(), "leases": len(book.leases),
                **self.stats}

    def adopt(self) -> None:
        """A dead daemon's (or a restored checkpoint's) table: the counts
        rebuilt from the references its slots hold, every lease gone.  A
        reference no daemon of this build could have written (outside its
        ring, a row half marked) is a ``LayoutError``: the table is set
        aside, not served with frames that may be anyone's."""
        bad = self.book.adopt()
        if bad:
            raise LayoutError(f"table {self.name!r}: {bad} frame references in its meta segment "
                              "are outside their rings or in rows half marked; no daemon of this "
                              "build wrote them, so the table is set aside: restore it from a "
                              "checkpoint, or drop it")
