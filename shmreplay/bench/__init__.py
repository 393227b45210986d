"""Benchmark machinery shared by ``shmreplay bench`` (a quick subset) and
``benchmarks/run.py`` (the full suite with targets): what ``shmreplay
bench`` needs and no more.  Not used at run time.

``runner.py`` (cells in separate processes, printed side by side) runs
``cells.py`` (one cell per process: ``python -m shmreplay.bench.cells``)
over ``workloads.py`` (the workloads of shared/WORKLOADS.md).  The other
replay libraries: ``peers.py`` (each behind one narrow interface),
``peerenv.py`` (where each lives, its venv), ``peerproc.py`` (a peer's
cell under its own venv's python), ``reverbpeer.py``, ``torchrlpeer.py``,
``flashbaxpeer.py``.  The harness only ``benchmarks/`` and the tests use
(the capacity benchmark's rows on disk, its seed row, a local Ray cluster)
lives in ``benchmarks/harness/``, which the installed package does not carry.
"""
