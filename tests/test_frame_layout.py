"""``wire/framelayout.py``: where a frame table's rings and references lie,
checked against offsets worked out by hand; and what the Nature-DQN
buffer of 1,000,000 Atari transitions costs as frames (issue 37's 8 GB)."""

import numpy as np

from shmreplay.fields import parse_fields
from shmreplay.framespec import parse_frames
from shmreplay.wire.framelayout import frame_rings, refs_span, rows_end, slot_fields

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
