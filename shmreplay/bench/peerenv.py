"""Where each replay library of the suite lives and how it runs.

shmreplay and cpprb run in this interpreter.  TorchRL, Reverb and Flashbax
pin numpy, torch, TensorFlow or JAX versions the project does not use, so
they live in their own virtual environments (see docs/performance.md,
"Peers") and each of their cells runs under that environment's python:

    SHMREPLAY_PEERS_PYTHON     torchrl and reverb  (default /tmp/peers-venv/bin/python)
    SHMREPLAY_FLASHBAX_PYTHON  flashbax            (default /tmp/flashbax-venv/bin/python
                                                    when it exists, else the peers python)

``probe(name)`` tells whether a library works there, with its versions, or
why it cannot run; nothing here raises for a missing peer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

DEFAULT_PEERS_PYTHON = "/tmp/peers-venv/bin/python"
DEFAULT_FLASHBAX_PYTHON = "/tmp/flashbax-venv/bin/python"
# the bootstrap a venv's python runs: it imports shmreplay.bench without
# shmreplay's own dependencies (see peerproc.py)
PEERPROC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "peerproc.py")


@dataclass(frozen=True)
class Spec:
    name: str
    env: str | None         # variable naming its python; None: this interpreter
    dists: tuple            # distributions whose versions the report records
    probe: str              # python code that fails unless the buffer can be built
    layout: str             # how its cells run (process layout), for the report
    no_multiprocess: str | None = None  # why it has no multiprocess cell


_VERSIONS = ("import json\nfrom importlib import metadata\n"
             "print(json.dumps({d: metadata.version(d) for d in %r}))\n")

SPECS = {s.name: s for s in [
    Spec("shmreplay", None, ("shmreplay",), "import shmreplay",
         "daemon process (nice -5) + the cell's client process; mp: actor processes attach to the daemon"),
    Spec("cpprb", None, ("cpprb",), "import cpprb; cpprb.PrioritizedReplayBuffer(8, {'a': {}}, alpha=0.6)",
         "PrioritizedReplayBuffer in the cell's process; mp: MPPrioritizedReplayBuffer (SharedMemory "
         "backend) shared with forked actor processes"),
    Spec("torchrl", "SHMREPLAY_PEERS_PYTHON", ("torchrl", "tensordict", "torch"),
         "import torch\nfrom torchrl.data import PrioritizedSampler\nPrioritizedSampler(8, 0.6, 0.4)\n",
         "TensorDictPrioritizedReplayBuffer over LazyTensorStorage in the cell's process (its own "
         "venv); mp: the same buffer with shared=True, sync=False (storage, cursor and write count in "
         "shared memory, passed to spawned actor processes that extend it; the learner's prioritized "
         "sampler catches up from write_count before each sample)"),
    Spec("reverb", "SHMREPLAY_PEERS_PYTHON", ("dm-reverb", "tensorflow-cpu"),
         "import reverb\n"
         "s = reverb.Server([reverb.Table('t', reverb.selectors.Prioritized(0.6), reverb.selectors.Fifo(),"
         " 8, reverb.rate_limiters.MinSize(1))])\ns.stop()\n",
         "reverb.Server process (nice -5) with one Prioritized(0.6)/Fifo/MinSize(1) table; the cell's "
         "process is its gRPC client (Client.writer append + create_item per item, TrajectoryDataset "
         "batches, mutate_priorities); mp: spawned actor processes, each its own client and writer"),
    Spec("flashbax", "SHMREPLAY_FLASHBAX_PYTHON", ("flashbax", "jax", "jaxlib"),
         "import flashbax\nflashbax.make_prioritised_item_buffer(max_length=8, min_length=1, "
         "sample_batch_size=2, add_batches=True)\n",
         "make_prioritised_item_buffer on JAX CPU in the cell's process (its own venv), add, sample "
         "and set_priorities jitted (add and set_priorities donate the state); every call waits for "
         "its result",
         no_multiprocess="no multi-process mode (the buffer state is passed functionally inside "
                         "one process)"),
]}


def python_for(name: str) -> str:
    """The interpreter that runs this library's cells."""
    spec = SPECS[name]
    if spec.env is None:
        return sys.executable
    if spec.env in os.environ:
        return os.environ[spec.env]
    peers = os.environ.get("SHMREPLAY_PEERS_PYTHON", DEFAULT_PEERS_PYTHON)
    if name == "flashbax" and os.path.exists(DEFAULT_FLASHBAX_PYTHON):
        return DEFAULT_FLASHBAX_PYTHON
    return peers


def command(name: str) -> list[str]:
    """argv prefix that runs ``cells.main`` for this library's cells."""
    py = python_for(name)
    if SPECS[name].env is None:
        return [py, "-m", "shmreplay.bench.cells"]
    return [py, PEERPROC]


def probe(name: str, timeout: float = 180) -> dict:
    """{"versions": {...}, "python": path} when the library's prioritized
    buffer can be built with its interpreter, else {"missing": reason}."""
    spec = SPECS[name]
    py = python_for(name)
    if spec.env is not None and not os.path.exists(py):
        return {"missing": f"no python at {py} (set {spec.env}; install: docs/performance.md, Peers)"}
    code = spec.probe + "\n" + _VERSIONS % (spec.dists,)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    try:
        out = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"missing": f"probe timed out after {timeout:.0f} s under {py}"}
    except OSError as e:
        return {"missing": f"cannot run {py}: {e}"}
    if out.returncode != 0:
        lines = [line for line in out.stderr.strip().splitlines() if line.strip()] or [f"exit {out.returncode}"]
        return {"missing": f"cannot build its prioritized buffer under {py}: {lines[-1].strip()[:300]}"}
    try:
        versions = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        versions = {}
    return {"versions": versions, "python": py}
