"""Smoke test of ``examples/pipeline_lm.py`` at tiny size: GPipe, interleaved 1F1B, ZB-H1
and ZB-V, on data x stage x model meshes 1x4x1, 1x2x1 (ZB-V) and (interleaved) 2x2x2 (DP x
PP x TP), and the
unpipelined one-device run print the same per-step losses (the example's contract, 1e-5),
and each prints its schedule table and the compiled step's temp bytes once. All runs share
one process (one JAX start-up), each through the script's own ``main(argv)``."""

import json
import re

import numpy as np
import pytest

from tests.scripts import run_ok

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)

STEP = re.compile(r"^step=(\d+) loss=(\S+)$", re.M)
TEMP = re.compile(r"^temp_bytes=(\d+)$", re.M)
# Runs main(argv) of the example for each named argv, each output (stderr and the exit
# status of a flag error included) after a marker line.
RUNNER = """
import contextlib, json, sys
sys.path.insert(0, "examples")
import pipeline_lm
for name, argv in json.loads(sys.argv[1]).items():
    print(f"=== {name}", flush=True)
    with contextlib.redirect_stderr(sys.stdout):
        try:
            pipeline_lm.main(["--size", "tiny", "--steps", "2", *argv])
        except SystemExit as e:
            print(f"exit={e.code}", flush=True)
"""


def _runs(runs: dict[str, list[str]]) -> dict[str, str]:
    out = run_ok("-c", RUNNER, json.dumps(runs), timeout=600)
    parts = re.split(r"^=== (.+)$", out, flags=re.M)[1:]
    got = dict(zip(parts[::2], parts[1::2], strict=True))
    assert list(got) == list(runs), out[-3000:]
    return got


def _parse(name: str, out: str) -> tuple[list[float], int]:
    found = STEP.findall(out)
    assert [int(n) for n, _ in found] == [1, 2], (name, out)
    temps = TEMP.findall(out)
    assert len(temps) == 1 and out.index("temp_bytes=") < out.index("step=1"), (name, out)
    return [float(v) for _, v in found], int(temps[0])


def test_pipeline_lm_schedules_agree_with_the_unpipelined_model():
    runs = {
        "none": ["--schedule", "none"],
        "gpipe 1x4x1": ["--schedule", "gpipe", "--microbatches", "8"],
        # (1F1B, the same runtime as GPipe with another table, and ZB-H1 on a 2x2x2
        # mesh: tests/parallel/test_pipeline_3d.py)
        "interleaved v2 2x2x2": ["--schedule", "interleaved", "--virtual-stages", "2",
                                 "--microbatches", "4", "--data-parallel", "2", "--stages", "2",
                                 "--tensor-parallel", "2"],
        "zb 1x4x1": ["--schedule", "zb", "--microbatches", "4"],
        "zbv 1x2x1": ["--schedule", "zbv", "--stages", "2", "--microbatches", "4"],
        # 4 tiny blocks cannot be cut into 4 stages x 2 chunks: a flag error says so
        "interleaved 1x4x1": ["--schedule", "interleaved"],
    }  # fmt: skip
    outs = _runs(runs)
    bad = outs.pop("interleaved 1x4x1")
    assert "--stages 4 x --virtual-stages 2 must divide the 4 blocks" in bad and "exit=2" in bad
    none, _ = _parse("none", outs["none"])
    assert np.all(np.isfinite(none)) and none[1] < none[0], none  # it trains
    for name in list(outs)[1:]:
        losses, temp = _parse(name, outs[name])
        np.testing.assert_allclose(losses, none, rtol=1e-5, err_msg=name)
        assert temp > 0, name
    # each prints the table it follows (4 tiny blocks: 2 devices x 2 chunks of one block)
    assert "gpipe: 4 stages x 8 microbatches" in outs["gpipe 1x4x1"]
    assert "interleaved: 2 stages x 2 chunks x 4 microbatches" in outs["interleaved v2 2x2x2"]
    assert "F0.1" in outs["interleaved v2 2x2x2"]
    assert "zb-h1: 4 stages x 4 microbatches" in outs["zb 1x4x1"]
    assert "zb-v: 2 stages x 2 chunks (V) x 4 microbatches" in outs["zbv 1x2x1"]


def test_pipeline_speed_quick_writes_its_section(tmp_path):
    from tests.scripts import run_benchmark_quick

    plot = tmp_path / "memory.png"
    text = run_benchmark_quick(
        "pipeline_speed.py", "pipeline_speed", tmp_path / "b.md", "--plot", str(plot)
    )
    for needle in ["GPipe vs 1F1B vs interleaved vs ZB-H1 vs ZB-V vs sequential",
                   "(p-1)/(m+p-1)", "idle, measured cells, pairs", "slot bound",
                   "| gpipe | 8 |", "| 1f1b | 8 |",
                   "| 1f1b-2f | 8 |", "| interleaved | 8 |", "| zb | 8 |", "| zbv | 8 |",
                   "busy, interleaved", "busy, zb", "busy, zbv", "step time 1f1b-2f / 1f1b",
                   "step time zb / 1f1b", "step time zbv / 1f1b", "temp / 1f1b temp",
                   "interleaved m=8: loss rel. error", "zb m=8: loss rel. error",
                   "zbv m=8: loss rel. error"]:  # fmt: skip
        assert needle in text, needle
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "pipeline_busy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
