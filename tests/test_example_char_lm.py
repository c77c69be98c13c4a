"""Smoke test: ``examples/char_lm.py --size tiny`` trains (loss falls) and samples with the
KV cache, in seconds."""

import re

import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)


def test_char_lm_example_runs_tiny_and_learns():
    out = run_script("examples/char_lm.py", "--size", "tiny", "--steps", "40", "--sample", "40")
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)  \(", out)]
    assert len(losses) == 10, out
    assert [int(n) for n in re.findall(r"^step=(\d+) loss=\d", out, re.M)] == list(range(1, 41))
    assert losses[-1] < 0.8 * losses[0], out
    assert "cache holds 43 of 44 positions" in out, out
    sample = out.split("sample:\n", 1)[1]
    assert sample.startswith("def ") and len(sample) >= 44, sample
