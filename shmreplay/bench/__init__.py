"""Benchmark machinery shared by ``shmreplay bench`` (a quick subset) and
``benchmarks/run.py`` (the full suite with targets).  Not used at run time.

``runner.py`` (cells in separate processes, printed side by side) runs
``cells.py`` (one cell per process: ``python -m shmreplay.bench.cells``)
over ``workloads.py`` (the workloads of shared/WORKLOADS.md).  The other
replay libraries: ``peers.py`` (each behind one narrow interface),
``peerenv.py`` (where each lives, its venv), ``peerproc.py`` (a peer's
cell under its own venv's python), ``reverbpeer.py``, ``torchrlpeer.py``,
``flashbaxpeer.py``.  For ``benchmarks/capacity.py``: ``disk.py`` (rows in
a file, read cold and warm) and ``seedrow.py`` (the DQN Atari seed row at
its size).  ``raycluster.py``: a two-node Ray cluster on 127.0.0.1 (also
the Ray tests').
"""
