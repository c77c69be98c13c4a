"""Smoke tests of the parallel examples at tiny size: the printed per-step losses agree
across meshes (the examples' contract), the GPT example prints its sharding table, and a
run stopped and resumed from its checkpoint (``--ckpt-dir``, ``--save-every``) prints the
lines of a run that never stopped: bit for bit on the same mesh (exact resume, the DP
example), within 1e-5 when ``examples/gpt_tp.py`` resumes a TP = 2 checkpoint written on a
4x2 mesh on 2x4 (TP = 4) or 8x1 (DP only), a checkpoint restored onto another mesh.
(``gpt_tp.py --fsdp`` in one process is checked beside the launched run, in
tests/parallel/test_fsdp_multiprocess.py.)

References: the uninterrupted run of the same script on the mesh compared with; the
1-device run for the DP example. The runs of one test that do not depend on each other
run side by side (subprocesses), to keep the wall time small.
"""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest

from blox import ckpt
from tests.scripts import finish, run_benchmark_quick, start

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)

STEP = re.compile(r"^step=(\d+) loss=(\S+)$", re.M)


def _run_all(*commands: tuple[str, ...]) -> list[str]:
    """Runs each ``(script, *args)`` in its own process, side by side; their stdouts."""
    return list(finish({(i, *cmd): start(*cmd) for i, cmd in enumerate(commands)}).values())


def _lines(out: str, first: int = 1) -> list[str]:
    """The ``step=<n> loss=<repr>`` lines, checked to number first, first + 1, ..."""
    found = STEP.findall(out)
    assert [int(n) for n, _ in found] == list(range(first, first + len(found))), out
    return [f"step={n} loss={v}" for n, v in found]


def _steps(directory) -> list[int]:
    with ckpt.CheckpointManager(directory) as mngr:
        return mngr.all_steps()


def _losses(lines: list[str]) -> list[float]:
    return [float(STEP.match(s)[2]) for s in lines]


DP = "examples/dp_classifier.py"
GPT = "examples/gpt_tp.py"


def _copy(src, dst, *, keep_step: int):
    """A copy of the checkpoint directory `src` as it was after step `keep_step`."""

    def ignore(directory, names):
        if directory != str(src):
            return []
        return [n for n in names if n.isdigit() and int(n) > keep_step]

    shutil.copytree(src, dst, ignore=ignore)
    return str(dst)


def test_dp_classifier_agrees_across_devices_and_resumes_bit_for_bit(tmp_path):
    tiny = ("--size", "tiny", "--accumulate", "2")
    saved = tmp_path / "saved"
    one, full = _run_all(
        (DP, "--size", "tiny", "--steps", "4", "--data-parallel", "1"),
        # Uninterrupted; checkpoints step 3 (--save-every 3) and step 4 (the end).
        (DP, *tiny, "--steps", "4", "--ckpt-dir", str(saved), "--save-every", "3"),
    )
    assert _steps(saved) == [3, 4]
    # A run killed after step 3 left the directory as it was then; resume it.
    (resumed,) = _run_all(
        (DP, *tiny, "--steps", "4", "--ckpt-dir", _copy(saved, tmp_path / "a", keep_step=3))
    )
    assert "resumed from step 3 of " in resumed

    reference = _lines(full)
    assert len(reference) == 4
    np.testing.assert_allclose(_losses(reference), _losses(_lines(one)), rtol=1e-5)
    # The repr of a float32 loss pins its bits: equal strings are equal float bits.
    assert _lines(resumed, first=4) == reference[3:]
    assert _steps(tmp_path / "a") == [3, 4]


def test_gpt_tp_resumes_on_another_mesh(tmp_path):
    tiny = ("--size", "tiny")
    saved = tmp_path / "saved_4x2"
    stopped, full_2x4, full_8x1 = _run_all(
        # TP = 2; stops after step 2, which it saves on the way out.
        (GPT, *tiny, "--mesh", "4x2", "--steps", "2", "--ckpt-dir", str(saved)),
        (GPT, *tiny, "--mesh", "2x4", "--steps", "3"),
        (GPT, *tiny, "--mesh", "8x1", "--steps", "3"),
    )
    assert "gpt/lm/block_0/mlp/linear_1/kernel" in stopped and "P('model', None)" in stopped
    assert _steps(saved) == [2]
    on_2x4, on_8x1 = _run_all(
        (
            GPT,
            *tiny,
            "--mesh",
            "2x4",
            "--steps",
            "3",
            "--ckpt-dir",
            _copy(saved, tmp_path / "b", keep_step=2),
        ),
        (
            GPT,
            *tiny,
            "--mesh",
            "8x1",
            "--steps",
            "3",
            "--ckpt-dir",
            _copy(saved, tmp_path / "c", keep_step=2),
        ),
    )
    for out in (on_2x4, on_8x1):
        assert "resumed from step 2 of " in out, out

    # The meshes agree with each other (the example's contract) ...
    ref_2x4, ref_8x1, first_4x2 = _lines(full_2x4), _lines(full_8x1), _lines(stopped)
    assert len(ref_2x4) == len(ref_8x1) == 3 and len(first_4x2) == 2
    np.testing.assert_allclose(_losses(ref_8x1), _losses(ref_2x4), rtol=1e-5)
    np.testing.assert_allclose(_losses(first_4x2), _losses(ref_2x4[:2]), rtol=1e-5)
    # ... and the TP = 2 checkpoint continues on TP = 4 and on DP only as those meshes do.
    np.testing.assert_allclose(_losses(_lines(on_2x4, 3)), _losses(ref_2x4[2:]), rtol=1e-5)
    np.testing.assert_allclose(_losses(_lines(on_8x1, 3)), _losses(ref_8x1[2:]), rtol=1e-5)


def test_parallel_speed_quick_writes_its_section(tmp_path):
    text = run_benchmark_quick("parallel_speed.py", "parallel_speed", tmp_path / "b.md")
    for needle in ["(a) DP train step, 8 devices", "(b) TP block fwd+bwd", "ratio of minima",
                   "max |weight diff| after one Adam step"]:  # fmt: skip
        assert needle in text, needle
