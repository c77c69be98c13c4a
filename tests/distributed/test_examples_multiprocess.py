"""The parallel examples in several processes: through ``python -m blox.launch -n 2
--devices-per-process 4``, ``examples/dp_classifier.py`` (DP over 8 devices) and
``examples/gpt_tp.py --mesh 2x4`` (DP x TP, the model axis inside each process, the data
axis across them) and ``examples/gpt_tp.py`` with context parallelism (the sequence split
over all 8 devices, across the processes; and data x model x context with the all-gather
variant) print the same ``step=<n> loss=<repr>`` lines on rank 0 as one process
with 8 devices, to 1e-6; rank 1 prints the same values as rank 0 (one replicated loss).

Reference: the single-process runs of the same scripts on 8 simulated devices. The four
runs go side by side (subprocesses) to keep the wall time small.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.scripts import LAUNCH, finish, start

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)

STEPS = "3"
_GPT = ("examples/gpt_tp.py", "--size", "tiny", "--steps", STEPS)
RUNS = {
    "dp": ("examples/dp_classifier.py", "--size", "tiny", "--steps", STEPS),
    "gpt": (*_GPT, "--mesh", "2x4"),
    # context parallelism: the sequence split over 8 devices, so across both processes
    "gpt_cp_ring": (*_GPT, "--mesh", "1x1", "--context-parallel", "8"),
    # data across the processes, model x context (all-gather variant) inside each
    "gpt_cp_allgather": (
        *_GPT,
        "--mesh",
        "2x2",
        "--context-parallel",
        "2",
        "--cp-variant",
        "allgather",
    ),
}
TWO = ("-n", "2", "--devices-per-process", "4")


def _lines(out: str, tag: str = "") -> list[str]:
    return [line[len(tag) :] for line in out.splitlines() if line.startswith(tag + "step=")]


def _losses(lines: list[str]) -> np.ndarray:
    return np.array([float(re.fullmatch(r"step=\d+ loss=(\S+)", s)[1]) for s in lines])


def test_two_processes_print_the_lines_of_one_process_on_eight_devices():
    procs = {}
    for name, argv in RUNS.items():
        procs[f"{name}/1x8"] = start(*argv)
        procs[f"{name}/2x4"] = start(*LAUNCH, *TWO, *argv)
    outs = finish(procs)

    for name in RUNS:
        one, two = outs[f"{name}/1x8"], outs[f"{name}/2x4"]
        assert "over 8 cpu devices (cpu), 1 process" in one, one
        assert "[0] Mesh(" in two and "over 8 cpu devices (cpu), 2 processes" in two, two
        reference, rank0, rank1 = _lines(one), _lines(two, "[0] "), _lines(two, "[1] ")
        assert len(reference) == len(rank0) == len(rank1) == int(STEPS), (name, two[-3000:])
        assert [s.split()[0] for s in rank0] == [s.split()[0] for s in reference]
        np.testing.assert_allclose(
            _losses(rank0), _losses(reference), rtol=0, atol=1e-6, err_msg=name
        )
        np.testing.assert_array_equal(_losses(rank1), _losses(rank0), err_msg=name)
