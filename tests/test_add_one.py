"""The one-kernel insert (``client.addone``) against the checked path, its
reference twin: ``rows.check_rows`` and a numpy store (``view[slot] =
array``), as ``test_row_checks.py`` holds ``check_one`` to.

* What the kernel takes, decided from numba types (``value_fits``), is
  only what ``check_rows`` takes: over a grid of values (Python and numpy
  scalars, arrays of every numeric dtype and a few shapes, in and out of
  range) and fields of every numeric dtype.
* What it stores is byte for byte what the checked path stores, for values
  hypothesis draws (NaN, infinities, integers that wrap), for four fixed
  combinations of value types (each combination compiles once).
* Through a real daemon: an SB3-style add takes the kernel and the rows
  come back whole; values it does not take (a list, an object numba cannot
  type, a wrong shape) take the checked path, which stores or explains.
"""

import hashlib
import os
import time

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import shmreplay
from shmreplay.client import addone, pipe as pipemod
from shmreplay.client.rows import check_rows
from shmreplay.errors import FieldError
from shmreplay.schema import make_spec
from shmreplay.wire.records import RECORD, SAMPLE

NUMERIC = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
           "float16", "float32", "float64"]


def _grid_values():
    out = [True, 0, -1, 7, 2**31, 2**63 - 1, 2**63, -2**63, 1.5, float("nan"), 1e300]
    for dt in NUMERIC:
        out.append(np.asarray(3).astype(dt)[()])         # a numpy scalar
        for shape in [(), (4,), (2, 2), (3,)]:
            out.append(np.ones(shape, dt))
    out.append(np.arange(8, dtype=np.float32)[::2])      # not contiguous
    return out


def _checked(dtype, shape, value):
    """Does check_rows take ``value`` for a field of ``dtype`` and ``shape``?"""
    spec = make_spec("grid", 4, {"f": (dtype, shape)}, sampler="uniform")
    try:
        check_rows(spec, frozenset(["f"]), {"f": value}, batch=False)
    except FieldError:
        return False
    return True


def test_the_kernel_takes_only_what_the_checked_path_takes():
    """For every field dtype and shape, and every value of the grid numba can
    type: if the kernel's rule takes it (a scalar, or an array of the
    field's shape), check_rows takes it too; float16 is never the kernel's."""
    taken = 0
    for dtype in NUMERIC:
        for shape in [(), (4,), (2, 2)]:
            view_ty = numba.typeof(np.zeros((2, *shape), dtype))
            for value in _grid_values():
                try:
                    value_ty = numba.typeof(value)
                except (ValueError, TypeError, OverflowError):
                    continue  # numba's dispatch raises, nothing runs (OneAdd then declines them)
                fits = addone.value_fits(view_ty, value_ty)
                if fits == "shape":
                    fits = np.shape(value) == shape
                if fits:
                    taken += 1
                    assert _checked(dtype, shape, value), (dtype, shape, value)
                    assert "float16" not in (dtype, getattr(value, "dtype", None))
    assert taken > 100  # the rule takes the usual cases, not nothing


FIELDS = {"obs": ("float32", (4,)), "i8": ("int8", ()), "i32": ("int32", ()), "f32": ("float32", ()),
          "f64": ("float64", ()), "b": ("bool", ()), "u16": ("uint16", ()), "img": ("uint8", (2, 2))}
SPEC = make_spec("twin", 4, FIELDS, sampler="uniform")
ORDER = tuple(FIELDS)

# four combinations of value types (numba compiles one kernel each):
# arrays of the field's dtype and Python scalars; arrays that narrow and
# numpy scalars that wrap; 0-d arrays and bools into numbers; arrays that
# are not C-contiguous
def _w(x, dtype):
    """x cast to ``dtype`` as numpy casts (wrapping): a numpy scalar, or an array."""
    with np.errstate(over="ignore", invalid="ignore"):
        a = np.asarray(x).astype(dtype)
    return a[()] if a.ndim == 0 else a


COMBOS = [
    (lambda x, i, f: (np.full(4, f, np.float32), i, i, f, f, bool(i % 2), _w(i, np.uint16),
                      np.full((2, 2), i % 256, np.uint8))),
    (lambda x, i, f: (np.full(4, f, np.float64), np.int64(i), np.int64(i), np.float64(f), np.float32(f),
                      np.bool_(i % 2), _w(i, np.uint8), _w(np.full((2, 2), i), np.uint16))),
    (lambda x, i, f: (np.arange(4, dtype=np.int16) + x, np.asarray(_w(i, np.int16)), np.asarray(i % 2 == 0),
                      np.asarray(f), True, np.asarray(i % 3 == 0), _w(x, np.uint8), np.ones((2, 2), np.bool_))),
    # arrays that are not C-contiguous (numba's strided store, not the flat copy)
    (lambda x, i, f: (np.full(8, f, np.float32)[::2], i, i, f, f, False, _w(i, np.uint16),
                      np.asfortranarray(_w(np.arange(4).reshape(2, 2) + i, np.uint8)))),
]


def _scratch():
    """Views of a 4-slot table and a scratch request ring for the kernel."""
    views = tuple(np.zeros((4, *shape), dtype) for dtype, shape in FIELDS.values())
    return views, np.zeros((8, 8), np.uint64), np.zeros(8, np.uint64)


def _kernel_store(values):
    views, words, ctl = _scratch()
    got = addone.add_one(views, values, np.array([2, 3]), 0, np.zeros(16, np.uint64), 0,
                         np.zeros((4, 8), np.uint64), np.zeros(4, np.uint64), 1, 0, words, ctl, 0, 0, 1, 2,
                         2, 1, 1, 7)
    return got, [v[2].tobytes() for v in views], words[0]


def _numpy_store(values):
    with np.errstate(over="ignore", invalid="ignore"):
        arrays, _ = check_rows(SPEC, frozenset(FIELDS), dict(zip(ORDER, values)), batch=False)
        views, _, _ = _scratch()
        for view, a in zip(views, arrays):
            view[2] = a
    return [v[2].tobytes() for v in views]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(range(len(COMBOS))), st.integers(-5, 5),
       st.one_of(st.integers(-2**40, 2**40), st.sampled_from([127, 128, -129, 2**31, 2**32 + 5, 65536])),
       st.floats(allow_nan=True, allow_infinity=True, width=64))
def test_the_kernel_stores_what_the_checked_path_stores(combo, x, i, f):
    values = COMBOS[combo](x, i, f)
    with np.errstate(over="ignore", invalid="ignore"):
        got, rows, record = _kernel_store(values)
    assert got == 0  # stored and published (the scratch consumer is awake)
    assert rows == _numpy_store(values)
    assert int(record[0]) & 0xFFFF == 2 and int(record[4]) == 0  # a COMMIT of position 0 (op, a2)


def test_the_kernels_file_changes_with_what_it_compiles_in():
    """numba's cache would run an old add_one after a change to the kernels
    it compiles in (its stamp is addone.py's bytes only): addone.py carries
    their hash.  If this fails, set ``COMPILED_IN`` to the hash it names."""
    wire = os.path.join(os.path.dirname(shmreplay.__file__), "wire")
    data = b"".join(open(os.path.join(wire, f), "rb").read() for f in ("commitrun.py", "livewords.py"))
    assert addone.COMPILED_IN == hashlib.sha256(data).hexdigest()[:16]


def _replies(statuses, head=None):
    """A scratch response ring (records as words, and its control words,
    the head at index 1) holding replies with these statuses from tail 0;
    ``head``: another head, as a peer might scribble."""
    words, ctl = np.zeros((4, 8), np.uint64), np.zeros(4, np.uint64)
    for j, status in enumerate(statuses):
        rec = words[j:j + 1].view(RECORD)
        rec["op"], rec["status"], rec["seq"] = SAMPLE, status, j + 1
    ctl[1] = len(statuses) if head is None else head
    return words, ctl


def test_the_kernel_writes_nothing_it_refuses():
    """A wrong shape, a value of a kind that does not cast (a float for an
    int8), an error reply waiting (behind an answer too), a response head
    past the ring, a moved epoch, a position past the reservation, a slot
    past the table: nothing stored, no record published."""
    good = COMBOS[0](0, 3, 1.5)
    cases = {
        "shape": (good[:7] + (np.zeros((2, 3), np.uint8),), {}),
        "kind": ((good[0], 1.5) + good[2:], {}),
        "error": (good, {"replies": [7]}),
        "error behind an answer": (good, {"replies": [0, 7]}),
        "impossible head": (good, {"replies": [], "head": 5}),
        "epoch": (good, {"epoch": 1}),
        "past": (good, {"pos": 2}),
        "slot": (good, {"slots": np.array([4, 5])}),
    }
    for name, (values, kw) in cases.items():
        views, words, ctl = _scratch()
        resp_words, resp_ctl = _replies(kw.get("replies", []), kw.get("head"))
        got = addone.add_one(views, values, kw.get("slots", np.array([2, 3])), kw.get("pos", 0),
                             np.zeros(16, np.uint64), kw.get("epoch", 0), resp_words, resp_ctl, 1, 0,
                             words, ctl, 0, 0, 1, 2, 2, 1, 1, 7)
        want = addone.REPLIES if "replies" in kw else (addone.REFUSED, addone.NOT_NOW)
        assert got == want if "replies" in kw else got in want, name
        assert all(not v.any() for v in views) and not words.any() and not ctl.any(), name


def test_answers_waiting_stay_for_their_caller_and_the_row_goes_in():
    """Replies with status 0 (a drawn-ahead SAMPLE's, an asked-ahead
    RESERVE's) do not stop the kernel: they are read by the call that
    waits for them, so the add does not copy them aside first."""
    good = COMBOS[0](0, 3, 1.5)
    views, words, ctl = _scratch()
    resp_words, resp_ctl = _replies([0, 0])
    got = addone.add_one(views, good, np.array([2, 3]), 0, np.zeros(16, np.uint64), 0, resp_words,
                         resp_ctl, 1, 0, words, ctl, 0, 0, 1, 2, 2, 1, 1, 7)
    assert got == 0
    assert [v[2].tobytes() for v in views] == _numpy_store(good)
    assert int(ctl[1]) == 1 and int(resp_ctl[1]) == 2  # published; the replies left as they were


@pytest.fixture
def table(client):
    return client.create_table("t", capacity=4096, sampler="fifo", max_times_sampled=1,
                               fields={"obs": ("float32", (4,)), "action": ("int64", ()),
                                       "reward": ("float32", ()), "done": ("bool", ())})


def _answers(monkeypatch) -> list:
    """The kernel's answers to every call the client makes of it."""
    got = []
    kernel = pipemod.add_one

    def counted(*args):
        got.append((args[1], kernel(*args)))
        return got[-1][1]
    monkeypatch.setattr(pipemod, "add_one", counted)
    return got


def test_an_sb3_style_add_takes_the_kernel_and_what_it_declines_takes_the_checked_path(table, monkeypatch):
    calls = _answers(monkeypatch)
    obs = np.arange(4, dtype=np.float32)
    for i in range(200):
        table.insert(obs=obs + i, action=i, reward=0.5 * i, done=bool(i % 2))
    assert sum(answer >= 0 for _, answer in calls) > 150  # stored: all but the calls that turn a lease over
    table.insert(obs=[1.0, 2.0, 3.0, 4.0], action=200, reward=100.0, done=False)  # a list: checked path
    before = len(calls)
    table.insert(done=True, reward=np.float32(100.5), action=np.int64(201), obs=obs + 201)  # another order
    assert calls[before:] and calls[-1][1] >= 0  # stored by the kernel too
    with pytest.raises(FieldError, match="obs"):
        table.insert(obs=np.zeros(3, np.float32), action=1, reward=0.0, done=False)
    assert calls[-1][1] == addone.REFUSED
    assert not any(isinstance(v, list) for values, _ in calls for v in values)  # the list never reached numba
    table.flush()
    b = table.sample(202, timeout=10)
    order = np.argsort(b.data["action"])
    actions = b.data["action"][order]
    assert actions.tolist() == list(range(202))
    expect = np.arange(4, dtype=np.float32) + actions[:, None].astype(np.float32)
    expect[200] = [1.0, 2.0, 3.0, 4.0]
    assert (b.data["obs"][order] == expect).all()
    rewards = (0.5 * actions).astype(np.float32)
    rewards[200], rewards[201] = 100.0, 100.5
    assert (b.data["reward"][order] == rewards).all()
    dones = actions % 2 == 1
    dones[201] = True
    assert (b.data["done"][order] == dones).all()


def test_values_numba_would_store_wrong_take_the_checked_path_and_the_kernel_stays_on(table, monkeypatch):
    """A big-endian array: numba's dispatch keys a tuple's arrays by dtype
    number, not byte order, so a kernel compiled for native float32 would
    store its bytes unswapped; it goes to the checked path, which stores
    it right.  An int past int64's range for a kernel compiled for int64
    (numba's unboxing overflows): the checked path too, which wraps it as
    numpy does.  An object array fails numba's typing and is refused by
    the checked path.  Later native values of the same Python types still
    take the kernel."""
    calls = _answers(monkeypatch)
    obs = np.arange(4, dtype=np.float32)
    for i in range(3):
        table.insert(obs=obs + i, action=i, reward=0.0, done=False)
    for i in range(3, 6):
        table.insert(obs=(np.arange(4) + i).astype(">f4"), action=i, reward=0.0, done=False)
    table.insert(obs=obs + 6, action=2**63 + 6, reward=0.0, done=False)
    with pytest.raises(FieldError):  # an object array: numba's typing fails, check_rows explains
        table.insert(obs=np.arange(4).astype(object), action=8, reward=0.0, done=False)
    tried = len(calls)
    assert not any(values[0].dtype.byteorder == ">" for values, _ in calls)
    table.insert(obs=obs + 7, action=7, reward=0.0, done=False)
    assert len(calls) > tried and calls[-1][1] >= 0
    table.flush()
    b = table.sample(8, timeout=10)
    order = np.argsort(b.data["obs"][:, 0])
    assert (b.data["obs"][order] == np.arange(4, dtype=np.float32) + np.arange(8)[:, None]).all()
    assert b.data["action"][order].tolist() == [0, 1, 2, 3, 4, 5, -2**63 + 6, 7]


def test_a_bad_timeout_is_refused_on_the_kernels_path_too(table):
    obs = np.arange(4, dtype=np.float32)
    table.insert(obs=obs, action=0, reward=0.0, done=False)  # a lease: the next goes to the kernel
    with pytest.raises(shmreplay.ReplayError, match="timeout"):
        table.insert(obs=obs, action=1, reward=0.0, done=False, timeout=-1)


def test_an_error_reply_waiting_is_raised_by_the_next_insert(start_daemon, monkeypatch):
    """The daemon voids a stalled writer's lease and refuses the COMMIT
    the kernel sent for it; once that reply is in the ring, the next
    insert reads it (as the checked path's prologue does) and raises it,
    and the one after inserts into a new lease."""
    fields = {"obs": ("float32", (4,)), "action": ("int64", ())}
    table = {"capacity": 4096, "fields": fields, "sampler": "fifo", "max_times_sampled": 1}
    # 2 s: a stall of the test between its two inserts below must not void the lease first
    d = start_daemon(tables=[dict(table, name="t"), dict(table, name="warm")], reservation_timeout_s=2.0)
    calls = _answers(monkeypatch)
    with d.connect() as c:
        c.lazy_commits = False  # every COMMIT wakes the daemon: its refusal comes without a flush
        obs = np.zeros(4, np.float32)
        try:  # the kernel for these types, compiled before t leases (seconds on a new machine,
            for i in range(3):  # past reservation_timeout_s: then these items are refused)
                c.table("warm").insert(obs=obs, action=i)
            c.flush()
        except shmreplay.ReservationExpired:
            pass
        t = c.table("t")
        t.insert(obs=obs, action=0)  # leases 16 slots
        t.insert(obs=obs, action=1)
        deadline = time.monotonic() + 30
        while c.stats()["tables"]["t"]["voided"] == 0:
            assert time.monotonic() < deadline, "the daemon did not void the lease"
            time.sleep(0.05)
        t.insert(obs=obs, action=2)  # into the void lease: the kernel stores it, the daemon refuses it
        assert calls[-1][1] >= 0
        pipe = c._session.pipe
        while not pipe.resp.has_pending():
            assert time.monotonic() < deadline, "no reply to the refused COMMIT"
            time.sleep(0.01)
        with pytest.raises(shmreplay.ReservationExpired, match="1 items were not stored"):
            t.insert(obs=obs, action=3)  # raised before anything is written
        t.insert(obs=obs, action=4)
        c.flush()
        assert sorted(t.sample(3, timeout=10).data["action"].tolist()) == [0, 1, 4]

