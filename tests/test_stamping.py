"""New items' marks (``select/stamping.py``, ``stamp_new``) against their
numpy twin: the seven numpy calls the kernel replaced in
``Selection.stamp`` and ``keys_of``.  Any slots of a table in any order,
stamps up to 2**32 - 1, given priorities or the largest seen, commit
numbers up to 2**63 (the daemon's count of commits; at 10**9 a second it
reaches that in 292 years): the segment's marks and the returned
priorities and keys agree bit for bit, and no other slot's marks
change."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from shmreplay.server.tables.select.stamping import NO_PRIORITIES, stamp_new
from shmreplay.wire.records import make_keys

CAP = 64


def twin(slots, given_prios, fill, prios, times, seqno, seq0, gens):
    """What Selection.stamp and keys_of did before the kernel."""
    p = np.full(slots.shape[0], fill) if given_prios is None else given_prios
    prios[slots] = p
    times[slots] = 0
    seqno[slots] = np.arange(seq0 + 1, seq0 + slots.shape[0] + 1, dtype=np.uint64)
    return p, make_keys(gens[slots], slots)


@settings(max_examples=300, deadline=None)
@given(slots=st.lists(st.integers(0, CAP - 1), min_size=1, max_size=CAP, unique=True),
       with_given=st.booleans(), fill=st.floats(0, 1e30),
       seq0=st.one_of(st.integers(0, 2**40), st.integers(2**63 - 200, 2**63 - CAP - 1)),
       seed=st.integers(0, 2**32 - 1))
def test_stamp_new_writes_the_marks_and_keys_numpy_wrote(slots, with_given, fill, seq0, seed):
    rng = np.random.default_rng(seed)
    slots = np.asarray(slots, np.int64)
    gens = rng.integers(0, 2**32, CAP, dtype=np.uint64).astype(np.uint32)
    given_prios = rng.random(slots.shape[0]) * 10 if with_given else None
    marks = [rng.random(CAP), rng.integers(0, 2**32, CAP, dtype=np.uint64).astype(np.uint32),
             rng.integers(0, 2**63, CAP, dtype=np.uint64)]
    want_marks = [m.copy() for m in marks]
    want_p, want_k = twin(slots, given_prios, fill, *want_marks, seq0, gens)
    got_p, got_k = stamp_new(slots, NO_PRIORITIES if given_prios is None else given_prios, fill,
                             *marks, seq0, gens)
    assert got_p.tobytes() == np.asarray(want_p, np.float64).tobytes()
    assert got_k.dtype == np.uint64 and got_k.tobytes() == want_k.tobytes()
    for got, want in zip(marks, want_marks):
        assert got.tobytes() == want.tobytes()
