"""Reading what a table holds straight from its segment, as the daemon
sees it: no sampling, so a test can check every item, exactly once each."""

import numpy as np

from shmreplay.wire.layout import COMMITTED


def committed(t):
    """Every committed item of table handle ``t``, in commit order, as
    ({field: array}, priorities)."""
    m = t._map
    slots = np.flatnonzero(m.state == COMMITTED)
    slots = slots[np.argsort(m.seqno[slots])]
    return {name: view[slots].copy() for name, view in m.fields.items()}, m.prios[slots].copy()
