"""The numba kernel that rebuilds sampled items' frame stacks from a frame
ring (docs/frames.md): for each drawn item, its ``depth`` frame references
(the daemon's copy, in the meta segment) name the frames to copy, one
``memcpy`` each, into the item's row of a contiguous ``(B, depth,
*frame)`` output.  Its twin is ``tests/test_frame_copy.py``'s numpy
indexing.  Stamps are re-checked after it, as for rows
(``rowcopy.stale_keys``): the frames of an item that was live through the
copy were not handed out again (``server/tables/frames/book.py``).

``Stacks`` is a frame table's stacked fields as a table handle maps them
now, and ``gather.take_rows`` hands it those fields of a sampled batch.
The kernel: pure functions over arrays, any thread, none holds the GIL;
``Stacks``: the thread of the handle that made it.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import cgutils, types
from numba.extending import intrinsic

from ..errors import ReplayError
from ..numbaconf import JIT
from ..wire.records import key_slots
from .rowcopy import AHEAD, copy_bytes, prefetch_line

_MASK = np.uint64(0xFFFFFFFF)


@intrinsic
def zero_bytes(typingctx, dst_addr, n):
    """memset(dst_addr, 0, n): an address, no bounds check (the caller's)."""
    sig = types.void(types.int64, types.intp)

    def codegen(context, builder, sig, args):
        cgutils.memset(builder, builder.inttoptr(args[0], cgutils.voidptr_t), args[1], 0)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**JIT)
def _fits(refs, keys, rows, col0, depth, nrows) -> bool:
    """Every row inside the output, every key's slot inside the table,
    the stack's columns inside a reference row: checked before any copy."""
    if col0 < 0 or depth < 1 or col0 + depth > refs.shape[1]:
        return False
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0 or r >= nrows or r >= keys.shape[0] or np.intp(keys[r] & _MASK) >= refs.shape[0]:
            return False
    return True


@numba.njit(**JIT)
def _ask_first(ring, refs, keys, rows, col) -> None:
    """Ask for the first AHEAD rows' first frames before the copy starts
    (the copy then asks AHEAD rows ahead of itself)."""
    for i in range(min(AHEAD, rows.shape[0])):
        f = np.intp(refs[np.intp(keys[rows[i]] & _MASK), col])
        if f < ring.shape[0]:
            prefetch_line(ring, f * ring.shape[1])


@numba.njit(**JIT)
def take_stacks(ring, refs, keys, rows, col0, depth, addr, nrows) -> int:
    """For each r in ``rows``: the stack of the item in slot ``keys[r] &
    0xFFFFFFFF``, frames ``refs[slot, col0 : col0 + depth]`` of ``ring``
    (uint8[frames, frame bytes]), copied into row r of the C-contiguous
    output at address ``addr`` (``nrows`` rows of ``depth`` frames).  The
    next rows' first frames are asked for AHEAD rows before.  Returns the
    rows copied whole, or -1: a row, a slot or the columns outside the
    arrays (nothing copied).  A row with a reference outside the ring is
    zeroed, not copied: its slot was reserved again since the draw (which
    lets go of its references, ``NO_REF``, after bumping its stamp), so
    the stamps' re-check draws the item again.

    One signature for every table (the output is an address): compiled
    once.  The caller keeps the array behind ``addr`` alive and writable."""
    if not _fits(refs, keys, rows, col0, depth, nrows):
        return -1
    nframes, fb = ring.shape[0], ring.shape[1]
    m = rows.shape[0]
    torn = 0
    _ask_first(ring, refs, keys, rows, col0)
    for i in range(m):
        if i + AHEAD < m:
            f = np.intp(refs[np.intp(keys[rows[i + AHEAD]] & _MASK), col0])
            if f < nframes:
                prefetch_line(ring, f * fb)
        r = rows[i]
        s = np.intp(keys[r] & _MASK)
        d = 0
        while d < depth:
            # read once: checked and used from the same load (the daemon
            # writes only references it checked, but a check must hold for
            # the value it guards)
            f = np.intp(refs[s, col0 + d])
            if f < 0 or f >= nframes:
                zero_bytes(addr + r * depth * fb, depth * fb)
                torn += 1
                break
            k = 1  # a run of frames next to each other in the ring (a stream's, mostly): one copy
            while d + k < depth and np.intp(refs[s, col0 + d + k]) == f + k and f + k < nframes:
                k += 1
            copy_bytes(addr + (r * depth + d) * fb, ring, f * fb, k * fb)
            d += k
    return m - torn


@intrinsic
def copy_within(typingctx, dst_addr, src_addr, n):
    """memcpy(dst_addr, src_addr, n) between two addresses of the output
    (a frame copied a moment ago, still in cache); no bounds check."""
    sig = types.void(types.int64, types.int64, types.intp)

    def codegen(context, builder, sig, args):
        dp = builder.inttoptr(args[0], cgutils.voidptr_t)
        sp = builder.inttoptr(args[1], cgutils.voidptr_t)
        cgutils.raw_memcpy(builder, dp, sp, args[2], 1)
        return context.get_dummy_value()

    return sig, codegen


@numba.njit(**JIT)
def take_pairs(ring, refs, keys, rows, col_a, col_b, depth, addr_a, addr_b, nrows) -> int:
    """``take_stacks`` of a stacked field (columns ``col_a``..) and its
    follow-on (``col_b``.., the same depth and ring), row by row: a frame
    of the follow-on that the row's first stack holds too (``next_obs``
    shares all but one with ``obs``) is copied from that stack's output,
    which the row has just written and the cache still holds, instead of
    from the ring.  Returns the rows copied whole, or -1 (nothing copied):
    as ``take_stacks``; a row with a reference outside the ring is zeroed
    in both outputs."""
    if not (_fits(refs, keys, rows, col_a, depth, nrows) and _fits(refs, keys, rows, col_b, depth, nrows)):
        return -1
    nframes, fb = ring.shape[0], ring.shape[1]
    m = rows.shape[0]
    torn = 0
    _ask_first(ring, refs, keys, rows, col_a)
    for i in range(m):
        if i + AHEAD < m:  # every page of the row's frames: their TLB walks start early
            s2 = np.intp(keys[rows[i + AHEAD]] & _MASK)
            f = np.intp(refs[s2, col_a])
            last = np.intp(refs[s2, col_b + depth - 1])
            if f < nframes and last < nframes and f <= last <= f + 2 * depth:
                for off in range(f * fb, (last + 1) * fb, 4096):
                    prefetch_line(ring, off)
            elif f < nframes:
                prefetch_line(ring, f * fb)
        r = rows[i]
        s = np.intp(keys[r] & _MASK)
        row_a, row_b = addr_a + r * depth * fb, addr_b + r * depth * fb
        bad = False
        d = 0
        while d < depth:  # runs of frames next to each other in the ring (a stream's, mostly) in one copy
            f = np.intp(refs[s, col_a + d])  # read once: checked and used from the same load
            if f < 0 or f >= nframes:
                bad = True
                break
            k = 1
            while d + k < depth and np.intp(refs[s, col_a + d + k]) == f + k and f + k < nframes:
                k += 1
            copy_bytes(row_a + d * fb, ring, f * fb, k * fb)
            d += k
        if not bad:
            for d in range(depth):
                f = np.intp(refs[s, col_b + d])
                if f < 0 or f >= nframes:
                    bad = True
                    break
                j = depth - 1
                while j >= 0 and np.intp(refs[s, col_a + j]) != f:
                    j -= 1
                if j >= 0:  # the first stack's frame j: the same frame (the daemon's references)
                    copy_within(row_b + d * fb, row_a + j * fb, fb)
                else:
                    copy_bytes(row_b + d * fb, ring, f * fb, fb)
        if bad:
            zero_bytes(row_a, depth * fb)
            zero_bytes(row_b, depth * fb)
            torn += 1
    return m - torn


class Stacks:
    """A frame table's stacked fields as mapped now (``tmap``: its
    ``TableMap``): for each, its ring (frames as bytes), and which columns
    of the daemon's references are its stack."""

    def __init__(self, tmap):
        self.refs = tmap.refs
        self.at = {name: (tmap.rings[base], col0, depth)
                   for name, base, col0, depth in tmap.spec.frames.columns}
        self._split: dict = {}
        self._paired: dict = {}

    def take(self, fields, out, rows: np.ndarray):
        """Copy the stacks of ``fields`` that are stacked into
        ``out.data[...][rows]`` (``out``: a ``gather.SampleBatch``);
        returns the other fields, for the rows' copy."""
        # by identity: the handle passes its spec's one tuple
        got = self._split.get(id(fields))
        if got is None or got[0] is not fields:
            got = self._split[id(fields)] = (
                fields, tuple(f for f in fields if f.name in self.at),
                tuple(f for f in fields if f.name not in self.at))
        pairs = self._pairs(got[1])
        done = set()
        for fa, fb_ in pairs:
            a, b = out.data[fa.name], out.data[fb_.name]
            if _writable(a, fa) and _writable(b, fb_):
                ring, col_a, depth = self.at[fa.name]
                col_b = self.at[fb_.name][1]
                if take_pairs(ring, self.refs, out.keys, rows, col_a, col_b, depth, a.ctypes.data,
                              b.ctypes.data, min(a.shape[0], b.shape[0])) < 0:
                    raise ReplayError(f"sampled stacks of {fa.name!r} and {fb_.name!r} do not fit: the "
                                      f"out= batch's arrays hold {min(a.shape[0], b.shape[0])} rows for "
                                      f"{out.keys.shape[0]} keys (give arrays of the batch's size)")
                done.update((fa.name, fb_.name))
        for f in got[1]:
            if f.name not in done:
                self._take(f, out.data[f.name], out.keys, rows)
        return got[2]

    def _pairs(self, stacked) -> tuple:
        """(field, its follow-on) pairs among ``stacked``, each field in one
        at most (``take_pairs`` copies them together)."""
        got = self._paired.get(id(stacked))
        if got is None or got[0] is not stacked:
            by_ring: dict = {}
            for f in stacked:
                ring, _, depth = self.at[f.name]
                by_ring.setdefault((id(ring), depth), []).append(f)
            pairs = tuple((fs[k], fs[k + 1]) for fs in by_ring.values() for k in range(0, len(fs) - 1, 2))
            got = self._paired[id(stacked)] = (stacked, pairs)
        return got[1]

    def _take(self, f, dst: np.ndarray, keys: np.ndarray, rows: np.ndarray) -> None:
        ring, col0, depth = self.at[f.name]
        if _writable(dst, f):
            if take_stacks(ring, self.refs, keys, rows, col0, depth, dst.ctypes.data, dst.shape[0]) < 0:
                raise ReplayError(f"a sampled stack of {f.name!r} does not fit: the out= batch's "
                                  f"arrays hold {dst.shape[0]} rows for {keys.shape[0]} keys (give "
                                  "arrays of the batch's size)")
            return
        # an out= array the kernel may not write: numpy's way (which says what is wrong, if anything)
        refs = self.refs[key_slots(keys[rows]), col0:col0 + depth]
        dst[rows] = ring[refs].view(f.dtype).reshape(rows.shape[0], *f.shape)


def _writable(dst: np.ndarray, f) -> bool:
    """Can the kernels write ``dst`` (a batch's array for field ``f``)?"""
    return (dst.dtype == f.dtype and dst.flags.c_contiguous and dst.flags.writeable
            and dst.shape[1:] == f.shape)  # the dtype too: the kernels write the ring's bytes a row
