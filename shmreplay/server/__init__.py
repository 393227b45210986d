"""The server wing: the daemon, ``shmreplayd`` (``python -m shmreplay.server.daemon``).

``daemon.py`` (startup, shutdown, signals), ``control.py`` (the control
socket: attach, table management, admin), ``engine.py`` (the data-plane
thread: dispatch, outboxes), ``parking.py`` (requests waiting for limits),
``table.py`` (a replay table) composed of ``ledger.py`` (slot books),
``counters.py`` (limiter counters), ``selectors.py`` (sampler/remover
interface) with ``samplers.py``, ``removers.py``, ``order.py``,
``reuse.py``, ``sumtree.py``, ``slotqueue.py``; ``recovery.py`` (adopting a
dead daemon's tables), ``checkpoint.py``, ``ownership.py`` (instance lock,
cleanup), ``access.py`` (who may connect), ``config.py``.  Imports ``wire``
and the shared root modules, never ``client``.
"""
