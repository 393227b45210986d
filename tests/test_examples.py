"""Issue 23, item 9: a smoke run of each example program: a short run that
data flows end to end (actors or env processes -> replay -> learner
batches -> priorities), that the CSV and PNG come out, and that nothing is
left behind.  The learning runs themselves are README commands, not tests."""

import csv
import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("gymnasium")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCHES = 20


def run(program, tmp_path, name, *args):
    marker = f"shmreplay.test{os.getpid()}{name}"
    cmd = [sys.executable, os.path.join(ROOT, "clients", program), "--max-batches", str(BATCHES),
           "--max-minutes", "8", "--target-return", "1e9", "--min-size", "200", "--out", str(tmp_path),
           "--instance", f"test{os.getpid()}{name}", *args]
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]   # 1: stopped before the target
    stem = os.path.splitext(program)[0]
    rows = list(csv.DictReader(open(tmp_path / f"{stem}.csv")))
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
    done = re.search(r"([\d,]+) env steps, ([\d,]+) batches", p.stdout)
    assert done, p.stdout[-2000:]
    steps, batches = (int(g.replace(",", "")) for g in done.groups())
    # the training thread of seed_learner may finish a batch or two more
    assert steps > 0 and BATCHES <= batches <= BATCHES + 4, p.stdout[-2000:]
    left = [n for n in os.listdir("/dev/shm") if marker[len("shmreplay."):] in n]
    assert not left, left
    return p.stdout, rows


def test_apex_dqn_smoke(tmp_path):
    out, rows = run("apex_dqn.py", tmp_path, "apex", "--actors", "1", "--envs", "2")
    assert "env steps" in out


def test_seed_learner_smoke(tmp_path):
    out, rows = run("seed_learner.py", tmp_path, "seed", "--envs", "2",
                    "--channel-prefix", f"shmreplay.test{os.getpid()}seedch")
    assert "mean step round trip" in out


def test_apex_dqn_on_atari_smoke(tmp_path):
    pytest.importorskip("ale_py")
    out, rows = run("apex_dqn.py", tmp_path, "pong", "--env", "ALE/Pong-v5", "--actors", "1", "--envs", "1",
                    "--batch", "16", "--capacity", "1000")
