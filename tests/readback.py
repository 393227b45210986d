"""Reading what a table holds straight from its segment, as the daemon
sees it: no sampling, so a test can check every item, exactly once each,
or compare a table's whole state before and after (``table_state``)."""

import numpy as np

from shmreplay.wire.layout import COMMITTED, TableMap


def committed(t):
    """Every committed item of table handle ``t``, in commit order, as
    ({field: array}, priorities)."""
    m = t._map
    slots = np.flatnonzero(m.state == COMMITTED)
    slots = slots[np.argsort(m.seqno[slots])]
    return {name: view[slots].copy() for name, view in m.fields.items()}, m.prios[slots].copy()


def table_state(segment: str) -> dict:
    """Everything a checkpoint must carry, read from the segment: per
    committed slot its stamp, priority, times sampled, commit number and
    rows, plus the limiter counters."""
    tm = TableMap.attach(segment)
    try:
        slots = np.flatnonzero(tm.state == COMMITTED)
        out = {"slots": slots, "gens": tm.gens[slots].copy(), "prios": tm.prios[slots].copy(),
               "times": tm.times[slots].copy(), "seqno": tm.seqno[slots].copy(),
               "counters": [tm.words.inserts, tm.words.samples, tm.words.deletes]}
        out.update({f"f.{k}": v[slots].copy() for k, v in tm.fields.items()})
        return out
    finally:
        tm.release()


def committed_stacks(t):
    """Every committed item of frame table handle ``t``, in commit order:
    its slot fields and its stacks rebuilt in plain numpy from the rings
    and the daemon's references (a twin of ``client/framecopy.py``), as
    ({field: array}, priorities)."""
    m = t.mapped
    spec = t.spec
    slots = np.flatnonzero(m.state == COMMITTED)
    slots = slots[np.argsort(m.seqno[slots])]
    out = {name: view[slots].copy() for name, view in m.fields.items()}
    for name, base, col, depth in spec.frames.columns:
        f = spec.field(name)
        ring = m.rings[base]
        refs = m.refs[slots, col:col + depth].astype(np.int64)
        out[name] = ring[refs].copy().view(f.dtype).reshape(slots.shape[0], *f.shape)
    return out, m.prios[slots].copy()
