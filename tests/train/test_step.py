"""value_and_grad / make_train_step / accumulate_gradients / steps_per_dispatch.

References are independent of the code under test: a raw-JAX MLP on a plain dict
(``jax.grad`` of hand-written math, Optax applied directly to the dict) and NumPy
recurrences for the non-trainable state. Tolerances: ``tests/tolerances.py`` (float32
``rtol=1e-5, atol=1e-6``; float64 ``rtol=1e-10, atol=1e-12``).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from tests.tolerances import tol

LAYERS = ("linear_0", "linear_1")


class RunningMean(bx.Module):
    """Test module with non-trainable state: subtracts a running mean it updates."""

    def __init__(self, graph, momentum: float = 0.9):
        super().__init__(graph)
        self.momentum = momentum

    def __call__(self, params, x):
        mean, params = self.get_param(
            params, "mean", (x.shape[-1],), jax.nn.initializers.zeros, trainable=False
        )
        m = jnp.asarray(self.momentum, x.dtype)
        new = m * mean + (jnp.ones((), x.dtype) - m) * jnp.mean(x, axis=0)
        return x - mean[None], self.set_param(params, "mean", new)


def build(dtype="float32", rate=0.0, with_stat=True, seed=0, batch=8):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    mlp = bx.MLP(g / "mlp", (8, 2), rng, param_dtype=dtype)
    stat = RunningMean(g / "stat")
    drop = bx.Dropout(g / "drop", rate, rng)

    def model(params, x):
        if with_stat:
            x, params = stat(params, x)
        x, params = drop(params, x)
        return mlp(params, x)

    x, y = data(dtype, seed, batch)
    params = rng.seed(bx.Params(), seed=seed)
    _, params = model(params, x)
    if with_stat:  # a non-zero starting mean
        params = stat.set_param(params, "mean", jnp.asarray([0.5, -0.25, 1.0], dtype))

    def loss_fn(params, x, y):
        y_hat, params = model(params, x)
        return bx.mse(y_hat, y), params

    return params.locked(), loss_fn, (x, y)


def data(dtype="float32", seed=0, batch=8):
    r = np.random.default_rng(100 + seed)
    x = jnp.asarray(r.standard_normal((batch, 3)), dtype)
    y = jnp.asarray(r.standard_normal((batch, 2)), dtype)
    return x, y


def raw_weights(params):
    return {
        f"{n}/{w}": jnp.array(params[("net", "mlp", n, w)].value, copy=True)
        for n in LAYERS
        for w in ("kernel", "bias")
    }


def raw_loss(d, x, y, mean=None):
    """The same math on a plain dict: (x - mean) -> Linear -> relu -> Linear, MSE."""
    if mean is not None:
        x = x - mean[None]
    h = jax.nn.relu(x @ d["linear_0/kernel"] + d["linear_0/bias"][None])
    out = h @ d["linear_1/kernel"] + d["linear_1/bias"][None]
    return jnp.mean((out - y) ** 2)


def assert_grads_match(grads: bx.Params, ref: dict, dtype: str) -> None:
    assert sorted(grads.keys()) == sorted(("net", "mlp", *k.split("/")) for k in ref)
    for k, v in ref.items():
        got = grads[("net", "mlp", *k.split("/"))].value
        assert got.dtype == jnp.dtype(dtype)
        np.testing.assert_allclose(got, v, **tol(dtype), err_msg=k)


def test_value_and_grad_matches_raw_jax_and_carries_state():
    params, loss_fn, (x, y) = build()
    mean0 = np.asarray(params[("net", "stat", "mean")].value)
    loss, grads, new_params = jax.jit(bx.value_and_grad(loss_fn))(params, x, y)

    d = raw_weights(params)
    ref_loss, ref_grads = jax.value_and_grad(raw_loss)(d, x, y, jnp.asarray(mean0))
    np.testing.assert_allclose(loss, ref_loss, **tol("float32"))
    assert_grads_match(grads, ref_grads, "float32")  # only trainable paths
    # Non-trainable state carried out of the forward pass (NumPy recurrence).
    np.testing.assert_allclose(
        new_params[("net", "stat", "mean")].value,
        0.9 * mean0 + 0.1 * np.asarray(x).mean(0),
        **tol("float32"),
    )
    # Trainable values are the inputs (no update happened), structure unchanged.
    for k in grads.keys():
        np.testing.assert_array_equal(new_params[k].value, params[k].value)
    assert jax.tree.structure(new_params) == jax.tree.structure(params)


def test_value_and_grad_has_aux_predicate_and_rng_counter():
    params, model_loss, (x, y) = build(rate=0.5)

    def loss_fn(params, x, y):
        loss, params = model_loss(params, x, y)
        return (loss, {"double": 2 * loss}), params

    (loss, aux), grads, new_params = bx.value_and_grad(loss_fn, has_aux=True)(params, x, y)
    np.testing.assert_allclose(aux["double"], 2 * loss, **tol("float32"))
    counter = ("net", "rng", "counter")
    assert int(new_params[counter].value) == int(params[counter].value) + 1  # one dropout key

    # A predicate freezes the first layer: no gradient for it.
    def only_last(path, p):
        return p.trainable and path[2] == "linear_1"

    _, grads, _ = bx.value_and_grad(loss_fn, has_aux=True, predicate=only_last)(params, x, y)
    assert sorted(k[2:] for k in grads.keys()) == [("linear_1", "bias"), ("linear_1", "kernel")]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_accumulated_gradients_equal_full_batch(dtype):
    ctx = jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()
    with ctx:
        params, loss_fn, (x, y) = build(dtype, with_stat=False, batch=16)
        acc = jax.jit(bx.accumulate_gradients(bx.value_and_grad(loss_fn), 4))
        loss, grads, _ = acc(params, x, y)
        ref_loss, ref_grads = jax.value_and_grad(raw_loss)(raw_weights(params), x, y)
        np.testing.assert_allclose(loss, ref_loss, **tol(dtype))
        assert_grads_match(grads, ref_grads, dtype)


def test_accumulation_threads_non_trainable_state_per_microbatch():
    params, loss_fn, (x, y) = build(batch=12, rate=0.5)
    mean = np.asarray(params[("net", "stat", "mean")].value, np.float64)
    _, _, new = bx.accumulate_gradients(bx.value_and_grad(loss_fn), 3)(params, x, y)
    for mb in np.split(np.asarray(x, np.float64), 3):
        mean = 0.9 * mean + 0.1 * mb.mean(0)
    np.testing.assert_allclose(new[("net", "stat", "mean")].value, mean, **tol("float32"))
    counter = ("net", "rng", "counter")
    assert int(new[counter].value) == int(params[counter].value) + 3


@pytest.mark.standard_promotion
def test_make_train_step_matches_optax_on_a_dict():
    params, loss_fn, (x, y) = build(with_stat=False)
    tx = optax.adam(1e-2)
    step = jax.jit(bx.make_train_step(loss_fn, tx), donate_argnums=(0, 1))
    opt_state = tx.init(params.split()[0])

    d = raw_weights(params)
    d_opt = tx.init(d)
    for i in range(3):
        xb, yb = data(seed=i)
        params, opt_state, metrics = step(params, opt_state, xb, yb)
        loss, g = jax.value_and_grad(raw_loss)(d, xb, yb)
        updates, d_opt = tx.update(g, d_opt, d)
        d = optax.apply_updates(d, updates)
        np.testing.assert_allclose(metrics["loss"], loss, **tol("float32"))
    for k, v in d.items():
        np.testing.assert_allclose(params[("net", "mlp", *k.split("/"))].value, v, **tol("float32"))
    assert params.is_locked and sorted(metrics) == ["loss"]


@pytest.mark.standard_promotion
def test_make_train_step_accumulation_equals_full_batch_step():
    params, loss_fn, (x, y) = build(with_stat=False, batch=16)
    tx = optax.sgd(0.1)
    opt = tx.init(params.split()[0])
    full = jax.jit(bx.make_train_step(loss_fn, tx))(params, opt, x, y)
    acc = jax.jit(bx.make_train_step(loss_fn, tx, accumulation_steps=4))(params, opt, x, y)
    np.testing.assert_allclose(acc[2]["loss"], full[2]["loss"], **tol("float32"))
    for k in params.split()[0].keys():
        np.testing.assert_allclose(acc[0][k].value, full[0][k].value, **tol("float32"))


@pytest.mark.standard_promotion
def test_steps_per_dispatch_equals_single_steps():
    params, loss_fn, _ = build(rate=0.25)
    tx = optax.adam(1e-2)
    step = bx.make_train_step(loss_fn, tx)
    batches = [data(seed=i) for i in range(4)]

    p1, o1 = params, tx.init(params.split()[0])
    single = jax.jit(step)
    losses = []
    for xb, yb in batches:
        p1, o1, m = single(p1, o1, xb, yb)
        losses.append(float(m["loss"]))

    multi = jax.jit(bx.steps_per_dispatch(step, 4), donate_argnums=(0, 1))
    xs, ys = bx.stack_batches(batches)
    p4, o4, m4 = multi(params, tx.init(params.split()[0]), xs, ys)
    assert m4["loss"].shape == (4,)
    np.testing.assert_allclose(m4["loss"], losses, **tol("float32"))
    for k in p1.keys():
        np.testing.assert_allclose(p4[k].value, p1[k].value, **tol("float32"), err_msg=str(k))
    assert int(p4[("net", "rng", "counter")].value) == int(p1[("net", "rng", "counter")].value)


@pytest.mark.standard_promotion
def test_optax_chain_clips_and_skips_nan_steps():
    params, loss_fn, (x, y) = build(with_stat=False)
    tx = optax.apply_if_finite(
        optax.chain(optax.clip_by_global_norm(1e-3), optax.sgd(1.0)), max_consecutive_errors=3
    )
    step = jax.jit(bx.make_train_step(loss_fn, tx))
    opt = tx.init(params.split()[0])
    new, opt, _ = step(params, opt, x, y)
    # Clipped: the update's global norm is the clip value (raw grads are much larger).
    diff = [new[k].value - params[k].value for k in params.split()[0].keys()]
    norm = float(jnp.sqrt(sum(jnp.sum(d**2) for d in diff)))
    np.testing.assert_allclose(norm, 1e-3, rtol=1e-4)
    # A NaN batch: apply_if_finite skips the update.
    skipped, opt, m = step(new, opt, x.at[0, 0].set(jnp.nan), y)
    assert np.isnan(m["loss"])
    for k in params.keys():
        np.testing.assert_array_equal(skipped[k].value, new[k].value)
    assert int(opt.notfinite_count) == 1


# -- errors ------------------------------------------------------------------------


def test_accumulation_count_must_divide_the_batch():
    params, loss_fn, (x, y) = build(batch=10)
    with pytest.raises(ValueError, match=r"args\[0\] of shape \(10, 3\) into 4 equal.*\[1, 2, 5"):
        bx.accumulate_gradients(bx.value_and_grad(loss_fn), 4)(params, x, y)
    with pytest.raises(ValueError, match="accumulation_steps must be a positive int"):
        bx.make_train_step(loss_fn, optax.sgd(0.1), accumulation_steps=0)


def test_value_and_grad_errors():
    params, loss_fn, (x, y) = build()

    def no_params(params, x, y):
        return loss_fn(params, x, y)[0]

    with pytest.raises(
        TypeError, match=r"must return \(loss, params\).*got an array of shape \(\)"
    ):
        bx.value_and_grad(no_params)(params, x, y)

    def vector_loss(params, x, y):
        return jnp.sum(x, axis=0), params

    with pytest.raises(ValueError, match=r"floating scalar, got float32 of shape \(3,\)"):
        bx.value_and_grad(vector_loss)(params, x, y)
    with pytest.raises(TypeError, match="first argument must be the model's bx.Params"):
        bx.value_and_grad(loss_fn)({"w": x}, x, y)
    with pytest.raises(TypeError, match=r"has_aux=True\): loss_fn must return \(\(loss, aux\)"):
        bx.value_and_grad(loss_fn, has_aux=True)(params, x, y)


def test_steps_per_dispatch_errors():
    def step(w, b):
        return w, {}

    with pytest.raises(
        ValueError, match=r"batch\[0\] has shape \(3, 2\); .*leading axis of length 4"
    ):
        bx.steps_per_dispatch(step, 4, num_state=1)(jnp.zeros(()), jnp.zeros((3, 2)))
    with pytest.raises(ValueError, match="k must be a positive int"):
        bx.steps_per_dispatch(step, 0)
