"""Normalization over the feature axis: `LayerNorm` and `RMSNorm`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from blox.core import Graph, Module, Params, Rng

__all__ = ["LayerNorm", "RMSNorm"]

_ones = jax.nn.initializers.ones
_zeros = jax.nn.initializers.zeros


def _stats_dtype(*dtypes: Any) -> Any:
    """float64 if any of `dtypes` is float64, else float32 (also for bf16/f16 inputs)."""
    wide = any(jnp.dtype(d) == jnp.float64 for d in dtypes)
    return jnp.dtype(jnp.float64) if wide else jnp.dtype(jnp.float32)


def _mean(x: jax.Array, axis_name: Any, groups: Sequence[Sequence[int]] | None) -> jax.Array:
    m = jnp.mean(x, axis=-1, keepdims=True)
    if axis_name is not None:
        m = jax.lax.pmean(m, axis_name, axis_index_groups=groups)
    return m


class AffineNorm(Module):
    """What the normalization layers share: the ``epsilon`` check, the settings of the
    optional per-feature ``scale`` and ``bias``, and their creation.

    Subclasses call `_set_affine` in ``__init__`` and `_scale_bias` in ``__call__``.
    """

    kind = "Norm"

    def _set_affine(
        self,
        epsilon: float,
        use_scale: bool,
        use_bias: bool,
        scale_init: Callable,
        bias_init: Callable,
        rng: Rng | None,
        dtype: Any | None,
        param_dtype: Any,
    ) -> None:
        if not float(epsilon) > 0.0:
            raise ValueError(f"{self.kind} '{self.path_str}': epsilon must be > 0, got {epsilon}.")
        self.epsilon = float(epsilon)
        self.use_scale = use_scale
        self.use_bias = use_bias
        self.scale_init = scale_init
        self.bias_init = bias_init
        self.rng = rng
        self.dtype = dtype
        self.param_dtype = param_dtype

    def _scale_bias(
        self, params: Params, n: int
    ) -> tuple[jax.Array | None, jax.Array | None, Params]:
        """``(scale, bias, params)``, each ``(n,)`` in ``param_dtype`` (created on first
        use), or ``None`` where the layer has none."""
        scale = bias = None
        pd = self.param_dtype
        if self.use_scale:
            scale, params = self.get_param(
                params, "scale", (n,), self.scale_init, dtype=pd, rng=self.rng
            )
        if self.use_bias:
            bias, params = self.get_param(
                params, "bias", (n,), self.bias_init, dtype=pd, rng=self.rng
            )
        return scale, bias, params


class _NormBase(AffineNorm):
    """Shared checks of the two feature-axis norms."""

    def _check_input(self, params: Params, x: jax.Array) -> int:
        if x.ndim == 0:
            raise ValueError(
                f"{self.kind} '{self.path_str}': input must not be scalar; expected shape "
                "(..., features)."
            )
        d = x.shape[-1]
        for name in ("scale", "bias"):
            existing = params._get_value(self.param_path(name))
            if existing is not None and hasattr(existing, "shape") and existing.shape != (d,):
                raise ValueError(
                    f"{self.kind} '{self.path_str}' normalizes {existing.shape[0]} features "
                    f"({name} {tuple(existing.shape)}), got input shape {tuple(x.shape)}. "
                    "Fix the input's last dimension or re-initialize the params."
                )
        return d

    def _out_dtype(self, x: jax.Array, param: jax.Array | None) -> Any:
        if self.dtype is not None:
            return jnp.dtype(self.dtype)
        if param is None:
            return x.dtype
        with jax.numpy_dtype_promotion("standard"):
            return jnp.promote_types(x.dtype, param.dtype)


class LayerNorm(_NormBase):
    """Layer normalization over the last axis (Ba et al., 2016)::

        y = (x - mean(x)) / sqrt(var(x) + epsilon) * scale + bias

    with the mean and the biased variance taken over the last axis (as in PyTorch's
    ``nn.LayerNorm(D)``).

    Shapes: ``(..., D)`` -> ``(..., D)``.

    Args:
      graph: this module's node.
      epsilon: added to the variance (default 1e-5, PyTorch's default).
      use_scale: multiply by a learned ``scale`` (initialized by `scale_init`, ones).
      use_bias: add a learned ``bias`` (initialized by `bias_init`, zeros).
      scale_init, bias_init: ``init(key, (D,), dtype)``.
      axis_name: if given, the statistics are averaged over this named axis
        (``jax.lax.pmean``) as well, e.g. a sequence split over devices.
      axis_index_groups: passed to ``pmean``.
      rng: optional `Rng` passed to the initializers (the defaults need none).
      dtype: the output dtype; default the promotion of the input dtype and the stored
        parameter dtype (the input dtype without parameters).
      param_dtype: the dtype parameters are created in (float32).

    Dtype policy: the statistics and the normalization are computed in float32 for
    bf16/f16 inputs (float64 for float64 inputs); the result is cast to the output
    dtype.

    Parameters: ``<path>/scale`` ``(D,)``, ``<path>/bias`` ``(D,)`` (each only if used).

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net')
    >>> norm = bx.LayerNorm(g / 'norm')
    >>> y, params = norm(bx.Params(), jnp.array([[1.0, 2.0, 3.0]]))
    >>> [round(float(v), 3) for v in y[0]]
    [-1.225, 0.0, 1.225]
    """

    kind = "LayerNorm"

    def __init__(
        self,
        graph: Graph,
        epsilon: float = 1e-5,
        use_scale: bool = True,
        use_bias: bool = True,
        scale_init: Callable = _ones,
        bias_init: Callable = _zeros,
        axis_name: Any = None,
        axis_index_groups: Sequence[Sequence[int]] | None = None,
        rng: Rng | None = None,
        *,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        self._set_affine(
            epsilon, use_scale, use_bias, scale_init, bias_init, rng, dtype, param_dtype
        )
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups

    def __call__(self, params: Params, x: jax.Array) -> tuple[jax.Array, Params]:
        """Normalizes ``x`` ``(..., D)``; returns ``((..., D), params)``."""
        x = jnp.asarray(x)
        d = self._check_input(params, x)
        scale, bias, params = self._scale_bias(params, d)
        out_dtype = self._out_dtype(x, scale if scale is not None else bias)
        sd = _stats_dtype(x.dtype, out_dtype)
        xs = x.astype(sd)
        mean = _mean(xs, self.axis_name, self.axis_index_groups)
        centered = xs - mean
        var = _mean(centered * centered, self.axis_name, self.axis_index_groups)
        y = centered * jax.lax.rsqrt(var + jnp.asarray(self.epsilon, sd))
        if scale is not None:
            y = y * jnp.broadcast_to(scale.astype(sd), y.shape)
        if bias is not None:
            y = y + jnp.broadcast_to(bias.astype(sd), y.shape)
        return y.astype(out_dtype), params


class RMSNorm(_NormBase):
    """Root-mean-square normalization over the last axis (Zhang & Sennrich, 2019)::

        y = x / sqrt(mean(x ** 2) + epsilon) * scale

    (as PyTorch's ``nn.RMSNorm(D, eps=epsilon)``).

    Shapes: ``(..., D)`` -> ``(..., D)``.

    Args:
      graph: this module's node.
      epsilon: added to the mean square (default 1e-5).
      use_scale: multiply by a learned ``scale`` (initialized by `scale_init`, ones).
      scale_init: ``init(key, (D,), dtype)``.
      axis_name: if given, the mean square is also averaged over this named axis.
      axis_index_groups: passed to ``pmean``.
      rng: optional `Rng` passed to the initializer.
      dtype: the output dtype; default the promotion of the input dtype and the stored
        ``scale`` dtype (the input dtype without a scale).
      param_dtype: the dtype ``scale`` is created in (float32).

    Dtype policy: statistics in float32 for bf16/f16 inputs (float64 for float64).

    Parameters: ``<path>/scale`` ``(D,)`` (if used).

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net')
    >>> norm = bx.RMSNorm(g / 'norm', epsilon=1e-6)
    >>> y, params = norm(bx.Params(), jnp.array([[3.0, 4.0]]))
    >>> [round(float(v), 3) for v in y[0]]
    [0.849, 1.131]
    """

    kind = "RMSNorm"

    def __init__(
        self,
        graph: Graph,
        epsilon: float = 1e-5,
        use_scale: bool = True,
        scale_init: Callable = _ones,
        axis_name: Any = None,
        axis_index_groups: Sequence[Sequence[int]] | None = None,
        rng: Rng | None = None,
        *,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        self._set_affine(epsilon, use_scale, False, scale_init, _zeros, rng, dtype, param_dtype)
        self.axis_name = axis_name
        self.axis_index_groups = axis_index_groups

    def __call__(self, params: Params, x: jax.Array) -> tuple[jax.Array, Params]:
        """Normalizes ``x`` ``(..., D)``; returns ``((..., D), params)``."""
        x = jnp.asarray(x)
        d = self._check_input(params, x)
        scale, _, params = self._scale_bias(params, d)
        out_dtype = self._out_dtype(x, scale)
        sd = _stats_dtype(x.dtype, out_dtype)
        xs = x.astype(sd)
        ms = _mean(xs * xs, self.axis_name, self.axis_index_groups)
        y = xs * jax.lax.rsqrt(ms + jnp.asarray(self.epsilon, sd))
        if scale is not None:
            y = y * jnp.broadcast_to(scale.astype(sd), y.shape)
        return y.astype(out_dtype), params
