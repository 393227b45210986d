"""Issue 34, item 5: the settings docs/reliability.md section 13
recommends for a Ray cluster next to a daemon, on a real one-node cluster
(rayfixtures.MemberCluster) whose every process, workers and drivers
included, runs as MEMBER, a real user who is in the daemon's group and not
in its admin group (people.py); the daemon runs as root with
``admin_group`` ADMINS.  Root is every daemon's admin, so only a cluster
run as another user can show what its tasks may do.

Two jobs (rayjobs.py): the operator's starts an ingest in its own
namespace and feeds the table; a second job's task tries to drop the
table, checkpoint it and shut the daemon down (each ``PermissionDenied``),
inserts a row at priority 1e200 (a member's right, documented), and looks
for the ingest by name (not found from its namespace; Ray's listing of
every namespace still shows the name: a namespace is no secret).  A third
job opens the table as a sharded table of one shard on the service
(``attach_shards``): it samples and updates priorities, and its drop and
checkpoint are refused (issue 39: a shard's box keeps its access rules).  At the
end the cluster's processes, its folder and the users are gone."""

import json
import os

import pytest

ray = pytest.importorskip("ray")
from people import ADMINS, GROUP, MEMBER, needs_root, shared_start, users  # noqa: E402,F401 (fixtures)
from rayfixtures import RAY_DEFAULTS, MemberCluster, member_cluster_unusable  # noqa: E402
from readback import committed  # noqa: E402
from waiting import HANG_S  # noqa: E402

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.dirname(TESTS)
# one pytest-xdist worker runs every test that starts Ray: one Ray at a time on the box
pytestmark = [needs_root, pytest.mark.xdist_group("ray"),
              pytest.mark.skipif(member_cluster_unusable(ROOT, TESTS) is not None,
                                 reason=str(member_cluster_unusable(ROOT, TESTS)))]
FIELDS = {"id": ("int64", ()), "obs": ("float32", (8,))}  # rayjobs.FIELDS


def test_a_second_job_on_a_member_run_cluster_can_neither_drop_tables_nor_find_a_private_ingest(
        shared_start, users):
    absent = [p for p in RAY_DEFAULTS if not os.path.exists(p)]
    d = shared_start(admin_group=ADMINS, allowed_groups=[GROUP],
                     tables=[{"name": "replay", "capacity": 256, "sampler": "prioritized", "alpha": 1.0,
                              "fields": FIELDS}])
    cluster = MemberCluster(users[MEMBER], [ROOT, TESTS])
    jobs = []
    try:
        cluster.start()
        script = os.path.join(TESTS, "rayjobs.py")
        learner = cluster.job("learner", script, "learner", d.socket, "replay", "ingest")
        jobs.append(learner)
        ready = learner.stdout.readline()
        assert ready, cluster.log("learner")[-3000:]
        ready = json.loads(ready)
        assert ready["confirmed"] == 2  # the ingest, run as the member, fed the table
        sharded = cluster.job("sharded", script, "sharded", d.socket, "replay")  # the table as one shard
        jobs.append(sharded)
        out, _ = sharded.communicate(timeout=10 * HANG_S)
        assert sharded.returncode == 0, cluster.log("sharded")[-3000:]
        shard_seen = json.loads(out)
        intruder = cluster.job("intruder", script, "intruder", d.socket, "replay", "ingest")
        jobs.append(intruder)
        out, _ = intruder.communicate(timeout=10 * HANG_S)
        assert intruder.returncode == 0, cluster.log("intruder")[-3000:]
        seen = json.loads(out)
        learner.stdin.close()
        assert learner.wait(timeout=10 * HANG_S) == 0, cluster.log("learner")[-3000:]
    finally:
        for p in jobs:
            if p.poll() is None:
                p.kill()
                p.wait()
        cluster.stop()
    assert seen["uid"] == users[MEMBER][0]  # every task runs as the cluster's user
    for op in ("drop_table", "checkpoint", "shutdown"):
        assert seen[op].startswith("PermissionDenied:") and "admin" in seen[op], (op, seen[op])
    assert seen["by_name"].startswith("ValueError:"), seen["by_name"]  # not from another namespace
    assert seen["listed"] == [{"name": "ingest", "namespace": ready["namespace"]}]  # but listed: no secret
    assert seen["insert_1e200"] == "ok"  # a member's right (section 13)
    # a sharded table over the service keeps its access rules: a member samples and
    # updates priorities; the drop and the checkpoint are the daemon's admins'
    assert shard_seen["uid"] == users[MEMBER][0] and shard_seen["size"] == 16
    assert shard_seen["update"] == "ok" and set(shard_seen["ids"]) <= set(range(16))
    for op in ("drop", "checkpoint"):
        assert shard_seen[op].startswith("PermissionDenied:") and "admin" in shard_seen[op], (op, shard_seen[op])
    with d.connect() as c:
        assert c.list_tables() == ["replay"]
        got, prios = committed(c.table("replay"))
        assert sorted(got["id"].tolist()) == [-1, *range(16)]
        assert prios[got["id"] == -1].tolist() == [1e200]
        assert {i for i, p in zip(got["id"].tolist(), prios.tolist()) if p == 2.0} == set(shard_seen["ids"])
    assert d.proc.poll() is None
    # nothing of the cluster is left: processes (the member's, any), its folder, Ray state elsewhere
    assert not cluster.leftovers()
    assert not os.path.exists(cluster.base)
    assert not [p for p in absent if os.path.exists(p)], "Ray made state of its own outside the run"
