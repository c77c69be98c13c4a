"""Smoke test: ``benchmarks/train_step.py --quick`` runs its same-math checks and writes
its own section (no timing asserts: timings of a quick run on a shared machine are noise)."""

import pytest

from tests.scripts import run_benchmark_quick

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)


def test_train_step_benchmark_quick(tmp_path):
    text = run_benchmark_quick("train_step.py", "train_step", tmp_path / "benchmarks.md")
    for needle in [
        "(a) hand-written split/grad/merge step",
        "(b) bx.make_train_step",
        "(c) bx.steps_per_dispatch k=10, per step",
        "max |weight diff| after 10 Adam steps",
    ]:
        assert needle in text, needle
