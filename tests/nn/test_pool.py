"""Pooling against PyTorch on CPU (forward and input gradients, both layouts), shapes and
errors.

References: ``F.max_pool{1,2,3}d`` / ``F.avg_pool{1,2,3}d`` (with their own symmetric
``padding`` and ``count_include_pad``); asymmetric pads (``'SAME'``, ``(low, high)`` pairs)
are applied with ``F.pad`` (``-inf`` for max pooling, zeros for average pooling) followed
by an unpadded PyTorch pool; average pooling that excludes padding divides PyTorch's window
sums of the zero-padded input by its window sums of a zero-padded mask of ones. ``'SAME'``
pads are written out here from the documented rule (output ``ceil(n / s)``, odd cell high;
``'SAME_LOWER'``: low). Tolerances: ``tests/tolerances.py``. Half-precision average
pooling is held to PyTorch's own bf16/fp16 error (both measured against float64 on the
same half-precision values), not to a fixed tolerance.
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

MAX = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
AVG = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}


@dataclass(frozen=True)
class PoolCase:
    name: str
    kind: str  # "max", "min", "avg"
    window: tuple
    spatial: tuple
    strides: tuple | None = None
    padding: object = "VALID"
    count_include_pad: bool = False

    @property
    def n(self) -> int:
        return len(self.window)


CASES = [
    PoolCase("max-2d-2x2", "max", (2, 2), (8, 8)),
    PoolCase("max-2d-3x3-s2-p1", "max", (3, 3), (7, 9), (2, 2), 1),
    PoolCase("max-1d-same", "max", (3,), (10,), (1,), "SAME"),
    PoolCase("max-3d-s122", "max", (2, 2, 2), (4, 6, 5), (1, 2, 2)),
    PoolCase("max-2d-pairs", "max", (3, 2), (7, 6), (2, 1), ((1, 0), (1, 1))),
    PoolCase("max-2d-same-lower-s2", "max", (2, 2), (7, 7), (2, 2), "SAME_LOWER"),
    PoolCase("min-2d-3x3-s2-p1", "min", (3, 3), (7, 8), (2, 2), 1),
    PoolCase("avg-2d-3x3-s2-p1-incl", "avg", (3, 3), (7, 9), (2, 2), 1, True),
    PoolCase("avg-2d-3x3-s2-p1-excl", "avg", (3, 3), (7, 9), (2, 2), 1, False),
    PoolCase("avg-1d-same-excl", "avg", (4,), (11,), (2,), "SAME", False),
    PoolCase("avg-3d-2x2x2", "avg", (2, 2, 2), (4, 6, 4)),
    PoolCase("avg-2d-pairs-incl", "avg", (2, 3), (6, 7), (1, 2), ((0, 1), (1, 1)), True),
    PoolCase("avg-2d-same-excl", "avg", (3, 3), (5, 6), (2, 2), "SAME", False),
]


def _pads(case: PoolCase) -> list[tuple[int, int]]:
    strides = case.strides or case.window
    out = []
    for i, n in enumerate(case.spatial):
        w, s, p = case.window[i], strides[i], case.padding
        if p == "VALID":
            out.append((0, 0))
        elif p in ("SAME", "SAME_LOWER"):
            total = max((-(-n // s) - 1) * s + w - n, 0)
            big = total - total // 2
            out.append((total - big, big) if p == "SAME" else (big, total - big))
        elif isinstance(p, int):
            out.append((p, p))
        else:
            out.append(tuple(p[i]))
    return out


def _pad_arg(pads) -> list[int]:
    flat = []
    for lo, hi in reversed(pads):
        flat += [lo, hi]
    return flat


def torch_pool(case: PoolCase, x: torch.Tensor) -> torch.Tensor:
    strides = case.strides or case.window
    pads = _pads(case)
    symmetric = all(lo == hi and 2 * lo <= w for (lo, hi), w in zip(pads, case.window, strict=True))
    if case.kind in ("max", "min"):
        sign = -1.0 if case.kind == "min" else 1.0
        if symmetric:
            return sign * MAX[case.n](sign * x, case.window, strides, [p[0] for p in pads])
        xp = F.pad(sign * x, _pad_arg(pads), value=-float("inf"))
        return sign * MAX[case.n](xp, case.window, strides)
    if symmetric:
        return AVG[case.n](
            x,
            case.window,
            strides,
            [p[0] for p in pads],
            count_include_pad=case.count_include_pad,
        )
    xp = F.pad(x, _pad_arg(pads))
    if case.count_include_pad:
        return AVG[case.n](xp, case.window, strides)
    mask = F.pad(torch.ones_like(x), _pad_arg(pads))
    one = dict(divisor_override=1) if case.n > 1 else {}
    sums = AVG[case.n](xp, case.window, strides, **one)
    counts = AVG[case.n](mask, case.window, strides, **one)
    if case.n == 1:  # avg_pool1d has no divisor_override: undo the mean
        size = float(np.prod(case.window))
        sums, counts = sums * size, counts * size
    return sums / counts


def blox_pool(case: PoolCase, x, channels_first: bool):
    kw = dict(channels_first=channels_first)
    if case.kind == "avg":
        kw["count_include_pad"] = case.count_include_pad
    fn = {"max": bx.max_pool, "min": bx.min_pool, "avg": bx.avg_pool}[case.kind]
    return fn(x, case.window, case.strides, case.padding, **kw)


def _check(case: PoolCase, channels_first: bool, dtype: str) -> None:
    tdt = TORCH_DTYPES[dtype]
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    x = torch.randn((2, 3) + case.spatial, generator=gen, dtype=tdt, requires_grad=True)
    ref = torch_pool(case, x)
    ct = torch.randn(ref.shape, generator=gen, dtype=tdt)
    (ref * ct).sum().backward()
    move = (lambda a: a) if channels_first else (lambda a: np.moveaxis(a, 1, -1))
    with dtype_context(dtype):
        xb = jnp.asarray(move(to_np(x)))
        ctb = jnp.asarray(move(ct.numpy()))
        y = blox_pool(case, xb, channels_first)
        expected = move(to_np(ref))
        assert y.dtype == jnp.dtype(dtype) and y.shape == expected.shape, (y.shape, expected.shape)
        np.testing.assert_allclose(np.asarray(y), expected, **tol(dtype), err_msg="forward")
        grad = jax.jit(jax.grad(lambda x: jnp.sum(blox_pool(case, x, channels_first) * ctb)))(xb)
        np.testing.assert_allclose(
            np.asarray(grad), move(to_np(x.grad)), **tol(dtype), err_msg="d/dx"
        )


@pytest.mark.parametrize("channels_first", [False, True], ids=["NHWC", "NCHW"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_pool_matches_torch(case, channels_first):
    _check(case, channels_first, "float32")


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.name in {"max-2d-3x3-s2-p1", "avg-1d-same-excl", "avg-2d-same-excl"}],
    ids=lambda c: c.name,
)
def test_pool_matches_torch_float64(case):
    _check(case, False, "float64")


@pytest.mark.parametrize("channels_first", [False, True], ids=["NHWC", "NCHW"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_global_pools_match_torch(n, channels_first):
    gen = torch.Generator().manual_seed(n)
    spatial = (5, 4, 3)[:n]
    x = torch.randn((2, 3) + spatial, generator=gen, requires_grad=True)
    adaptive_avg = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}
    adaptive_max = {1: F.adaptive_max_pool1d, 2: F.adaptive_max_pool2d, 3: F.adaptive_max_pool3d}
    move = (lambda a: a) if channels_first else (lambda a: np.moveaxis(a, 1, -1))
    xb = jnp.asarray(move(to_np(x)))
    for fn, ref_fn in [(bx.global_avg_pool, adaptive_avg), (bx.global_max_pool, adaptive_max)]:
        x.grad = None
        ref = ref_fn[n](x, 1)
        ct = torch.randn(ref.shape, generator=gen)
        (ref * ct).sum().backward()
        y = fn(xb, n, channels_first=channels_first)
        np.testing.assert_allclose(np.asarray(y), to_np(ref).reshape(2, 3), **tol("float32"))
        kept = fn(xb, n, channels_first=channels_first, keepdims=True)
        assert kept.shape == move(to_np(ref)).shape
        ctb = jnp.asarray(ct.numpy().reshape(2, 3))

        def loss(x, fn=fn, ctb=ctb):
            return jnp.sum(fn(x, n, channels_first=channels_first) * ctb)

        grad = jax.grad(loss)(xb)
        np.testing.assert_allclose(np.asarray(grad), move(to_np(x.grad)), **tol("float32"))


# ----------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("batch", [(), (2,), (2, 3)], ids=["unbatched", "B", "B1xB2"])
def test_any_number_of_batch_axes(batch):
    x = jax.random.normal(jax.random.key(0), batch + (6, 5, 4))
    flat = x.reshape((-1, 6, 5, 4))
    for fn, kw in [(bx.max_pool, {}), (bx.avg_pool, {}), (bx.avg_pool, {"padding": "SAME"})]:
        y = fn(x, (2, 2), (2, 1), **kw)
        ref = fn(flat, (2, 2), (2, 1), **kw)
        assert y.shape == batch + ref.shape[1:]
        np.testing.assert_array_equal(np.asarray(y).reshape(ref.shape), np.asarray(ref))


def test_channels_first_gives_the_same_numbers():
    x = jax.random.normal(jax.random.key(1), (2, 7, 6, 3))
    xt = jnp.moveaxis(x, -1, 1)
    for fn in (bx.max_pool, bx.min_pool, bx.avg_pool):
        y = fn(x, (3, 2), 2, "SAME")
        yt = fn(xt, (3, 2), 2, "SAME", channels_first=True)
        np.testing.assert_array_equal(np.asarray(jnp.moveaxis(yt, 1, -1)), np.asarray(y))


def test_int_window_is_1d_and_strides_default_to_the_window():
    x = jnp.arange(12.0).reshape(1, 6, 2)
    y = bx.max_pool(x, 3)
    np.testing.assert_array_equal(np.asarray(y), [[[4.0, 5.0], [10.0, 11.0]]])


def test_dtypes_are_kept():
    x = jnp.arange(16, dtype=jnp.int32).reshape(1, 4, 4, 1)
    assert bx.max_pool(x, (2, 2), padding="SAME").dtype == jnp.int32
    assert int(bx.min_pool(x, (2, 2), 1, padding=1)[0, 0, 0, 0]) == 0
    xb = x.astype(jnp.bfloat16)
    assert bx.avg_pool(xb, (2, 2)).dtype == jnp.bfloat16


HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _errors(actual, exact) -> tuple[float, float]:
    err = np.abs(np.asarray(actual, np.float64) - exact)
    return float(err.mean()), float(err.max())


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "padding, count_include_pad", [(0, True), (1, False), (1, True)], ids=["valid", "excl", "incl"]
)
def test_avg_pool_half_precision_error_is_no_worse_than_torch(dtype, padding, count_include_pad):
    """3x3 windows, stride 1, on half-precision inputs: the forward and d/dx errors
    against float64 (PyTorch in float64 on the same half values) are no larger than
    PyTorch's own half-precision errors. blox sums in float32 and rounds once; summing
    in bf16 gave 2-4x PyTorch's forward error."""
    rs = np.random.default_rng(0)
    x = torch.tensor(rs.standard_normal((2, 4, 12, 12)) * 2.0 + 1.0).to(HALF[dtype])
    out = 12 - 2 + 2 * padding
    ct = torch.tensor(rs.standard_normal((2, 4, out, out))).to(HALF[dtype])
    kw = dict(count_include_pad=count_include_pad)

    x64 = x.double().requires_grad_(True)
    exact = F.avg_pool2d(x64, 3, 1, padding, **kw)
    (exact * ct.double()).sum().backward()
    x_half = x.clone().requires_grad_(True)
    y_torch = F.avg_pool2d(x_half, 3, 1, padding, **kw)
    (y_torch * ct).sum().backward()

    def pool(v):
        return bx.avg_pool(v, (3, 3), 1, padding, channels_first=True, **kw)

    xb = jnp.asarray(x.double().numpy(), dtype)
    y = pool(xb)
    grad = jax.grad(lambda v: jnp.sum(pool(v) * jnp.asarray(ct.double().numpy(), dtype)))(xb)
    assert y.dtype == grad.dtype == jnp.dtype(dtype)
    for what, mine, theirs, ref in [
        ("forward", y, y_torch, exact),
        ("d/dx", grad, x_half.grad, x64.grad),
    ]:
        ref = to_np(ref)
        (mean_b, max_b), (mean_t, max_t) = (
            _errors(mine, ref),
            _errors(theirs.detach().double(), ref),
        )
        assert mean_b <= 1.05 * mean_t, (what, mean_b, mean_t)
        assert max_b <= 1.05 * max_t, (what, max_b, max_t)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_global_avg_pool_half_precision_error_is_no_worse_than_torch(dtype):
    rs = np.random.default_rng(1)
    x = torch.tensor(rs.standard_normal((2, 4, 12, 12)) * 2.0 + 1.0).to(HALF[dtype])
    exact = x.double().mean((2, 3)).numpy()
    y = bx.global_avg_pool(jnp.asarray(x.double().numpy(), dtype), channels_first=True)
    assert y.dtype == jnp.dtype(dtype)
    (mean_b, max_b), (mean_t, max_t) = (
        _errors(y, exact),
        _errors(F.adaptive_avg_pool2d(x, 1).double().numpy().reshape(2, 4), exact),
    )
    assert mean_b <= 1.05 * mean_t and max_b <= 1.05 * max_t, (mean_b, mean_t, max_b, max_t)


def test_avg_pool_float16_window_sums_do_not_overflow():
    """Nine float16 values near 20000 sum to ~180000 > 65504 (float16's max): the sum
    must not be taken in float16. Reference: NumPy float64 means, tol(float16)."""
    x = (20000.0 + 100.0 * np.random.default_rng(2).standard_normal((1, 6, 6, 2))).astype(
        np.float16
    )
    x64 = x.astype(np.float64)
    windows = np.lib.stride_tricks.sliding_window_view(x64, (3, 3), axis=(1, 2))
    expected = windows.mean(axis=(-2, -1))  # (1, 4, 4, 2)
    y = bx.avg_pool(jnp.asarray(x), (3, 3), 1)
    assert y.dtype == jnp.float16 and np.isfinite(np.asarray(y, np.float64)).all()
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, **tol("float16"))
    g = bx.global_avg_pool(jnp.asarray(x))
    np.testing.assert_allclose(np.asarray(g, np.float64), x64.mean((1, 2)), **tol("float16"))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda x: bx.max_pool(x, (2, 2), padding="FULL"), r"max_pool: unknown padding 'FULL'"),
        (lambda x: bx.max_pool(x, 2, padding="CAUSAL"), r"unknown padding 'CAUSAL'"),
        (lambda x: bx.avg_pool(x, (2, 2), padding=((1, 1),)), r"1 entries for 2 spatial"),
        (lambda x: bx.avg_pool(x, (2, 2), padding=-1), r"must be >= 0"),
        (lambda x: bx.max_pool(x, (2, 2), padding=((1, 2, 3), (0, 0))), r"not a \(low, high\)"),
        (lambda x: bx.max_pool(x, (2, 2), strides=(1, 1, 1)), r"strides has 3 entries"),
        (lambda x: bx.max_pool(x, (0, 2)), r"window_shape must be positive"),
        (lambda x: bx.max_pool(x, ()), r"window_shape must not be empty"),
        (lambda x: bx.max_pool(x, (9, 2)), r"axis 0 of the input has size 5 .*\(2, 5, 4, 3\)"),
        (lambda x: bx.max_pool(x, (2, 2), padding=2), r"not smaller than the window size 2"),
        (lambda x: bx.max_pool(x[0, :, :, 0], (2, 2)), r"at least 3 axes, got shape \(5, 4\)"),
        (lambda x: bx.avg_pool(x.astype(jnp.int32), 2), r"avg_pool: .*dtype int32.*astype"),
        (lambda x: bx.global_avg_pool(x, 4), r"num_spatial_dims=4 .*\(2, 5, 4, 3\)"),
        (lambda x: bx.global_max_pool(x, 0), r"num_spatial_dims must be a positive int"),
    ],
)
def test_errors_name_the_function_shapes_and_fix(call, match):
    x = jnp.ones((2, 5, 4, 3))
    with pytest.raises((ValueError, TypeError), match=match):
        call(x)
