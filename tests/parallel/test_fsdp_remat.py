"""`fsdp_call`'s backward modes (``remat``) on 8 simulated devices: the default
``'weights'`` keeps the layer's activations and gathers only the weights again, so one
layer's forward + backward costs the FLOPs of the same layer under DP (``True`` also
recomputes the layer's forward) and no full weight is kept for the backward (``False``
keeps them). References: the gradients of the whole batch on one device (plain
``jax.grad``), the same layer under `dp_value_and_grad`, and the compiled programs'
cost and memory analyses and collectives."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp
from tests.tolerances import tol

N = 8
FUSION = {"xla_cpu_use_fusion_emitters": True}  # as users compile (tests/conftest.py)


class TwoLinear(bx.Module):
    """Linear (D -> F) -> tanh -> Linear (F -> D): the activation between the two
    matmuls is what ``remat=True`` recomputes and ``'weights'`` keeps."""

    def __init__(self, graph, width, hidden, rng, dtype):
        super().__init__(graph)
        self.fc1 = bx.Linear(graph / "fc1", hidden, rng, param_dtype=dtype)
        self.fc2 = bx.Linear(graph / "fc2", width, rng, param_dtype=dtype)

    def __call__(self, params, x):
        h, params = self.fc1(params, x)
        return self.fc2(params, jnp.tanh(h))


def _scaled_inside_jit(fc):
    """``tanh(x @ (2 W) + b)`` with ``2 W`` computed inside a ``jax.jit`` that also reads
    ``x``: a residual of the weight alone that comes out of a call with the input."""
    path = fc.graph.path

    @jax.jit
    def product(x, w):
        return x @ (w * jnp.asarray(2, w.dtype))

    def call(p, x):
        if (*path, "kernel") not in p:  # creates the params
            return fc(p, x)
        y = product(x, p[(*path, "kernel")].value) + p[(*path, "bias")].value[None]
        return jnp.tanh(y), p

    return call


def _layer(kind, dtype, width, rows=2):
    """``(call, params, x_shape)``: one layer, its params and the global batch shape
    (`N` devices x `rows`; sequences of 8 tokens for the block)."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    if kind == "mlp":
        layer = TwoLinear(g / "layer", width, 4 * width, rng, dtype)
        shape = (rows * N, width)

        def call(p, x):
            return layer(p, x)
    elif kind == "jitted":
        layer = bx.Linear(g / "layer", width, rng, param_dtype=dtype)
        shape = (rows * N, width)
        call = _scaled_inside_jit(layer)
    else:
        layer = bx.TransformerBlock(
            g / "layer", width, 4, rng, mlp_size=4 * width, param_dtype=dtype
        )
        shape = (rows * N, 8, width)

        def call(p, x):
            return layer(p, x, is_causal=True)

    x = jnp.zeros((1,) + shape[1:], dtype)
    params = jax.jit(lambda: call(rng.seed(bx.Params(), seed=0), x)[1].locked())()
    return call, params, shape


def _loss(call, mode):
    """The mean square of the layer's output; `mode`: ``'dp'`` (a plain call),
    ``'default'`` (`fsdp_call` without `remat`), ``'checkpoint'`` (the default inside
    the user's ``jax.checkpoint``) or a `remat` value."""

    def loss(p, x):
        if mode == "dp":
            out, p = call(p, x)
        elif mode == "default":
            out, p = bp.fsdp_call(call, p, x, under="net/layer")
        elif mode == "checkpoint":
            out, p = jax.checkpoint(lambda p, x: bp.fsdp_call(call, p, x, under="net/layer"))(p, x)
        else:
            out, p = bp.fsdp_call(call, p, x, under="net/layer", remat=mode)
        return jnp.mean(out.astype(jnp.float32) ** 2), p

    return loss


def _grad_step(call, params, mode, mesh, min_size=256):
    """The jitted ``shard_map`` of one layer's forward + backward (no scan around it):
    `fsdp_value_and_grad`, or `dp_value_and_grad` (replicated params) for ``'dp'``."""
    if mode == "dp":
        specs = jax.tree.map(lambda _: P(), params)
        grad = bp.dp_value_and_grad(_loss(call, mode))
    else:
        specs = bp.fsdp_specs(params, mesh, min_size=min_size)
        grad = bp.fsdp_value_and_grad(_loss(call, mode), specs)
    step = jax.shard_map(
        lambda p, x: grad(p, x)[:2],
        mesh=mesh,
        in_specs=(specs, P("data")),
        out_specs=(P(), specs.split()[0]),
    )
    return jax.jit(step), specs


def _placed(tree, specs, mesh):
    return jax.tree.map(lambda v, s: jax.device_put(v, NamedSharding(mesh, s)), tree, specs)


def _abstract(tree, specs, mesh):
    return jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NamedSharding(mesh, s)),
        tree,
        specs,
    )


@pytest.mark.parametrize(
    ("kind", "dtype", "mode"),
    [
        ("mlp", jnp.float32, "weights"),
        ("mlp", jnp.bfloat16, "weights"),
        ("block", jnp.float32, "weights"),
        ("block", jnp.bfloat16, "weights"),  # under the suite's strict promotion
        ("jitted", jnp.float32, "weights"),
        ("mlp", jnp.float32, "checkpoint"),
    ],
)
def test_weights_mode_gradients_equal_one_device(kind, dtype, mode):
    """Loss and every gradient of ``remat='weights'`` on 8 devices equal ``jax.grad`` of
    the whole batch on one device (the same bf16 params and batch for bf16); also
    inside a ``jax.checkpoint`` of the user's."""
    mesh = bp.make_mesh((N,), ("data",))
    call, params, shape = _layer(kind, dtype, width=32)
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape), dtype)
    step, specs = _grad_step(call, params, mode, mesh)
    loss, grads = step(_placed(params, specs, mesh), _placed(x, P("data"), mesh))
    trained, rest = params.split()
    ref_loss, ref = jax.jit(jax.value_and_grad(lambda t: _loss(call, "dp")(t.merge(rest), x)[0]))(
        trained
    )
    t = tol(dtype)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=t["rtol"])
    assert grads.keys() == ref.keys()
    assert any("data" in jax.tree.leaves(tuple(s)) for s in specs.split()[0].leaves())
    # atol relative to the largest gradient: some are 0 in exact arithmetic (the key
    # bias: softmax ignores a shift), rounding noise in both runs
    scale = max(float(np.max(np.abs(np.asarray(b, np.float32)))) for b in ref.leaves())
    for key, a, b in zip(grads.keys(), grads.leaves(), ref.leaves(), strict=True):
        assert a.dtype == b.dtype == dtype, key
        np.testing.assert_allclose(
            np.asarray(a, np.float32),
            np.asarray(b, np.float32),
            rtol=t["rtol"],
            atol=t["atol"] * scale,
            err_msg=str(key),
        )


def _flops(kind, dtype, mode, width, rows):
    mesh = bp.make_mesh((N,), ("data",))
    call, params, shape = _layer(kind, dtype, width, rows)
    step, specs = _grad_step(call, params, mode, mesh)
    x = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("data")))
    compiled = step.lower(_abstract(params, specs, mesh), x).compile(FUSION)
    return compiled.cost_analysis()["flops"]


@pytest.mark.parametrize(
    ("kind", "dtype"),
    [("mlp", jnp.float32), ("mlp", jnp.bfloat16), ("block", jnp.float32)],
)
def test_one_layer_costs_the_flops_of_dp(kind, dtype):
    """One FSDP layer's forward + backward, jitted alone: the default (``'weights'``)
    costs at most 1.05x the FLOPs of the same layer under DP; ``remat=True``, which runs
    the layer's forward again in the backward, costs over 1.1x. (16 rows or tokens per
    device: each gather adds a few elementwise operations per weight element, casts
    for bf16, which a handful of rows would already make visible.)"""
    width, rows = (128, 16) if kind == "mlp" else (64, 2)
    dp = _flops(kind, dtype, "dp", width, rows)
    default = _flops(kind, dtype, "default", width, rows)
    recompute = _flops(kind, dtype, True, width, rows)
    assert default <= 1.05 * dp, (default, dp)
    assert recompute >= 1.1 * dp, (recompute, dp)


def _stack_step(mode, jitted, layers, width, rows, mesh):
    """The compiled fwd + bwd of `layers` Linear layers (tanh after each) through
    `fsdp_call` with `remat` `mode`; `jitted`: each layer `_scaled_inside_jit`."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fcs = [bx.Linear(g / f"fc_{i}", width, rng) for i in range(layers)]
    calls = [_scaled_inside_jit(fc) if jitted else fc for fc in fcs]

    def model(p, x):
        for fc, call in zip(fcs, calls, strict=True):
            x, p = bp.fsdp_call(call, p, x, under=fc.graph.path, remat=mode)
            x = x if jitted else jnp.tanh(x)
        return x, p

    def loss(p, x):
        out, p = model(p, x)
        return jnp.sum(out**2), p

    init = lambda: model(rng.seed(bx.Params(), seed=0), jnp.zeros((1, width)))[1].locked()  # noqa: E731
    abstract = jax.eval_shape(init)
    specs = bp.fsdp_specs(abstract, mesh)
    grad = bp.fsdp_value_and_grad(loss, specs)
    step = jax.shard_map(
        lambda p, x: grad(p, x)[:2],
        mesh=mesh,
        in_specs=(specs, P("data")),
        out_specs=(P(), specs.split()[0]),
    )
    x = jax.ShapeDtypeStruct(
        (rows * N, width), jnp.float32, sharding=NamedSharding(mesh, P("data"))
    )
    return jax.jit(step).lower(_abstract(abstract, specs, mesh), x).compile(FUSION)


@pytest.mark.full_optimizations
@pytest.mark.parametrize("jitted", [False, True])
def test_weights_mode_keeps_no_full_weight_for_the_backward(jitted):
    """8 layers: with ``remat=False`` the backward starts with the full kernels of every
    layer alive (they are residuals); with ``'weights'`` the backward gathers each again
    (one all-gather per layer forward, one per layer backward but the first, whose
    input needs no gradient) and the temporaries hold about two layers' full weights
    (a gathered kernel and its gradient before the reduce-scatter). `jitted`: the
    residual is ``2 W``, computed inside a ``jax.jit`` that also reads the input, and
    it is rebuilt all the same."""
    layers, width, rows = 8, 256, 2
    mesh = bp.make_mesh((N,), ("data",))
    layer = width * width * 4
    temp, gathers = {}, {}
    for mode in ("weights", False):
        compiled = _stack_step(mode, jitted, layers, width, rows, mesh)
        temp[mode] = compiled.memory_analysis().temp_size_in_bytes
        hlo = compiled.as_text()
        gathers[mode] = len(re.findall(r" all-gather(?:-start)?\(", hlo))
        assert len(re.findall(r" reduce-scatter\(", hlo)) == layers
    assert gathers == {"weights": 2 * layers - 1, False: layers}
    assert temp["weights"] <= 2.2 * layer, (temp, layer)
    assert temp[False] - temp["weights"] >= (layers - 4) * layer, (temp, layer)


@pytest.mark.parametrize("remat", ["all", "Weights", 1, None])
def test_a_bad_remat_raises(remat):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 4, rng)
    params = fc(rng.seed(bx.Params(), seed=0), jnp.ones((2, 3)))[1].locked()
    with pytest.raises(ValueError, match=r"remat must be one of \('weights', True, False\)"):
        bp.fsdp_call(fc, params, jnp.ones((2, 3)), remat=remat)
