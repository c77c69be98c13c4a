"""Every train step runs Optax under standard dtype promotion, whatever mode the caller
traces it in (Optax's Adam mixes a Python float with an int32 count, ``b1 ** count``,
which strict promotion rejects). The one-device step always did; the DP and FSDP steps
raised ``TypePromotionError`` under strict promotion. Reference: the same step traced
under standard promotion, for the Adam family, a clipped AdamW with a schedule and SGD
with momentum, with and without microbatches."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp

TXS = {
    "adam": lambda: optax.adam(1e-2),
    "adamw_clip_schedule": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adamw(optax.cosine_decay_schedule(1e-2, 10))
    ),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
}


def _model():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    mlp = bx.MLP(g / "mlp", (32, 4), rng)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.float32)
    y = jnp.asarray(np.random.default_rng(1).normal(size=(16, 4)), jnp.float32)
    params = mlp(rng.seed(bx.Params(), seed=0), x)[1].locked()

    def loss_fn(params, x, y):  # fsdp_call: a plain call outside FSDP
        out, params = bp.fsdp_call(mlp, params, x)
        return jnp.mean((out - y) ** 2), params

    return loss_fn, params, x, y


def _steps(loss_fn, tx, params, microbatches):
    """``{name: (step, params)}``: one device, DP over 8 devices and FSDP over 8."""
    mesh = bp.make_mesh((8,), ("data",))
    specs = bp.fsdp_specs(params, mesh, min_size=64)
    sharded = jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
        params,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )
    return {
        "one_device": (bx.make_train_step(loss_fn, tx, accumulation_steps=microbatches), params),
        "dp": (bp.make_dp_train_step(loss_fn, tx, mesh, microbatches=microbatches), params),
        "fsdp": (
            bp.make_fsdp_train_step(loss_fn, tx, mesh, specs, microbatches=microbatches),
            sharded,
        ),
    }


@pytest.mark.parametrize("microbatches", [1, 2])
@pytest.mark.parametrize("tx_name", sorted(TXS))
def test_every_step_runs_optax_under_strict_promotion(tx_name, microbatches):
    loss_fn, params, x, y = _model()
    tx = TXS[tx_name]()
    for name, (step, p) in _steps(loss_fn, tx, params, microbatches).items():
        out = {}
        for mode in ("standard", "strict"):
            with jax.numpy_dtype_promotion(mode):
                q, opt = p, tx.init(p.split()[0])
                for _ in range(3):
                    q, opt, metrics = jax.jit(step)(q, opt, x, y)
                out[mode] = (q, float(metrics["loss"]))
        assert out["strict"][1] == out["standard"][1], name
        leaves = zip(
            jax.tree.leaves(out["strict"][0]), jax.tree.leaves(out["standard"][0]), strict=True
        )
        for a, b in leaves:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
