"""Reverb (dm-reverb) under the peers venv's python (peerenv.py): a
``reverb.Server`` in its own process (nice -5, like shmreplay's daemon) with
one table, ``Prioritized(0.6)`` sampler, ``Fifo`` remover, ``MinSize(1)``
limiter, and this process as its gRPC client.

    insert      a ``Client.writer(max_sequence_length=1)`` kept open: per item
                ``append`` then ``create_item`` (one step per item, chunks of one
                step); about twice the items/s of a ``TrajectoryWriter`` here
    sample      ``reverb.TrajectoryDataset`` (the sampling path Reverb documents
                for training; 2 batches of samples in flight) batched by 256,
                importance weights from each sample's probability and table size
    update      ``Client.mutate_priorities`` with the batch's keys
    mp          spawned actor processes, each its own client and writer
"""

from __future__ import annotations

import multiprocessing as mp

import numpy as np

from .peers import BETA, DAEMON_NICE, actor_loop, new_priorities, nice, run_mp
from .workloads import Workload

TABLE = "bench"


def _serve(capacity: int, port_out, stop) -> None:
    import reverb
    nice(DAEMON_NICE)
    server = reverb.Server([reverb.Table(
        TABLE, sampler=reverb.selectors.Prioritized(0.6), remover=reverb.selectors.Fifo(),
        max_size=capacity, rate_limiter=reverb.rate_limiters.MinSize(1))])
    port_out.put(server.port)
    stop.wait()
    server.stop()


class ReverbPeer:
    name = "reverb"

    def open(self, w: Workload) -> None:
        import reverb
        self.w = w
        self.rng = np.random.default_rng(1)
        self.names = sorted(w.fields)  # Reverb flattens a dict by sorted key
        ctx = mp.get_context("spawn")
        port, self.stop = ctx.Queue(), ctx.Event()
        self.server = ctx.Process(target=_serve, args=(w.capacity, port, self.stop), daemon=True)
        self.server.start()
        self.address = f"localhost:{port.get(timeout=300)}"
        self.client = reverb.Client(self.address)
        self.writer = self.client.writer(max_sequence_length=1)
        self.it = None

    def insert(self, rows: dict, n: int) -> None:
        write(self.writer, [rows[k] for k in self.names], n)

    def settle(self) -> None:
        self.writer.flush()

    def size(self) -> int:
        return int(self.client.server_info()[TABLE].current_size)

    def _batches(self):
        import reverb
        import tensorflow as tf
        w = self.w
        ds = reverb.TrajectoryDataset(
            self.address, TABLE, max_in_flight_samples_per_worker=2 * w.batch,
            dtypes=tuple(tf.as_dtype(np.dtype(w.fields[k][0])) for k in self.names),
            shapes=tuple(tf.TensorShape((1, *w.fields[k][1])) for k in self.names))
        return ds.batch(w.batch).as_numpy_iterator()

    def sample_update(self, beta: float = BETA) -> dict:
        if self.it is None:
            self.it = self._batches()
        info, data = next(self.it)
        weights = (info.table_size.astype(np.float64) * info.probability) ** -beta
        weights /= weights.max()
        self.client.mutate_priorities(TABLE, updates=dict(zip(
            info.key.tolist(), new_priorities(self.w.batch, self.rng).tolist())))
        out = {k: v[:, 0] for k, v in zip(self.names, data)}  # one step per item
        out["weights"] = weights
        return out

    def close(self) -> None:
        self.it = None
        try:
            self.writer.close()
        finally:
            self.stop.set()
            self.server.join(60)
            if self.server.is_alive():
                self.server.kill()

    def mp_run(self, actors: int, chunk: int, seconds: float) -> dict:
        ctx = mp.get_context("spawn")
        start, out = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=_actor, args=(self.address, self.w.key, chunk, seconds, a, start, out))
                 for a in range(actors)]
        self.it = self._batches()  # built before the clock starts; it waits for items
        return run_mp(procs, start, out, seconds, self.sample_update, self.size)


def write(writer, cols: list, n: int) -> None:
    """n items, one step each, at priority 1.0."""
    for i in range(n):
        writer.append([c[i] for c in cols])
        writer.create_item(TABLE, 1, 1.0)


def _actor(address, wkey, chunk, seconds, seed, start, out):
    import reverb
    from .workloads import WORKLOADS
    w = WORKLOADS[wkey]
    rows = w.rows(chunk, seed)
    cols = [rows[k] for k in sorted(w.fields)]
    writer = reverb.Client(address).writer(max_sequence_length=1)
    actor_loop(lambda _: write(writer, cols, chunk), wkey, chunk, seconds, seed, start, out)
    writer.close()
