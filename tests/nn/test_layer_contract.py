"""The shared layer contract, one check per test, each over every row of ``layer_table``:

* ``jax.jit`` equals eager, and the returned params keep the input's tree, shapes and dtypes;
* two jitted steps (the second on the first's params) trace once;
* ``jax.eval_shape`` gives the eager shapes and dtypes;
* ``jax.grad`` of a loss over the outputs: finite, the trainable tree, not all zero;
* ``jax.vmap`` over a new leading axis equals a Python loop over it;
* bfloat16 params and inputs run in bfloat16 and stay close to float32;
* float64 params and inputs (``jax.enable_x64``) run in float64 and equal float32;
* a wrong input shape raises an error that names the layer's path;
* the params placed by the row's sharding rules on a 2x4 ``('data', 'model')`` mesh, the
  input's batch over ``'data'``: under ``jax.jit`` on an Explicit and on an Auto mesh the
  outputs and params equal the unsharded single-device run (float32, highest matmul
  precision), and on the Explicit mesh the returned params keep their shardings;
* inside ``jax.shard_map`` over a data axis, under ``make_dp_train_step`` and as a
  ``pipeline_value_and_grad`` stage, against single-device runs (see "parallel" below).

References are independent of the transformation under test: the eager single-device call
(itself checked against PyTorch / NumPy in the per-layer test files), a Python loop, the
float32 run. Built layers, params (the layer's own layout from ``jax.eval_shape``, filled
with NumPy values: no initializer is compiled) and eager outputs are cached per row
(module level), so each row is built once for all checks.
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp
from tests.nn.layer_table import (
    DESCRIPTORS,
    PATH,
    RNG,
    by_name,
    cast_floats,
    numpy_params,
    public_modules,
)

IDS = [d.name for d in DESCRIPTORS]
ROWS = pytest.mark.parametrize("name", IDS)
# Rows without parameters to shard (their inputs are sharded over 'model' instead).
_REPLICATED = {"Dropout", "SinusoidalPositionalEncoding", "max_pool", "avg_pool", "upsample"}


# ----------------------------------------------------------------------------- caches


class _Built:
    """A row's layer, its initialized (locked) params, input and eager outputs."""

    def __init__(self, desc):
        self.desc = desc
        g = bx.Graph("net")
        self.rng = bx.Rng(g / "rng")
        self.layer = desc.build(g / "layer", self.rng)
        self.x = jax.tree.map(jnp.asarray, desc.inputs(0))
        self.x2 = jax.tree.map(jnp.asarray, desc.inputs(1))
        seeded = self.rng.seed(bx.Params(), seed=0)
        self.params = numpy_params(self.call, seeded, self.x).locked()
        self.traces = 0

        def step(p, x):
            self.traces += 1
            return desc.call(self.layer, p, x)

        self.jitted = jax.jit(step)
        reference = self.call if desc.eager else self.jitted
        with jax.default_matmul_precision("highest"):
            self.y, self.new = reference(self.params, self.x)
        self.rules = tuple(desc.rules) + (RNG,)

    def call(self, params, x):
        return self.desc.call(self.layer, params, x)


@functools.cache
def built(name: str) -> _Built:
    return _Built(by_name()[name])


@functools.cache
def mesh(kind: str):
    t = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[kind]
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(t, t))


# ----------------------------------------------------------------------------- helpers


def _floats(tree) -> list:
    return [v for v in jax.tree.leaves(tree) if jnp.issubdtype(v.dtype, jnp.floating)]


def _assert_close(actual, expected, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Trees of the same structure: floating leaves close (`atol` relative to the
    largest magnitude of the expected leaf, at least `atol` itself: a deep stack's float32
    rounding grows with its outputs), the other leaves equal."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected), what
    for i, (a, e) in enumerate(
        zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    ):
        a, e = np.asarray(a), np.asarray(e)
        msg = f"{what}: leaf {i}"
        assert a.shape == e.shape, msg
        if np.issubdtype(e.dtype, np.floating) or e.dtype == jnp.bfloat16:
            e = e.astype(np.float64)
            scale = max(1.0, float(np.max(np.abs(e), initial=0.0)))
            np.testing.assert_allclose(
                a.astype(np.float64), e, rtol=rtol, atol=atol * scale, err_msg=msg
            )
        else:
            np.testing.assert_array_equal(a, e, err_msg=msg)


def _assert_same_params(new: bx.Params, params: bx.Params) -> None:
    assert isinstance(new, bx.Params)
    assert jax.tree.structure(new) == jax.tree.structure(params)
    chex.assert_trees_all_equal_shapes_and_dtypes(new, params)


F32_DEEP = dict(rtol=1e-5, atol=1e-5)  # jit / vmap / mesh vs a reference: other fusions


# ----------------------------------------------------------------------------- coverage


def test_the_table_covers_every_public_nn_module():
    covered = {d.cls for d in DESCRIPTORS} | {c for d in DESCRIPTORS for c in d.covers}
    missing = sorted(n for n, cls in public_modules().items() if cls not in covered)
    assert not missing, f"blox.nn layers without a row in tests/nn/layer_table.py: {missing}"
    assert len(set(IDS)) == len(IDS), "row names must be unique"
    stale = sorted(_STATELESS_STAGES - set(IDS))
    assert not stale, f"_STATELESS_STAGES names rows the table lacks: {stale}"
    for d in DESCRIPTORS:
        assert (d.bad is None) != (not d.no_bad_reason), (
            f"row {d.name}: give a wrong input (bad=...) or say why there is none"
        )


# ----------------------------------------------------------------------------- checks


@pytest.mark.parametrize("name", [d.name for d in DESCRIPTORS if d.eager])
def test_jit_equals_eager_and_params_keep_their_tree(name):
    b = built(name)
    with jax.default_matmul_precision("highest"):
        y, new = b.jitted(b.params, b.x)
    _assert_close(y, b.y, "outputs", **F32_DEEP)
    _assert_close(new, b.new, "params", **F32_DEEP)
    _assert_same_params(new, b.params)
    _assert_same_params(b.new, b.params)


@ROWS
def test_two_jitted_steps_trace_once(name):
    b = built(name)
    with jax.default_matmul_precision("highest"):
        _, p1 = b.jitted(b.params, b.x)
        b.jitted(p1, b.x2)
    assert b.traces == 1, f"{name}: traced {b.traces} times over two steps"


@ROWS
def test_eval_shape_gives_the_eager_shapes_and_dtypes(name):
    b = built(name)
    out = jax.eval_shape(b.call, b.params, b.x)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, (b.y, b.new))


@ROWS
def test_grad_is_finite_with_the_trainable_tree(name):
    b = built(name)
    train, rest = b.params.split()
    wrt_x = b.desc.float_input

    def loss(t, x):
        y, _ = b.call(t.merge(rest), x)
        return sum(jnp.sum(jnp.square(v.astype(jnp.float32))) for v in _floats(y))

    g_train, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)) if wrt_x else _grad_params(loss))(
        train, b.x
    )
    assert jax.tree.structure(g_train) == jax.tree.structure(train)
    chex.assert_trees_all_equal_shapes_and_dtypes(g_train, train)
    leaves = jax.tree.leaves(g_train) + (jax.tree.leaves(g_x) if wrt_x else [])
    assert leaves, f"{name}: nothing to differentiate"
    assert all(bool(jnp.all(jnp.isfinite(v))) for v in leaves)
    assert any(bool(jnp.any(v != 0)) for v in leaves), f"{name}: every gradient is zero"


def _grad_params(loss):
    def f(t, x):
        return jax.grad(loss)(t, x), None

    return f


@ROWS
def test_vmap_over_a_leading_axis_equals_a_loop(name):
    b = built(name)
    xs = jax.tree.map(lambda a, c: jnp.stack([a, c]), b.x, b.x2)
    with jax.default_matmul_precision("highest"):
        ys = jax.jit(jax.vmap(b.call, in_axes=(None, 0)))(b.params, xs)
        one = b.call if b.desc.eager else b.jitted
        loop = [(b.y, b.new), one(b.params, b.x2)]
    expected = jax.tree.map(lambda *v: jnp.stack(v), *loop)
    _assert_close(ys, expected, "vmap vs loop", **F32_DEEP)


@ROWS
def test_bfloat16_params_and_inputs_compute_in_bfloat16(name):
    b = built(name)
    params = cast_floats(b.params, jnp.bfloat16)
    x = cast_floats(b.x, jnp.bfloat16)
    y, new = jax.jit(b.call)(params, x)
    _assert_same_params(new, params)
    floats = _floats(y)
    assert floats and all(v.dtype == jnp.bfloat16 for v in floats), [v.dtype for v in floats]
    for v, ref in zip(floats, _floats(b.y), strict=True):
        scale = float(np.max(np.abs(np.asarray(ref)))) or 1.0
        r = b.desc.bf16_rtol
        np.testing.assert_allclose(
            np.asarray(v, np.float32), np.asarray(ref), rtol=r, atol=r * scale
        )


@ROWS
def test_float64_params_and_inputs_compute_in_float64(name):
    b = built(name)
    with jax.enable_x64(True):
        params = cast_floats(b.params, jnp.float64)
        x = cast_floats(b.x, jnp.float64)
        with jax.default_matmul_precision("highest"):
            y, new = jax.jit(b.call)(params, x)
        _assert_same_params(new, params)
        floats = _floats(y)
        assert floats and all(v.dtype == jnp.float64 for v in floats), [v.dtype for v in floats]
        if b.desc.stochastic:  # other random bits: compare the elements both runs keep
            a, e = np.asarray(floats[0]), np.asarray(_floats(b.y)[0])
            kept = (a != 0) & (e != 0)
            assert kept.sum() >= 2, kept
            np.testing.assert_allclose(a[kept], e[kept], **F32_DEEP)
        else:
            _assert_close(y, b.y, "float64 vs float32", **F32_DEEP)


@pytest.mark.parametrize("name", [d.name for d in DESCRIPTORS if d.bad is not None])
def test_a_wrong_input_shape_raises_naming_the_layer_path(name):
    b = built(name)
    bad = jax.tree.map(jnp.asarray, b.desc.bad())
    with pytest.raises((ValueError, TypeError), match=b.desc.bad_match) as info:
        b.call(b.params, bad)
    assert f"'{PATH}" in str(info.value), str(info.value)


# ----------------------------------------------------------------------------- sharding


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@ROWS
def test_sharded_by_rules_under_jit_equals_the_unsharded_run(name, kind):
    b = built(name)
    m = mesh(kind)
    specs = bp.param_specs(b.params, b.rules, m)  # every parameter needs a rule
    entries = {e for s in jax.tree.leaves(specs, is_leaf=_is_spec) for e in s}
    assert ("model" in entries) == (name not in _REPLICATED), (name, entries)
    shardings = bp.param_shardings(b.params, b.rules, m)
    params = jax.device_put(b.params, shardings)
    x = jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(m, s)),
        b.x,
        b.desc.in_spec,
    )
    with jax.set_mesh(m), jax.default_matmul_precision("highest"):
        y, new = jax.jit(b.call)(params, x)
    _assert_close(y, b.y, f"{kind} mesh outputs", **F32_DEEP)
    _assert_close(new, b.new, f"{kind} mesh params", **F32_DEEP)
    if kind == "explicit":
        for path, v in new.arrays().items():
            want = shardings.arrays()[path]
            assert v.sharding.is_equivalent_to(want, v.ndim), (path, v.sharding, want)


def _is_spec(x) -> bool:
    return isinstance(x, jax.sharding.PartitionSpec)


def test_wrong_rules_are_named():
    """The mesh check relies on param_specs covering every parameter: a row whose rules
    miss one fails with the path (here: the bias of Linear)."""
    b = built("Linear")
    with pytest.raises(ValueError, match=re.escape(f"'{PATH}/bias'")):
        bp.param_specs(b.params, (("kernel", (None, "model")), RNG), mesh("auto"))


# ----------------------------------------------------------------------------- parallel
#
# Every row inside the parallel runtimes, each against a single-device reference:
# (a) `jax.shard_map` over a 2-device data axis: each shard's outputs and params equal the
#     single-device call on that shard (`jax.vmap` over the two shards, itself checked
#     against a Python loop above). Explicit mesh only: inside `shard_map` every axis is
#     manual, so the program is the same on an Auto mesh.
# (b) `make_dp_train_step` (SGD, lr 1, the row's Rng in ``rngs=``) on an Explicit and an
#     Auto mesh (the step's code outside `shard_map` differs): the loss and the updated
#     params equal the mean over the shards of single-device `value_and_grad` results, each
#     shard's seed folded with its index, no DP code involved.
# (c) a two-stage `pipeline_value_and_grad` (1F1B, 2 microbatches) whose stages each run
#     the layer: loss, stage gradients and non-trainable state equal the same stages run
#     one after the other on one device under plain `jax.value_and_grad`.
#
# The deep composite (`eager=False`: YOLOBackboneNeck) is left out: its blocks have rows.
# (c) also leaves out the rows in `_STATELESS_STAGES`: a stateless function of (params,
# x) with no scan carry, no non-trainable state, no randomness, float inputs and no
# attention, whose stage runs the same pipeline code as the Linear row (which is checked);
# a new row is checked unless it is added there.

_PARALLEL_ROWS = [d.name for d in DESCRIPTORS if d.eager]
_STATELESS_STAGES = {
    "MLP",
    "Conv2d-row-NCHW",
    "Conv1d-depthwise-causal",
    "ConvTranspose2d-grouped",
    "ConvTranspose1d-torch-layout",
    "LearnedPositionalEmbedding",
    "SinusoidalPositionalEncoding",
    "LayerNorm",
    "RMSNorm",
    "GroupNorm",
    "PReLU",
    "ConvBNSiLU",  # its BatchNorm has the BatchNorm rows; C2f / SPPF: ConvBNSiLU blocks
    "C2f",
    "SPPF",
    "max_pool",
    "avg_pool",
    "upsample",
}
_PIPELINE_ROWS = [n for n in _PARALLEL_ROWS if n not in _STATELESS_STAGES]

N_SHARDS = 2


@functools.cache
def axis_mesh(kind: str, axis: str):
    t = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[kind]
    return jax.make_mesh((N_SHARDS,), (axis,), devices=jax.devices()[:N_SHARDS], axis_types=(t,))


def _split(tree, n: int):
    """``(B, ...)`` leaves -> ``(n, B / n, ...)``."""
    return jax.tree.map(lambda a: a.reshape((n, a.shape[0] // n) + a.shape[1:]), tree)


def _place(tree, m, spec):
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(m, spec)), tree)


def _sq_loss(y) -> jax.Array:
    return sum(jnp.mean(jnp.square(v.astype(jnp.float32))) for v in _floats(y))


@pytest.mark.parametrize("name", _PARALLEL_ROWS)
def test_inside_shard_map_each_shard_equals_the_single_device_run(name):
    kind = "explicit"
    b = built(name)
    m = axis_mesh(kind, "data")

    def per_shard(params, x):
        y, new = b.call(params, x)
        return y, jax.tree.map(lambda v: v[None], new)  # params stacked over the shards

    sm = jax.shard_map(
        per_shard, mesh=m, in_specs=(P(), P("data")), out_specs=(P("data"), P("data"))
    )
    with jax.default_matmul_precision("highest"):
        y, new = jax.jit(sm)(_place(b.params, m, P()), _place(b.x, m, P("data")))
        ref_y, ref_new = jax.jit(jax.vmap(b.call, in_axes=(None, 0)))(
            b.params, _split(b.x, N_SHARDS)
        )
    _assert_close(_split(y, N_SHARDS), ref_y, f"{kind} shard_map outputs", **F32_DEEP)
    _assert_close(new, ref_new, f"{kind} shard_map params", **F32_DEEP)


def _dp_reference(b, x):
    """One SGD step (lr 1) on the mean over the shards of each shard's single-device
    loss and gradients (no DP code): floating non-trainable state averaged over them.
    Shard i draws its keys from the seed folded with i (the step's ``rngs=``), and the
    seed is put back after."""
    train, rest = b.params.split()

    def loss(t, x, i):
        params = t.merge(rest)
        seed = b.rng.get_seed(params)
        y, new = b.call(b.rng.seed(params, seed=jax.random.fold_in(seed, i)), x)
        return _sq_loss(y), b.rng.seed(new, seed=seed)

    (losses, news), grads = jax.vmap(jax.value_and_grad(loss, has_aux=True), in_axes=(None, 0, 0))(
        train, _split(x, N_SHARDS), jnp.arange(N_SHARDS)
    )
    grads = jax.tree.map(lambda g: jnp.mean(g, axis=0), grads)
    new_train = jax.tree.map(lambda p, g: p - g, train, grads)

    def settle(v):
        return jnp.mean(v, axis=0) if jnp.issubdtype(v.dtype, jnp.floating) else v[0]

    _, new_rest = jax.tree.map(settle, news).split()
    return jnp.mean(losses), new_train.merge(new_rest)


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("name", _PARALLEL_ROWS)
def test_make_dp_train_step_equals_the_mean_of_single_device_shard_steps(name, kind):
    import optax

    b = built(name)
    m = axis_mesh(kind, "data")
    tx = optax.sgd(1.0)

    def loss_fn(params, x):
        y, params = b.call(params, x)
        return _sq_loss(y), params

    # every row's Rng listed: a row that draws (Dropout) draws per-shard keys
    step = jax.jit(bp.make_dp_train_step(loss_fn, tx, m, rngs=[b.rng]))
    params = _place(b.params, m, P())
    with jax.default_matmul_precision("highest"):
        new, _, metrics = step(params, tx.init(params.split()[0]), b.x)
        ref_loss, ref_new = jax.jit(_dp_reference, static_argnums=0)(b, b.x)
    _assert_close(metrics["loss"], ref_loss, f"{kind} DP loss", **F32_DEEP)
    _assert_close(new, ref_new, f"{kind} DP params", **F32_DEEP)


def _per_example(y) -> jax.Array:
    """``[B]``: each example's mean square over the floating output leaves."""
    return sum(
        jnp.mean(jnp.square(v.astype(jnp.float32)).reshape(v.shape[0], -1), axis=1)
        for v in _floats(y)
    )


def _stage_params(b) -> bx.Params:
    """Two stages: the row's params and a copy with its floating leaves halved."""
    half = jax.tree.map(
        lambda v: v * jnp.asarray(0.5, v.dtype) if jnp.issubdtype(v.dtype, jnp.floating) else v,
        b.params,
    )
    return bp.stack_stages([b.params, half])


def _pipeline_reference(b, stages, x):
    """The two stages one after the other on one device, microbatch by microbatch,
    each stage's non-trainable state threaded through the microbatches in order."""
    train, rest = stages.split()

    def total(train):
        params = [jax.tree.map(lambda v, s=s: v[s], train.merge(rest)) for s in range(N_SHARDS)]
        losses = []
        xs = _split(x, N_SHARDS)
        for j in range(N_SHARDS):
            x_mb = jax.tree.map(lambda a, j=j: a[j], xs)
            acc = 0.0
            for s in range(N_SHARDS):
                y, params[s] = b.call(params[s], x_mb)
                acc = acc + _per_example(y)
            losses.append(jnp.mean(acc))
        new = jax.tree.map(lambda *v: jnp.stack(v), *params)
        return sum(losses) / len(losses), new

    (loss, new), grads = jax.value_and_grad(total, has_aux=True)(train)
    return loss, grads, new


@pytest.mark.parametrize("name", _PIPELINE_ROWS)
def test_as_a_pipeline_stage_equals_the_stages_run_one_after_the_other(name):
    b = built(name)
    m = axis_mesh("explicit", "stage")
    float_in = b.desc.float_input

    def stage_fn(params, h):
        x, acc = h
        x_in = x if float_in else jax.tree.map(lambda a: a.astype(jnp.int32), x)
        y, params = b.call(params, x_in)
        return (x, acc + _per_example(y)), params

    def last_fn(shared, h, _):
        return jnp.mean(h[1]), shared

    step = bp.pipeline_value_and_grad(
        stage_fn, last_fn, m, schedule="1f1b", num_microbatches=N_SHARDS
    )
    stages = _stage_params(b)
    shared = bx.Params().locked()
    # The activation: the row's input (tokens as floats) and a [B] running sum.
    batch = jax.tree.leaves(b.x)[0].shape[0]
    h = jax.tree.map(lambda a: a.astype(jnp.float32), b.x)
    inputs = (h, jnp.zeros((batch,), jnp.float32))
    targets = jnp.zeros((batch,), jnp.float32)
    with jax.default_matmul_precision("highest"):
        loss, (grads, _), (new, _) = jax.jit(step)(stages, shared, inputs, targets)
        ref_loss, ref_grads, ref_new = jax.jit(_pipeline_reference, static_argnums=0)(
            b, stages, b.x
        )
    _assert_close(loss, ref_loss, "pipeline loss", **F32_DEEP)
    _assert_close(grads, ref_grads, "pipeline stage gradients", **F32_DEEP)
    _assert_close(new, ref_new, "pipeline stage params", **F32_DEEP)
