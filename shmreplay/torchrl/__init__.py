"""``shmreplay.torchrl``: TorchRL's replay buffers over a shmreplay table (issue 38)::

    import shmreplay.torchrl as srl
    rb = srl.ReplayBuffer(storage=LazyTensorStorage(100_000), batch_size=256)
    rb = srl.PrioritizedReplayBuffer(alpha=0.6, beta=0.4, storage=100_000, batch_size=256)

They take TensorDicts as ``TensorDictReplayBuffer`` and
``TensorDictPrioritizedReplayBuffer`` do, with their argument names:
``storage`` (a TorchRL storage, whose ``max_size`` and ``device`` are
read, or a capacity), ``batch_size``, ``prefetch``, ``alpha``, ``beta``,
``eps``, ``priority_key``.

* ``extend(td)`` stores ``td.shape[0]`` items, each ``td[i]`` (TorchRL's
  ``dim_extend=0``).  The table is made at the first ``extend``/``add``
  from the TensorDict's leaves (as ``LazyTensorStorage`` sizes itself);
  nested keys become fields named with ``__`` (``("next", "pixels")`` is
  ``next__pixels``).  A prioritized buffer takes ``td[priority_key]`` (max
  over an item's entries, plus ``eps``) as the items' priorities and does
  not store it; without it, new items get the highest priority so far.
  ``extend`` and ``add`` return None: an item's index is fixed when the
  daemon applies its commit, after the call.  ``keys=[...]`` fixes the
  entries stored (others are left out); without it every ``extend``
  carries the first one's entries.
* ``sample(batch_size=None)`` returns a TensorDict of ``batch_size`` rows
  (on the storage's device) with ``"index"`` (the slot, int64) and
  ``"index_generation"`` (its generation stamp), TorchRL's names; a
  prioritized buffer adds the importance weights as ``"priority_weight"``
  (TorchRL 0.8 on) and ``"_weight"`` (before).  ``return_info=True``
  returns ``(td, info)``.
* ``update_priority(index, priority)`` and ``update_tensordict_priority(td)``
  set ``(priority + eps) ** alpha`` for the items sampled: a slot written
  again since is skipped, not given another item's priority, because the
  update carries the generation the sample saw (``generation=``, or the
  buffer's last sample of that slot).
* ``len(rb)``, ``rb.write_count`` (the table's inserts, every writer's),
  ``rb.batch_size``; ``iter(rb)`` / ``rb.next()`` yield batches for ever,
  ``prefetch=N`` gathered ahead by a thread with its own connection.  Each
  batch is the caller's to keep (TorchRL's contract), so a prefetched one
  is copied once out of the rotating buffers; ``shmreplay.torch.iterate``
  is the zero-copy path.

What is new: ``table=``, ``socket=`` (a running daemon's table, made if
missing, which several processes feed together; without it a private
daemon, ``shmreplay.Server``, is started and stopped with the buffer),
``frames=`` (in TensorDict keys: ``{"pixels": 4, ("next", "pixels"):
"pixels"}``, docs/frames.md), ``storage_dir=`` (a file-backed table),
``seed=`` (the private daemon's sampler), ``timeout=``.

Processes: the buffer pickles as its daemon's socket and table name, so
TorchRL's multi-process collectors (``replay_buffer=rb``) write from their
workers straight into the table; a forked worker's client opens its own
connection.  The private daemon is stopped by the process that made it.
``shared`` is True (the data lives in the daemon) and ``share()`` does
nothing.  ``empty()`` drops and remakes a table the buffer made; a shared
table raises instead (``shmreplay drop`` is its owner's).  ``state_dict``/``dumps`` are refused: the
daemon checkpoints (``client.checkpoint``).

Imports torch and tensordict (and not torchrl itself); ``import
shmreplay`` imports neither.  One thread at a time per buffer, TorchRL's;
the prefetch thread has its own connection.

The package: ``buffers.py`` (the buffers and the storage view TorchRL's
collectors read), ``tableside.py`` (a buffer's daemon, connection and
table) and ``tdform.py`` (TensorDict entries as table fields and back).
"""

from .buffers import PrioritizedReplayBuffer, ReplayBuffer, TableView
from .tdform import TensorDictForm, field_name, nested_key

__all__ = ["ReplayBuffer", "PrioritizedReplayBuffer", "TableView", "TensorDictForm", "field_name",
           "nested_key"]
