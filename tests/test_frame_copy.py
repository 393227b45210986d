"""``client/framecopy.take_stacks`` against its twin, numpy's indexing
``ring[refs[slots, col0:col0 + depth]]``, bit for bit; and every bound it
checks before copying."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmreplay.client.framecopy import take_stacks


def twin(ring, refs, keys, rows, col0, depth, out):
    slots = (keys[rows] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    out[rows] = ring[refs[slots, col0:col0 + depth].astype(np.int64)]


def setup(rng, frames=40, frame=(3, 5), capacity=12, cols=7):
    """A ring and references: half the slots' at random, half in runs of
    frames next to each other (a stream's, copied as one run), wrapping at
    the ring's end."""
    ring = rng.integers(0, 256, size=(frames, *frame), dtype=np.uint8)
    refs = rng.integers(0, frames, size=(capacity, cols), dtype=np.uint32)
    for s in range(0, capacity, 2):
        refs[s] = (rng.integers(0, frames) + np.arange(cols)) % frames
    return ring, refs


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), depth=st.integers(1, 4), col0=st.integers(0, 3),
       batch=st.integers(1, 20), dtype=st.sampled_from(["uint8", "float32", "int16"]))
def test_stacks_are_the_frames_the_references_name_bit_for_bit(seed, depth, col0, batch, dtype):
    rng = np.random.default_rng(seed)
    ring8, refs = setup(rng)
    ring = ring8.view(np.uint8) if dtype == "uint8" else \
        rng.integers(0, 1000, size=(40, 3, 5)).astype(dtype)
    keys = (rng.integers(1, 2**31, size=batch, dtype=np.uint64) << np.uint64(32)) | \
        rng.integers(0, 12, size=batch).astype(np.uint64)
    rows = rng.permutation(batch)[:rng.integers(1, batch + 1)].astype(np.int64)
    out = np.zeros((batch, depth, 3, 5), dtype=dtype)
    want = out.copy()
    got = take_stacks(ring.reshape(40, -1).view(np.uint8), refs, keys, rows, col0, depth,
                      out.ctypes.data, batch)
    twin(ring, refs, keys, rows, col0, depth, want)
    assert got == rows.shape[0]
    assert out.tobytes() == want.tobytes()  # rows not asked for stay as they were too


@pytest.mark.parametrize("case", ["slot", "row", "columns", "depth"])
def test_anything_outside_the_arrays_copies_nothing(case):
    rng = np.random.default_rng(1)
    ring, refs = setup(rng)
    keys = np.arange(4, dtype=np.uint64) | (np.uint64(9) << np.uint64(32))
    rows = np.arange(4, dtype=np.int64)
    col0, depth, nrows = 0, 4, 4
    if case == "slot":
        keys[2] = (np.uint64(9) << np.uint64(32)) | np.uint64(12)  # capacity 12
    elif case == "row":
        rows[3] = 4
    elif case == "columns":
        col0 = 4  # 4 + 4 > 7 columns
    else:
        depth = 0
    out = np.full((4, 4, 3, 5), 7, dtype=np.uint8)
    assert take_stacks(ring.reshape(40, -1), refs, keys, rows, col0, depth, out.ctypes.data, nrows) == -1
    assert (out == 7).all()


def test_a_reference_outside_the_ring_zeroes_its_row_and_copies_the_rest():
    """A slot reserved again since the draw holds NO_REF: its row is zeroed
    (the stamps' re-check draws it again), never read out of bounds."""
    rng = np.random.default_rng(2)
    ring, refs = setup(rng)
    refs[3, 1] = 40  # the ring holds 40 frames
    refs[1, 0] = 0xFFFFFFFF  # NO_REF
    refs[2, :2] = [39, 40]  # a run that would go past the ring's end
    keys = np.arange(5, dtype=np.uint64)
    out = np.full((5, 2, 3, 5), 7, dtype=np.uint8)
    assert take_stacks(ring.reshape(40, -1), refs, keys, np.arange(5, dtype=np.int64), 0, 2,
                       out.ctypes.data, 5) == 2
    assert (out[[1, 2, 3]] == 0).all()
    for r in (0, 4):
        assert np.array_equal(out[r], ring[refs[r, :2]])


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), depth=st.integers(1, 4), shift=st.integers(0, 3),
       batch=st.integers(1, 20), torn=st.booleans())
def test_a_stack_and_its_follow_on_copied_together_are_their_twins_bit_for_bit(seed, depth, shift,
                                                                               batch, torn):
    """``take_pairs`` (next_obs's shared frames from obs's output) against
    the twin of each stack alone; rows whose references overlap as a
    stream's do (next_obs = obs shifted by ``shift``) and at random; a torn
    row (a reference outside the ring) zeroed in both."""
    from shmreplay.client.framecopy import take_pairs
    rng = np.random.default_rng(seed)
    ring = rng.integers(0, 256, size=(40, 3, 5), dtype=np.uint8)
    refs = np.empty((12, 2 * depth), np.uint32)
    for s in range(12):
        stream = (rng.integers(0, 40, size=depth + shift) if s % 3 == 0
                  else (rng.integers(0, 40) + np.arange(depth + shift)) % 40)  # a run, wrapping
        refs[s, :depth] = stream[:depth] if s % 2 else rng.integers(0, 40, size=depth)
        refs[s, depth:] = stream[shift:shift + depth]
    bad = rng.integers(0, 12) if torn else None
    if torn:
        refs[bad, rng.integers(0, 2 * depth)] = 0xFFFFFFFF
    keys = (rng.integers(1, 2**31, size=batch, dtype=np.uint64) << np.uint64(32)) | \
        rng.integers(0, 12, size=batch).astype(np.uint64)
    rows = rng.permutation(batch)[:rng.integers(1, batch + 1)].astype(np.int64)
    a, b = (np.full((batch, depth, 3, 5), 7, np.uint8) for _ in range(2))
    want_a, want_b = a.copy(), b.copy()
    slots = (keys[rows] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    good = slots != bad
    twin(ring, refs, keys, rows[good], 0, depth, want_a)
    twin(ring, refs, keys, rows[good], depth, depth, want_b)
    want_a[rows[~good]] = 0
    want_b[rows[~good]] = 0
    got = take_pairs(ring.reshape(40, -1), refs, keys, rows, 0, depth, depth, a.ctypes.data,
                     b.ctypes.data, batch)
    assert got == int(good.sum())
    assert a.tobytes() == want_a.tobytes() and b.tobytes() == want_b.tobytes()
