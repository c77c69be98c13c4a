"""Smoke tests of the CNN scripts: ``examples/digits_cnn.py --size tiny`` learns, and
``benchmarks/cnn_speed.py --quick`` runs its same-math checks and writes its section.

No timing asserts: timings on a shared machine are noise at these sizes.
"""

import re

import pytest

from tests.bench_checks import bold_ratios, loss_pairs, max_diffs, section
from tests.scripts import run_benchmark_quick, run_script

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)


def test_digits_cnn_tiny_learns():
    out = run_script("examples/digits_cnn.py", "--size", "tiny")
    losses = [float(m) for m in re.findall(r"test loss (\d+\.\d+)", out)]
    assert len(losses) >= 5, out
    assert losses[-1] < 0.5 * losses[0], out
    accuracy = float(re.search(r"final test accuracy (\d\.\d+)", out).group(1))
    assert accuracy >= 0.8, out  # chance is 0.1; the default size reaches >= 0.97
    assert "net/cnn/conv1/kernel" in out and "(3, 3, 1, 32)" in out, out


def test_cnn_speed_quick_writes_its_section(tmp_path):
    text = run_benchmark_quick("cnn_speed.py", "cnn_speed", tmp_path / "benchmarks.md")
    for needle in [
        "CNN train step",
        "ratio of minima",
        "optimised-HLO FLOPs",
        "`transpose` instructions",
        "first loss: blox",
    ]:
        assert needle in text, needle
    flops = re.search(r"optimised-HLO FLOPs \| (\d+) \| (\d+) \| yes", text)
    assert flops and flops.group(1) == flops.group(2), text
    s = section(text, "cnn_speed")
    bold_ratios(s, at_least=1)  # finite and positive
    max_diffs(s, at_least=1, tol=1e-6)
    loss_pairs(s, at_least=1)
