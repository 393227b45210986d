"""Every Python snippet in README.md and docs/*.md runs, as written, in a
process of its own (issue 23, item 7): a snippet that drifts from the API
fails here.  Snippets start their own daemon (``shmreplay.Server``) and
must leave nothing behind."""

import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

import pytest

from daemons import checkout_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets():
    out = []
    for path in [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]:
        text = open(path).read()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            # a snippet that starts Ray runs on the pytest-xdist worker of test_ray.py (one Ray at a time)
            marks = [pytest.mark.xdist_group("ray")] if "import ray" in m.group(1) else []
            out.append(pytest.param(m.group(1), id=f"{os.path.relpath(path, ROOT)}:{line}", marks=marks))
    return out


def test_the_docs_have_python_snippets():
    assert len(snippets()) >= 8


def test_the_readme_and_the_guide_have_their_snippets():
    """The front door's examples (an actor, a learner, torch) and the
    guide's (a table's life, torch, weights to actors, a file-backed table)
    are among those run: a file left out of snippets() fails here."""
    files = [p.id.rsplit(":", 1)[0] for p in snippets()]
    assert files.count("README.md") >= 3, files
    assert files.count(os.path.join("docs", "guide.md")) >= 4, files


@pytest.mark.parametrize("code", snippets())
def test_snippet_runs(code, tmp_path):
    # a snippet that starts a local Ray puts its session under RAY_TMPDIR:
    # short (Ray's socket paths live there), and removed after
    ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    # Ray's token authentication comes with the environment (conftest.py:
    # token_auth): a local cluster a snippet starts demands it, and no token
    # file is kept in ~/.ray
    env = checkout_env(RAY_TMPDIR=ray_tmp, RAY_USAGE_STATS_ENABLED="0")
    env.pop("SHMREPLAY_SOCKET", None)
    p = subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert p.returncode == 0, f"snippet failed:\n{out}"
    left = [n for n in os.listdir("/dev/shm") if f"shmreplay.local{p.pid}x" in n]
    assert not left, f"the snippet's Server left {left} in /dev/shm"
