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


@pytest.mark.standard_promotion  # the test's own Optax calls
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


def test_make_train_step_accumulation_equals_full_batch_step():
    params, loss_fn, (x, y) = build(with_stat=False, batch=16)
    tx = optax.sgd(0.1)
    opt = tx.init(params.split()[0])
    full = jax.jit(bx.make_train_step(loss_fn, tx))(params, opt, x, y)
    acc = jax.jit(bx.make_train_step(loss_fn, tx, accumulation_steps=4))(params, opt, x, y)
    np.testing.assert_allclose(acc[2]["loss"], full[2]["loss"], **tol("float32"))
    for k in params.split()[0].keys():
        np.testing.assert_allclose(acc[0][k].value, full[0][k].value, **tol("float32"))


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


TX = {
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=0.1),
    "clip+adam+schedule": lambda: optax.chain(
        optax.clip_by_global_norm(0.5), optax.adam(optax.cosine_decay_schedule(1e-2, 10))
    ),
}


@pytest.mark.parametrize("loss_scale", [False, True])
@pytest.mark.parametrize("name", sorted(TX))
def test_make_train_step_runs_optax_under_strict_promotion(name, loss_scale):
    # The conftest traces everything under strict promotion, where Optax alone fails
    # (adam's `b1 ** count`). Reference: the same Optax loop on a dict, by hand, under
    # standard promotion.
    assert jax.config.jax_numpy_dtype_promotion == "strict"
    params, loss_fn, _ = build(with_stat=False)
    tx = TX[name]()
    batches = [data(seed=i) for i in range(2)]
    with jax.numpy_dtype_promotion("standard"):
        d = raw_weights(params)
        d_opt = tx.init(d)
        for xb, yb in batches:
            updates, d_opt = tx.update(jax.grad(raw_loss)(d, xb, yb), d_opt, d)
            d = optax.apply_updates(d, updates)

    opt_state = tx.init(params.split()[0])
    if loss_scale:  # power-of-two scale: scaling and unscaling are exact
        ls = bx.DynamicLossScale(initial_scale=2.0**10)
        step = jax.jit(bx.make_train_step(loss_fn, tx, loss_scale=ls))
        ls_state = ls.init()
        for xb, yb in batches:
            params, opt_state, ls_state, _ = step(params, opt_state, ls_state, xb, yb)
    else:
        step = jax.jit(bx.make_train_step(loss_fn, tx))
        for xb, yb in batches:
            params, opt_state, _ = step(params, opt_state, xb, yb)
    for k, v in d.items():
        np.testing.assert_allclose(
            params[("net", "mlp", *k.split("/"))].value, v, **tol("float32"), err_msg=k
        )


# -- weighted accumulation: a masked per-token loss ----------------------------------

LENGTHS = np.array([3, 3, 1, 0, 2, 3, 0, 0])  # real tokens of each of 8 sequences (T = 3)
# Microbatches hold 12 / 12 real tokens (k=1), 7 / 5 (k=2), 6 / 1 / 5 / 0 (k=4).


def token_problem(dtype="float32"):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    mlp = bx.MLP(g / "mlp", (8, 2), rng, param_dtype=dtype)
    r = np.random.default_rng(7)
    x = jnp.asarray(r.standard_normal((8, 3, 3)), dtype)  # [B, T, D]
    y = jnp.asarray(r.standard_normal((8, 3, 2)), dtype)
    mask = jnp.asarray(np.arange(3)[None, :] < LENGTHS[:, None])  # [B, T]
    params = mlp(rng.seed(bx.Params(), seed=0), x)[1].locked()

    def loss_fn(params, x, y, mask):
        y_hat, params = mlp(params, x)
        per = jnp.mean((y_hat - y) ** 2, axis=-1)  # [B, T]
        n = jnp.sum(mask)
        # A plain masked mean: NaN for a microbatch without real tokens (0 / 0), which
        # the weighted accumulation drops (its weight is 0).
        loss = jnp.sum(jnp.where(mask, per, 0.0)) / n.astype(per.dtype)
        mae = jnp.sum(jnp.where(mask, jnp.mean(jnp.abs(y_hat - y), axis=-1), 0.0))
        return (loss, {"weight": n, "mae": mae / n.astype(per.dtype)}), params

    return params, loss_fn, (x, y, mask)


def raw_token_loss(d, x, y, mask):
    """The full-batch masked mean on a plain dict, written out by hand."""
    h = jax.nn.relu(x @ d["linear_0/kernel"] + d["linear_0/bias"][None, None])
    out = h @ d["linear_1/kernel"] + d["linear_1/bias"][None, None]
    per = jnp.mean((out - y) ** 2, axis=-1)
    mae = jnp.sum(jnp.where(mask, jnp.mean(jnp.abs(out - y), axis=-1), 0.0))
    n = jnp.sum(mask).astype(per.dtype)
    return jnp.sum(jnp.where(mask, per, 0.0)) / n, mae / n


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_weighted_accumulation_equals_the_full_batch_masked_mean(k, dtype):
    ctx = jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()
    with ctx:
        params, loss_fn, batch = token_problem(dtype)
        acc = jax.jit(bx.accumulate_gradients(bx.value_and_grad(loss_fn, has_aux=True), k))
        (loss, aux), grads, _ = acc(params, *batch)
        (ref_loss, ref_mae), ref_grads = jax.value_and_grad(raw_token_loss, has_aux=True)(
            raw_weights(params), *batch
        )
        np.testing.assert_allclose(loss, ref_loss, **tol(dtype))
        np.testing.assert_allclose(aux["mae"], ref_mae, **tol(dtype))
        assert int(aux["weight"]) == LENGTHS.sum()  # the total, still an integer
        assert jnp.issubdtype(aux["weight"].dtype, jnp.integer)
        assert_grads_match(grads, ref_grads, dtype)


def test_weighted_accumulation_in_make_train_step():
    params, loss_fn, batch = token_problem()
    tx = optax.sgd(0.5)
    step = jax.jit(bx.make_train_step(loss_fn, tx, has_aux=True, accumulation_steps=4))
    new, _, metrics = step(params, tx.init(params.split()[0]), *batch)
    d = raw_weights(params)
    (ref_loss, ref_mae), g = jax.value_and_grad(raw_token_loss, has_aux=True)(d, *batch)
    np.testing.assert_allclose(metrics["loss"], ref_loss, **tol("float32"))
    np.testing.assert_allclose(metrics["mae"], ref_mae, **tol("float32"))
    assert int(metrics["weight"]) == LENGTHS.sum()
    for k, v in d.items():
        np.testing.assert_allclose(
            new[("net", "mlp", *k.split("/"))].value, v - 0.5 * g[k], **tol("float32"), err_msg=k
        )


def test_weighted_terms_give_the_full_batch_gradient_across_devices():
    # The data-parallel use: each device's terms psum-ed, then weighted_mean. 4 devices
    # with 6, 1, 5 and 0 real tokens.
    from jax.sharding import PartitionSpec as P

    params, loss_fn, batch = token_problem()
    grad_fn = bx.value_and_grad(loss_fn, has_aux=True)

    def dp(params, x, y, mask):
        # Replicated params are invariant over 'data', and shard_map would sum their
        # gradients over the devices by itself (the transpose of the implicit broadcast):
        # mark them as varying to get each device's own gradient, then combine.
        params = jax.lax.pcast(params, "data", to="varying")
        value, grads, _ = grad_fn(params, x, y, mask)
        terms = jax.lax.psum(bx.weighted_terms(value, grads), "data")
        return bx.weighted_mean(*terms)

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
    specs = (P(), P("data"), P("data"), P("data"))
    f = jax.jit(jax.shard_map(dp, mesh=mesh, in_specs=specs, out_specs=P()))
    (loss, aux), grads = f(params, *batch)
    (ref_loss, ref_mae), ref_grads = jax.value_and_grad(raw_token_loss, has_aux=True)(
        raw_weights(params), *batch
    )
    np.testing.assert_allclose(loss, ref_loss, **tol("float32"))
    np.testing.assert_allclose(aux["mae"], ref_mae, **tol("float32"))
    assert int(aux["weight"]) == LENGTHS.sum()
    assert_grads_match(grads, ref_grads, "float32")


def test_weighted_mean_of_an_all_padding_batch_is_zero():
    params, loss_fn, (x, y, _) = token_problem()
    mask = jnp.zeros((8, 3), bool)
    acc = bx.accumulate_gradients(bx.value_and_grad(loss_fn, has_aux=True), 2)
    (loss, aux), grads, _ = jax.jit(acc)(params, x, y, mask)
    assert float(loss) == 0.0 and float(aux["mae"]) == 0.0 and int(aux["weight"]) == 0
    assert all(np.all(np.asarray(v) == 0.0) for v in jax.tree.leaves(grads))


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


def test_loss_weight_must_be_a_scalar():
    params, loss_fn, batch = token_problem()

    def per_sequence_weight(params, x, y, mask):
        (loss, aux), params = loss_fn(params, x, y, mask)
        return (loss, {"weight": jnp.sum(mask, axis=1)}), params

    with pytest.raises(ValueError, match=r"aux\['weight'\] is the loss's weight.*shape \(8,\)"):
        bx.value_and_grad(per_sequence_weight, has_aux=True)(params, *batch)
    acc = bx.accumulate_gradients(bx.value_and_grad(per_sequence_weight, has_aux=True), 2)
    with pytest.raises(ValueError, match=r"integer or floating scalar, got int32 of shape \(4,\)"):
        acc(params, *batch)
