"""Issue 13, item 4: the programs a user runs as they are (the quick
start's demo with the bundled config, which runs clients/actor.py and
clients/learner.py) run, report throughput and leave nothing behind."""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_demo_runs_with_the_bundled_config_and_leaves_nothing():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "clients", "demo.py"), "--seconds", "2",
                          "--actors", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    m = re.search(r"result: (\d+) items inserted by 1 actor\(s\).*learner ([\d.]+) batches/s", run.stdout)
    assert m and int(m.group(1)) > 0 and float(m.group(2)) > 0, run.stdout[-2000:]
    assert "daemon exited with code 0; shared memory left behind: none" in run.stdout


def test_the_bundled_config_loads_and_declares_the_demo_table():
    from shmreplay.server.control.config import load_config
    cfg = load_config(os.path.join(ROOT, "daemon", "shmreplayd.toml"))
    assert [t.name for t in cfg.tables] == ["demo"]
    assert cfg.hold_timeout_s > 0 and cfg.handshake_timeout_s > 0
    json.dumps(cfg.tables[0].to_wire())  # a spec the wire can carry
