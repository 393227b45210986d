"""The client wing: what actor and learner processes import.

``client.py`` (``connect``, ``Client``: the public API), ``session.py``
(the connection's life across forks and daemon restarts: opening,
reconnecting, the "may be lost" notice), ``link.py`` (control socket),
``pipe.py`` (command channel), ``table.py`` (the table handle),
``lease.py`` (slot leases for every writer), ``draws.py`` (SAMPLE and the
one draw-gather-redraw loop), ``gather.py`` (rows out of the segment:
functions over arrays), ``iterator.py`` (prefetching learner loop),
``writers.py`` (sequence and n-step writers), ``retry.py`` (the calls that
run again after a reconnect), ``private_daemon.py`` (``Server``: a daemon
of one program's own), ``parameters.py`` (``ParameterBoard``: model
parameters from a learner to its actors).  Imports ``wire`` and the shared root
modules, never ``server``.
"""

from .client import Client, connect
from .gather import SampleBatch
from .parameters import ParameterBoard
from .private_daemon import Server, ServerFailed
from .table import Table
from .writers import NStepWriter, SequenceWriter

__all__ = ["connect", "Client", "Server", "ServerFailed", "ParameterBoard", "Table", "SampleBatch", "SequenceWriter", "NStepWriter"]
