"""Seams of the DP, FSDP and one-device train steps, against independent references:

* dropout in a DP / FSDP step draws per-shard masks when its Rng is listed in
  ``rngs=`` (equal to one-device runs of each shard with the seed folded by the shard
  index), and raises naming the Rng and ``rngs=`` when it is not;
* a layer first created inside the loss raises in `make_train_step`, the DP and
  FSDP steps and `fit`, naming the new paths and ``locked()``;
* bf16 gradients are summed in float32 (``reduce_dtype``): the lowered HLO shows
  f32 all-reduces / reduce-scatters, and gradients whose per-shard values are exact in
  bf16 come out as the correctly rounded f32 sum (today's bf16 sums miss it).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp


def _mesh(n):
    return bp.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _put(tree, mesh, specs=None):
    if specs is None:
        return jax.device_put(tree, NamedSharding(mesh, P()))
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)


# ---------------------------------------------------------------------------
# Item 1: dropout per data shard, and the unlisted Rng
# ---------------------------------------------------------------------------


def _dropout_model(fsdp: bool):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 4, rng)
    drop = bx.Dropout(g / "drop", 0.5, rng)

    def loss_fn(p, x):
        h, p = bp.fsdp_call(fc, p, x) if fsdp else fc(p, x, precision="highest")
        h, p = drop(p, h)
        return jnp.mean(h**2), p

    x = jnp.asarray(np.random.default_rng(0).normal(size=(3, 3)), jnp.float32)
    params = loss_fn(rng.seed(bx.Params(), seed=0), x)[1].locked()
    return rng, loss_fn, params, x


def _dp_or_fsdp_step(fsdp, loss_fn, params, mesh, tx=None, **kw):
    tx = optax.sgd(0.0) if tx is None else tx
    if fsdp:
        specs = bp.fsdp_specs(params, mesh, min_size=0)
        step = bp.make_fsdp_train_step(loss_fn, tx, mesh, specs, **kw)
        params = _put(params, mesh, specs)
    else:
        step = bp.make_dp_train_step(loss_fn, tx, mesh, **kw)
        params = _put(params, mesh)
    return jax.jit(step), params, tx.init(params.split()[0])


@pytest.mark.parametrize("fsdp", [False, True], ids=["dp", "fsdp"])
def test_listed_rng_draws_per_shard_masks_equal_to_folded_one_device_runs(fsdp):
    """A duplicated batch on 2 shards: the loss is the mean of the one-device losses of
    the shard's rows with the seed folded by 0 and by 1, which differ (different masks)."""
    rng, loss_fn, params, x = _dropout_model(fsdp)
    mesh = _mesh(2)
    step, p, o = _dp_or_fsdp_step(fsdp, loss_fn, params, mesh, rngs=[rng])
    _, _, metrics = step(p, o, jnp.concatenate([x, x]))

    def folded(i):
        seed = jax.random.fold_in(rng.get_seed(params), i)
        return float(jax.jit(loss_fn)(rng.seed(params, seed=seed), x)[0])

    ref = [folded(0), folded(1)]
    assert ref[0] != ref[1]
    np.testing.assert_allclose(float(metrics["loss"]), np.mean(ref), rtol=1e-6)


@pytest.mark.parametrize("fsdp", [False, True], ids=["dp", "fsdp"])
def test_unlisted_rng_that_draws_raises_naming_it_and_rngs(fsdp):
    rng, loss_fn, params, x = _dropout_model(fsdp)
    mesh = _mesh(2)
    step, p, o = _dp_or_fsdp_step(fsdp, loss_fn, params, mesh)  # rngs=() (the default)
    where = "make_fsdp_train_step" if fsdp else "make_dp_train_step"
    with pytest.raises(ValueError, match=rf"{where}: the Rng 'net/rng' .*'net/rng/counter'.*rngs="):
        step(p, o, jnp.concatenate([x, x]))


# ---------------------------------------------------------------------------
# Item 5: a layer created inside the loss
# ---------------------------------------------------------------------------


def _lazy_model():
    """Params hold `fc` only; the loss also calls `head`, which is created there."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 4, rng)
    head = bx.Linear(g / "head", 1, rng)
    x = jnp.ones((4, 4))

    def loss_fn(p, x):
        h, p = bp.fsdp_call(fc, p, x)
        y, p = bp.fsdp_call(head, p, h)
        return jnp.mean(y**2), p

    params = fc(rng.seed(bx.Params(), seed=0), x)[1]  # unlocked, no head
    return loss_fn, params, x


@pytest.mark.parametrize("kind", ["one_device", "dp", "fsdp"])
def test_a_layer_created_in_the_loss_raises_naming_it_and_locked(kind):
    loss_fn, params, x = _lazy_model()
    tx = optax.sgd(0.0)
    if kind == "one_device":
        step, where = jax.jit(bx.make_train_step(loss_fn, tx)), "make_train_step"
        opt = tx.init(params.split()[0])
    else:
        step, params, opt = _dp_or_fsdp_step(kind == "fsdp", loss_fn, params, _mesh(2))
        where = "make_fsdp_train_step" if kind == "fsdp" else "make_dp_train_step"
    with pytest.raises(ValueError, match=rf"{where}: .*'net/head/bias', 'net/head/kernel'") as e:
        step(params, opt, x)
    assert "params.locked()" in str(e.value)


def test_fit_raises_when_the_step_returns_new_paths():
    """A hand-written step (not blox's) that returns params with a path it was not
    given: fit names it after the first step."""
    loss_fn, params, x = _lazy_model()

    def step(p, o, x):
        (_, p2) = loss_fn(p, x)
        return p2, o, {"loss": jnp.zeros(())}

    with pytest.raises(ValueError, match=r"fit: .*'net/head/bias', 'net/head/kernel'"):
        bx.fit(step, params, (), [(x,)], progress=False)


# ---------------------------------------------------------------------------
# Item 7: reduce_dtype
# ---------------------------------------------------------------------------

ROWS, SHARDS = 16, 4  # one row per microbatch: 16 on one device, 4 x 4 with 4 shards


def _bf16_linear(remat=True):
    """A bias-free bf16 Linear (8 -> 4) with a zero kernel and the loss mean_b sum_j
    (x_b @ W)_j: the gradient of one row is x_b[i] for every j, exact in bf16, so
    everything a step adds up is exact in f32 and the right bf16 result is the f32 sum
    rounded once. Trained by SGD at lr -1 from a zero kernel, the new kernel is the
    gradient."""
    g = bx.Graph("net")
    fc = bx.Linear(g / "fc", 4, None, use_bias=False, param_dtype=jnp.bfloat16)
    fc.kernel_init = lambda key, shape, dtype: jnp.zeros(shape, dtype)

    def loss_fn(p, x):
        y, p = bp.fsdp_call(fc, p, x, remat=remat)
        return jnp.mean(jnp.sum(y, axis=-1)), p

    r = np.random.default_rng(1)
    x = r.normal(size=(ROWS, 8)) * np.exp2(r.integers(-6, 4, size=(ROWS, 8)))
    x = jnp.asarray(x, jnp.bfloat16)
    params = fc(bx.Params(), x)[1].locked()
    want = np.asarray(x, np.float64).mean(axis=0)[:, None] * np.ones((1, 4))
    return loss_fn, params, x, jnp.asarray(want, jnp.bfloat16)


def _kernel_after_one_step(kind, reduce_dtype, lower=False, gather="per_layer"):
    loss_fn, params, x, want = _bf16_linear(remat=gather != "per_layer_no_remat")
    gather = "per_layer" if gather == "per_layer_no_remat" else gather
    tx = optax.sgd(-1.0)
    kw = {} if reduce_dtype == "default" else {"reduce_dtype": reduce_dtype}
    if kind == "one_device":
        step = jax.jit(bx.make_train_step(loss_fn, tx, accumulation_steps=ROWS, **kw))
        opt = tx.init(params.split()[0])
    else:
        kw["microbatches"] = ROWS // SHARDS
        if kind == "fsdp":
            kw["gather"] = gather
        step, params, opt = _dp_or_fsdp_step(
            kind == "fsdp", loss_fn, params, _mesh(SHARDS), tx, **kw
        )
    if lower:
        return step.lower(params, opt, x).as_text()
    new, _, _ = step(params, opt, x)
    return np.asarray(new[("net", "fc", "kernel")].value), np.asarray(want)


@pytest.mark.parametrize(
    "kind, gather",
    [
        ("one_device", None),
        ("dp", None),
        ("fsdp", "per_layer"),
        ("fsdp", "per_layer_no_remat"),
        ("fsdp", "per_step"),
    ],
)
def test_bf16_gradients_are_the_f32_sum_rounded_once(kind, gather):
    """Accumulation over 16 microbatches (one device), or over 4 microbatches and then
    the 4-way all-reduce (DP) / reduce-scatters (FSDP, per layer inside fsdp_call's
    backward or once per step): the default sums in f32, so the bf16 gradient is the
    exact sum rounded once; summed in bf16 (today's behaviour, still available as
    reduce_dtype=bfloat16) entries are off by an ulp or more. (XLA's CPU all-reduce of
    bf16 happens to round only once; NCCL's sums in bf16, which the HLO test below rules
    out.)"""
    got, want = _kernel_after_one_step(kind, "default", gather=gather)
    assert got.dtype == want.dtype  # the gradient comes back in the params' dtype
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    low, _ = _kernel_after_one_step(kind, jnp.bfloat16, gather=gather)
    assert np.any(low.astype(np.float32) != want.astype(np.float32))


@pytest.mark.parametrize("kind", ["dp", "fsdp"])
def test_the_lowered_step_reduces_bf16_gradients_in_f32(kind):
    """DP's all-reduce and FSDP's per-layer reduce-scatter (inside fsdp_call's backward)
    run on f32 operands by default; FSDP still all-gathers the bf16 weights in bf16."""
    text = _kernel_after_one_step(kind, "default", lower=True)
    op = "reduce_scatter" if kind == "fsdp" else "all_reduce"
    # Each op: '"stablehlo.<op>"(%x) <{...}> ({ reduction body }) : (operand types) -> ...'
    ops = re.findall(rf'"stablehlo\.{op}".*?\}}\) : \(([^)]*)\)', text, re.DOTALL)
    assert ops, f"no {op} in the lowered step"
    types = {t for o in ops for t in re.findall(r"x(bf16|f32)>", o)}
    assert types == {"f32"}, ops
    if kind == "fsdp":
        gathers = re.findall(r'"stablehlo\.all_gather"\(%[^)]*\).*?: \(([^)]*)\)', text)
        assert gathers and {t for o in gathers for t in re.findall(r"x(bf16|f32)>", o)} == {
            "bf16"
        }, gathers


# ---------------------------------------------------------------------------
# Item 4: an FSDP shard read outside fsdp_call
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("min_size", [0, 1024])
def test_a_layer_called_without_fsdp_call_raises_naming_the_leaf_and_fsdp_call(min_size):
    """The trial's mistake: the loss calls the layer directly. With min_size=0 the bias is
    sharded too (the layer computed on its local shards: a wrong loss); with the default
    the kernel alone is (a broadcasting error). Both now name the kernel and fsdp_call."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 64, rng)
    x = jnp.ones((4, 32))

    def loss_fn(p, x):
        y, p = fc(p, x)  # should be bp.fsdp_call(fc, p, x)
        return jnp.mean(y**2), p

    params = fc(rng.seed(bx.Params(), seed=0), x)[1].locked()
    mesh = _mesh(2)
    specs = bp.fsdp_specs(params, mesh, min_size=min_size)
    assert specs[("net", "fc", "kernel")].value != P()
    step = jax.jit(bp.make_fsdp_train_step(loss_fn, optax.sgd(0.1), mesh, specs))
    placed = _put(params, mesh, specs)
    with pytest.raises(
        ValueError, match=r"(?s)'net/fc/kernel' is this device's FSDP shard.*fsdp_call"
    ):
        step(placed, optax.sgd(0.1).init(placed.split()[0]), x)


# ---------------------------------------------------------------------------
# Items 11, 17, 18, 19, 20: errors that name the leaf and the fix
# ---------------------------------------------------------------------------


def _mlp_step(fsdp=False, n=4):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 64, rng)

    def loss_fn(p, x):
        y, p = bp.fsdp_call(fc, p, x)
        return jnp.mean(y**2), p

    x = jnp.asarray(np.random.default_rng(0).normal(size=(8, 32)), jnp.float32)
    params = fc(rng.seed(bx.Params(), seed=0), x)[1].locked()
    mesh = _mesh(n)
    tx = optax.sgd(0.1)
    if fsdp:
        specs = bp.fsdp_specs(params, mesh)
        return bp.make_fsdp_train_step(loss_fn, tx, mesh, specs), params, specs, mesh, tx, x
    return bp.make_dp_train_step(loss_fn, tx, mesh), params, None, mesh, tx, x


def test_a_batch_on_other_devices_is_moved_when_the_step_runs_outside_jit():
    """Item 18: outside jax.jit the step device_puts a batch committed elsewhere (JAX
    said "incompatible devices"); same result as the batch placed on the mesh."""
    step, params, _, mesh, tx, x = _mlp_step()
    p = bp.place(params, mesh)
    o = tx.init(p.split()[0])
    elsewhere = jax.device_put(x, jax.devices()[6])
    got, _, m = step(p, o, elsewhere)
    want, _, m_ref = step(p, o, jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert float(m["loss"]) == float(m_ref["loss"])
    np.testing.assert_array_equal(
        np.asarray(got[("net", "fc", "kernel")].value),
        np.asarray(want[("net", "fc", "kernel")].value),
    )


def test_params_moved_off_the_mesh_with_device_put_raise_naming_place():
    """Item 17: the step sees concrete params whose type keeps a mesh they left."""
    step, params, _, mesh, tx, x = _mlp_step()
    other = bp.make_mesh((2,), ("data",), devices=jax.devices()[4:6])
    stale = jax.device_put(bp.place(params, other), jax.devices()[0])
    with pytest.raises(ValueError, match=r"(?s)make_dp_train_step: leaf .*net/fc/bias.*bp\.place"):
        step(stale, tx.init(params.split()[0]), x)


def test_fsdp_step_given_unsharded_params_names_the_leaf_and_fsdp_specs():
    """Item 19: JAX said "in_specs ... does not match" without a path; the message's
    one-line fix (bp.place with the specs) then runs and equals the placed run."""
    step, params, specs, mesh, tx, x = _mlp_step(fsdp=True)
    step = jax.jit(step)
    replicated = bp.place(params, mesh)
    with pytest.raises(
        ValueError,
        match=r"(?s)make_fsdp_train_step: parameter 'net/fc/kernel' float32\[32, 64\] is laid "
        r"out as P\(None, None\), but the step's specs \(fsdp_specs\) have "
        r"P\(None, 'data'\).*bp\.place",
    ):
        step(replicated, tx.init(replicated.split()[0]), x)
    with pytest.raises(ValueError, match=r"'net/fc/kernel' .* is not on the mesh"):
        step(params, tx.init(params.split()[0]), x)
    placed = bp.place(params, specs, mesh=mesh)  # the fix the message shows
    opt = tx.init(params.split()[0])
    opt = bp.place(opt, bp.opt_state_specs(opt, specs), mesh=mesh)
    _, _, m = step(placed, opt, x)
    assert np.isfinite(float(m["loss"]))


def test_a_scalar_batch_leaf_says_scalars_do_not_split():
    """Item 20: it said "use a global batch that is a multiple of 4"."""
    step, params, _, mesh, tx, x = _mlp_step()
    with pytest.raises(
        ValueError, match=r"(?s)batch\[1\] is a scalar .*close over it.*non-trainable leaf"
    ):
        step(params, tx.init(params.split()[0]), x, jnp.float32(2.0))


def test_a_partial_batch_names_drop_remainder_and_weight_0_padding():
    """Item 11 (the step's side): a partial final batch that cannot be split evenly."""
    step, params, _, mesh, tx, x = _mlp_step()
    with pytest.raises(
        ValueError,
        match=r"(?s)batch\[0\] of shape \(6, 32\) has 6 rows.*drop_remainder=True.*weight 0",
    ):
        step(params, tx.init(params.split()[0]), x[:6])
