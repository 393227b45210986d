"""``ReplayBuffer`` and ``PrioritizedReplayBuffer``: TorchRL's
``TensorDictReplayBuffer`` and ``TensorDictPrioritizedReplayBuffer`` over
a table (the package docstring says what each call does), and
``TableView``, what TorchRL's collectors read of a buffer's storage.

Who calls: one thread at a time per buffer (TorchRL's rule); the prefetch
thread (``Table.iterate``) has its own connection.  A buffer pickled into
another process connects there anew.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from tensordict import TensorDictBase

from ..client.private_daemon import buffer_options
from ..errors import ReplayError
from ..wire.records import make_keys
from .tableside import BufferTable
from .tdform import field_name

TABLE = "replay"
_UNSAMPLED = np.iinfo(np.uint64).max


def _capacity_device(storage):
    if isinstance(storage, (int, np.integer)):
        return int(storage), None
    size = getattr(storage, "max_size", None)  # a TorchRL storage's public size
    if size is None:
        raise ReplayError("storage= takes a capacity (an int) or a TorchRL storage "
                          "(LazyTensorStorage(100_000))")
    device = getattr(storage, "device", None)
    return int(size), (None if device in (None, "auto") else torch.device(device))


def _item_priorities(values, n: int) -> np.ndarray:
    """One float64 priority for each of n items: the max over an item's
    entries (TorchRL's "max" reduction); a single value for every item."""
    p = torch.as_tensor(values).detach().double().cpu()
    if p.numel() == 1:
        p = p.reshape(1).expand(n)
    return p.reshape(n, -1).amax(1).numpy()


class ReplayBuffer:
    """TorchRL's ``TensorDictReplayBuffer`` over a table: uniform draws."""

    prioritized = False

    def __init__(self, *, storage=1_000_000, batch_size: int | None = None, prefetch: int | None = None,
                 priority_key="td_error", keys=None, table: str | None = None, socket: str | None = None,
                 frames: dict | None = None, storage_dir: str | None = None, seed: int | None = None,
                 timeout: float | None = 60.0, alpha: float = 1.0, beta: float = 0.4, eps: float = 1e-8):
        capacity, self._device = _capacity_device(storage)
        if capacity < 1:
            raise ReplayError(f"storage holds {capacity} items; give at least 1")
        self._batch_size = None if batch_size is None else int(batch_size)
        self._prefetch = prefetch or 0
        self.priority_key = priority_key
        self._alpha, self._beta, self._eps = float(alpha), float(beta), float(eps)
        self.timeout = timeout
        spec = dict(name=table or TABLE, capacity=capacity, remover="fifo",
                    sampler="prioritized" if self.prioritized else "uniform",
                    **({"alpha": self._alpha} if self.prioritized else {}),
                    **({"frames": {field_name(k): v if isinstance(v, int) else field_name(v)
                                   for k, v in frames.items()}} if frames else {}),
                    **({"storage_dir": storage_dir} if storage_dir else {}))
        opts = buffer_options(socket, storage_dir, seed)
        # the entries to store (None: the first extend's); others are left out
        stored = None if keys is None else [field_name(k) for k in keys]
        if self.prioritized and stored is not None and field_name(priority_key) in stored:
            raise ReplayError(f"keys= names {priority_key!r}, the priority_key: a prioritized buffer takes it "
                              "as the items' priorities and never stores it; leave it out of keys=")
        self._side = BufferTable(spec, stored, (priority_key,) if self.prioritized else (),
                                 type(self).__name__, socket, opts)
        self._batches = None  # the prefetching iterator, made at the first sample
        self._batches_pid = None  # the process whose thread fills it
        self._last_keys = None  # slot -> the key this buffer last sampled there

    # ---- writing ----
    def extend(self, tensordicts: TensorDictBase, *, update_priority: bool | None = None) -> None:
        """Store ``tensordicts.shape[0]`` items (module docstring)."""
        if not isinstance(tensordicts, TensorDictBase):
            raise ReplayError(f"extend takes a TensorDict, got {type(tensordicts).__name__}")
        if tensordicts.batch_dims == 0:
            raise ReplayError("extend takes a TensorDict with a batch dimension; add() takes one item")
        n = tensordicts.shape[0]
        prios = None
        if self.prioritized and update_priority is not False:
            p = tensordicts.get(self.priority_key, None)
            if p is not None:
                prios = _item_priorities(p, n) + self._eps
        self._side.insert(tensordicts, prios, self.timeout)

    def add(self, data: TensorDictBase) -> None:
        """Store one item (a TensorDict without a batch dimension)."""
        if not isinstance(data, TensorDictBase):
            raise ReplayError(f"add takes a TensorDict, got {type(data).__name__}")
        self.extend(data.unsqueeze(0))

    # ---- reading ----
    def __len__(self) -> int:
        return self._side.length()

    @property
    def write_count(self) -> int:
        """Items written to the table so far, by every writer."""
        table = self._side.readable()
        return 0 if table is None else table.inserts

    @property
    def batch_size(self) -> int | None:
        return self._batch_size

    @property
    def capacity(self) -> int:
        """The table's (the buffer's storage size until the table exists)."""
        return self._side.capacity

    @property
    def beta(self) -> float:
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        """Anneal beta (TorchRL's ``rb.sampler.beta``); prefetched batches
        drawn with the old one are dropped."""
        self._beta = float(value)
        self._close_batches()

    @property
    def device(self) -> torch.device:
        """Where ``sample`` puts its TensorDicts (the storage's device)."""
        return self._device or torch.device("cpu")

    def sample(self, batch_size: int | None = None, return_info: bool = False):
        """A TensorDict of ``batch_size`` items (module docstring)."""
        n = self._batch_size if batch_size is None else int(batch_size)
        if n is None:
            raise ReplayError("no batch size: give sample(batch_size) or ReplayBuffer(batch_size=...)")
        table = self._side.readable()
        if table is None:
            raise ReplayError(f"table {self._side.name!r} is empty: extend the buffer before sampling")
        if self._prefetch and n == self._batch_size:
            return self._finish(self._prefetched(table), return_info, copy=True)
        return self._finish(table.sample(n, self._beta, timeout=self.timeout), return_info, copy=False)

    def _prefetched(self, table):
        if self._batches is None or self._batches_pid != os.getpid():  # none, or a forked copy's
            self._batches = table.iterate(self._batch_size, self._beta, prefetch=self._prefetch,
                                          timeout=self.timeout)
            self._batches_pid = os.getpid()
        return next(self._batches)

    def _finish(self, batch, return_info: bool, copy: bool):
        data = {k: a.copy() for k, a in batch.data.items()} if copy else batch.data
        n = len(batch)
        td = self._side.form.tensordict(data, n, self._device)
        slots = batch.indices
        info = {"index": torch.from_numpy(slots),
                "index_generation": torch.from_numpy((batch.keys >> np.uint64(32)).astype(np.int64))}
        if self.prioritized:
            weight = torch.from_numpy(batch.weights.astype(np.float32))
            info["priority_weight"] = info["_weight"] = weight
            if self._last_keys is None:
                self._last_keys = np.full(self._side.capacity, _UNSAMPLED, np.uint64)
            self._last_keys[slots] = batch.keys
        for key, value in info.items():
            td.set(key, value if self._device is None else value.to(self._device))
        return (td, info) if return_info else td

    def __iter__(self):
        if self._batch_size is None:
            raise ReplayError("iterating a buffer needs ReplayBuffer(batch_size=...)")
        while True:
            yield self.sample()

    def next(self):
        return self.sample()

    # ---- priorities: TorchRL's no-ops on a uniform buffer ----
    def update_priority(self, index, priority, generation=None) -> None:
        pass

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        pass

    # ---- the buffer's lifetime ----
    @property
    def shared(self) -> bool:
        return True  # the rows live in the daemon, for every process that has the buffer

    def share(self, shared: bool = True):
        return self

    @property
    def storage(self) -> "TableView":
        return TableView(self)

    # TorchRL's collectors read ``replay_buffer._storage`` (its initialized
    # and device): a view that says the table sizes itself
    _storage = storage

    @property
    def table(self):
        """The ``shmreplay.Table`` under the buffer (None before the first write)."""
        return self._side.readable()

    def empty(self, empty_write_count: bool = True) -> None:
        """Drop the table this buffer made (made again at the next write);
        the table's write count goes with it."""
        self._close_batches()
        self._side.drop()
        self._last_keys = None

    def _close_batches(self) -> None:
        if self._batches is not None and self._batches_pid == os.getpid():
            self._batches.close()
        self._batches = None

    def close(self) -> None:
        """Close the connection, and stop the private daemon if the buffer made one."""
        self._close_batches()
        self._side.close()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    def __repr__(self) -> str:
        return (f"shmreplay.torchrl.{type(self).__name__}(table={self._side.name!r}, "
                f"capacity={self.capacity}, socket={self._side.socket!r})")

    def __getstate__(self):  # into a collector's worker: the same daemon and table (BufferTable)
        return {**self.__dict__, "_batches": None, "_batches_pid": None, "_last_keys": None}

    def state_dict(self):
        raise ReplayError("a shmreplay buffer's data lives in its daemon and is not saved with the "
                          "module: checkpoint the table (client.checkpoint)")

    dumps = state_dict


class PrioritizedReplayBuffer(ReplayBuffer):
    """TorchRL's ``TensorDictPrioritizedReplayBuffer`` over a prioritized table."""

    prioritized = True

    def __init__(self, *, alpha: float, beta: float, priority_key="td_error", eps: float = 1e-8, **kwargs):
        super().__init__(alpha=alpha, beta=beta, priority_key=priority_key, eps=eps, **kwargs)

    def update_priority(self, index, priority, generation=None) -> None:
        """New priorities for sampled items: ``index`` as ``sample`` gave it
        (with ``generation``, its ``"index_generation"``; without, the
        generation this buffer's last sample of the slot saw)."""
        slots = torch.as_tensor(index).reshape(-1).cpu().numpy().astype(np.int64)
        p = _item_priorities(priority, slots.shape[0])
        cap = self.capacity
        if slots.size and (slots.min() < 0 or slots.max() >= cap):
            raise ReplayError(f"index holds slots outside 0..{cap - 1}: pass the sample's 'index'")
        if generation is not None:
            gens = torch.as_tensor(generation).reshape(-1).cpu().numpy()
            if gens.shape != slots.shape:
                raise ReplayError(f"generation has {gens.shape[0]} entries for {slots.shape[0]} indices: "
                                  "pass the sample's 'index_generation' with its 'index'")
            keys = make_keys(gens, slots)
        else:
            keys = (np.full(0, _UNSAMPLED, np.uint64) if self._last_keys is None
                    else self._last_keys[slots])
            if keys.shape[0] != slots.shape[0] or (keys == _UNSAMPLED).any():
                raise ReplayError("update_priority got slots this buffer never sampled: pass "
                                  "generation=sample['index_generation'] (or update_tensordict_priority)")
        table = self._side.readable()
        if table is None:
            raise ReplayError("update_priority before anything was extended: there is no item to update")
        table.update_priorities(keys, p + self._eps)

    def update_tensordict_priority(self, data: TensorDictBase) -> None:
        """``update_priority`` from a sampled TensorDict carrying ``priority_key``."""
        priority = data.get(self.priority_key, None)
        if priority is None:
            raise ReplayError(f"the TensorDict has no {self.priority_key!r} (the buffer's priority_key): "
                              "set it to the new priorities first")
        self.update_priority(data.get("index"), priority, data.get("index_generation", None))


class TableView:
    """What TorchRL's code reads of a buffer's storage (``initialized``,
    ``device``, ``max_size``, ``len``): the table sizes itself at the
    first write, so a collector does not write a fake one first."""

    initialized = True
    shared_init = False
    ndim = 1

    def __init__(self, buffer: ReplayBuffer):
        self._buffer = buffer

    @property
    def device(self) -> torch.device:
        return self._buffer.device

    @property
    def max_size(self) -> int:
        return self._buffer.capacity

    def __len__(self) -> int:
        return len(self._buffer)
