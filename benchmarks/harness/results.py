"""Where a benchmark's JSON report goes, and writing it: ``--out``, else
``benchmarks/results/<name>-<time>.json`` (git-ignored).  Any thread."""

from __future__ import annotations

import json
import os
import time

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


def write(report: dict, name: str, out: str | None = None) -> str:
    """Write ``report`` as JSON; returns the path."""
    out = out or os.path.join(RESULTS, time.strftime(f"{name}-%Y%m%d-%H%M%S.json"))
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)
    return out
