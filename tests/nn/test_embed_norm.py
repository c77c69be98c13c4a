"""`Embed`, `LayerNorm`, `RMSNorm` and the sinusoidal / learned positional encodings.

References: PyTorch CPU (``nn.Embedding``, ``nn.LayerNorm``, ``nn.RMSNorm``) with the
weights copied across, forward and gradients; NumPy for the positional tables.
Tolerances: ``tests/tolerances.py`` ``tol(dtype)`` (f32 rtol 1e-5 / atol 1e-6, f64 rtol
1e-10 / atol 1e-12); float64 inside ``jax.enable_x64(True)``. Gradients of the grouped
cross-device norms use rtol 1e-4 / atol 1e-5 in float32 (a normalization's backward
subtracts nearly equal sums, taken in a different order than PyTorch's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import blox as bx
from tests.nn.torch_reference import (
    TORCH_DTYPES,
    assert_close,
    dtype_context,
    jit_grads,
    layout,
    load_weights,
    to_np,
)
from tests.tolerances import tol

DTYPES = ["float32", "float64"]


def _seeded(name="net"):
    g = bx.Graph(name)
    rng = bx.Rng(g / "rng")
    return g, rng, rng.seed(bx.Params(), seed=0)


# ---------------------------------------------------------------------------
# Embed
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_embed_lookup_and_attend_match_torch(dtype):
    """Lookup vs nn.Embedding and attend vs ``x @ weight.T``: outputs, d/d table, d/d x.

    The loss uses both (a tied LM head), so the table gradient sums both paths.
    """
    torch.manual_seed(0)
    v, d = 7, 5
    ref = torch.nn.Embedding(v, d, dtype=TORCH_DTYPES[dtype])
    rs = np.random.default_rng(0)
    idx = rs.integers(0, v, size=(2, 4))
    x = rs.standard_normal((3, d)).astype(dtype)
    r1 = rs.standard_normal((2, 4, d)).astype(dtype)
    r2 = rs.standard_normal((3, v)).astype(dtype)

    x_t = torch.tensor(x, requires_grad=True)
    e_t = ref(torch.tensor(idx))
    a_t = x_t @ ref.weight.T
    ((e_t * torch.tensor(r1)).sum() + (a_t * torch.tensor(r2)).sum()).backward()

    with dtype_context(dtype):
        g, rng, params = _seeded()
        embed = bx.Embed(g / "embed", v, d, rng, param_dtype=dtype)
        params = layout(embed, params, jnp.zeros((1,), jnp.int32))
        params = load_weights(params, {("net", "embed", "embedding"): to_np(ref.weight)})
        e, _ = embed(params, jnp.asarray(idx))
        a, _ = embed.attend(params, jnp.asarray(x))
        assert_close(e, to_np(e_t), dtype, "Embed lookup")
        assert_close(a, to_np(a_t), dtype, "Embed.attend")

        def loss(params, x):
            e, params = embed(params, jnp.asarray(idx))
            a, _ = embed.attend(params, x)
            return jnp.sum(e * jnp.asarray(r1)) + jnp.sum(a * jnp.asarray(r2))

        g_params, g_x = jit_grads(loss, params, jnp.asarray(x))
    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x")
    assert_close(
        g_params[("net", "embed", "embedding")].value, to_np(ref.weight.grad), dtype, "d/d table"
    )


def test_embed_default_init_variance_and_out_of_range_is_nan():
    g, rng, params = _seeded()
    embed = bx.Embed(g / "embed", 4000, 16, rng)
    y, params = embed(params, jnp.array([0, 3999, 4000, -1]))
    table = np.asarray(params[("net", "embed", "embedding")].value)
    # variance_scaling(1, fan_in, normal, out_axis=0): fan-in = D = 16, std 1/4.
    assert abs(table.std() - 0.25) < 0.01, table.std()
    np.testing.assert_array_equal(np.asarray(y[0]), table[0])
    np.testing.assert_array_equal(np.asarray(y[1]), table[3999])
    assert np.isnan(np.asarray(y[2:])).all()


def test_embed_errors():
    g, rng, params = _seeded()
    embed = bx.Embed(g / "embed", 10, 4, rng)
    with pytest.raises(TypeError, match=r"Embed 'net/embed': indices must be integers.*float32"):
        embed(params, jnp.ones((2, 3)))
    with pytest.raises(
        ValueError,
        match=r"Embed 'net/embed'.attend expects inputs of shape \(\.\.\., 4\) "
        r"\(embedding \(10, 4\)\), got shape \(2, 5\)",
    ):
        embed.attend(params, jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="Embed 'net/bad': embedding_size must be a positive"):
        bx.Embed(g / "bad", 10, 0, rng)


def _stored(params: bx.Params, path: tuple, shape: tuple) -> bx.Params:
    """Stores a zero array of `shape` at `path`, as a script that copies weights does."""
    params = params.unlocked()
    params[path] = bx.Param(jnp.zeros(shape, jnp.float32))
    return params


def test_embed_blames_a_stored_table_of_the_wrong_shape_not_the_input():
    g, rng, params = _seeded()
    embed = bx.Embed(g / "embed", 10, 4, rng)
    _, params = embed(params, jnp.array([1, 2]))
    path = ("net", "embed", "embedding")
    # A (D, V) table (e.g. a tied output projection kernel copied as the table).
    p = _stored(params, path, (4, 10))
    head = (
        r"Parameter 'net/embed/embedding' is stored with shape \(4, 10\), but Embed "
        r"'net/embed' expects \(10, 4\) = \(V, D\) for num_embeddings=10, embedding_size=4\. "
    )
    for call in (
        lambda: embed(p, jnp.array([1])),
        lambda: embed.attend(p, jnp.ones((2, 4))),
        # An input shaped for the wrong table: the table is still what is blamed.
        lambda: embed.attend(p, jnp.ones((2, 10))),
    ):
        with pytest.raises(ValueError, match=head + r"The stored value is transposed") as info:
            call()
        assert "Project the input" not in str(info.value)
    # A table of another embedding size: blamed without the transpose hint.
    p = _stored(params, path, (10, 6))
    with pytest.raises(
        ValueError,
        match=r"'net/embed/embedding' is stored with shape \(10, 6\), but Embed 'net/embed' "
        r"expects \(10, 4\).*Replace the stored value",
    ):
        embed.attend(p, jnp.ones((2, 6)))


# ---------------------------------------------------------------------------
# LayerNorm / RMSNorm
# ---------------------------------------------------------------------------


def _torch_norm(kind, d, dtype, use_scale, use_bias, eps):
    tdt = TORCH_DTYPES[dtype]
    if kind == "layer":
        ref = torch.nn.LayerNorm(
            d, eps=eps, elementwise_affine=use_scale, bias=use_bias and use_scale, dtype=tdt
        )
    else:
        ref = torch.nn.RMSNorm(d, eps=eps, elementwise_affine=use_scale, dtype=tdt)
    with torch.no_grad():  # non-trivial affine parameters
        if ref.weight is not None:
            ref.weight.copy_(torch.linspace(0.5, 1.5, d, dtype=tdt))
        if getattr(ref, "bias", None) is not None:
            ref.bias.copy_(torch.linspace(-0.3, 0.2, d, dtype=tdt))
    return ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "kind, use_scale, use_bias",
    [("layer", True, True), ("layer", True, False), ("layer", False, False), ("rms", True, False)],
    ids=["ln", "ln-nobias", "ln-plain", "rms"],
)
def test_norms_match_torch(dtype, kind, use_scale, use_bias):
    """LayerNorm / RMSNorm vs torch on (2, 3, 6) inputs: outputs, d/dx, d/dscale, d/dbias."""
    d, eps = 6, 1e-5
    ref = _torch_norm(kind, d, dtype, use_scale, use_bias, eps)
    rs = np.random.default_rng(3)
    x = (3.0 + 2.0 * rs.standard_normal((2, 3, d))).astype(dtype)
    r = rs.standard_normal((2, 3, d)).astype(dtype)
    x_t = torch.tensor(x, requires_grad=True)
    y_t = ref(x_t)
    (y_t * torch.tensor(r)).sum().backward()

    with dtype_context(dtype):
        g, rng, params = _seeded()
        if kind == "layer":
            norm = bx.LayerNorm(
                g / "norm", eps, use_scale=use_scale, use_bias=use_bias, param_dtype=dtype
            )
        else:
            norm = bx.RMSNorm(g / "norm", eps, use_scale=use_scale, param_dtype=dtype)
        params = layout(norm, params, jnp.zeros((1, d), dtype))
        weights = {}
        if use_scale:
            weights[("net", "norm", "scale")] = to_np(ref.weight)
        if use_bias:
            weights[("net", "norm", "bias")] = to_np(ref.bias)
        params = load_weights(params, weights)
        assert set(params.keys()) == {("net", "rng", "seed"), ("net", "rng", "counter"), *weights}
        y, _ = norm(params, jnp.asarray(x))
        assert_close(y, to_np(y_t), dtype, f"{kind} norm output")

        def loss(params, x):
            y, _ = norm(params, x)
            return jnp.sum(y * jnp.asarray(r))

        g_params, g_x = jit_grads(loss, params, jnp.asarray(x))
    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x")
    if use_scale:
        assert_close(
            g_params[("net", "norm", "scale")].value, to_np(ref.weight.grad), dtype, "d/d scale"
        )
    if use_bias:
        assert_close(
            g_params[("net", "norm", "bias")].value, to_np(ref.bias.grad), dtype, "d/d bias"
        )


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_statistics_in_float32_for_bf16(kind):
    """bf16 input + bf16 params: output bf16, statistics in f32. A large mean (1000 + small
    noise) loses everything if the variance is taken in bf16; the reference is NumPy f64 on
    the same bf16 values."""
    g, rng, params = _seeded()
    norm = bx.LayerNorm(g / "n") if kind == "layer" else bx.RMSNorm(g / "n")
    x = (1000.0 + jax.random.normal(jax.random.key(0), (4, 64))).astype(jnp.bfloat16)
    _, params = norm(params, x)
    params = jax.tree.map(lambda v: v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v, params)
    y, _ = norm(params, x)
    assert y.dtype == jnp.bfloat16
    xf = np.asarray(x, np.float64)
    if kind == "layer":
        ref = (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5)
    else:
        ref = xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, **tol(jnp.bfloat16))
    # f32 params with a bf16 input: the output is promoted to f32 (the layer dtype policy).
    _, p32 = norm(rng.seed(bx.Params(), seed=0), x)
    assert norm(p32, x)[0].dtype == jnp.float32


def test_norm_cross_device_statistics_with_axis_name():
    """axis_name: statistics over the named (vmap) axis too = whole-batch statistics."""
    g = bx.Graph("net")
    ln = bx.LayerNorm(g / "ln", axis_name="seq")
    rms = bx.RMSNorm(g / "rms", axis_name="seq")
    x = np.random.default_rng(0).standard_normal((4, 2, 3)).astype(np.float32)
    # Init outside the named axis with plain norms at the same paths (ones / zeros).
    g0 = bx.Graph("net")
    _, params = bx.LayerNorm(g0 / "ln")(bx.Params(), jnp.asarray(x[0]))
    _, params = bx.RMSNorm(g0 / "rms")(params, jnp.asarray(x[0]))

    y_ln = jax.vmap(lambda v: ln(params, v)[0], axis_name="seq")(jnp.asarray(x))
    y_rms = jax.vmap(lambda v: rms(params, v)[0], axis_name="seq")(jnp.asarray(x))
    # Reference: per row b, the mean/var over (all vmap lanes, features).
    xf = x.astype(np.float64)
    mean = xf.mean(axis=(0, 2), keepdims=True)
    var = ((xf - mean) ** 2).mean(axis=(0, 2), keepdims=True)
    np.testing.assert_allclose(y_ln, (xf - mean) / np.sqrt(var + 1e-5), **tol(jnp.float32))
    ms = (xf**2).mean(axis=(0, 2), keepdims=True)
    np.testing.assert_allclose(y_rms, xf / np.sqrt(ms + 1e-5), **tol(jnp.float32))


GROUPS = [[0, 2, 4, 6], [1, 3, 5, 7]]  # interleaved, so an order mix-up shows


def _grouped_norm_case(kind):
    """A norm averaging over axis 'data' within GROUPS, its params (non-trivial scale and
    bias), 8 lanes of (2, 3) inputs and a cotangent."""
    g = bx.Graph("net")
    cls = bx.LayerNorm if kind == "layer" else bx.RMSNorm
    norm = cls(g / "n", axis_name="data", axis_index_groups=GROUPS)
    _, params = cls(bx.Graph("net") / "n")(bx.Params(), jnp.zeros((2, 3)))  # same paths
    weights = {("net", "n", "scale"): np.array([0.5, 1.0, 1.5], np.float32)}
    if kind == "layer":
        weights[("net", "n", "bias")] = np.array([-0.3, 0.0, 0.2], np.float32)
    params = load_weights(params, weights)
    rs = np.random.default_rng(4)
    x = (2.0 + 3.0 * rs.standard_normal((8, 2, 3))).astype(np.float32)
    r = rs.standard_normal((8, 2, 3)).astype(np.float32)
    return norm, params, weights, x, r


def _torch_grouped(kind, weights, x, r):
    """Per group: torch's norm over the concatenated features of the group's lanes
    (scale and bias tiled), forward and d/dx, scattered back to (8, 2, 3); the scale and
    bias gradients summed over lanes, as the shared parameters receive them."""
    y = np.zeros(x.shape)
    gx = np.zeros(x.shape)
    g_w = {path: np.zeros(3) for path in weights}
    for grp in GROUPS:
        xg = torch.tensor(np.concatenate(list(x[grp]), axis=-1), dtype=torch.float64)
        xg.requires_grad_(True)
        w = torch.tensor(np.tile(weights[("net", "n", "scale")], 4), dtype=torch.float64)
        w.requires_grad_(True)
        if kind == "layer":
            b = torch.tensor(np.tile(weights[("net", "n", "bias")], 4), dtype=torch.float64)
            b.requires_grad_(True)
            yg = torch.nn.functional.layer_norm(xg, (12,), w, b, eps=1e-5)
        else:
            yg = torch.nn.functional.rms_norm(xg, (12,), w, eps=1e-5)
        rg = torch.tensor(np.concatenate(list(r[grp]), axis=-1), dtype=torch.float64)
        (yg * rg).sum().backward()
        y[grp] = np.stack(np.split(to_np(yg), 4, axis=-1))
        gx[grp] = np.stack(np.split(to_np(xg.grad), 4, axis=-1))
        g_w[("net", "n", "scale")] += to_np(w.grad).reshape(4, 3).sum(0)
        if kind == "layer":
            g_w[("net", "n", "bias")] += to_np(b.grad).reshape(4, 3).sum(0)
    return y, gx, g_w


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_axis_index_groups_under_vmap_match_numpy_group_statistics(kind):
    """axis_name + axis_index_groups under jax.vmap (JAX's own pmean has no groups
    there): each lane normalizes with the statistics of its group's lanes. Forward
    against NumPy statistics per group; d/dx, d/dscale, d/dbias against PyTorch over the
    group's concatenated features."""
    norm, params, weights, x, r = _grouped_norm_case(kind)
    y = jax.vmap(lambda v: norm(params, v)[0], axis_name="data")(jnp.asarray(x))
    xf = x.astype(np.float64)
    scale = weights[("net", "n", "scale")].astype(np.float64)
    expected = np.zeros(x.shape)
    for grp in GROUPS:
        xg = xf[grp]  # (4 lanes, 2 rows, 3 features): statistics per row
        if kind == "layer":
            mean = xg.mean(axis=(0, 2), keepdims=True)
            var = ((xg - mean) ** 2).mean(axis=(0, 2), keepdims=True)
            bias = weights[("net", "n", "bias")].astype(np.float64)
            expected[grp] = (xg - mean) / np.sqrt(var + 1e-5) * scale + bias
        else:
            ms = (xg**2).mean(axis=(0, 2), keepdims=True)
            expected[grp] = xg / np.sqrt(ms + 1e-5) * scale
    np.testing.assert_allclose(y, expected, **tol(jnp.float32))

    def loss(train, rest, x):
        ys = jax.vmap(lambda v: norm(train.merge(rest), v)[0], axis_name="data")(x)
        return jnp.sum(ys * jnp.asarray(r))

    train, rest = params.split()
    g_train, g_x = jax.jit(jax.grad(loss, argnums=(0, 2)))(train, rest, jnp.asarray(x))
    y_t, gx_t, gw_t = _torch_grouped(kind, weights, x, r)
    np.testing.assert_allclose(y, y_t, **tol(jnp.float32))
    np.testing.assert_allclose(g_x, gx_t, rtol=1e-4, atol=1e-5, err_msg="d/dx")
    for path, ref in gw_t.items():
        np.testing.assert_allclose(g_train[path].value, ref, rtol=1e-4, atol=1e-5, err_msg=path)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_axis_index_groups_under_shard_map_over_8_devices(kind):
    """The same under jax.shard_map: the features split over 8 devices (each holds 3 of
    the 24), statistics averaged within GROUPS of devices; equals the vmap run above,
    which is checked against NumPy and PyTorch."""
    norm, params, _, x, _ = _grouped_norm_case(kind)
    mesh = Mesh(np.array(jax.devices()), ("data",))
    wide = np.concatenate(list(x), axis=-1)  # (2, 24): device i holds x[i]
    y = jax.jit(
        jax.shard_map(
            lambda p, v: norm(p, v)[0],
            mesh=mesh,
            in_specs=(P(), P(None, "data")),
            out_specs=P(None, "data"),
        )
    )(params, jnp.asarray(wide))
    y_vmap = jax.vmap(lambda v: norm(params, v)[0], axis_name="data")(jnp.asarray(x))
    np.testing.assert_allclose(
        y, np.concatenate(list(np.asarray(y_vmap)), axis=-1), **tol(jnp.float32)
    )


def test_norm_axis_errors_name_the_layer_and_the_fix():
    g = bx.Graph("net")
    with pytest.raises(ValueError, match=r"LayerNorm 'net/a': axis_index_groups needs an axis"):
        bx.LayerNorm(g / "a", axis_index_groups=[[0, 1]])
    with pytest.raises(ValueError, match=r"RMSNorm 'net/b': axis_index_groups needs an axis"):
        bx.RMSNorm(g / "b", axis_index_groups=[[0, 1]])
    _, params = bx.LayerNorm(bx.Graph("net") / "ln")(bx.Params(), jnp.zeros((2, 3)))
    bad = bx.LayerNorm(g / "ln", axis_name="data", axis_index_groups=[[0, 1, 2], [3]])
    with pytest.raises(ValueError, match=r"'net/ln': axis_index_groups=.*4 indices.*equal size"):
        jax.vmap(lambda v: bad(params, v)[0], axis_name="data")(jnp.ones((4, 2, 3)))
    unbound = bx.LayerNorm(bx.Graph("net") / "ln", axis_name="data")
    msg = r"(?s)LayerNorm 'net/ln': axis_name='data' is not bound.*jax.vmap.*axis_name=None"
    with pytest.raises(ValueError, match=msg):
        unbound(params, jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=msg):
        jax.vmap(lambda v: unbound(params, v)[0], axis_name="other")(jnp.ones((4, 2, 3)))


def test_norm_errors():
    g, rng, params = _seeded()
    ln = bx.LayerNorm(g / "ln")
    _, params = ln(params, jnp.ones((2, 4)))
    with pytest.raises(
        ValueError,
        match=r"LayerNorm 'net/ln' normalizes 4 features \(scale \(4,\)\), got input shape "
        r"\(2, 5\)\. Fix",
    ):
        ln(params, jnp.ones((2, 5)))
    rms = bx.RMSNorm(g / "rms")
    _, params = rms(params, jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"RMSNorm 'net/rms' normalizes 3 features"):
        rms(params, jnp.ones((3, 2)))
    with pytest.raises(ValueError, match=r"RMSNorm 'net/rms': input must not be scalar"):
        rms(params, jnp.float32(1.0))
    with pytest.raises(ValueError, match=r"LayerNorm 'net/bad': epsilon must be > 0"):
        bx.LayerNorm(g / "bad", epsilon=0.0)


# ---------------------------------------------------------------------------
# Positional encodings (sinusoidal, learned); RoPE is in test_attention.py
# ---------------------------------------------------------------------------


def _np_sinusoid(positions, dim, base=10000.0):
    pe = np.zeros((*np.shape(positions), dim))
    for i in range(dim // 2):
        w = 1.0 / base ** (2 * i / dim)
        pe[..., 2 * i] = np.sin(np.asarray(positions, np.float64) * w)
        pe[..., 2 * i + 1] = np.cos(np.asarray(positions, np.float64) * w)
    return pe


def test_sinusoidal_encoding_matches_the_formula():
    with jax.enable_x64(True):
        pe = bx.sinusoidal_encoding(jnp.arange(50), 16, dtype=jnp.float64)
        np.testing.assert_allclose(pe, _np_sinusoid(np.arange(50), 16), **tol(jnp.float64))
    pe32 = bx.sinusoidal_encoding(jnp.arange(50), 16)
    assert pe32.dtype == jnp.float32
    np.testing.assert_allclose(pe32, _np_sinusoid(np.arange(50), 16), rtol=1e-5, atol=2e-5)

    g = bx.Graph("net")
    enc = bx.SinusoidalPositionalEncoding(g / "pos")
    x = np.random.default_rng(0).standard_normal((2, 5, 8)).astype(np.float32)
    y, _ = enc(bx.Params(), jnp.asarray(x))
    np.testing.assert_allclose(y, x + _np_sinusoid(np.arange(5), 8), rtol=1e-5, atol=2e-6)
    # Offsets (decoding): per-batch positions.
    pos = np.array([[3, 4, 5, 6, 7], [0, 1, 2, 3, 4]])
    y, _ = enc(bx.Params(), jnp.asarray(x), jnp.asarray(pos))
    np.testing.assert_allclose(y, x + _np_sinusoid(pos, 8), rtol=1e-5, atol=2e-6)
    with pytest.raises(ValueError, match=r"dim must be a positive even int"):
        bx.sinusoidal_encoding(jnp.arange(3), 5)
    with pytest.raises(
        ValueError,
        match=r"SinusoidalPositionalEncoding 'net/pos': positions must have shape \(T,\) = "
        r"\(5,\) or \(B, T\) for input of shape \(2, 5, 8\), got \(4,\)",
    ):
        enc(bx.Params(), jnp.asarray(x), jnp.arange(4))


def test_learned_positional_embedding_adds_rows_and_checks_length():
    g, rng, params = _seeded()
    pos = bx.LearnedPositionalEmbedding(g / "pos", 6, rng)
    x = np.random.default_rng(0).standard_normal((2, 4, 3)).astype(np.float32)
    y, params = pos(params, jnp.asarray(x))
    table = np.asarray(params[("net", "pos", "embedding")].value)
    assert table.shape == (6, 3)
    assert 0.005 < table.std() < 0.05  # normal(0.02)
    np.testing.assert_allclose(y, x + table[:4], **tol(jnp.float32))
    y2, _ = pos(params, jnp.asarray(x[:, :1]), jnp.array([5]))
    np.testing.assert_allclose(y2, x[:, :1] + table[5:6], **tol(jnp.float32))
    with pytest.raises(
        ValueError,
        match=r"LearnedPositionalEmbedding 'net/pos': input has T = 7 positions \(shape "
        r"\(1, 7, 3\)\) but the table holds max_length = 6",
    ):
        pos(params, jnp.ones((1, 7, 3)))
    with pytest.raises(
        ValueError,
        match=r"LearnedPositionalEmbedding 'net/pos' expects inputs of shape \(\.\.\., 3\) "
        r"\(embedding \(6, 3\) = \(L, D\)\), got \(1, 2, 5\)\. Fix the input's last dimension",
    ):
        pos(params, jnp.ones((1, 2, 5)))
    # A stored table of the wrong shape is blamed, not the input: transposed (D, L) ...
    path = ("net", "pos", "embedding")
    with pytest.raises(
        ValueError,
        match=r"Parameter 'net/pos/embedding' is stored with shape \(3, 6\), but "
        r"LearnedPositionalEmbedding 'net/pos' expects \(6, 3\) = \(L, D\) for max_length=6 "
        r"and input shape \(2, 4, 3\)\. The stored value is transposed",
    ) as info:
        pos(_stored(params, path, (3, 6)), jnp.asarray(x))
    assert "Fix the input" not in str(info.value)
    # ... or made for another max_length (also with explicit positions).
    with pytest.raises(
        ValueError,
        match=r"'net/pos/embedding' is stored with shape \(8, 3\), but LearnedPositionalEmbedding "
        r"'net/pos' expects \(6, 3\).*Replace the stored value",
    ):
        pos(_stored(params, path, (8, 3)), jnp.asarray(x), jnp.arange(4))
