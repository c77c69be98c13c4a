"""Mixed precision: bf16 compute with fp32 master params; fp16 dynamic loss scaling.

References: the raw-JAX float32 MLP on a dict (``tests/train/test_step.py``) with Optax
applied directly. Stated tolerances: bf16 losses within ``tol('bfloat16')`` (``rtol=2e-2,
atol=2e-2``) of float32 at every step; fp16 steps within ``tol('float16')`` (``rtol=2e-3,
atol=2e-3``) of float32 for the weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from tests.tolerances import tol
from tests.train.test_step import build, data, raw_loss, raw_weights


@pytest.mark.standard_promotion  # the test's own Optax calls
def test_bf16_policy_keeps_fp32_masters_and_tracks_fp32_loss():
    params, loss_fn, _ = build(with_stat=False)
    seen = []

    def traced_loss(params, x, y):
        seen.append((x.dtype, params[("net", "mlp", "linear_0", "kernel")].value.dtype))
        return loss_fn(params, x, y)

    tx = optax.adam(1e-2)
    policy = bx.Policy(compute_dtype="bfloat16")
    step = jax.jit(bx.make_train_step(traced_loss, tx, policy=policy))
    opt = tx.init(params.split()[0])
    d, d_opt = raw_weights(params), tx.init(raw_weights(params))
    for i in range(10):
        x, y = data(seed=i)
        params, opt, m = step(params, opt, x, y)
        ref, g = jax.value_and_grad(raw_loss)(d, x, y)
        d_opt_updates, d_opt = tx.update(g, d_opt, d)
        d = optax.apply_updates(d, d_opt_updates)
        assert m["loss"].dtype == jnp.float32
        np.testing.assert_allclose(m["loss"], ref, **tol("bfloat16"), err_msg=f"step {i}")
    assert seen[0] == (jnp.bfloat16, jnp.bfloat16)  # the forward pass ran in bf16
    for k, v in params.split()[0].items():
        assert v.value.dtype == jnp.float32, k  # master params stay fp32
    for k, v in d.items():
        np.testing.assert_allclose(
            params[("net", "mlp", *k.split("/"))].value, v, **tol("bfloat16")
        )


@pytest.mark.standard_promotion  # the test's own Optax calls
def test_bf16_policy_restores_non_trainable_dtypes():
    params, loss_fn, (x, y) = build()  # RunningMean state is float32, computed in bf16
    policy = bx.Policy(compute_dtype="bfloat16")
    _, grads, new = bx.value_and_grad(loss_fn, policy=policy)(params, x, y)
    assert new[("net", "stat", "mean")].value.dtype == jnp.float32
    assert all(g.value.dtype == jnp.float32 for g in grads.values())
    assert jax.tree.structure(new) == jax.tree.structure(params)


def test_fp16_loss_scaling_skips_overflow_halves_then_grows_back():
    params, loss_fn, _ = build(with_stat=False)
    tx = optax.sgd(0.1)
    ls = bx.DynamicLossScale(initial_scale=2.0**10, period=2)
    step = jax.jit(
        bx.make_train_step(loss_fn, tx, policy=bx.Policy(compute_dtype="float16"), loss_scale=ls)
    )
    opt, ls_state = tx.init(params.split()[0]), ls.init()
    d = raw_weights(params)

    def raw_sgd(d, x, y):
        g = jax.grad(raw_loss)(d, x, y)
        return jax.tree.map(lambda w, gw: w - 0.1 * gw, d, g)

    x, y = data(seed=0)
    params, opt, ls_state, m = step(params, opt, ls_state, x, y)
    d = raw_sgd(d, x, y)
    assert bool(m["grads_finite"]) and float(m["loss_scale"]) == 2.0**10
    assert (float(ls_state.scale), int(ls_state.good_steps)) == (2.0**10, 1)

    # Injected overflow: 1e5 is inf in float16. The step is skipped, the scale halves.
    before = params
    xo = x.at[0, 0].set(1e5)
    params, opt, ls_state, m = step(params, opt, ls_state, xo, y)
    assert not bool(m["grads_finite"])
    assert (float(ls_state.scale), int(ls_state.good_steps)) == (2.0**9, 0)
    for k in before.keys():
        np.testing.assert_array_equal(params[k].value, before[k].value)

    # Two finite steps: the scale grows back after `period` good steps.
    for i in (1, 2):
        x, y = data(seed=i)
        params, opt, ls_state, m = step(params, opt, ls_state, x, y)
        d = raw_sgd(d, x, y)
        assert bool(m["grads_finite"])
    assert (float(ls_state.scale), int(ls_state.good_steps)) == (2.0**10, 0)
    for k, v in d.items():
        got = params[("net", "mlp", *k.split("/"))].value
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, v, **tol("float16"))


def test_loss_scale_adjust_matches_a_python_recurrence():
    ls = bx.DynamicLossScale(initial_scale=4.0, period=3, factor=2.0, min_scale=1.0)
    finite = [True, True, True, False, False, False, True, True, True, True]
    state = ls.init()
    scale, good = 4.0, 0
    for f in finite:
        state = ls.adjust(state, jnp.asarray(f))
        if f:
            good += 1
            if good == 3:
                scale, good = scale * 2, 0
        else:
            scale, good = max(scale / 2, 1.0), 0
        assert (float(state.scale), int(state.good_steps)) == (scale, good)


def test_policy_errors():
    with pytest.raises(ValueError, match=r"compute_dtype='int8' is not supported; use one of"):
        bx.Policy(compute_dtype="int8")
    with pytest.raises(ValueError, match=r"param_dtype='float8_e4m3fn' is not supported"):
        bx.Policy(param_dtype="float8_e4m3fn")
    with pytest.raises(ValueError, match="is not supported"):
        bx.Policy(output_dtype="not-a-dtype")
    params, loss_fn, (x, y) = build(dtype="bfloat16", with_stat=False)
    with pytest.raises(ValueError, match=r"master params in float32.*stored as \['bfloat16'\]"):
        bx.value_and_grad(loss_fn, policy=bx.Policy(compute_dtype="bfloat16"))(params, x, y)
    with pytest.raises(ValueError, match="period must be an int >= 1"):
        bx.DynamicLossScale(period=0)
    step = bx.make_train_step(loss_fn, optax.sgd(0.1), loss_scale=bx.DynamicLossScale())
    with pytest.raises(TypeError, match=r"step\(params, opt_state, ls_state, \*batch\)"):
        step(params, None, x, y)


def test_loss_scale_with_accumulation_equals_unscaled_full_batch():
    params, loss_fn, (x, y) = build(with_stat=False, batch=16)
    tx = optax.sgd(0.1)
    opt = tx.init(params.split()[0])
    ls = bx.DynamicLossScale(initial_scale=2.0**8)
    scaled = bx.make_train_step(loss_fn, tx, accumulation_steps=4, loss_scale=ls)
    p, _, s, m = jax.jit(scaled)(params, opt, ls.init(), x, y)
    ref, _, ref_m = jax.jit(bx.make_train_step(loss_fn, tx))(params, opt, x, y)
    np.testing.assert_allclose(m["loss"], ref_m["loss"], **tol("float32"))
    for k in ref.keys():
        np.testing.assert_allclose(p[k].value, ref[k].value, **tol("float32"))
    assert int(s.good_steps) == 1
