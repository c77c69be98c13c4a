"""Smoke test of ``examples/pipeline_lm.py`` at tiny size: GPipe and 1F1B on data x stage
x model meshes 1x4x1, 2x2x2 (DP x PP x TP) and 1x2x4 (PP x TP) and the unpipelined
one-device run print the same per-step losses (the example's contract, 1e-5), and each
prints the compiled step's temp bytes once."""

import re

import numpy as np
import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)

STEP = re.compile(r"^step=(\d+) loss=(\S+)$", re.M)
TEMP = re.compile(r"^temp_bytes=(\d+)$", re.M)


def _run(*args: str) -> tuple[list[float], int]:
    out = run_script("examples/pipeline_lm.py", "--size", "tiny", "--steps", "2", *args)
    found = STEP.findall(out)
    assert [int(n) for n, _ in found] == [1, 2], out
    temps = TEMP.findall(out)
    assert len(temps) == 1 and out.index("temp_bytes=") < out.index("step=1"), out
    return [float(v) for _, v in found], int(temps[0])


def test_pipeline_lm_schedules_agree_with_the_unpipelined_model():
    none, _ = _run("--schedule", "none")
    assert np.all(np.isfinite(none)) and none[1] < none[0], none  # it trains
    runs = {
        "gpipe 1x4x1": ("--schedule", "gpipe", "--microbatches", "8"),
        "1f1b 2x2x2": ("--schedule", "1f1b", "--microbatches", "4", "--data-parallel", "2",
                       "--stages", "2", "--tensor-parallel", "2"),
        "gpipe 1x2x4": ("--schedule", "gpipe", "--microbatches", "4", "--stages", "2",
                        "--tensor-parallel", "4"),
        "1f1b 1x4x1": ("--schedule", "1f1b", "--microbatches", "4"),
    }  # fmt: skip
    for name, args in runs.items():
        losses, temp = _run(*args)
        np.testing.assert_allclose(losses, none, rtol=1e-5, err_msg=name)
        assert temp > 0, name


def test_pipeline_speed_quick_writes_its_section(tmp_path):
    from tests.scripts import run_benchmark_quick

    plot = tmp_path / "memory.png"
    text = run_benchmark_quick(
        "pipeline_speed.py", "pipeline_speed", tmp_path / "b.md", "--plot", str(plot)
    )
    for needle in ["GPipe vs 1F1B vs sequential", "(p-1)/(m+p-1)", "idle, busy-time weighted",
                   "| gpipe | 8 |", "| 1f1b | 8 |", "| 1f1b-2f | 8 |", "busy, 1f1b-2f",
                   "step time 1f1b-2f / 1f1b", "loss rel. error"]:  # fmt: skip
        assert needle in text, needle
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "pipeline_busy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
