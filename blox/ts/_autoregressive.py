"""`ARModel`: autoregressive simulation with teacher forcing, free run and prediction mode."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from blox.core import Graph, Params, Rng
from blox.ts._models import SysIdModel

__all__ = ["ARModel", "ARState"]


class ARState(NamedTuple):
    """The carried state of an `ARModel`: the recurrent layers' states and ``y_last``
    ``[B, Cy]``, the previous output (normalized) that the next step takes as input."""

    rnn: tuple
    y_last: jax.Array


class ARModel(SysIdModel):
    """An autoregressive recurrent model: each step sees ``[u_t, y_{t-1}]`` (normalized).

    Legend: B batch, T time, Cu input / Cy output channels, H ``hidden_size``.

    Shapes: ``u [B, T, Cu]`` and measured ``y [B, T, Cy]`` (teacher forcing) ->
    ``y_hat [B, T, Cy]``; `simulate`: ``u [B, T, Cu]`` -> ``y_hat [B, T, Cy]``.

    Step ``t``: ``x_t = [norm_u(u_t), norm_y(y_{t-1})]``, ``h_t = rnn(x_t, h_{t-1})``,
    ``y_hat_t = denorm_y(head(h_t))``. Where ``y_{t-1}`` comes from:

    - **teacher forcing / prediction mode** (``model(params, u, y)``, used in training):
      the measured output, shifted by one step inside the model (``y_last`` of the state
      before the first step). The model is then a one-step-ahead predictor whose input is
      ``[u_normalized, y]``.
    - **free run** (`simulate`, evaluation): the model's own previous prediction, fed
      back in a ``lax.scan``; the first ``n_warmup`` steps may use the measured output
      to settle the state.

    Fed the true outputs, the two agree: teacher forcing on ``y = simulate(u)`` gives
    ``simulate(u)`` back.

    Args:
      graph: this model's node.
      u_stats, y_stats: the training statistics (see `SysIdModel`).
      rng: the `Rng` for initialization.
      hidden_size, num_layers, cell: the recurrent layers (as `RNNModel`).
      n_skip: warm-up steps excluded from the loss, and `simulate`'s default
        ``n_warmup``.
      is_static: Python-loop scan instead of ``lax.scan`` (teacher forcing).
      dtype, param_dtype: see `SysIdModel`.

    Returns (``model(params, u, y, prev_state=None, is_reset=None)``):
      ``((y_hat [B, T, Cy], ARState), params)``; where ``is_reset[b, t]`` the recurrent
      state and ``y_{t-1}`` of row b restart from zeros (the training mean).

    Parameters: the normalizers, ``<path>/rnn/layer_<i>/...`` (input ``Cu + Cy``
    features), ``<path>/head/{kernel,bias}`` ``(H, Cy)``, ``(Cy,)``.

    >>> import blox as bx, jax.numpy as jnp
    >>> from blox.ts import ARModel
    >>> g = bx.Graph('m'); rng = bx.Rng(g / 'rng')
    >>> model = ARModel(g / 'ar', ([0.0], [1.0]), ([0.0], [1.0]), rng, hidden_size=8)
    >>> u, y = jnp.ones((2, 30, 1)), jnp.zeros((2, 30, 1))
    >>> (y_tf, state), params = model(rng.seed(bx.Params(), seed=0), u, y)
    >>> y_free, params = model.simulate(params, u, y, n_warmup=10)
    >>> y_tf.shape, y_free.shape, state.y_last.shape
    ((2, 30, 1), (2, 30, 1), (2, 1))
    """

    def __init__(
        self,
        graph: Graph,
        u_stats: Any,
        y_stats: Any,
        rng: Rng | None,
        *,
        hidden_size: int = 64,
        num_layers: int = 1,
        cell: str = "gru",
        n_skip: int = 0,
        is_static: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(
            graph, u_stats, y_stats, n_skip=n_skip, dtype=dtype, param_dtype=param_dtype
        )
        self.rnn = self._make_rnn(rng, hidden_size, num_layers, cell, is_static)
        self.head = self._output_linear(rng)

    def initial_state(self, params: Params, u_t: ArrayLike) -> tuple[ARState, Params]:
        """``(state, params)``: zero recurrent states and ``y_last = 0`` (the mean)."""
        z, params = self.u_norm(params, jnp.asarray(u_t))
        rnn, params = self.rnn.initial_state(params, z)
        y_last = jnp.zeros((z.shape[0], self.num_outputs), z.dtype)
        return ARState(rnn, y_last), params

    def _check_state(self, state: Any) -> ARState:
        if not isinstance(state, ARState):
            raise TypeError(
                f"{self._where}: prev_state must be the ARState a previous call returned "
                f"(or None), got {type(state).__name__}. Carry `state` from "
                "`(y_hat, state), params = model(params, u, y, prev_state)`."
            )
        return state

    def __call__(
        self,
        params: Params,
        u: ArrayLike,
        y: ArrayLike,
        prev_state: ARState | None = None,
        is_reset: ArrayLike | None = None,
    ) -> tuple[tuple[jax.Array, ARState], Params]:
        """Teacher forcing: raw ``u`` ``[B, T, Cu]`` and measured ``y`` ``[B, T, Cy]`` ->
        ``((y_hat [B, T, Cy], ARState), params)``."""
        u, y = self._u(u), self._y(y)
        if y.shape[:2] != u.shape[:2]:
            raise ValueError(
                f"{self._where}: u {tuple(u.shape)} and y {tuple(y.shape)} must share "
                "[B, T] (sampled together)."
            )
        z, params = self.u_norm(params, u)
        yn, params = self.y_norm(params, y)
        if prev_state is None:
            prev_state, params = self.initial_state(params, u[:, 0])
        prev_state = self._check_state(prev_state)
        y_prev = jnp.concatenate([prev_state.y_last[:, None].astype(yn.dtype), yn[:, :-1]], 1)
        if is_reset is not None:
            reset = jnp.asarray(is_reset)
            y_prev = jnp.where(reset[..., None], jnp.zeros_like(y_prev), y_prev)
        x = jnp.concatenate([z, y_prev.astype(z.dtype)], axis=-1)
        (h, rnn_state), params = self.rnn(params, x, prev_state.rnn, is_reset)
        out, params = self.head(params, h)
        y_hat, params = self.y_norm.denormalize(params, out)
        return (y_hat, ARState(rnn_state, yn[:, -1])), params

    def forward(self, params, u, y=None, prev_state=None, is_reset=None):
        """Teacher forcing (the training loss's outputs); ``y`` is required."""
        if y is None:
            raise ValueError(
                f"{self._where}: teacher forcing needs the measured y [B, T, "
                f"{self.num_outputs}]; pass batch['y']."
            )
        return self(params, u, y, prev_state, is_reset)

    def simulate(
        self,
        params: Params,
        u: ArrayLike,
        y: ArrayLike | None = None,
        *,
        n_warmup: int | None = None,
        prev_state: ARState | None = None,
    ) -> tuple[jax.Array, Params]:
        """Free run (a ``lax.scan``): the model's predictions are fed back.

        Args:
          params: the model's params.
          u: raw input ``[B, T, Cu]``.
          y: measured output ``[B, T, Cy]``, read only for the first `n_warmup` steps
            (may be ``None`` when ``n_warmup == 0``).
          n_warmup: steps whose *next* input is the measured ``y_t`` (teacher forcing)
            before the model runs free; default ``n_skip``.
          prev_state: the state before step 0 (default: `initial_state`).

        Returns:
          ``(y_hat [B, T, Cy], params)``.
        """
        u = self._u(u)
        n_warmup = self.n_skip if n_warmup is None else n_warmup
        if isinstance(n_warmup, bool) or not isinstance(n_warmup, int) or n_warmup < 0:
            raise ValueError(f"{self._where}: n_warmup must be an int >= 0, got {n_warmup!r}.")
        if y is None:
            if n_warmup:
                raise ValueError(
                    f"{self._where}: simulate(n_warmup={n_warmup}) feeds the measured y "
                    "during the warm-up; pass y [B, T, Cy] or n_warmup=0."
                )
            y = jnp.zeros(u.shape[:2] + (self.num_outputs,), u.dtype)
        y = self._y(y)
        if not params.is_locked:  # create the parameters on one teacher-forced step
            _, params = self(params, u[:, :1], y[:, :1])
        z, _ = self.u_norm(params, u)
        yn, _ = self.y_norm(params, y)
        if prev_state is None:
            prev_state, _ = self.initial_state(params, u[:, 0])
        prev_state = self._check_state(prev_state)
        measured = jnp.arange(u.shape[1]) < n_warmup

        def step(carry, inputs):
            rnn_state, y_last = carry
            z_t, yn_t, use_measured = inputs
            x_t = jnp.concatenate([z_t, y_last.astype(z_t.dtype)], axis=-1)
            (h, rnn_state), _ = self.rnn.step(params, x_t, rnn_state)
            o, _ = self.head(params, h)
            y_next = jnp.where(use_measured, yn_t.astype(o.dtype), o)
            return (rnn_state, y_next.astype(y_last.dtype)), o

        xs = (jnp.swapaxes(z, 0, 1), jnp.swapaxes(yn, 0, 1), measured)
        _, outs = jax.lax.scan(step, (prev_state.rnn, prev_state.y_last), xs)
        y_hat, params = self.y_norm.denormalize(params, jnp.swapaxes(outs, 0, 1))
        return y_hat, params
