"""Where rows lie in a rows segment or file: the byte ranges of a set of
slots, for reading them ahead (``server/disk/prefetch.py``).

Rows are stored field by field: field f's row of slot s lies at
``offs[f] + s * widths[f]``, the spans ``layout.TableLayout.row_spans``
gives; so one slot's row is one range per field.  Pure functions; any
thread (the kernel releases the GIL).
"""

from __future__ import annotations

import numba
import numpy as np

from ..numbaconf import JIT

PAGE = 4096
MAX_RANGE = 1 << 20  # longer ranges are split, so that several readers can share one


@numba.njit(**JIT)
def _emit(a, b, max_len, out_off, out_len, n):
    while b > a >= 0:
        k = min(b - a, max_len)
        out_off[n], out_len[n] = a, k
        n += 1
        a += k
    return n


@numba.njit(**JIT)
def row_ranges(slots, offs, widths, align, max_len, out_off, out_len):
    """The byte ranges of ``slots`` in each field (field f's rows start at
    ``offs[f]``, ``widths[f]`` bytes apart): runs of consecutive slots
    merged, ends widened to multiples of ``align``, overlapping ranges
    merged, none longer than ``max_len``.  Writes them into out_*; returns
    how many."""
    s = np.sort(slots)
    m = s.shape[0]
    n = 0
    for f in range(offs.shape[0]):
        off, w = offs[f], widths[f]
        cur_a, cur_b = np.int64(-1), np.int64(-1)
        i = 0
        while i < m:
            j = i
            while j + 1 < m and s[j + 1] <= s[j] + 1:  # duplicates and neighbours
                j += 1
            a = off + s[i] * w
            b = off + (s[j] + 1) * w
            a -= a % align
            b = (b + align - 1) // align * align
            i = j + 1
            if cur_a >= 0 and a <= cur_b:
                cur_b = max(cur_b, b)
            else:
                n = _emit(cur_a, cur_b, max_len, out_off, out_len, n)
                cur_a, cur_b = a, b
        n = _emit(cur_a, cur_b, max_len, out_off, out_len, n)
    return n


def ranges_of(slots: np.ndarray, offs: np.ndarray, widths: np.ndarray, align: int = PAGE,
              max_len: int = MAX_RANGE) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, lengths) of the byte ranges holding ``slots``' rows.  Any thread."""
    slots = np.asarray(slots, dtype=np.int64)
    # each run of slots makes at most one range per field, split once per
    # max_len of its bytes (widened by at most 2 x align each)
    m, nf = slots.shape[0], offs.shape[0]
    cap = 2 * m * nf + int(m * widths.sum()) // max_len + 2 * nf + 2
    out_off, out_len = np.empty(cap, np.int64), np.empty(cap, np.int64)
    n = row_ranges(slots, offs, widths, align, max_len, out_off, out_len) if slots.shape[0] else 0
    return out_off[:n], out_len[:n]
