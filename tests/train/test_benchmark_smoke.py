"""Smoke test: ``benchmarks/train_step.py --quick`` runs its same-math checks and writes
its own section (no timing asserts: timings of a quick run on a shared machine are noise)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "benchmarks", "train_step.py")


def test_train_step_benchmark_quick(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\nKept text.\n")
    cmd = [sys.executable, SCRIPT, "--quick", "--out", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nKept text.\n")
    for needle in [
        "<!-- bench:train_step:begin -->",
        "<!-- bench:train_step:end -->",
        "(a) hand-written split/grad/merge step",
        "(b) bx.make_train_step",
        "(c) bx.steps_per_dispatch k=10, per step",
        "max |weight diff| after 10 Adam steps",
    ]:
        assert needle in text, needle
