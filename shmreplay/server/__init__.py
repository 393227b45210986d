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
``wire`` and the shared root modules, never ``client`` or ``inference``.
``tests/test_structure.py`` checks these rules.
"""

import os as _os

# numba caches kernels next to the sources, or under $NUMBA_CACHE_DIR, read
# when numba is first imported (below this package).  Under systemd with
# CacheDirectory= the sources are read-only (ProtectSystem=strict) and a
# system user's home may be too, so numba would fail to cache ("no locator
# available") and compile every kernel at every start: use the service's
# cache directory unless the operator chose one.
if not _os.environ.get("NUMBA_CACHE_DIR") and _os.environ.get("CACHE_DIRECTORY"):
    _os.environ["NUMBA_CACHE_DIR"] = _os.path.join(_os.environ["CACHE_DIRECTORY"].split(":")[0], "numba")
