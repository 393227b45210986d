"""Issue 33: promises of the Ray integration, on a real two-node Ray
cluster (rayfixtures.cluster: both nodes on 127.0.0.1) and a real daemon:
the parameter relay."""

import numpy as np
import pytest

ray = pytest.importorskip("ray")
import shmreplay  # noqa: E402
import shmreplay.ray as sray  # noqa: E402
from rayfixtures import cluster  # noqa: E402,F401 (a fixture)
from rayproducer import read_parameters  # noqa: E402
from waiting import HANG_S  # noqa: E402

# one pytest-xdist worker runs every test that starts Ray: one Ray at a time on the box
pytestmark = pytest.mark.xdist_group("ray")


def parameters(version: int) -> dict:
    """The learner's parameters at ``version``: three dtypes, one of them a
    scalar, every value exact in its dtype and different per version."""
    return {"w": np.arange(12, dtype=np.float32).reshape(3, 4) + np.float32(0.25 * version),
            "b": np.array([-2.0, -1.0, 0.0, 1.0, 2.0]) * version,
            "step": np.int64(1000 * version)}


def test_remote_actors_read_the_learners_parameters_through_the_relay(cluster, start_daemon):
    """docs/scaling.md ("A program that uses it": the actors read the
    learner's weights through ``start_parameter_relay``, a ParameterBoard
    read on the replay node) and relay.py: ``relay.latest.remote(
    newer_than=v)`` is None or ``(version, {name: array})``, for any actor.
    Actors on the other node get the version and arrays the learner
    published, then the newer one after the next publish, and None when
    nothing newer than theirs exists; one relay serves every actor, so an
    actor that has read less than another is still told of the newest."""
    d = start_daemon()
    with d.connect() as c:
        board = shmreplay.ParameterBoard.create(c, "policy", like=parameters(0))
        relay = sray.start_parameter_relay(d.socket, "policy", parameters(0), node_id=cluster)

        def read(newer_than):
            got, node = ray.get(read_parameters.remote(relay, newer_than), timeout=HANG_S)
            assert node != cluster  # not on the replay node
            return got

        def check(got, version):
            assert got is not None and got[0] == version
            arrays, want = got[1], parameters(version)
            assert sorted(arrays) == ["b", "step", "w"]
            for k, v in want.items():
                assert arrays[k].dtype == v.dtype and arrays[k].shape == v.shape, k
                np.testing.assert_array_equal(arrays[k], v, err_msg=k)

        assert read(None) is None  # nothing published yet
        assert board.publish(parameters(1), flush=True) == 1
        check(read(None), 1)
        assert read(1) is None
        check(read(0), 1)  # an actor behind the one that read version 1
        assert board.publish(parameters(2), flush=True) == 2
        check(read(1), 2)
        assert read(2) is None
        check(read(0), 2)  # the newest, not each version in turn
        check(read(None), 2)
    ray.kill(relay)
