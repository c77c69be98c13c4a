"""`RunningMeanStd` against NumPy: after any sequence of batches (ranks 1 to 3, sizes
1 to 64) its statistics are NumPy's mean, biased variance and count of all values seen,
and each call's output is ``(x - mean) / sqrt(var + eps)`` with the statistics of the
*earlier* batches. Under ``jax.vmap`` and ``jax.shard_map`` with ``axis_name`` every lane
stores the statistics of the whole batch (NumPy over the concatenation)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx

D = 3


def _norm(**kw):
    return bx.RunningMeanStd(bx.Graph("net") / "norm", **kw)


def _batches(seed: int):
    rs = np.random.default_rng(seed)
    shapes = [(5, D), (1, D), (D,), (4, 2, D), (64, D)]
    # an offset and a scale far from (0, 1), so a wrong merge cannot pass by accident
    return [(3.0 + 2.5 * rs.standard_normal(s)).astype(np.float32) for s in shapes]


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_statistics_and_outputs_equal_numpy_over_every_batch_seen(jit):
    norm = _norm(epsilon=1e-5)
    call = jax.jit(norm) if jit else norm
    params, seen = bx.Params(), []
    for i, x in enumerate(_batches(0)):
        prior = np.concatenate(seen).reshape(-1, D) if seen else None
        mean = prior.mean(0) if seen else np.zeros(D)
        var = prior.var(0) if seen else np.ones(D)
        y, params = call(params, x)
        np.testing.assert_allclose(y, (x - mean) / np.sqrt(var + 1e-5), rtol=1e-5, atol=1e-5)
        seen.append(x.reshape(-1, D))
        everything = np.concatenate(seen)
        m, v, c = norm.statistics(params)
        np.testing.assert_allclose(m, everything.mean(0), rtol=1e-5, err_msg=i)
        np.testing.assert_allclose(v, everything.var(0), rtol=1e-4, err_msg=i)
        assert float(c) == len(everything), i


def test_eval_mode_and_update_split_the_call():
    norm = _norm()
    x1, x2 = _batches(1)[:2]
    y_train, p_train = norm(bx.Params(), x1)
    p = norm.update(bx.Params(), x1)
    y_eval, p_eval = norm(p, x2, is_training=False)
    y_ref, _ = norm(p_train, x2)
    np.testing.assert_array_equal(y_eval, y_ref)
    for a, b in zip(norm.statistics(p_eval), norm.statistics(p_train), strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(y_train, x1 / np.sqrt(1 + 1e-8), rtol=1e-6)  # mean 0, var 1


def test_clip_bounds_the_output():
    norm = _norm(clip=1.5)
    p = norm.update(bx.Params(), np.array([[0.0], [1.0]], np.float32))  # mean .5, var .25
    y, _ = norm(p, np.array([[-10.0], [0.75], [10.0]], np.float32), is_training=False)
    np.testing.assert_allclose(y[:, 0], [-1.5, 0.5, 1.5], rtol=1e-6)


def test_vmap_with_axis_name_stores_the_whole_batch_statistics():
    """One environment per lane (``(D,)`` each) and a ``(T, D)`` rollout per lane."""
    norm = _norm(axis_name="env")
    for x in (_batches(2)[-1][:8], _batches(2)[3]):
        y, p = jax.vmap(norm, in_axes=(None, 0), out_axes=(0, None), axis_name="env")(
            bx.Params(), x
        )
        flat = x.reshape(-1, D)
        m, v, c = norm.statistics(p)
        np.testing.assert_allclose(m, flat.mean(0), rtol=1e-5)
        np.testing.assert_allclose(v, flat.var(0), rtol=1e-4)
        assert float(c) == len(flat)
        np.testing.assert_allclose(y, x / np.sqrt(1 + 1e-8), rtol=1e-6)


def test_shard_map_psum_over_devices_equals_one_device():
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    x = _batches(3)[-1]  # (64, D): 16 per device
    dist = _norm(axis_name="data")
    one = _norm()
    p0 = one.update(bx.Params(), _batches(4)[0])  # start from non-trivial statistics
    f = jax.shard_map(dist, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P()))
    placed = jax.device_put(x, NamedSharding(mesh, P("data")))
    y, p = jax.jit(f)(jax.device_put(p0, NamedSharding(mesh, P())), placed)
    y_ref, p_ref = one(p0, x)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6)
    for a, b in zip(dist.statistics(p), one.statistics(p_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_float64_statistics_count_past_2_to_the_24():
    with jax.enable_x64(True):
        norm = _norm(param_dtype=jnp.float64)
        p = norm.update(bx.Params(), np.zeros((4, D)))
        p = norm.update(p, np.ones((4, D)))
        m, v, c = norm.statistics(p)
        assert m.dtype == jnp.float64 and float(c) == 8.0
        np.testing.assert_array_equal(m, 0.5)
        np.testing.assert_array_equal(v, 0.25)


def test_gradients_flow_through_the_normalization_not_the_statistics():
    norm = _norm()
    p = norm.update(bx.Params(), np.array([[0.0], [2.0]], np.float32))  # var 1
    g = jax.grad(lambda x: jnp.sum(norm(p, x)[0]))(jnp.ones((3, 1)))
    np.testing.assert_allclose(g, 1 / np.sqrt(1 + 1e-8), rtol=1e-6)


def test_bad_inputs_name_the_layer():
    norm = _norm()
    with pytest.raises(ValueError, match=r"RunningMeanStd 'net/norm': input of shape \(\) has"):
        norm(bx.Params(), jnp.float32(1.0))
    with pytest.raises(TypeError, match=r"'net/norm': input dtype int32 is not floating"):
        norm(bx.Params(), jnp.ones((2, 3), jnp.int32))
    _, p = norm(bx.Params(), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"'net/norm/running_mean' is stored with shape \(3,\)"):
        norm(p, jnp.ones((2, 4)))
    with pytest.raises(KeyError, match=r"no statistics in params yet"):
        norm.statistics(bx.Params())
    with pytest.raises(ValueError, match=r"clip must be > 0 or None, got 0"):
        _norm(clip=0)


@pytest.mark.parametrize("axis_name", ["data", ("data", "env")])
def test_an_unbound_axis_name_raises_naming_the_layer_and_the_axis(axis_name):
    """Called outside the transform that names its axis (here one of two), the merge
    cannot sum over it: the error names the layer, the axis and both fixes (JAX's own,
    'unbound axis name', names neither). Normalizing alone (is_training=False) reads no
    axis and still runs."""
    norm = _norm(axis_name=axis_name)
    x = jnp.ones((2, 3))
    with pytest.raises(ValueError, match=r"RunningMeanStd 'net/norm': axis_name='data' is not "
                                         r"bound here(.|\n)*axis_name=None"):  # fmt: skip
        norm(bx.Params(), x)
    if isinstance(axis_name, tuple):  # 'data' bound, 'env' not
        with pytest.raises(ValueError, match=r"axis_name='env' is not bound"):
            jax.vmap(lambda x: norm(bx.Params(), x), axis_name="data")(x[None])
    y, _ = norm(bx.Params(), x, is_training=False)
    np.testing.assert_array_equal(y, x)
