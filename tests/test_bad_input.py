"""Bad input through the API: a field, priority, table definition, size
or sample argument that does not fit is refused with an error that names
it; the refused call stores nothing and the daemon serves on, also when a
client skipped its own checks."""

import ctypes
import os

import numpy as np
import pytest

import shmreplay
from conftest import SMALL_FIELDS
from items import assert_still_serving, good_row, table_stats
from rawclient import commit, reserve
from shmreplay.wire.layout import TableMap

@pytest.fixture
def table(client):
    return client.create_table("t", capacity=100, fields=SMALL_FIELDS)


# ---- fields ----
def test_unknown_and_missing_fields_are_named(table):
    with pytest.raises(shmreplay.FieldError, match=r"unknown field\(s\) \['rewrd'\]"):
        table.insert(obs=np.zeros((4, 8, 8), np.uint8), action=1, rewrd=0.0)
    with pytest.raises(shmreplay.FieldError, match=r"missing field\(s\) \['reward'\]"):
        table.insert_batch({"obs": np.zeros((1, 4, 8, 8), np.uint8), "action": [1]})


def test_wrong_dtype_is_named(table):
    with pytest.raises(shmreplay.FieldError, match="field 'obs': dtype float64 cannot be stored as uint8"):
        table.insert(obs=np.zeros((4, 8, 8)), action=1, reward=0.0)
    with pytest.raises(shmreplay.FieldError, match="field 'action'"):
        table.insert(obs=np.zeros((4, 8, 8), np.uint8), action=1.5, reward=0.0)


def test_wrong_shape_is_named(table):
    with pytest.raises(shmreplay.FieldError, match=r"field 'obs': shape \(4, 8\), expected \(4, 8, 8\)"):
        table.insert(obs=np.zeros((4, 8), np.uint8), action=1, reward=0.0)
    with pytest.raises(shmreplay.FieldError, match=r"field 'obs': shape \(2, 4, 8, 9\)"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 9), np.uint8), "action": [1, 2], "reward": [0.0, 0.0]})
    with pytest.raises(shmreplay.FieldError, match="field 'action' has 3 items, earlier fields have 2"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 8), np.uint8), "action": [1, 2, 3], "reward": [0.0, 0.0]})


class _Pair(ctypes.Structure):  # a buffer numpy reads no array from (PEP 3118 'T{...}')
    _fields_ = [("a", ctypes.c_int), ("b", ctypes.c_char_p)]


def test_values_numpy_cannot_convert_say_what_to_do_and_store_nothing(daemon, table):
    """Ragged lists, object arrays and a buffer whose format numpy cannot
    read: each a FieldError naming the field and what to give instead."""
    ok = good_row()
    with pytest.raises(shmreplay.FieldError, match=r"field 'obs': .*ragged list.*give an array "
                       r"of shape \(4, 8, 8\) \(numpy: ValueError: .*inhomogeneous"):
        table.insert(**{**ok, "obs": [[[0] * 8] * 8] * 3 + [[[0] * 8] * 7]})
    with pytest.raises(shmreplay.FieldError, match=r"field 'action': .*ragged list.*shape \(n\)"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 8), np.uint8), "action": [[1], [2, 3]],
                            "reward": [0.0, 0.0]})
    with pytest.raises(shmreplay.FieldError, match=r"field 'reward': dtype object cannot be stored "
                       r"as float32: an object array .*give numbers, e\.g\. np\.asarray"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 8), np.uint8), "action": [1, 2],
                            "reward": np.array([0.5, None], dtype=object)})
    with pytest.raises(shmreplay.FieldError, match=r"field 'obs': numpy cannot convert a "
                       r"memoryview: give a numpy array .*of shape \(4, 8, 8\)"):
        table.insert(**{**ok, "obs": memoryview((_Pair * 4)())})
    with pytest.raises(shmreplay.FieldError, match=r"dtype float64 cannot be stored as int64: "
                       r"numpy's same_kind rule .*value\.astype\('int64'\)"):
        table.insert(**{**ok, "action": 1.5})
    table.flush()
    assert len(table) == 0
    assert_still_serving(daemon, 0)


def test_tensors_numpy_cannot_take_say_what_to_do(daemon, table):
    """A tensor that requires grad, or one not on the CPU (a GPU's; torch's
    'meta' device stands in here, CI has no GPU): refused before anything
    is stored, with the call that fixes it.  Detached CPU tensors go in."""
    torch = pytest.importorskip("torch")
    ok = good_row()
    with pytest.raises(shmreplay.FieldError, match=r"field 'reward': a torch\.Tensor that "
                       r"requires grad cannot be stored: \.detach\(\) it first"):
        table.insert(**{**ok, "reward": torch.tensor(0.5, requires_grad=True)})
    with pytest.raises(shmreplay.FieldError, match=r"field 'obs': a torch\.Tensor on meta, not "
                       r"on the CPU, cannot be stored: \.cpu\(\) it first"):
        table.insert(**{**ok, "obs": torch.zeros((4, 8, 8), dtype=torch.uint8, device="meta")})
    with pytest.raises(shmreplay.FieldError, match=r"field 'reward': a list holding a tensor that "
                       r"requires grad cannot be stored: \.detach\(\) each tensor first"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 8), np.uint8), "action": [1, 2],
                            "reward": [torch.tensor(0.5, requires_grad=True)] * 2})
    table.insert(obs=torch.ones((4, 8, 8), dtype=torch.uint8), action=torch.tensor(3),
                 reward=torch.tensor(0.5))
    b = table.sample(1)
    with pytest.raises(shmreplay.PriorityError, match=r"priorities are not numbers: a torch\."
                       r"Tensor that requires grad .*\.detach\(\) it first"):
        table.update_priorities(b.keys, torch.ones(1, requires_grad=True))
    table.flush()
    assert len(table) == 1 and b.data["obs"].min() == 1 and b.data["action"][0] == 3
    assert_still_serving(daemon, 1)


def test_rejected_inserts_store_nothing(daemon, table):
    with pytest.raises(shmreplay.FieldError):
        table.insert(obs=np.zeros(3), action=1, reward=0.0)
    table.flush()
    assert len(table) == 0
    assert_still_serving(daemon, 0)


# ---- priorities ----
@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_bad_priorities_are_rejected_everywhere(daemon, table, bad):
    with pytest.raises(shmreplay.PriorityError, match=r"priority\[0\] = .* not a finite number >= 0"):
        table.insert(priority=bad, **good_row())
    with pytest.raises(shmreplay.PriorityError, match=r"priority\[1\]"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 8), np.uint8), "action": [1, 2],
                            "reward": [0.0, 0.0]}, priorities=[1.0, bad])
    table.insert(**good_row())
    b = table.sample(1)
    with pytest.raises(shmreplay.PriorityError):
        table.update_priorities(b.keys, [bad])
    table.flush()
    assert len(table) == 1
    assert_still_serving(daemon, 1)


def test_priority_count_must_match(table):
    with pytest.raises(shmreplay.PriorityError, match=r"expected 2 priorities, got shape \(3,\)"):
        table.insert_batch({"obs": np.zeros((2, 4, 8, 8), np.uint8), "action": [1, 2],
                            "reward": [0.0, 0.0]}, priorities=[1.0, 1.0, 1.0])


def test_priority_whose_power_overflows_the_tree_is_rejected(client):
    t = client.create_table("huge", capacity=10, fields=SMALL_FIELDS, alpha=2.0)
    with pytest.raises(shmreplay.PriorityError, match="exceeds the sum tree's limit"):
        t.insert(priority=1e200, **good_row())


def test_daemon_rejects_bad_priorities_that_bypass_the_client(daemon, table):
    """A client that skips validation still cannot poison the tree."""
    c = table.client
    rid, _, slots = reserve(table, 1)
    commit(table, rid, 1, prios=np.array([np.nan]))
    with pytest.raises(shmreplay.PriorityError, match="not a finite number"):
        table.flush()
    assert len(table) == 0
    assert table_stats(c, "t")["reserved"] == 0, "the failed commit's slot was freed"
    assert_still_serving(daemon, 0)


# ---- tables ----
def test_unknown_table_is_named(client):
    with pytest.raises(shmreplay.UnknownTable, match="no table named 'nope'"):
        client.table("nope")


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="bad name"), "invalid table name"),
    (dict(capacity=0), "capacity 0 outside"),
    (dict(fields={"o": ("object", ())}), "not a plain numeric"),
    (dict(fields={"o": ("nosuchtype", ())}), "unknown dtype"),
    (dict(fields={"o": ("uint8", (0, 3))}), "positive ints"),
    (dict(fields={"1o": ("uint8", ())}), "invalid field name"),
    (dict(fields={}), "at least one field"),
    (dict(sampler="heap"), "sampler 'heap' is not one of"),
    (dict(samples_per_insert=8.0, error_buffer=2.0), "narrower than"),
    (dict(alpha=-1), "alpha must be finite"),
])
def test_bad_table_definitions_are_named(client, kwargs, match):
    args = dict(name="ok", capacity=10, fields=SMALL_FIELDS)
    args.update(kwargs)
    with pytest.raises(shmreplay.SchemaError, match=match):
        client.create_table(**args)


def test_too_large_table_fails_at_create_with_shm_full(daemon, client):
    with pytest.raises(shmreplay.ShmFull, match="/dev/shm has .* MiB free"):
        client.create_table("giant", capacity=2**32 - 1, fields={"x": ("uint8", (4096,))})
    assert not [n for n in os.listdir("/dev/shm") if "giant" in n]
    client.create_table("t", capacity=10, fields=SMALL_FIELDS)
    assert_still_serving(daemon)


@pytest.mark.parametrize("capacity, fields", [
    (10, {"a": ("int64", ()), "big": ("uint8", (2**62,))}),     # was: "internal error" from the daemon
    (10, {"a": ("int64", ()), "big": ("float32", (2**70,))}),   # was: OverflowError in the client
    (2**32 - 1, {"a": ("int64", ()), "big": ("float64", (2**20,))}),  # 2**55 bytes of rows
])
def test_sizes_no_segment_could_hold_are_schema_errors(daemon, client, capacity, fields):
    with pytest.raises(shmreplay.SchemaError, match=r"table 'huge': field 'big' .* at most 2\*\*47"):
        client.create_table("huge", capacity=capacity, fields=fields)
    assert "huge" not in client.list_tables()


def test_the_daemon_refuses_sizes_no_segment_could_hold(daemon, client):
    """A definition that skips the client's checks gets the same answer."""
    spec = {"name": "huge", "capacity": 10, "fields": [["big", "|u1", [2**62]]]}
    with pytest.raises(shmreplay.SchemaError, match="field 'big'"):
        client._session.request("create_table", spec=spec, exist_ok=False)
    client.create_table("t", capacity=10, fields=SMALL_FIELDS)
    assert_still_serving(daemon)


def test_a_truncated_table_segment_is_a_layout_error(start_daemon):
    d = start_daemon(tables=[{"name": "t", "capacity": 100, "fields": SMALL_FIELDS}])
    with d.connect() as c:
        spec = c.table("t").spec
    d.crash()
    path = "/dev/shm" + d.segment("t")
    size = os.path.getsize(path)
    os.truncate(path, 0)
    with pytest.raises(shmreplay.LayoutError, match=f"is 0 bytes, expected {size}"):
        TableMap.attach(path[len("/dev/shm"):], spec)  # as a client's handle attaches it
    assert "is 0 bytes" in d.start_set_aside("t")["reason"]  # the next daemon sets it aside
    os.unlink(path)
    os.unlink(path.replace(".t.t", ".r.t"))  # its rows segment
    d.start()  # the table starts empty, as the config says


# ---- sample arguments ----
def test_bad_sample_arguments(table):
    table.insert(**good_row())
    with pytest.raises(shmreplay.ReplayError, match="batch_size 0 outside"):
        table.sample(0)
    with pytest.raises(shmreplay.ReplayError, match="beta must be finite"):
        table.sample(1, beta=float("nan"))
