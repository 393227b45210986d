"""shmreplay: a shared-memory experience-replay daemon and its client.

    import shmreplay
    with shmreplay.connect() as client:
        t = client.table("demo")
        t.insert(obs=o, action=a, reward=r)
        batch = t.sample(256, beta=0.4)
        t.update_priorities(batch.keys, new_priorities)

The replay store has three wings: ``client/`` (what actors and learners
import), ``server/`` (the daemon) and ``wire/`` (every byte format both
agree on).  A fourth, ``inference/``, is the SEED inference channel: env
processes and a learner over shared memory, no daemon.

Shared pure logic sits at the root: ``errors.py`` (every exception),
``schema.py`` (table definitions and their checks), ``fields.py`` (the
forms a table's fields take), ``framespec.py`` (a frame table's
declaration and its rings' sizes), ``ratelimiter.py`` (the rate limiter's
predicates), ``leasing.py`` (writers' lease sizes, and what they leave
samplers), ``priorities.py`` (priority checks), ``numbaconf.py`` (numba
flags), ``version.py``.  Tools over the client: ``cli.py`` (the
``shmreplay`` command) with ``statusview.py`` (its status screen),
``torch.py`` (``shmreplay.torch``: batches as tensors), ``sb3.py``
(``shmreplay.sb3``: stable-baselines3's replay buffers), ``torchrl/``
(``shmreplay.torchrl``: TorchRL's replay buffers), ``ray/``
(``shmreplay.ray``: actors anywhere on a Ray cluster) and ``bench/`` (the
benchmark cells).  docs/layout.md, "Where things are", maps it.
"""

from .errors import (
    CapacityError, DaemonUnavailable, DiskFull, EmptyTable, ForeignObject, FieldError, InferenceClosed,
    LayoutError, PermissionDenied, PriorityError, ProtocolError, RateLimited, ReplayError, ReplayTimeout,
    ReservationExpired, SchemaError, ShmFull, SlotsBusy, TableExists, UnknownTable,
)
from .version import __version__

# The client's classes load on first use (PEP 562), so ``import shmreplay``
# costs milliseconds and loads neither numba nor the daemon's code: the
# command line and a program that only names the errors never pay for them.
# A client pays numba's import (the command ring's atomic loads and stores,
# wire/atomics.py) when it first touches one of these.
_LAZY = {
    "connect": "client", "Client": "client", "Server": "client", "ServerFailed": "client",
    "ParameterBoard": "client", "Table": "client", "SampleBatch": "client",
    "SequenceWriter": "client", "NStepWriter": "client", "actor_steps": "client", "learner_batches": "client",
    "yield_to_learners": "client",
    "InferenceServer": "inference", "InferenceClient": "inference", "InferenceBatch": "inference",
}


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'shmreplay' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "connect", "Client", "Server", "ServerFailed", "ParameterBoard", "Table", "SampleBatch", "SequenceWriter", "NStepWriter",
    "actor_steps", "learner_batches", "yield_to_learners", "ReplayError", "ProtocolError", "DaemonUnavailable", "ReplayTimeout", "UnknownTable",
    "TableExists", "SchemaError", "FieldError", "PriorityError", "CapacityError", "ShmFull",
    "LayoutError", "EmptyTable", "RateLimited", "SlotsBusy", "PermissionDenied", "DiskFull",
    "ForeignObject", "ReservationExpired",
    "InferenceServer", "InferenceClient", "InferenceBatch", "InferenceClosed",
    "__version__",
]
