"""The client wing: what actor and learner processes import.

``client.py`` (``connect``, ``Client``: the public API), ``session.py``
(the connection's life across forks and daemon restarts: opening,
reconnecting, the "may be lost" notice), ``link.py`` (control socket),
``pipe.py`` (command channel), ``table.py`` (the table handle),
``rows.py`` (checking the rows a caller hands in), ``addone.py`` (a one-item insert's check,
copy and COMMIT in one kernel), ``lease.py`` (slot leases for every writer), ``binding.py`` (the table as a
lease writes into it),
``leases.py`` (a table handle's leases, and their size), ``draws.py`` (SAMPLE, the
one draw-gather-redraw loop, a table handle's draw side), ``gather.py`` (rows out of the segment:
functions over arrays), ``rowcopy.py`` (its kernels for a slot layout: the row copy and the
stamp check), ``framecopy.py`` (a frame table's stacks rebuilt from its
frame ring, for the gather), ``framestream.py`` (which frames of a
stack a writer stores), ``framestore.py`` (one writer's frames: its
window and frame leases) and ``frametable.py`` (a frame table's handle,
whose inserts store frames once; docs/frames.md), ``iterator.py`` (prefetching learner loop),
``writers.py`` (sequence and n-step writers) with ``openitems.py`` (what a
writer keeps of the items it has begun) and ``envstreams.py`` (a vector
env's streams, one writer an env, gymnasium's autoreset skipped), ``loops.py`` (an actor's and a
learner's loop: the global step, a stop), ``retry.py`` (the calls that
run again after a reconnect), ``private_daemon.py`` (``Server``: a daemon
of one program's own), ``parameters.py`` (``ParameterBoard``: model
parameters from a learner to its actors).  Imports ``wire`` and the shared root
modules, never ``server`` or ``inference``.
"""

# loaded on first use (PEP 562), as the package's own names: the command
# line imports link.py alone, and never pays for numba (wire/atomics.py)
_LAZY = {"connect": "client", "Client": "client", "SampleBatch": "gather",
         "ParameterBoard": "parameters", "Server": "private_daemon", "ServerFailed": "private_daemon",
         "Table": "table", "NStepWriter": "writers", "SequenceWriter": "writers",
         "actor_steps": "loops", "learner_batches": "loops", "yield_to_learners": "loops"}


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'shmreplay.client' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(f".{where}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["connect", "Client", "Server", "ServerFailed", "ParameterBoard", "Table", "SampleBatch", "SequenceWriter", "NStepWriter",
           "actor_steps", "learner_batches", "yield_to_learners"]
