"""Smoke test: ``benchmarks/core_overhead.py --quick`` runs and writes its report.

Only checks that the script works (same-math asserts included); no timing asserts,
since timings on a shared machine are noise at this size.
"""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "benchmarks", "core_overhead.py")


def test_core_overhead_quick(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\nKept text.\n")
    cmd = [sys.executable, SCRIPT, "--quick", "--peer", "off", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nKept text.\n")
    for needle in [
        "<!-- bench:core_overhead:begin -->",
        "<!-- bench:core_overhead:end -->",
        "(a) MLP step",
        "(b) 4 Linear step, donated",
        "(c) jit identity",
        "tree_flatten",
        "Optimised-HLO FLOPs",
    ]:
        assert needle in text, needle

    # A second run replaces the section instead of appending another one.
    res = subprocess.run(
        cmd + ["--only", "(c)"], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    assert text.count("<!-- bench:core_overhead:begin -->") == 1
    assert "(a) MLP step" not in text and "(c) jit identity" in text
