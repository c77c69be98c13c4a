"""Smoke test: ``benchmarks/core_overhead.py --quick`` runs and writes its report.

Only checks that the script works (same-math asserts included); no timing asserts,
since timings on a shared machine are noise at this size.
"""

from tests.scripts import run_benchmark_quick


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
