"""Benchmark machinery shared by ``shmreplay bench`` (a quick subset) and
``benchmarks/run.py`` (the full suite with targets).  Not used at run time."""
