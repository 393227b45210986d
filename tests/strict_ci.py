"""CI's strict mode: with ``CI=true`` in the environment, a test that would
be skipped fails instead, and so does a test module skipped whole at
collection (``pytest.importorskip``, a module-level ``skipif``).

Why: the test extra installs every dependency the suite uses and CI runs as
root, so a skip there can only mean a broken install or a broken machine,
which must not pass as green.  Outside CI (a developer's box without root,
say) skips stay skips, and ``-ra`` lists them.

The one skip CI allows is a test for hardware the CI machine has not got:
a reason starting with one of ``ALLOWED`` (a GPU: the pinned-memory path of
shmreplay.torch).  An xfail is not a skip and is left alone.

Loaded by tests/conftest.py (``pytest_plugins``); a nested run loads it
with ``-p strict_ci``.
"""

from __future__ import annotations

import os

import pytest

ALLOWED = ("needs CUDA:",)


def strict() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def _reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:  # (path, line, "Skipped: reason")
        return str(lr[2]).removeprefix("Skipped: ")
    return str(lr)


def _fail_skip(report, where: str) -> None:
    reason = _reason(report)
    if any(reason.startswith(a) for a in ALLOWED):
        return
    report.outcome = "failed"
    report.longrepr = (f"CI=true: {where} would be skipped ({reason}).  CI installs every test "
                       "dependency (pip install '.[test]') and runs as root, so a skip here means a "
                       "broken install or machine: fix that (or, for hardware CI lacks, give the "
                       f"skip a reason starting with one of {ALLOWED} in tests/strict_ci.py).")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if strict() and report.skipped and not hasattr(report, "wasxfail"):
        _fail_skip(report, f"test {item.nodeid}")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if strict() and report.skipped:
        _fail_skip(report, f"module {collector.nodeid}")
