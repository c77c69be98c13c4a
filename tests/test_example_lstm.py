"""Smoke test: ``examples/lstm_sequence.py --size tiny`` runs and its loss falls."""

import re

import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)


def test_lstm_sequence_example_runs_tiny_and_learns():
    out = run_script("examples/lstm_sequence.py", "--size", "tiny")
    rows = re.findall(r"epoch +\d+ +loss (\d+\.\d+) +test mse (\d+\.\d+)", out)
    losses = [float(a) for a, _ in rows]
    tests = [float(b) for _, b in rows]
    assert len(losses) == 4 and len(tests) == 4, out
    assert losses[-1] < 0.8 * losses[0], out
    assert tests[-1] < 0.8 * tests[0], out
    assert "truncated BPTT, state carried" in out
