"""Smoke tests for issue 5's scripts: ``examples/digits_cnn.py --size tiny`` learns, and
``benchmarks/cnn_speed.py --quick`` runs its same-math checks and writes its section.

No timing asserts: timings on a shared machine are noise at these sizes.
"""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_digits_cnn_tiny_learns():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "digits_cnn.py"), "--size", "tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    losses = [float(m) for m in re.findall(r"test loss (\d+\.\d+)", out)]
    assert len(losses) >= 5, out
    assert losses[-1] < 0.5 * losses[0], out
    accuracy = float(re.search(r"final test accuracy (\d\.\d+)", out).group(1))
    assert accuracy >= 0.8, out  # chance is 0.1; the default size reaches >= 0.97
    assert "net/cnn/conv1/kernel" in out and "(3, 3, 1, 32)" in out, out


def test_cnn_speed_quick_writes_its_section(tmp_path):
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n\nKept text.\n")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "cnn_speed.py"), "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nKept text.\n")
    for needle in [
        "<!-- bench:cnn_speed:begin -->",
        "<!-- bench:cnn_speed:end -->",
        "CNN train step",
        "ratio of minima",
        "optimised-HLO FLOPs",
        "`transpose` instructions",
        "first loss: blox",
    ]:
        assert needle in text, needle
    flops = re.search(r"optimised-HLO FLOPs \| (\d+) \| (\d+) \| yes", text)
    assert flops and flops.group(1) == flops.group(2), text
