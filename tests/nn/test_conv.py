"""`Conv` / `ConvTranspose`: parameters, layouts, batch axes, padding rules against
hand-written ``jax.lax`` calls, causality, dtypes and errors (jit, vmap, grad, bf16,
float64 and sharding run over the table in ``test_layer_contract.py``).
`ConvTranspose` kernels: jax-blox 0.1.6's semantics (its ``lax.conv_transpose`` call with
its dimension numbers written out, grouped as per-group calls) and Flax's (its
``lax.conv_transpose`` defaults), and the flip relating the two kernel modes.

Numerics against PyTorch (forward and gradients over a stride/padding/dilation/groups grid,
both layouts) live in ``test_conv_torch.py``.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from tests.tolerances import tol


def _np_init(key, shape, dtype):
    """Random values from NumPy: no XLA compilation per shape (keeps the tests fast)."""
    del key
    r = np.random.default_rng(int(np.prod(shape)))
    return jnp.asarray(0.3 * r.standard_normal(shape), dtype)


# The layers with NumPy-initialized parameters; the library's own initializers are checked
# in test_default_kernel_init_is_lecun_normal_over_the_fan_in.
Conv = functools.partial(bx.Conv, kernel_init=_np_init, bias_init=_np_init)
ConvT = functools.partial(bx.ConvTranspose, kernel_init=_np_init, bias_init=_np_init)


def _init(make, x, seed=0):
    """Builds ``make(graph, rng)`` under 'net', initializes it on `x`; returns (layer, params)."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    layer = make(g, rng)
    _, params = jax.jit(layer)(rng.seed(bx.Params(), seed=seed), x)  # one compile, not per op
    return layer, params.locked()


def _normal(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, dtype)


def _kernel(params, name="conv"):
    return params[("net", name, "kernel")].value


def _bias(params, name="conv"):
    return params[("net", name, "bias")].value


# ----------------------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    "kernel, groups, x_shape, kernel_shape",
    [
        (3, 1, (2, 9, 4), (3, 4, 6)),
        ((3, 2), 2, (2, 7, 7, 4), (3, 2, 2, 6)),
        ((2, 3, 1), 1, (2, 4, 5, 6, 3), (2, 3, 1, 3, 6)),
    ],
)
def test_conv_parameter_paths_and_shapes(kernel, groups, x_shape, kernel_shape):
    layer, params = _init(
        lambda g, r: Conv(g / "conv", kernel, 6, r, feature_group_count=groups), _normal(x_shape)
    )
    assert sorted(k for k in params.keys() if k[1] == "conv") == [
        ("net", "conv", "bias"),
        ("net", "conv", "kernel"),
    ]
    assert _kernel(params).shape == kernel_shape and _kernel(params).dtype == jnp.float32
    assert _bias(params).shape == (6,)
    assert layer.num_spatial_dims == len(kernel_shape) - 2


def test_conv_transpose_parameter_shapes_and_no_bias():
    """jax-blox's layout (*k, C_out, C_in // G) by default; (*k, C_out // G, C_in) with
    transpose_kernel=True."""
    x = _normal((2, 4, 4, 9))
    _, params = _init(lambda g, r: ConvT(g / "conv", (2, 3), 6, r, feature_group_count=3), x)
    assert _kernel(params).shape == (2, 3, 6, 3)
    _, params = _init(
        lambda g, r: ConvT(g / "conv", (2, 3), 6, r, feature_group_count=3, transpose_kernel=True),
        x,
    )
    assert _kernel(params).shape == (2, 3, 2, 9)
    _, params = _init(lambda g, r: ConvT(g / "conv", 4, 5, r, use_bias=False), _normal((2, 4, 3)))
    assert _kernel(params).shape == (4, 5, 3)
    assert ("net", "conv", "bias") not in params


def test_jax_blox_positional_arguments_and_metadata():
    """Conv(graph, kernel_size, output_channels, rng, strides, padding, input_dilation,
    kernel_dilation, feature_group_count, use_bias, kernel_init, bias_init,
    kernel_metadata, bias_metadata) as in jax-blox 0.1.6."""
    ones = jax.nn.initializers.ones

    def make(g, r):
        return bx.Conv(
            g / "conv", (3, 3), 4, r, 1, "VALID", 1, 1, 1, True, ones, ones,
            {"sharding": (None, None, None, "model")}, {"sharding": ("model",)},
        )  # fmt: skip

    _, params = _init(make, jnp.ones((1, 5, 5, 2)))
    assert params[("net", "conv", "kernel")].sharding == (None, None, None, "model")
    assert params[("net", "conv", "bias")].sharding == ("model",)
    y, _ = make(bx.Graph("other"), None)(params.unlocked(), jnp.ones((1, 5, 5, 2)))
    np.testing.assert_allclose(np.asarray(y), np.full((1, 3, 3, 4), 9 * 2 + 1.0))


@pytest.mark.parametrize(
    "cls, kw",
    [
        (bx.Conv, {}),
        (bx.ConvTranspose, {}),
        (bx.ConvTranspose, {"transpose_kernel": True}),
    ],
    ids=["Conv", "ConvTranspose", "ConvTranspose-transpose_kernel"],
)
def test_default_kernel_init_is_lecun_normal_over_the_fan_in(cls, kw):
    _, params = _init(
        lambda g, r: cls(g / "conv", (3, 3), 96, r, feature_group_count=2, **kw),
        jnp.ones((1, 4, 4, 64)),
    )
    np.testing.assert_array_equal(np.asarray(_bias(params)), np.zeros(96))  # bias: zeros
    kernel = np.asarray(_kernel(params))
    # Conv: prod(k) * C_in / G. ConvTranspose (either layout): prod(k) * C_out, the
    # fan-in lecun_normal() counts on jax-blox's (*k, C_out, C_in // G) kernel.
    fan_in = 9 * 64 // 2 if cls is bx.Conv else 9 * 96
    assert abs(kernel.std() - fan_in**-0.5) < 0.03 * fan_in**-0.5
    assert abs(kernel.mean()) < 0.03 * fan_in**-0.5


@pytest.mark.parametrize("groups", [1, 2])
def test_default_transpose_kernel_equals_jax_blox_lecun_normal_draw(groups):
    """jax-blox 0.1.6's ConvTranspose kernel is (*k, C_out, C_in // G) drawn with
    lecun_normal() (in_axis=-2, out_axis=-1) from the parameter's key, fold_in(seed, 0)
    for the first parameter: blox's default kernel is that array."""
    _, params = _init(
        lambda g, r: bx.ConvTranspose(g / "conv", (3, 2), 6, r, feature_group_count=groups),
        jnp.ones((1, 4, 4, 4)),
    )
    key = jax.random.fold_in(jax.random.key(0), 0)
    want = jax.nn.initializers.lecun_normal()(key, (3, 2, 6, 4 // groups), jnp.float32)
    np.testing.assert_allclose(np.asarray(_kernel(params)), np.asarray(want), rtol=1e-6)


# ----------------------------------------------------------------------------- padding rules


@pytest.mark.parametrize("padding", ["SAME", "SAME_LOWER", "VALID", ((2, 0), (1, 3))])
@pytest.mark.parametrize("strides", [(1, 1), (2, 3)])
def test_conv_padding_matches_lax(padding, strides):
    """The padding strings mean what they mean in lax.conv_general_dilated."""
    x = _normal((2, 9, 8, 3))
    layer, params = _init(
        lambda g, r: Conv(
            g / "conv", (3, 2), 4, r, strides, padding, kernel_dilation=(1, 2), use_bias=False
        ),
        x,
    )
    y, _ = jax.jit(layer)(params, x)
    ref = lax.conv_general_dilated(
        x, _kernel(params), strides, padding, rhs_dilation=(1, 2),
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **tol("float32"))


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize(
    "kernel, strides, dilation, tk",
    [(3, 2, 1, False), (4, 2, 1, False), (2, 3, 2, False), (5, 1, 1, False)]
    + [(4, 2, 1, True), (2, 3, 2, True)],
)
def test_conv_transpose_padding_matches_lax_conv_transpose(padding, kernel, strides, dilation, tk):
    """'SAME' / 'VALID' are lax.conv_transpose's; the default kernel (*k, C_out, C_in) is
    used as stored ('HWOI', transpose_kernel=False, as jax-blox), transpose_kernel=True is
    lax's transpose_kernel=True over the (*k, C_out, C_in) kernel read as 'HWIO'."""
    x = _normal((2, 5, 4, 3))
    layer, params = _init(
        lambda g, r: ConvT(
            g / "conv", (kernel, kernel), 2, r, strides, padding, dilation, use_bias=False,
            transpose_kernel=tk,
        ),
        x,
    )  # fmt: skip
    y, _ = jax.jit(layer)(params, x)
    ref = lax.conv_transpose(
        x, _kernel(params), (strides, strides), padding, (dilation, dilation),
        ("NHWC", "HWIO" if tk else "HWOI", "NHWC"), transpose_kernel=tk,
    )  # fmt: skip
    assert y.shape == ref.shape
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **tol("float32"))


def _jax_blox_conv_transpose(x, kernel, bias, strides, padding, dilation, groups):
    """jax-blox 0.1.6's ConvTranspose written out: ``lax.conv_transpose`` over the kernel
    ``(*k, C_out, C_in // G)`` with its dimension numbers (lhs (0, n+1, 1..n), rhs
    (n, n+1, 0..n-1): kernel axis n is the output features, n+1 the input features),
    ``transpose_kernel=False``. jax-blox cannot run G > 1 (it does not pass the groups
    on); the grouped reference is G such calls over channel slices, concatenated: group
    g maps inputs g*C_in/G:(g+1)*C_in/G with kernel[..., g*C_out/G:(g+1)*C_out/G, :]."""
    n = kernel.ndim - 2
    spatial = tuple(range(1, n + 1))
    dn = lax.ConvDimensionNumbers(
        lhs_spec=(0, n + 1) + spatial,
        rhs_spec=(n, n + 1) + tuple(range(n)),
        out_spec=(0, n + 1) + spatial,
    )
    cin, cout = x.shape[-1] // groups, kernel.shape[-2] // groups
    outs = [
        lax.conv_transpose(
            x[..., g * cin : (g + 1) * cin],
            kernel[..., g * cout : (g + 1) * cout, :],
            strides,
            padding,
            rhs_dilation=dilation,
            dimension_numbers=dn,
        )
        for g in range(groups)
    ]
    y = jnp.concatenate(outs, axis=-1)
    return y + jnp.broadcast_to(bias, y.shape)


@pytest.mark.parametrize(
    "kernel, strides, padding, dilation, groups, x_shape",
    [
        ((3,), (2,), "SAME", (1,), 1, (2, 6, 3)),
        ((4, 4), (2, 2), "SAME", (1, 1), 1, (2, 5, 4, 3)),
        ((3, 2), (2, 3), "VALID", (2, 1), 1, (2, 4, 3, 2)),
        ((3, 3), (2, 2), ((2, 1), (0, 3)), (1, 1), 1, (1, 4, 5, 2)),
        ((2, 3, 2), (1, 2, 2), "SAME", (1, 1, 1), 1, (1, 3, 2, 3, 2)),
        ((3, 3), (2, 2), "SAME", (1, 1), 2, (2, 4, 5, 4)),
        ((4,), (3,), "VALID", (2,), 3, (2, 5, 6)),
    ],
    ids=["1d", "2d-k4", "2d-valid-dil", "2d-explicit", "3d", "2d-g2", "1d-g3-valid-dil"],
)
def test_conv_transpose_gives_jax_blox_numbers_with_jax_blox_weights(
    kernel, strides, padding, dilation, groups, x_shape
):
    """A jax-blox ConvTranspose checkpoint (same paths, shapes and arguments) gives the
    numbers jax-blox computes, grouped kernels included (which jax-blox cannot run)."""
    x = _normal(x_shape)
    cout = 6
    layer, params = _init(
        lambda g, r: ConvT(
            g / "conv", kernel, cout, r, strides, padding, dilation, groups
        ),  # jax-blox's positional order
        x,
    )
    k = _kernel(params)
    assert k.shape == kernel + (cout, x_shape[-1] // groups)
    y, _ = jax.jit(layer)(params, x)
    ref = _jax_blox_conv_transpose(x, k, _bias(params), strides, padding, dilation, groups)
    assert y.shape == ref.shape
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **tol("float32"))
    # The flipped-kernel (PyTorch) semantics give other numbers from the same weights.
    tk = ConvT(
        bx.Graph("net") / "conv", kernel, cout, None, strides, padding, dilation, groups,
        transpose_kernel=True,
    )  # fmt: skip
    if groups == 1:
        y_tk, _ = tk(params, x)
        assert np.abs(np.asarray(y_tk) - np.asarray(ref)).max() > 0.1


@pytest.mark.parametrize("padding", ["SAME", "VALID", ((1, 2), (2, 0))])
@pytest.mark.parametrize("tk", [False, True], ids=["flax-default", "flax-transpose_kernel"])
def test_conv_transpose_loads_flax_kernels(padding, tk):
    """Flax's ConvTranspose is lax.conv_transpose with its default dimension numbers
    (NHWC, HWIO, NHWC). Flax kernel (*k, C_in, C_out) -> blox kernel.swapaxes(-1, -2);
    Flax transpose_kernel=True kernel (*k, C_out, C_in) -> blox transpose_kernel=True,
    unchanged."""
    x = _normal((2, 4, 5, 3))
    flax_shape = (3, 2) + ((4, 3) if tk else (3, 4))
    flax_kernel = _np_init(None, flax_shape, jnp.float32)
    ref = lax.conv_transpose(
        x, flax_kernel, (2, 2), padding, (1, 1), ("NHWC", "HWIO", "NHWC"), transpose_kernel=tk
    )
    layer = bx.ConvTranspose(
        bx.Graph("net") / "conv", (3, 2), 4, None, 2, padding, use_bias=False,
        transpose_kernel=tk,
    )  # fmt: skip
    params = bx.Params()
    params[("net", "conv", "kernel")] = bx.Param(
        flax_kernel if tk else flax_kernel.swapaxes(-1, -2)
    )
    y, _ = jax.jit(layer)(params, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **tol("float32"))


def test_transpose_kernel_mode_is_the_default_mode_with_the_kernel_flipped():
    """For G = 1: ConvTranspose(transpose_kernel=True) with kernel K equals the default
    mode with K[::-1, ::-1] (the docs' conversion between the two modes)."""
    x = _normal((2, 4, 3, 3))
    tk, params = _init(lambda g, r: ConvT(g / "conv", (3, 2), 5, r, 2, transpose_kernel=True), x)
    default = bx.ConvTranspose(bx.Graph("net") / "conv", (3, 2), 5, None, 2)
    flipped = params.unlocked()
    flipped[("net", "conv", "kernel")] = bx.Param(_kernel(params)[::-1, ::-1])
    np.testing.assert_allclose(
        np.asarray(default(flipped, x)[0]), np.asarray(tk(params, x)[0]), **tol("float32")
    )


def test_conv_transpose_kernel_in_the_other_mode_layout_is_an_error():
    x = _normal((1, 4, 4, 6))
    _, params = _init(lambda g, r: ConvT(g / "conv", (3, 3), 4, r, feature_group_count=2), x)
    assert _kernel(params).shape == (3, 3, 4, 3)
    torch_mode = bx.ConvTranspose(
        bx.Graph("net") / "conv", (3, 3), 4, None, feature_group_count=2, transpose_kernel=True
    )
    with pytest.raises(
        ValueError,
        match=r"ConvTranspose 'net/conv': its kernel has shape \(3, 3, 4, 3\) in params, the "
        r"layout of transpose_kernel=False, but this layer has transpose_kernel=True and "
        r"needs \(3, 3, 2, 6\)",
    ):
        torch_mode(params, x)
    with pytest.raises(TypeError, match=r"'net/c': transpose_kernel must be a bool"):
        bx.ConvTranspose(bx.Graph("net") / "c", 3, 4, None, transpose_kernel="yes")


@pytest.mark.parametrize("strides, dilation", [(1, 1), (2, 1), (1, 3), (3, 2)])
def test_causal_conv_sees_only_the_past(strides, dilation):
    x = _normal((2, 12, 3))
    layer, params = _init(
        lambda g, r: Conv(g / "conv", 3, 4, r, strides, "CAUSAL", kernel_dilation=dilation), x
    )
    f = jax.jit(layer)
    y, _ = f(params, x)
    assert y.shape == (2, -(-12 // strides), 4)
    for t in range(y.shape[1]):
        # Changing inputs after t * strides leaves outputs 0..t unchanged.
        y2, _ = f(params, x.at[:, t * strides + 1 :].add(1.0))
        np.testing.assert_array_equal(np.asarray(y2[:, : t + 1]), np.asarray(y[:, : t + 1]))
        if t + 1 < y.shape[1]:
            assert not np.allclose(np.asarray(y2[:, t + 1 :]), np.asarray(y[:, t + 1 :]))
    # The same as left-padding by hand, then 'VALID'.
    pad = (3 - 1) * dilation
    valid = Conv(bx.Graph("net") / "conv", 3, 4, None, strides, "VALID", kernel_dilation=dilation)
    y_valid, _ = valid(params, jnp.pad(x, ((0, 0), (pad, 0), (0, 0))))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_valid), **tol("float32"))


@pytest.mark.parametrize("tk", [False, True], ids=["default", "transpose_kernel"])
def test_causal_conv_transpose_sees_only_the_past(tk):
    x = _normal((2, 5, 3))
    layer, params = _init(
        lambda g, r: ConvT(g / "conv", 3, 2, r, 2, "CAUSAL", transpose_kernel=tk), x
    )
    f = jax.jit(layer)
    y, _ = f(params, x)
    assert y.shape == (2, 10, 2)
    for j in range(5):  # input j influences outputs >= j * stride only
        y2, _ = f(params, x.at[:, j].add(1.0))
        np.testing.assert_array_equal(np.asarray(y2[:, : 2 * j]), np.asarray(y[:, : 2 * j]))
        assert not np.allclose(np.asarray(y2[:, 2 * j]), np.asarray(y[:, 2 * j]))


def test_padding_spellings_are_equivalent():
    x = _normal((1, 6, 5, 2))
    spellings = [1, (1, 1), ((1, 1), (1, 1)), [(1, 1), [1, 1]]]
    outs = []
    for pad in spellings:
        layer, params = _init(lambda g, r, pad=pad: Conv(g / "conv", (3, 3), 2, r, padding=pad), x)
        outs.append(np.asarray(layer(params, x)[0]))
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    layer, params = _init(lambda g, r: Conv(g / "conv", 3, 2, r, padding=(2, 0)), x[:, 0])
    lower, _ = layer(params, x[:, 0])
    causal, _ = Conv(bx.Graph("net") / "conv", 3, 2, None, padding="causal")(params, x[:, 0])
    np.testing.assert_array_equal(np.asarray(lower), np.asarray(causal))


# ----------------------------------------------------------------------------- layouts, batch


@pytest.mark.parametrize(
    "cls, kw, x_shape",
    [
        (Conv, dict(kernel_size=(3, 2), strides=2, feature_group_count=2), (2, 7, 6, 4)),
        (Conv, dict(kernel_size=3, input_dilation=2, padding="CAUSAL"), (3, 9, 2)),
        (Conv, dict(kernel_size=(2, 2, 2), padding="VALID"), (2, 3, 4, 5, 2)),
        (
            ConvT,
            dict(kernel_size=(3, 3), strides=2, feature_group_count=2),
            (2, 4, 5, 4),
        ),
    ],
    ids=["conv2d-groups", "conv1d-causal-input-dil", "conv3d", "transpose2d-groups"],
)
def test_channels_first_gives_the_same_numbers_with_the_same_params(cls, kw, x_shape):
    x = _normal(x_shape)
    layer, params = _init(lambda g, r: cls(g / "conv", output_channels=6, rng=r, **kw), x)
    first = cls(bx.Graph("net") / "conv", output_channels=6, rng=None, channels_first=True, **kw)
    y, _ = jax.jit(layer)(params, x)
    xt = jnp.moveaxis(x, -1, 1)
    # Nothing is created: one set of parameters serves both layouts.
    assert jax.tree.structure(jax.eval_shape(first, params, xt)[1]) == jax.tree.structure(params)
    yt, _ = jax.jit(first)(params, xt)
    np.testing.assert_allclose(np.asarray(jnp.moveaxis(yt, 1, -1)), np.asarray(y), **tol("float32"))


@pytest.mark.parametrize(
    "cls, channels_first, batch",
    [(Conv, False, ()), (Conv, True, (2, 3)), (ConvT, False, (2, 3)), (ConvT, True, ())],
    ids=["Conv-NHWC-unbatched", "Conv-NCHW-B1xB2", "ConvT-NHWC-B1xB2", "ConvT-NCHW-unbatched"],
)
def test_any_number_of_batch_axes(cls, channels_first, batch):
    x = _normal((6, 2, 5, 4))
    flat = x if not channels_first else jnp.moveaxis(x, -1, 1)
    layer, params = _init(
        lambda g, r: cls(g / "conv", (3, 2), 5, r, strides=2, channels_first=channels_first), flat
    )
    ref, _ = jax.jit(layer)(params, flat)
    n = int(np.prod(batch))
    xb = flat[:n].reshape(batch + flat.shape[1:])
    y, _ = jax.jit(layer)(params, xb)
    assert y.shape == batch + ref.shape[1:]
    np.testing.assert_allclose(
        np.asarray(y).reshape((n,) + ref.shape[1:]), np.asarray(ref[:n]), **tol("float32")
    )


# ----------------------------------------------------------------------------- dtypes


def test_explicit_compute_dtype_and_precision():
    x = _normal((2, 5, 5, 3))
    layer, params = _init(lambda g, r: Conv(g / "conv", 3, 4, r, dtype=jnp.bfloat16), x)
    assert layer(params, x)[0].dtype == jnp.bfloat16
    assert _kernel(params).dtype == jnp.float32
    # Without dtype=, f32 params with a bf16 input compute in f32 (promotion).
    plain = Conv(bx.Graph("net") / "conv", 3, 4, None)
    assert jax.eval_shape(plain, params, x.astype(jnp.bfloat16))[0].dtype == jnp.float32
    layer, params = _init(lambda g, r: Conv(g / "conv", 3, 4, r), x)
    hi, _ = layer(params, x, precision=lax.Precision.HIGHEST)
    np.testing.assert_allclose(np.asarray(hi), np.asarray(layer(params, x)[0]), **tol("float32"))


# ----------------------------------------------------------------------------- sharding


def _mesh(kind):
    t = {"explicit": jax.sharding.AxisType.Explicit, "auto": jax.sharding.AxisType.Auto}[kind]
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(t, t))


# kernel spec, input spec, inferred output spec on an Explicit mesh
CONV_SHARDINGS = {
    "column": (P(None, None, None, "model"), P("data"), P("data", None, None, "model")),
    "row": (
        P(None, None, "model", None),
        P("data", None, None, "model"),
        P("data", None, None, None),
    ),
    "row-column": (
        P(None, None, "data", "model"),
        P(None, None, None, "data"),
        P(None, None, None, "model"),
    ),
}


@pytest.mark.parametrize("kind", ["explicit", "auto"])
@pytest.mark.parametrize("case", sorted(CONV_SHARDINGS))
def test_conv_on_sharded_kernels_infers_or_takes_the_output_sharding(kind, case):
    """JAX infers a convolution's output sharding only for a replicated kernel and
    unsharded input channels; the layer infers the rest (batch kept, channels following
    the kernel's when free) and honours ``out_sharding``. Reference: the unsharded run."""
    k_spec, x_spec, expected = CONV_SHARDINGS[case]
    mesh = _mesh(kind)
    x = _normal((2, 6, 6, 8))
    layer, params = _init(lambda g, r: Conv(g / "conv", (3, 3), 8, r), x)
    ref, _ = layer(params, x, precision=lax.Precision.HIGHEST)
    specs = {"net/conv/kernel": k_spec}
    ps = jax.device_put(
        params,
        jax.tree_util.tree_map_with_path(
            lambda kp, _: NamedSharding(mesh, specs.get(kp[0].key, P())), params
        ),
    )
    xs = jax.device_put(x, NamedSharding(mesh, x_spec))
    hi = lax.Precision.HIGHEST
    y, _ = jax.jit(lambda p, a: layer(p, a, precision=hi))(ps, xs)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), **tol("float32"))
    if kind == "explicit":
        assert jax.typeof(y).sharding.spec == expected
    want = NamedSharding(mesh, P(None, None, "data", None))
    y2, _ = jax.jit(lambda p, a: layer(p, a, precision=hi, out_sharding=want))(ps, xs)
    np.testing.assert_allclose(np.asarray(y2), np.asarray(ref), **tol("float32"))
    assert y2.sharding.is_equivalent_to(want, 4), (y2.sharding, want)


def test_conv_out_sharding_errors_name_the_layer_and_the_fix():
    x = _normal((2, 5, 5, 3))
    layer, params = _init(lambda g, r: ConvT(g / "conv", (3, 3), 4, r), x)
    with pytest.raises(TypeError, match=r"ConvTranspose 'net/conv': out_sharding must be a"):
        layer(params, x, out_sharding="data")
    with pytest.raises(ValueError, match=r"'net/conv': out_sharding=.* no mesh is set.*set_mesh"):
        layer(params, x, out_sharding=P("data"))
    mesh = _mesh("explicit")
    with pytest.raises(ValueError, match=r"has 5 entries but the output has 4 dims"):
        layer(params, x, out_sharding=NamedSharding(mesh, P("data", None, None, None, None)))
    with jax.set_mesh(mesh), pytest.raises(ValueError, match=r"names mesh axis 'tensor'"):
        layer(params, x, out_sharding=P(None, "tensor"))


def test_repr_names_the_path_and_changed_arguments():
    g = bx.Graph("net")
    conv = bx.Conv(g / "conv", (3, 3), 8, None, strides=2, channels_first=True)
    assert repr(conv).startswith("Conv(") and "at 'net/conv'" in repr(conv)
    assert "strides=2" in repr(conv) and "channels_first=True" in repr(conv)


# ----------------------------------------------------------------------------- errors


def _conv(*args, **kw):
    return bx.Conv(bx.Graph("net") / "enc" / "conv", *args, **kw)


def _convt(*args, **kw):
    return bx.ConvTranspose(bx.Graph("net") / "dec" / "up", *args, **kw)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: _conv((3, 3), 4, None, padding="FULL"), r"Conv 'net/enc/conv': unknown padding"),
        (lambda: _conv((3, 3), 4, None, padding="CAUSAL"), r"'CAUSAL' padding is only defined"),
        (lambda: _conv(3, 4, None, padding=((1, 1), (1, 1))), r"2 entries for 1 spatial"),
        (lambda: _conv((3, 3), 4, None, padding=((1, -1), (0, 0))), r"must be >= 0"),
        (lambda: _conv((3, 3), 4, None, padding=((1, 1, 1), 0)), r"not a \(low, high\) pair"),
        (lambda: _conv((3, 3), 4, None, padding=1.5), r"bad padding 1.5"),
        (lambda: _conv((3, 3), 4, None, padding=((1.0, 1), (0, 0))), r"must be ints"),
        (lambda: _conv((3, 3), 4, None, strides=(1, 1, 1)), r"strides has 3 entries .* 2 spatial"),
        (lambda: _conv((3, 0), 4, None), r"kernel_size must be positive ints"),
        (lambda: _conv((), 4, None), r"kernel_size must not be empty"),
        (lambda: _conv((3, 3), 0, None), r"output_channels must be a positive int"),
        (lambda: _conv((3, 3), 6, None, feature_group_count=4), r"output_channels=6 .* by"),
        (lambda: _conv((3, 3), 6, None, feature_group_count=0), r"feature_group_count must be"),
        (lambda: _convt((3, 3), 4, None, padding="SAME_LOWER"), r"'net/dec/up': unknown padding"),
        (lambda: _convt((3, 3), 4, None, 2, output_padding=2), r"output_padding\[0\]=2 must be"),
        (lambda: _convt((3, 3), 4, None, output_padding=(1,)), r"output_padding must be"),
    ],
)
def test_constructor_errors_name_the_path_and_the_fix(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def _params():
    return bx.Params()


@pytest.mark.parametrize(
    "layer, x_shape, match",
    [
        # Kernel larger than a VALID input.
        (
            lambda: _conv((3, 5), 4, None, padding="VALID"),
            (2, 8, 4, 1),
            r"Conv 'net/enc/conv': spatial axis 1 .*size 4 .*\(2, 8, 4, 1\).* kernel size 5",
        ),
        (
            lambda: _conv(3, 4, None, padding="VALID", kernel_dilation=3),
            (2, 6, 1),
            r"smaller than the dilated kernel size 7 .*padding='SAME'",
        ),
        # Channels not divisible by the group count.
        (
            lambda: _conv((3, 3), 4, None, feature_group_count=2),
            (2, 8, 8, 3),
            r"'net/enc/conv': the input has 3 channels .*\(2, 8, 8, 3\).*feature_group_count=2",
        ),
        (
            lambda: _convt((3, 3), 4, None, feature_group_count=4, channels_first=True),
            (2, 6, 5, 5),
            r"ConvTranspose 'net/dec/up': the input has 6 channels \(axis -3",
        ),
        # Wrong input rank for the conv's dimensionality.
        (
            lambda: _conv((3, 3), 4, None),
            (28, 28),
            r"'net/enc/conv' is 2-D .*\(\.\.\., H, W, C\) .*got shape \(28, 28\)",
        ),
        (
            lambda: _conv((3, 3, 3), 4, None, channels_first=True),
            (1, 8, 8),
            r"is 3-D .*\(\.\.\., C, D, H, W\) with at least 4 axes",
        ),
        # A transposed conv whose explicit pads leave nothing.
        (
            lambda: _convt(5, 4, None, padding=(0, 0)),
            (2, 1, 3),
            r"'net/dec/up': spatial axis 0 .*empty output",
        ),
    ],
)
def test_call_errors_name_the_path_shapes_and_fix(layer, x_shape, match):
    with pytest.raises(ValueError, match=match):
        layer()(_params(), jnp.ones(x_shape))


def test_changed_input_channels_name_both_kernel_shapes():
    layer = _conv((3, 3), 4, None, kernel_init=jax.nn.initializers.ones)
    _, params = layer(_params(), jnp.ones((1, 5, 5, 3)))
    with pytest.raises(ValueError, match=r"'net/enc/conv': its kernel has shape \(3, 3, 3, 4\)"):
        layer(params, jnp.ones((1, 5, 5, 2)))
    # The classic layout slip: NCHW data into a channels-last layer.
    with pytest.raises(ValueError, match=r"needs \(3, 3, 5, 4\) .*channels_first"):
        layer(params, jnp.ones((1, 3, 5, 5)))


def _store_kernel(params, name, value):
    """Stores `value` as the kernel, as a script that copies weights from PyTorch does."""
    params = params.unlocked()
    params[("net", name, "kernel")] = bx.Param(jnp.asarray(value))
    return params


def test_stored_kernel_in_pytorch_layout_is_blamed_with_the_permute():
    x = _normal((2, 6, 5, 4))
    layer, params = _init(lambda g, r: Conv(g / "conv", (3, 2), 6, r, padding="VALID"), x)
    # torch.nn.Conv2d(4, 6, (3, 2)).weight: (C_out, C_in, kh, kw), copied without permute.
    weight = np.random.default_rng(1).standard_normal((6, 4, 3, 2)).astype(np.float32)
    with pytest.raises(
        ValueError,
        match=r"Parameter 'net/conv/kernel' is stored with shape \(6, 4, 3, 2\), but Conv "
        r"'net/conv' expects \(3, 2, 4, 6\) = \(\*kernel_size, C_in // G, C_out\) for input "
        r"shape \(2, 6, 5, 4\)\. The stored value is in PyTorch's layout \(C_out, C_in // G, "
        r"\*kernel_size\): store kernel = weight\.permute\(2, 3, 1, 0\)",
    ) as info:
        layer(_store_kernel(params, "conv", weight), x)
    assert "Fix the input" not in str(info.value)
    # The advice is right: the permuted weight computes PyTorch's convolution, written here
    # with lax in PyTorch's own kernel layout (OIHW).
    y, _ = layer(_store_kernel(params, "conv", weight.transpose(2, 3, 1, 0)), x)
    ref = lax.conv_general_dilated(
        x, jnp.asarray(weight), (1, 1), "VALID", dimension_numbers=("NHWC", "OIHW", "NHWC")
    )
    np.testing.assert_allclose(y, ref + _bias(params)[None, None, None], **tol("float32"))
    # A square kernel in PyTorch's layout is the expected shape reversed: still the permute
    # (weight.T would also swap kh and kw), for a 1-D conv too.
    x1 = _normal((2, 7, 4))
    layer1, params1 = _init(lambda g, r: Conv(g / "conv", 3, 5, r), x1)
    with pytest.raises(
        ValueError, match=r"stored with shape \(5, 4, 3\).*weight\.permute\(2, 1, 0\)"
    ):
        layer1(_store_kernel(params1, "conv", np.zeros((5, 4, 3), np.float32)), x1)
    # Another kernel size or output count: the stored value is blamed, not the input.
    for bad in [(3, 3, 4, 6), (3, 2, 4, 5), (3, 2, 4, 6, 1)]:
        with pytest.raises(
            ValueError,
            match=rf"'net/conv/kernel' is stored with shape {re.escape(str(bad))}, but Conv "
            r"'net/conv' expects \(3, 2, 4, 6\).*Replace the stored value",
        ):
            layer(_store_kernel(params, "conv", np.zeros(bad, np.float32)), x)


@pytest.mark.parametrize("transpose_kernel", [False, True])
def test_stored_conv_transpose_kernel_in_pytorch_layout_is_blamed(transpose_kernel):
    x = _normal((1, 4, 4, 6))
    layer, params = _init(
        lambda g, r: ConvT(
            g / "conv", (3, 2), 4, r, feature_group_count=2, transpose_kernel=transpose_kernel
        ),
        x,
    )
    # torch.nn.ConvTranspose2d(6, 4, (3, 2), groups=2).weight: (C_in, C_out // G, kh, kw).
    expected = r"\(3, 2, 2, 6\)" if transpose_kernel else r"\(3, 2, 4, 3\)"
    fix = r"\." if transpose_kernel else r" and construct the layer with transpose_kernel=True"
    with pytest.raises(
        ValueError,
        match=r"Parameter 'net/conv/kernel' is stored with shape \(6, 2, 3, 2\), but "
        rf"ConvTranspose 'net/conv' expects {expected} = .* The stored value is in PyTorch's "
        r"layout \(C_in, C_out // G, \*kernel_size\): store kernel = "
        r"weight\.permute\(2, 3, 1, 0\)" + fix,
    ):
        layer(_store_kernel(params, "conv", np.zeros((6, 2, 3, 2), np.float32)), x)
    with pytest.raises(ValueError, match=r"stored with shape \(3, 2, 5, 6\).*Replace the stored"):
        layer(_store_kernel(params, "conv", np.zeros((3, 2, 5, 6), np.float32)), x)
