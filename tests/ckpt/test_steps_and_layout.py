"""Checkpoint steps and layout: steps must increase (an old run's
directory raises; ``force=True`` overwrites), integer scalar arrays are steps, ``mesh``
lays a concrete target out (the TP layout of the ``jax.eval_shape`` recipe is
tested in tests/ckpt/test_reshard.py), and Adafactor's
factored statistics get a valid (replicated) layout.

References: the saved arrays (bit equality), the shardings the rules derive on the new
mesh (`blox.parallel.param_shardings` / `opt_state_shardings`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import blox as bx
from blox import ckpt
from blox import parallel as bp
from tests.ckpt._common import init, tree_equal

P = PartitionSpec


def _state(step=0, seed=0):
    params, _ = init(seed)
    return {"params": params, "w": jnp.arange(6.0).reshape(2, 3) + step, "step": step}


# -- steps must increase -----------------------------------------------------------------


def test_saving_into_an_old_runs_directory_raises(tmp_path):
    with ckpt.CheckpointManager(tmp_path, save_every=5) as old:
        old.save(10, _state(10))
    fresh = ckpt.CheckpointManager(tmp_path, save_every=5, save_on_exit=False)
    # Even on a step that would not be written (1 % 5 != 0): the first call raises.
    for step in (1, 5, 10):
        with pytest.raises(ValueError, match=r"already holds steps up to 10, so saving step"):
            fresh.save(step, _state(step))
    with pytest.raises(ValueError, match=f"{tmp_path}.*force=True"):
        fresh.save(3, _state(3))
    assert fresh.all_steps() == [10]
    # Resuming is fine: the restored step is "known", the next ones are new.
    state = fresh.restore(_state(0, seed=1))
    assert fresh.save(10, state) is False  # the step just restored: nothing to do
    assert fresh.save(15, _state(15)) is True
    fresh.wait()
    # force=True overwrites: the steps from 5 on are deleted, then 5 is written.
    assert fresh.save(5, _state(5), force=True) is True
    fresh.close()
    mngr = ckpt.CheckpointManager(tmp_path)
    assert mngr.all_steps() == [5]
    tree_equal(mngr.restore(_state(0, seed=1)), _state(5))


def test_same_step_saved_twice_by_one_manager_is_a_no_op(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as mngr:
        assert mngr.save(2, _state(2)) is True
        assert mngr.save(2, _state(2)) is False
        with pytest.raises(ValueError, match="already holds steps up to 2, so saving step 1"):
            mngr.save(1, _state(1))


# -- integer scalar arrays are steps -----------------------------------------------------


def test_integer_scalar_array_steps(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as mngr:
        assert mngr.save(jnp.int32(1), _state(1)) is True
        assert mngr.save(np.int64(2), _state(2)) is True
        assert mngr.save(jnp.asarray(3, jnp.uint32), _state(3)) is True
        # restore(jax.eval_shape(...)) returns the step as an Array: it saves again.
        restored = mngr.restore(jax.eval_shape(lambda: {**_state(0, seed=1), "step": jnp.int32(0)}))
        assert isinstance(restored["step"], jax.Array) and int(restored["step"]) == 3
        assert mngr.save(restored["step"] + 1, {**_state(4), "step": restored["step"] + 1})
        assert mngr.restore(_state(0), step=jnp.int32(4))["step"] == 4
        with pytest.raises(TypeError, match="step must be an integer, got a float32 scalar"):
            mngr.save(jnp.float32(5), _state(5))
        with pytest.raises(
            ValueError, match=r"step must be a scalar, got an array of shape \(2,\)"
        ):
            mngr.save(jnp.arange(2), _state(5))
        with pytest.raises(TypeError, match="step must be an int >= 0, got the bool"):
            mngr.save(True, _state(5))
        with pytest.raises(TypeError, match="step must be an int >= 0 .* got float"):
            mngr.save(5.0, _state(5))
    assert ckpt.CheckpointManager(tmp_path).all_steps() == [1, 2, 3, 4]


# -- mesh lays out a concrete target -----------------------------------------------------


def test_concrete_target_with_mesh_is_laid_out_on_the_mesh(tmp_path):
    params, _ = init(0, sharded=True)  # fc1/kernel has metadata sharding (None, 'model')
    state = {"params": params, "step": 1}
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, state)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    target = {"params": init(1, sharded=True)[0], "step": 0}  # on one device
    assert isinstance(
        target["params"][("net", "fc1", "kernel")].value.sharding, SingleDeviceSharding
    )
    restored = ckpt.CheckpointManager(tmp_path).restore(target, mesh=mesh)
    tree_equal(restored, state)
    for path, p in restored["params"].items():
        want = P(None, "model") if path == ("net", "fc1", "kernel") else P()
        assert p.value.sharding == NamedSharding(mesh, want), path
    # A leaf already on this mesh keeps its sharding.
    on_mesh = jax.device_put(target["params"], bx.named_shardings(target["params"], mesh))
    k = ("net", "head", "kernel")
    special = NamedSharding(mesh, P("data", None))
    on_mesh = on_mesh.unlocked()
    on_mesh[k] = bx.Param(jax.device_put(on_mesh[k].value, special))
    restored = ckpt.CheckpointManager(tmp_path).restore(
        {"params": on_mesh.locked(), "step": 0}, mesh=mesh
    )
    assert restored["params"][k].value.sharding == special


# -- the eval_shape recipe's layout: tests/ckpt/test_reshard.py (test_eval_shape_recipe_*)


# -- Adafactor's factored statistics -----------------------------------------------------


def test_adafactor_state_round_trips_on_a_sharded_mesh(tmp_path):
    tx = optax.adafactor(1e-2, min_dim_size_to_factor=4)
    mesh = bp.make_mesh((4, 2), ("data", "model"))
    params, _ = init(0, hidden=8, sharded=True)  # fc1/kernel (4, 8): (None, 'model')
    params = jax.device_put(params, bx.named_shardings(params, mesh))
    trainable = params.split()[0]
    specs = bp.param_specs(params, [("fc1/kernel", (None, "model")), (".*", None)], mesh)
    o_sh = bp.opt_state_shardings(jax.eval_shape(tx.init, trainable), specs, mesh)
    opt_state = jax.jit(tx.init, out_shardings=o_sh)(trainable)
    v_row = opt_state[0].v_row[("net", "fc1", "kernel")].value
    assert v_row.shape == (4,)  # factored: one dimension fewer than the kernel
    state = {"params": params, "opt_state": opt_state, "step": 1}
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, state)

    def abstract():
        p, _ = init(1, hidden=8, sharded=True)
        return {"params": p, "opt_state": tx.init(p.split()[0]), "step": 0}

    target = {**jax.eval_shape(abstract), "step": 0}
    for kwargs in ({}, {"rules": [("fc1/kernel", (None, "model")), (".*", None)]}):
        restored = ckpt.CheckpointManager(tmp_path).restore(target, mesh=mesh, **kwargs)
        tree_equal(restored, state)
        fs = restored["opt_state"][0]
        k = ("net", "fc1", "kernel")
        assert restored["params"][k].value.sharding.spec == P(None, "model")
        assert fs.v_row[k].value.sharding.spec == P()  # the kernel's spec does not fit
        assert fs.v_col[k].value.sharding.spec == P()
        assert fs.v[k].value.sharding.spec == P()  # the (1,) placeholder
    target = ckpt.abstract_target(jax.eval_shape(abstract), mesh=mesh)
    assert target["opt_state"][0].v_row[("net", "fc1", "kernel")].value.sharding.spec == P()
