"""A peer library's cell under that library's own python (a venv without
shmreplay's dependencies): ``VENV_PYTHON peerproc.py CELL PEER WORKLOAD
[--seconds S]``, the arguments of ``python -m shmreplay.bench.cells``.

It makes ``shmreplay.bench`` importable without running shmreplay's
``__init__`` (which imports the client and its dependencies): ``shmreplay``
becomes a bare package over this source tree.  The module level does it,
so processes that multiprocessing spawns from here (they re-run this file
before unpickling their target) can import the peers' actor functions too.
Results go to the parent as JSON lines on stdout, as from ``cells``.
"""

from __future__ import annotations

import os
import sys
import types

if "shmreplay" not in sys.modules:
    _pkg = types.ModuleType("shmreplay")
    _pkg.__path__ = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    sys.modules["shmreplay"] = _pkg
    # the script's own folder on sys.path would let `import peers` etc. shadow nothing
    # useful and load a second copy of these modules: drop it
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from shmreplay.bench import cells
    sys.exit(cells.main())
