"""A frame table's declaration (``shmreplay/framespec.py``, docs/frames.md):
the forms it takes, its canonical form, every refusal saying what to
write, and the frame rings' sizes."""

import pytest

from shmreplay.errors import SchemaError
from shmreplay.fields import parse_fields
from shmreplay.framespec import (MAX_FRAMES, Frames, check_frame_capacity, frame_bytes,
                                 frame_capacity, most_frame_items, parse_frames)

ATARI = parse_fields({"obs": ("uint8", (4, 84, 84)), "action": ("int64", ()),
                      "next_obs": ("uint8", (4, 84, 84)), "reward": ("float32", ()),
                      "depth": ("float32", (2, 8, 8)), "next_depth": ("float32", (2, 8, 8))})


@pytest.mark.parametrize("given", [
    {"next_obs": "obs", "obs": 4},                   # a mapping, in any order
    [["obs", 4], ["next_obs", "obs"]],               # the wire form
    (("next_obs", "obs"), ("obs", 4)),               # pairs as tuples
])
def test_the_forms_give_one_canonical_declaration_in_field_order(given):
    fr = parse_frames(given, ATARI)
    assert fr.decl == (("obs", 4), ("next_obs", "obs"))
    assert fr.to_wire() == [["obs", 4], ["next_obs", "obs"]]
    assert parse_frames(fr.to_wire(), ATARI) == fr  # the wire form round-trips


def test_what_a_declaration_says_about_each_field():
    fr = parse_frames({"obs": 4, "next_obs": "obs", "depth": 2, "next_depth": "depth"}, ATARI)
    assert fr.bases == ("obs", "depth")
    assert [fr.base_of(n) for n in ("obs", "next_obs", "depth", "next_depth")] == \
        ["obs", "obs", "depth", "depth"]
    assert [fr.depth(n) for n in ("obs", "next_obs", "depth", "next_depth")] == [4, 4, 2, 2]
    assert fr.refs_per_item == 4 + 4 + 2 + 2
    assert frame_bytes(ATARI[0]) == 84 * 84          # one uint8 frame
    assert frame_bytes(ATARI[4]) == 8 * 8 * 4        # one float32 (8, 8) frame


def test_no_frames_is_a_table_of_rows():
    for nothing in (None, {}, []):
        fr = parse_frames(nothing, ATARI)
        assert not fr and fr == Frames() and fr.refs_per_item == 0


@pytest.mark.parametrize("given, says", [
    ({"pixels": 4}, ["'pixels'", "not a field", "obs, action, next_obs"]),
    ({"obs": 3}, ["frames['obs'] is 3", "(4, 84, 84)", "frames={'obs': 4}"]),
    ({"action": 1}, ["'action' has shape ()", "first axis"]),
    ({"obs": True}, ["frames['obs'] is True", "depth (an int)"]),
    ({"obs": 4.0}, ["frames['obs'] is 4.0", "depth (an int)"]),
    ({"obs": 0}, ["frames['obs'] is 0", "frames={'obs': 4}"]),
    ({"next_obs": "obs"}, ["follows on from 'obs'", "no depth", "frames={'obs': 4, 'next_obs': 'obs'}"]),
    ({"obs": 4, "next_obs": "next_obs"}, ["follows on from itself"]),
    ({"obs": 4, "next_obs": "pixels"}, ["'pixels'", "not a field"]),
    ({"obs": 4, "next_depth": "obs"}, ["'next_depth' (float32, shape (2, 8, 8))",
                                       "the dtype uint8 and the shape (4, 84, 84)"]),
    ({"obs": 4, "reward": "obs"}, ["'reward'", "the dtype uint8 and the shape (4, 84, 84)"]),
    (5, ["frames must be a mapping", 'frames={"obs": 4, "next_obs": "obs"}']),
    ([["obs", 4, 1]], ["frames must be a mapping"]),
    ({4: "obs"}, ["frames names 4", "not a field"]),
])
def test_a_wrong_declaration_says_what_to_write(given, says):
    with pytest.raises(SchemaError) as e:
        parse_frames(given, ATARI)
    for words in says:
        assert words in str(e.value)


def test_a_field_named_twice_in_the_wire_form_is_refused():
    with pytest.raises(SchemaError, match="field 'obs' twice"):
        parse_frames([["obs", 4], ["obs", 4]], ATARI)


def test_frame_rings_hold_one_frame_an_item_and_a_sixteenth_more():
    assert frame_capacity(1) == 1 + 64             # at least 64 more
    assert frame_capacity(1024) == 1024 + 64       # 1024 // 16 == 64
    assert frame_capacity(1_000_000) == 1_062_500  # the Nature-DQN buffer: 7.5 GB of Atari frames
    most = most_frame_items()
    assert frame_capacity(most) <= MAX_FRAMES < frame_capacity(most + 1)
    fr = parse_frames({"obs": 4}, ATARI)
    check_frame_capacity("t", most, fr)
    with pytest.raises(SchemaError, match=f"at most {most} items"):
        check_frame_capacity("t", most + 1, fr)
    check_frame_capacity("t", most + 1, Frames())  # a table of rows: no frame references


# ---- in a table's definition (schema.py) and at the daemon ----

from conftest import SMALL_FIELDS  # noqa: E402
from items import assert_still_serving  # noqa: E402
from shmreplay.schema import make_spec, spec_from_dict, spec_from_wire  # noqa: E402
from shmreplay.server.control.config import load_config  # noqa: E402

ATARI_FIELDS = {"obs": ("uint8", (4, 84, 84)), "next_obs": ("uint8", (4, 84, 84)),
                "action": ("int64", ()), "reward": ("float32", ())}


def test_a_table_definition_carries_its_frames_through_the_wire_and_toml_forms():
    spec = make_spec("atari", 1000, ATARI_FIELDS, frames={"next_obs": "obs", "obs": 4})
    assert spec.frames.decl == (("obs", 4), ("next_obs", "obs"))
    assert spec.to_wire()["frames"] == [["obs", 4], ["next_obs", "obs"]]
    assert spec_from_wire(spec.to_wire()) == spec
    # what a TOML [tables.frames] table reads as: a mapping
    toml_form = {**spec.to_wire(), "frames": {"obs": 4, "next_obs": "obs"}}
    assert spec_from_dict(toml_form, "config") == spec
    # the slot keeps only the small fields (16 bytes): a slot layout
    assert spec.row_layout == "slot"
    assert make_spec("atari", 1000, ATARI_FIELDS).row_layout == "field"


def test_a_table_of_rows_reads_as_before_frames_existed():
    spec = make_spec("t", 10, {"x": ("float32", (3,))})
    assert "frames" not in spec.to_wire() and not spec.frames


def test_a_wrong_declaration_names_its_table():
    with pytest.raises(SchemaError, match=r"^table 'atari': frames\['obs'\] is 3, .* frames=\{'obs': 4\}"):
        make_spec("atari", 1000, ATARI_FIELDS, frames={"obs": 3})
    with pytest.raises(SchemaError, match=f"^table 'atari': a frame table holds at most {most_frame_items()}"):
        make_spec("atari", most_frame_items() + 1, {"obs": ("uint8", (4, 2, 2))}, frames={"obs": 4})


def test_a_frame_table_is_made_by_a_request_and_by_the_config_in_memory_or_in_a_file(
        start_daemon, tmp_path):
    store = str(tmp_path / "tables")
    d = start_daemon(storage_dirs=[store])
    with d.connect() as client:
        client.create_table("atari", capacity=100, fields=ATARI_FIELDS, frames={"obs": 4})
        t = client.create_table("filed", capacity=100, fields=ATARI_FIELDS, frames={"obs": 4},
                                storage_dir=store)
        assert t.spec.file_backed and t.spec.frames.bases == ("obs",)
        client.create_table("t", capacity=10, fields=SMALL_FIELDS)
        assert sorted(client.list_tables()) == ["atari", "filed", "t"]
    assert_still_serving(d, 0)
    path = tmp_path / "d.toml"
    path.write_text(f'[daemon]\nstorage_dir = "{store}"\nstorage_dirs = ["{store}"]\n'
                    '[[tables]]\nname = "atari"\ncapacity = 100\n'
                    '[tables.fields]\nobs = { dtype = "uint8", shape = [4, 8, 8] }\n'
                    '[tables.frames]\nobs = 4\n')
    [spec] = load_config(str(path)).tables
    assert spec.frames.bases == ("obs",)


def test_frames_per_item_sizes_a_sequence_tables_rings_and_is_checked():
    seq = {"obs": ("uint8", (80, 4, 4)), "length": ("int32", ())}
    spec = make_spec("r2d2", 10_000, seq, frames={"obs": 80}, frames_per_item=40)
    assert spec.frames.per_item == 40
    assert spec.frames.ring_frames(10_000) == 400_000 + 25_000  # 40 an item and a 16th more
    assert spec.to_wire()["frames_per_item"] == 40
    assert spec_from_wire(spec.to_wire()) == spec
    assert "frames_per_item" not in make_spec("r2d2", 10, seq, frames={"obs": 80}).to_wire()
    for bad in (0, 81, True, 2.0, "40"):
        with pytest.raises(SchemaError, match=r"^table 'r2d2': frames_per_item is .*: the frames an "
                                              r"item adds to its rings, 1\.\.80"):
            make_spec("r2d2", 10, seq, frames={"obs": 80}, frames_per_item=bad)
    with pytest.raises(SchemaError, match="frames_per_item is 40 but the table declares no frames"):
        make_spec("r2d2", 10, seq, frames_per_item=40)
    with pytest.raises(SchemaError, match=f"holds at most {most_frame_items(40)} items of 40 frames"):
        make_spec("r2d2", most_frame_items(40) + 1, seq, frames={"obs": 80}, frames_per_item=40)
    make_spec("r2d2", most_frame_items(40), seq, frames={"obs": 80}, frames_per_item=40)
