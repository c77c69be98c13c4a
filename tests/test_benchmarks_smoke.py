"""Smoke tests of the benchmark scripts: ``benchmarks/core_overhead.py``,
``layers_speed.py`` and ``transformer_speed.py`` with ``--quick`` run and write their
sections.

No timing bounds, since timings on a shared machine are noise at this size; but every
reported ratio must be a finite positive number, the written same-math lines must show
equal losses and weights (to the 1e-6 the scripts assert), and the FLOPs of blox and raw
must be equal (tests/bench_checks.py).
"""

import pytest

from tests.bench_checks import (
    bold_ratios,
    equal_flops,
    loss_pairs,
    max_diffs,
    section,
    table_column,
)
from tests.scripts import run_benchmark_quick

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)


def test_core_overhead_quick(tmp_path):
    out = tmp_path / "benchmarks.md"
    text = run_benchmark_quick("core_overhead.py", "core_overhead", out, "--peer", "off")
    for needle in [
        "(a) MLP step",
        "(b) 4 Linear step, donated",
        "(c) jit identity",
        "tree_flatten",
        "Optimised-HLO FLOPs",
    ]:
        assert needle in text, needle
    s = section(text, "core_overhead")
    bold_ratios(s, at_least=9)  # (a) and (b) plain, donated and diagnostic rows, (c)
    table_column(s, "tree_flatten", 3)  # Params / dict
    table_column(s, "tree_unflatten", 3)
    max_diffs(s, at_least=2, tol=1e-6)  # (a), (b): weights after one Adam step
    loss_pairs(s, at_least=2)
    equal_flops(s, at_least=2)

    # A second run replaces the section instead of appending another one.
    text = run_benchmark_quick(
        "core_overhead.py", "core_overhead", out, "--peer", "off", "--only", "(c)"
    )
    assert "(a) MLP step" not in text and "(c) jit identity" in text
    bold_ratios(section(text, "core_overhead"), at_least=1)


def test_layers_speed_benchmark_quick(tmp_path):
    """``benchmarks/layers_speed.py --quick`` runs (same-math checks included) and writes
    its own section."""
    text = run_benchmark_quick("layers_speed.py", "layers_speed", tmp_path / "b.md")
    for needle in ("LSTM", "transpose", "FLOPs"):
        assert needle in text, needle
    s = section(text, "layers_speed")
    bold_ratios(s, at_least=1)
    max_diffs(s, at_least=1, tol=1e-6)
    loss_pairs(s, at_least=1)
    equal_flops(s, at_least=1)


def test_transformer_benchmark_quick_smoke(tmp_path):
    """``benchmarks/transformer_speed.py --quick`` runs (same-math checks included) and
    writes only its own section."""
    text = run_benchmark_quick("transformer_speed.py", "transformer_speed", tmp_path / "b.md")
    for needle in [
        "LM train step",
        "KV-cache decode",
        "Optimised-HLO FLOPs",
        "transpose ops in the optimised HLO of the step",
    ]:
        assert needle in text, needle
    s = section(text, "transformer_speed")
    bold_ratios(s, at_least=1)
    max_diffs(s, at_least=1, tol=1e-6)
    loss_pairs(s, at_least=1)
    equal_flops(s, at_least=1)
    for fill in ("1", "16", "31"):  # decode per token: min vs fill 1, and the full forward
        table_column(s, fill, 3)
        table_column(s, fill, 4)
