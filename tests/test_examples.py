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

from daemons import checkout_env

pytest.importorskip("torch")
pytest.importorskip("gymnasium")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCHES = 20
NOT_REACHED = 3  # docs/guide.md, "Example programs": stopped before --target-return (1 is an error: an uncaught exception)
COLUMNS = ["seconds", "env_steps", "inserts", "batches", "episodes", "recent_return"]  # docs/guide.md, "Example programs"
LINE = re.compile(r"^\[\s*[\d.]+s\] env steps/s ", re.M)  # a progress line


def run(program, tmp_path, name, *args):
    """Run ``program`` to --max-batches (the target, 1e9, is never reached):
    it must say it stopped before the target, by its exit code and its last
    words, not crash; its CSV has one row per progress line it printed,
    counts that never go down, and ends at the batches it reports."""
    marker = f"shmreplay.test{os.getpid()}{name}"
    cmd = [sys.executable, os.path.join(ROOT, "clients", program), "--max-batches", str(BATCHES),
           "--max-minutes", "8", "--target-return", "1e9", "--min-size", "200", "--out", str(tmp_path),
           "--instance", f"test{os.getpid()}{name}", *args]
    p = subprocess.run(cmd, cwd=tmp_path, env=checkout_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == NOT_REACHED, p.stdout[-3000:] + p.stderr[-3000:]
    stem = os.path.splitext(program)[0]
    done = re.search(rf"^{stem}: stopped \(8 min or --max-batches\); recent return \S+ "
                     r"after ([\d,]+) env steps, ([\d,]+) batches", p.stdout, re.M)
    assert done, p.stdout[-2000:]
    steps, batches = (int(g.replace(",", "")) for g in done.groups())
    # a learner checks the count after each batch (seed_learner's training thread too)
    assert steps > 0 and BATCHES <= batches <= BATCHES + 4, p.stdout[-2000:]
    with open(tmp_path / f"{stem}.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == COLUMNS
        rows = list(reader)
    assert len(rows) == len(LINE.findall(p.stdout)) >= 1, (len(rows), p.stdout[-2000:])
    for col in ("seconds", "env_steps", "inserts", "batches", "episodes"):
        got = [float(r[col]) for r in rows]
        assert got == sorted(got), (col, got)
    assert int(rows[-1]["batches"]) == batches and int(rows[-1]["env_steps"]) <= steps, rows[-1]
    assert (tmp_path / f"{stem}.png").stat().st_size > 0
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
    # a frame table by default (issue 37), and what its replay holds a transition
    assert re.search(r"^apex_dqn: ALE/Pong-v5, .* replay 1,000 items as frames,", out, re.M), out[-2000:]
    memory = re.search(r"^apex_dqn: replay memory: ([\d,]+) bytes a transition in /dev/shm \(([\d,]+) held, "
                       r"[\d,]+ MiB\); ([\d,]+) bytes a transition when full; ([\d.]+) frames held an item$",
                       out, re.M)
    assert memory, out[-2000:]
    full = int(memory.group(3).replace(",", ""))
    assert full < 56_448 / 4, full  # rows would be 2 x 4 x 84 x 84 bytes a transition


def test_a_run_without_out_writes_into_a_run_folder_of_its_own(tmp_path):
    """Issue 38, item 4: the default --out is runs/<program>-<env>-seed<N>-<time>
    under the current directory (git-ignored here), never the directory
    itself; the curve is drawn against env steps with the target."""
    cmd = [sys.executable, os.path.join(ROOT, "clients", "apex_dqn.py"), "--max-batches", "5",
           "--max-minutes", "8", "--target-return", "1e9", "--min-size", "200", "--actors", "1",
           "--envs", "1", "--instance", f"test{os.getpid()}runs"]
    p = subprocess.run(cmd, cwd=tmp_path, env=checkout_env(), capture_output=True, text=True, timeout=600)
    assert p.returncode == NOT_REACHED, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(os.listdir(tmp_path)) == ["runs"]
    [run] = os.listdir(tmp_path / "runs")
    assert re.fullmatch(r"apex_dqn-CartPole-v1-seed0-\d{8}-\d{6}", run), run
    assert sorted(os.listdir(tmp_path / "runs" / run)) == ["apex_dqn.csv", "apex_dqn.png"]
    assert f"apex_dqn: wrote runs/{run}/apex_dqn.csv and runs/{run}/apex_dqn.png" in p.stdout
    with open(os.path.join(ROOT, ".gitignore")) as f:
        assert "/runs/" in f.read().split()
