"""`Linear` and `MLP` on sharded inputs and kernels, on Explicit and Auto (2, 4) meshes.

Reference: the same math in NumPy float64 on unsharded arrays (highest matmul precision
in the layers). On an Explicit mesh the output's sharding is part of the array's type,
so the expected spec is checked exactly; on an Auto mesh the compiler chooses it unless
the user constrains it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from tests.tolerances import tol

HIGHEST = jax.lax.Precision.HIGHEST


def _mesh(kind: str):
    types = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[kind]
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(types, types))


def _place(params: bx.Params, mesh, specs: dict) -> bx.Params:
    """`params` on `mesh`: leaf ``path`` on ``specs[path]`` (default replicated)."""
    shardings = jax.tree_util.tree_map_with_path(
        lambda kp, _: NamedSharding(mesh, specs.get(kp[0].key, P())), params
    )
    return jax.device_put(params, shardings)


def _linear(d_in=8, d_out=8, dtype=jnp.float32):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", d_out, rng, param_dtype=dtype)
    params = rng.seed(bx.Params(), seed=0)
    _, params = fc(params, jnp.ones((1, d_in), dtype))
    # A non-zero bias, so a misplaced bias add would show.
    b = jax.random.normal(jax.random.key(7), (d_out,), jnp.float32).astype(dtype)
    params = jax.tree_util.tree_map_with_path(
        lambda kp, v: b if kp[0].key == "net/fc/bias" else v, params
    )
    return fc, params.locked()


def _np_linear(params, x, name="net/fc"):
    a = {"/".join(k): np.asarray(v, np.float64) for k, v in params.arrays().items()}
    return np.asarray(x, np.float64) @ a[name + "/kernel"] + a[name + "/bias"]


def _x(shape, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(3), shape, jnp.float32).astype(dtype)


# (x shape, x spec, kernel spec, bias spec, expected output spec on an Explicit mesh)
LINEAR_CASES = {
    # row-parallel: contracting dim sharded in both -> JAX alone raises ShardingTypeError
    "row": ((4, 8), P("data", "model"), P("model", None), P(), P("data", None)),
    "row_3d": ((2, 4, 8), P("data", None, "model"), P("model", None), P(), P("data", None, None)),
    # column-parallel: no contraction over a sharded dim, JAX infers (nothing added)
    "column": ((4, 8), P("data", None), P(None, "model"), P("model"), P("data", "model")),
    # contracting over 'data', columns over 'model': features keep the kernel's columns
    "row_and_column": ((4, 8), P(None, "data"), P("data", "model"), P("model"), P(None, "model")),
    # the kernel's column axis is taken by the batch dim: features replicated
    "column_axis_taken": ((4, 8), P("data", "model"), P("model", "data"), P(), P("data", None)),
}


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("case", sorted(LINEAR_CASES))
def test_linear_sharded_under_jit_equals_unsharded(kind, case):
    shape, x_spec, k_spec, b_spec, expected = LINEAR_CASES[case]
    mesh = _mesh(kind)
    fc, params = _linear()
    x = _x(shape)
    ps = _place(params, mesh, {"net/fc/kernel": k_spec, "net/fc/bias": b_spec})
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    y, _ = jax.jit(lambda p, a: fc(p, a, precision=HIGHEST))(ps, xs)
    np.testing.assert_allclose(np.asarray(y), _np_linear(params, x), **tol(jnp.float32))
    if kind == "explicit":
        assert y.sharding.spec == expected
        assert jax.typeof(y).sharding.spec == expected


def test_linear_eager_on_explicit_mesh():
    """Called outside jit on placed arrays: the same inferred sharding."""
    mesh = _mesh("explicit")
    fc, params = _linear()
    x = _x((4, 8))
    ps = _place(params, mesh, {"net/fc/kernel": P("model", None)})
    y, _ = fc(ps, jax.device_put(x, NamedSharding(mesh, P("data", "model"))), precision=HIGHEST)
    np.testing.assert_allclose(np.asarray(y), _np_linear(params, x), **tol(jnp.float32))
    assert y.sharding.spec == P("data", None)


def test_linear_row_parallel_bf16():
    mesh = _mesh("explicit")
    fc, params = _linear(dtype=jnp.bfloat16)
    x = _x((4, 8), jnp.bfloat16)
    ps = _place(params, mesh, {"net/fc/kernel": P("model", None)})
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    y, _ = jax.jit(lambda p, a: fc(p, a))(ps, xs)
    assert y.dtype == jnp.bfloat16 and y.sharding.spec == P("data", None)
    ref = _np_linear(params, np.asarray(x.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(y.astype(jnp.float32)), ref, **tol(jnp.bfloat16))


def _eqns(jaxpr):
    return [(e.primitive.name, dict(e.params)) for e in jaxpr.jaxpr.eqns]


@pytest.mark.parametrize("kind", ["auto", "off-mesh"])
def test_no_extra_work_off_explicit_meshes(kind):
    """On Auto meshes and off a mesh the traced program is exactly raw JAX's
    ``dot + bias`` (no out_sharding, no resharding, no constraint)."""
    fc, params = _linear()
    x = _x((4, 8))
    if kind == "auto":
        mesh = _mesh("auto")
        params = _place(params, mesh, {"net/fc/kernel": P("model", None)})
        x = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    arrays = {"/".join(k): v for k, v in params.arrays().items()}
    k, b = arrays["net/fc/kernel"], arrays["net/fc/bias"]

    def raw(k, b, x):
        y = jnp.dot(x, k)
        return y + jnp.expand_dims(b, tuple(range(y.ndim - 1)))

    ours = jax.make_jaxpr(lambda p, a: fc(p, a)[0])(params, x)
    assert _eqns(ours) == _eqns(jax.make_jaxpr(raw)(k, b, x))
    assert all(e.params["out_sharding"] is None for e in ours.jaxpr.eqns if "dot" in str(e))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize(
    "out_spec", [P(None, "model"), P("data", None), P(("data", "model"), None), P()]
)
def test_linear_user_out_sharding_is_honoured(kind, out_spec):
    mesh = _mesh(kind)
    fc, params = _linear()
    x = _x((8, 8))
    # A bias sharded unlike the requested output: it must not change the output's sharding.
    ps = _place(params, mesh, {"net/fc/kernel": P("model", None), "net/fc/bias": P("model")})
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    want = NamedSharding(mesh, out_spec)
    f = jax.jit(lambda p, a: fc(p, a, precision=HIGHEST, out_sharding=want))
    y, _ = f(ps, xs)
    np.testing.assert_allclose(np.asarray(y), _np_linear(params, x), **tol(jnp.float32))
    assert y.sharding.is_equivalent_to(want, 2), (y.sharding, want)
    # The same as a bare PartitionSpec under jax.set_mesh.
    with jax.set_mesh(mesh):
        y2, _ = jax.jit(lambda p, a: fc(p, a, precision=HIGHEST, out_sharding=out_spec))(ps, xs)
    np.testing.assert_allclose(np.asarray(y2), np.asarray(y), rtol=0, atol=0)
    assert y2.sharding.is_equivalent_to(want, 2)


def _mlp():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    mlp = bx.MLP(g / "mlp", (16, 6), rng, activation=jnp.tanh)
    params = rng.seed(bx.Params(), seed=0)
    _, params = mlp(params, jnp.ones((1, 8)))
    params = jax.tree_util.tree_map_with_path(
        lambda kp, v: v + 0.1 if kp[0].key.endswith("bias") else v, params
    )
    return mlp, params.locked()


def _np_mlp(params, x):
    h = np.tanh(_np_linear(params, x, "net/mlp/linear_0"))
    return _np_linear(params, h, "net/mlp/linear_1")


# Megatron layout: column- then row-parallel; and both layers row-parallel.
MLP_LAYOUTS = {
    "column_row": (
        P("data", None),
        {
            "net/mlp/linear_0/kernel": P(None, "model"),
            "net/mlp/linear_0/bias": P("model"),
            "net/mlp/linear_1/kernel": P("model", None),
        },
    ),
    "row_row": (
        P("data", "model"),
        {"net/mlp/linear_0/kernel": P("model", None), "net/mlp/linear_1/kernel": P("model", None)},
    ),
}


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("layout", sorted(MLP_LAYOUTS))
def test_mlp_sharded_forward_and_grad_equal_unsharded(kind, layout):
    x_spec, specs = MLP_LAYOUTS[layout]
    mesh = _mesh(kind)
    mlp, params = _mlp()
    x = _x((4, 8))
    ps = _place(params, mesh, specs)
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))

    def loss(t, rest, a):
        y, _ = mlp(t.merge(rest), a, precision=HIGHEST)
        return jnp.sum(y * y), y

    (value, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(*ps.split(), xs)
    np.testing.assert_allclose(np.asarray(y), _np_mlp(params, x), **tol(jnp.float32))
    if kind == "explicit":
        assert y.sharding.spec == P("data", None)
        # Gradients keep their parameter's sharding.
        for path, spec in specs.items():
            assert g.arrays()[tuple(path.split("/"))].sharding.spec == spec
    # Gradients against the unsharded single-device run of the same layers.
    (value1, _), g1 = jax.value_and_grad(loss, has_aux=True)(*params.split(), x)
    np.testing.assert_allclose(float(value), float(value1), **tol(jnp.float32))
    for path, v in g1.arrays().items():
        np.testing.assert_allclose(np.asarray(g.arrays()[path]), np.asarray(v), **tol(jnp.float32))


@pytest.mark.parametrize("kind", ["explicit", "auto"])
def test_mlp_user_out_sharding_is_honoured(kind):
    x_spec, specs = MLP_LAYOUTS["column_row"]
    mesh = _mesh(kind)
    mlp, params = _mlp()
    x = _x((4, 8))
    ps = _place(params, mesh, specs)
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    want = NamedSharding(mesh, P(None, "data"))
    y, _ = jax.jit(lambda p, a: mlp(p, a, precision=HIGHEST, out_sharding=want))(ps, xs)
    np.testing.assert_allclose(np.asarray(y), _np_mlp(params, x), **tol(jnp.float32))
    assert y.sharding.is_equivalent_to(want, 2)


def test_out_sharding_errors():
    mesh = _mesh("explicit")
    fc, params = _linear()
    x = jnp.ones((4, 8))
    with pytest.raises(TypeError, match=r"Linear 'net/fc': out_sharding must be a .*NamedSharding"):
        fc(params, x, out_sharding="data")
    with pytest.raises(ValueError, match=r"Linear 'net/fc': out_sharding=.* no mesh is set"):
        fc(params, x, out_sharding=P("data", None))
    with pytest.raises(ValueError, match=r"has 3 entries but the output has 2 dims"):
        fc(params, x, out_sharding=NamedSharding(mesh, P("data", None, None)))
    with jax.set_mesh(mesh):
        with pytest.raises(ValueError, match=r"names mesh axis 'tensor'.*\('data', 'model'\)"):
            fc(params, x, out_sharding=P(None, "tensor"))
