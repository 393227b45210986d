"""Draw new examples for the suite's property tests, round after round.

The suite itself runs them derandomized (tests/conftest.py: the same
examples every run, so a submission fails only for a change in the code).
This program is the other half: it runs the property tests with the
"random" hypothesis profile, ``--rounds`` times, each round with fresh
examples, and stops at the first failure, printing hypothesis's falsifying
example and its ``@reproduce_failure`` blob (paste it above the test to
replay it).  Run it after touching a kernel or its twin, or nightly::

    python3 benchmarks/fuzz_properties.py --rounds 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROPERTY_MODULES = ["tests/test_sumtree.py"]  # every module that uses hypothesis


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="runs of the property tests, each with new examples")
    args = ap.parse_args()
    for r in range(1, args.rounds + 1):
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
                              "--hypothesis-profile=random", *PROPERTY_MODULES], cwd=ROOT,
                             capture_output=True, text=True)
        last = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
        print(f"round {r}: {last}", flush=True)
        if run.returncode != 0:
            print(run.stdout[-20000:], run.stderr[-5000:], sep="\n")
            return 1
    print(f"{args.rounds} rounds of new examples: no failure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
