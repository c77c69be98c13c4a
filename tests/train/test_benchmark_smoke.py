"""Smoke test: ``benchmarks/train_step.py --quick`` runs its same-math checks and writes
its own section. No timing bounds (timings of a quick run on a shared machine are noise),
but every ratio must be finite and positive and the written same-math lines must show
equal losses and weights."""

import pytest

from tests.bench_checks import bold_ratios, loss_pairs, max_diffs, section
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
    s = section(text, "train_step")
    bold_ratios(s, at_least=6)  # (a), (b), two (c) rows, two not-donated rows
    max_diffs(s, at_least=4, tol=1e-5)  # (a), (b), (c), raw lax.scan
    loss_pairs(s, at_least=3)
