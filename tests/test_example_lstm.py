"""Smoke test: ``examples/lstm_sequence.py --size tiny`` runs and its loss falls."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_lstm_sequence_example_runs_tiny_and_learns():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "lstm_sequence.py"), "--size", "tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = re.findall(r"epoch +\d+ +loss (\d+\.\d+) +test mse (\d+\.\d+)", proc.stdout)
    losses = [float(a) for a, _ in rows]
    tests = [float(b) for _, b in rows]
    assert len(losses) == 4 and len(tests) == 4, proc.stdout
    assert losses[-1] < 0.8 * losses[0], proc.stdout
    assert tests[-1] < 0.8 * tests[0], proc.stdout
    assert "truncated BPTT, state carried" in proc.stdout
