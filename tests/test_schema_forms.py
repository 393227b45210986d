"""The forms a table's fields may take (shmreplay/fields.py), and every
malformed one refused with a SchemaError that names the field, what is
wrong and what to write instead: by the client (``make_spec``, which
``create_table`` runs before it sends anything), by the daemon for a client
that skipped those checks (``spec_from_wire`` behind a raw ``create_table``
request; the daemon answers and serves on), and in the daemon's config."""

import numpy as np
import pytest

import shmreplay
from conftest import SMALL_FIELDS
from items import assert_still_serving
from shmreplay.schema import make_spec, spec_from_wire
from shmreplay.server.control.config import load_config

OBS = (shmreplay.schema.Field("obs", np.dtype("float32"), (4, 2)),)
FORMS = "give a field as \\(dtype, shape\\)"      # the accepted forms, as the messages say them
DTYPES = "use a numeric or bool numpy dtype"
SHAPES = "use a tuple or list of positive ints"

# (fields, what the refusal must say), each expressible in msgpack and TOML,
# so that the daemon can be sent every one of them as it stands
MALFORMED = [
    ({"obs": {"shape": [4]}}, f"field 'obs': .* has no \"dtype\" \\(there is no default\\); {FORMS}"),
    ({"obs": {"dtype": "float32", "shpae": [4]}},
     "field 'obs': unknown key\\(s\\) \\['shpae'\\] .* has \"dtype\" and, optionally, \"shape\""),
    ({"obs": "float32"}, "field 'obs': 'float32' has no shape; give \\('float32', \\(\\)\\) for a scalar"),
    ({"obs": ["float32", [4], 1]}, f"field 'obs': .* is not a field definition; {FORMS}"),
    ({"obs": [None, [4]]}, f"field 'obs': no dtype given; {DTYPES}"),
    ({"obs": ["nosuchtype", []]}, f"field 'obs': unknown dtype 'nosuchtype' .*; {DTYPES}"),
    ({"obs": [5, []]}, f"field 'obs': unknown dtype 5 .*; {DTYPES}"),
    ({"obs": ["O", []]}, f"field 'obs': dtype object is not a plain numeric .*Python objects.*{DTYPES}"),
    ({"obs": ["U", []]}, f"field 'obs': dtype <U0 is not a plain numeric .*uint8 field.*{DTYPES}"),
    ({"obs": ["S5", []]}, "field 'obs': dtype \\|S5 is not a plain numeric .*strings"),
    ({"obs": ["u1,O", []]}, "field 'obs': .* not a plain numeric .*give each of its parts a field"),
    ({"obs": ["(3,)u1", []]}, "field 'obs': .* not a plain numeric .*put its shape \\(3,\\) into"),
    ({"obs": ["M8[s]", []]}, "field 'obs': dtype datetime64\\[s\\] is not a plain numeric .*as int64"),
    ({"obs": ["float32", True]}, f"field 'obs': shape True is not a tuple of ints; {SHAPES}"),
    ({"obs": ["float32", "4"]}, f"field 'obs': shape '4' is not a tuple of ints; {SHAPES}"),
    ({"obs": ["float32", None]}, f"field 'obs': shape None is not a tuple of ints; {SHAPES}"),
    ({"obs": ["float32", [True, 2]]}, f"shape \\[True, 2\\] must hold positive ints, and True .*{SHAPES}"),
    ({"obs": ["float32", [4.0]]}, f"field 'obs': shape \\[4.0\\] must hold positive ints, and 4.0 is not one"),
    ({"obs": ["float32", [[4]]]}, "field 'obs': shape \\[\\[4\\]\\] must hold positive ints, and \\[4\\] is not"),
    ({"obs": ["float32", [4, -1]]}, f"shape \\[4, -1\\] must hold positive ints, and -1 .*{SHAPES}"),
    ({"obs": ["float32", [1] * 32]}, "field 'obs': shape has 32 dimensions, at most 31"),
    ({"": ["float32", []]}, "invalid field name '': use a Python identifier"),
    ({"obs\n": ["float32", []]}, "invalid field name 'obs\\\\n': use a Python identifier"),
    ([[1, "float32", []]], "invalid field name 1: use a Python identifier"),
    ([["obs", "float32"]], "field entry \\['obs', 'float32'\\] is not \\[name, dtype, shape\\]; fields is"),
    ([["a", "int8", []], ["a", "float32", []]], "duplicate field name 'a': give each field its own name"),
    ("obs", "fields must be a mapping or a list, got str; fields is a mapping \\{name: \\(dtype, shape"),
    (5, "fields must be a mapping or a list, got int"),
    (None, "fields must be a mapping or a list, got NoneType"),
    ({}, "at least one field"),
    ({f"f{i}": ["uint8", []] for i in range(65)}, "at most 64 fields"),
]


@pytest.mark.parametrize("fields", [
    {"obs": ("float32", (4, 2))},
    {"obs": ["float32", [4, 2]]},
    {"obs": {"dtype": "float32", "shape": [4, 2]}},
    {"obs": (np.float32, (np.int64(4), 2))},
    {"obs": (np.dtype("float32"), (4, 2))},
    {"obs": (">f4", (4, 2))},            # stored in the machine's byte order
    [["obs", "<f4", [4, 2]]],            # the wire form
    [(np.str_("obs"), "float32", (4, 2))],
])
def test_every_accepted_form_gives_the_same_field(fields):
    spec = make_spec("t", 10, fields)
    assert spec.fields == OBS and type(spec.fields[0].name) is str
    assert spec_from_wire(spec.to_wire()) == spec


def test_a_scalar_may_leave_its_shape_out_and_an_int_is_a_1d_shape():
    spec = make_spec("t", 10, {"r": {"dtype": "float32"}, "a": (bool, ()), "v": ("int64", 3)})
    assert [(f.name, f.dtype, f.shape) for f in spec.fields] == [
        ("r", np.float32, ()), ("a", np.bool_, ()), ("v", np.int64, (3,))]


@pytest.mark.parametrize("fields, match", MALFORMED + [
    ({"obs": (object, ())}, "field 'obs': dtype object is not a plain numeric"),
    ({"obs": (np.dtype([("a", object)]), ())}, "is not a plain numeric .*give each of its parts"),
    ({"obs": (np.dtype("float32"), ())}, None),  # control: the same field, well formed
    ({"obs": ("float32", {4})}, "shape \\{4\\} is not a tuple of ints"),
    ({"obs": ("float32", np.array([4]))}, "shape array\\(\\[4\\]\\) is not a tuple of ints"),
    ({"obs": ("float32", b"\x04")}, "is not a tuple of ints"),
    ({"obs": np.dtype("float32")}, "has no shape; give \\(dtype\\('float32'\\), \\(\\)\\)"),
    ({("obs", "float32", ())}, "fields must be a mapping or a list, got set"),
    ([[np.str_("a"), "int8", ()], ["a", "int8", ()]], "duplicate field name 'a'"),
])
def test_the_client_refuses_every_malformed_field_saying_what_to_write(fields, match):
    if match is None:
        assert make_spec("t", 10, fields).fields[0].dtype == np.float32
        return
    with pytest.raises(shmreplay.SchemaError, match=f"^table 't': .*{match}"):
        make_spec("t", 10, fields)


def test_the_daemon_refuses_every_malformed_field_a_client_sends_and_serves_on(daemon, client):
    """What a client that skips make_spec sends: the same refusal, from the
    daemon, for every form; nothing is created and the daemon serves on."""
    for fields, match in MALFORMED:
        with pytest.raises(shmreplay.SchemaError, match=f"^table 'bad': .*{match}"):
            client._session.request("create_table", spec={"name": "bad", "capacity": 10,
                                                          "fields": fields}, exist_ok=False)
    assert client.list_tables() == []
    client.create_table("t", capacity=10, fields=SMALL_FIELDS)
    assert_still_serving(daemon, 0)


@pytest.mark.parametrize("key, value, match", [
    ("alpha", "0.6", "alpha must be finite and >= 0 \\(a number\\), got '0.6'"),
    ("alpha", 2**63, None),  # control: a large int is a finite number
    ("max_times_sampled", 2**64 - 1, "max_times_sampled must be 0 \\(no limit\\) or 1..2\\*\\*32-1"),
    ("sampler", ["uniform"], "sampler \\['uniform'\\] is not one of"),
    ("capacity", [0] * 400_000, "capacity must be an int, got \\[0, 0, .*\\.\\.\\.$"),
])
def test_the_daemon_answers_any_other_malformed_part_briefly(daemon, client, key, value, match):
    """A value is quoted at most 120 characters long: a 400,000-item list
    (a 400 KB request) once made a 1.2 MB answer, larger than a frame, which
    the daemon could not send: the client heard nothing until its timeout."""
    spec = {"name": "bad", "capacity": 10, "fields": [["x", "<f4", []]], key: value}
    if match is None:
        client._session.request("create_table", spec=spec, exist_ok=False)
        assert client.list_tables() == ["bad"]
        return
    with pytest.raises(shmreplay.SchemaError, match=f"^table 'bad': {match}"):
        client._session.request("create_table", spec=spec, exist_ok=False)
    assert client.list_tables() == []
    client.create_table("t", capacity=10, fields=SMALL_FIELDS)
    assert_still_serving(daemon, 0)


def test_the_config_refuses_a_field_without_a_dtype(tmp_path):
    """The TOML form (``[[tables]]``, read by ``spec_from_dict``): the field
    that was stored as float64 is refused and named with its table."""
    path = tmp_path / "d.toml"
    path.write_text('[[tables]]\nname = "demo"\ncapacity = 10\n'
                    '[tables.fields]\nobs = { shape = [4] }\n')
    with pytest.raises(shmreplay.SchemaError,
                       match=f"table 'demo': field 'obs': .* has no \"dtype\".*{FORMS}"):
        load_config(str(path))
    path.write_text(path.read_text().replace("{ shape", '{ dtype = "float32", shape'))
    assert load_config(str(path)).tables[0].fields[0].dtype == np.float32
