"""numba flags in one place (stumpy-style), so every kernel compiles alike.

``cache=True`` writes compiled kernels next to the sources (or to
``$NUMBA_CACHE_DIR``) so later processes load them in ~0.15 s instead of
compiling for ~1 s; ``nogil=True`` lets the daemon's control thread run
while the engine thread is inside a kernel.

Also what numba costs a process beside its kernels, and how the daemon and
the command line avoid it: numba's BLAS probe (``without_blas_probe``) and
the interpreter's teardown of numba's registries (``exit_without_teardown``).
"""

from __future__ import annotations

import contextlib
import sys

JIT = {"cache": True, "nogil": True, "boundscheck": False}

_BLAS = "scipy.linalg.cython_blas"


@contextlib.contextmanager
def without_blas_probe():
    """Load or compile kernels without numba's one-time BLAS probe.

    The first kernel a process loads makes numba set up its target, which
    probes for BLAS by importing ``scipy.linalg`` when scipy is installed:
    ~0.2 s of every daemon start, for a library none of our kernels uses (no
    ``np.dot``, no linear algebra).  Inside this block that import fails at
    once, so numba takes BLAS as absent (its answer without scipy); after it
    scipy imports as usual again.  Only the daemon uses this, around its
    warm-up, never a client: a user's process keeps numba's own answer.
    """
    if _BLAS in sys.modules:  # probed or imported already: nothing to save
        yield
        return
    sys.modules[_BLAS] = None  # an import of a None entry raises ImportError at once
    try:
        yield
    finally:
        if _BLAS in sys.modules and sys.modules[_BLAS] is None:
            del sys.modules[_BLAS]


def exit_without_teardown(code: int) -> None:
    """End a program that has released everything it owns with ``code``,
    skipping the interpreter's teardown.

    With numba loaded, that teardown garbage-collects numba's type and
    lowering registries: ~0.25 s of CPU after the last useful instruction,
    on every daemon stop and command-line run.  Skipped only when no other
    thread is left (none can still be writing) and after the log and stdio
    are flushed, so the exit code and everything written are what a normal
    exit gives.
    """
    import logging
    import os
    import threading
    import multiprocessing
    # no other thread (none can still be writing), no child of ours
    # (multiprocessing's exit handler would reap or stop it)
    if threading.active_count() == 1 and not multiprocessing.active_children():
        logging.shutdown()  # flush and close every log handler, as atexit would
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):  # a closed pipe: the usual exit reports it as usual
            sys.exit(code)
        os._exit(code)
    sys.exit(code)
