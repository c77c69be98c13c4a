"""``examples/gpt_tp.py --context-parallel C [--cp-variant ring|allgather]``: the GPT
with each sequence split over a ``context`` mesh axis trains to the step lines of
``--mesh 1x1`` (1e-5): ring attention over data 2 x context 4; the all-gather variant
over model 2 x context 4 with FSDP; the dense MoE over data 2 x context 2 against the
same MoE on one device. The ring's attention temporaries per device (``attn_temp_bytes``)
are below one device's on the whole batch; the flags' errors.

The example runs in this process (its ``main(argv)``), on the 8 simulated CPU devices.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.scripts import load_example

STEP = re.compile(r"^step=(\d+) loss=(\S+)$", re.M)
TEMP = re.compile(r"^attn_temp_bytes=(\d+)$", re.M)
STEPS = 2


GPT = load_example("gpt_tp")


def _run(capsys, *argv):
    losses = GPT.main(["--size", "tiny", "--steps", str(STEPS), *argv])
    out = capsys.readouterr().out
    lines = [(int(s), float(v)) for s, v in STEP.findall(out)]
    assert [s for s, _ in lines] == list(range(1, STEPS + 1)), out
    assert [v for _, v in lines] == losses  # the printed lines are repr(float(loss))
    (temp,) = TEMP.findall(out)
    return np.array(losses), int(temp)


def test_context_parallel_lines_equal_one_device(capsys):
    one, temp_one = _run(capsys, "--mesh", "1x1")
    ring, temp_ring = _run(capsys, "--mesh", "2x1", "--context-parallel", "4")
    gather, _ = _run(
        capsys, "--mesh", "1x2", "--context-parallel", "4", "--cp-variant", "allgather", "--fsdp"
    )
    np.testing.assert_allclose(ring, one, rtol=1e-5)
    np.testing.assert_allclose(gather, one, rtol=1e-5)
    assert 0 < temp_ring < temp_one
    moe_one, _ = _run(capsys, "--mesh", "1x1", "--experts", "4")
    moe_cp, _ = _run(capsys, "--mesh", "2x1", "--context-parallel", "2", "--experts", "4")
    np.testing.assert_allclose(moe_cp, moe_one, rtol=1e-5)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--context-parallel", "2", "--experts", "4", "--expert-parallel", "2"],
         "--context-parallel does not combine with --expert-parallel"),
        (["--cp-variant", "ring"], "--cp-variant needs --context-parallel C"),
        (["--context-parallel", "3"], "--context-parallel 3 must divide the context length 16"),
        (["--mesh", "2x2", "--context-parallel", "4"],
         "--mesh 2x2 x --context-parallel 4 needs 16 devices"),
    ],
)  # fmt: skip
def test_context_parallel_flag_errors(capsys, argv, message):
    with pytest.raises(SystemExit):
        GPT.main(["--size", "tiny", "--steps", "1", *argv])
    assert message in capsys.readouterr().err
