"""TensorDict entries as a table's fields and back: a nested key is a field
named with its parts joined by ``__`` (``("next", "pixels")`` is
``next__pixels``), read back by splitting there, so a key that would not
read back as itself is refused.  Pure functions and ``TensorDictForm``
(what one buffer stores); any thread.
"""

from __future__ import annotations

import re

import torch
from tensordict import TensorDict, TensorDictBase, is_leaf_nontensor

from ..errors import ReplayError

SEP = "__"  # between a nested key's parts in a field name
# what sample() writes next to the rows, never stored by extend
META = frozenset({"index", "index_generation", "priority_weight", "_weight"})
_FIELD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")


def field_name(key) -> str:
    """A TensorDict key's field name: its parts joined with ``__``; a key
    that would not read back as itself (``("a_", "b")`` reads as ``("a",
    "_b")``) or is no field name raises."""
    parts = (key,) if isinstance(key, str) else tuple(key)
    name = SEP.join(parts)
    if not _FIELD.fullmatch(name) or tuple(name.split(SEP)) != parts:
        raise ReplayError(f"TensorDict key {key!r} cannot name a table field (letters, digits and single "
                          "underscores between a key's parts, 64 characters in all): rename it, or "
                          "td.exclude(key) before extend")
    return name


def _stored_name(key) -> str | None:
    try:
        return field_name(key)
    except ReplayError:
        return None  # no field could have this name


def nested_key(name: str):
    parts = tuple(name.split(SEP))
    return parts[0] if len(parts) == 1 else parts


def _leaves(td: TensorDictBase):
    # non-tensor entries (strings, objects) count as leaves, to be refused,
    # not skipped: a key the table silently left out would be lost
    return td.keys(include_nested=True, leaves_only=True, is_leaf=is_leaf_nontensor)


def _numpy_dtype(dtype: torch.dtype) -> str:
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype.name
    except TypeError as exc:
        raise ReplayError(f"{dtype} has no numpy twin to store: cast it (bfloat16 -> float32)") from exc


class TensorDictForm:
    """Which TensorDict leaves are which table fields, and back."""

    def __init__(self, names, skip=(), only: bool = False):
        self.names = tuple(names)
        self.keys = {n: nested_key(n) for n in self.names}
        self.skip = frozenset(skip)  # keys read but not stored: the priority key
        self.only = only  # the buffer's keys=: other entries are left out, not refused

    @classmethod
    def of(cls, td: TensorDictBase, skip=(), only=None) -> tuple["TensorDictForm", dict]:
        """The form of ``td``'s items and the fields to declare for them
        (``only``: those field names, each of which ``td`` must have)."""
        fields = {}
        for key in _leaves(td):
            if key in META or key in skip or (only is not None and _stored_name(key) not in only):
                continue
            value = td.get(key)
            if not isinstance(value, torch.Tensor):
                raise ReplayError(f"TensorDict entry {key!r} is a {type(value).__name__}, not a tensor: "
                                  "a table stores tensors; td.exclude(key) before extend")
            fields[field_name(key)] = (_numpy_dtype(value.dtype), tuple(value.shape[td.batch_dims:]))
        missing = [nested_key(n) for n in only or () if n not in fields]
        if missing:
            raise ReplayError(f"the TensorDict lacks {missing}, named in keys=")
        if not fields:
            raise ReplayError("the TensorDict has no tensors to store")
        return cls(fields, skip, only is not None), fields

    def arrays(self, td: TensorDictBase) -> dict:
        """Field -> numpy array of ``td``'s items (CPU, detached)."""
        out = {}
        for name, key in self.keys.items():
            value = td.get(key, None)
            if value is None:
                raise ReplayError(f"the TensorDict lacks {key!r}, which the table stores: every "
                                  f"extend carries the same keys ({sorted(self.keys.values(), key=str)})")
            out[name] = value.detach().cpu().numpy()
        extra = [] if self.only else [k for k in _leaves(td) if k not in META and k not in self.skip
                                      and _stored_name(k) not in self.keys]
        if extra:
            raise ReplayError(f"the TensorDict has {extra}, which the table does not store: "
                              "td.exclude(...) them, or give the buffer keys= (the entries to store; "
                              "others are left out)")
        return out

    def tensordict(self, data: dict, n: int, device) -> TensorDict:
        td = TensorDict({}, batch_size=[n])
        for name, key in self.keys.items():
            td.set(key, torch.from_numpy(data[name]))
        return td if device is None else td.to(device, non_blocking=True)
