"""shmreplay: a shared-memory experience-replay daemon and its client.

    import shmreplay
    with shmreplay.connect() as client:
        t = client.table("demo")
        t.insert(obs=o, action=a, reward=r)
        batch = t.sample(256, beta=0.4)
        t.update_priorities(batch.keys, new_priorities)

The package has three wings: ``client/`` (what actors and learners import),
``server/`` (the daemon) and ``wire/`` (every byte format both agree on),
plus shared pure logic at the root (errors, schema, rate-limiter
predicates, priority checks).  docs/layout.md, "Where things are", maps it.
"""

from .client import Client, NStepWriter, ParameterBoard, SampleBatch, SequenceWriter, Server, ServerFailed, Table, connect
from .errors import (
    CapacityError, DaemonUnavailable, DiskFull, EmptyTable, ForeignObject, FieldError, LayoutError, PriorityError,
    PermissionDenied, ProtocolError, RateLimited, ReplayError, ReplayTimeout, SchemaError, ShmFull,
    ReservationExpired, SlotsBusy, TableExists, UnknownTable,
)
from .client.inference import InferenceBatch, InferenceClient, InferenceServer
from .errors import InferenceClosed
from .version import __version__

__all__ = [
    "connect", "Client", "Server", "ServerFailed", "ParameterBoard", "Table", "SampleBatch", "SequenceWriter", "NStepWriter",
    "ReplayError", "ProtocolError", "DaemonUnavailable", "ReplayTimeout", "UnknownTable",
    "TableExists", "SchemaError", "FieldError", "PriorityError", "CapacityError", "ShmFull",
    "LayoutError", "EmptyTable", "RateLimited", "SlotsBusy", "PermissionDenied", "DiskFull",
    "ForeignObject", "ReservationExpired",
    "InferenceServer", "InferenceClient", "InferenceBatch", "InferenceClosed",
]
