"""The wire: every byte format the client and the daemon must agree on.

``names.py`` (socket path and /dev/shm names), ``peer.py`` (who a peer
process is: its credentials, its start time), ``segment.py`` (POSIX
shared-memory segments), ``headers.py`` (a table's two segment headers,
read from bytes nobody vouches for), ``layout.py`` (a table segment's byte
map, mapped) with ``tablelayout.py`` (its offsets) and ``framelayout.py``
(where a frame table's rings and references lie), ``livewords.py`` (the meta segment's live counter words, by name),
``rowfile.py`` (a file-backed table's rows file), ``rowranges.py`` (the
byte ranges of a set of slots' rows), ``channel.py`` (a client's two
command rings), ``doorbell.py`` (their eventfd doorbells), ``records.py``
(what each record in a ring means, and the slot key), ``framerecords.py``
(a frame table's records), ``commitrun.py``
(payload-free COMMIT records: a run read, or one written, in one kernel),
``replytake.py`` (a SAMPLE reply read off the ring in one kernel),
``control.py`` (the control-socket protocol, sans-IO),
``atomics.py`` (the memory-ordering primitives both ends of a ring use).
Imports only the shared root modules, never ``client``, ``server`` or
``inference``.
"""
