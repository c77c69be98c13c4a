"""Mixed precision: a dtype `Policy` and fp16 dynamic loss scaling with explicit state."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["DynamicLossScale", "LossScaleState", "Policy", "all_finite"]

_SUPPORTED = ("float16", "bfloat16", "float32", "float64")


def _check_dtype(field: str, dtype: Any) -> Any:
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in _SUPPORTED:
        raise ValueError(
            f"Policy: {field}={dtype!r} is not supported; use one of {', '.join(_SUPPORTED)} "
            "(e.g. Policy(compute_dtype='bfloat16') for bf16 compute with fp32 master params)."
        )
    return dt


def _cast_floating(tree: Any, dtype: Any) -> Any:
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Which dtype parameters are stored in, computed in, and outputs are returned in.

    The usual mixed-precision setup is ``Policy(compute_dtype='bfloat16')``: master
    parameters stay float32 (what the optimizer updates), the forward and backward pass
    run in bf16, and the loss comes back in float32. Only floating leaves are cast;
    integer leaves (RNG counters, labels) and PRNG keys are left alone.

    How `make_train_step` / `value_and_grad` apply it (all casts explicit, no hidden
    state): the *trainable* params are cast to `compute_dtype` inside the differentiated
    function, so gradients arrive in the master dtype; floating leaves of the batch are
    cast to `compute_dtype`; non-trainable state (e.g. BatchNorm statistics) is passed as
    stored and cast back to its stored dtype after the forward pass; the loss is cast to
    `output_dtype`.

    Args:
      param_dtype: the master-parameter dtype (checked: stored trainable params must have
        it; default float32).
      compute_dtype: the dtype of the forward and backward pass.
      output_dtype: the dtype of the loss and metrics (default float32).

    Supported dtypes: float16, bfloat16, float32, float64; anything else raises.

    >>> import jax.numpy as jnp
    >>> policy = Policy(compute_dtype='bfloat16')
    >>> policy.cast_to_compute({'x': jnp.ones(2), 'label': jnp.ones(2, jnp.int32)})['x'].dtype
    dtype(bfloat16)
    """

    param_dtype: Any = "float32"
    compute_dtype: Any = "float32"
    output_dtype: Any = "float32"

    def __post_init__(self) -> None:
        for f in ("param_dtype", "compute_dtype", "output_dtype"):
            object.__setattr__(self, f, _check_dtype(f, getattr(self, f)))

    def cast_to_compute(self, tree: Any) -> Any:
        """Casts the floating leaves of `tree` to `compute_dtype`."""
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_param(self, tree: Any) -> Any:
        """Casts the floating leaves of `tree` to `param_dtype`."""
        return _cast_floating(tree, self.param_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        """Casts the floating leaves of `tree` to `output_dtype`."""
        return _cast_floating(tree, self.output_dtype)


def all_finite(tree: Any) -> jax.Array:
    """``True`` (a bool scalar array) when every floating leaf of `tree` is finite.

    >>> import jax.numpy as jnp
    >>> bool(all_finite({'a': jnp.ones(2), 'b': jnp.array([1.0, jnp.inf])}))
    False
    """
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack(leaves).all()


class LossScaleState(NamedTuple):
    """The state of `DynamicLossScale`: a plain pytree the user threads through steps.

    Attributes:
      scale: float32 scalar, the current loss scale.
      good_steps: int32 scalar, finite steps since the scale last changed.
    """

    scale: jax.Array
    good_steps: jax.Array


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling for float16 training (static configuration only).

    The loss is multiplied by ``scale`` before differentiation and the gradients divided
    by it, so small fp16 gradients do not underflow. After each step:

    * gradients not all finite: the step is skipped (params and optimizer state are kept)
      and ``scale = max(scale / factor, min_scale)``, ``good_steps = 0``;
    * finite: ``good_steps += 1``; when it reaches `period`, ``scale *= factor`` (capped at
      `max_scale`) and ``good_steps = 0``.

    The state is a `LossScaleState` made by `init`; `make_train_step` (with
    ``loss_scale=``) threads it as ``step(params, opt_state, ls_state, *batch)``.

    Args:
      initial_scale: the starting scale (default ``2 ** 15``).
      period: finite steps before the scale grows (default 2000).
      factor: growth / shrink factor (default 2).
      min_scale: lower bound of the scale (default 1).
      max_scale: upper bound of the scale (default ``2 ** 24``).

    >>> ls = DynamicLossScale(initial_scale=8.0, period=2)
    >>> s = ls.init()
    >>> s = ls.adjust(s, jnp.asarray(False)); float(s.scale)
    4.0
    >>> s = ls.adjust(ls.adjust(s, jnp.asarray(True)), jnp.asarray(True)); float(s.scale)
    8.0
    """

    initial_scale: float = 2.0**15
    period: int = 2000
    factor: float = 2.0
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def __post_init__(self) -> None:
        if not self.initial_scale > 0 or not self.min_scale > 0:
            raise ValueError(
                f"DynamicLossScale: initial_scale ({self.initial_scale}) and min_scale "
                f"({self.min_scale}) must be positive."
            )
        if not isinstance(self.period, int) or self.period < 1:
            raise ValueError(f"DynamicLossScale: period must be an int >= 1, got {self.period!r}.")
        if not self.factor > 1:
            raise ValueError(f"DynamicLossScale: factor must be > 1, got {self.factor}.")

    def init(self) -> LossScaleState:
        """The initial state: ``scale = initial_scale``, ``good_steps = 0``."""
        return LossScaleState(
            jnp.asarray(self.initial_scale, jnp.float32), jnp.zeros((), jnp.int32)
        )

    def scale(self, loss: jax.Array, state: LossScaleState) -> jax.Array:
        """``loss * scale`` (in the loss dtype)."""
        return loss * state.scale.astype(loss.dtype)

    def unscale(self, grads: Any, state: LossScaleState) -> Any:
        """Divides every floating leaf of `grads` by the scale (in that leaf's dtype)."""

        def f(g):
            if hasattr(g, "dtype") and jnp.issubdtype(g.dtype, jnp.floating):
                return g / state.scale.astype(g.dtype)
            return g

        return jax.tree.map(f, grads)

    def adjust(self, state: LossScaleState, finite: jax.Array) -> LossScaleState:
        """The state after a step whose gradients were `finite` (a bool scalar)."""
        f = jnp.asarray(self.factor, jnp.float32)
        grown = state.good_steps + 1 >= self.period
        up = jnp.where(grown, jnp.minimum(state.scale * f, self.max_scale), state.scale)
        down = jnp.maximum(state.scale / f, jnp.asarray(self.min_scale, jnp.float32))
        scale = jnp.where(finite, up, down)
        good = jnp.where(finite & ~grown, state.good_steps + 1, jnp.zeros((), jnp.int32))
        return LossScaleState(scale, good)
