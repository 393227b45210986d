"""Issue 33, item 5: "``import shmreplay`` never imports torch" (docs/guide.md,
"Torch";
shmreplay/torch.py: "imported only when used").

Checked where it matters, in a fresh interpreter that has torch installed
(test_torch.py needs it too): the package's import, and then every client
piece an actor or a learner touches without ``shmreplay.torch`` (connect,
a table's insert/sample/update/iterate, a ParameterBoard, an inference
channel's server and client) each leave "torch" out of ``sys.modules``.
test_cli.py checks the same for numba and the daemon's code."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")  # without it, nothing could import it anyway

PROGRAM = r"""
import sys, threading
import numpy as np

def no_torch(step):  # nor the libraries shmreplay.sb3 and the torchrl plug-in stand on (issue 38)
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "stable_baselines3", "torchrl",
                                                                  "tensordict"))
    assert not loaded, f"{step} imported torch or an RL library ({len(loaded)} modules: {loaded[:5]})"

import shmreplay
no_torch("import shmreplay")
sock, prefix = sys.argv[1], sys.argv[2]
fields = {"obs": ("float32", (4,)), "action": ("int64", ())}
with shmreplay.connect(sock, timeout=60) as c:
    no_torch("shmreplay.connect")
    t = c.create_table("replay", 100, fields)
    t.insert(obs=np.ones(4), action=1)
    t.insert_batch({"obs": np.ones((20, 4)), "action": np.arange(20)})
    c.flush()
    b = t.sample(8)
    t.update_priorities(b.keys, np.ones(8))
    with t.iterate(4) as batches:
        next(iter(batches))
    no_torch("a table's insert, sample, update_priorities and iterate")
    board = shmreplay.ParameterBoard.create(c, "policy", like={"w": np.zeros(3, np.float32)})
    board.publish({"w": np.ones(3, np.float32)}, flush=True)
    reader = shmreplay.ParameterBoard.attach(c, "policy", like={"w": np.zeros(3, np.float32)})
    version, arrays = reader.latest()
    assert (arrays["w"] == 1).all()
    no_torch("a ParameterBoard")
with shmreplay.InferenceServer({"obs": ("float32", (4,))}, {"action": ("int64", ())}, slots=1,
                               prefix=prefix) as srv:
    def answer():
        got = srv.receive(timeout=60)
        srv.respond(got.slots, action=np.full(len(got), 7))
    th = threading.Thread(target=answer)
    th.start()
    with shmreplay.InferenceClient(srv.address, timeout=60) as env:
        assert int(env.call(obs=np.zeros(4))["action"]) == 7
    th.join(60)
    no_torch("an InferenceServer and InferenceClient")
print("no torch")
"""


def test_the_client_never_imports_torch(daemon):
    """A fresh interpreter against a real daemon: torch stays unloaded
    through every step (the message names the first that loaded it)."""
    run = subprocess.run([sys.executable, "-c", PROGRAM, daemon.socket, f"shmreplay.test{os.getpid()}.weight"],
                         capture_output=True, text=True, timeout=300)  # a hang guard
    assert run.returncode == 0 and run.stdout.strip() == "no torch", run.stderr[-3000:]
