"""`Normalize`: per-channel statistics kept inside the model as non-trainable params."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from blox.core import Graph, Module, Params
from blox.nn._dtype import compute_dtype

__all__ = ["Normalize"]


class Normalize(Module):
    """Per-channel standardization with the statistics stored as non-trainable params.

    ``normalize``: ``(x - mean) / std``; ``denormalize``: ``z * std + mean``. A model
    holds one `Normalize` for its inputs and one for its outputs, so it takes and
    returns raw physical values (raw-in/raw-out) while computing in normalized units::

        u_norm = Normalize(graph / 'u_norm', stats['u'].mean, stats['u'].std)
        y_norm = Normalize(graph / 'y_norm', stats['y'].mean, stats['y'].std)
        z, params = u_norm(params, u)                      # raw u -> normalized
        h, params = rnn(params, z) ...
        y, params = y_norm.denormalize(params, out)        # normalized -> raw y

    The statistics (from `channel_stats` on the training split) are only used to create
    the params; afterwards the params are the truth (a restored checkpoint brings its
    own). They are non-trainable, so `Params.split` leaves them out of the gradients,
    and a loss in normalized units takes ``y_norm.std(params)`` (e.g.
    ``bx.normalized_mse(pred, y, y_norm.std(params))``).

    Shapes: ``(..., C)`` -> ``(..., C)`` (channels last, any leading axes).

    Dtype policy: ``mean``/``std`` stored in ``param_dtype`` (default float32); computed
    in ``dtype`` if given, else in the standard promotion of the input dtype and
    ``param_dtype`` (bf16 or uint8 inputs with float32 params compute in float32); the
    output has the compute dtype.

    Args:
      graph: this module's node.
      mean: ``(C,)`` per-channel means (or a scalar for one channel).
      std: ``(C,)`` per-channel standard deviations, all > 0.
      dtype: the compute dtype (default: promotion of input and ``param_dtype``).
      param_dtype: the dtype the statistics are stored in.

    Parameters (``C`` channels): ``<path>/mean`` ``(C,)`` and ``<path>/std`` ``(C,)``,
    both non-trainable.

    Raises ``ValueError`` when ``mean`` and ``std`` differ in shape, when either is not
    finite (NaN or inf in the data they came from: `channel_stats` names where), when a
    ``std`` is not positive (a constant channel: replace its 0 by 1, e.g.
    ``np.where(std == 0, 1.0, std)``), and when the input's last axis is not ``C``.

    >>> import blox as bx, jax.numpy as jnp
    >>> from blox.data import Normalize
    >>> norm = Normalize(bx.Graph('net') / 'y_norm', mean=[1.0, 10.0], std=[2.0, 5.0])
    >>> z, params = norm(bx.Params(), jnp.array([[3.0, 0.0]]))
    >>> z
    Array([[ 1., -2.]], dtype=float32)
    >>> norm.denormalize(params, z)[0]
    Array([[3., 0.]], dtype=float32)
    >>> params[('net', 'y_norm', 'std')].trainable
    False
    """

    def __init__(
        self,
        graph: Graph,
        mean: ArrayLike,
        std: ArrayLike,
        *,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        m = np.atleast_1d(np.asarray(mean, dtype=np.float64))
        s = np.atleast_1d(np.asarray(std, dtype=np.float64))
        if m.ndim != 1 or m.shape != s.shape:
            raise ValueError(
                f"Normalize '{self.path_str}': mean has shape {m.shape} and std {s.shape}; "
                "both must be (C,) for C channels, e.g. the mean and std of "
                "channel_stats(train_source)['u']."
            )
        for what, v in (("mean", m), ("std", s)):
            bad = np.flatnonzero(~np.isfinite(v))
            if bad.size:
                raise ValueError(
                    f"Normalize '{self.path_str}': {what} is not finite in channels "
                    f"{bad.tolist()} ({v[bad].tolist()}): the data the statistics came "
                    "from holds NaN or inf there. channel_stats(source) names the first "
                    "such value (file, dataset, channel, sample) unless given "
                    "check_finite=False; fix or leave out that data and recompute the "
                    "statistics (replacing the nan here would only hide it)."
                )
        bad = np.flatnonzero(s <= 0)
        if bad.size:
            raise ValueError(
                f"Normalize '{self.path_str}': std must be positive, but channels "
                f"{bad.tolist()} have std {s[bad].tolist()}. A constant channel has std 0: "
                "replace those zeros by 1, e.g. std=np.where(std == 0, 1.0, std) (a "
                "negative std is not a standard deviation: check where it came from)."
            )
        self.num_channels = int(m.shape[0])
        self._mean, self._std = m, s
        self.dtype = dtype
        self.param_dtype = param_dtype

    def _stats(self, params: Params) -> tuple[jax.Array, jax.Array, Params]:
        shape = (self.num_channels,)
        mean, params = self.get_param(
            params,
            "mean",
            shape,
            lambda k, sh, dt: jnp.asarray(self._mean, dt),
            dtype=self.param_dtype,
            trainable=False,
        )
        std, params = self.get_param(
            params,
            "std",
            shape,
            lambda k, sh, dt: jnp.asarray(self._std, dt),
            dtype=self.param_dtype,
            trainable=False,
        )
        return mean, std, params

    def _check(self, x: jax.Array, what: str) -> None:
        if x.ndim == 0 or x.shape[-1] != self.num_channels:
            raise ValueError(
                f"Normalize '{self.path_str}': {what} has shape {tuple(x.shape)}, but the "
                f"statistics have {self.num_channels} channels; the last axis must be "
                f"{self.num_channels} (channels last, e.g. [B, T, {self.num_channels}])."
            )

    def __call__(self, params: Params, x: ArrayLike) -> tuple[jax.Array, Params]:
        """``(x - mean) / std``: raw values ``(..., C)`` to normalized ones."""
        x = jnp.asarray(x)
        self._check(x, "input")
        mean, std, params = self._stats(params)
        dt = compute_dtype(x, mean.dtype, self.dtype)
        shape = (1,) * (x.ndim - 1) + (self.num_channels,)
        mean, std = mean.astype(dt).reshape(shape), std.astype(dt).reshape(shape)
        return (x.astype(dt) - mean) / std, params

    normalize = __call__

    def denormalize(self, params: Params, z: ArrayLike) -> tuple[jax.Array, Params]:
        """``z * std + mean``: normalized values ``(..., C)`` back to raw ones."""
        z = jnp.asarray(z)
        self._check(z, "input")
        mean, std, params = self._stats(params)
        dt = compute_dtype(z, mean.dtype, self.dtype)
        shape = (1,) * (z.ndim - 1) + (self.num_channels,)
        mean, std = mean.astype(dt).reshape(shape), std.astype(dt).reshape(shape)
        return z.astype(dt) * std + mean, params

    def mean(self, params: Params) -> jax.Array:
        """The stored ``(C,)`` means (the params must hold them: call the module once)."""
        return self.get_param(params, "mean")[0]

    def std(self, params: Params) -> jax.Array:
        """The stored ``(C,)`` standard deviations (e.g. for `normalized_mse`)."""
        return self.get_param(params, "std")[0]
