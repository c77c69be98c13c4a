"""The checksums are part of the committed step: Orbax renames a step's
temporary directory only once the ``blox`` item (description and checksums) is written,
so no committed step lacks them; a blox step without them (as a process killed between
the commit and the checksum write left it before) raises, or restores with a warning on
``allow_unverified=True``.

References: the directory as Orbax commits it, watched while the asynchronous save runs
(no blox call in between, as in a process killed right after the commit); the saved
arrays (bit equality); files removed or edited on purpose. tests/ckpt/test_atomicity.py
kills a saving process at random moments and checks every committed step it leaves.
"""

from __future__ import annotations

import json
import time

import jax.numpy as jnp
import numpy as np
import pytest

from blox import ckpt
from tests.ckpt._common import flip_bytes, tree_equal


def _state(seed=0):
    rs = np.random.default_rng(seed)
    return {"w": jnp.asarray(rs.standard_normal((32, 32)), jnp.float32), "n": 3}


def test_a_step_is_committed_with_its_checksums(tmp_path):
    state = _state()
    mngr = ckpt.CheckpointManager(tmp_path, save_on_exit=False)  # async_save=True
    try:
        mngr.save(1, state)
        # Orbax's background thread commits the step (renames its temporary directory).
        # No blox call runs until it appears: a process killed now leaves this on disk.
        deadline = time.monotonic() + 60
        while not (tmp_path / "1").exists():
            assert time.monotonic() < deadline, "step 1 was never committed"
            time.sleep(0.005)
        sums = tmp_path / "1" / "blox" / "checksums.json"
        assert sums.exists(), "a committed step without its checksums"
        assert set(json.loads(sums.read_text())) == {"w", "n"}
    finally:
        mngr.close()
    flip_bytes(tmp_path, 1)
    with pytest.raises(ckpt.CheckpointError, match=r"step 1 is corrupted.*: w\."):
        ckpt.CheckpointManager(tmp_path).restore(_state(1))


def test_a_step_without_checksums_raises_unless_allowed(tmp_path):
    state = _state()
    with ckpt.CheckpointManager(tmp_path, async_save=False) as mngr:
        mngr.save(3, state)
    sums = tmp_path / "3" / "blox" / "checksums.json"
    saved = json.loads(sums.read_text())
    sums.unlink()  # what a kill between Orbax's commit and blox's checksum write left
    mngr = ckpt.CheckpointManager(tmp_path)
    with pytest.raises(
        ckpt.CheckpointError,
        match=r"step 3 cannot be verified: it has no checksums \('.*/3/blox/checksums\.json' "
        r"is missing.*Nothing was restored.*allow_unverified=True",
    ) as info:
        mngr.restore(_state(1))
    assert info.value.step == 3
    with pytest.warns(UserWarning, match=r"step 3: it has no checksums.*restored unverified"):
        restored = mngr.restore(_state(1), allow_unverified=True)
    tree_equal(restored, state)
    # A checksum file that lacks a leaf's checksum: the leaf is named.
    sums.write_text(json.dumps({"n": saved["n"]}))
    with pytest.raises(ckpt.CheckpointError, match=r"1 leaves have no checksum in .*: w \("):
        mngr.restore(_state(1))
    with pytest.warns(UserWarning, match="restored unverified"):
        tree_equal(mngr.restore(_state(1), allow_unverified=True), state)
    # A corrupted leaf is an error even with allow_unverified.
    sums.write_text(json.dumps(saved))
    flip_bytes(tmp_path, 3)
    with pytest.raises(ckpt.CheckpointError, match=r"step 3 is corrupted"):
        mngr.restore(_state(1), allow_unverified=True)


def test_a_save_whose_checksums_fail_commits_no_step(tmp_path, monkeypatch):
    """The checksums are computed after Orbax's save returns; if that fails (here made to
    raise), the step is abandoned, not committed without them."""

    def fail(_):
        raise RuntimeError("the checksum program failed")

    mngr = ckpt.CheckpointManager(tmp_path, save_on_exit=False)
    mngr.save(1, _state())
    monkeypatch.setattr(mngr._checksums, "start", fail)
    with pytest.raises(RuntimeError, match="the checksum program failed"):
        mngr.save(2, _state())
    with pytest.raises(ckpt.CheckpointError, match=r"writing step 2 .*failed .*abandoned"):
        mngr.wait()
    monkeypatch.undo()
    assert mngr.all_steps() == [1]
    assert not (tmp_path / "2").exists()  # only its temporary directory is left
    mngr.close()
    tree_equal(ckpt.CheckpointManager(tmp_path).restore(_state(1)), _state())
