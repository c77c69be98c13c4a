"""FSDP under ``python -m blox.launch``: ``examples/gpt_tp.py --mesh 2x4 --fsdp``
in 2 processes x 4 devices (the data axis across the processes, the model axis inside
each), and in one process on 8 devices, prints the ``step=<n> loss=<repr>`` lines of the
one-device run (``--mesh 1x1``) to 1e-5 relative, the same on both ranks; its
``param_bytes_per_device=`` is the TP layout's bytes with every leaf of at least 1024
elements (`fsdp_specs`'s default ``min_size``) halved over the data axis of size 2; and
the checkpoint it writes from two processes resumes in one process on one device with the
lines of the run that never stopped.

References: the single-process ``--mesh 1x1`` run (losses, bytes of the whole model), and
the shapes and TP shard shapes of the sharding table the launched run prints (expected
bytes, summed here by hand). The reference run goes beside the launched one; the resumed
run loads the reference's compiled programs from the shared compile cache
(tests/conftest.py).
"""

from __future__ import annotations

import ast
import math
import re

import numpy as np
import pytest

from tests.scripts import LAUNCH, finish, start

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)

SCRIPT = ("examples/gpt_tp.py", "--size", "tiny")  # 5 steps, float32 parameters
TWO = ("-n", "2", "--devices-per-process", "4")
SAVED = 3  # the launched run trains (and checkpoints) steps 1..3; the resumed one 4..5
TOTAL = 5
MIN_SIZE = 1024  # fsdp_specs's default: smaller leaves stay replicated over `data`
TABLE_ROW = re.compile(r"(gpt/\S+)\s+(\([\d, ]*\))\s+(P\(.*?\))\s+(\([\d, ]*\))\s+rule")


def _losses(out: str, tag: str = "") -> dict[int, float]:
    found = [re.fullmatch(r"step=(\d+) loss=(\S+)", s[len(tag) :]) for s in out.splitlines()]
    return {int(m[1]): float(m[2]) for m in found if m}


def _param_bytes(out: str, tag: str = "") -> int:
    (line,) = [s for s in out.splitlines() if s.startswith(tag + "param_bytes_per_device=")]
    return int(line.split("=")[1])


def _expected_fsdp_bytes(out: str, tag: str) -> tuple[int, int]:
    """(whole model, one device under FSDP) in bytes, from the printed sharding table:
    shape and TP shard shape per leaf; a leaf of >= MIN_SIZE elements is split once more
    over data = 2 (each has an even dimension), 4 bytes an element."""
    rows = [TABLE_ROW.match(s[len(tag) :]) for s in out.splitlines() if s.startswith(tag + "gpt/")]
    assert rows and all(rows), out[-3000:]
    whole = per_device = 0
    for row in rows:
        size = math.prod(ast.literal_eval(row[2]))
        tp_shard = math.prod(ast.literal_eval(row[4]))
        whole += 4 * size
        per_device += 4 * (tp_shard // 2 if size >= MIN_SIZE else tp_shard)
    return whole, per_device


def test_launched_fsdp_run_matches_one_device_and_its_checkpoint_resumes_in_one_process(
    tmp_path,
):
    ckpt_dir = str(tmp_path / "ckpt")
    procs = {
        "1x1": start(*SCRIPT, "--mesh", "1x1", "--steps", str(TOTAL)),
        "fsdp": start(
            *LAUNCH,
            *TWO,
            *SCRIPT,
            "--mesh",
            "2x4",
            "--fsdp",
            "--steps",
            str(SAVED),
            "--ckpt-dir",
            ckpt_dir,
            "--save-every",
            str(SAVED),
        ),
        # FSDP x TP in one process on 8 devices: the same losses and layout.
        "fsdp_one_process": start(*SCRIPT, "--mesh", "2x4", "--fsdp", "--steps", str(SAVED)),
    }
    outs = finish(procs)
    one, two, single = outs["1x1"], outs["fsdp"], outs["fsdp_one_process"]
    assert "over 1 cpu device (cpu), 1 process" in one, one[-3000:]
    assert "[0] Mesh(data=2, model=4; Explicit) over 8 cpu devices (cpu), 2 processes" in two

    reference = _losses(one)
    assert sorted(reference) == list(range(1, TOTAL + 1)), one[-3000:]
    rank0, rank1 = _losses(two, "[0] "), _losses(two, "[1] ")
    assert sorted(rank0) == list(range(1, SAVED + 1)), two[-3000:]
    assert rank1 == rank0  # one replicated loss, read by both processes
    steps = sorted(rank0)
    np.testing.assert_allclose(
        [rank0[i] for i in steps], [reference[i] for i in steps], rtol=1e-5, atol=0
    )

    single_losses = _losses(single)
    assert sorted(single_losses) == steps, single[-3000:]
    np.testing.assert_allclose(
        [single_losses[i] for i in steps], [reference[i] for i in steps], rtol=1e-5, atol=0
    )

    whole, expected = _expected_fsdp_bytes(two, "[0] ")
    assert _param_bytes(one) == whole
    assert _param_bytes(two, "[0] ") == _param_bytes(two, "[1] ") == expected
    assert _expected_fsdp_bytes(single, "") == (whole, expected)
    assert _param_bytes(single) == expected
    assert expected < 0.25 * whole  # the 8 devices hold about 1/8 each (the embedding 1/2)

    # Saved by two processes, read by one on one device: steps SAVED + 1 .. TOTAL.
    resumed = finish(
        {"resume": start(*SCRIPT, "--mesh", "1x1", "--steps", str(TOTAL), "--ckpt-dir", ckpt_dir)}
    )["resume"]
    assert f"resumed from step {SAVED} of {ckpt_dir}" in resumed, resumed[-3000:]
    after = _losses(resumed)
    assert sorted(after) == list(range(SAVED + 1, TOTAL + 1)), resumed[-3000:]
    np.testing.assert_allclose(
        [after[i] for i in sorted(after)],
        [reference[i] for i in sorted(after)],
        rtol=1e-5,
        atol=0,
    )
