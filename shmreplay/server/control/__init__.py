"""The control plane: the daemon's event loop and what it decides.

``server.py`` (``ControlServer``: the parts put together, the control
socket, status), ``lifecycle.py`` (tables' life cycle: create, add, drop,
sync), ``setaside.py`` (tables set aside at start), ``checkpoints.py``
(checkpoints asked for), ``gate.py`` (accepting connections and deciding
who comes in), ``connections.py`` (the open connections: counted,
kicked), ``connection.py`` (one client's connection: its requests in
order, its lease), ``handshake.py`` (hello, ready, the descriptors a
reply passes), ``ops.py`` (one handler per op), ``access.py`` (who may
connect and administer), ``seen.py`` (what ``status`` shows to whom),
``descriptors.py`` (the descriptor limit and the reserve), ``quotas.py``
(who created each table, what other users may still create),
``config.py`` (the daemon's config), ``memory.py`` (can the box hold a
table), ``recovery.py`` (bringing every table up at start: adopt,
restore, create), ``syncs.py`` (when durable tables are synced),
``monitor.py`` (the daemon's numbers over time, its own memory),
``metrics.py`` (Prometheus ``/metrics``: its endpoints and the views
pushed) with ``scrapes.py`` (the process that answers the scrapes),
``watchdog.py`` (systemd's notify protocol and watchdog).

May import every other room: ``tables``, ``engine``, ``disk``.
Who calls: the event-loop thread; table state is reached only through
the engine's entry points (``ControlServer.call``), slow work runs in the
loop's executor.
"""
