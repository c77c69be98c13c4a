"""Params + optimizer + step + RNG + iterator position + loss scale + EMA
survive a save/restore tree-equal: values (bit for bit), dtypes, trainable flags, metadata.
The reference is the state that was saved, restored into a *different* state (another
seed, not trained) so that a no-op restore cannot pass."""

from __future__ import annotations

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from blox import ckpt
from tests.ckpt._common import batch, init, tree_equal


def _train_state(seed: int, steps: int):
    """A trained state with every kind of entry a run carries."""
    params, model = init(seed)
    # A low-precision non-trainable buffer, to check bf16/fp16 bits survive too.
    params = params.unlocked()
    params[("net", "buf_bf16")] = bx.Param(
        jnp.linspace(-3, 3, 5, dtype=jnp.bfloat16), trainable=False, metadata={"tag": "buf"}
    )
    params[("net", "buf_f16")] = bx.Param(
        jnp.linspace(-1, 1, 3, dtype=jnp.float16) / 7, trainable=False
    )
    params = bx.ema_init(params.locked())
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    ls = bx.DynamicLossScale(initial_scale=2.0**10, period=2)

    def loss_fn(params, x, y):
        pred, params = model(params, x, is_training=True)
        return bx.mse(pred, y), params

    step_fn = jax.jit(bx.make_train_step(loss_fn, tx, loss_scale=ls))
    ema = jax.jit(lambda p: bx.ema_update(p, 0.9))
    opt_state, ls_state = tx.init(params.split()[0]), ls.init()
    for i in range(steps):
        params, opt_state, ls_state, _ = step_fn(params, opt_state, ls_state, *batch(i))
        params = ema(params)
    return {"params": params, "opt_state": opt_state, "loss_scale": ls_state, "step": steps}


def _rng_counter(state) -> int:
    return int(state["params"][("net", "rng", "counter")].value)


@pytest.fixture(scope="module")
def states():
    return _train_state(seed=0, steps=3), _train_state(seed=1, steps=0)


@pytest.mark.parametrize("abstract", [False, True], ids=["concrete", "abstract"])
def test_round_trip_is_tree_equal(tmp_path, abstract, states):
    state, other = states
    ds = grain.MapDataset.range(30).shuffle(seed=5)
    it = iter(ds)
    for _ in range(7):
        next(it)
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(3, state, data_iterator=it)

    # `other`: same structure, other values (another seed, untrained).
    assert _rng_counter(other) != _rng_counter(state)
    target = jax.eval_shape(lambda: other) if abstract else other
    if abstract:
        target["step"] = 0  # keep the Python int a Python int
    resumed_it = iter(ds)
    restored = ckpt.CheckpointManager(tmp_path).restore(target, data_iterator=resumed_it)

    tree_equal(restored, state)
    # The pieces named in the issue, one by one.
    assert isinstance(restored["step"], int) and restored["step"] == 3
    assert _rng_counter(restored) == _rng_counter(state) > 0
    assert float(restored["loss_scale"].scale) == float(state["loss_scale"].scale)
    assert isinstance(restored["loss_scale"], bx.LossScaleState)
    ema = restored["params"][("ema", "net", "fc1", "kernel")]
    assert ema.trainable is False and ema.metadata["tag"] == "ema"
    np.testing.assert_array_equal(
        np.asarray(ema.value), np.asarray(state["params"][("ema", "net", "fc1", "kernel")].value)
    )
    assert restored["params"][("net", "buf_bf16")].value.dtype == jnp.bfloat16
    assert restored["params"][("net", "buf_bf16")].metadata == {"tag": "buf"}
    assert restored["params"].is_locked
    assert resumed_it.get_state() == it.get_state()
    assert [next(resumed_it) for _ in range(5)] == [next(it) for _ in range(5)]
