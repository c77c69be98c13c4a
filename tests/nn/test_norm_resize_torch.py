"""`BatchNorm`, `GroupNorm`, `resize`, the activations and `PReLU` against PyTorch on CPU.

Each test builds the blox op, copies PyTorch's weights across (``scale = weight``,
``bias = bias``, ``negative_slope = weight``; the running statistics start equal), and
compares the forward pass *and* the gradients of ``sum(y * r)`` (``r`` a fixed random
cotangent) with respect to the input and every trainable weight. Channels-last inputs
are PyTorch's NC... tensors moved to N...C; channels-first inputs are passed unchanged.

Tolerances: ``tests/tolerances.py`` ``tol(dtype)`` (float32 rtol 1e-5 / atol 1e-6;
float64 rtol 1e-10 / atol 1e-12), except where a test says otherwise: normalization
gradients and activation gradients in float32 use rtol 1e-4 / atol 1e-5 (both
libraries sum ~100 terms per channel in a different order and the backward pass of a
normalization subtracts nearly equal sums; the tanh-GELU derivative in its tail, ~1e-4,
is computed by a different formula and differs by ~2e-6 in float32). float64 always uses
tol(float64).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import blox as bx
from tests.nn.torch_reference import (
    TORCH_DTYPES,
    assert_close,
    dtype_context,
    load_weights,
    to_last,
    to_np,
)

NORM_GRAD_TOL_F32 = dict(rtol=1e-4, atol=1e-5)


def _close(actual, expected, dtype: str, what: str, grad: bool = False) -> None:
    t = NORM_GRAD_TOL_F32 if (grad and dtype == "float32") else None
    assert_close(actual, expected, dtype, what, tolerance=t)


# ---------------------------------------------------------------------------
# BatchNorm: several training steps, then eval
# ---------------------------------------------------------------------------

BN_CASES = [
    # (torch input shape NC..., channels_first, dtype, affine)
    ((6, 3, 5, 4), False, "float32", True),
    ((6, 3, 5, 4), True, "float32", True),
    ((6, 3, 5, 4), False, "float64", True),
    ((6, 3, 5, 4), True, "float64", False),
    ((8, 4), False, "float32", True),  # BatchNorm1d on (N, C)
    ((4, 2, 7), True, "float64", True),  # BatchNorm1d on (N, C, L)
    ((3, 2, 3, 4, 2), False, "float64", True),  # BatchNorm3d
]


@pytest.mark.parametrize("shape,channels_first,dtype,affine", BN_CASES)
def test_batchnorm_matches_torch_over_training_steps_then_eval(
    shape, channels_first, dtype, affine
):
    """Three training steps: output, d/dx, d/dscale, d/dbias and both running statistics
    after every step; then eval mode on a fresh batch. torch momentum 0.1 = blox 0.9."""
    torch.manual_seed(0)
    c = shape[1]
    cls = {2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d}
    ref = cls.get(len(shape), torch.nn.BatchNorm3d)(
        c, eps=1e-3, momentum=0.1, affine=affine, dtype=TORCH_DTYPES[dtype]
    )
    rs = np.random.default_rng(1)
    if affine:
        with torch.no_grad():
            ref.weight.copy_(torch.tensor(rs.uniform(0.5, 1.5, c)))
            ref.bias.copy_(torch.tensor(rs.standard_normal(c)))
    layout = (lambda a: a) if channels_first else to_last

    with dtype_context(dtype):
        g = bx.Graph("net")
        bn = bx.BatchNorm(
            g / "bn",
            momentum=0.9,
            epsilon=1e-3,
            use_scale=affine,
            use_bias=affine,
            channels_first=channels_first,
            param_dtype=dtype,
        )
        # An eval-mode call creates the parameters and leaves the statistics at their
        # initial values (zeros / ones, as PyTorch's).
        zeros = jnp.zeros(layout(np.zeros(shape)).shape, dtype)
        _, base = bn(bx.Params(), zeros, is_training=False)
        weights = {}
        if affine:
            weights[("net", "bn", "scale")] = to_np(ref.weight)
            weights[("net", "bn", "bias")] = to_np(ref.bias)
        params = load_weights(base, weights, cast=True)
        expected = {("net", "bn", "running_mean"), ("net", "bn", "running_var"), *weights}
        assert set(params.keys()) == expected
        assert not params[("net", "bn", "running_mean")].trainable
        assert not params[("net", "bn", "running_var")].trainable

        def loss(train, rest, x, r):
            y, new = bn(train.merge(rest), x, is_training=True)
            return jnp.sum(y * r), (y, new)

        grad_fn = jax.jit(jax.grad(loss, argnums=(0, 2), has_aux=True))
        for step in range(3):
            x = (rs.standard_normal(shape) * 2.0 + 0.5 * step).astype(dtype)
            r = rs.standard_normal(shape).astype(dtype)
            x_t = torch.tensor(x, requires_grad=True)
            ref.zero_grad()
            y_t = ref(x_t)
            (y_t * torch.tensor(r)).sum().backward()

            train, rest = params.split()
            (g_train, g_x), (y, params) = grad_fn(
                train, rest, jnp.asarray(layout(x)), jnp.asarray(layout(r))
            )
            _close(y, layout(to_np(y_t)), dtype, f"step {step} output")
            _close(g_x, layout(to_np(x_t.grad)), dtype, f"step {step} d/dx", grad=True)
            if affine:
                _close(
                    g_train[("net", "bn", "scale")].value,
                    to_np(ref.weight.grad),
                    dtype,
                    f"step {step} d/dscale",
                    grad=True,
                )
                _close(
                    g_train[("net", "bn", "bias")].value,
                    to_np(ref.bias.grad),
                    dtype,
                    f"step {step} d/dbias",
                    grad=True,
                )
            _close(
                params[("net", "bn", "running_mean")].value,
                to_np(ref.running_mean),
                dtype,
                f"step {step} running_mean",
            )
            _close(
                params[("net", "bn", "running_var")].value,
                to_np(ref.running_var),
                dtype,
                f"step {step} running_var (unbiased)",
            )

        ref.eval()
        x = rs.standard_normal(shape).astype(dtype)
        r = rs.standard_normal(shape).astype(dtype)
        x_t = torch.tensor(x, requires_grad=True)
        ref.zero_grad()
        y_t = ref(x_t)
        (y_t * torch.tensor(r)).sum().backward()

        def eval_loss(train, rest, x, r):
            y, new = bn(train.merge(rest), x, is_training=False)
            return jnp.sum(y * r), (y, new)

        train, rest = params.split()
        (g_train, g_x), (y, after) = jax.grad(eval_loss, argnums=(0, 2), has_aux=True)(
            train, rest, jnp.asarray(layout(x)), jnp.asarray(layout(r))
        )
        _close(y, layout(to_np(y_t)), dtype, "eval output")
        _close(g_x, layout(to_np(x_t.grad)), dtype, "eval d/dx", grad=True)
        if affine:
            _close(
                g_train[("net", "bn", "scale")].value,
                to_np(ref.weight.grad),
                dtype,
                "eval d/dscale",
                grad=True,
            )
        for name in ("running_mean", "running_var"):  # eval changes nothing
            np.testing.assert_array_equal(
                after[("net", "bn", name)].value, params[("net", "bn", name)].value
            )


# ---------------------------------------------------------------------------
# GroupNorm
# ---------------------------------------------------------------------------

GN_CASES = [
    # (torch shape NC..., num_groups, channels_first, dtype, affine)
    ((2, 6, 5, 4), 3, False, "float32", True),
    ((2, 6, 5, 4), 2, True, "float64", True),
    ((2, 6, 5, 4), 6, False, "float64", True),  # instance norm
    ((2, 6, 5, 4), 1, True, "float32", False),  # one group, no affine
    ((3, 4, 9), 2, False, "float64", True),  # 1-D
    ((2, 4, 3, 2, 3), 2, True, "float64", True),  # 3-D
]


@pytest.mark.parametrize("shape,groups,channels_first,dtype,affine", GN_CASES)
def test_groupnorm_matches_torch(shape, groups, channels_first, dtype, affine):
    """Output, d/dx, d/dscale, d/dbias against torch.nn.GroupNorm(eps=1e-5)."""
    torch.manual_seed(0)
    c = shape[1]
    ref = torch.nn.GroupNorm(groups, c, eps=1e-5, affine=affine, dtype=TORCH_DTYPES[dtype])
    rs = np.random.default_rng(2)
    if affine:
        with torch.no_grad():
            ref.weight.copy_(torch.tensor(rs.uniform(0.5, 1.5, c)))
            ref.bias.copy_(torch.tensor(rs.standard_normal(c)))
    x = (rs.standard_normal(shape) * 3.0 + 1.0).astype(dtype)
    r = rs.standard_normal(shape).astype(dtype)
    x_t = torch.tensor(x, requires_grad=True)
    y_t = ref(x_t)
    (y_t * torch.tensor(r)).sum().backward()
    layout = (lambda a: a) if channels_first else to_last

    with dtype_context(dtype):
        g = bx.Graph("net")
        gn = bx.GroupNorm(
            g / "gn",
            groups,
            use_scale=affine,
            use_bias=affine,
            channels_first=channels_first,
            param_dtype=dtype,
        )
        _, params = gn(bx.Params(), jnp.asarray(layout(x)))
        weights = {}
        if affine:
            weights = {
                ("net", "gn", "scale"): to_np(ref.weight),
                ("net", "gn", "bias"): to_np(ref.bias),
            }
        assert set(params.keys()) == set(weights)
        params = load_weights(params, weights, cast=True)

        def loss(params, x):
            y, _ = gn(params, x)
            return jnp.sum(y * jnp.asarray(layout(r)))

        y, _ = gn(params, jnp.asarray(layout(x)))
        _close(y, layout(to_np(y_t)), dtype, "GroupNorm output")
        g_p, g_x = jax.jit(jax.grad(loss, argnums=(0, 1)))(params, jnp.asarray(layout(x)))
        _close(g_x, layout(to_np(x_t.grad)), dtype, "GroupNorm d/dx", grad=True)
        if affine:
            _close(
                g_p[("net", "gn", "scale")].value,
                to_np(ref.weight.grad),
                dtype,
                "d/dscale",
                grad=True,
            )
            _close(
                g_p[("net", "gn", "bias")].value, to_np(ref.bias.grad), dtype, "d/dbias", grad=True
            )


# ---------------------------------------------------------------------------
# resize / upsample vs torch.nn.functional.interpolate
# ---------------------------------------------------------------------------

RESIZE_CASES = [
    # (torch shape NC..., blox kwargs, torch kwargs)
    ((2, 3, 4, 5), dict(scale_factor=2), dict(scale_factor=2, mode="nearest")),
    ((2, 3, 4, 5), dict(size=(7, 3)), dict(size=(7, 3), mode="nearest-exact")),
    (
        (2, 3, 4, 5),
        dict(size=(9, 11), method="bilinear"),
        dict(size=(9, 11), mode="bilinear", align_corners=False),
    ),
    (
        (2, 3, 4, 5),
        dict(scale_factor=2, method="bilinear"),
        dict(scale_factor=2, mode="bilinear", align_corners=False),
    ),
    (
        (2, 3, 9, 8),
        dict(size=(4, 3), method="bilinear"),
        dict(size=(4, 3), mode="bilinear", align_corners=False),
    ),
    (
        (2, 3, 9, 8),
        dict(size=(4, 3), method="bilinear", antialias=True),
        dict(size=(4, 3), mode="bilinear", align_corners=False, antialias=True),
    ),
    ((2, 3, 6), dict(size=13, method="linear"), dict(size=13, mode="linear", align_corners=False)),
    ((2, 3, 6), dict(scale_factor=3), dict(scale_factor=3, mode="nearest")),
    (
        (1, 2, 3, 4, 2),
        dict(size=(5, 6, 4), method="trilinear"),
        dict(size=(5, 6, 4), mode="trilinear", align_corners=False),
    ),
    ((1, 2, 3, 4, 2), dict(scale_factor=(2, 1, 3)), dict(scale_factor=(2, 1, 3), mode="nearest")),
]


@pytest.mark.parametrize("channels_first", [False, True], ids=["last", "first"])
@pytest.mark.parametrize("shape,kw,torch_kw", RESIZE_CASES)
def test_resize_matches_torch_interpolate(shape, kw, torch_kw, channels_first):
    """Output and d/dx against F.interpolate; half-pixel convention (align_corners=False,
    nearest-exact; plain 'nearest' for integer factors). float64 (tol 1e-10)."""
    dtype = "float64"
    rs = np.random.default_rng(3)
    x = rs.standard_normal(shape)
    x_t = torch.tensor(x, requires_grad=True)
    y_t = F.interpolate(x_t, **torch_kw)
    r = rs.standard_normal(tuple(y_t.shape))
    (y_t * torch.tensor(r)).sum().backward()
    layout = (lambda a: a) if channels_first else to_last
    with dtype_context(dtype):

        def f(x):
            return bx.resize(x, channels_first=channels_first, **kw)

        y = f(jnp.asarray(layout(x)))
        _close(y, layout(to_np(y_t)), dtype, "resize output")
        g_x = jax.grad(lambda x: jnp.sum(f(x) * jnp.asarray(layout(r))))(jnp.asarray(layout(x)))
        _close(g_x, layout(to_np(x_t.grad)), dtype, "resize d/dx")


def test_upsample_is_torch_nn_upsample_x2_nearest_float32():
    rs = np.random.default_rng(4)
    x = rs.standard_normal((2, 4, 3, 5)).astype("float32")
    y_t = torch.nn.Upsample(scale_factor=2, mode="nearest")(torch.tensor(x))
    _close(bx.upsample(jnp.asarray(to_last(x))), to_last(to_np(y_t)), "float32", "upsample")


# ---------------------------------------------------------------------------
# Activations
# ---------------------------------------------------------------------------

TORCH_ACTIVATIONS = {
    "identity": lambda x: x,
    "relu": F.relu,
    "relu6": F.relu6,
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "hardswish": F.hardswish,
    "hardsigmoid": F.hardsigmoid,
    "hardtanh": F.hardtanh,
    "mish": F.mish,
    "elu": F.elu,
    "selu": F.selu,
    "celu": F.celu,
    "softplus": F.softplus,
    "softsign": F.softsign,
    "logsigmoid": F.logsigmoid,
    "leaky_relu": F.leaky_relu,
    "hardshrink": F.hardshrink,
    "softshrink": F.softshrink,
    "tanhshrink": F.tanhshrink,
}


def test_every_activation_name_has_a_torch_reference():
    from blox.nn._activations import _TORCH_NAMES

    assert set(_TORCH_NAMES) == set(TORCH_ACTIVATIONS)


@pytest.mark.parametrize("name", sorted(TORCH_ACTIVATIONS))
def test_activation_matches_torch_functional(name):
    """get_activation(name) vs torch.nn.functional: values and gradients in float32 and
    float64 on points away from the kinks (|x| in [0.05, 6], not near +-0.5, +-1, +-3)."""
    rs = np.random.default_rng(5)
    x = rs.uniform(0.05, 6.0, 64) * rs.choice([-1.0, 1.0], 64)
    kinks = np.array([0.5, 1.0, 3.0])
    x = x[np.min(np.abs(np.abs(x)[:, None] - kinks[None]), axis=1) > 0.05]
    fn = bx.get_activation(name)
    for dtype in ("float32", "float64"):
        xd = x.astype(dtype)
        x_t = torch.tensor(xd, requires_grad=True)
        y_t = TORCH_ACTIVATIONS[name](x_t)
        y_t.sum().backward()
        with dtype_context(dtype):
            y = fn(jnp.asarray(xd))
            g = jax.grad(lambda v: jnp.sum(fn(v)))(jnp.asarray(xd))
            _close(y, to_np(y_t), dtype, f"{name} {dtype}")
            expected = to_np(x_t.grad)
            if name == "hardsigmoid" and dtype == "float64":
                # PyTorch's float64 hardsigmoid backward uses 1/6 rounded to float32
                # (0.1666666716...); the reference here is the closed form.
                expected = np.where(np.abs(xd) < 3.0, 1.0 / 6.0, 0.0)
            _close(g, expected, dtype, f"{name} {dtype} grad", grad=True)


def test_activation_names_ignore_case_and_underscores_and_errors_list_names():
    assert bx.get_activation("Hard_Swish") is bx.get_activation("hardswish")
    assert bx.get_activation("LeakyReLU") is bx.get_activation("leaky_relu")
    assert bx.get_activation(jnp.tanh) is jnp.tanh
    with pytest.raises(ValueError, match=r"unknown activation 'swishy'.*silu"):
        bx.get_activation("swishy")
    with pytest.raises(TypeError, match="expected a name or a callable"):
        bx.get_activation(3)


@pytest.mark.parametrize("channels_first", [False, True], ids=["last", "first"])
@pytest.mark.parametrize("num", [1, 4])
def test_prelu_matches_torch(num, channels_first):
    """PReLU (shared or per-channel slope) vs torch.nn.PReLU: output, d/dx, d/dslope."""
    dtype = "float64"
    rs = np.random.default_rng(6)
    ref = torch.nn.PReLU(num, dtype=torch.float64)
    with torch.no_grad():
        ref.weight.copy_(torch.tensor(rs.uniform(0.05, 0.5, num)))
    x = rs.standard_normal((2, 4, 3, 5))
    x_t = torch.tensor(x, requires_grad=True)
    r = rs.standard_normal(x.shape)
    (ref(x_t) * torch.tensor(r)).sum().backward()
    y_t = ref(torch.tensor(x))
    layout = (lambda a: a) if channels_first else to_last
    with dtype_context(dtype):
        act = bx.PReLU(
            bx.Graph("net") / "act", num, channels_first=channels_first, param_dtype=dtype
        )
        _, params = act(bx.Params(), jnp.asarray(layout(x)))
        params = load_weights(
            params, {("net", "act", "negative_slope"): to_np(ref.weight)}, cast=True
        )
        y, _ = act(params, jnp.asarray(layout(x)))
        _close(y, layout(to_np(y_t)), dtype, "PReLU output")

        def loss(p, x):
            return jnp.sum(act(p, x)[0] * jnp.asarray(layout(r)))

        g_p, g_x = jax.grad(loss, argnums=(0, 1))(params, jnp.asarray(layout(x)))
        _close(g_x, layout(to_np(x_t.grad)), dtype, "PReLU d/dx")
        _close(
            g_p[("net", "act", "negative_slope")].value,
            to_np(ref.weight.grad),
            dtype,
            "PReLU d/dslope",
        )


def test_prelu_rejects_a_channel_count_mismatch():
    act = bx.PReLU(bx.Graph("net") / "act", 3)
    with pytest.raises(ValueError, match=r"PReLU 'net/act'.*3 channels.*\(2, 5\)"):
        act(bx.Params(), jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="num_parameters must be a positive int"):
        bx.PReLU(bx.Graph("net") / "act", 0)
