"""Smoke test: ``benchmarks/data_speed.py --quick`` runs (its equal-window asserts included)
and writes its section; no timing asserts (timings on a shared machine are noise here)."""

import pytest

from tests.scripts import run_benchmark_quick

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)


def test_data_speed_quick(tmp_path):
    out = tmp_path / "benchmarks.md"
    text = run_benchmark_quick("data_speed.py", "data_speed", out, "--size-mb", "2")
    for needle in [
        "L=500 vs h5py, chunked file",
        "L=5000 vs list of slices",
        "Loader vs a GRU train step",
        "| 0 |",
    ]:
        assert needle in text, needle
