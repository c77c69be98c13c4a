"""Schedules against closed forms (NumPy) and EMA of weights against a NumPy recurrence."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from tests.tolerances import tol


def fastai_flat_cos(lr: float, total: int, pct: float, div_final: float, t: int) -> float:
    """fastai's fit_flat_cos: SchedNo(lr, lr) for pct of training, then SchedCos(lr, lr/div)."""
    flat = round(pct * total)
    if t < flat:
        return lr
    p = min((t - flat) / (total - flat), 1.0)
    end = lr / div_final
    return lr + (1 + math.cos(math.pi * (1 - p))) * (end - lr) / 2


@pytest.mark.parametrize("pct", [0.75, 0.3])
def test_flat_cosine_schedule_matches_fastai_formula(pct):
    sched = bx.flat_cosine_schedule(3e-3, 200, pct_start=pct, div_final=1e5)
    ts = np.arange(0, 230)
    got = np.asarray(jax.vmap(sched)(jnp.asarray(ts)))
    ref = np.array([fastai_flat_cos(3e-3, 200, pct, 1e5, int(t)) for t in ts])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-10)


def test_warmup_cosine_schedule_matches_closed_form():
    sched = bx.warmup_cosine_schedule(1.0, 100, warmup_steps=20, init_value=0.1, end_value=0.01)
    for t in range(0, 120):
        if t < 20:
            ref = 0.1 + (1.0 - 0.1) * t / 20
        else:
            p = min((t - 20) / 80, 1.0)
            ref = 0.01 + (1.0 - 0.01) * 0.5 * (1 + math.cos(math.pi * p))
        np.testing.assert_allclose(float(sched(t)), ref, rtol=1e-5, atol=1e-7, err_msg=str(t))


@pytest.mark.standard_promotion  # the test's own Optax calls
def test_warmup_cosine_schedule_matches_optax():
    ours = bx.warmup_cosine_schedule(2.0, 50, warmup_steps=7, init_value=0.2, end_value=0.1)
    ref = optax.warmup_cosine_decay_schedule(0.2, 2.0, 7, 50, end_value=0.1)
    ts = jnp.arange(60)
    np.testing.assert_allclose(jax.vmap(ours)(ts), jax.vmap(ref)(ts), rtol=1e-5, atol=1e-7)


def test_schedule_drives_optax_inside_a_chain():
    sched = bx.flat_cosine_schedule(0.5, 10, pct_start=0.5)
    tx = optax.chain(optax.clip_by_global_norm(10.0), optax.sgd(sched))
    w = {"w": jnp.zeros(())}
    state = tx.init(w)
    lrs = []
    for _ in range(10):
        upd, state = tx.update({"w": jnp.ones(())}, state, w)
        lrs.append(-float(upd["w"]))
    np.testing.assert_allclose(lrs, [float(sched(t)) for t in range(10)], rtol=1e-6)


def test_schedule_errors():
    with pytest.raises(ValueError, match="total_steps must be a positive int"):
        bx.flat_cosine_schedule(1.0, 0)
    with pytest.raises(ValueError, match=r"pct_start must be in \[0, 1\]"):
        bx.flat_cosine_schedule(1.0, 10, pct_start=1.5)
    with pytest.raises(ValueError, match=r"warmup_steps=10 must be in \[0, total_steps=10\)"):
        bx.warmup_cosine_schedule(1.0, 10, warmup_steps=10)


def _params():
    p = bx.Params()
    r = np.random.default_rng(0)
    p[("net", "w")] = bx.Param(jnp.asarray(r.standard_normal((3, 2)), jnp.float32))
    p[("net", "b")] = bx.Param(jnp.zeros((2,), jnp.float32), metadata={"sharding": (None,)})
    p[("net", "count")] = bx.Param(jnp.zeros((), jnp.int32), trainable=False)
    return p.locked()


def test_ema_matches_numpy_recurrence_inside_jit():
    params = bx.ema_init(_params())
    assert params.is_locked
    ema_w = ("ema", "net", "w")
    assert not params[ema_w].trainable and params[ema_w].metadata["tag"] == "ema"
    assert params[("ema", "net", "b")].metadata["sharding"] == (None,)
    assert ("ema", "net", "count") not in params  # only trainable params are averaged
    assert sorted(params.split()[0].keys()) == [("net", "b"), ("net", "w")]

    @jax.jit
    def fake_step(params, t):
        trainable, rest = params.split()
        trainable = jax.tree.map(lambda v: v + jnp.sin(t), trainable)
        return bx.ema_update(trainable.merge(rest), 0.9)

    ref_w = np.asarray(params[("net", "w")].value, np.float64)
    ema_ref = ref_w.copy()
    for t in range(6):
        params = fake_step(params, jnp.asarray(float(t)))
        ref_w = ref_w + np.sin(t)
        ema_ref = 0.9 * ema_ref + 0.1 * ref_w
    np.testing.assert_allclose(params[ema_w].value, ema_ref, **tol("float32"))
    evaluated = bx.ema_params(params)
    np.testing.assert_allclose(evaluated[("net", "w")].value, ema_ref, **tol("float32"))
    assert sorted(evaluated.keys()) == sorted(_params().keys())
    assert evaluated[("net", "w")].trainable


def test_ema_errors():
    params = bx.ema_init(_params())
    with pytest.raises(ValueError, match="already hold paths under 'ema'.*prefix="):
        bx.ema_init(params)
    with pytest.raises(KeyError, match="no EMA params under 'ema'.*bx.ema_init"):
        bx.ema_update(_params(), 0.9)
    with pytest.raises(KeyError, match=r"without a source weight: \['net/w'\]"):
        bx.ema_params(params.split(lambda path, _: path != ("net", "w"))[0])


def _bf16_params():
    p = bx.Params()
    r = np.random.default_rng(1)
    p[("net", "w")] = bx.Param(jnp.asarray(r.standard_normal((4, 3)), jnp.bfloat16))
    p[("net", "b")] = bx.Param(jnp.zeros((3,), jnp.bfloat16))
    return p.locked()


def test_ema_of_bf16_weights_moves_and_matches_a_float64_numpy_ema():
    # In bf16, 0.999 rounds to 1.0: an EMA computed (or stored) in bf16 never moves.
    params = bx.ema_init(_bf16_params())
    assert params[("ema", "net", "w")].value.dtype == jnp.float32  # default storage
    decay, steps = 0.999, 60

    @jax.jit
    def fake_step(params, t):
        trainable, rest = params.split()
        trainable = jax.tree.map(
            lambda v: (v.astype(jnp.float32) + 0.02 + 0.01 * jnp.cos(t)).astype(v.dtype),
            trainable,
        )
        return bx.ema_update(trainable.merge(rest), decay)

    ema_ref = {k: np.asarray(params[k].value, np.float64) for k in params.split()[0].keys()}
    for t in range(steps):
        params = fake_step(params, jnp.asarray(float(t), jnp.float32))
        for k in ema_ref:  # the reference averages the bf16 weights as they are stored
            w = np.asarray(params[k].value.astype(jnp.float32), np.float64)
            ema_ref[k] = decay * ema_ref[k] + (1 - decay) * w
    for k, ref in ema_ref.items():
        got = params[("ema", *k)].value
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(got, ref, **tol("float32"), err_msg=str(k))
        # It moved: far more than float32 rounding from where it started.
        start = np.asarray(_bf16_params()[k].value.astype(jnp.float32), np.float64)
        assert np.min(np.abs(ref - start)) > 1e-2
    assert bx.ema_params(params)[("net", "w")].value.dtype == jnp.bfloat16


def test_ema_float64_weights_keep_float64():
    with jax.enable_x64(True):
        p = bx.Params()
        p[("w",)] = bx.Param(jnp.asarray([1.0, -2.0], jnp.float64))
        params = bx.ema_init(p.locked())
        assert params[("ema", "w")].value.dtype == jnp.float64
        ref = np.array([1.0, -2.0])
        for t in range(5):
            trainable, rest = params.split()
            trainable = jax.tree.map(lambda v: v + 0.1, trainable)
            params = bx.ema_update(trainable.merge(rest), 0.999)
            ref = 0.999 * ref + 0.001 * (np.array([1.0, -2.0]) + 0.1 * (t + 1))
        np.testing.assert_allclose(params[("ema", "w")].value, ref, **tol("float64"))


def test_ema_explicit_storage_dtype():
    # bf16 storage by request; the arithmetic still runs in float32, then rounds to bf16.
    params = bx.ema_init(_params(), dtype="bfloat16")
    assert params[("ema", "net", "w")].value.dtype == jnp.bfloat16
    w0 = np.asarray(params[("net", "w")].value, np.float64)
    ema0 = np.asarray(params[("ema", "net", "w")].value.astype(jnp.float32), np.float64)
    trainable, rest = params.split()
    trainable = jax.tree.map(lambda v: v + 1.0, trainable)
    new = bx.ema_update(trainable.merge(rest), 0.5)
    got = new[("ema", "net", "w")].value
    assert got.dtype == jnp.bfloat16
    expected = 0.5 * ema0 + 0.5 * (w0 + 1.0)
    np.testing.assert_allclose(np.asarray(got, np.float64), expected, **tol("bfloat16"))


def test_ema_dtype_and_decay_errors():
    with pytest.raises(ValueError, match=r"dtype='int32' is not a floating dtype"):
        bx.ema_init(_params(), dtype="int32")
    params = bx.ema_init(_params())
    with pytest.raises(ValueError, match=r"decay must be in \[0, 1\], got 1.5"):
        bx.ema_update(params, 1.5)
    with pytest.raises(ValueError, match=r"decay must be a scalar, got shape \(2,\)"):
        bx.ema_update(params, jnp.array([0.9, 0.9]))
