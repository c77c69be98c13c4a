"""Normalization over the feature axis: `LayerNorm` and `RMSNorm`, and what every
normalization layer shares (statistics dtype, cross-device averaging, scale and bias)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blox.core import Graph, Module, Params, Rng

__all__ = ["LayerNorm", "RMSNorm"]

_ones = jax.nn.initializers.ones
_zeros = jax.nn.initializers.zeros

_UNBOUND_AXIS = (
    "{kind} '{path}': axis_name={axis!r} is not bound here, so the statistics cannot be "
    "averaged over it. Call the model inside a transform that names that axis, e.g.\n"
    "    jax.shard_map(step, mesh=mesh, in_specs=..., out_specs=...)  # mesh axis {axis!r}\n"
    "    jax.vmap(step, axis_name={axis!r})\n"
    "or build the layer with axis_name=None for single-device statistics."
)


def stats_dtype(*dtypes: Any) -> Any:
    """The dtype normalization statistics are computed in: float64 if any of `dtypes` is
    float64, else float32 (also for bf16/f16 inputs, whose squares overflow or lose
    precision in their own dtype)."""
    wide = any(jnp.dtype(d) == jnp.float64 for d in dtypes)
    return jnp.dtype(jnp.float64) if wide else jnp.dtype(jnp.float32)


class AffineNorm(Module):
    """What the normalization layers share: the ``epsilon`` check, the settings of the
    optional per-feature ``scale`` and ``bias`` and their creation, the output dtype, and
    statistics averaged over a named axis (optionally within groups of its indices).

    Subclasses call `_set_affine` (and `_set_axis` if they take ``axis_name``) in
    ``__init__`` and `_scale_bias`, `_out_dtype` (and `_device_mean`) in ``__call__``.
    """

    kind = "Norm"
    axis_name: Hashable | tuple[Hashable, ...] | None  # set by `_set_axis`
    axis_index_groups: tuple[tuple[int, ...], ...] | None

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

    def _set_axis(
        self,
        axis_name: Hashable | tuple[Hashable, ...] | None,
        axis_index_groups: Sequence[Sequence[int]] | None,
    ) -> None:
        if axis_index_groups is not None and axis_name is None:
            raise ValueError(
                f"{self.kind} '{self.path_str}': axis_index_groups needs an axis_name; pass "
                "axis_name='<mesh axis>' too, or drop axis_index_groups."
            )
        self.axis_name = axis_name
        self.axis_index_groups = (
            None
            if axis_index_groups is None
            else tuple(tuple(int(i) for i in grp) for grp in axis_index_groups)
        )

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

    def _out_dtype(self, x: jax.Array, scale: jax.Array | None, bias: jax.Array | None) -> Any:
        """The compute (= output) dtype: ``dtype`` if given, else the promotion of the
        input dtype and the stored ``scale``/``bias`` dtype (the input dtype without
        them; float32 for a non-floating input). Running statistics never take part, so
        bf16 inputs and bf16 (policy-cast) parameters give bf16."""
        if self.dtype is not None:
            return jnp.dtype(self.dtype)
        out = x.dtype
        with jax.numpy_dtype_promotion("standard"):
            for p in (scale, bias):
                if p is not None:
                    out = jnp.promote_types(out, p.dtype)
        if not jnp.issubdtype(out, jnp.inexact):
            out = jnp.dtype(jnp.float32)
        return jnp.dtype(out)

    # -- statistics over a named axis ----------------------------------------------

    def _axis_size(self) -> int:
        names = self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)
        size = 1
        for name in names:
            try:
                size *= int(jax.lax.axis_size(name))
            except NameError as e:
                raise ValueError(
                    _UNBOUND_AXIS.format(kind=self.kind, path=self.path_str, axis=name)
                ) from e
        return size

    def _group_weights(self, axis_size: int) -> tuple[np.ndarray, int]:
        groups = self.axis_index_groups or ()
        flat = sorted(i for grp in groups for i in grp)
        sizes = {len(grp) for grp in groups}
        if flat != list(range(axis_size)) or len(sizes) != 1:
            raise ValueError(
                f"{self.kind} '{self.path_str}': axis_index_groups={groups} must split the "
                f"{axis_size} indices of axis {self.axis_name!r} into groups of equal size, "
                "each index exactly once, e.g. [[0, 1], [2, 3]] for 4 devices."
            )
        weights = np.zeros((axis_size, axis_size))
        for grp in groups:
            for i in grp:
                weights[i, list(grp)] = 1.0 / len(grp)
        return weights, sizes.pop()

    def _device_mean(self) -> tuple[Callable[[jax.Array], jax.Array], int]:
        """``(mean, count)``: ``mean(v)`` averages `v` over ``axis_name`` (within the
        caller's group of ``axis_index_groups``; the identity without ``axis_name``) and
        ``count`` is how many devices each average covers.

        Groups are computed from an ``all_gather`` and a weighted sum (elementwise, so no
        matmul precision setting can round it), because JAX's ``pmean`` takes no
        ``axis_index_groups`` under ``vmap`` or ``shard_map``. Raises a ``ValueError``
        naming the layer when the axis is not bound."""
        if self.axis_name is None:
            return (lambda v: v), 1
        axis = self.axis_name
        size = self._axis_size()
        if self.axis_index_groups is None:
            return (lambda v: jax.lax.pmean(v, axis)), size
        weights, count = self._group_weights(size)

        def mean(v: jax.Array) -> jax.Array:
            gathered = jax.lax.all_gather(v, axis)  # (devices, *v.shape)
            row = jnp.asarray(weights, v.dtype)[jax.lax.axis_index(axis)]
            return jnp.sum(gathered * row.reshape(row.shape + (1,) * v.ndim), axis=0)

        return mean, count


class _NormBase(AffineNorm):
    """Shared checks and statistics of the two feature-axis norms."""

    def _check_input(self, params: Params, x: jax.Array) -> int:
        if x.ndim == 0:
            raise ValueError(
                f"{self.kind} '{self.path_str}': input must not be scalar; expected shape "
                "(..., features)."
            )
        d = x.shape[-1]
        for name in ("scale", "bias"):
            existing = self.peek_param(params, name)
            if existing is not None and hasattr(existing, "shape") and existing.shape != (d,):
                raise ValueError(
                    f"{self.kind} '{self.path_str}' normalizes {existing.shape[0]} features "
                    f"({name} {tuple(existing.shape)}), got input shape {tuple(x.shape)}. "
                    "Fix the input's last dimension or re-initialize the params."
                )
        return d


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
      axis_name: if given, the statistics are also averaged over this named axis (or
        tuple of axes) of an enclosing ``jax.shard_map`` or ``jax.vmap``,
        e.g. features split over devices; each device must hold the same number of
        features. Unbound: a ``ValueError`` that says how to bind it.
      axis_index_groups: a partition of the axis indices into equal-size groups (e.g.
        ``[[0, 1], [2, 3]]``); the statistics are averaged within each group only. Works
        under ``shard_map`` and ``vmap`` (computed with an ``all_gather``).
        Needs ``axis_name``.
      rng: optional `Rng` passed to the initializers (the defaults need none).
      dtype: the compute and output dtype; default the promotion of the input dtype and
        the stored parameter dtype (the input dtype without parameters).
      param_dtype: the dtype parameters are created in (float32).

    Dtype policy: the mean, the variance and the normalization are computed in float32
    for bf16/f16 inputs or outputs (float64 if either is float64); the result is cast
    to the output dtype, so bf16 inputs with bf16 parameters (a bf16 `Policy`) return
    bf16, and f32 parameters with a bf16 input return f32.

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
        self._set_axis(axis_name, axis_index_groups)

    def __call__(self, params: Params, x: jax.Array) -> tuple[jax.Array, Params]:
        """Normalizes ``x`` ``(..., D)``; returns ``((..., D), params)``."""
        x = jnp.asarray(x)
        d = self._check_input(params, x)
        scale, bias, params = self._scale_bias(params, d)
        out_dtype = self._out_dtype(x, scale, bias)
        sd = stats_dtype(x.dtype, out_dtype)
        device_mean, _ = self._device_mean()
        xs = x.astype(sd)
        mean = device_mean(jnp.mean(xs, axis=-1, keepdims=True))
        centered = xs - mean
        var = device_mean(jnp.mean(centered * centered, axis=-1, keepdims=True))
        y = centered * jax.lax.rsqrt(var + jnp.asarray(self.epsilon, sd))
        if scale is not None:
            y = y * jnp.expand_dims(scale.astype(sd), tuple(range(y.ndim - 1)))
        if bias is not None:
            y = y + jnp.expand_dims(bias.astype(sd), tuple(range(y.ndim - 1)))
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
      axis_name: if given, the statistics are also averaged over this named axis (or
        tuple of axes) of an enclosing ``jax.shard_map`` or ``jax.vmap``,
        e.g. features split over devices; each device must hold the same number of
        features. Unbound: a ``ValueError`` that says how to bind it.
      axis_index_groups: a partition of the axis indices into equal-size groups (e.g.
        ``[[0, 1], [2, 3]]``); the statistics are averaged within each group only. Works
        under ``shard_map`` and ``vmap`` (computed with an ``all_gather``).
        Needs ``axis_name``.
      rng: optional `Rng` passed to the initializer.
      dtype: the compute and output dtype; default the promotion of the input dtype and
        the stored ``scale`` dtype (the input dtype without a scale).
      param_dtype: the dtype ``scale`` is created in (float32).

    Dtype policy: the mean square and the normalization are computed in float32 for
    bf16/f16 inputs or outputs (float64 if either is float64); the result is cast to
    the output dtype (bf16 input and bf16 scale: bf16).

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
        self._set_axis(axis_name, axis_index_groups)

    def __call__(self, params: Params, x: jax.Array) -> tuple[jax.Array, Params]:
        """Normalizes ``x`` ``(..., D)``; returns ``((..., D), params)``."""
        x = jnp.asarray(x)
        d = self._check_input(params, x)
        scale, _, params = self._scale_bias(params, d)
        out_dtype = self._out_dtype(x, scale, None)
        sd = stats_dtype(x.dtype, out_dtype)
        device_mean, _ = self._device_mean()
        xs = x.astype(sd)
        ms = device_mean(jnp.mean(xs * xs, axis=-1, keepdims=True))
        y = xs * jax.lax.rsqrt(ms + jnp.asarray(self.epsilon, sd))
        if scale is not None:
            y = y * jnp.expand_dims(scale.astype(sd), tuple(range(y.ndim - 1)))
        return y.astype(out_dtype), params
