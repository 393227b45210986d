"""``FrameTable``: a client's handle on a frame table (docs/frames.md).

It is a ``table.Table`` (sampling, iterating, priorities, probes: the
gather rebuilds stacks, ``gather.take_rows``) whose inserts store frames
once.  ``insert`` and ``insert_batch`` take full stacks, as for a table of
rows; each item's slot fields go into a slot of the handle's own lease,
its stacks through the handle's own ``framestore.FrameStore`` (frames
stored only where its window has no frame of the same bytes), and its
commit is an FCOMMIT with the references.  What a plain insert costs:
a checksum of every frame of every stack and a comparison for each found,
one frame copy for each frame stored (one a transition for a stream of
``obs``/``next_obs`` stacks), and a commit record per item.  Writers that
keep items open (``NStepWriter``) make a store of their own
(``frame_store``).  The client's flush hands back slots, not frame leases:
a store's window finds its stream's next frames in them.

What it owns beside its ``Table``'s: the stores of its writers (weakly:
a store goes with its writer) and its own, bound to the table as mapped
now, again after every reconnect, and voided when the connection goes.
Same threading rule as ``Table``: one thread at a time.
"""

from __future__ import annotations

import weakref

from ..framespec import slot_fields
from .framestore import FrameStore
from .pipe import deadline_of
from .retry import retried, with_retries
from .rows import check_rows
from .table import Table


class FrameTable(Table):
    """A frame table's handle (see the module docstring)."""

    def __init__(self, client, session, desc: dict):
        self._stores: weakref.WeakSet = weakref.WeakSet()
        super().__init__(client, session, desc)
        frames = self.spec.frames
        self._framed = tuple(name for name, _ in frames.decl)
        self._slot_names = tuple(f.name for f in slot_fields(self.spec.fields, frames))
        # a stream of obs/next_obs stacks finds each transition's frames in
        # the last two stacks' worth
        self._own_frames = self.frame_store(2 * max(frames.depth(b) for b in frames.bases) + 2)

    def frame_store(self, window: int, timeout: float | None = None) -> FrameStore:
        """A store of its own for a writer (``FrameStore``): ``window``
        frames remembered for references again; ``timeout`` bounds a wait
        for free frames (None: the client's)."""
        store = FrameStore(self.spec, self._session, window, timeout)
        self._bind_store(store)
        self._stores.add(store)
        return store

    # ---- the table as mapped now, for its stores too ----
    def rebind(self, desc: dict) -> None:
        super().rebind(desc)
        for store in list(self._stores):
            self._bind_store(store)

    def _bind_store(self, store: FrameStore) -> None:
        store.bind(self.id, self.mapped.rings, self.mapped.words, self.mapped.words.epoch)

    def retire(self) -> None:
        super().retire()
        for store in list(self._stores):
            self._bind_store(store)

    def forget_connection(self) -> bool:
        lost = super().forget_connection()
        for store in list(self._stores):
            store.void()
        return lost

    # ---- writing ----
    @retried
    def insert(self, priority=None, timeout: float | None = None, **fields) -> None:
        """Insert one item, its stacks full (as for a table of rows);
        ``priority=None`` means the max priority seen so far."""
        arrays, _ = check_rows(self.spec, self._form.names, fields, batch=False)
        if priority is not None:
            self._priorities([priority], 1, "insert")
        self._begin()
        self._put(dict(zip(self._form.order, arrays)), priority, deadline_of(timeout))
        if self._draws.counting:
            self._draws.step()

    @retried
    def insert_batch(self, data: dict, priorities=None, timeout: float | None = None) -> None:
        """Insert n items, one after another (each stores the frames its
        stacks need); if ``timeout`` runs out part-way, the items before the
        error are in."""
        arrays, n = check_rows(self.spec, self._form.names, data, batch=True)
        prios = None if priorities is None else self._priorities(priorities, n, "insert_batch")
        if n == 0:
            return
        self._begin()
        deadline = deadline_of(timeout)
        names = self._form.order
        for i in range(n):
            self._put({k: a[i] for k, a in zip(names, arrays)},
                      None if prios is None else float(prios[i]), deadline)
        if self._draws.counting:
            self._draws.step()

    def _put(self, values: dict, priority, deadline: float | None) -> None:
        """One item: its slot fields into a slot of the own lease, its
        stacks' frames through the own store, committed with the references."""
        lease, store = self._lease, self._own_frames
        lease.check()
        rid, pos, slot = lease.take(deadline)
        try:
            views = lease.views
            for name in self._slot_names:
                views[name][slot] = values[name]
            refs = store.item_refs({name: values[name] for name in self._framed}, deadline)
        except BaseException:
            lease.release([(rid, pos, slot)])  # the item is not committed: its slot goes back
            raise
        lease.commit(rid, pos, priority, refs)
        store.settle()


ReconnectingFrameTable = with_retries(FrameTable)
