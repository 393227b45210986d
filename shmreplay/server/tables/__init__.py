"""Replay tables as the daemon keeps them: items in, items out, and the numbers.

``table.py`` (``Table``) is composed of parts that each own their state:
``ledger.py`` (the slot life cycle: free, reserved, committed, held), with
``slotqueue.py`` (the free list), ``orphans.py`` (slots a dead daemon's
writers leased) and ``barrier.py`` (a durable table's reuse barrier);
``reservations.py`` (writers' reservations: whose slots, committed how
far, how much other users may hold) and ``pinbooks.py`` (the caps on
protected redraws); ``counters.py`` (the rate limiter's and reuse limit's
counters, mirrored into the segment); a sampler and a remover behind
``selectors.py`` (``samplers.py``, ``removers.py``, the commit order of
``order.py``, the dense member set of ``members.py``, the numba sum tree
of ``sumtree.py`` and a prioritized table's UPDATE and SAMPLE kernels over
it, ``treeops.py``); ``reuse.py`` (random draws under a reuse limit);
``tablestats.py`` (what ``status`` reports).

May import: ``wire`` and the shared root modules, nothing else of the
server: a table knows nothing of threads, sockets or files.
Who calls: the engine thread only (or one thread before the table is
served); nothing here is safe to call concurrently.
"""
