"""What the daemon keeps in files, and the names it owns on the box.

``safedir.py`` (every directory the daemon writes in: checked component
by component, made with its mode and group, walked and pruned without
following a link), ``durable.py`` (a durable file-backed table's metadata
file: one sync's steps, reading it back after a reboot) with
``metafile.py`` (that file's bytes: two copies written in place in turn),
``checkpoint.py``
(a table's checkpoint directory: write, prune) with ``sealed.py`` (its
files, made, checksummed and fsynced), ``ckframes.py`` (a frame table's
frames and references in it), ``ckread.py`` (list, load, restore) and
``rowread.py`` (rows read with ``pread``, never through
a mapping a client can truncate), ``storage.py`` (which ``storage_dir`` is
safe to create rows files in),
``prefetch.py`` (reading file-backed rows ahead, starting their writeback)
with ``rowranges.py`` (slots to byte ranges, a numba kernel),
``ownership.py`` (the instance lock; removing what dead daemons left).

May import: ``tables`` (and ``wire``, the shared root modules).  Byte
formats of segments are ``wire.layout``'s; this room opens, reads and
writes files by them.
Who calls: each module says; most run on the control plane's executor
threads, the prefetch readers on threads of their own.
"""
