"""Pooling: `max_pool`, `min_pool`, `avg_pool`, `global_avg_pool`, `global_max_pool`.

Plain functions (pooling has no parameters), N-D from the window's length, channels-last
by default with any number of leading batch axes, channels-first with
``channels_first=True``. Padding specs are those of `Conv` (without ``'CAUSAL'``); the
padding arithmetic is shared with the convolutions (``_padding.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from blox.nn._padding import PaddingLike, int_tuple, layout, normalize_padding, resolve_pads

__all__ = ["avg_pool", "global_avg_pool", "global_max_pool", "max_pool", "min_pool"]

_POOL_PADDING = ("SAME", "SAME_LOWER", "VALID")


def _window(window_shape: Any, where: str) -> tuple[int, ...]:
    if isinstance(window_shape, int) and not isinstance(window_shape, bool):
        window_shape = (window_shape,)
    try:
        window = tuple(window_shape)
    except TypeError:
        raise TypeError(
            f"{where}: window_shape must be an int (1-D) or a tuple of ints, e.g. (2, 2) for "
            f"2-D, got {window_shape!r}."
        ) from None
    if not window:
        raise ValueError(f"{where}: window_shape must not be empty; e.g. (2, 2) for 2-D.")
    return int_tuple(window, len(window), "window_shape", where, "")


def _plan(
    where: str,
    x: jax.Array,
    window_shape: Any,
    strides: Any,
    padding: Any,
    channels_first: bool,
) -> tuple[tuple[int, ...], tuple[int, ...], list[tuple[int, int]], list[int], tuple[int, ...]]:
    """Checks the arguments; returns full-rank window, strides and pads, the spatial axes
    and the spatial shape."""
    window = _window(window_shape, where)
    n = len(window)
    fix = f"Give one value per spatial axis (window_shape={window}) or a single int."
    strides = window if strides is None else int_tuple(strides, n, "strides", where, fix)
    spec = normalize_padding(padding, n, where, _POOL_PADDING)
    if x.ndim < n + 1:
        raise ValueError(
            f"{where}: a {n}-D window {window} needs inputs of shape "
            f"{layout(n, channels_first)} with at least {n + 1} axes, got shape "
            f"{tuple(x.shape)}. Add the channel axis (e.g. x[..., None]) or use a window with "
            "one entry per spatial axis."
        )
    first = x.ndim - n - (0 if channels_first else 1)
    axes = list(range(first, first + n))
    spatial = tuple(x.shape[a] for a in axes)
    pads = resolve_pads(spec, spatial, window, strides)
    for i, (size, w, (lo, hi)) in enumerate(zip(spatial, window, pads, strict=True)):
        if size + lo + hi < w:
            raise ValueError(
                f"{where}: spatial axis {i} of the input has size {size} (input shape "
                f"{tuple(x.shape)}, padding ({lo}, {hi})), smaller than the window {window}, "
                "so the output would be empty. Use padding='SAME', a smaller window, or a "
                "larger input."
            )
        if lo >= w or hi >= w:
            raise ValueError(
                f"{where}: padding ({lo}, {hi}) on spatial axis {i} is not smaller than the "
                f"window size {w}, so some windows would hold padding only. Use at most "
                f"{w - 1} per side."
            )
    full_window = [1] * x.ndim
    full_strides = [1] * x.ndim
    full_pads = [(0, 0)] * x.ndim
    for a, w, s, p in zip(axes, window, strides, pads, strict=True):
        full_window[a], full_strides[a], full_pads[a] = w, s, p
    return tuple(full_window), tuple(full_strides), full_pads, axes, spatial


def _reduce(
    where: str,
    x: jax.Array,
    init: Callable[[Any], Any],
    op: Callable,
    window_shape: Any,
    strides: Any,
    padding: Any,
    channels_first: bool,
) -> jax.Array:
    x = jnp.asarray(x)
    window, strides, pads, _, _ = _plan(where, x, window_shape, strides, padding, channels_first)
    return lax.reduce_window(x, init(x.dtype), op, window, strides, pads)


# Concrete NumPy identities, so that lax recognises the max / min / sum monoids (their
# reduce_window primitives have gradients; a generic reduce_window has none).
def _lowest(dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(-np.inf, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return np.array(np.iinfo(dtype).min, dtype)
    return np.array(False, dtype)


def _highest(dtype: Any) -> Any:
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        return np.array(np.inf, dtype)
    if jnp.issubdtype(dtype, jnp.integer):
        return np.array(np.iinfo(dtype).max, dtype)
    return np.array(True, dtype)


def max_pool(
    x: jax.Array,
    window_shape: int | Sequence[int],
    strides: int | Sequence[int] | None = None,
    padding: PaddingLike = "VALID",
    *,
    channels_first: bool = False,
) -> jax.Array:
    """Max pooling over windows of the spatial axes (padding never wins: it is ``-inf``).

    Shapes: ``(*B, *spatial, C)`` -> ``(*B, *spatial', C)`` (any number of batch axes B;
    N spatial axes, ``N = len(window_shape)``); with ``channels_first=True``
    ``(*B, C, *spatial)`` -> ``(*B, C, *spatial')``. Per spatial axis of size ``n`` the
    output size is ``floor((n + low + high - w) / stride) + 1``.

    Args:
      x: the input, any real dtype (kept).
      window_shape: an int (1-D) or one int per spatial axis.
      strides: an int or one per spatial axis; default: the window (non-overlapping).
      padding: ``'VALID'`` (default), ``'SAME'`` (output ``ceil(n / stride)``),
        ``'SAME_LOWER'``, an int (both sides, PyTorch's ``padding``), one int per axis,
        or ``(low, high)`` pairs; each side must be smaller than the window.
      channels_first: NCHW-style input.

    Returns:
      The pooled array, same dtype as `x`.

    >>> import blox as bx, jax.numpy as jnp
    >>> x = jnp.arange(16.0).reshape(1, 4, 4, 1)
    >>> bx.max_pool(x, (2, 2))[0, ..., 0]
    Array([[ 5.,  7.],
           [13., 15.]], dtype=float32)
    """
    return _reduce("max_pool", x, _lowest, lax.max, window_shape, strides, padding, channels_first)


def min_pool(
    x: jax.Array,
    window_shape: int | Sequence[int],
    strides: int | Sequence[int] | None = None,
    padding: PaddingLike = "VALID",
    *,
    channels_first: bool = False,
) -> jax.Array:
    """Min pooling; as `max_pool` with the minimum (padding is ``+inf``).

    Shapes: as `max_pool`: ``(*B, *spatial, C)`` -> ``(*B, *spatial', C)``
    (``channels_first=True``: ``(*B, C, *spatial)`` -> ``(*B, C, *spatial')``).

    >>> import blox as bx, jax.numpy as jnp
    >>> bx.min_pool(jnp.arange(4.0).reshape(4, 1), 2)[:, 0]
    Array([0., 2.], dtype=float32)
    """
    return _reduce("min_pool", x, _highest, lax.min, window_shape, strides, padding, channels_first)


def _counts(size: int, window: int, stride: int, lo: int, out: int) -> np.ndarray:
    """How many real (unpadded) input cells each output window covers, along one axis."""
    start = np.arange(out) * stride - lo
    return (np.minimum(start + window, size) - np.maximum(start, 0)).astype(np.float64)


def _accumulation_dtype(dtype: Any) -> np.dtype:
    """float32 for the half-precision floats (a bf16 sum of 9 values is off by ~3 ulp),
    else the dtype itself (float32, float64, complex)."""
    dtype = np.dtype(dtype)
    if dtype in (np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
        return np.dtype(np.float32)
    return dtype


def avg_pool(
    x: jax.Array,
    window_shape: int | Sequence[int],
    strides: int | Sequence[int] | None = None,
    padding: PaddingLike = "VALID",
    *,
    count_include_pad: bool = False,
    channels_first: bool = False,
) -> jax.Array:
    """Average pooling over windows of the spatial axes.

    Shapes: as `max_pool`: ``(*B, *spatial, C)`` -> ``(*B, *spatial', C)``
    (``channels_first=True``: ``(*B, C, *spatial)`` -> ``(*B, C, *spatial')``).

    Arguments as `max_pool`; padded cells are zeros. With
    ``count_include_pad=False`` (the default) each window's sum is divided
    by the number of *real* input cells it covers; with ``True`` by the full window size
    (PyTorch's default ``count_include_pad=True``). Without padding both are the same.

    Args:
      x: a floating-point input (cast integers first).
      window_shape: an int (1-D) or one int per spatial axis.
      strides: default: the window.
      padding: as `max_pool`.
      count_include_pad: divide by the full window size, padding included.
      channels_first: NCHW-style input.

    Returns:
      The pooled array, same dtype as `x`.

    Dtype policy: for bf16/f16 inputs the window sums and the division are computed in
    float32 and the mean is rounded to the input dtype once (as PyTorch does); other
    dtypes are computed in their own dtype.

    >>> import blox as bx, jax.numpy as jnp
    >>> x = jnp.ones((1, 3, 3, 1))
    >>> bx.avg_pool(x, (3, 3), 1, padding=1)[0, 0, :, 0]
    Array([1., 1., 1.], dtype=float32)
    >>> bx.avg_pool(x, (3, 3), 1, padding=1, count_include_pad=True)[0, 0, :, 0]
    Array([0.44444445, 0.6666667 , 0.44444445], dtype=float32)
    """
    where = "avg_pool"
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise TypeError(
            f"{where}: the input has dtype {x.dtype}; average pooling needs a floating-point "
            "input. Cast it first, e.g. avg_pool(x.astype(jnp.float32), ...)."
        )
    window, strides_, pads, axes, spatial = _plan(
        where, x, window_shape, strides, padding, channels_first
    )
    acc = _accumulation_dtype(x.dtype)
    xs = x.astype(acc)
    summed = lax.reduce_window(xs, np.array(0, acc), lax.add, window, strides_, pads)
    padded = any(pads[a] != (0, 0) for a in axes)
    if count_include_pad or not padded:
        mean = summed / jnp.array(np.prod([window[a] for a in axes]), acc)
        return mean.astype(x.dtype)
    counts = np.ones((), np.float64)
    for a, size in zip(axes, spatial, strict=True):
        c = _counts(size, window[a], strides_[a], pads[a][0], summed.shape[a])
        counts = np.multiply.outer(counts, c)
    if not channels_first:
        counts = counts[..., None]  # the channel axis
    mean = summed / jnp.broadcast_to(jnp.asarray(counts, acc), summed.shape)
    return mean.astype(x.dtype)


def _spatial_axes(where: str, x: jax.Array, num_spatial_dims: int, channels_first: bool):
    n = num_spatial_dims
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{where}: num_spatial_dims must be a positive int, got {n!r}.")
    if x.ndim < n + 1:
        raise ValueError(
            f"{where}: num_spatial_dims={n} needs inputs of shape {layout(n, channels_first)} "
            f"with at least {n + 1} axes, got shape {tuple(x.shape)}. Pass the number of "
            "spatial axes (e.g. num_spatial_dims=1 for (B, T, C)) or add the channel axis."
        )
    first = x.ndim - n - (0 if channels_first else 1)
    return tuple(range(first, first + n))


def global_avg_pool(
    x: jax.Array,
    num_spatial_dims: int = 2,
    *,
    channels_first: bool = False,
    keepdims: bool = False,
) -> jax.Array:
    """The mean over all spatial positions (PyTorch's ``AdaptiveAvgPool(1)`` + flatten).

    Shapes: ``(*B, *spatial, C)`` -> ``(*B, C)`` (``keepdims=True``: spatial axes kept
    with size 1); ``channels_first=True``: ``(*B, C, *spatial)`` -> ``(*B, C)``.

    Args:
      x: the input; N = `num_spatial_dims` spatial axes (default 2: images).
      num_spatial_dims: how many axes before (or, channels-first, after) the channel
        axis are spatial.
      channels_first: NCHW-style input.
      keepdims: keep the spatial axes with size 1.

    Returns:
      The mean, same dtype as a floating `x` (integer inputs give a float mean, as
      ``jnp.mean``).

    Dtype policy: bf16/f16 inputs are summed and divided in float32 and rounded to the
    input dtype once; other dtypes in their own dtype.

    >>> import blox as bx, jax.numpy as jnp
    >>> bx.global_avg_pool(jnp.ones((8, 7, 7, 32))).shape
    (8, 32)
    """
    x = jnp.asarray(x)
    axes = _spatial_axes("global_avg_pool", x, num_spatial_dims, channels_first)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.mean(x, axis=axes, keepdims=keepdims)  # integers: a float mean
    acc = _accumulation_dtype(x.dtype)
    return jnp.mean(x.astype(acc), axis=axes, keepdims=keepdims).astype(x.dtype)


def global_max_pool(
    x: jax.Array,
    num_spatial_dims: int = 2,
    *,
    channels_first: bool = False,
    keepdims: bool = False,
) -> jax.Array:
    """The maximum over all spatial positions; arguments as `global_avg_pool`.

    Shapes: as `global_avg_pool`: ``(*B, *spatial, C)`` -> ``(*B, C)``
    (``channels_first=True``: ``(*B, C, *spatial)`` -> ``(*B, C)``).

    >>> import blox as bx, jax.numpy as jnp
    >>> bx.global_max_pool(jnp.arange(6.0).reshape(1, 3, 2), num_spatial_dims=1)
    Array([[4., 5.]], dtype=float32)
    """
    x = jnp.asarray(x)
    axes = _spatial_axes("global_max_pool", x, num_spatial_dims, channels_first)
    return jnp.max(x, axis=axes, keepdims=keepdims)
