"""Hand-written tensor parallelism (jax-blox compatibility): inside
``jax.shard_map`` a layer accepts its parameter's per-device shard (the expected shape
divided along dimensions by manual mesh-axis sizes), and computes the local slice; any
other stored shape is still an error naming path and shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx


def _mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit,) * 2)


def _put(mesh, tree, specs):
    if isinstance(specs, P):
        return jax.device_put(tree, NamedSharding(mesh, specs))
    return jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), tree, specs)


def _np(params, *path):
    return np.asarray(params[path].value, np.float64)


def test_hand_written_tp_mlp_in_shard_map_equals_the_unsharded_mlp():
    """Column-parallel Linear (kernel (8, 16) split P(None, 'model'): (8, 4) per device,
    bias (4,)), ReLU, row-parallel Linear (kernel (16, 8) split P('model', None)) and an
    explicit psum; the row bias is added once after the psum."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    up = bx.Linear(g / "up", 16, rng)
    down = bx.Linear(g / "down", 8, rng, use_bias=False)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)
    params = rng.seed(bx.Params(), seed=0)
    h, params = up(params, x)
    _, params = down(params, h)
    params = params.locked()
    b2 = jnp.asarray(np.random.default_rng(1).standard_normal(8), jnp.float32)

    specs = jax.tree.map(lambda _: P(), params).unlocked()
    specs[("net", "up", "kernel")] = bx.Param(P(None, "model"))
    specs[("net", "up", "bias")] = bx.Param(P("model"))
    specs[("net", "down", "kernel")] = bx.Param(P("model", None))
    specs = specs.locked()

    def body(p, x, b2):
        assert p[("net", "up", "kernel")].value.shape == (8, 4)  # the local shard
        h, _ = up(p, x)
        y, _ = down(p, jax.nn.relu(h))
        return jax.lax.psum(y, "model") + b2[None]

    mesh = _mesh()
    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, P("data"), P()), out_specs=P("data"))
    )
    got = f(_put(mesh, params, specs), _put(mesh, x, P("data")), _put(mesh, b2, P()))
    xs = np.asarray(x, np.float64)
    hidden = np.maximum(
        xs @ _np(params, "net", "up", "kernel") + _np(params, "net", "up", "bias"), 0
    )
    want = hidden @ _np(params, "net", "down", "kernel") + np.asarray(b2, np.float64)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_conv_and_embed_accept_their_local_shards():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    conv = bx.Conv(g / "conv", (3, 3), 8, rng)
    embed = bx.Embed(g / "embed", 10, 8, rng)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 5, 3)), jnp.float32)
    ids = jnp.asarray([[1, 9, 3], [0, 4, 4]], jnp.int32)
    params = rng.seed(bx.Params(), seed=0)
    y_ref, params = conv(params, x)
    e_ref, params = embed(params, ids)
    params = params.locked()
    specs = jax.tree.map(lambda _: P(), params).unlocked()
    specs[("net", "conv", "kernel")] = bx.Param(P(None, None, None, "model"))  # (3,3,3,2)
    specs[("net", "conv", "bias")] = bx.Param(P("model"))
    specs[("net", "embed", "embedding")] = bx.Param(P(None, "model"))  # (10, 2)
    specs = specs.locked()

    def body(p, x, ids):
        return conv(p, x)[0], embed(p, ids)[0]

    mesh = _mesh()
    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, P(), P()),
            out_specs=(P(None, None, None, "model"), P(None, None, "model")),
            axis_names={"model"},
        )
    )
    y, e = f(_put(mesh, params, specs), _put(mesh, x, P()), _put(mesh, ids, P()))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), rtol=1e-5, atol=1e-5)
    table = _np(params, "net", "embed", "embedding")
    np.testing.assert_array_equal(np.asarray(e), table[np.asarray(ids)])


def test_a_shape_that_is_no_shard_still_raises_naming_path_and_shapes():
    """(8, 8) is (8, 16) halved, but only the 4-device 'model' axis is manual: not a
    shard. Outside shard_map a shard-looking shape is refused as before."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 16, rng, use_bias=False)
    params = bx.Params()
    params[("net", "fc", "kernel")] = bx.Param(jnp.zeros((8, 8)))
    params = params.locked()
    mesh = _mesh()

    def body(p, x):
        return fc(p, x)[0]

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P(), axis_names={"model"})
    with pytest.raises(
        ValueError,
        match=r"Parameter 'net/fc/kernel' is stored with shape \(8, 8\), but Linear 'net/fc' "
        r"expects \(8, 16\)",
    ):
        jax.jit(f)(_put(mesh, params, P()), _put(mesh, jnp.zeros((2, 8)), P()))
    params4 = bx.Params()
    params4[("net", "fc", "kernel")] = bx.Param(jnp.zeros((8, 4)))
    with pytest.raises(ValueError, match=r"stored with shape \(8, 4\), but Linear 'net/fc'"):
        fc(params4.locked(), jnp.zeros((2, 8)))
    from blox.core._module import is_local_shard

    assert not is_local_shard((8, 4), (8, 16))  # no manual axes in scope


def test_is_local_shard_assigns_each_manual_axis_once():
    from blox.core._module import is_local_shard

    mesh = _mesh()
    seen = {}

    def body(x):
        seen["both"] = (
            is_local_shard((4, 2), (8, 8)),  # data on dim 0, model on dim 1
            is_local_shard((8, 1), (8, 8)),  # data x model on dim 1
            is_local_shard((2, 2), (8, 8)),  # would need model twice
            is_local_shard((8, 3), (8, 12)),  # 4: model
            is_local_shard((8, 6), (8, 12)),  # 2: data
            is_local_shard((8, 5), (8, 16)),  # not a divisor
            is_local_shard((8,), (8, 16)),  # another rank
        )
        return x

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))(jnp.zeros(2))
    assert seen["both"] == (True, True, False, True, True, False, False)
