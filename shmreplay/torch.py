"""``shmreplay.torch``: batches as torch tensors, gathered straight into them.

Optional (``pip install "shmreplay[torch]"``), imported only when used:
``import shmreplay`` never imports torch.

    import shmreplay.torch as srt

    # one host copy: rows go from shared memory straight into pinned tensors
    with srt.iterate(table, 256, beta=0.4, pin_memory=True) as batches:
        for b in batches:                      # b: TensorBatch, valid until the next one
            d = b.to("cuda")                   # non_blocking device copies (dict of tensors)
            loss = (d.weights * td_loss(d.data)).mean()
            ...
            table.update_priorities(b.keys, new_priorities)

* ``TensorBatch``: preallocated CPU tensors per field (pinned with
  ``pin_memory=True``), float32 importance weights, uint64 keys (numpy, as
  ``update_priorities`` takes them).  The gather writes into the tensors'
  memory through numpy views of it: no staging batch, no second copy.
* ``sample(table, n, out=TensorBatch)``: one batch; ``as_tensors(batch)``:
  a numpy ``SampleBatch`` as tensors without copying its rows.
* ``iterate(...)``: ``Table.iterate`` over ``TensorBatch`` buffers, with
  its contract (a batch is valid until the next one; ``check_reuse=True``
  checks it).  A batch copied to a device with ``non_blocking=True`` is not
  refilled before that copy has finished (a CUDA event per batch).
* ``learner_batches(...)``: ``shmreplay.learner_batches`` (a learner's
  loop: updates, a total, a stop) over ``TensorBatch`` buffers.
* ``ReplayDataset``: a ``torch.utils.data.IterableDataset`` of batches, for
  ``DataLoader(dataset, batch_size=None)``; every batch it yields is fresh
  (nothing reused), so a loader may keep or pin it.
* ``numpy_state(module)`` / ``load_state(module, arrays)``: a module's
  parameters and buffers for ``shmreplay.ParameterBoard`` and back.

Threads: as the table handle's (one thread at a time per table handle);
``iterate``'s prefetch thread has its own connection.
"""

from __future__ import annotations

import numpy as np
import torch

from .client import loops
from .client.gather import SampleBatch
from .errors import ReplayError
from .wire.records import key_slots


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


class TensorBatch:
    """A batch's tensors on the CPU (see the module docstring).  ``data``:
    field -> tensor (n, *shape); ``weights``: float32 tensor; ``keys``:
    uint64 numpy array; ``probabilities``: float64 numpy array."""

    def __init__(self, fields, n: int, pin_memory: bool = False, tensors: dict | None = None):
        """``tensors``: field -> a tensor of the caller's to gather into
        (CPU, contiguous, shape (n, *field shape), the field's dtype);
        other fields get new tensors, pinned with ``pin_memory``."""
        if pin_memory and not torch.cuda.is_available():
            raise ReplayError("pin_memory=True needs CUDA (pinned host memory is for device "
                              "copies); this torch sees no GPU: leave it False")
        tensors = dict(tensors or {})
        unknown = sorted(set(tensors) - {f.name for f in fields})
        if unknown:
            raise ReplayError(f"tensors for {unknown}: the table has no such field")
        self.data = {}
        for f in fields:
            dtype = _torch_dtype(f.dtype)
            t = tensors.get(f.name)
            if t is None:
                t = torch.empty((n, *f.shape), dtype=dtype, pin_memory=pin_memory)
            elif (t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != (n, *f.shape)
                  or t.dtype != dtype):
                raise ReplayError(f"tensor for field {f.name!r} is {t.dtype}{list(t.shape)} on "
                                  f"{t.device}{'' if t.is_contiguous() else ', not contiguous'}; "
                                  f"give a contiguous CPU {dtype}{[n, *f.shape]}")
            self.data[f.name] = t
        self.weights = torch.empty(n, dtype=torch.float32, pin_memory=pin_memory)
        self.keys = np.empty(n, np.uint64)
        self.probabilities = np.empty(n)
        # the numpy views the gather writes into: the tensors' own memory
        self.batch = SampleBatch({k: t.numpy() for k, t in self.data.items()}, self.keys,
                                 self.probabilities, self.weights.numpy())
        self._copied = None  # a CUDA event: the last device copy of these tensors

    def __len__(self) -> int:
        return self.keys.shape[0]

    @property
    def redraws(self) -> int:
        return self.batch.redraws

    @property
    def indices(self) -> torch.Tensor:
        return torch.from_numpy(key_slots(self.keys).astype(np.int64))

    def arrays(self) -> dict:
        """What a caller may hold on to (``Table.iterate``'s check_reuse)."""
        return {**{f"data[{k!r}]": t for k, t in self.data.items()}, "weights": self.weights}

    def to(self, device, non_blocking: bool = True) -> "DeviceBatch":
        """The batch on ``device`` (new tensors); keys stay here.  From
        pinned memory to CUDA the copies are asynchronous; ``iterate`` waits
        for them before it refills this batch."""
        device = torch.device(device)
        # copy=True: to() of a tensor already on ``device`` ("cpu") returns the
        # tensor itself, which the next batch refills; the result must be new
        out = DeviceBatch({k: t.to(device, non_blocking=non_blocking, copy=True) for k, t in self.data.items()},
                          self.weights.to(device, non_blocking=non_blocking, copy=True), self.keys.copy())
        if device.type == "cuda" and non_blocking:
            self._copied = torch.cuda.Event()
            self._copied.record()
        return out

    def ready_for_refill(self) -> None:
        """Wait for the last asynchronous device copy out of these tensors
        (called by the prefetch thread before it gathers into them)."""
        ev, self._copied = self._copied, None
        if ev is not None:
            ev.synchronize()


class DeviceBatch:
    """A batch on a device: ``data`` (field -> tensor), ``weights``
    (float32), ``keys`` (a numpy copy, for ``update_priorities``)."""

    def __init__(self, data: dict, weights: torch.Tensor, keys: np.ndarray):
        self.data, self.weights, self.keys = data, weights, keys

    def __len__(self) -> int:
        return self.keys.shape[0]


def tensor_batch(table, n: int, pin_memory: bool = False, tensors: dict | None = None) -> TensorBatch:
    """Tensors for n rows of ``table``'s fields (``tensors``: the caller's
    own for some fields, see ``TensorBatch``)."""
    return TensorBatch(table.spec.fields, int(n), pin_memory, tensors)


def sample(table, n: int, beta: float = 0.4, out: TensorBatch | None = None,
           pin_memory: bool = False, timeout: float | None = None) -> TensorBatch:
    """``Table.sample`` gathered straight into tensors (``out``, or new ones)."""
    if out is None:
        out = tensor_batch(table, n, pin_memory)
    out.ready_for_refill()
    table.sample(n, beta=beta, out=out.batch, timeout=timeout)
    return out


def as_tensors(batch: SampleBatch) -> dict:
    """A numpy batch as tensors sharing its memory (rows are not copied);
    weights as float32 (a copy of n numbers); keys stay numpy."""
    return {"data": {k: torch.from_numpy(a) for k, a in batch.data.items()},
            "weights": torch.from_numpy(batch.weights.astype(np.float32)), "keys": batch.keys}


def iterate(table, batch_size: int, beta: float = 0.4, prefetch: int = 2, pin_memory: bool = False,
            timeout: float | None = None, check_reuse: bool = False):
    """``Table.iterate`` yielding ``TensorBatch`` es (see there for the
    contract: a batch is valid until the next one)."""
    return table.iterate(batch_size, beta, prefetch, timeout, check_reuse,
                         buffers=lambda: tensor_batch(table, batch_size, pin_memory))


def learner_batches(table, batch_size: int, updates: int | None = None, pin_memory: bool = False, **loop):
    """``shmreplay.learner_batches`` yielding ``TensorBatch`` es (the same
    stops, waits and contract; ``loop``: its keyword arguments)."""
    return loops.learner_batches(table, batch_size, updates, buffers=lambda: tensor_batch(table, batch_size, pin_memory), **loop)


class ReplayDataset(torch.utils.data.IterableDataset):
    """Batches of a table, for ``DataLoader(ReplayDataset(...), batch_size=None)``.

    Each item is a dict: the table's fields as tensors, ``weights``
    (float32), ``keys`` (uint64 tensor: ``table.update_priorities(keys,
    ...)`` takes it).  Items are fresh: keep them as long as needed.  With
    ``num_workers > 0`` each worker process connects by itself (a
    ``Client`` pickles as its socket path).  ``batches``: how many to yield
    (None: for ever); ``timeout``: the longest wait for one."""

    def __init__(self, client, table: str, batch_size: int, beta: float = 0.4,
                 batches: int | None = None, timeout: float | None = None):
        super().__init__()
        self.client, self.table_name = client, str(table)
        self.batch_size, self.beta = int(batch_size), float(beta)
        self.batches, self.timeout = batches, timeout

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        client = self.client if info is None else self.client.clone()
        table = client.table(self.table_name)
        count = self.batches
        if info is not None and count is not None:  # split the count across workers
            count = count // info.num_workers + (info.id < count % info.num_workers)
        try:
            i = 0
            while count is None or i < count:
                b = table.sample(self.batch_size, self.beta, timeout=self.timeout)
                item = {k: torch.from_numpy(a) for k, a in b.data.items()}
                item["weights"] = torch.from_numpy(b.weights.astype(np.float32))
                item["keys"] = torch.from_numpy(b.keys)
                yield item
                i += 1
        finally:
            if client is not self.client:
                client.close()


def numpy_state(module: torch.nn.Module) -> dict:
    """A module's parameters and buffers as numpy arrays (CPU copies when
    they live on a device; views on the CPU), for ``ParameterBoard``."""
    return {k: v.detach().cpu().numpy() for k, v in module.state_dict().items()}


def load_state(module: torch.nn.Module, arrays: dict) -> None:
    """Copy ``arrays`` (name -> numpy array, as a board's ``latest`` gives)
    into the module's own tensors, without keeping a reference to them."""
    state = module.state_dict()
    missing = sorted(set(state) - set(arrays))
    if missing:
        raise ReplayError(f"load_state: parameters {missing} are missing")
    with torch.no_grad():
        for k, t in state.items():
            t.copy_(torch.from_numpy(np.asarray(arrays[k])))


__all__ = ["TensorBatch", "DeviceBatch", "tensor_batch", "sample", "as_tensors", "iterate", "learner_batches",
           "ReplayDataset", "numpy_state", "load_state"]
