"""Rows that show tearing: item ``i``'s row is ``id = i`` and ``obs``
filled with ``i % 251``; a row that mixes two writes, or was never fully
written, fails ``torn()``.  The fault tests take them from ``fault/faults.py``;
tests outside ``fault/`` import them from here."""

import numpy as np

FIELDS = {"obs": ("uint8", (64,)), "id": ("int64", ())}


def rows(ids) -> dict:
    ids = np.asarray(ids, dtype=np.int64)
    return {"obs": np.repeat((ids % 251).astype(np.uint8)[:, None], 64, axis=1), "id": ids}


def torn(data: dict) -> int:
    """How many rows are not exactly what their id says."""
    ids = data["id"]
    want = (ids % 251).astype(np.uint8)[:, None]
    return int(np.sum((ids < 0) | np.any(data["obs"] != want, axis=1)))
