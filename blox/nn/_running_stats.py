"""`RunningMeanStd`: running mean and variance of a stream of inputs, kept as
non-trainable parameters, and normalization by them (e.g. RL observations)."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blox.core import Graph, Module, Params
from blox.core._errors import BloxKeyError
from blox.nn._norm import _UNBOUND_AXIS, stats_dtype

__all__ = ["RunningMeanStd"]


class RunningMeanStd(Module):
    """Running mean and variance per feature, merged batch by batch, and normalization
    by them: ``y = (x - mean) / sqrt(var + epsilon)``, optionally clipped to
    ``[-clip, clip]``.

    Unlike `BatchNorm`, the output never depends on the batch it normalizes: a call
    normalizes `x` with the statistics *as stored* (those of every earlier batch), then,
    when ``is_training``, merges the batch into them. So one step of a vectorized
    environment normalizes every environment alike, and an RL learner that normalizes a
    stored rollout with the statistics as of the rollout's start sees exactly the
    actor's inputs. Before the first update the statistics are ``mean = 0``, ``var = 1``,
    ``count = 0``; the first update replaces them by the batch's.

    The merge is the parallel form of Welford's algorithm (Chan, Golub and LeVeque
    1979): with ``n`` stored values of mean ``m_a`` and variance ``v_a`` and a batch of
    ``k`` values of mean ``m_b`` and (biased) variance ``v_b``, ``d = m_b - m_a``::

        count = n + k
        mean  = m_a + d * k / count
        var   = (v_a * n + v_b * k + d**2 * n * k / count) / count

    which equals the mean and (biased) variance of all ``n + k`` values. The batch is
    every axis of `x` but the last.

    Under ``jax.vmap`` or ``jax.shard_map`` with ``axis_name`` set, the batch statistics
    are computed over that named axis too (a ``psum`` of the counts and sums, then of
    the centred squares), so every lane or device stores the statistics of the whole
    batch, the same as one call on the concatenated batch. Lanes may hold different
    numbers of values.

    Shapes: ``(..., D)`` -> ``(..., D)``, rank >= 1 (``(D,)`` is one value: one
    environment's observation under ``jax.vmap``).

    Args:
      graph: this module's node.
      epsilon: added to the variance before the square root (keyword-only, as all that
        follow).
      clip: clip the normalized output to ``[-clip, clip]``; None: no clipping.
      axis_name: a named axis (or tuple of names) whose lanes form one batch, or None.
      param_dtype: the dtype of the statistics (default float32; its ``count`` counts
        exactly up to ``2**24`` values, float64 up to ``2**53``).

    Dtype policy: the statistics and the normalization are computed in float32 for
    bf16/f16 inputs (float64 if the input or the statistics are float64); the output
    has the input's dtype and the statistics keep their stored dtype. Integer inputs
    raise a ``TypeError``.

    Parameters (``D`` features), all non-trainable:
      ``<path>/running_mean`` ``(D,)`` zeros,
      ``<path>/running_var`` ``(D,)`` ones (the biased variance),
      ``<path>/count`` ``()`` zero, the number of values merged so far.

    Calls: ``y, params = norm(params, x, is_training=True)`` normalizes, then merges `x`;
    ``is_training=False`` only normalizes. ``params = norm.update(params, x)`` only
    merges. ``mean, var, count = norm.statistics(params)``.

    >>> import blox as bx, jax.numpy as jnp
    >>> norm = bx.RunningMeanStd(bx.Graph('net') / 'obs_norm')
    >>> x = jnp.array([[1.0, 10.0], [3.0, 30.0]])
    >>> y, params = norm(bx.Params(), x)       # normalized by mean 0, var 1: y == x
    >>> mean, var, count = norm.statistics(params)
    >>> mean, var, count
    (Array([ 2., 20.], dtype=float32), Array([  1., 100.], dtype=float32), Array(2., dtype=float32))
    >>> y, params = norm(params, x, is_training=False)
    >>> y.round(3)
    Array([[-1., -1.],
           [ 1.,  1.]], dtype=float32)
    """

    def __init__(
        self,
        graph: Graph,
        *,
        epsilon: float = 1e-8,
        clip: float | None = None,
        axis_name: Hashable | tuple[Hashable, ...] | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        if not float(epsilon) >= 0.0:
            raise ValueError(
                f"RunningMeanStd '{self.path_str}': epsilon must be >= 0, got {epsilon}."
            )
        if clip is not None and not float(clip) > 0.0:
            raise ValueError(
                f"RunningMeanStd '{self.path_str}': clip must be > 0 or None, got {clip}."
            )
        self.epsilon = float(epsilon)
        self.clip = None if clip is None else float(clip)
        self.axis_name = axis_name
        self.param_dtype = param_dtype

    # -- parameters --------------------------------------------------------------------

    def _check(self, x: Any) -> jax.Array:
        x = jnp.asarray(x)
        if x.ndim < 1:
            raise ValueError(
                f"RunningMeanStd '{self.path_str}': input of shape {tuple(x.shape)} has "
                "rank 0; expected (..., D) with the features on the last axis. For one "
                "scalar feature pass x[None]."
            )
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(
                f"RunningMeanStd '{self.path_str}': input dtype {x.dtype} is not floating; "
                "cast it first, e.g. x.astype(jnp.float32)."
            )
        return x

    def _stats(self, params: Params, d: int) -> tuple[tuple[jax.Array, ...], Params]:
        pd = self.param_dtype
        zeros, ones = jax.nn.initializers.zeros, jax.nn.initializers.ones
        mean, params = self.get_param(
            params, "running_mean", (d,), zeros, dtype=pd, trainable=False
        )
        var, params = self.get_param(params, "running_var", (d,), ones, dtype=pd, trainable=False)
        count, params = self.get_param(params, "count", (), zeros, dtype=pd, trainable=False)
        return (mean, var, count), params

    def statistics(self, params: Params) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The stored ``(running_mean (D,), running_var (D,), count ())``."""
        values = tuple(
            params.value(self.param_path(n)) for n in ("running_mean", "running_var", "count")
        )
        if any(v is None for v in values):
            raise BloxKeyError(
                f"RunningMeanStd '{self.path_str}': no statistics in params yet; call "
                "norm(params, x) or norm.update(params, x) first."
            )
        return values  # type: ignore[return-value]

    def _check_axis(self) -> None:
        """Raises, naming this layer and the axis, when ``axis_name`` is not bound by an
        enclosing ``jax.vmap`` / ``jax.shard_map`` (JAX's own error names neither)."""
        names = self.axis_name if isinstance(self.axis_name, tuple) else (self.axis_name,)
        for name in names if self.axis_name is not None else ():
            try:
                jax.lax.axis_size(name)
            except NameError as e:
                raise ValueError(
                    _UNBOUND_AXIS.format(kind="RunningMeanStd", path=self.path_str, axis=name)
                ) from e

    # -- calls -------------------------------------------------------------------------

    def __call__(
        self, params: Params, x: jax.Array, is_training: bool = True
    ) -> tuple[jax.Array, Params]:
        """Normalizes `x` ``(..., D)`` with the stored statistics, then merges `x` into
        them when ``is_training``; returns ``(y (..., D), params)``."""
        x = self._check(x)
        (mean, var, _), params = self._stats(params, x.shape[-1])
        sd = stats_dtype(x.dtype, mean.dtype)
        bshape = (1,) * (x.ndim - 1) + (x.shape[-1],)
        inv = jax.lax.rsqrt(var.astype(sd) + jnp.asarray(self.epsilon, sd)).reshape(bshape)
        y = (x.astype(sd) - mean.astype(sd).reshape(bshape)) * inv
        if self.clip is not None:
            y = jnp.clip(y, -self.clip, self.clip)
        if is_training:
            params = self.update(params, x)
        return y.astype(x.dtype), params

    def update(self, params: Params, x: jax.Array) -> Params:
        """Merges the values of `x` ``(..., D)`` (every axis but the last, and the lanes
        of ``axis_name``) into the statistics; returns the new params."""
        x = self._check(x)
        (mean, var, count), params = self._stats(params, x.shape[-1])
        sd = stats_dtype(x.dtype, mean.dtype)
        xs = jax.lax.stop_gradient(x.astype(sd)).reshape(-1, x.shape[-1])
        k = jnp.asarray(np.prod(x.shape[:-1], dtype=np.int64), sd)
        total = jnp.sum(xs, axis=0)
        self._check_axis()
        if self.axis_name is not None:
            k, total = jax.lax.psum((k, total), self.axis_name)
        batch_mean = total / k
        sq = jnp.sum(jnp.square(xs - batch_mean[None]), axis=0)
        if self.axis_name is not None:
            sq = jax.lax.psum(sq, self.axis_name)
        batch_var = sq / k
        n, m_a, v_a = count.astype(sd), mean.astype(sd), var.astype(sd)
        new_count = n + k
        delta = batch_mean - m_a
        new_mean = m_a + delta * (k / new_count)
        new_var = (v_a * n + batch_var * k + jnp.square(delta) * (n * k / new_count)) / new_count
        params = self.set_param(params, "running_mean", new_mean.astype(mean.dtype))
        params = self.set_param(params, "running_var", new_var.astype(var.dtype))
        return self.set_param(params, "count", new_count.astype(count.dtype))
