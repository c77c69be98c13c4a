"""Smoke tests of the benchmark scripts: ``benchmarks/core_overhead.py``,
``layers_speed.py`` and ``transformer_speed.py`` with ``--quick`` run and write their
sections.

Only checks that the scripts work (their same-math asserts included); no timing asserts,
since timings on a shared machine are noise at this size.
"""

import pytest

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

    # A second run replaces the section instead of appending another one.
    text = run_benchmark_quick(
        "core_overhead.py", "core_overhead", out, "--peer", "off", "--only", "(c)"
    )
    assert "(a) MLP step" not in text and "(c) jit identity" in text


def test_layers_speed_benchmark_quick(tmp_path):
    """``benchmarks/layers_speed.py --quick`` runs (same-math checks included) and writes
    its own section."""
    text = run_benchmark_quick("layers_speed.py", "layers_speed", tmp_path / "b.md")
    for needle in ("LSTM", "transpose", "FLOPs"):
        assert needle in text, needle


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
