"""Physics-informed training: ODE residuals whose time derivatives come from autodiff.

Seed 000's PIRNN computes derivatives with finite differences of the predicted sequence;
here the model is a function of continuous time and `time_derivatives` differentiates it
exactly with nested ``jax.jvp`` (forward mode: one pass per order, any number of output
channels), so the residual of a known ODE (`msd_residual`: a mass-spring-damper) becomes
a loss term that needs no measured outputs at the collocation points.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from blox.core import Graph, Params, Rng
from blox.nn import MLP
from blox.ts._models import SysIdModel

__all__ = ["PINN", "msd_residual", "physics_loss", "time_derivatives"]


def time_derivatives(
    fn: Callable[[jax.Array], jax.Array], t: ArrayLike, order: int = 2
) -> tuple[jax.Array, ...]:
    """``(x, dx/dt, ..., d^order x/dt^order)`` of ``x = fn(t)`` by nested ``jax.jvp``.

    `fn` maps times ``[N]`` to values ``[N, C]`` (or ``[N]``) *pointwise* (row n depends
    on ``t[n]`` only, as a network applied to each time is), so one forward-mode pass
    with tangent ones gives every row's derivative at once; each order nests one more
    ``jvp``. Exact up to float rounding, unlike finite differences.

    Args:
      fn: ``t [N] -> x [N, ...]``, pointwise in t.
      t: ``[N]`` times.
      order: the highest derivative (>= 0).

    Returns:
      ``order + 1`` arrays shaped like ``fn(t)``.

    >>> import jax.numpy as jnp
    >>> x, dx, ddx = time_derivatives(lambda t: jnp.sin(2.0 * t), jnp.array([0.0, 1.0]))
    >>> bool(jnp.allclose(ddx, -4.0 * x)), bool(jnp.allclose(dx[0], 2.0))
    (True, True)
    """
    if isinstance(order, bool) or not isinstance(order, int) or order < 0:
        raise ValueError(f"time_derivatives: order must be an int >= 0, got {order!r}.")
    t = jnp.asarray(t)
    if t.ndim != 1 or not jnp.issubdtype(t.dtype, jnp.floating):
        raise ValueError(
            f"time_derivatives: t must be a floating [N] array of times, got shape "
            f"{tuple(t.shape)} and dtype {t.dtype}."
        )

    def nest(f: Callable, k: int) -> Callable:
        # Returns g(t) -> (f(t), f'(t), ..., f^(k)(t)).
        if k == 0:
            return lambda s: (f(s),)
        inner = nest(f, k - 1)
        return lambda s: _jvp_all(inner, s)

    def _jvp_all(inner: Callable, s: jax.Array) -> tuple:
        values, tangents = jax.jvp(inner, (s,), (jnp.ones_like(s),))
        return (*values, tangents[-1])

    return nest(fn, order)(t)


def msd_residual(
    x: ArrayLike,
    dx: ArrayLike,
    ddx: ArrayLike,
    force: ArrayLike,
    *,
    mass: float,
    damping: float,
    stiffness: float,
) -> jax.Array:
    """The mass-spring-damper residual ``m x'' + c x' + k x - F`` (zero on a solution).

    Args:
      x, dx, ddx: position and its first two time derivatives (same shapes).
      force: the applied force ``F``, broadcastable to them.
      mass, damping, stiffness: ``m > 0``, ``c >= 0``, ``k >= 0``.

    Returns:
      The residual, shaped like `x`.
    """
    if not (mass > 0 and damping >= 0 and stiffness >= 0):
        raise ValueError(
            f"msd_residual: need mass > 0, damping >= 0, stiffness >= 0; got {mass}, "
            f"{damping}, {stiffness}."
        )
    x, dx, ddx = jnp.asarray(x), jnp.asarray(dx), jnp.asarray(ddx)
    f = jnp.broadcast_to(jnp.asarray(force).astype(x.dtype), x.shape)
    return mass * ddx + damping * dx + stiffness * x - f


class PINN(SysIdModel):
    """A physics-informed network of continuous time: ``t -> x(t)``, raw-in/raw-out.

    Legend: N time points, C output channels.

    Shapes: ``t [N]`` -> ``x [N, C]``.

    ``x(t) = denorm(MLP(norm(t)))`` with a smooth activation (tanh), so its time
    derivatives exist and `time_derivatives` computes them exactly. Trained on sparse
    measurements plus `physics_loss` at collocation points (no measurement needed there).

    Args:
      graph: this model's node.
      t_stats: ``(mean, std)`` of the time axis (e.g. of the collocation grid).
      y_stats: ``(mean, std)`` of the measured output, ``(C,)`` each.
      rng: the `Rng` for initialization.
      hidden_sizes: widths of the hidden layers.
      activation: a smooth activation (default ``jnp.tanh``).

    Returns (``model(params, t [N])``): ``(x [N, C], params)``.

    Parameters: ``<path>/u_norm/{mean,std}`` ``(1,)`` (time), ``<path>/y_norm/{mean,std}``
    ``(C,)``, ``<path>/mlp/linear_<i>/{kernel,bias}``.

    >>> import blox as bx, jax.numpy as jnp
    >>> from blox.ts import PINN
    >>> g = bx.Graph('m'); rng = bx.Rng(g / 'rng')
    >>> net = PINN(g / 'pinn', ([5.0], [3.0]), ([0.0], [1.0]), rng, hidden_sizes=(16,))
    >>> x, params = net(rng.seed(bx.Params(), seed=0), jnp.linspace(0.0, 10.0, 7))
    >>> x.shape
    (7, 1)
    """

    def __init__(
        self,
        graph: Graph,
        t_stats: Any,
        y_stats: Any,
        rng: Rng | None,
        *,
        hidden_sizes: Sequence[int] = (64, 64, 64),
        activation: Callable[[jax.Array], jax.Array] = jnp.tanh,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph, t_stats, y_stats, dtype=dtype, param_dtype=param_dtype)
        if self.num_inputs != 1:
            raise ValueError(
                f"{self._where}: t_stats must describe one channel (time), got {self.num_inputs}."
            )
        self.mlp = MLP(
            graph / "mlp",
            (*tuple(hidden_sizes), self.num_outputs),
            rng,
            activation=activation,
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def __call__(self, params: Params, t: ArrayLike) -> tuple[jax.Array, Params]:
        """Times ``t`` ``[N]`` -> ``(x [N, C], params)``."""
        t = jnp.asarray(t)
        if t.ndim != 1:
            raise ValueError(f"{self._where}: t must be [N] times, got shape {tuple(t.shape)}.")
        z, params = self.u_norm(params, t[:, None])
        h, params = self.mlp(params, z)
        return self.y_norm.denormalize(params, h)

    def forward(self, params, u, y=None, prev_state=None, is_reset=None):
        """``u`` is the time ``[N]``: ``((x [N, C], None), params)``."""
        x, params = self(params, u)
        return (x, None), params

    def simulate(self, params, u, y=None):
        """``u`` is the time ``[N]``: ``(x [N, C], params)``."""
        return self(params, u)

    def derivatives(self, params: Params, t: ArrayLike, order: int = 2) -> tuple[jax.Array, ...]:
        """``(x, x', ..., x^(order))`` at times ``t`` ``[N]`` (`time_derivatives`)."""
        return time_derivatives(lambda s: self(params, s)[0], t, order)


def physics_loss(
    model: PINN,
    params: Params,
    t: ArrayLike,
    force: ArrayLike,
    *,
    mass: float,
    damping: float,
    stiffness: float,
) -> jax.Array:
    """Mean squared mass-spring-damper residual at collocation times ``t`` ``[N]``,
    divided by ``(k * std_x)^2`` (``std_x^2`` when ``k = 0``) so it is of order one
    whatever the units.

    Args:
      model: a `PINN` (or anything with ``derivatives`` and ``y_norm``).
      params: its params.
      t: ``[N]`` collocation times.
      force: ``[N]`` (or ``[N, C]``) applied force at those times.
      mass, damping, stiffness: the ODE's coefficients (see `msd_residual`).

    Returns:
      A scalar.
    """
    x, dx, ddx = model.derivatives(params, t, 2)
    f = jnp.asarray(force)
    f = f.reshape(x.shape) if f.size == x.size else f
    r = msd_residual(x, dx, ddx, f, mass=mass, damping=damping, stiffness=stiffness)
    std = model.y_norm.std(params).astype(r.dtype)
    scale = (stiffness if stiffness else 1.0) * std.reshape((1,) * (r.ndim - 1) + (-1,))
    return jnp.mean(jnp.square(r / scale))
