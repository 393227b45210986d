"""A frame table's frame books (docs/frames.md): which frames of each ring
slots hold (their items', until reserved again) and writers' leases hold,
which are free, and the daemon's copy of every item's frame references.

``book.py`` (``FrameBook``: the invariant that keeps a frame alive while a
slot references it, argued there) with ``refcount.py`` (the kernels:
references checked and counted, let go, frames leased and given back,
counts rebuilt; twin ``tests/frames_reference.py``), ``freeframes.py``
(``FrameQueues``: the counts and free queues the kernels work on) and
``frameleases.py`` (``FrameLeases``: writers' frame leases and their caps);
``tableframes.py`` (``TableFrames``: the book's moves made whole for the
table that holds it: commits all or none, a short ring reclaimed through
the table before a lease).

May import: ``wire`` and the shared root modules; never ``slots/``,
``select/`` nor the table above.  Engine thread only, like the table that
holds one.
"""
