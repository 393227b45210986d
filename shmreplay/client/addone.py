"""One item's row stored and its COMMIT published by one kernel: the short
path of ``Table.insert`` for a step-by-step writer (an SB3-style ``add``).

``add_one`` does, in one call, what ``rows.check_one``, the session's
prologue (``Session.begin``: replies waiting) and ``SlotLease.write_one``
(the epoch check, the copy, ``Ring.commit_one``) did from Python: each of
those is ~1 us of numba or numpy call in a tight loop and two to three
times that in a training loop, whose env step and torch update leave the
caches cold (docs/performance.md, "A fused add").

What it accepts is decided when numba types the call, from each value's
numba type against its field's view, never from the value's bytes:

* an array whose dtype casts to the field's by numpy's ``same_kind`` rule
  and whose number of dimensions is the field's (its shape is checked at
  run time, before anything is written);
* a scalar (numba's type of a Python float, int or bool is the dtype
  ``np.asarray`` gives it: float64, int64 or uint64, bool; a numpy scalar's
  is its own) only for a field of shape (), by the same rule.

That is what ``rows.check_rows`` accepts of these types, and the row stored
is the one ``view[slot] = np.asarray(value)`` stores (the casts are the
same C casts: rounding to nearest, integers wrapping; one exception: a bool
array whose bytes are not 0 or 1, a uint8 array viewed as bool, is stored
as 0 and 1, where numpy copies its bytes); the twin in
tests/test_add_one.py holds it to that, byte for byte.  Anything else (a
float16 field, a list, a tensor) is refused (-2) or never handed to it:
the caller takes ``check_rows``'s path, which converts or explains.

``OneAdd`` decides what reaches numba's dispatch, because the dispatch does
not check everything: it lets only arrays of the native byte order and
numeric scalars through (a list would compile a reflected list, a tensor
fail numba's typing, ~2.5 ms a try; and the dispatch keys a tuple's arrays
by dtype number alone, so a big-endian array would run a kernel compiled
for native ones and store its bytes unswapped), remembers combinations of
types numba's typing refused, and takes an int past int64's range (numba's
unboxing overflows, nothing runs) to ``check_rows`` for that call.  Each
combination of value types numba sees compiles once a machine (numba's
cache: 2.7-5.4 s here the first time, ~15 ms to load in a new process).

Who calls it: ``pipe.CommandPipe.add_row`` for ``OneAdd``, for
``lease.SlotLease.add_one``, on the client's thread (the ring's producer
end), never concurrently.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.core.errors import NumbaError
from numba.extending import overload

from ..numbaconf import JIT
from ..wire.commitrun import answers_only, put_commit_one
from ..wire.livewords import LIVE_EPOCH

# numba's cache stamps a cached kernel by its own file's bytes (a hash of
# them), and add_one compiles in wire/commitrun.py's kernels and
# livewords.LIVE_EPOCH: this line carries the hash of both files (the first
# 16 hex digits of sha256 over commitrun.py then livewords.py), so a change
# there changes this file and a warm machine compiles add_one again
COMPILED_IN = "5d5b664b0501763e"

# add_one's answers below 0 (>= 0: the ring's sleeping word, as publish gives it)
RING_FULL = -1     # the row is stored, its COMMIT is not: send it the way that waits
REFUSED = -2       # nothing written: a value's type or shape is not the field's
NOT_NOW = -3       # nothing written: the epoch moved, or the lease is used up
REPLIES = -4       # nothing written: an error reply waits on the response ring (read it first)


def _fits(view, value):
    """Numba-only: may ``value`` be stored as one row of ``view``?"""
    raise NotImplementedError("numba only")


def _same_kind(src, dst) -> bool:
    """numpy's same_kind rule on two numba scalar types (False for float16,
    which numba does not cast, and for anything that is not a number)."""
    ok = (types.Boolean, types.Integer, types.Float)
    if not (isinstance(src, ok) and isinstance(dst, ok)):
        return False
    try:
        a, b = numba.np.numpy_support.as_dtype(src), numba.np.numpy_support.as_dtype(dst)
    except NotImplementedError:
        return False
    if a == np.float16 or b == np.float16:
        return False
    return bool(np.can_cast(a, b, "same_kind"))


def value_fits(view, value):
    """``_fits``'s decision at typing time, from numba types: False (never),
    True (a scalar that fits), or "shape" (an array that fits if its shape
    is the field's, checked at run time).  ``view``: a field's array type
    (rows along axis 0)."""
    if isinstance(value, types.Array):
        if value.ndim != view.ndim - 1 or not _same_kind(value.dtype, view.dtype):
            return False
        return "shape"
    return view.ndim == 1 and _same_kind(value, view.dtype)


@overload(_fits)
def _fits_typed(view, value):
    if not isinstance(view, types.Array):
        return None
    fits = value_fits(view, value)
    if fits == "shape":
        return lambda view, value: value.shape == view.shape[1:]
    if fits:
        return lambda view, value: True
    return lambda view, value: False


def _all_fit(views, values):
    raise NotImplementedError("numba only")


def _store_all(views, values, slot):
    raise NotImplementedError("numba only")


@overload(_all_fit)
def _all_fit_typed(views, values):
    n = len(views)
    if not isinstance(values, types.BaseTuple) or len(values) != n:
        return lambda views, values: False
    src = "def impl(views, values):\n" + "".join(
        f"    if not _fits(views[{i}], values[{i}]):\n        return False\n" for i in range(n)
    ) + "    return True\n"
    scope = {"_fits": _fits}
    exec(src, scope)
    return scope["impl"]


def _store_one(view, slot, value):
    raise NotImplementedError("numba only")


@overload(_store_one)
def _store_one_typed(view, slot, value):
    if isinstance(value, types.Array) and value.ndim == 0:  # a 0-d array into a shape-() field
        def store_item(view, slot, value):
            view[slot] = value.item()
        return store_item

    if isinstance(value, types.Array) and value.layout == "C" and view.layout == "C":
        def store_flat(view, slot, value):
            # one flat loop LLVM turns into a wide copy: numba's n-d setitem
            # walks an index per element (a 28 KB Atari frame: ~25 us, not ~2)
            src = value.reshape(value.size)
            dst = view[slot].reshape(value.size)
            for k in range(value.size):
                dst[k] = src[k]
        return store_flat

    def store(view, slot, value):
        view[slot] = value
    return store


@overload(_store_all)
def _store_all_typed(views, values, slot):
    n = len(views)
    src = "def impl(views, values, slot):\n" + "".join(
        f"    _store_one(views[{i}], slot, values[{i}])\n" for i in range(n)) + "    return 0\n"
    scope = {"_store_one": _store_one}
    exec(src, scope)
    return scope["impl"]


@numba.njit(**JIT)
def add_one(views, values, slots, pos, live, epoch, resp_words, resp_ctl, resp_head_w, resp_tail,
            words, ctl, head, tail_w, head_w, sleeping_w, commit, table, seq, rid):
    """Store ``values`` (a tuple, in field order; ``views`` the table's field
    arrays, the same order) as the row of slot ``slots[pos]`` and publish a
    COMMIT of it (``put_commit_one``, ``words`` to ``sleeping_w`` from
    ``Ring.kernel_args``): the ring's sleeping word (>= 0), or
    ``RING_FULL``, ``REFUSED``, ``NOT_NOW``, ``REPLIES``.  Writes
    nothing when an error reply waits on the response ring (``resp_*``,
    ``commitrun.answers_only``: the prologue drains it first; answers stay
    for the call that waits for them), when the table's epoch (``live``: its live
    words) is no longer ``epoch`` (a restarted daemon: the slots are void),
    when ``pos`` is past the reservation, or when a value does not fit."""
    if not answers_only(resp_words, resp_ctl, resp_head_w, resp_tail):
        return REPLIES
    if np.int64(live[LIVE_EPOCH]) != epoch or pos >= slots.shape[0]:
        return NOT_NOW
    slot = slots[pos]
    if slot < 0 or slot >= views[0].shape[0] or not _all_fit(views, values):
        return REFUSED  # a slot the daemon sent past the table is numpy's IndexError on the checked path
    _store_all(views, values, slot)
    return put_commit_one(words, ctl, head, tail_w, head_w, sleeping_w, commit, table, seq, rid, pos)


# the Python types a value may have to be handed to add_one: arrays, and the
# scalars numba types as np.asarray does (module docstring); a list, a tensor
# or any other object goes to rows.check_rows without meeting numba's typing
# (which would compile a reflected list, or raise, on every call)
KERNEL_TYPES = frozenset([np.ndarray, float, int, bool]
                         + [np.dtype(c).type for c in "?bhilqBHILQfd"])


_UNSEEN = object()


class OneAdd:
    """``add_one`` bound to one table's views, for one lease
    (``lease.SlotLease.add_one``): what it owns is the views as a tuple and
    its verdicts on the Python types of values it was handed.  The
    lease's thread only."""

    def __init__(self):
        self._views: tuple | None = None
        self._live = None
        # tuple(map(type, values)) -> the positions of its arrays, or None:
        # never handed to the kernel (a list, a tensor, or types numba refused)
        self._kinds: dict = {}

    def bind(self, views: list, live) -> None:
        """The table's field views (field order) and its live words
        (``wire.livewords.LiveWords``), as mapped now.  A table with a field
        no value fits in the kernel (float16, complex, a datetime) never
        calls it: each insert would pay its dispatch to be refused."""
        usable = all(v.dtype.kind in "biuf" and v.dtype != np.float16 for v in views)
        self._views = tuple(views) if usable and views else None
        self._live = None if live is None else live.words

    def add(self, pipe, table: int, rid: int, slots, pos: int, values: tuple, epoch: int) -> int:
        """Store ``values`` as the row of ``slots[pos]`` and publish its
        COMMIT on ``pipe`` (``CommandPipe.add_row``, whose answer this is),
        or ``NOT_NOW`` with nothing written if the kernel does not take
        these values."""
        kinds = tuple(map(type, values))
        arrays = self._kinds.get(kinds, _UNSEEN)
        if arrays is _UNSEEN:
            arrays = self._kinds[kinds] = (
                tuple(i for i, k in enumerate(kinds) if k is np.ndarray)
                if all(k in KERNEL_TYPES for k in kinds) else None)
        if arrays is None or self._views is None:
            return NOT_NOW
        for i in arrays:
            if not values[i].dtype.isnative:  # numba would store another byte order's bytes as they are
                return NOT_NOW
        try:
            return pipe.add_row(table, rid, pos, slots, self._views, values, self._live, epoch)
        except OverflowError:  # numba's unboxing of an int past int64: this call only, nothing ran
            return NOT_NOW
        except NumbaError:  # its typing refused these values (nothing ran)
            if not any(type(v) is np.ndarray and v.dtype.hasobject for v in values):
                self._kinds[kinds] = None  # these types, never again; an object array
            return NOT_NOW  # (which check_rows refuses) for this call only
