"""A table's selection: which committed item a draw or an eviction picks.

``selection.py`` (``Selection``: what the table holds of it) over
``selectors.py`` (the ``Selector`` and ``Sampler`` protocols and their
factories), ``samplers.py`` and ``removers.py`` (the kinds), ``order.py``
(commit order, for fifo and lifo), ``members.py`` (the dense member set
kernels of uniform selection), ``sumtree.py`` (the sum/min tree kernels),
``treeops.py`` (a prioritized table's UPDATE and SAMPLE as one kernel
each), ``stamping.py`` (new items' marks and keys, one kernel per commit)
and ``reuse.py`` (picks under ``max_times_sampled``).

May import: ``wire`` and the shared root modules; never ``slots/`` nor
the table above.  Engine thread only, like the table that owns it.
"""
