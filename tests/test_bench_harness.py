"""The benchmark harness still runs (no speed is asserted: benchmarks are
not tests).  One tiny cell per kind, shmreplay only (cpprb is not a test
dependency)."""

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("cell, keys", [
    ("insert64", {"items_per_s", "MB_per_s"}),
    ("sample_it", {"batches_per_s", "GB_per_s"}),
])
def test_a_cell_runs_in_its_own_process_and_reports_json(cell, keys):
    out = subprocess.run([sys.executable, "-m", "shmreplay.bench.cells", cell, "shmreplay",
                          "sac-mujoco", "--seconds", "0.2"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert keys <= res.keys() and all(res[k] > 0 for k in keys)


def _check(results):
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "run.py")
    spec = importlib.util.spec_from_file_location("bench_run", path)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    return run.check_targets({"results": results})


def test_target_check_tells_a_slow_cell_from_one_beyond_the_machine():
    r2d2_item = 564_480
    lines = _check([
        {"cell": "copy", "peer": "numpy", "workload": "-", "GB_per_s": 20.0},
        # cpprb already writes 25 GB/s of r2d2 rows: 2x that is 51 GB/s
        {"cell": "insert64", "peer": "cpprb", "workload": "r2d2-seq", "items_per_s": 25e9 / r2d2_item},
        {"cell": "insert64", "peer": "shmreplay", "workload": "r2d2-seq", "items_per_s": 24e9 / r2d2_item},
        # sac rows: 2x cpprb is well inside the machine
        {"cell": "insert64", "peer": "cpprb", "workload": "sac-mujoco", "items_per_s": 3e6},
        {"cell": "insert64", "peer": "shmreplay", "workload": "sac-mujoco", "items_per_s": 4.5e6},
        {"cell": "sample", "peer": "cpprb", "workload": "sac-mujoco", "batches_per_s": 2500.0},
        {"cell": "sample", "peer": "shmreplay", "workload": "sac-mujoco", "batches_per_s": 5100.0},
    ])
    by_cell = {" ".join(line.split()[1:3]): line for line in lines}
    assert by_cell["r2d2-seq insert64"].startswith("MISS")
    assert "beyond this machine: needs 50.0 GB/s" in by_cell["r2d2-seq insert64"]
    assert by_cell["sac-mujoco insert64"].startswith("MISS")
    assert "beyond" not in by_cell["sac-mujoco insert64"]
    assert by_cell["sac-mujoco sample"].startswith("PASS")
