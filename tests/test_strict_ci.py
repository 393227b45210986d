"""CI's strict mode (strict_ci.py): with CI=true a skip fails, for a test
and for a module skipped whole at collection; a skip for hardware CI has
not got ("needs CUDA: ...") and an xfail stay what they are.  Without
CI=true skips stay skips.  Each case is a nested pytest run over a small
test file, in a clean environment (conftest.nested_env)."""

import os
import subprocess
import sys

from conftest import nested_env

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = '''
import pytest
def test_runs(): pass
def test_skips(): pytest.skip("no such thing here")
@pytest.mark.skipif(True, reason="a marker says so")
def test_skipped_by_marker(): pass
def test_needs_a_gpu(): pytest.skip("needs CUDA: no GPU on this machine")
@pytest.mark.xfail(reason="known", strict=True)
def test_known_failure(): assert False
'''
WHOLE_MODULE = '''
import pytest
pytest.importorskip("shmreplay_no_such_module")
def test_never_runs(): pass
'''


def nested(tmp_path, source: str, ci: str | None) -> subprocess.CompletedProcess:
    """pytest over ``source`` with strict_ci loaded and CI set to ``ci`` (None: unset)."""
    (tmp_path / "test_cases.py").write_text(source)
    env = nested_env(PYTHONPATH=HERE)
    env.pop("CI", None)
    if ci is not None:
        env["CI"] = ci
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-p", "strict_ci", "test_cases.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)


def outcomes(out: str) -> dict[str, str]:
    got = {}
    for line in out.splitlines():
        word, _, rest = line.partition(" ")
        if word in ("PASSED", "FAILED", "ERROR", "XFAIL", "SKIPPED"):
            got[rest.split(" - ")[0].split("::")[-1] if "::" in rest else rest] = word
    return got


def test_with_ci_true_a_skip_fails_but_a_gpu_skip_and_an_xfail_do_not(tmp_path):
    run = nested(tmp_path, CASES, ci="true")
    got = outcomes(run.stdout)
    assert run.returncode == 1, run.stdout
    assert got["test_runs"] == "PASSED" and got["test_skips"] == "FAILED", run.stdout
    assert got["test_skipped_by_marker"] in ("FAILED", "ERROR"), run.stdout  # fails in its setup
    assert got["test_known_failure"] == "XFAIL", run.stdout
    assert "needs CUDA: no GPU on this machine" in run.stdout  # listed as a skip, not failed
    assert "CI=true: test test_cases.py::test_skips would be skipped (no such thing here)" in run.stdout


def test_with_ci_true_a_module_skipped_at_collection_fails(tmp_path):
    run = nested(tmp_path, WHOLE_MODULE, ci="true")
    assert run.returncode != 0 and "CI=true: module test_cases.py would be skipped" in run.stdout, run.stdout


def test_without_ci_skips_stay_skips(tmp_path):
    run = nested(tmp_path, CASES, ci=None)
    assert run.returncode == 0 and "1 passed, 3 skipped, 1 xfailed" in run.stdout, run.stdout
