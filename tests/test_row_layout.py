"""Row layouts (issue 36, item 2): small rows stored slot by slot (all
fields of a slot together) and gathered by one kernel; large rows field by
field.  The choice follows the row size, a schema option forces either,
and every path that reads or writes rows (inserts, samples, checkpoints of
/dev/shm and file-backed tables, restores into the other layout) keeps
every byte."""

import numpy as np
import pytest

import shmreplay
from shmreplay.client.rowcopy import stale_keys, take_slot_rows
from shmreplay.schema import make_spec, spec_from_wire
from shmreplay.wire.layout import TableLayout
from shmreplay.wire.names import SHM_DIR

from conftest import write_config

# sac-mujoco's transition: 68 + 24 + 4 + 68 + 1 = 165 bytes
SAC = {"obs": ("float32", (17,)), "action": ("float32", (6,)), "reward": ("float32", ()),
       "next_obs": ("float32", (17,)), "done": ("bool", ())}
# with an id to check rows by, and a field that needs padding before it
ROWS = {"done": ("bool", ()), "id": ("int64", ()), "obs": ("float32", (5,)), "flag": ("uint8", (3,))}


def rows(ids):
    """Rows whose every byte follows from the id."""
    ids = np.asarray(ids, np.int64)
    return {"done": ids % 3 == 0, "id": ids,
            "obs": (ids[:, None] * 10 + np.arange(5)[None, :]).astype(np.float32),
            "flag": ((ids[:, None] + np.arange(3)[None, :]) % 251).astype(np.uint8)}


def exact(data) -> bool:
    want = rows(data["id"])
    return all(np.array_equal(data[k], want[k]) for k in want)


def test_auto_stores_small_rows_slot_by_slot_and_large_rows_field_by_field():
    assert make_spec("s", 10, SAC).row_layout == "slot"
    atari = {"obs": ("uint8", (4, 84, 84)), "action": ("int32", ())}
    assert make_spec("a", 10, atari).row_layout == "field"
    assert make_spec("s", 10, SAC, row_layout="field").row_layout == "field"
    assert make_spec("a", 10, atari, row_layout="slot").row_layout == "slot"
    with pytest.raises(shmreplay.SchemaError, match='row_layout must be "auto".*"slot".*"field"'):
        make_spec("s", 10, SAC, row_layout="rows")


def test_a_stored_definition_without_a_layout_is_field_and_a_request_without_one_is_auto():
    """Segments and checkpoints written before row layouts existed name
    none, and hold fields apart; a config or create request that names none
    asks for the default."""
    stored = make_spec("s", 10, SAC, row_layout="field").to_wire()
    assert "row_layout" not in stored  # as such tables' schemas always read
    assert spec_from_wire(stored).row_layout == "field"
    assert spec_from_wire(stored, asked=True).row_layout == "slot"
    assert spec_from_wire(make_spec("s", 10, SAC).to_wire()).row_layout == "slot"


def test_a_slot_layout_puts_each_field_of_a_slot_in_its_row_aligned():
    # worked out by hand: done at 0 (1 byte), id aligned to 8, obs (20 bytes)
    # at 16, flag (3 bytes) at 36; 39 bytes rounded up to 8: 40 a row
    lo = TableLayout(make_spec("s", 100, ROWS, row_layout="slot"))
    assert lo.row_stride == 40
    assert {k: v - 4096 for k, v in lo.field_offs.items()} == {"done": 0, "id": 8, "obs": 16, "flag": 36}
    assert lo.rows_size == 4096 + 4096  # the header page, then 4,000 bytes of rows in one page
    sac = TableLayout(make_spec("s", 1000, SAC))
    assert sac.row_stride == 168  # 165 bytes, float32 fields: rounded up to 4


def test_the_slot_gather_kernel_agrees_with_numpy_bit_for_bit():
    rng = np.random.default_rng(7)
    cap, stride = 500, 40
    src = rng.integers(0, 256, (cap, stride), dtype=np.uint8)
    offs, widths = np.array([0, 8, 16, 36]), np.array([1, 8, 20, 3])
    gens = rng.integers(1, 9, cap).astype(np.uint64)
    slots = rng.integers(0, cap, 256).astype(np.uint64)
    keys = gens[slots] << np.uint64(32) | slots
    rows_idx = np.sort(rng.choice(256, 100, replace=False))
    dsts = [np.zeros((256, w), np.uint8) for w in widths]
    addrs = np.array([d.ctypes.data for d in dsts], np.int64)
    assert take_slot_rows(src, keys, rows_idx, offs, widths, addrs, 256) == 100
    for d, o, w in zip(dsts, offs, widths):
        want = np.zeros((256, w), np.uint8)
        want[rows_idx] = src[slots[rows_idx].astype(np.int64), o:o + w]  # the twin: plain numpy
        assert np.array_equal(d, want)
    # a key past the table, a row past the outputs, a field past the row:
    # refused before anything is copied
    for d in dsts:
        d[:] = 0
    bad = keys.copy()
    bad[rows_idx[3]] = np.uint64(cap)
    assert take_slot_rows(src, bad, rows_idx, offs, widths, addrs, 256) == -1
    assert take_slot_rows(src, keys, rows_idx, offs, widths, addrs, int(rows_idx[-1])) == -1
    assert take_slot_rows(src, keys, rows_idx, offs, widths + np.array([0, 0, 0, 2]), addrs, 256) == -1
    assert not any(d.any() for d in dsts)


def test_the_stamp_kernel_agrees_with_numpy():
    rng = np.random.default_rng(8)
    gens = rng.integers(1, 2**32, 300, dtype=np.uint64).astype(np.uint32)
    slots = rng.integers(0, 300, 256).astype(np.uint64)
    stamps = gens[slots].astype(np.uint64)
    moved = rng.random(256) < 0.2
    stamps[moved] += np.uint64(1)  # drawn before the slot's stamp moved on (wraps too)
    keys = stamps << np.uint64(32) | slots
    keys[5] = np.uint64(300)  # outside the table: stale, never read
    found = np.empty(256, np.int64)
    k = stale_keys(keys, gens, found)
    want = np.flatnonzero((gens[np.minimum(slots, 299).astype(np.int64)].astype(np.uint64) != stamps)
                          | (np.arange(256) == 5))
    assert np.array_equal(found[:k], want)


@pytest.mark.parametrize("layout", ["slot", "field"])
def test_rows_round_trip_in_either_layout_and_lie_where_the_layout_says(start_daemon, layout):
    d = start_daemon()
    with d.connect() as c:
        t = c.create_table("r", capacity=200, fields=ROWS, row_layout=layout)
        t.insert_batch(rows(np.arange(150)))
        for i in range(150, 180):  # single inserts too
            t.insert(**{k: v[0] for k, v in rows([i]).items()})
        c.flush()
        b = t.sample(400)
        assert exact(b.data) and set(b.data["id"].tolist()) == set(range(180))
        out = t.sample(64, out=None)
        again = t.sample(64, out=out)  # into the arrays of a batch handed out before
        assert again.data["obs"] is out.data["obs"] and exact(again.data)
        # the bytes in the rows segment, read from /dev/shm by offsets worked out by hand
        name = c.stats()["tables"]["r"]["rows"]
        with open(SHM_DIR + name, "rb") as f:
            raw = f.read()
        slot = int(b.keys[0] & 0xFFFFFFFF)
        i = int(b.data["id"][0])
        if layout == "slot":
            at = 4096 + slot * 40 + 8
        else:  # done: 200 bytes from 4096, then id on the next page
            at = 8192 + slot * 8
        assert int(np.frombuffer(raw, np.int64, 1, at)[0]) == i


def test_a_checkpoint_of_either_layout_restores_into_the_other(start_daemon, tmp_path):
    """A checkpoint holds fields, whatever the layout: a table restored with
    the config's other layout (the definition is otherwise the same) keeps
    every row and priority."""
    ck = str(tmp_path / "ck")
    d = start_daemon(tables=[{"name": "r", "capacity": 128, "fields": ROWS, "row_layout": "field"}])
    with d.connect() as c:
        t = c.table("r")
        t.insert_batch(rows(np.arange(100)), priorities=np.arange(1, 101, dtype=float))
        c.flush()
        c.checkpoint(ck, "r")
    assert d.stop() == 0
    write_config(d.config, [{"name": "r", "capacity": 128, "fields": ROWS}],
                 instance=d.instance, socket=d.socket)
    d.start(["--restore", ck])
    with d.connect() as c:
        t = c.table("r")
        assert t.spec.row_layout == "slot"
        assert len(t) == 100
        b = t.sample(512)
        assert exact(b.data)
        p = (b.data["id"] + 1.0) ** 0.6
        np.testing.assert_allclose(b.probabilities, p / ((np.arange(1, 101) ** 0.6).sum()), rtol=1e-9)


def test_a_file_backed_slot_table_checkpoints_through_pread(start_daemon, tmp_path):
    """The daemon reads a served table's rows only with pread (rowread.py):
    in a slot layout each read cuts a field out of whole rows."""
    store, ck = str(tmp_path / "tables"), str(tmp_path / "ck")
    d = start_daemon(storage_dirs=[store])
    with d.connect() as c:
        t = c.create_table("r", capacity=300, fields=ROWS, storage_dir=store)
        assert t.spec.row_layout == "slot"
        # slots in runs and apart: the FIFO remover turns the table over once
        t.insert_batch(rows(np.arange(250)))
        t.insert_batch(rows(np.arange(1000, 1100)))
        c.flush()
        c.checkpoint(ck, "r")
        c.drop_table("r")  # so that the restart restores it, not adopts its file
    assert d.stop() == 0
    write_config(d.config, [], instance=d.instance, socket=d.socket, storage_dirs=[store])
    d.start(["--restore", ck])
    with d.connect() as c:
        t = c.table("r")
        assert t.spec.row_layout == "slot" and t.spec.storage_dir == store
        assert len(t) == 300
        b = t.sample(1000)
        assert exact(b.data)
        assert set(b.data["id"].tolist()) == set(range(50, 250)) | set(range(1000, 1100))


def test_exist_ok_returns_the_table_in_its_own_layout(start_daemon):
    d = start_daemon()
    with d.connect() as c:
        c.create_table("r", capacity=50, fields=ROWS, row_layout="field")
        t = c.create_table("r", capacity=50, fields=ROWS, exist_ok=True)
        assert t.spec.row_layout == "field"
        with pytest.raises(shmreplay.TableExists):
            c.create_table("r", capacity=50, fields=ROWS)


def test_an_out_batch_too_short_for_its_keys_is_a_clear_error(start_daemon):
    from shmreplay.client.gather import SampleBatch
    d = start_daemon()
    with d.connect() as c:
        t = c.create_table("r", capacity=100, fields=ROWS)
        t.insert_batch(rows(np.arange(50)))
        c.flush()
        short = SampleBatch({k: np.empty((4, *v.shape[1:]), v.dtype) for k, v in rows(np.arange(8)).items()},
                            np.empty(8, np.uint64), np.empty(8), np.empty(8))
        with pytest.raises(shmreplay.ReplayError, match="hold 4 rows for 8 keys"):
            t.sample(8, out=short)
        assert exact(t.sample(16).data)  # the table serves on
