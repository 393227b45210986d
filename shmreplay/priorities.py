"""Priority validation, shared by the client (to fail fast, in the caller's
stack) and the daemon (which trusts no client).  Pure functions; any thread.
``first_invalid_priority`` has a plain-numpy twin in tests/sumtree_reference.py."""

from __future__ import annotations

import numba
import numpy as np

from .errors import PriorityError
from .fields import unconvertible
from .numbaconf import JIT

@numba.njit(**JIT)
def first_invalid_priority(priorities):
    """Index of the first NaN, infinite or negative priority, or -1."""
    for k in range(priorities.shape[0]):
        v = priorities[k]
        if not (v >= 0.0 and v < np.inf):
            return k
    return -1


# the tree's total must stay finite even with 2**32 leaves at the maximum
MAX_TREE_VALUE = 1e290


@numba.njit(**JIT)
def priorities_fit(priorities, alpha):
    """True if every priority is finite and >= 0 and the largest one's tree
    value ``p ** alpha`` is at most MAX_TREE_VALUE: the whole check in one
    pass and one call (``check_priorities`` took 14 us for 256 priorities as
    numpy calls, more than the rest of an update_priorities call)."""
    top = 0.0
    for k in range(priorities.shape[0]):
        v = priorities[k]
        if not (v >= 0.0 and v < np.inf):
            return False
        if v > top:
            top = v
    return not top ** alpha > MAX_TREE_VALUE


def check_priorities(priorities: np.ndarray, n: int, what: str, alpha: float = 1.0) -> None:
    """Raise PriorityError unless there are n finite priorities >= 0 whose
    tree values ``p ** alpha`` stay below MAX_TREE_VALUE."""
    if priorities.shape != (n,):
        raise PriorityError(f"{what}: expected {n} priorities, got shape {priorities.shape}")
    if priorities_fit(priorities, alpha):
        return  # the common case; the checks below say what is wrong
    bad = first_invalid_priority(priorities)
    if bad >= 0:
        raise PriorityError(
            f"{what}: priority[{bad}] = {priorities[bad]!r} is not a finite number >= 0")
    if n:
        top = float(priorities.max())
        with np.errstate(over="ignore"):
            value = float(np.power(top, alpha))
        if value > MAX_TREE_VALUE:
            raise PriorityError(f"{what}: priority {top!r} ** alpha {alpha} = {value!r} exceeds "
                                f"the sum tree's limit {MAX_TREE_VALUE:g}")


def as_priorities(values, n: int, what: str, alpha: float) -> np.ndarray:
    """Convert user input to a contiguous float64 array and check it."""
    try:
        p = np.ascontiguousarray(values, dtype=np.float64).reshape(-1)
    except Exception as exc:  # whatever numpy (or a tensor's __array__) raised: say what to do
        raise PriorityError(f"{what}: priorities are not numbers: "
                            f"{unconvertible(values, exc, f'({n},)')}") from exc
    check_priorities(p, n, what, alpha)
    return p
