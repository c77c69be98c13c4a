"""`ckpt.verify` and ``python -m blox.ckpt verify DIR`` check a checkpoint without a model:
one row per step (step, leaves, bytes, status), an intact step ok, a
corrupted one named with its leaf, a non-zero exit status on corruption.

References: the saved state (its leaf count and its bytes, counted here from the arrays;
a Python int is stored as int64), files damaged or removed on purpose.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from blox import ckpt
from blox.ckpt.__main__ import main
from tests.ckpt._common import flip_bytes
from tests.scripts import run


def _state(seed):
    rs = np.random.default_rng(seed)
    w = jnp.asarray(rs.standard_normal((32, 32)), jnp.float32)  # the largest data chunk
    return {"params": {"w": w}, "b": jnp.arange(3, dtype=jnp.int32), "step": seed}


BYTES = 32 * 32 * 4 + 3 * 4 + 8


@pytest.fixture
def two_steps(tmp_path):
    """Step 1 intact, step 2 with flipped bytes in its kernel."""
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, _state(1))
        mngr.save(2, _state(2))
    flip_bytes(tmp_path, 2)
    return tmp_path


def test_verify_reports_each_step(two_steps, capsys):
    rows = ckpt.verify(two_steps)
    assert [(r.step, r.leaves, r.bytes, r.status, r.ok) for r in rows] == [
        (1, 3, BYTES, "ok", True),
        (2, 3, BYTES, "corrupted", False),
    ]
    assert rows[1].detail == "params/w"
    assert capsys.readouterr().out.splitlines() == [
        "step  leaves  bytes  status     detail",
        f"   1       3   {BYTES}  ok",
        f"   2       3   {BYTES}  corrupted  params/w",
    ]
    assert ckpt.verify(two_steps, step=1, quiet=True) == rows[:1]
    assert capsys.readouterr().out == ""
    with pytest.raises(ValueError, match=r"step 5 is not in .*; the committed steps are \[1, 2\]"):
        ckpt.verify(two_steps, step=5)
    with pytest.raises(ValueError, match="is not a directory"):
        ckpt.verify(two_steps / "nothing")
    # A step without its checksums, and one whose files cannot be read.
    (two_steps / "1" / "blox" / "checksums.json").unlink()
    (row,) = ckpt.verify(two_steps, step=1, quiet=True)
    assert (row.status, row.detail) == ("unverified", "no blox/checksums.json")
    (two_steps / "1" / "state" / "_METADATA").write_text("garbage{")
    (row,) = ckpt.verify(two_steps, step=1, quiet=True)
    assert row.status == "damaged" and "Orbax's metadata" in row.detail


def test_cli_exit_status(two_steps, capsys):
    assert main(["verify", str(two_steps), "--step", "1"]) == 0
    assert main(["verify", str(two_steps)]) == 1
    assert main(["verify", str(two_steps / "nothing")]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.mark.slow  # starts a Python process
def test_cli_in_a_subprocess(two_steps):
    proc = run("-m", "blox.ckpt", "verify", str(two_steps), timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert f"   2       3   {BYTES}  corrupted  params/w" in proc.stdout.splitlines()
    assert f"   1       3   {BYTES}  ok" in proc.stdout.splitlines()


@pytest.mark.parametrize("group_bytes", [1, 4096, 2**30])
def test_verify_reads_in_groups_of_any_size(two_steps, monkeypatch, group_bytes):
    """`verify` reads a step a group of leaves at a time (256 MiB by default, so the
    suite's small states are one group): with one leaf per group, two groups and one,
    the same rows, the corrupted leaf named."""
    from blox.ckpt import _verify

    monkeypatch.setattr(_verify, "GROUP_BYTES", group_bytes)
    rows = ckpt.verify(two_steps, quiet=True)
    assert [(r.step, r.leaves, r.bytes, r.status) for r in rows] == [
        (1, 3, BYTES, "ok"),
        (2, 3, BYTES, "corrupted"),
    ]
    assert rows[1].detail == "params/w"
