"""Issue 33, item 6: ``shmreplay.torch``'s pinned-memory path
(``pin_memory=True``; docs/guide.md, "Torch": "rows gathered
straight into (pinned, with pin_memory=True) tensors: one host copy";
shmreplay/torch.py's module docstring).

Without CUDA, asking for pinned memory is a clear ReplayError from every
entry point, before anything is drawn or connected; checked in an
interpreter whose torch sees no GPU (CUDA_VISIBLE_DEVICES=""), so it runs
on any machine.  With CUDA, batches land in pinned tensors and copy to the
device row for row; that test is skipped elsewhere with a reason starting
"needs CUDA:".  And a batch moved with ``to`` is new tensors, which the
next batch does not overwrite (checked on the CPU, which any machine has)."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import shmreplay.torch as srt  # noqa: E402
from test_torch import FIELDS, check_rows, fill  # noqa: E402
from waiting import HANG_S  # noqa: E402

NO_GPU = r"""
import sys
import numpy as np
import torch
import shmreplay
import shmreplay.torch as srt
assert not torch.cuda.is_available()
c = shmreplay.connect(sys.argv[1], timeout=60)
t = c.create_table("r", 100, {"x": ("float32", (2,))})
t.insert_batch({"x": np.ones((10, 2))})
c.flush()
for name, call in [("tensor_batch", lambda: srt.tensor_batch(t, 4, pin_memory=True)),
                   ("sample", lambda: srt.sample(t, 4, pin_memory=True)),
                   ("iterate", lambda: srt.iterate(t, 4, pin_memory=True))]:
    try:
        call()
    except shmreplay.ReplayError as exc:
        print(f"{name}: {exc}")
    else:
        print(f"{name}: pinned memory without CUDA")
st = c.stats()
print(f"clients {st['clients']}, sample calls {st['tables']['r']['sample_calls']}")
c.close()
"""

NEEDS_CUDA = ("pin_memory=True needs CUDA (pinned host memory is for device copies); "
              "this torch sees no GPU: leave it False")


def test_pin_memory_without_cuda_is_a_clear_error_from_every_entry_point(daemon):
    """tensor_batch, sample and iterate each raise the ReplayError that says
    what to do; nothing was drawn, and iterate's prefetch connection was
    not left open behind the error (the daemon counts one client)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # torch sees no GPU, on any machine
    run = subprocess.run([sys.executable, "-c", NO_GPU, daemon.socket], capture_output=True, text=True,
                         env=env, timeout=300)  # a hang guard
    assert run.returncode == 0, run.stderr[-3000:]
    entries = ("tensor_batch", "sample", "iterate")
    assert run.stdout.splitlines() == [f"{name}: {NEEDS_CUDA}" for name in entries] + [
        "clients 1, sample calls 0"], run.stdout


def test_a_batch_moved_with_to_keeps_its_rows_after_the_refill(client):
    """``TensorBatch.to`` gives "the batch on device (new tensors)": on the
    CPU too, where torch's own ``to`` returns the very tensor the next
    batch refills.  Each of 20 iterate batches moved with ``to("cpu")`` and
    kept still holds the rows its keys name after the loop, while the
    prefetch thread refilled its buffers (3 of them) many times over."""
    t = client.create_table("r", 1000, FIELDS)
    fill(t)
    kept = []
    with srt.iterate(t, 64, prefetch=2, timeout=HANG_S) as batches:
        for _, b in zip(range(20), batches):
            kept.append(b.to("cpu"))
    for d in kept:
        check_rows(d.data, d.keys)
        assert d.weights.dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs CUDA: pinned host memory is for device copies")
def test_pinned_batches_are_pinned_and_copy_to_the_device(client):
    """sample(pin_memory=True) gathers into pinned tensors (weights too),
    and ``to("cuda")`` gives the same rows on the device.  iterate's pinned
    batches, each copied with non_blocking=True while the prefetch thread
    refills the others, arrive on the device with the rows their keys name:
    a batch is not refilled before its copy has finished (torch.py: the
    CUDA event ``ready_for_refill`` waits for)."""
    t = client.create_table("r", 1000, FIELDS)
    fill(t)
    b = srt.sample(t, 32, pin_memory=True)
    assert all(x.is_pinned() for x in b.data.values()) and b.weights.is_pinned()
    check_rows(b.data, b.keys)
    d = b.to("cuda")
    assert all(x.device.type == "cuda" for x in d.data.values()) and d.weights.device.type == "cuda"
    torch.cuda.synchronize()
    for k, x in b.data.items():
        assert torch.equal(d.data[k].cpu(), x), k
    assert torch.equal(d.weights.cpu(), b.weights)
    on_device = []
    with srt.iterate(t, 64, prefetch=2, pin_memory=True, timeout=HANG_S) as batches:
        for _, b in zip(range(20), batches):
            assert all(x.is_pinned() for x in b.data.values()) and b.weights.is_pinned()
            on_device.append(b.to("cuda"))  # asynchronous: the next batches refill other buffers meanwhile
    torch.cuda.synchronize()
    for d in on_device:
        check_rows({k: x.cpu() for k, x in d.data.items()}, d.keys)
