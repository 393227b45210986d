"""The server wing: the daemon, ``shmreplayd`` (``python -m shmreplay.server.daemon``).

``daemon.py`` builds the daemon from four rooms, starts it in order and
stops it in the reverse order; signals are handled there and nowhere else.
The rooms, from the ground up (each one's ``__init__`` says what it owns):

* ``tables/``: a replay table as the daemon keeps it: slot books, limits,
  samplers and removers, the sum tree.  Knows nothing of threads, sockets
  or files.
* ``engine/``: the data-plane thread: it owns every table and client
  channel, applies each command and builds and sends every reply.
* ``disk/``: files and shared-memory names: durable tables' metadata,
  checkpoints, rows files and their read-ahead, the instance lock and the
  cleanup of dead daemons' objects.
* ``control/``: the event loop: the control socket, who may connect, the
  config, tables' life cycle and startup recovery, durable tables' syncs.

Imports run down only: ``control`` may use every other room; ``engine``
and ``disk`` only ``tables``; ``tables`` none.  Every room may use
``wire`` and the shared root modules, never ``client``.
``tests/test_structure.py`` checks these rules.
"""
