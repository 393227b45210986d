"""``wire/framelayout.py``: where a frame table's rings and references lie,
checked against offsets worked out by hand; and what the Nature-DQN
buffer of 1,000,000 Atari transitions costs as frames (issue 37's 8 GB)."""

import numpy as np

from shmreplay.fields import parse_fields
from shmreplay.framespec import parse_frames
from shmreplay.framespec import slot_fields
from shmreplay.wire.framelayout import frame_rings, refs_span, rows_end

FIELDS = parse_fields({"obs": ("uint8", (4, 10, 10)), "action": ("int64", ()),
                       "next_obs": ("uint8", (4, 10, 10)), "depth": ("float32", (2, 3, 3))})
FRAMES = parse_frames({"obs": 4, "next_obs": "obs", "depth": 2}, FIELDS)


def test_rings_follow_the_rows_each_on_a_page_of_its_own():
    rings = frame_rings(FIELDS, FRAMES, capacity=100, start=10_000)
    assert [r.base for r in rings] == ["obs", "depth"]
    obs, depth = rings
    # 100 items: 100 + 64 frames a ring; obs frames 10 x 10 uint8, depth 3 x 3 float32
    assert (obs.offset, obs.frames, obs.frame_bytes, obs.frame_shape) == (12_288, 164, 100, (10, 10))
    assert obs.end == 12_288 + 16_400
    assert (depth.offset, depth.frames, depth.frame_bytes) == (32_768, 164, 36)
    assert depth.dtype == np.float32 and depth.frame_shape == (3, 3)
    assert rows_end(rings, 10_000) == 32_768 + 8_192  # 5,904 bytes of depth frames: two pages
    assert rows_end((), 10_000) == 10_000


def test_a_slot_holds_the_fields_that_are_not_frames():
    assert [f.name for f in slot_fields(FIELDS, FRAMES)] == ["action"]
    assert slot_fields(FIELDS, parse_frames(None, FIELDS)) == FIELDS


def test_references_follow_the_per_slot_arrays_64_byte_aligned():
    # 4 (obs) + 4 (next_obs) + 2 (depth) references of 4 bytes an item
    assert refs_span(100, FRAMES, 5_000) == (5_056, 100 * 10 * 4)


def test_the_nature_dqn_buffer_as_frames_fits_8_gb():
    fields = parse_fields({"obs": ("uint8", (4, 84, 84)), "next_obs": ("uint8", (4, 84, 84)),
                           "action": ("int64", ()), "reward": ("float32", ()),
                           "discount": ("float32", ())})
    frames = parse_frames({"obs": 4, "next_obs": "obs"}, fields)
    n = 1_000_000
    rows = n * sum(f.item_bytes for f in slot_fields(fields, frames))  # 16 bytes an item
    (ring,) = frame_rings(fields, frames, n, rows)
    _, refs = refs_span(n, frames, 0)
    per_slot_books = n * (4 + 8 + 1 + 4 + 8 + 4 + 8 + 8)  # layout.py's per-slot arrays
    total = rows_end((ring,), rows) + refs + per_slot_books
    assert ring.frames == 1_062_500 and ring.frame_bytes == 7_056
    assert total < 8 * 10**9  # about 7.6 GB; as rows the same items are 56.5 GB
    assert n * sum(f.item_bytes for f in fields) > 56 * 10**9


# ---- the table's map (wire/tablelayout.py, wire/layout.py) on real segments ----

import os  # noqa: E402

import pytest  # noqa: E402

from shmreplay.errors import LayoutError  # noqa: E402
from shmreplay.schema import make_spec  # noqa: E402
from shmreplay.wire.framelayout import NO_REF  # noqa: E402
from shmreplay.wire.headers import FRAME_LAYOUT_VERSION, LAYOUT_VERSION  # noqa: E402
from shmreplay.wire.layout import TableMap  # noqa: E402
from shmreplay.wire.tablelayout import TableLayout  # noqa: E402

SPEC_FIELDS = {"obs": ("uint8", (4, 10, 10)), "action": ("int64", ()),
               "next_obs": ("uint8", (4, 10, 10)), "reward": ("float32", ())}


def test_a_frame_tables_layout_keeps_small_fields_in_the_slot_and_places_rings_and_references():
    spec = make_spec("f", 100, SPEC_FIELDS, frames={"obs": 4, "next_obs": "obs"})
    lo = TableLayout(spec)
    assert [f.name for f in lo.slot_fields] == ["action", "reward"]
    assert spec.row_layout == "slot" and lo.row_stride == 16  # int64 + float32, 8-aligned
    assert set(lo.field_offs) == {"action", "reward"}
    (ring,) = lo.rings
    # the slots' rows: 4096 + 100 * 16 = 5,696 -> the ring from 8,192, 164 frames of 100 bytes
    assert (ring.base, ring.offset, ring.frames, ring.frame_bytes) == ("obs", 8192, 164, 100)
    assert lo.rows_size == 8192 + 20480  # 16,400 bytes of frames, rounded up to five pages
    # the references after the per-slot arrays: lease_start's 800 bytes, then 64-aligned
    assert lo.refs_off == (lo.lease_start_off + 800 + 63) // 64 * 64
    assert lo.size == (lo.refs_off + 100 * 8 * 4 + 4095) // 4096 * 4096


def test_a_table_of_rows_lies_as_it_did():
    lo = TableLayout(make_spec("r", 100, SPEC_FIELDS))
    assert lo.refs_off is None and lo.rings == () and len(lo.offsets) == 9
    assert [f.name for f in lo.slot_fields] == list(SPEC_FIELDS)


def test_a_frame_tables_segments_map_its_rings_and_references(tmp_path):
    spec = make_spec("f", 100, SPEC_FIELDS, frames={"obs": 4, "next_obs": "obs"})
    tm = TableMap.create(f"/shmreplay.test{os.getpid()}.frames", spec)
    try:
        assert int(tm.header["layout_version"]) == FRAME_LAYOUT_VERSION
        assert tm.refs.shape == (100, 8) and (tm.refs == NO_REF).all()
        assert tm.rings["obs"].shape == (164, 100) and set(tm.fields) == {"action", "reward"}
        tm.rings["obs"][163] = 7
        client = TableMap.attach(tm.name, spec)
        try:
            assert client.spec == spec and (client.rings["obs"][163] == 7).all()
            assert not client.refs.flags.writeable  # the daemon's copy: clients read it
        finally:
            client.release()
        tm.header["layout_version"] = LAYOUT_VERSION  # a frame table's map under a row table's version
        with pytest.raises(LayoutError, match="has layout version 4, but its schema declares frames"):
            TableMap.attach(tm.name, spec)
    finally:
        tm.unlink()
        tm.release()
