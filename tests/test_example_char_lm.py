"""Smoke test: ``examples/char_lm.py --size tiny`` trains (loss falls) and samples with the
KV cache, in seconds."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_char_lm_example_runs_tiny_and_learns():
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "char_lm.py"),
            "--size",
            "tiny",
            "--steps",
            "40",
            "--sample",
            "40",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)  \(", proc.stdout)]
    assert len(losses) == 10, proc.stdout
    assert losses[-1] < 0.8 * losses[0], proc.stdout
    assert "cache holds 43 of 44 positions" in proc.stdout, proc.stdout
    sample = proc.stdout.split("sample:\n", 1)[1]
    assert sample.startswith("def ") and len(sample) >= 44, sample
