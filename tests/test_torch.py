"""shmreplay.torch with real CPU torch: rows gathered straight into tensors,
the iterate buffer contract checked, a DataLoader over a table, parameters
through a ParameterBoard."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import shmreplay  # noqa: E402
import shmreplay.torch as srt  # noqa: E402

FIELDS = {"obs": ("uint8", (3, 5)), "action": ("int64", ()), "reward": ("float32", ()),
          "done": ("bool", ())}


def fill(t, n=200):
    ids = np.arange(n)
    t.insert_batch({"obs": (ids[:, None, None] % 251 * np.ones((1, 3, 5))).astype(np.uint8),
                    "action": ids, "reward": ids.astype(np.float32), "done": ids % 2 == 0})
    t.flush()


def check_rows(data, keys):
    """Every row is the item its key names (action == item id; the table
    is large enough that no slot was reused)."""
    slots = (np.asarray(keys) & 0xFFFFFFFF).astype(np.int64)
    ids = data["action"].numpy()
    assert (ids == slots).all()
    assert (data["reward"].numpy() == ids).all()
    assert (data["obs"].numpy() == (ids % 251)[:, None, None]).all()
    assert (data["done"].numpy() == (ids % 2 == 0)).all()


def test_sample_gathers_straight_into_the_callers_tensors(client):
    t = client.create_table("r", 1000, FIELDS)
    fill(t)
    obs = torch.zeros((32, 3, 5), dtype=torch.uint8)
    out = srt.tensor_batch(t, 32, tensors={"obs": obs})
    ptrs = {k: v.data_ptr() for k, v in out.data.items()}
    for _ in range(3):
        b = srt.sample(t, 32, beta=0.5, out=out)
        assert b is out and {k: v.data_ptr() for k, v in b.data.items()} == ptrs  # no new buffers
        assert b.data["obs"] is obs
        check_rows(b.data, b.keys)
        assert b.weights.dtype == torch.float32 and b.keys.dtype == np.uint64
        assert torch.all((b.weights > 0) & (b.weights <= 1))
    t.update_priorities(b.keys, np.ones(32))          # keys as the learner got them
    d = b.to("cpu")
    check_rows(d.data, d.keys)


def test_tensor_batch_refuses_tensors_it_cannot_gather_into(client):
    t = client.create_table("r", 1000, FIELDS)
    with pytest.raises(shmreplay.ReplayError, match=r"field 'obs' is torch.float32\[32, 3, 5\].*give a contiguous CPU torch.uint8"):
        srt.tensor_batch(t, 32, tensors={"obs": torch.zeros((32, 3, 5))})
    with pytest.raises(shmreplay.ReplayError, match="not contiguous"):
        srt.tensor_batch(t, 32, tensors={"obs": torch.zeros((5, 3, 32), dtype=torch.uint8).transpose(0, 2)})
    with pytest.raises(shmreplay.ReplayError, match=r"\['nope'\]: the table has no such field"):
        srt.tensor_batch(t, 32, tensors={"nope": torch.zeros(1)})
    if not torch.cuda.is_available():
        with pytest.raises(shmreplay.ReplayError, match="pin_memory=True needs CUDA"):
            srt.tensor_batch(t, 32, pin_memory=True)


def test_as_tensors_shares_the_batchs_memory(client):
    t = client.create_table("r", 1000, FIELDS)
    fill(t)
    b = t.sample(16)
    got = srt.as_tensors(b)
    assert got["data"]["obs"].data_ptr() == b.data["obs"].ctypes.data
    assert got["weights"].dtype == torch.float32
    check_rows(got["data"], got["keys"])


def test_iterate_yields_tensor_batches_and_checks_the_reuse_contract(client):
    t = client.create_table("r", 1000, FIELDS)
    fill(t)
    with srt.iterate(t, 16, prefetch=2, check_reuse=True) as batches:
        for _, b in zip(range(10), batches):
            check_rows(b.data, b.keys)
            x = b.data["reward"] * 2        # a new tensor: nothing of the batch is kept
    kept = []
    with pytest.raises(shmreplay.ReplayError, match=r"still referenced \(data\['obs'\]\).*valid until the next"):
        with srt.iterate(t, 16, prefetch=2, check_reuse=True) as batches:
            for _, b in zip(range(10), batches):
                kept.append(b.data["obs"])   # kept past its step: the check says so
    assert len(kept) == 2
    del x


def test_a_dataloader_over_a_table_yields_fresh_batches(client):
    t = client.create_table("r", 1000, FIELDS)
    fill(t)
    ds = srt.ReplayDataset(client, "r", batch_size=8, batches=6)
    items = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0))
    assert len(items) == 6
    assert len({it["obs"].data_ptr() for it in items}) == 6   # nothing reused
    for it in items:
        check_rows(it, it["keys"])
        assert it["weights"].dtype == torch.float32
    t.update_priorities(items[0]["keys"], np.full(8, 2.0))
    two = list(torch.utils.data.DataLoader(srt.ReplayDataset(client, "r", 8, batches=5),
                                           batch_size=None, num_workers=2,
                                           multiprocessing_context="fork"))
    assert len(two) == 5
    for it in two:
        check_rows(it, it["keys"])


def test_module_parameters_through_a_board(client):
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    dst = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    state = srt.numpy_state(src)
    board = shmreplay.ParameterBoard.create(client, "policy", like=state)
    board.publish(state, flush=True)
    reader = shmreplay.ParameterBoard.attach(client, "policy", like=srt.numpy_state(dst))
    v, arrays = reader.latest()
    srt.load_state(dst, arrays)
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert torch.equal(a, b), k
