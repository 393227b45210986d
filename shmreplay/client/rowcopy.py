"""numba kernels that copy sampled rows out of a slot-layout table and
re-check their stamps (``gather.py`` calls them; their plain-numpy twins
are in tests/test_row_layout.py).

A slot layout keeps every field of a slot together (wire/layout.py), so a
sampled row is one read from one place of the table.  The copy is one
``memcpy`` per field per row, the rows asked for ahead (``AHEAD``): a byte
loop that numba compiles for a run-time width copies about a byte a cycle
(28 us for 256 SAC rows), numpy's fancy indexing of strided views costs
~70 us, and the kernel 22 us.  Measured in docs/performance.md.

Pure functions over arrays; any thread, none holds the GIL.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic
from llvmlite import ir

from ..numbaconf import JIT
from ..wire.atomics import load

_MASK = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


@intrinsic
def copy_bytes(typingctx, dst_addr, src, src_at, n):
    """memcpy(dst_addr, src's data + src_at, n): an address and byte offsets,
    no bounds check (the caller's)."""
    sig = types.void(types.int64, src, types.intp, types.intp)

    def codegen(context, builder, sig, args):
        s = context.make_array(sig.args[1])(context, builder, args[1])
        dp = builder.inttoptr(args[0], cgutils.voidptr_t)
        sp = builder.gep(builder.bitcast(s.data, cgutils.voidptr_t), [args[2]])
        cgutils.raw_memcpy(builder, dp, sp, args[3], 1)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def prefetch_line(typingctx, arr, at):
    """Ask the CPU to bring the cache line of byte ``at`` of ``arr``'s data
    in (``llvm.prefetch``: a hint, never a fault, whatever the address)."""
    sig = types.void(arr, types.intp)

    def codegen(context, builder, sig, args):
        a = context.make_array(sig.args[0])(context, builder, args[0])
        p = builder.gep(builder.bitcast(a.data, cgutils.voidptr_t), [args[1]])
        i32 = ir.IntType(32)
        fn = builder.module.declare_intrinsic(
            "llvm.prefetch", fnty=ir.FunctionType(ir.VoidType(), [cgutils.voidptr_t, i32, i32, i32]))
        builder.call(fn, [p, ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])  # read, keep, data
        return context.get_dummy_value()

    return sig, codegen


# rows asked for ahead of the one being copied: sampled rows are scattered
# over a table of 4 KiB pages, each a TLB and cache miss; without the hints
# the copy waits on one at a time (256 SAC rows of a 1M table in /dev/shm:
# 76 us; ahead 4: 27 us, 8: 26 us, 16: 31 us, 32: 33 us; the same rows as
# fields with np.take: 65 us)
AHEAD = 8


@numba.njit(**JIT)
def _fits(src, keys, rows, offs, widths, nrows) -> bool:
    """Every slot inside the table, every row inside the outputs, every
    field inside a row: checked before the copy, whose loop has no branch
    but the hints' (the same checks inside it cost 25 us of 47 for 256 SAC
    rows)."""
    cap, stride = src.shape[0], src.shape[1]
    for f in range(offs.shape[0]):
        if offs[f] < 0 or widths[f] < 0 or offs[f] + widths[f] > stride:
            return False
    for i in range(rows.shape[0]):
        r = rows[i]
        if r < 0 or r >= nrows or r >= keys.shape[0] or np.intp(keys[r] & _MASK) >= cap:
            return False
    return True


@numba.njit(**JIT)
def take_slot_rows(src, keys, rows, offs, widths, addrs, nrows) -> int:
    """For each r in ``rows``: copy the row of slot ``keys[r] & 0xFFFFFFFF``
    (a line of ``src``, uint8[capacity, stride]) into row r of each field's
    output, C-contiguous rows of ``widths[f]`` bytes at address
    ``addrs[f]`` (``nrows`` rows each), from byte ``offs[f]`` of the row.
    Each row is read once, asked for AHEAD rows before.  Returns the number
    of rows copied, or -1 (nothing copied) if a key's slot is outside the
    table or a row or field outside the outputs.

    One signature for every table (the outputs are addresses, not a tuple
    of arrays): compiled once, not once per schema.  The caller keeps the
    arrays behind ``addrs`` alive and writable."""
    if not _fits(src, keys, rows, offs, widths, nrows):
        return -1
    stride = src.shape[1]
    m = rows.shape[0]
    nf = offs.shape[0]
    # indices that never go negative: numba's wrap-around of a possibly
    # negative index costs the loop half its speed (47 us against 23)
    for i in range(min(AHEAD, m)):
        at = np.intp(keys[rows[i]] & _MASK) * stride
        prefetch_line(src, at)
        prefetch_line(src, at + stride - 1)
    for i in range(m):
        if i + AHEAD < m:
            at = np.intp(keys[rows[i + AHEAD]] & _MASK) * stride
            prefetch_line(src, at)  # a row of up to 4 KiB: its first and last lines;
            prefetch_line(src, at + stride - 1)  # the hardware prefetcher fills between
        r = rows[i]
        at = np.intp(keys[r] & _MASK) * stride
        for f in range(nf):
            copy_bytes(addrs[f] + r * widths[f], src, at + offs[f], widths[f])
    return m


@numba.njit(**JIT)
def stale_keys(keys, gens, out_rows) -> int:
    """Write into ``out_rows`` the positions of ``keys`` whose slot's stamp
    (``gens``, read atomically: after the rows were copied) is no longer
    the key's, and of keys outside the table; returns how many."""
    k = 0
    cap = gens.shape[0]
    for i in range(keys.shape[0]):
        s = np.intp(keys[i] & _MASK)
        if s >= cap or np.uint64(load(gens, s)) != keys[i] >> _SHIFT:
            out_rows[k] = i
            k += 1
    return k


def warm() -> None:
    """Load (or compile, the first time on a machine) the kernels now, for
    every signature a client calls them with, instead of at the first
    sample: the rows writable or read-only (a table only its creator
    writes), the stamps read-only (the meta segment).  For a process that
    forks children which must not compile (their user may not read numba's
    modules, nor write its cache)."""
    keys = np.zeros(1, np.uint64)
    out = np.zeros(1, np.uint8)
    for writable in (True, False):
        src = np.zeros((1, 8), np.uint8)
        gens = np.zeros(1, np.uint32)
        src.setflags(write=writable)
        gens.setflags(write=writable)
        take_slot_rows(src, keys, np.zeros(1, np.int64), np.zeros(1, np.int64), np.ones(1, np.int64),
                       np.array([out.ctypes.data], np.int64), 1)
        stale_keys(keys, gens, np.zeros(1, np.int64))
