"""Sequentially consistent loads, stores and compare-and-swap on shared-memory words.

numba has no public CPU atomics, and a plain load inside a numba loop may be
hoisted out of it by LLVM (a spinner that never sees the other process).
These intrinsics emit ``load atomic``/``store atomic``/``cmpxchg`` with
``seq_cst`` ordering; on x86-64 the load is a plain ``mov`` and the store an ``xchg``
(a full barrier).  They are the only way this package touches a word that
another process writes concurrently.

Callable from any thread or process; each call is one indivisible access.
"""

from __future__ import annotations

import platform
import time

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from llvmlite import ir
from numba.extending import intrinsic

from ..numbaconf import JIT


def _pointer(context, builder, aryty, ary_value, idx):
    ary = context.make_array(aryty)(context, builder, ary_value)
    return cgutils.get_item_pointer(context, builder, aryty, ary, [idx])


@intrinsic
def _load(typingctx, arr, idx):
    sig = arr.dtype(arr, types.intp)

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ptr = _pointer(context, builder, aryty, args[0], args[1])
        return builder.load_atomic(ptr, ordering="seq_cst", align=aryty.dtype.bitwidth // 8)

    return sig, codegen


@intrinsic
def _store(typingctx, arr, idx, val):
    sig = types.void(arr, types.intp, val)

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ptr = _pointer(context, builder, aryty, args[0], args[1])
        v = context.cast(builder, args[2], sig.args[2], aryty.dtype)
        builder.store_atomic(v, ptr, ordering="seq_cst", align=aryty.dtype.bitwidth // 8)
        return context.get_dummy_value()

    return sig, codegen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "x86")


@intrinsic
def _pause(typingctx):
    """x86 ``pause`` in a spin loop: the core stops speculating past the
    load and gives its execution units to the other hardware thread (or a
    vCPU sharing the core); elsewhere nothing."""
    sig = types.void()

    def codegen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []),
                                                "llvm.x86.sse2.pause")
            builder.call(fn, [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _cas(typingctx, arr, idx, expected, new):
    sig = arr.dtype(arr, types.intp, expected, new)

    def codegen(context, builder, sig, args):
        aryty = sig.args[0]
        ptr = _pointer(context, builder, aryty, args[0], args[1])
        exp = context.cast(builder, args[2], sig.args[2], aryty.dtype)
        val = context.cast(builder, args[3], sig.args[3], aryty.dtype)
        pair = builder.cmpxchg(ptr, exp, val, "seq_cst", "seq_cst")
        return builder.extract_value(pair, 0)

    return sig, codegen


@numba.njit(**JIT)
def cas(words, i, expected, new):
    """Atomically: if ``words[i] == expected`` set it to ``new``; returns
    the value found (``expected`` when it succeeded).  seq_cst.  (The
    inference channel's slot words: inference/layout.py.)"""
    return _cas(words, i, np.uint64(expected), np.uint64(new))


@numba.njit(**JIT)
def pause():
    """x86 ``pause`` (elsewhere nothing): one beat of a spin loop."""
    _pause()


@numba.njit(**JIT)
def load(words, i):
    """Atomic seq_cst load of ``words[i]`` (a uint64 array in shared memory)."""
    return _load(words, i)


@numba.njit(**JIT)
def store(words, i, value):
    """Atomic seq_cst store; on x86-64 also a full fence (``xchg``)."""
    _store(words, i, value)


@numba.njit(**JIT)
def store_then_load(words, i, value, j):
    """Publish ``words[i] = value`` and then read ``words[j]``.

    This is the Dekker half of the sleep/wake handshake: a producer publishes
    its head and then reads the consumer's "sleeping" flag; the consumer sets
    the flag and then re-reads the head.  x86-TSO may reorder a plain store
    with a later load, so both steps must be seq_cst (the ``xchg`` drains the
    store buffer); with both sides doing this at least one sees the other.
    """
    _store(words, i, value)
    return _load(words, j)


@numba.njit(**JIT)
def spin_until_changed(words, i, old, iterations):
    """Spin up to ``iterations`` loads waiting for ``words[i] != old``.

    Returns the new value, or ``old`` if it never changed.  Used for the short
    spin before sleeping on a doorbell (see docs/protocol.md, "Waking").
    """
    for _ in range(iterations):
        v = _load(words, i)
        if v != old:
            return v
        _pause()
    return old


_loads_per_s: float | None = None


def loads_per_second() -> float:
    """How many ``spin_until_changed`` loads this CPU does per second
    (measured once per process, ~1 ms), so spin budgets can be set in time."""
    global _loads_per_s
    if _loads_per_s is None:
        words = np.zeros(8, dtype=np.uint64)
        spin_until_changed(words, 0, 1, 1)  # compile or load from cache first
        n = 1 << 20
        t0 = time.perf_counter()
        spin_until_changed(words, 0, 0, n)
        _loads_per_s = n / max(time.perf_counter() - t0, 1e-6)
    return _loads_per_s
