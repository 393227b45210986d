"""A fixed-capacity FIFO of integers in a numpy ring (free slots, commit order),
and ``is_run``: whether the slots a reservation hands out are one run.

Engine thread only.  Bulk push/pop are a copy or two, not a Python loop.
"""

from __future__ import annotations

import numba
import numpy as np

from ....numbaconf import JIT


@numba.njit(**JIT)
def is_run(slots) -> bool:
    """Whether ``slots`` are s, s + 1, s + 2, ... (a writer then copies its
    rows with one slice per field).  One kernel: numpy's diff and all cost
    ~20 us of every reservation of a small table, ~13% of its writer's
    daemon time."""
    for i in range(1, slots.shape[0]):
        if slots[i] != slots[0] + i:
            return False
    return True


class SlotQueue:
    def __init__(self, capacity: int, dtype=np.int64):
        self.buf = np.zeros(max(1, capacity), dtype=dtype)
        self.start = 0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def push(self, values: np.ndarray) -> None:
        n = values.shape[0]
        cap = self.buf.shape[0]
        if self.count + n > cap:
            raise OverflowError(f"SlotQueue of {cap} cannot take {n} more (holds {self.count})")
        end = (self.start + self.count) % cap
        first = min(n, cap - end)
        self.buf[end:end + first] = values[:first]
        self.buf[:n - first] = values[first:]
        self.count += n

    def pop(self, n: int) -> np.ndarray:
        n = min(n, self.count)
        cap = self.buf.shape[0]
        first = min(n, cap - self.start)
        out = np.concatenate((self.buf[self.start:self.start + first], self.buf[:n - first]))
        self.start = (self.start + n) % cap
        self.count -= n
        return out
