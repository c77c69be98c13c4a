"""Checked collectives: the same numbers as jax.lax over pytrees, and an unbound axis
raising at trace time with the axis, the bound axes and the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from blox import parallel as bp


def _run(fn, x, mesh_shape=(2, 4), out=None):
    out = P("data", "model") if out is None else out
    mesh = bp.make_mesh(mesh_shape, ("data", "model"))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("data", "model"), out_specs=out))(xs)


X = jnp.arange(2 * 8 * 3, dtype=jnp.float32).reshape(2, 8, 3)


def test_collectives_over_pytrees_match_numpy():
    x = np.asarray(X)  # shards: (1, 2, 3) per device; model axis splits dimension 1
    blocks = x.reshape(2, 1, 4, 2, 3)
    got = _run(lambda a: bp.psum({"a": a}, "model")["a"], X)
    want = np.tile(blocks.sum(axis=2, keepdims=True), (1, 1, 4, 1, 1)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(got), want)
    got = _run(lambda a: bp.pmean([a], ("data", "model"))[0], X)
    mean = np.broadcast_to(blocks.mean((0, 2)), (2, 1, 4, 2, 3)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(got), mean, rtol=1e-6)
    got = _run(lambda a: bp.all_gather(a, "model", dim=1), X, out=P("data"))
    np.testing.assert_allclose(np.asarray(got), x)
    got = _run(lambda a: bp.reduce_scatter(a, "model", dim=1), jnp.tile(X, (1, 4, 1)))
    np.testing.assert_allclose(np.asarray(got), 4 * x)
    got = _run(lambda a: bp.ppermute(a, "model", [(i, (i + 1) % 4) for i in range(4)]), X)
    np.testing.assert_allclose(np.asarray(got), np.roll(blocks, 1, axis=2).reshape(x.shape))
    got = _run(lambda a: bp.broadcast(a, "model", source=3), X)
    want = np.tile(blocks[:, :, 3:], (1, 1, 4, 1, 1)).reshape(x.shape)
    np.testing.assert_allclose(np.asarray(got), want)


def test_unbound_axis_inside_shard_map_names_bound_axes():
    with pytest.raises(ValueError, match=r"psum: axis 'tensor' is not bound here.*\('data', "
                       r"'model'\).*add 'tensor' to the mesh"):  # fmt: skip
        _run(lambda a: bp.psum(a, "tensor"), X)


def test_psum_in_plain_jit_raises_at_trace_time_naming_the_axis():
    mesh = bp.make_mesh((8,), ("data",))
    x = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match=r"(?s)psum: axis 'data' is not bound here.*none.*"
                       r"wrong: plain jit.*jax.shard_map"):  # fmt: skip
        jax.jit(lambda a: bp.psum(a, "data"))(x)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="axis 'data' is not bound"):
        jax.jit(lambda a: bp.pmean(a, "data"))(x)


def test_argument_errors():
    with pytest.raises(
        ValueError,
        match=r"leaf <root> of shape \(1, 2, 3\): dimension 2 \(size 3\) is not divisible",
    ):
        _run(lambda a: bp.reduce_scatter(a, "model", dim=2), X)
    with pytest.raises(ValueError, match=r"pairs \[\(0, 4\)\] are not"):
        _run(lambda a: bp.ppermute(a, "model", [(0, 4)]), X)
    with pytest.raises(ValueError, match="destination index appears twice"):
        _run(lambda a: bp.ppermute(a, "model", [(0, 1), (2, 1)]), X)
    with pytest.raises(ValueError, match="source 4 is not an index"):
        _run(lambda a: bp.broadcast(a, "model", source=4), X)
    with pytest.raises(TypeError, match="not an array"):
        _run(lambda a: bp.psum({"a": a, "b": "text"}, "model")["a"], X)


def test_bound_axes_lists_shard_map_and_vmap_axes():
    seen = []

    def f(a):
        seen.append(bp.bound_axes())
        return a

    _run(f, X)
    jax.vmap(f, axis_name="i")(jnp.ones(2))
    assert seen == [("data", "model"), ("i",)]
