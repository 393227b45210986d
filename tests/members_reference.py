"""Plain-numpy twins of the kernels in ``shmreplay.server.tables.select.members``.

The twin keeps the member set as a sorted array and answers what the set
holds after each call; the kernels' order inside ``members[:count]`` is
theirs (removal moves the last member into the hole), so the tests compare
the set, the count, and that ``pos`` indexes ``members`` exactly.
"""

from __future__ import annotations

import numpy as np


def members_add(current: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The member set after adding ``slots`` (duplicates and members taken once)."""
    return np.union1d(current, slots)


def members_remove(current: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The member set after removing ``slots`` (non-members skipped)."""
    return np.setdiff1d(current, slots)


def first_new(current: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """The slots an add appends, in the order it appends them: first
    occurrences of slots that were not members."""
    _, first = np.unique(slots, return_index=True)
    ordered = slots[np.sort(first)]
    return ordered[~np.isin(ordered, current)]
