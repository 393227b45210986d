"""The short path of a one-item insert's checks (``rows.check_one``) against
the full check (``rows.check_rows``), which is its reference twin.

Items are drawn from what callers pass: numpy arrays of the right or a
wrong dtype and shape, numpy scalars, Python floats, bools and ints (in
and out of int64's range), lists, strings, None.  Whatever ``check_rows``
refuses, ``check_one`` must hand back None (so the insert takes the full
path, which explains the refusal); whatever ``check_one`` accepts,
``check_rows`` accepts too, and the values it hands back store the same
bytes into a slot (``view[slot] = value``, as the lease writes them) as
``check_rows``' arrays do, or fail the same way.  Pure functions: no
daemon needed."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmreplay.errors import FieldError
from shmreplay.client.rows import check_one, check_rows, one_row_fields
from shmreplay.schema import make_spec

FIELDS = {"obs": ("float32", (4,)), "action": ("int64", ()), "small": ("int32", ()),
          "reward": ("float32", ()), "done": ("bool", ()), "q": ("float64", ()),
          "img": ("uint8", (2, 2)), "u": ("uint64", ()), "h": ("float16", ()), "i8": ("int8", ()),
          "u16": ("uint16", ())}
SPEC = make_spec("checks", 8, FIELDS, sampler="uniform")
NAMES = frozenset(FIELDS)
ONE = one_row_fields(SPEC)

DTYPES = ["float32", "float64", "int64", "int32", "uint8", "uint64", "bool", "float16"]


def values():
    big = st.sampled_from([2**63 - 1, -2**63, 2**63, -2**63 - 1, 2**64, 2**70, 2**31, -1])
    shapes = st.sampled_from([(), (4,), (2, 2), (1, 4), (3,)])
    arrays = st.builds(lambda dt, shape, x: np.full(shape, x).astype(dt),
                       st.sampled_from(DTYPES), shapes, st.integers(-3, 300))
    return st.one_of(
        st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.integers(-2**40, 2**40), big,
        arrays,
        st.builds(_numpy_scalar, st.sampled_from(DTYPES),
                  st.one_of(st.integers(-2**40, 2**40), st.floats(-1e6, 1e6))),
        st.sampled_from([None, "x", [1.0, 2.0, 3.0, 4.0], [[1, 2], [3, 4]], object(),
                         np.arange(8, dtype=np.float32)[::2],  # non-contiguous
                         np.ma.masked_array(np.ones(4, np.float32)),  # a subclass: the full path
                         np.arange(4, dtype=">f4")]))  # another byte order


def _numpy_scalar(dtype, x):
    """A numpy scalar of ``dtype`` made from x as a cast makes it (wrapped, or inf)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x).astype(dtype)[()]


def items():
    good = {"obs": np.arange(4, dtype=np.float32), "action": 1, "small": np.int32(3), "reward": 1.0,
            "done": False, "q": 0.5, "img": np.zeros((2, 2), np.uint8), "u": np.uint64(7),
            "h": 0.25, "i8": np.int8(-3), "u16": np.uint16(9)}
    return st.builds(lambda swaps, drop, extra: _item(good, swaps, drop, extra),
                     st.dictionaries(st.sampled_from(sorted(FIELDS)), values(), max_size=4),
                     st.one_of(st.none(), st.sampled_from(sorted(FIELDS))),
                     st.booleans())


def _item(good, swaps, drop, extra):
    item = {**good, **swaps}
    if drop is not None:  # a missing field
        del item[drop]
    if extra:  # an unknown one beside the rest
        item["unknown"] = 1.0
    return item


def stored(values: list):
    """The bytes a slot holds after ``view[slot] = value`` per field, or the
    exception type the first failing store raised."""
    rows = {name: np.zeros((2, *shape), dtype) for name, dtype, shape, _ in ONE}
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # 1e300 into a float16: inf, both ways
            for (name, _, _, _), v in zip(ONE, values):
                rows[name][1] = v
    except Exception as exc:  # noqa: BLE001 (the type is what is compared)
        return type(exc)
    return [rows[name][1].tobytes() for name, _, _, _ in ONE]


@settings(max_examples=1500, deadline=None)
@given(items())
def test_the_short_path_takes_only_what_the_full_check_takes_and_stores_the_same(item):
    fast = check_one(ONE, NAMES, item)
    try:
        arrays, _ = check_rows(SPEC, NAMES, item, batch=False)
    except FieldError:
        assert fast is None
        return
    if fast is None:
        return  # the full path takes it (a list, a Python int for an int32...): nothing to compare
    assert stored(fast) == stored(arrays)


def test_the_short_path_takes_what_an_sb3_style_add_passes():
    """The values a CartPole actor hands in (arrays, a Python or numpy int
    action, a float reward, a bool done, numpy scalars) take the short
    path: the case it is for."""
    item = {"obs": np.ones(4, np.float32), "action": 1, "small": np.int32(2), "reward": 1.0,
            "done": True, "q": 2.5, "img": np.ones((2, 2), np.uint8), "u": np.uint64(1),
            "h": 0.5, "i8": np.int8(1), "u16": np.uint16(2)}
    got = check_one(ONE, NAMES, item)
    assert got is not None and [type(v) for v in got] == [np.ndarray, int, np.int32, float, bool, float,
                                                          np.ndarray, np.uint64, float, np.int8, np.uint16]
    item["action"] = np.int64(1)  # what a gymnasium Discrete space's sample() returns
    assert check_one(ONE, NAMES, item) is not None


@pytest.mark.parametrize("field,value", [("action", 2**63), ("action", 1.5), ("small", 7),
                                         ("small", np.int64(2**31)), ("reward", np.float64(0.1)),
                                         ("obs", np.zeros(3, np.float32)), ("img", np.zeros((2, 2), np.int64)),
                                         ("done", 1.0), ("q", "1")])
def test_values_that_narrow_or_need_numpy_take_the_full_path(field, value):
    """An int for an int32 field (np.asarray makes it int64, which the full
    path casts by wrapping where a stored Python int overflows), a numpy
    scalar whose cast is not safe (likewise), an int64 out of range, a float
    for an int, a wrong shape: the full path decides."""
    item = {"obs": np.ones(4, np.float32), "action": 1, "small": np.asarray(2, np.int32), "reward": 1.0,
            "done": True, "q": 2.5, "img": np.ones((2, 2), np.uint8), "u": np.asarray(1, np.uint64),
            "h": 0.5, "i8": np.int8(1), "u16": np.uint16(2), field: value}
    assert check_one(ONE, NAMES, item) is None
