"""Padding and window arithmetic shared by the convolutions (``_conv.py``) and the
pooling functions (``_pool.py``): argument checks, ``'SAME'`` / ``'VALID'`` / ``'CAUSAL'`` /
explicit pads of a forward window, the pads of a transposed convolution, and the layout
text used in error messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

__all__ = [
    "PaddingLike",
    "dilate",
    "int_tuple",
    "layout",
    "normalize_padding",
    "resolve_pads",
    "same_pads",
    "split_input",
    "transpose_pads",
]

PaddingLike = str | int | Sequence[int] | Sequence[tuple[int, int]]
"""``'SAME'``, ``'SAME_LOWER'``, ``'VALID'``, ``'CAUSAL'`` (1-D), an int (the same on
both sides of every spatial axis), one int per spatial axis, or one ``(low, high)``
pair per spatial axis."""


def int_tuple(value: Any, n: int, what: str, where: str, fix: str) -> tuple[int, ...]:
    """`value` as `n` positive ints: an int is repeated, a sequence must have length n."""
    if isinstance(value, int) and not isinstance(value, bool):
        out = (value,) * n
    else:
        try:
            out = tuple(value)
        except TypeError:
            raise TypeError(
                f"{where}: {what} must be an int or a sequence of ints, got {value!r}."
            ) from None
        if len(out) != n:
            raise ValueError(
                f"{where}: {what} has {len(out)} entries {out!r}, but the operation has {n} "
                f"spatial dimension(s). {fix}"
            )
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in out):
        raise ValueError(f"{where}: {what} must be positive ints, got {value!r}.")
    return out


def normalize_padding(
    padding: Any, n: int, where: str, allowed: Sequence[str]
) -> str | tuple[tuple[int, int], ...]:
    """Checks a padding spec; returns a canonical string or `n` ``(low, high)`` pairs."""
    fix = (
        f"Use one of {', '.join(repr(s) for s in allowed)}, an int, one int per spatial "
        f"axis, or {n} (low, high) pair(s), e.g. padding={[(1, 1)] * n!r}."
    )
    if isinstance(padding, str):
        p = padding.upper()
        if p not in allowed:
            extra = ""
            if p == "CAUSAL":
                extra = f" 'CAUSAL' padding is only defined for 1-D inputs (this one is {n}-D)."
            raise ValueError(f"{where}: unknown padding {padding!r}.{extra} {fix}")
        return p
    if isinstance(padding, int) and not isinstance(padding, bool):
        pairs: list[Any] = [(padding, padding)] * n
    else:
        try:
            items = list(padding)
        except TypeError:
            raise TypeError(f"{where}: bad padding {padding!r}. {fix}") from None
        if n == 1 and len(items) == 2 and all(isinstance(v, int) for v in items):
            items = [tuple(items)]  # 1-D: (low, high)
        if len(items) != n:
            raise ValueError(
                f"{where}: padding {padding!r} has {len(items)} entries for {n} spatial "
                f"dimension(s). {fix}"
            )
        pairs = []
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool):
                pairs.append((item, item))
                continue
            try:
                pair = tuple(item)
            except TypeError:
                raise TypeError(f"{where}: bad padding entry {item!r}. {fix}") from None
            if len(pair) != 2:
                raise ValueError(
                    f"{where}: padding entry {item!r} is not a (low, high) pair. {fix}"
                )
            pairs.append(pair)
    for lo, hi in pairs:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi)):
            raise TypeError(f"{where}: padding values must be ints, got {padding!r}. {fix}")
        if lo < 0 or hi < 0:
            raise ValueError(
                f"{where}: padding values must be >= 0, got {padding!r}. To crop, slice the "
                "input instead."
            )
    return tuple((int(lo), int(hi)) for lo, hi in pairs)


def same_pads(size: int, window: int, stride: int, lower: bool) -> tuple[int, int]:
    """XLA/TensorFlow 'SAME': output ``ceil(size / stride)``; odd extra on the high side
    (on the low side for 'SAME_LOWER')."""
    out = -(-size // stride)
    total = max((out - 1) * stride + window - size, 0)
    small = total // 2
    return (total - small, small) if lower else (small, total - small)


def resolve_pads(
    spec: str | tuple[tuple[int, int], ...],
    sizes: Sequence[int],
    windows: Sequence[int],
    strides: Sequence[int],
) -> list[tuple[int, int]]:
    """Concrete ``(low, high)`` pads of a forward convolution / pooling window."""
    if spec == "VALID":
        return [(0, 0)] * len(sizes)
    if spec in ("SAME", "SAME_LOWER"):
        return [
            same_pads(n, w, s, spec == "SAME_LOWER")
            for n, w, s in zip(sizes, windows, strides, strict=True)
        ]
    if spec == "CAUSAL":
        return [(w - 1, 0) for w in windows]
    return list(spec)  # explicit pairs


def transpose_pads(
    spec: str | tuple[tuple[int, int], ...],
    windows: Sequence[int],
    strides: Sequence[int],
) -> list[tuple[int, int]]:
    """Pads of the stride-1 convolution over the stride-dilated input of a transposed
    convolution (lax semantics)."""
    if isinstance(spec, tuple):
        return list(spec)
    out = []
    for k, s in zip(windows, strides, strict=True):
        if spec == "SAME":  # output n * s
            total = k + s - 2
            lo = k - 1 if s > k - 1 else -(-total // 2)
        elif spec == "VALID":  # output n * s + max(k - s, 0)
            total = k + s - 2 + max(k - s, 0)
            lo = k - 1
        else:  # CAUSAL: output n * s; output t sees inputs j with j * s <= t
            total = k + s - 2
            lo = k - 1
        out.append((lo, total - lo))
    return out


def dilate(size: int, rate: int) -> int:
    """The extent of `size` cells with ``rate - 1`` zeros between neighbours."""
    return 0 if size == 0 else (size - 1) * rate + 1


def split_input(
    x: jax.Array, n: int, channels_first: bool
) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """(batch shape, channels, spatial shape) of an input with `n` spatial axes."""
    batch = tuple(x.shape[: x.ndim - n - 1])
    if channels_first:
        return batch, x.shape[-n - 1], tuple(x.shape[-n:])
    return batch, x.shape[-1], tuple(x.shape[-n - 1 : -1])


def layout(n: int, channels_first: bool) -> str:
    """The input layout as printed in messages, e.g. ``'(..., H, W, C)'``."""
    letters = "DHW"[-n:] if n <= 3 else "S" * n
    return (
        ("(..., C, " if channels_first else "(..., ")
        + ", ".join(letters)
        + (")" if channels_first else ", C)")
    )
