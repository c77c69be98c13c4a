"""Smoke test of examples/yolo_blocks.py at tiny size: it runs, prints the parameter
table and the output shape at every scale, and the loss goes down."""

import re

import pytest

from tests.scripts import run_script

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)


def test_yolo_example_runs_tiny_and_the_loss_drops():
    out = run_script("examples/yolo_blocks.py", "--size", "tiny", timeout=600)
    assert "total:" in out and "yolo/features/backbone/stem/conv/kernel" in out, out
    assert "yolo/features/neck/out_p5/cv2/bn/running_var" in out, out
    # 32x32 inputs: 4x4, 2x2 and 1x1 maps at strides 8, 16, 32.
    assert "stride  8: features (8, 4, 4, 8)  objectness (8, 4, 4, 1)" in out, out
    assert "stride 16: features (8, 2, 2, 8)" in out, out
    assert "stride 32: features (8, 1, 1, 8)" in out, out
    losses = [float(v) for v in re.findall(r"step +\d+  loss (\d+\.\d+)", out)]
    assert len(losses) == 12, out
    assert len(re.findall(r"^step=\d+ loss=\d", out, re.M)) >= 12, out
    assert np_mean(losses[-3:]) < 0.95 * losses[0], losses


def np_mean(values):
    return sum(values) / len(values)
