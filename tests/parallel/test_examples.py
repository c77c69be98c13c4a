"""Smoke tests of the parallel examples at tiny size: the printed per-step losses agree
across meshes (the examples' contract), and the GPT example prints its sharding table."""

import re

import numpy as np

from tests.scripts import run_script

STEP = re.compile(r"^step=(\d+) loss=(\S+)$", re.M)


def _losses(out: str) -> list[float]:
    found = STEP.findall(out)
    assert found and [int(n) for n, _ in found] == list(range(1, len(found) + 1)), out
    return [float(v) for _, v in found]


def test_dp_classifier_losses_agree_for_1_and_8_devices():
    one = _losses(run_script("examples/dp_classifier.py", "--size", "tiny", "--steps", "3",
                             "--data-parallel", "1"))  # fmt: skip
    eight = _losses(run_script("examples/dp_classifier.py", "--size", "tiny", "--steps", "3",
                               "--data-parallel", "8", "--accumulate", "2"))  # fmt: skip
    assert len(one) == len(eight) == 3
    np.testing.assert_allclose(eight, one, rtol=1e-5)


def test_gpt_tp_losses_agree_across_meshes():
    runs = {}
    for mesh in ("1x1", "2x4"):
        out = run_script("examples/gpt_tp.py", "--size", "tiny", "--steps", "2", "--mesh", mesh)
        runs[mesh] = _losses(out)
    assert "gpt/lm/block_0/mlp/linear_1/kernel" in out and "P('model', None)" in out, out
    np.testing.assert_allclose(runs["2x4"], runs["1x1"], rtol=1e-5)


def test_parallel_speed_quick_writes_its_section(tmp_path):
    from tests.scripts import run_benchmark_quick

    text = run_benchmark_quick("parallel_speed.py", "parallel_speed", tmp_path / "b.md")
    for needle in ["(a) DP train step, 8 devices", "(b) TP block fwd+bwd", "ratio of minima",
                   "max |weight diff| after one Adam step"]:  # fmt: skip
        assert needle in text, needle
