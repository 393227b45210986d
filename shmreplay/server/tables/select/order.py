"""Commit order of a table's items: the FIFO/LIFO samplers and removers read it.

A deque of keys (``gen << 32 | slot``) in commit order, in a numpy ring of
twice the table's capacity.  Items leave out of order (sampled for the last
time, evicted by another remover), so entries are deleted lazily: an entry
whose key no longer names a committed item is skipped, and dropped once it
reaches either end.  When the ring fills, it is compacted to the live keys,
at most ``capacity`` of them, so compaction runs at most once per
``capacity`` pushes: O(1) amortised.

A key is alive while its slot is COMMITTED with the key's stamp (the
table segment's ``state`` and ``gens``, which the order reads and never
writes).  The scan from either end is one kernel (``scan_live``; its twin
is the list the test keeps): the numpy version's ~15 calls cost ~60 us of
each eviction a writer's reservation makes (a 1,000-item table evicts on
every reservation).

Engine thread only, never concurrently.
"""

from __future__ import annotations

import numba
import numpy as np

from ....numbaconf import JIT
from ....wire.records import SLOT_BITS, SLOT_MASK, key_slots, stale

_SHIFT = np.uint64(SLOT_BITS)  # the key's layout, records.py's: gen << 32 | slot
_MASK = np.uint64(SLOT_MASK)


@numba.njit(**JIT)
def scan_live(buf, start, count, k, back, state, gens, committed, out):
    """The first up to k live keys of the ``count`` entries of ring ``buf``
    from ``start`` (from the other end if ``back``), written to ``out`` in
    scan order: (how many, entries before the first of them, entries up to
    and including the last of them); (0, count, count) if none is live.
    The keys are the daemon's own; a slot past ``state`` counts as dead."""
    if k <= 0:
        return 0, 0, 0
    cap = buf.shape[0]
    slots = state.shape[0]
    n = 0
    first = count
    last = count - 1
    for i in range(count):
        p = (start + count - 1 - i) % cap if back else (start + i) % cap
        key = buf[p]
        s = np.intp(key & _MASK)
        if s < slots and state[s] == committed and np.uint64(gens[s]) == key >> _SHIFT:
            if n == 0:
                first = i
            out[n] = key
            n += 1
            last = i
            if n == k:
                break
    return n, first, last + 1


class CommitOrder:
    def __init__(self, capacity: int, state: np.ndarray, gens: np.ndarray, committed: int):
        """A key is alive while ``state[slot] == committed`` and ``gens[slot]``
        is its stamp (the table segment's arrays, read only)."""
        self.buf = np.zeros(2 * max(1, capacity), dtype=np.uint64)
        self.start = 0
        self.count = 0
        self.state = state
        self.gens = gens
        self.committed = committed

    def alive(self, keys: np.ndarray) -> np.ndarray:
        """Mask of keys that still name the committed item they were made for."""
        return (self.state[key_slots(keys)] == self.committed) & ~stale(keys, self.gens)

    def __len__(self) -> int:
        """Entries, dead ones included."""
        return self.count

    def _positions(self, i: int, n: int, back: bool) -> np.ndarray:
        """Ring positions of entries i..i+n-1 counted from the chosen end."""
        if back:
            idx = self.start + self.count - 1 - i - np.arange(n)
        else:
            idx = self.start + i + np.arange(n)
        return idx % self.buf.shape[0]

    def push(self, keys: np.ndarray) -> None:
        n = keys.shape[0]
        cap = self.buf.shape[0]
        if self.count + n > cap:
            self.compact()
            if self.count + n > cap:
                raise OverflowError(f"commit order of {cap} entries cannot take {n} more "
                                    f"({self.count} live)")
        end = (self.start + self.count) % cap  # two slices, not a fancy index of n positions
        first = min(n, cap - end)
        self.buf[end:end + first] = keys[:first]
        self.buf[:n - first] = keys[first:]
        self.count += n

    def compact(self) -> None:
        keys = self.buf[self._positions(0, self.count, False)]
        keys = keys[self.alive(keys)]
        self.buf[:keys.shape[0]] = keys
        self.start, self.count = 0, keys.shape[0]

    def _scan(self, k: int, back: bool) -> tuple[np.ndarray, int, int]:
        """Up to k live keys from one end, in order from that end; how many
        dead entries precede the first of them; how many entries (live and
        dead) lie up to and including the last of them."""
        out = np.empty(max(0, min(k, self.count)), np.uint64)
        n, dead, used = scan_live(self.buf, self.start, self.count, out.shape[0], back,
                                  self.state, self.gens, self.committed, out)
        return out[:n], int(dead), int(used)

    def _drop(self, n: int, back: bool) -> None:
        if not back:
            self.start = (self.start + n) % self.buf.shape[0]
        self.count -= n

    def peek(self, k: int, back: bool = False) -> np.ndarray:
        """Up to k live keys from the front (oldest first) or the back (newest first)."""
        keys, dead, _ = self._scan(k, back)
        self._drop(dead, back)  # they can never come back to life
        return keys

    def pop(self, k: int, back: bool = False) -> np.ndarray:
        """Remove and return up to k live keys from one end (dead ones passed are dropped)."""
        keys, _, used = self._scan(k, back)
        self._drop(used, back)
        return keys
