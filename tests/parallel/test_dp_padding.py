"""A data shard or microbatch of weight 0 (all padding) under a masked-mean loss: its loss
is ``0 / 0 = NaN``, and it must contribute nothing, to the loss *and* to the gradients.

Reference: plain ``jax.value_and_grad`` on one device of the masked mean over the real
rows only (the padding rows removed with NumPy, so no mask, no NaN, no DP code)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp
from tests.tolerances import tol

F32 = tol(jnp.float32)
ROWS, T, VOCAB, WIDTH = 16, 4, 5, 8


@functools.cache  # one model, params and batch for every test of the module
def _setup():
    """A tiny token model (embed, tanh, linear head), ``[B, T]`` tokens and a padding
    mask whose last 4 rows (one shard at dp 4, one microbatch at k 4) are all padding."""
    r = np.random.default_rng(7)
    x = r.integers(0, VOCAB, (ROWS, T)).astype(np.int32)
    mask = np.arange(T)[None, :] < r.integers(1, T + 1, ROWS)[:, None]
    mask[-4:] = False
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    embed = bx.Embed(g / "embed", VOCAB, WIDTH, rng)
    head = bx.Linear(g / "head", VOCAB, rng)

    def model(p, tokens):
        h, p = embed(p, tokens)
        return head(p, jnp.tanh(h), precision="highest")

    params = model(rng.seed(bx.Params(), seed=0), jnp.asarray(x))[1].locked()
    return model, params, x, mask


def _per_token(model, p, x):
    logits, p = model(p, x)
    targets = jnp.roll(x, -1, axis=1)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets), p


def _masked_mean_loss(model):
    """The usual masked mean ``sum(ce * mask) / sum(mask)``, as users write it (no
    ``maximum(count, 1)`` guard): ``0 / 0 = NaN`` for an all-padding part, and NaN
    gradients there (in the backward, ``0 / 0`` times the mask)."""

    def loss_fn(p, x, m):  # m: float 0/1 weights (a bool mask becomes a select in XLA)
        ce, p = _per_token(model, p, x)
        w = jnp.sum(m)
        return (jnp.sum(ce * m) / w, {"weight": w}), p

    return loss_fn


@functools.cache  # the same reference for every test of the module
def _reference():
    """Mean cross-entropy over the real tokens only (NumPy picks them: no mask, no NaN),
    of `_setup`'s model, params and batch: its value and gradients."""
    model, params, x, mask = _setup()
    rows = mask.any(axis=1)
    xr, mr = jnp.asarray(x[rows]), mask[rows]

    def loss(t):
        ce, _ = _per_token(model, t, xr)
        return jnp.mean(ce[mr])

    return jax.value_and_grad(loss)(params.split()[0])


def _close(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), **F32)


@pytest.mark.parametrize("dp,k", [(4, 1), (2, 2)])
def test_an_all_padding_shard_or_microbatch_gives_the_real_rows_gradients(dp, k):
    model, params, x, mask = _setup()
    loss_fn = _masked_mean_loss(model)
    mesh = bp.make_mesh((dp,), ("data",), devices=jax.devices()[:dp])
    f = bp.dp_value_and_grad(loss_fn, microbatches=k, has_aux=True)
    spec = P("data")
    run = jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=(P(), spec, spec), out_specs=(P(), P(), P()))
    )
    with jax.default_matmul_precision("highest"):
        (loss, aux), grads, _ = run(
            jax.device_put(params, NamedSharding(mesh, P())),
            *(
                jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
                for a in (x, mask.astype(np.float32))
            ),
        )
        ref_loss, ref_grads = _reference()
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads)), grads
    np.testing.assert_allclose(float(loss), float(ref_loss), **F32)
    assert float(aux["weight"]) == float(mask.sum())
    _close(grads, ref_grads)


@pytest.mark.standard_promotion  # the reference's own Optax update
@pytest.mark.parametrize("types", ["explicit", "auto"])
def test_dp_train_step_with_an_all_padding_shard_updates_as_the_real_rows(types):
    model, params, x, mask = _setup()
    tx = optax.adam(0.1)  # adam turns one NaN gradient into NaN params
    mesh = bp.make_mesh((4,), ("data",), devices=jax.devices()[:4], axis_types=types)
    step = jax.jit(bp.make_dp_train_step(_masked_mean_loss(model), tx, mesh, has_aux=True))
    t = params.split()[0]
    rep = jax.device_put(params, NamedSharding(mesh, P()))
    with jax.default_matmul_precision("highest"):
        new, _, metrics = step(rep, tx.init(t), jnp.asarray(x), jnp.asarray(mask, jnp.float32))
        ref_loss, ref_grads = _reference()
    ref_new = optax.apply_updates(t, tx.update(ref_grads, tx.init(t), t)[0])
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), **F32)
    _close(new.split()[0], ref_new)


def _fsdp_loss(model, guard):
    """The masked mean with the model's weights gathered by `fsdp_call`; `guard` divides
    by ``max(count, 1)``, which a per-layer FSDP loss needs for all-padding shards."""

    def loss_fn(p, x, m):
        logits, p = bp.fsdp_call(model, p, x, under=("net",))
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(x, -1, axis=1))
        w = jnp.sum(m)
        den = jnp.maximum(w, jnp.ones((), w.dtype)) if guard else w
        return (jnp.sum(ce * m) / den, {"weight": w}), p

    return loss_fn


@pytest.mark.parametrize("gather,guard", [("per_step", False), ("per_layer", True)])
def test_fsdp_with_an_all_padding_shard_gives_the_real_rows_gradients(gather, guard):
    """FSDP shares DP's accumulation: with gather='per_step' an unguarded masked mean on an
    all-padding shard contributes nothing; with 'per_layer' the gradient is reduce-
    scattered inside the backward (before the weight is known), so the loss guards its
    count, as the FSDP docs say."""
    model, params, x, mask = _setup()
    mesh = bp.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    specs = bp.fsdp_specs(params, mesh, min_size=1)
    f = bp.fsdp_value_and_grad(_fsdp_loss(model, guard), specs, gather=gather, has_aux=True)
    spec = P("data")
    run = jax.jit(
        jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(specs, spec, spec),
            out_specs=(P(), specs.split()[0], specs),
        )
    )
    ps = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
    with jax.default_matmul_precision("highest"):
        (loss, _), grads, _ = run(
            ps,
            *(
                jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
                for a in (x, mask.astype(np.float32))
            ),
        )
        ref_loss, ref_grads = _reference()
    np.testing.assert_allclose(float(loss), float(ref_loss), **F32)
    _close(grads, ref_grads)


def test_an_all_padding_shard_keeps_what_a_global_term_sends_its_gradients():
    """A loss with a term computed over every shard's rows (a ``psum`` in the loss, as an
    MoE's global balancing loss): the all-padding shard's own masked mean adds nothing,
    but the global term's gradient through that shard's rows still arrives (before, the
    weight-0 shard's whole gradient was dropped). The masked mean is guarded
    (``maximum(count, 1)``), so that shard's gradients are finite.

    Reference: one device, the real rows' mean cross-entropy plus the same term over all
    rows."""
    model, params, x, mask = _setup()
    c = 0.5

    def loss_fn(p, x, m):
        logits, p = model(p, x)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, jnp.roll(x, -1, axis=1))
        w = jnp.sum(m)
        term = jax.lax.psum(jnp.sum(jnp.tanh(logits)), "data") / (ROWS * T * VOCAB)
        return (jnp.sum(ce * m) / jnp.maximum(w, 1.0) + c * term, {"weight": w}), p

    mesh = bp.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    f = bp.dp_value_and_grad(loss_fn, has_aux=True)
    spec = P("data")
    run = jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=(P(), spec, spec), out_specs=(P(), P(), P()))
    )

    def reference(t):
        rows = mask.any(axis=1)
        ce, _ = _per_token(model, t, jnp.asarray(x[rows]))
        logits, _ = model(t, jnp.asarray(x))
        return jnp.mean(ce[mask[rows]]) + c * jnp.mean(jnp.tanh(logits))

    with jax.default_matmul_precision("highest"):
        (loss, _), grads, _ = run(
            jax.device_put(params, NamedSharding(mesh, P())),
            *(
                jax.device_put(jnp.asarray(a), NamedSharding(mesh, spec))
                for a in (x, mask.astype(np.float32))
            ),
        )
        ref_loss, ref_grads = jax.value_and_grad(reference)(params.split()[0])
    np.testing.assert_allclose(float(loss), float(ref_loss), **F32)
    _close(grads, ref_grads)
