"""numba flags in one place (stumpy-style), so every kernel compiles alike.

``cache=True`` writes compiled kernels next to the sources (or to
``$NUMBA_CACHE_DIR``) so later processes load them in ~0.15 s instead of
compiling for ~1 s; ``nogil=True`` lets the daemon's control thread run
while the engine thread is inside a kernel.
"""

JIT = {"cache": True, "nogil": True, "boundscheck": False}
