"""Writers' frame leases: which frames of which ring each lease holds,
whose it is, and how many frames each owner holds (capped, so that one
client cannot take every free frame).  Only the books: ``book.py`` hands
the frames out and back.  Engine thread only.
"""

from __future__ import annotations

import numpy as np

from ....errors import ReplayError


class FrameLeases:
    """Leases by id: (owner, ring, frames)."""

    def __init__(self, cap_per_owner: int):
        self.cap_per_owner = cap_per_owner
        self._leases: dict[int, tuple[int, int, np.ndarray]] = {}
        self._by_owner: dict[int, set[int]] = {}
        self._held: dict[int, int] = {}
        self._next = 1

    def room(self, owner: int) -> int:
        """Frames ``owner`` may still lease."""
        return max(0, self.cap_per_owner - self._held.get(owner, 0))

    def add(self, owner: int, ring: int, frames: np.ndarray) -> int:
        """Record a lease just handed out; returns its id."""
        lid = self._next
        self._next += 1
        self._leases[lid] = (owner, ring, frames)
        self._by_owner.setdefault(owner, set()).add(lid)
        self._held[owner] = self._held.get(owner, 0) + frames.shape[0]
        return lid

    def pop(self, owner: int, lid: int) -> tuple[int, np.ndarray]:
        """Forget lease ``lid`` of ``owner``: (ring, frames).  Another
        owner's lease, or one that has ended, is a ``ReplayError`` and
        changes nothing."""
        got = self._leases.get(lid)
        if got is None or got[0] != owner:
            raise ReplayError(f"frame lease {lid} is not one of yours (ended, or never given): "
                              "give back only the leases the daemon gave you, once")
        del self._leases[lid]
        return self._forget(owner, lid, got)

    def pop_owner(self, owner: int) -> list[tuple[int, np.ndarray]]:
        """Forget every lease of ``owner`` (its client is gone): (ring, frames) each."""
        return [self._forget(owner, lid, self._leases.pop(lid))
                for lid in sorted(self._by_owner.get(owner, ()))]

    def _forget(self, owner: int, lid: int, got) -> tuple[int, np.ndarray]:
        _, ring, frames = got
        ids = self._by_owner[owner]
        ids.discard(lid)
        if not ids:
            del self._by_owner[owner]
        self._held[owner] -= frames.shape[0]
        if not self._held[owner]:
            del self._held[owner]
        return ring, frames

    def clear(self) -> None:
        """Forget every lease (their daemon is gone); ids go on from where
        they were, so none is given twice."""
        self._leases.clear()
        self._by_owner.clear()
        self._held.clear()

    def held(self, owner: int | None = None) -> int:
        """Frames leases hold (``owner``'s, or everyone's)."""
        return self._held.get(owner, 0) if owner is not None else sum(self._held.values())

    def __len__(self) -> int:
        return len(self._leases)
