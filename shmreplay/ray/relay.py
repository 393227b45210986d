"""A ``ParameterBoard`` read on the replay node, for remote actors.

Who calls it: ``start_parameter_relay`` a driver or actor on the replay
node; ``latest`` any actor, concurrently (Ray runs the calls one at a time).
"""

from __future__ import annotations

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

class ParameterRelay:
    """A ``ParameterBoard`` read on the replay node for remote actors."""

    def __init__(self, socket_path: str, board: str, like: dict):
        import shmreplay
        self.client = shmreplay.connect(socket_path, reconnect=True)
        self.board = shmreplay.ParameterBoard.attach(self.client, board, like=like)
        self.newest = None  # (version, {name: array}): the newest read, for every caller

    def latest(self, newer_than: int | None = None):
        # One board reads for every caller, and its ``newer_than`` shortcut
        # (None when nothing was published since *its* last read) would
        # answer None to an actor behind the one that read last: the board
        # reads whatever was published since its last read (newer_than=-1:
        # a learner that restarts from version 1 is relayed too), and each
        # caller is answered from the newest read here.
        got = self.board.latest(newer_than=-1)
        if got is not None:
            version, arrays = got
            self.newest = version, {k: np.array(v) for k, v in arrays.items()}  # the board reuses its buffer
        if self.newest is None or (newer_than is not None and self.newest[0] <= newer_than):
            return None
        return self.newest


def start_parameter_relay(socket_path: str, board: str, like: dict, node_id: str | None = None):
    """A Ray actor on the replay node that reads ``board`` (a
    ``ParameterBoard``) for actors that cannot map it: ``ray.get(
    relay.latest.remote(newer_than=v))`` is None or ``(version, {name:
    array})``, the arrays travelling through the object store."""
    node = node_id or ray.get_runtime_context().get_node_id()
    return ray.remote(ParameterRelay).options(
        num_cpus=0, max_restarts=-1,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False)).remote(socket_path, board, like)
