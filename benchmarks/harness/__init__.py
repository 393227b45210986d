"""The benchmark-only harness: what ``benchmarks/`` runs beyond the cells
that ``shmreplay bench`` ships (those stay in ``shmreplay/bench/``).  Not
part of the installed package (pyproject's packages.find names only
``shmreplay``); scripts next to it import it as ``harness`` (their folder
is first on sys.path), the tests as ``benchmarks.harness`` (the checkout's
root is on sys.path under ``python3 -m pytest`` and pyproject's
``pythonpath``).

``disk.py`` (rows in a file, read cold and warm, and ``BenchDaemon``, a
private daemon with file-backed tables kept across restarts) and
``seedrow.py`` (the DQN Atari seed row at its size), both for
``benchmarks/capacity.py``; ``raycluster.py``: a two-node Ray cluster on
127.0.0.1 (``benchmarks/ray_ingest.py`` and the Ray tests); ``results.py``:
where a benchmark's JSON report goes, and writing it.
"""
