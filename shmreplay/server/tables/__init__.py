"""Replay tables as the daemon keeps them: items in, items out, and the numbers.

Three rooms and the table that joins them:

* ``slots/``, the slot books: which slot is free, reserved by a writer,
  committed, or held for a learner, and who may still write or read it;
* ``select/``, the selection: which committed item a draw or an eviction
  picks (samplers, removers, the commit order, the sum tree, the reuse
  limit);
* ``frames/``, a frame table's frame books: which frames live items and
  writers' leases hold, and items' frame references (docs/frames.md).

``table.py`` (``Table``) composes one of each with ``counters.py`` (the
rate limiter's and reuse limit's counters, mirrored into the segment, and
``Blocked``, why a request waits) and ``tablestats.py`` (what ``status``
reports), and moves items between them.  No room imports another
or this level; the table hands each what it needs.

May import: ``wire`` and the shared root modules, nothing else of the
server: a table knows nothing of threads, sockets or files.
Who calls: the engine thread only (or one thread before the table is
served); nothing here is safe to call concurrently.
"""
