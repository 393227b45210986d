"""The client wing: what actor and learner processes import.

``client.py`` (``connect``, ``Client``: the lease and its life cycle),
``link.py`` (control socket), ``pipe.py`` (command channel), ``table.py``
(the table handle), ``lease.py`` (slot leases for every writer),
``gather.py`` (rows out of the segment), ``iterator.py`` (prefetching
learner loop), ``writers.py`` (sequence and n-step writers), ``retry.py``
(riding out a daemon restart).  Imports ``wire`` and the shared root
modules, never ``server``.
"""

from .client import Client, connect
from .gather import SampleBatch
from .table import Table
from .writers import NStepWriter, SequenceWriter

__all__ = ["connect", "Client", "Table", "SampleBatch", "SequenceWriter", "NStepWriter"]
