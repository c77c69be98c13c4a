"""Smoke test: ``benchmarks/ckpt_speed.py --quick`` runs and writes its section. No timing
bounds (timings on a shared machine are noise at this size), but every time and the
async / sync ratio must be finite positive numbers."""

import math
import re

import pytest

from tests.bench_checks import section, table_column
from tests.scripts import run_benchmark_quick

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)


def test_ckpt_speed_quick(tmp_path):
    text = run_benchmark_quick("ckpt_speed.py", "ckpt_speed", tmp_path / "benchmarks.md")
    for needle in ("async save (default)", "sync save", "restore (abstract target)"):
        assert needle in text, needle
    s = section(text, "ckpt_speed")
    for row in ("async save (default)", "sync save"):
        table_column(s, row, 1)  # loop blocked (ms)
        table_column(s, row, 2)  # until committed (ms)
    table_column(s, "restore (abstract target)", 1)
    ratio = re.search(r"blocks the loop ([-+0-9.e]+|nan|inf)x", s)
    assert ratio, s
    assert math.isfinite(float(ratio.group(1))) and float(ratio.group(1)) > 0, s
