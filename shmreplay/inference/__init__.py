"""The inference wing: SEED-style serving between env processes and a
learner over shared memory, no daemon (docs/protocol.md, "Inference
channel").  Its own product beside the replay store, sharing only the
shared root modules and the ring's primitives of ``wire``.

``server.py`` (``InferenceServer``: the learner's end, and the
``InferenceBatch`` its ``receive`` returns), ``env.py``
(``InferenceClient``: an env's end), ``handle.py`` (what both ends share:
``with``, refusal after close or in another process, a wait's deadline),
``slots.py`` (``SlotBooks``: the server's books of its slots, and its
reading of their state words), ``layout.py`` (the channel's bytes: its
segment's map, state words, the header the server mends, value checks),
``memfd.py`` (the sealed memfd: making it, its address, an env's checked
opening of it), ``futex.py`` (the bells: sleeping on and waking a word of
the segment).  Imports ``wire``'s segment and atomics and the shared root
modules, never ``client`` or ``server``, and neither of them imports it.
"""

# ``shmreplay`` loads this wing on first use of its names (PEP 562), so
# ``import shmreplay`` never pays for it, nor for numba (wire/atomics.py)
from .env import InferenceClient
from .server import InferenceBatch, InferenceServer

__all__ = ["InferenceServer", "InferenceClient", "InferenceBatch"]
