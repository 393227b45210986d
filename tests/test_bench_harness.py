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
