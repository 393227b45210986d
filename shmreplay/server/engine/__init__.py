"""The data plane: one thread that owns every table and client channel.

``engine.py`` (``Engine``: the loop, one handler per record op, every
reply built and sent there, the entry points the control plane submits),
``commands.py`` (each record of a client's ring applied to its table, its
reply built), ``parking.py`` (RESERVEs and SAMPLEs waiting for a table's limits),
``outbox.py`` (an attached client: its channel and the replies waiting
for room in its ring), ``idle.py`` (spin, then sleep on the doorbells),
``calls.py`` (calls handed in by the control plane).

May import: ``tables`` (and ``wire``, the shared root modules).  Not
``disk``: the prefetcher is handed in by the daemon, and the engine only
tells it which rows will be touched.
Who calls: ``Engine.start``, ``submit`` and ``stop`` from any thread;
everything else runs on the engine thread.
"""
