"""The wire: every byte format the client and the daemon must agree on.

``names.py`` (socket path and /dev/shm names), ``segment.py`` (POSIX
shared-memory segments), ``layout.py`` (a table segment's byte map and live
words), ``channel.py`` (a client's two command rings), ``records.py`` (what
each record in a ring means, and the slot key), ``control.py`` (the
control-socket protocol, sans-IO), ``atomics.py`` (the memory-ordering
primitives both ends of a ring use).  Imports only the shared root modules,
never ``client`` or ``server``.
"""
