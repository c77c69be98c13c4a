"""Smoke test: ``benchmarks/ckpt_speed.py --quick`` runs and writes its section (no timing
asserts: timings on a shared machine are noise at this size)."""

import pytest

from tests.scripts import run_benchmark_quick

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)


def test_ckpt_speed_quick(tmp_path):
    text = run_benchmark_quick("ckpt_speed.py", "ckpt_speed", tmp_path / "benchmarks.md")
    for needle in ("async save (default)", "sync save", "restore (abstract target)"):
        assert needle in text, needle
