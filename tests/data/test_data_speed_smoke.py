"""Smoke test: ``benchmarks/data_speed.py --quick`` runs (its equal-window asserts included)
and writes its section. No timing bounds (timings on a shared machine are noise here), but
every speed-up and the loader / step ratio must be finite positive numbers."""

import pytest

from tests.bench_checks import bold_ratios, section, table_column
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
    s = section(text, "data_speed")
    bold_ratios(s, at_least=6)  # memmap vs the 3 others, at L=500 and L=5000
    table_column(s, "L=500 vs h5py, chunked file", 1)  # windows/s
    table_column(s, "0", 1)  # batches/s with 0 workers
    table_column(s, "0", 3)  # loader / GRU steps
