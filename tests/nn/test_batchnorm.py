"""`BatchNorm` across devices and its dtype policy; `GroupNorm` and `BatchNorm` errors.

PyTorch parity (forward, gradients, running statistics over several steps) lives in
``test_norm_resize_torch.py``. Here the references are NumPy (closed-form statistics)
and the single-device layer on the full batch, which that file checks against PyTorch.

Cross-device runs use the 8 simulated CPU devices of ``tests/conftest.py`` with
``jax.shard_map`` over a mesh axis ``'data'``, and ``jax.vmap(..., axis_name=...)``.
Tolerances: ``tol(float32)`` (rtol 1e-5, atol 1e-6); the statistics are averaged in a
different order than on one device, so results agree to rounding, not bit for bit.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import blox as bx
from tests.tolerances import tol

F32 = tol("float32")


def _mesh() -> Mesh:
    assert len(jax.devices()) == 8, "tests/conftest.py simulates 8 CPU devices"
    return Mesh(np.array(jax.devices()), ("data",))


def _bn(axis_name=None, groups=None, **kw):
    g = bx.Graph("net")
    bn = bx.BatchNorm(g / "bn", axis_name=axis_name, axis_index_groups=groups, **kw)
    x0 = jnp.zeros((2, 5, 5, 3))
    _, params = bn(bx.Params(), x0, is_training=False)  # creates params, stats untouched
    rs = np.random.default_rng(0)
    params = params.unlocked()
    params[("net", "bn", "scale")] = bx.Param(jnp.asarray(rs.uniform(0.5, 1.5, 3), jnp.float32))
    params[("net", "bn", "bias")] = bx.Param(jnp.asarray(rs.standard_normal(3), jnp.float32))
    return bn, params.locked()


def _batch(n=16, seed=1):
    rs = np.random.default_rng(seed)
    x = rs.standard_normal((n, 5, 5, 3)) * np.array([1.0, 3.0, 0.5]) + np.array([0.0, 2.0, -1.0])
    return jnp.asarray(x, jnp.float32)


# ---------------------------------------------------------------------------
# statistics: closed form
# ---------------------------------------------------------------------------


def test_running_statistics_follow_the_momentum_and_the_unbiased_variance():
    """momentum=0.9 keeps 90 % of the old value; running_var takes var * n / (n - 1)."""
    bn, params = _bn()
    x = _batch()
    xs = np.asarray(x, np.float64).reshape(-1, 3)
    _, p1 = bn(params, x)
    np.testing.assert_allclose(p1[("net", "bn", "running_mean")].value, 0.1 * xs.mean(0), **F32)
    np.testing.assert_allclose(
        p1[("net", "bn", "running_var")].value, 0.9 + 0.1 * xs.var(0, ddof=1), **F32
    )
    _, p2 = bn(p1, 2.0 * x)
    np.testing.assert_allclose(
        p2[("net", "bn", "running_mean")].value, 0.09 * xs.mean(0) + 0.2 * xs.mean(0), **F32
    )
    # Output normalizes with the *biased* batch variance, then scale and bias.
    y, _ = bn(params, x)
    scale = np.asarray(params[("net", "bn", "scale")].value, np.float64)
    bias = np.asarray(params[("net", "bn", "bias")].value, np.float64)
    expected = (xs - xs.mean(0)) / np.sqrt(xs.var(0) + 1e-5) * scale + bias
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 3), expected, rtol=1e-5, atol=2e-6)


def test_eval_mode_uses_running_statistics_and_changes_nothing():
    bn, params = _bn()
    _, params = bn(params, _batch())
    x = _batch(seed=7)
    y, after = bn(params, x, is_training=False)
    rm = np.asarray(params[("net", "bn", "running_mean")].value, np.float64)
    rv = np.asarray(params[("net", "bn", "running_var")].value, np.float64)
    scale = np.asarray(params[("net", "bn", "scale")].value, np.float64)
    bias = np.asarray(params[("net", "bn", "bias")].value, np.float64)
    expected = (np.asarray(x, np.float64) - rm) / np.sqrt(rv + 1e-5) * scale + bias
    np.testing.assert_allclose(y, expected, **F32)
    chex.assert_trees_all_equal(after, params)


# ---------------------------------------------------------------------------
# cross-device statistics
# ---------------------------------------------------------------------------


def test_shard_map_over_8_devices_equals_the_full_batch_on_one_device():
    """Output, running statistics and d(loss)/dx, d(loss)/dscale under shard_map over 8
    devices (2 examples each) equal one device on all 16 examples."""
    bn_x, params = _bn(axis_name="data")
    bn_1, _ = _bn()
    mesh = _mesh()
    x = _batch()
    r = jnp.asarray(np.random.default_rng(3).standard_normal(x.shape), jnp.float32)

    def sharded(params, x):
        return jax.shard_map(
            lambda p, x: bn_x(p, x),
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=(P("data"), P()),
        )(params, x)

    y8, p8 = jax.jit(sharded)(params, x)
    y1, p1 = bn_1(params, x)
    np.testing.assert_allclose(y8, y1, **F32)
    chex.assert_trees_all_close(p8, p1, **F32)
    xs = np.asarray(x, np.float64).reshape(-1, 3)
    np.testing.assert_allclose(
        p8[("net", "bn", "running_var")].value, 0.9 + 0.1 * xs.var(0, ddof=1), **F32
    )

    def loss(run, train, rest, x):
        y, _ = run(train.merge(rest), x)
        return jnp.sum(y * r)

    train, rest = params.split()
    g8 = jax.jit(jax.grad(lambda t, x: loss(sharded, t, rest, x), argnums=(0, 1)))(train, x)
    g1 = jax.grad(lambda t, x: loss(bn_1, t, rest, x), argnums=(0, 1))(train, x)
    chex.assert_trees_all_close(g8, g1, rtol=1e-4, atol=1e-5)


def test_vmap_with_axis_name_equals_the_full_batch():
    """vmap over 4 lanes of 4 examples each, axis_name='lanes'; the running statistics
    come back unbatched (out_axes=None) because every lane holds the same values."""
    bn_v, params = _bn(axis_name="lanes")
    bn_1, _ = _bn()
    x = _batch()
    yv, pv = jax.vmap(bn_v, in_axes=(None, 0), out_axes=(0, None), axis_name="lanes")(
        params, x.reshape(4, 4, 5, 5, 3)
    )
    y1, p1 = bn_1(params, x)
    np.testing.assert_allclose(yv.reshape(x.shape), y1, **F32)
    chex.assert_trees_all_close(pv, p1, **F32)


def test_axis_index_groups_average_within_each_group():
    """Groups [[0..3], [4..7]] under shard_map (and under vmap): each half of the batch
    is normalized with its own statistics. JAX's own pmean has no groups under
    shard_map/vmap; blox computes them from an all_gather."""
    groups = [[0, 1, 2, 3], [4, 5, 6, 7]]
    bn_g, params = _bn(axis_name="data", groups=groups)
    bn_1, _ = _bn()
    x = _batch()
    y_sm = jax.shard_map(
        lambda p, x: bn_g(p, x)[0],
        mesh=_mesh(),
        in_specs=(P(), P("data")),
        out_specs=P("data"),
    )(params, x)
    y_vm = jax.vmap(lambda p, x: bn_g(p, x)[0], in_axes=(None, 0), axis_name="data")(
        params, x.reshape(8, 2, 5, 5, 3)
    ).reshape(x.shape)
    expected = jnp.concatenate([bn_1(params, x[:8])[0], bn_1(params, x[8:])[0]])
    np.testing.assert_allclose(y_sm, expected, **F32)
    np.testing.assert_allclose(y_vm, expected, **F32)


def test_unbound_axis_name_raises_a_clear_error():
    bn, params = _bn(axis_name="data")
    x = _batch()
    msg = r"(?s)BatchNorm 'net/bn': axis_name='data' is not bound.*shard_map.*axis_name=None"
    with pytest.raises(ValueError, match=msg):
        bn(params, x)
    with pytest.raises(ValueError, match=msg):
        jax.jit(bn)(params, x)
    with pytest.raises(ValueError, match=msg):
        jax.vmap(bn, in_axes=(None, 0), axis_name="other")(params, x.reshape(4, 4, 5, 5, 3))
    # Eval mode needs no collective, so it runs outside shard_map.
    y, _ = bn(params, x, is_training=False)
    assert y.shape == x.shape


def test_bad_axis_index_groups_raise():
    bn, params = _bn(axis_name="data", groups=[[0, 1, 2], [3, 4, 5, 6, 7]])
    with pytest.raises(ValueError, match=r"'net/bn': axis_index_groups=.*equal size"):
        jax.vmap(bn, in_axes=(None, 0), axis_name="data")(params, _batch().reshape(8, 2, 5, 5, 3))
    with pytest.raises(ValueError, match="axis_index_groups needs an axis_name"):
        bx.BatchNorm(bx.Graph("net") / "bn", axis_index_groups=[[0, 1]])


# ---------------------------------------------------------------------------
# dtype policy (jit, retracing, params tree, bf16 and float64 params run over the table
# in test_layer_contract.py)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda g: bx.BatchNorm(g / "bn"),
        lambda g: bx.GroupNorm(g / "gn", 3),
        lambda g: bx.PReLU(g / "act", 3),
    ],
    ids=["BatchNorm", "GroupNorm", "PReLU"],
)
def test_bf16_inputs_with_float32_params_compute_in_float32(make):
    """bf16 input + f32 params compute (and return) f32, equal to the f32 input run on
    the same (bf16-representable) values; stored dtypes never change."""
    layer = make(bx.Graph("net"))
    x = _batch(4).astype(jnp.bfloat16)
    _, params = layer(bx.Params(), x.astype(jnp.float32))
    y32, _ = layer(params, x.astype(jnp.float32))
    y_mixed, p_mixed = layer(params, x)
    assert y_mixed.dtype == jnp.float32
    chex.assert_trees_all_equal_shapes_and_dtypes(p_mixed, params)
    np.testing.assert_allclose(y_mixed, y32, **F32)


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def test_batchnorm_errors_name_the_path_the_shapes_and_the_fix():
    bn, params = _bn()
    with pytest.raises(ValueError, match=r"BatchNorm 'net/bn'.*shape \(3,\) has rank 1.*x\[None\]"):
        bn(params, jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"'net/bn': training needs more than one value.*\(1, 3\)"):
        bn(params, jnp.ones((1, 3)))
    y, _ = bn(params, jnp.ones((1, 3)), is_training=False)  # fine in eval mode
    assert y.shape == (1, 3)
    with pytest.raises(ValueError, match=r"'net/bn/scale'.*shape \(3,\).*\(4,\)"):
        bn(params, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"momentum must be in \[0, 1\].*momentum=0.9 here"):
        bx.BatchNorm(bx.Graph("net") / "bn", momentum=1.5)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        bx.BatchNorm(bx.Graph("net") / "bn", epsilon=0.0)


def test_groupnorm_errors_name_the_path_the_shapes_and_the_fix():
    g = bx.Graph("net")
    with pytest.raises(ValueError, match=r"GroupNorm 'net/a': num_groups must be a positive"):
        bx.GroupNorm(g / "a", 0)
    with pytest.raises(ValueError, match=r"GroupNorm 'net/b': num_groups must be a positive"):
        bx.GroupNorm(g / "b", 2.0)
    gn = bx.GroupNorm(g / "gn", 4)
    with pytest.raises(
        ValueError,
        match=r"'net/gn': num_groups=4 does not divide the 6 channels of input shape "
        r"\(2, 3, 6\).*one of \[1, 2, 3, 6\]",
    ):
        gn(bx.Params(), jnp.ones((2, 3, 6)))
    with pytest.raises(ValueError, match=r"GroupNorm 'net/gn'.*rank 1.*\(B, \.\.\., C\)"):
        gn(bx.Params(), jnp.ones((8,)))
    nchw = bx.GroupNorm(g / "nchw", 4, channels_first=True)
    y, _ = nchw(bx.Params(), jnp.ones((2, 8, 3, 3)))  # 8 channels on axis 1
    assert y.shape == (2, 8, 3, 3)
