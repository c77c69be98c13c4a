"""`Conv` and `ConvTranspose` against PyTorch on CPU, weights copied across.

Each case builds the blox layer, initializes it with a forward pass (so the parameter
layout is the layer's own), overwrites its parameters with PyTorch-layout weights
converted by the documented recipes (``Conv``: ``kernel = weight.permute(2, ..., 1, 0)``;
``ConvTranspose(transpose_kernel=True)``: the same permutation of PyTorch's
``(C_in, C_out // G, *k)`` weight; ``ConvTranspose`` in its default (jax-blox) mode:
``weight.reshape(G, C_in // G, C_out // G, *k).flip(spatial).permute(*spatial, 0, 2,
1).reshape(*k, C_out, C_in // G)``) and compares the output *and* the gradients of
``sum(y * cotangent)`` with respect to the input, the kernel (converted by the same
recipe, a permutation of the entries) and the bias, in both layouts (channels-last input
``x.moveaxis(1, -1)``, and ``channels_first=True``).

The reference pads explicitly with ``F.pad`` using the documented padding rules, written
out here independently of the library: ``'SAME'`` gives ``ceil(n / s)`` outputs with the odd
cell on the high side (``'SAME_LOWER'``: low side), ``'CAUSAL'`` pads ``K - 1`` on the low
side, ints pad both sides; for stride-1 ``'SAME'`` it uses PyTorch's own ``padding='same'``.
Input dilation is zero insertion in PyTorch. For ``ConvTranspose`` the reference is
PyTorch's full transposed convolution (``padding=0``) cropped or zero-extended to the
documented pads (``'SAME'``: output ``n * s``; ``'VALID'``: ``n * s + max(K - s, 0)``; see
the ``ConvTranspose`` docstring), or, for the porting recipe, PyTorch's own ``padding`` /
``output_padding`` arguments.

Tolerances: ``tests/tolerances.py`` (float32 ``rtol=1e-5, atol=1e-6``; float64
``rtol=1e-10, atol=1e-12``); float64 cases run inside ``jax.enable_x64(True)``.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import blox as bx
from tests.nn.torch_reference import TORCH_DTYPES, dtype_context, to_np
from tests.tolerances import tol

CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class Case:
    name: str
    kernel: tuple
    cin: int
    cout: int
    spatial: tuple
    strides: tuple
    padding: object
    dilation: tuple
    groups: int = 1
    use_bias: bool = True
    input_dilation: tuple | None = None
    output_padding: int = 0
    torch_padding: int | None = None  # ConvTranspose: use PyTorch's padding/output_padding

    @property
    def n(self) -> int:
        return len(self.kernel)


CONV_CASES = [
    Case("1d-same-dil2", (3,), 3, 4, (11,), (1,), "SAME", (2,)),
    Case("1d-valid-s2-g2-nobias", (4,), 4, 6, (13,), (2,), "VALID", (1,), 2, False),
    Case("1d-causal-s2-dil2", (3,), 2, 3, (10,), (2,), "CAUSAL", (2,)),
    Case("2d-same", (3, 3), 3, 5, (6, 7), (1, 1), "SAME", (1, 1)),
    Case("2d-valid-s21-dil12-g2", (3, 2), 4, 6, (9, 8), (2, 1), "VALID", (1, 2), 2),
    Case("2d-explicit-s2", (3, 3), 2, 3, (7, 6), (2, 2), ((1, 2), (0, 1)), (1, 1)),
    Case("2d-depthwise-same-s2", (3, 3), 4, 8, (8, 9), (2, 2), "SAME", (1, 1), 4),
    Case("2d-int-pad-input-dil2", (3, 3), 2, 3, (5, 4), (1, 1), 1, (1, 1), input_dilation=(2, 2)),
    Case("1d-same-s2-input-dil3", (3,), 2, 2, (5,), (2,), "SAME", (1,), input_dilation=(3,)),
    Case("2d-same-lower-s23", (2, 4), 3, 2, (7, 8), (2, 3), "SAME_LOWER", (1, 1)),
    Case("3d-same-s121", (2, 3, 2), 2, 3, (4, 5, 4), (1, 2, 1), "SAME", (1, 1, 1)),
    Case(
        "3d-valid-dil211-g2-nobias",
        (2, 2, 2),
        4,
        2,
        (5, 4, 3),
        (1, 1, 1),
        "VALID",
        (2, 1, 1),
        2,
        False,
    ),
]

TRANSPOSE_CASES = [
    Case("1d-same-s2", (3,), 3, 4, (5,), (2,), "SAME", (1,)),
    Case("1d-valid-s2-g2", (4,), 4, 6, (6,), (2,), "VALID", (1,), 2),
    Case("1d-causal-s2-dil2", (3,), 2, 3, (5,), (2,), "CAUSAL", (2,)),
    Case(
        "2d-torch-p1-op1",
        (3, 3),
        3,
        2,
        (4, 5),
        (2, 2),
        1,
        (1, 1),
        output_padding=1,
        torch_padding=1,
    ),
    Case("2d-valid-s21-dil21-g2", (3, 2), 4, 6, (4, 3), (2, 1), "VALID", (2, 1), 2),
    Case("2d-same-k4-s2-nobias", (4, 4), 2, 3, (3, 4), (2, 2), "SAME", (1, 1), 1, False),
    Case("2d-explicit-s3-g3", (3, 3), 3, 3, (3, 3), (3, 3), ((2, 0), (1, 3)), (1, 1), 3),
    Case("3d-valid-s2", (2, 2, 2), 2, 2, (2, 3, 2), (2, 2, 2), "VALID", (1, 1, 1)),
]


def _eff(k: int, d: int) -> int:
    return (k - 1) * d + 1


def _ref_conv_pads(case: Case, sizes) -> list[tuple[int, int]]:
    """The documented forward-conv padding, written out independently."""
    out = []
    for i, n in enumerate(sizes):
        K, s, p = _eff(case.kernel[i], case.dilation[i]), case.strides[i], case.padding
        if p == "VALID":
            out.append((0, 0))
        elif p in ("SAME", "SAME_LOWER"):
            total = max((-(-n // s) - 1) * s + K - n, 0)
            big = total - total // 2
            out.append((total - big, big) if p == "SAME" else (big, total - big))
        elif p == "CAUSAL":
            out.append((K - 1, 0))
        elif isinstance(p, int):
            out.append((p, p))
        else:
            out.append(tuple(p[i]))
    return out


def _ref_transpose_pads(case: Case) -> list[tuple[int, int]]:
    """The documented ConvTranspose pads of the stride-dilated input."""
    out = []
    for i in range(case.n):
        K, s, p = _eff(case.kernel[i], case.dilation[i]), case.strides[i], case.padding
        if p == "SAME":  # n * s outputs; lax's rule for where the extra cells go
            total = K + s - 2
            lo = K - 1 if s > K - 1 else -(-total // 2)
        elif p == "VALID":
            total, lo = K + s - 2 + max(K - s, 0), K - 1
        elif p == "CAUSAL":
            total, lo = K + s - 2, K - 1
        elif isinstance(p, int):
            total, lo = 2 * p, p
        else:
            total, lo = sum(p[i]), p[i][0]
        out.append((lo, total - lo + case.output_padding))
    return out


def _torch_pad_arg(pads) -> list[int]:
    """F.pad's argument: last axis first; negative values crop."""
    flat = []
    for lo, hi in reversed(pads):
        flat += [lo, hi]
    return flat


def _dilate_input(x: torch.Tensor, rates) -> torch.Tensor:
    if rates is None or all(r == 1 for r in rates):
        return x
    n = len(rates)
    shape = list(x.shape[:2]) + [(s - 1) * r + 1 for s, r in zip(x.shape[2:], rates, strict=True)]
    out = x.new_zeros(shape)
    out[(slice(None), slice(None)) + tuple(slice(None, None, r) for r in rates)] = x
    assert out.ndim == n + 2
    return out


def torch_conv(case: Case, x, w, b):
    x = _dilate_input(x, case.input_dilation)
    sizes = list(x.shape[2:])
    if case.padding == "SAME" and all(s == 1 for s in case.strides):
        return CONV[case.n](x, w, b, 1, "same", case.dilation, case.groups)
    x = F.pad(x, _torch_pad_arg(_ref_conv_pads(case, sizes)))
    return CONV[case.n](x, w, b, case.strides, 0, case.dilation, case.groups)


def torch_conv_transpose(case: Case, x, w, b):
    if case.torch_padding is not None:
        return CONV_T[case.n](
            x,
            w,
            b,
            case.strides,
            case.torch_padding,
            case.output_padding,
            case.groups,
            case.dilation,
        )
    full = CONV_T[case.n](x, w, None, case.strides, 0, 0, case.groups, case.dilation)
    # Full output index u = t + (K - 1 - low): crop K - 1 - low / K - 1 - high (negative:
    # zero-extend; those cells see no input).
    crops = []
    for i, (lo, hi) in enumerate(_ref_transpose_pads(case)):
        K = _eff(case.kernel[i], case.dilation[i])
        crops.append((lo - (K - 1), hi - (K - 1)))
    y = F.pad(full, _torch_pad_arg(crops))
    if b is not None:
        y = y + b.reshape((1, -1) + (1,) * case.n)
    return y


def torch_weight_to_kernel(w: torch.Tensor, transpose: bool, groups: int, tk: bool):
    """The docs' conversion of a PyTorch weight to the blox kernel, as a NumPy array."""
    n = w.ndim - 2
    spatial = tuple(range(2, 2 + n))
    if not transpose or tk:
        out = w.permute(*spatial, 1, 0)  # Conv; ConvTranspose(transpose_kernel=True)
    else:  # ConvTranspose, default (jax-blox) layout (*k, C_out, C_in // G), unflipped
        cin, cout_g, k = w.shape[0], w.shape[1], tuple(w.shape[2:])
        grouped = w.reshape(groups, cin // groups, cout_g, *k)
        s3 = tuple(range(3, 3 + n))
        out = grouped.flip(s3).permute(*s3, 0, 2, 1).reshape(*k, groups * cout_g, cin // groups)
    return to_np(out)


def _check(case: Case, transpose: bool, channels_first: bool, dtype: str, tk: bool = True) -> None:
    tdt = TORCH_DTYPES[dtype]
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    x = torch.randn((2, case.cin) + case.spatial, generator=gen, dtype=tdt)
    if transpose:
        w_shape = (case.cin, case.cout // case.groups) + case.kernel
    else:
        w_shape = (case.cout, case.cin // case.groups) + case.kernel
    w = torch.randn(w_shape, generator=gen, dtype=tdt) * 0.3
    b = torch.randn((case.cout,), generator=gen, dtype=tdt) if case.use_bias else None
    for t in (x, w, b):
        if t is not None:
            t.requires_grad_(True)
    ref = (torch_conv_transpose if transpose else torch_conv)(case, x, w, b)
    ct = torch.randn(ref.shape, generator=gen, dtype=tdt)
    (ref * ct).sum().backward()

    to_kernel = lambda t: torch_weight_to_kernel(t, transpose, case.groups, tk)  # noqa: E731
    move = (lambda a: a) if channels_first else (lambda a: np.moveaxis(a, 1, -1))
    with dtype_context(dtype):
        g = bx.Graph("net")
        rng = bx.Rng(g / "rng")
        kw = dict(
            strides=case.strides,
            padding=case.padding,
            kernel_dilation=case.dilation,
            feature_group_count=case.groups,
            use_bias=case.use_bias,
            channels_first=channels_first,
            param_dtype=jnp.dtype(dtype),
        )
        if transpose:
            pad = case.padding
            if case.torch_padding is not None:  # the porting recipe of the docstring
                pad = tuple(
                    _eff(k, d) - 1 - case.torch_padding
                    for k, d in zip(case.kernel, case.dilation, strict=True)
                )
            kw.update(padding=pad, output_padding=case.output_padding, transpose_kernel=tk)
            layer = bx.ConvTranspose(g / "conv", case.kernel, case.cout, rng, **kw)
        else:
            layer = bx.Conv(
                g / "conv",
                case.kernel,
                case.cout,
                rng,
                input_dilation=case.input_dilation or 1,
                **kw,
            )
        xb = jnp.asarray(move(to_np(x)))
        # The layer's own parameter layout, from an abstract init (no compilation), filled
        # with the PyTorch weights.
        seeded = rng.seed(bx.Params(), seed=0)
        _, abstract = jax.eval_shape(layer, seeded, xb)
        kernel_path, bias_path = ("net", "conv", "kernel"), ("net", "conv", "bias")
        weights = {kernel_path: to_kernel(w)}
        if case.use_bias:
            weights[bias_path] = to_np(b)
        new_paths = set(abstract.keys()) - set(seeded.keys())
        assert new_paths == set(weights), sorted(new_paths)
        params = seeded.unlocked()
        for path, value in weights.items():
            assert abstract[path].value.shape == value.shape, (path, value.shape)
            assert abstract[path].value.dtype == value.dtype, (path, value.dtype)
            params[path] = bx.Param(jnp.asarray(value))
        params = params.locked()

        ctb = jnp.asarray(move(to_np(ct)))
        train, rest = params.split()

        def loss(train, x):
            out, _ = layer(train.merge(rest), x)
            return jnp.sum(out * ctb), out

        grad_fn = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        (_, y), (g_params, g_x) = jax.jit(grad_fn)(train, xb)
        expected = move(to_np(ref))
        assert y.dtype == jnp.dtype(dtype)
        assert y.shape == expected.shape, (y.shape, expected.shape)
        np.testing.assert_allclose(np.asarray(y), expected, **tol(dtype), err_msg="forward")
        np.testing.assert_allclose(
            np.asarray(g_x), move(to_np(x.grad)), **tol(dtype), err_msg="d/dx"
        )
        np.testing.assert_allclose(
            np.asarray(g_params[kernel_path].value),
            to_kernel(w.grad),
            **tol(dtype),
            err_msg="d/dkernel",
        )
        if case.use_bias:
            np.testing.assert_allclose(
                np.asarray(g_params[bias_path].value),
                to_np(b.grad),
                **tol(dtype),
                err_msg="d/dbias",
            )


F64_CONV = {"1d-causal-s2-dil2", "2d-depthwise-same-s2", "2d-int-pad-input-dil2", "3d-same-s121"}
F64_TRANSPOSE = {"2d-torch-p1-op1", "2d-valid-s21-dil21-g2", "2d-explicit-s3-g3"}
LAYOUTS = [False, True]
LAYOUT_IDS = ["NHWC", "NCHW"]


@pytest.mark.parametrize("channels_first", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("case", CONV_CASES, ids=lambda c: c.name)
def test_conv_matches_torch_float32(case, channels_first):
    _check(case, transpose=False, channels_first=channels_first, dtype="float32")


# ConvTranspose in both kernel modes: transpose_kernel=True with ``weight.permute`` (both
# layouts), and the default (jax-blox) mode with the flip-and-regroup recipe (channels-last;
# the layout does not touch the kernel, see test_conv.py's channels_first test).
TK_MODES = [(True, False), (True, True), (False, False)]
TK_IDS = ["torch-layout-NHWC", "torch-layout-NCHW", "jax-blox-layout-NHWC"]


@pytest.mark.parametrize("tk, channels_first", TK_MODES, ids=TK_IDS)
@pytest.mark.parametrize("case", TRANSPOSE_CASES, ids=lambda c: c.name)
def test_conv_transpose_matches_torch_float32(case, tk, channels_first):
    _check(case, transpose=True, channels_first=channels_first, dtype="float32", tk=tk)


@pytest.mark.parametrize(
    "case",
    [c for c in CONV_CASES if c.name in F64_CONV],
    ids=lambda c: c.name,
)
def test_conv_matches_torch_float64(case):
    _check(case, transpose=False, channels_first=False, dtype="float64")


@pytest.mark.parametrize(
    "case",
    [c for c in TRANSPOSE_CASES if c.name in F64_TRANSPOSE],
    ids=lambda c: c.name,
)
def test_conv_transpose_matches_torch_float64(case):
    _check(case, transpose=True, channels_first=True, dtype="float64", tk=True)


def test_grouped_conv_transpose_jax_blox_layout_matches_torch_float64():
    case = next(c for c in TRANSPOSE_CASES if c.name == "2d-explicit-s3-g3")
    _check(case, transpose=True, channels_first=True, dtype="float64", tk=False)
