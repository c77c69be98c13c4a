"""Damaged checkpoints and failed writes raise a `CheckpointError` naming the directory, the
step, the leaf and the fix; steps written by plain Orbax are
restored; `partial=True` restores a subset or another optimizer's structure.

References: the saved arrays themselves (bit equality), files damaged on purpose (bytes
flipped, truncated, deleted, metadata overwritten), and a write made to fail by the
process's file-size limit (``RLIMIT_FSIZE``: unprivileged, the kernel refuses the write
with EFBIG as it refuses a full disk with ENOSPC).
"""

from __future__ import annotations

import os
import resource
import signal
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import blox as bx
from blox import ckpt
from tests.ckpt._common import tree_equal

KERNEL = ("net", "big", "kernel")


def _state(seed: int = 0, tx=None):
    rs = np.random.default_rng(seed)
    params = bx.Params()
    # 32 x 32 random float32: incompressible, so it gets its own data chunk on disk.
    params[KERNEL] = bx.Param(jnp.asarray(rs.standard_normal((32, 32)), jnp.float32))
    params[("net", "big", "bias")] = bx.Param(jnp.asarray(rs.standard_normal(32), jnp.float32))
    params = params.locked()
    tx = tx or optax.adam(1e-2)
    return {"params": params, "opt_state": tx.init(params.split()[0]), "step": 3}


def _save(directory, state, step=3):
    with ckpt.CheckpointManager(directory) as mngr:
        mngr.save(step, state)


def _data_files(directory, step=3) -> list[Path]:
    """The OCDBT data files of a step, largest first (the kernel's chunk is the largest)."""
    files = list(Path(directory, str(step), "state").glob("ocdbt.process_*/d/*"))
    return sorted(files, key=lambda f: f.stat().st_size, reverse=True)


def test_flipped_bytes_raise_naming_directory_step_and_leaf(tmp_path):
    state = _state()
    _save(tmp_path, state)
    biggest = _data_files(tmp_path)[0]
    data = bytearray(biggest.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + 64):  # the corruption of the issue: 64 bytes flipped
        data[i] ^= 0xFF
    biggest.write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError) as info:
        ckpt.CheckpointManager(tmp_path).restore(_state(1))
    message = str(info.value)
    assert str(tmp_path) in message and "step 3" in message
    assert "corrupted" in message and "params/net/big/kernel" in message
    assert info.value.step == 3 and info.value.leaves == ["params/net/big/kernel"]
    # Without the checksum Orbax returns wrong values silently: read the raw arrays.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Orbax: no sharding given, read from the file
        raw = ocp.PyTreeCheckpointer().restore(tmp_path / "3" / "state")
    wrong = np.asarray(raw["params"]["net/big/kernel"]) != np.asarray(state["params"][KERNEL].value)
    assert wrong.any()


def test_checksums_do_not_depend_on_the_layout(tmp_path):
    """Saved on a (4, 2) mesh, restored onto one device and onto (8,): the checksums (of
    the logical values) match and the values are the saved ones."""
    state = _state()
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    sharded = jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    sharded["params"] = jax.device_put(
        state["params"],
        jax.tree.map(
            lambda v: jax.sharding.NamedSharding(
                mesh, jax.sharding.PartitionSpec(*([None] * (v.ndim - 1)), "model")
            ),
            state["params"],
        ),
    )
    sharded["step"] = 3
    _save(tmp_path, sharded)
    restored = ckpt.CheckpointManager(tmp_path).restore(_state(1))
    tree_equal(restored, state)
    mesh8 = jax.make_mesh((8,), ("data",))
    restored = ckpt.CheckpointManager(tmp_path).restore(
        jax.eval_shape(lambda: _state(1)), mesh=mesh8, rules=[(".*", None)]
    )
    assert np.array_equal(restored["params"][KERNEL].value, state["params"][KERNEL].value)


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_truncated_or_deleted_data_file(tmp_path, damage):
    _save(tmp_path, _state())
    biggest = _data_files(tmp_path)[0]
    if damage == "truncate":
        with open(biggest, "r+b") as f:
            f.truncate(biggest.stat().st_size // 2)
    else:
        biggest.unlink()
    with pytest.raises(ckpt.CheckpointError, match="step 3 is damaged") as info:
        ckpt.CheckpointManager(tmp_path).restore(_state(1))
    message = str(info.value)
    assert str(tmp_path) in message and "params/net/big/kernel" in message
    assert "restore(..., step=s)" in message and "tensorstore_spec" not in message
    assert len(message) < 2000


@pytest.mark.parametrize("which", ["state/_METADATA", "blox/metadata"])
def test_garbage_metadata(tmp_path, which):
    _save(tmp_path, _state())
    (tmp_path / "3" / which).write_text("garbage{")
    with pytest.raises(ckpt.CheckpointError, match=f"step 3 is damaged: .*{which}"):
        ckpt.CheckpointManager(tmp_path).restore(_state(1))


def _limited_file_size(limit: int):
    """Context: files of this process cannot grow past `limit` bytes (as on a full disk)."""

    class _Limit:
        def __enter__(self):
            self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
            self.handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, self.old[1]))

        def __exit__(self, *exc):
            resource.setrlimit(resource.RLIMIT_FSIZE, self.old)
            signal.signal(signal.SIGXFSZ, self.handler)

    return _Limit()


def test_failed_async_write_is_raised_by_the_next_save_naming_the_step(tmp_path):
    state = _state()
    mngr = ckpt.CheckpointManager(tmp_path, save_on_exit=False)
    mngr.save(1, state)
    mngr.wait()
    with _limited_file_size(1024):  # the 4 KB kernel chunk cannot be written
        mngr.save(2, state)
        # The next save that writes waits for step 2 (as Orbax does) and raises its error.
        with pytest.raises(ckpt.CheckpointError) as info:
            mngr.save(3, state)
    message = str(info.value)
    assert "writing step 2" in message and str(tmp_path) in message
    assert "latest committed step is 1" in message and "disk space" in message
    assert "File too large" in message and "tensorstore_spec" not in message
    assert info.value.step == 2
    assert mngr.all_steps() == [1]
    # The next save works again, and step 1 is intact.
    mngr.save(5, state)
    mngr.close()
    tree_equal(
        ckpt.CheckpointManager(tmp_path).restore(_state(1), step=1)["params"], state["params"]
    )


def test_adam_to_adamw_and_params_only(tmp_path):
    state = _state(tx=optax.adam(1e-2))
    _save(tmp_path, state)
    mngr = ckpt.CheckpointManager(tmp_path)
    adamw = _state(1, tx=optax.adamw(1e-2))
    with pytest.raises(ValueError, match=r"only in the target: \['opt_state/2'\].*partial=True"):
        mngr.restore(adamw)
    restored = mngr.restore(adamw, partial=True)
    assert len(restored["opt_state"]) == 3  # adamw's structure
    tree_equal(restored["opt_state"][0], state["opt_state"][0])
    tree_equal(restored["params"], state["params"])
    # Params only, e.g. to fine-tune with a new optimizer.
    only = mngr.restore({"params": _state(1)["params"]}, partial=True)
    assert set(only) == {"params"}
    tree_equal(only["params"], state["params"])
    with pytest.raises(ckpt.RestoreMismatchError, match="(?s)unexpected.*pass partial=True"):
        mngr.restore({"params": _state(1)["params"]})
    # A target leaf the checkpoint lacks is still an error with partial=True.
    bigger = _state(1)
    bigger["extra"] = jnp.zeros(2)
    with pytest.raises(ckpt.RestoreMismatchError, match="(?s)missing from the checkpoint.*extra"):
        mngr.restore(bigger, partial=True)


@pytest.mark.parametrize("layout", ["default", "state"])
def test_restore_a_plain_orbax_checkpoint(tmp_path, layout):
    """Written by orbax.checkpoint alone: one unnamed item, or a Composite 'state' item."""
    state = _state()
    with ocp.CheckpointManager(tmp_path) as m:
        if layout == "default":
            m.save(7, args=ocp.args.StandardSave(state))
        else:
            m.save(7, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
        m.wait_until_finished()
    assert not (tmp_path / "7" / "blox").exists()
    mngr = ckpt.CheckpointManager(tmp_path)
    restored = mngr.restore(_state(1))
    tree_equal(restored, {**state, "step": 3})
    abstract = mngr.restore(jax.eval_shape(lambda: _state(1)))
    assert int(abstract["step"]) == 3
    # The checks Orbax's metadata allows: names, shapes, dtypes.
    wrong = _state(1)
    wrong["params"] = wrong["params"].unlocked()
    wrong["params"][KERNEL] = bx.Param(jnp.zeros((32, 16)))
    with pytest.raises(ckpt.RestoreMismatchError, match=r"net/big/kernel: saved float32\[32, 32\]"):
        mngr.restore(wrong)
    with pytest.raises(ValueError, match="no blox description.*written by Orbax directly"):
        mngr.description(7)


def test_errors_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match="rules=... lay parameters out on a mesh; pass mesh"):
        ckpt.abstract_target(_state(), rules=[(".*", None)])
    _save(tmp_path, _state())
    os.remove(tmp_path / "3" / "state" / "_METADATA")
    with pytest.raises(ckpt.CheckpointError, match="Orbax's metadata .*_METADATA' cannot be read"):
        ckpt.CheckpointManager(tmp_path).restore(_state(1))
