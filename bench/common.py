"""What the benchmark scripts share: the test helpers (the SSH lab, running dtf) and the way
figures are printed. The scripts reuse the tests' own code rather than a copy of it."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # tests/lab.py and tests/helpers.py


def fmt(xs: list[float]) -> str:
    return f"median {statistics.median(xs):6.2f}s  (min {min(xs):.2f}, max {max(xs):.2f}, n={len(xs)})"
