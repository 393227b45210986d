"""shmreplay: a shared-memory experience-replay daemon and its client.

    import shmreplay
    with shmreplay.connect() as client:
        t = client.table("demo")
        t.insert(obs=o, action=a, reward=r)
        batch = t.sample(256, beta=0.4)
        t.update_priorities(batch.keys, new_priorities)
"""

__version__ = "0.1.0"

from .client import Client, SampleBatch, Table, connect  # noqa: E402
from .writers import NStepWriter, SequenceWriter  # noqa: E402
from .errors import (  # noqa: E402
    CapacityError, DaemonUnavailable, EmptyTable, FieldError, LayoutError, PriorityError,
    PermissionDenied, ProtocolError, RateLimited, ReplayError, ReplayTimeout, SchemaError, ShmFull,
    TableExists, UnknownTable,
)

__all__ = [
    "connect", "Client", "Table", "SampleBatch", "SequenceWriter", "NStepWriter",
    "ReplayError", "ProtocolError", "DaemonUnavailable", "ReplayTimeout", "UnknownTable",
    "TableExists", "SchemaError", "FieldError", "PriorityError", "CapacityError", "ShmFull",
    "LayoutError", "EmptyTable", "RateLimited", "PermissionDenied",
]
