"""``examples/gpt_tp.py --experts E --top-k K --expert-parallel N``: the GPT with an MoE
MLP in every block trains with expert parallelism (EP = 4 x data 2, and EP = 4 x TP 2
inside the experts) to the same step lines as the same MoE on one device (1e-5), with
the same per-expert loads, nothing dropped (dropless), and each device holding 1/N of
the expert kernels' bytes (N: the devices they are split over), counted here from the
layer's shapes.

The example runs in this process (its ``main(argv)``), on the 8 simulated CPU devices.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.scripts import load_example

STEP = re.compile(r"^step=(\d+) loss=(\S+)$", re.M)
MOE = re.compile(r"^moe step=(\d+) dropped=(\S+) load=(.+)$", re.M)
BYTES = re.compile(r"^expert_bytes_per_device=(\d+)$", re.M)
E, K, STEPS = 4, 2, 2
WIDTH, LAYERS = 32, 1  # the example's tiny size; the experts' hidden size is 2 x width


GPT = load_example("gpt_tp")


def _run(capsys, *argv):
    tiny = ["--size", "tiny", "--steps", str(STEPS), "--experts", str(E), "--top-k", str(K)]
    losses = GPT.main(tiny + list(argv))
    out = capsys.readouterr().out
    steps = [(int(n), float(v)) for n, v in STEP.findall(out)]
    assert [n for n, _ in steps] == list(range(1, STEPS + 1)), out
    assert [v for _, v in steps] == losses
    moe = MOE.findall(out)
    assert [int(n) for n, _, _ in moe] == list(range(1, STEPS + 1)), out
    loads = np.array([[float(v) for v in load.split()] for _, _, load in moe])
    dropped = [float(d) for _, d, _ in moe]
    return losses, loads, dropped, int(BYTES.search(out)[1])


@pytest.mark.standard_promotion  # the example's own Optax update (as users write it)
def test_expert_parallel_lines_equal_one_device(capsys):
    ref, ref_loads, ref_dropped, ref_bytes = _run(capsys, "--mesh", "1x1")
    # SwiGLU experts: gate, up (D, 2D) and down (2D, D) per expert, float32.
    full = LAYERS * E * 3 * WIDTH * 2 * WIDTH * 4
    assert ref_bytes == full
    assert ref_dropped == [0.0] * STEPS
    np.testing.assert_allclose(ref_loads.sum(axis=1), 1.0, atol=1e-3)
    for mesh, devices in (("2x1", 4), ("1x2", 8)):  # data x EP 4; EP 4 x TP 2
        losses, loads, dropped, nbytes = _run(capsys, "--mesh", mesh, "--expert-parallel", "4")
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=mesh)
        np.testing.assert_array_equal(loads, ref_loads, err_msg=mesh)
        assert dropped == [0.0] * STEPS, mesh
        assert nbytes <= 1.1 * full / devices, (mesh, nbytes, full)


def test_flag_misuse_is_refused(capsys):
    for argv, msg in (
        (["--expert-parallel", "3"], "--expert-parallel 3 must divide --experts 4"),
        (["--mesh", "4x1", "--expert-parallel", "4"], "needs 16 devices"),
        (["--fsdp"], "--experts does not combine with --fsdp"),
    ):
        with pytest.raises(SystemExit):
            GPT.main(["--size", "tiny", "--experts", "4", *argv])
        assert msg in capsys.readouterr().err, argv
