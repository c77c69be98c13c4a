"""Resizing feature maps: `resize` and `upsample` (nearest and (bi/tri)linear)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

__all__ = ["resize", "upsample"]

_METHODS = {
    "nearest": "nearest",
    "linear": "linear",
    "bilinear": "linear",
    "trilinear": "linear",
}


def _per_dim(name: str, value: float | Sequence[float], nspatial: int, where: str) -> tuple:
    values = tuple(value) if isinstance(value, Sequence) else (value,) * nspatial
    if len(values) != nspatial:
        raise ValueError(
            f"{where}: {name}={value!r} has {len(values)} entries but the input has "
            f"{nspatial} spatial axes; give one value per spatial axis or a single number."
        )
    return values


def resize(
    x: jax.typing.ArrayLike,
    size: int | Sequence[int] | None = None,
    *,
    scale_factor: float | Sequence[float] | None = None,
    method: str = "nearest",
    antialias: bool = False,
    channels_first: bool = False,
) -> jax.Array:
    """Resizes the spatial axes of a batch of feature maps (``jax.image.resize``).

    Shapes: ``(B, *spatial, C)`` (channels last, default) or ``(B, C, *spatial)`` with
    ``channels_first=True``, with 1, 2 or 3 spatial axes -> the same layout with the new
    spatial size. No transposes: the spatial axes are resized where they are.

    Sampling convention: half-pixel centres, i.e. output pixel ``i`` samples the input
    at ``(i + 0.5) * in / out - 0.5``. That is PyTorch's ``align_corners=False``:

    * ``method='linear'`` (also spelled ``'bilinear'``/``'trilinear'``) equals
      ``torch.nn.functional.interpolate(mode='bilinear'`` (or ``'linear'``,
      ``'trilinear'``) ``, align_corners=False)``; ``antialias=True`` (a wider filter when
      downsampling, JAX's default) equals PyTorch's ``antialias=True``.
      ``align_corners=True`` has no equivalent here.
    * ``method='nearest'`` equals PyTorch's ``mode='nearest-exact'``; for integer
      upsampling factors (e.g. x2, the YOLO/FPN case) it also equals PyTorch's
      ``mode='nearest'``, which otherwise samples at ``floor(i * in / out)``.

    With ``scale_factor`` the output size is ``floor(in * scale_factor)`` and the
    sampling grid uses ``in / out``; PyTorch uses ``1 / scale_factor`` for the grid,
    which is the same whenever ``in * scale_factor`` is an integer. Pass ``size`` for an
    exact match otherwise.

    Args:
      x: the input, rank 3 to 5.
      size: the output spatial size (an int for all axes, or one per spatial axis).
      scale_factor: instead of `size`: a factor for all axes or one per axis.
      method: ``'nearest'`` or ``'linear'`` (``'bilinear'``, ``'trilinear'``).
      antialias: filter when downsampling with ``'linear'`` (no effect when upsampling).
      channels_first: ``x`` is ``(B, C, *spatial)``.

    Returns:
      The resized array, in the dtype of `x`.

    >>> import blox as bx, jax.numpy as jnp
    >>> x = jnp.arange(4.0).reshape(1, 2, 2, 1)
    >>> bx.resize(x, (4, 4))[0, :, :, 0]
    Array([[0., 0., 1., 1.],
           [0., 0., 1., 1.],
           [2., 2., 3., 3.],
           [2., 2., 3., 3.]], dtype=float32)
    """
    x = jnp.asarray(x)
    where = "resize"
    if method not in _METHODS:
        raise ValueError(
            f"{where}: unknown method {method!r}; use 'nearest' or 'linear' "
            "('bilinear'/'trilinear' are accepted spellings)."
        )
    if x.ndim < 3 or x.ndim > 5:
        layout = "(B, C, *spatial)" if channels_first else "(B, *spatial, C)"
        raise ValueError(
            f"{where}: input of shape {tuple(x.shape)} has rank {x.ndim}; expected rank 3 "
            f"to 5 laid out as {layout} with 1 to 3 spatial axes. Add a batch axis with "
            "x[None] or a channel axis with x[..., None]."
        )
    if (size is None) == (scale_factor is None):
        raise ValueError(f"{where}: pass exactly one of size= or scale_factor=.")
    spatial = tuple(range(2, x.ndim)) if channels_first else tuple(range(1, x.ndim - 1))
    in_size = tuple(x.shape[i] for i in spatial)
    if size is not None:
        out_size = tuple(int(s) for s in _per_dim("size", size, len(spatial), where))
    else:
        factors = _per_dim("scale_factor", scale_factor, len(spatial), where)  # type: ignore[arg-type]
        out_size = tuple(math.floor(n * float(f)) for n, f in zip(in_size, factors, strict=True))
    if any(s < 1 for s in out_size):
        raise ValueError(
            f"{where}: output spatial size {out_size} from input shape {tuple(x.shape)} "
            f"(spatial {in_size}) must be >= 1 on every axis; use a larger size or "
            "scale_factor."
        )
    shape = list(x.shape)
    for i, s in zip(spatial, out_size, strict=True):
        shape[i] = s
    if tuple(shape) == tuple(x.shape):
        return x
    return jax.image.resize(x, tuple(shape), _METHODS[method], antialias=antialias)


def upsample(
    x: jax.typing.ArrayLike,
    scale_factor: float | Sequence[float] = 2,
    *,
    method: str = "nearest",
    channels_first: bool = False,
) -> jax.Array:
    """Upsamples the spatial axes by `scale_factor` (default: nearest, x2): ``resize(x,
    scale_factor=scale_factor, method=method)``, the FPN/YOLO ``nn.Upsample``.

    Shapes: ``(B, *spatial, C)`` -> ``(B, *(spatial * scale_factor), C)`` (or channels
    first). See `resize` for the sampling convention; ``method`` (keyword-only) is one
    of its methods.

    >>> import blox as bx, jax.numpy as jnp
    >>> bx.upsample(jnp.ones((2, 5, 5, 8))).shape
    (2, 10, 10, 8)
    """
    return resize(x, scale_factor=scale_factor, method=method, channels_first=channels_first)
