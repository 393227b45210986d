"""``BufferTable``: a TorchRL buffer's side of its table: the daemon (a
private ``shmreplay.Server`` or ``socket=``), this process's connection,
the table (made at the first write, or found), which TensorDict entries
it stores, and who may drop it.  The buffer (``buffers.py``) keeps what
TorchRL's interface adds: batch sizes, beta, prefetching, the keys it
sampled.

Pickled (into a collector's worker) it is the socket, the table's name and
definition; the worker connects anew and owns nothing.  A forked copy
keeps its parent's objects, and the client opens its own connection at
its first call; it owns nothing either (``owns``).  Who calls: the
buffer's thread.
"""

from __future__ import annotations

import os
from multiprocessing.util import Finalize, register_after_fork

from tensordict import TensorDictBase

from ..client import Server, connect
from ..errors import ReplayError, TableExists
from .tdform import TensorDictForm


def _close_quietly(client) -> None:
    try:
        client.close()  # flushes this process's inserts
    except ReplayError:
        pass  # at exit, the daemon may be gone already (a private one stopped first)


def _flush_at_exit(side: "BufferTable") -> None:
    Finalize(side, _close_quietly, args=(side.client,), exitpriority=10)


class BufferTable:
    def __init__(self, spec: dict, keys, skip, kind: str, socket: str | None, server_opts: dict):
        """``spec``: ``create_table``'s arguments but the fields; ``keys``:
        the field names to store (None: the first write's); ``skip``: keys
        read but never stored (the priority key); ``kind``: the buffer's
        name, for errors."""
        self.spec, self.keys, self.skip, self.kind = spec, keys, tuple(skip), kind
        self._owner_pid = os.getpid()  # a forked worker's copy does not own the table
        self._server = Server(**server_opts) if socket is None else None
        self._owned = socket is None
        try:
            self._attach(socket or self._server.socket)
        except BaseException:
            if self._server is not None:
                self._server.stop(check=False)  # no daemon left behind a buffer that never was
            raise

    def _attach(self, socket: str) -> None:
        self.socket = socket
        self._client = connect(socket, timeout=30.0)
        self._table = self.form = None
        self._unflushed = False
        # a collector's worker process ends without close(): flush its last
        # extend on the way out (multiprocessing runs these finalizers at a
        # worker's exit, and at the program's; a worker it forks starts
        # with none, and registers its own after the fork)
        _flush_at_exit(self)
        register_after_fork(self, _flush_at_exit)

    @property
    def client(self):
        return self._client

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def owns(self) -> bool:
        """This process made the table's daemon (and may drop the table)."""
        return self._owned and self._owner_pid == os.getpid()

    # ---- the table, made at the first write or found ----
    def _bind(self, table) -> None:
        alpha = self.spec.get("alpha")
        if table.spec.sampler != self.spec["sampler"] or (alpha is not None and table.spec.alpha != alpha):
            raise ReplayError(f"table {table.name!r} samples {table.spec.sampler} (alpha {table.spec.alpha}); "
                              f"this buffer is {self.kind}" + (f" with alpha {alpha}" if alpha is not None else "")
                              + ": make it as the table is, or use another table=")
        self._table = table
        self.form = TensorDictForm([f.name for f in table.spec.fields], self.skip, self.keys is not None)

    def writable(self, td: TensorDictBase):
        if self._table is None:
            _, fields = TensorDictForm.of(td, self.skip, self.keys)
            try:
                table = self._client.create_table(fields=fields, exist_ok=True, **self.spec)
            except TableExists as exc:
                raise ReplayError(f"{exc}: another writer's first TensorDict had other entries, or the "
                                  "table was made otherwise; give every buffer the same keys=") from exc
            self._bind(table)
        return self._table

    def readable(self):
        """The table, or None while nobody has written to it."""
        if self._table is None:
            try:
                table = self._client.table(self.name)
            except KeyError:
                return None
            self._bind(table)
        return self._table

    def insert(self, td: TensorDictBase, priorities, timeout: float | None) -> None:
        self.writable(td).insert_batch(self.form.arrays(td), priorities=priorities, timeout=timeout)
        self._unflushed = True

    def length(self) -> int:
        table = self.readable()
        if table is None:
            return 0
        if self._unflushed:  # count this process's commits, as TorchRL's len does
            table.flush()
            self._unflushed = False
        return len(table)

    @property
    def capacity(self) -> int:
        """The table's (the buffer's storage size until the table exists)."""
        return self.spec["capacity"] if self._table is None else self._table.capacity

    def drop(self) -> None:
        if not self.owns:
            raise ReplayError(f"empty() would drop table {self.name!r}, which other processes share; "
                              "drop it with `shmreplay drop` if you mean to")
        if self.readable() is not None:
            self._client.drop_table(self.name)
        self._table = self.form = None

    def close(self) -> None:
        """Close the connection, and stop the private daemon if this made one."""
        self._client.close()
        if self._server is not None and self.owns:
            self._server.stop(check=False)
            self._server = None

    def __getstate__(self):
        state = {k: v for k, v in self.__dict__.items() if k not in ("_client", "_table", "form", "_server")}
        return {**state, "_owned": False, "_owner_pid": None}

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._server = None
        self._attach(state["socket"])
