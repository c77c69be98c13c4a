"""Normalization over batches and groups of channels: `BatchNorm` and `GroupNorm`."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blox.core import Graph, Params, Rng
from blox.core._sharding import explicit_sharding, split_out_sharding
from blox.nn._norm import AffineNorm, stats_dtype

__all__ = ["BatchNorm", "GroupNorm"]

_ones = jax.nn.initializers.ones
_zeros = jax.nn.initializers.zeros


def _channel_axis(kind: str, path: str, x: jax.Array, channels_first: bool) -> int:
    """The channel axis of `x` (rank >= 2), or a `ValueError` naming the layer."""
    if x.ndim < 2:
        layout = "(B, C, ...)" if channels_first else "(B, ..., C)"
        raise ValueError(
            f"{kind} '{path}': input of shape {tuple(x.shape)} has rank {x.ndim}; expected "
            f"rank >= 2 laid out as {layout}. Add a batch axis, e.g. x[None]."
        )
    return 1 if channels_first else x.ndim - 1


def _bcast_shape(ndim: int, axis: int, size: int) -> tuple[int, ...]:
    shape = [1] * ndim
    shape[axis] = size
    return tuple(shape)


class BatchNorm(AffineNorm):
    """Batch normalization with running statistics kept as non-trainable parameters.

    In training mode (``is_training=True``) the input is normalized with the mean and
    the biased variance of the batch, per channel, over every axis but the channel axis
    (as ``torch.nn.BatchNorm{1,2,3}d`` does), and the running statistics are updated:

        running_mean = momentum * running_mean + (1 - momentum) * mean
        running_var  = momentum * running_var  + (1 - momentum) * var * n / (n - 1)

    ``momentum`` keeps that fraction of the old value (Flax's meaning: PyTorch's
    ``momentum=0.1`` is ``momentum=0.9`` here). The running variance takes the
    *unbiased* batch variance (``n`` = number of values per channel), as PyTorch does, so
    ported PyTorch models keep their statistics (jax-blox: see docs/migrating.md). In
    eval mode (``is_training=False``) the running statistics normalize and nothing changes.

    Cross-device statistics: with ``axis_name`` set and the model run under
    ``jax.shard_map`` (or ``jax.vmap(..., axis_name=...)``), mean and variance are averaged
    over that axis (two ``pmean``: the mean first, then the centred second moment), so
    each device normalizes with the statistics of the full batch and stores the same
    running statistics as a single device would on that batch. Every device must hold
    the same number of examples. ``axis_index_groups`` (a partition of the axis into
    equal-size groups) averages within each group; it is computed with an
    ``all_gather`` of the per-device ``(C,)`` statistics, so it also works under
    ``shard_map`` and ``vmap`` (whose ``pmean`` lacks groups). Eval mode uses no
    collective.

    Shapes: ``(B, ..., C)`` (channels last, default) or ``(B, C, ...)`` with
    ``channels_first=True`` -> the same shape. Rank >= 2.

    Args:
      graph: this module's node.
      momentum: fraction of the running statistics kept at each training step.
      epsilon: added to the variance before the square root.
      use_scale: learn a per-channel ``scale`` (PyTorch ``weight``).
      use_bias: learn a per-channel ``bias``.
      scale_init: initializer of ``scale`` (default ones).
      bias_init: initializer of ``bias`` (default zeros).
      axis_name: a named axis (or tuple of names) to average statistics over, or None.
      axis_index_groups: groups of axis indices to average within, or None (all).
      rng: an `Rng` for random initializers (not needed for the defaults).
      channels_first: inputs are ``(B, C, ...)`` (PyTorch layout) instead of
        ``(B, ..., C)``.
      dtype: the compute and output dtype; default: the promotion of the input dtype
        and the stored ``scale``/``bias`` dtype (the input dtype without them). The
        running statistics do not take part: bf16 inputs with bf16 ``scale``/``bias``
        (what a bf16 `Policy` passes) return bf16, float32 ones with a bf16 input
        return float32.
      param_dtype: the dtype parameters are created in (default float32).

    Dtype policy: the batch mean and variance, the running-statistics update and the
    normalization are computed in float32 for bf16/f16 inputs or outputs (float64 if
    either is float64), then cast: the output to the compute dtype, the running
    statistics to their stored dtype. So one float16 activation far from the batch
    mean (whose square overflows float16) neither zeroes the output nor makes
    ``running_var`` infinite.

    Parameters (``C`` channels):
      ``<path>/scale`` ``(C,)`` trainable (if ``use_scale``),
      ``<path>/bias`` ``(C,)`` trainable (if ``use_bias``),
      ``<path>/running_mean`` ``(C,)`` zeros, non-trainable,
      ``<path>/running_var`` ``(C,)`` ones, non-trainable.

    Raises ``ValueError`` on rank < 2, on a training batch with one value per channel
    (the unbiased variance is undefined), and on an ``axis_name`` that is not bound.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net')
    >>> bn = bx.BatchNorm(g / 'bn')
    >>> x = jnp.arange(8.0).reshape(4, 2)
    >>> y, params = bn(bx.Params(), x)
    >>> [round(float(v), 3) for v in y[:, 0]]
    [-1.342, -0.447, 0.447, 1.342]
    >>> params[('net', 'bn', 'running_mean')].value      # 0.9 * 0 + 0.1 * [3, 4]
    Array([0.3, 0.4], dtype=float32)
    >>> y_eval, _ = bn(params, x, is_training=False)      # uses the running statistics
    """

    kind = "BatchNorm"

    def __init__(
        self,
        graph: Graph,
        momentum: float = 0.9,
        epsilon: float = 1e-5,
        use_scale: bool = True,
        use_bias: bool = True,
        scale_init: Callable = _ones,
        bias_init: Callable = _zeros,
        axis_name: Hashable | tuple[Hashable, ...] | None = None,
        axis_index_groups: Sequence[Sequence[int]] | None = None,
        rng: Rng | None = None,
        *,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        if not 0.0 <= float(momentum) <= 1.0:
            raise ValueError(
                f"BatchNorm '{self.path_str}': momentum must be in [0, 1], got {momentum}. "
                "It is the fraction of the running statistics kept per step (PyTorch's "
                "momentum=0.1 is momentum=0.9 here)."
            )
        self._set_affine(
            epsilon, use_scale, use_bias, scale_init, bias_init, rng, dtype, param_dtype
        )
        self._set_axis(axis_name, axis_index_groups)
        self.momentum = float(momentum)
        self.channels_first = channels_first

    # -- call --------------------------------------------------------------------------

    def __call__(
        self, params: Params, x: jax.Array, is_training: bool = True
    ) -> tuple[jax.Array, Params]:
        """Normalizes `x`; returns ``(y, params)`` (running statistics updated when
        training)."""
        x = jnp.asarray(x)
        ax = _channel_axis("BatchNorm", self.path_str, x, self.channels_first)
        c = x.shape[ax]
        reduce_axes = tuple(i for i in range(x.ndim) if i != ax)
        bshape = _bcast_shape(x.ndim, ax, c)
        scale, bias, params = self._scale_bias(params, c)
        pd = self.param_dtype
        r_mean, params = self.get_param(
            params, "running_mean", (c,), _zeros, dtype=pd, trainable=False, rng=self.rng
        )
        r_var, params = self.get_param(
            params, "running_var", (c,), _ones, dtype=pd, trainable=False, rng=self.rng
        )
        out_dtype = self._out_dtype(x, scale, bias)
        sd = stats_dtype(x.dtype, out_dtype)
        xs = x.astype(sd)

        if is_training:
            device_mean, devices = self._device_mean()
            n = int(np.prod([x.shape[i] for i in reduce_axes], dtype=np.int64)) * devices
            if n < 2:
                raise ValueError(
                    f"BatchNorm '{self.path_str}': training needs more than one value per "
                    f"channel, got input shape {tuple(x.shape)} ({n} value(s) per channel). "
                    "Use a larger batch, or is_training=False to normalize with the "
                    "running statistics."
                )
            mean = device_mean(jnp.mean(xs, axis=reduce_axes))
            centred = xs - mean.reshape(bshape)
            var = device_mean(jnp.mean(jnp.square(centred), axis=reduce_axes))
            m = self.momentum
            stats_mean = jax.lax.stop_gradient(mean)
            stats_var = jax.lax.stop_gradient(var) * (n / (n - 1))
            new_mean = m * r_mean.astype(sd) + (1.0 - m) * stats_mean
            new_var = m * r_var.astype(sd) + (1.0 - m) * stats_var
            params = self.set_param(params, "running_mean", new_mean.astype(r_mean.dtype))
            params = self.set_param(params, "running_var", new_var.astype(r_var.dtype))
        else:
            centred = xs - r_mean.astype(sd).reshape(bshape)
            var = r_var.astype(sd)

        inv = jax.lax.rsqrt(var + jnp.asarray(self.epsilon, sd))
        if scale is not None:
            inv = inv * scale.astype(sd)
        y = centred * inv.reshape(bshape)
        if bias is not None:
            y = y + bias.astype(sd).reshape(bshape)
        return y.astype(out_dtype), params


class GroupNorm(AffineNorm):
    """Group normalization: per example, the channels are split into ``num_groups``
    groups and each group is normalized over its channels and all spatial positions
    (mean and biased variance), then a per-channel scale and bias are applied. Matches
    ``torch.nn.GroupNorm(num_groups, C, eps, affine)``; no running statistics, the same
    computation in training and evaluation.

    Shapes: ``(B, ..., C)`` (channels last, default) or ``(B, C, ...)`` with
    ``channels_first=True`` -> the same shape. Axis 0 is the batch; rank >= 2.

    Args:
      graph: this module's node.
      num_groups: the number of groups; must divide ``C`` (``C`` groups is instance
        norm, 1 group normalizes each example over everything, like LayerNorm over all
        non-batch axes).
      rng: an `Rng` for random initializers (not needed for the defaults).
      epsilon: added to the variance before the square root (keyword-only, as all that
        follow).
      use_scale: learn a per-channel ``scale`` (PyTorch ``weight``).
      use_bias: learn a per-channel ``bias``. PyTorch's ``affine=False`` is
        ``use_scale=False, use_bias=False``.
      scale_init: initializer of ``scale`` (default ones).
      bias_init: initializer of ``bias`` (default zeros).
      channels_first: inputs are ``(B, C, ...)`` instead of ``(B, ..., C)``.
      dtype: the compute and output dtype; default: the promotion of the input dtype
        and the stored parameter dtype (the input dtype when there are no parameters).
      param_dtype: the dtype parameters are created in (default float32).

    Dtype policy: the group mean, the variance and the normalization are computed in
    float32 for bf16/f16 inputs or outputs (float64 if either is float64), then cast to
    the output dtype. So a float16 activation far from its group mean (whose square
    overflows float16) still normalizes correctly, and bf16 inputs with bf16
    parameters (a bf16 `Policy`) return bf16, rounded once.

    Parameters: ``<path>/scale`` ``(C,)`` and ``<path>/bias`` ``(C,)``, trainable (each
    only if used).

    >>> import blox as bx, jax.numpy as jnp
    >>> gn = bx.GroupNorm(bx.Graph('net') / 'gn', num_groups=2)
    >>> y, params = gn(bx.Params(), jnp.ones((3, 8, 8, 4)))
    >>> y.shape, params[('net', 'gn', 'scale')].value.shape
    ((3, 8, 8, 4), (4,))
    """

    kind = "GroupNorm"

    def __init__(
        self,
        graph: Graph,
        num_groups: int,
        rng: Rng | None = None,
        *,
        epsilon: float = 1e-5,
        use_scale: bool = True,
        use_bias: bool = True,
        scale_init: Callable = _ones,
        bias_init: Callable = _zeros,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
            raise ValueError(
                f"GroupNorm '{self.path_str}': num_groups must be a positive int, got "
                f"{num_groups!r}. It must also divide the number of channels."
            )
        self._set_affine(
            epsilon, use_scale, use_bias, scale_init, bias_init, rng, dtype, param_dtype
        )
        self.num_groups = num_groups
        self.channels_first = channels_first

    def __call__(self, params: Params, x: jax.Array) -> tuple[jax.Array, Params]:
        """Normalizes `x`; returns ``(y, params)``."""
        x = jnp.asarray(x)
        ax = _channel_axis("GroupNorm", self.path_str, x, self.channels_first)
        c, g = x.shape[ax], self.num_groups
        if c % g:
            divisors = [d for d in range(1, c + 1) if c % d == 0]
            raise ValueError(
                f"GroupNorm '{self.path_str}': num_groups={g} does not divide the {c} "
                f"channels of input shape {tuple(x.shape)} (channel axis {ax}). Use a "
                f"num_groups that divides {c}: one of {divisors}."
            )
        bshape = _bcast_shape(x.ndim, ax, c)
        scale, bias, params = self._scale_bias(params, c)
        out_dtype = self._out_dtype(x, scale, bias)
        sd = stats_dtype(x.dtype, out_dtype)
        # Split the channel axis into (groups, channels per group) and reduce over every
        # axis except the batch axis and the group axis.
        # On an Explicit mesh a sharded channel axis needs the reshapes' shardings.
        split = split_out_sharding(x, ax, (g, c // g))
        grouped = x.astype(sd).reshape(
            x.shape[:ax] + (g, c // g) + x.shape[ax + 1 :], out_sharding=split
        )
        reduce_axes = tuple(i for i in range(1, grouped.ndim) if i != ax)
        mean = jnp.mean(grouped, axis=reduce_axes, keepdims=True)
        centred = grouped - mean
        var = jnp.mean(jnp.square(centred), axis=reduce_axes, keepdims=True)
        y = (centred * jax.lax.rsqrt(var + jnp.asarray(self.epsilon, sd))).reshape(
            x.shape, out_sharding=explicit_sharding(x) if split is not None else None
        )
        if scale is not None:
            y = y * scale.astype(sd).reshape(bshape)
        if bias is not None:
            y = y + bias.astype(sd).reshape(bshape)
        return y.astype(out_dtype), params
