"""Recurrent layers: `LSTM`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from blox.core import Graph, Params, RecurrenceBase, Rng
from blox.core._module import stored_shape_error
from blox.core._params import format_path
from blox.nn._linear import Linear, compute_dtype

__all__ = ["LSTM", "LSTMState"]


class LSTMState(NamedTuple):
    """The carried state of an `LSTM`: ``hidden`` and ``cell``, each ``[B, H]``."""

    hidden: jax.Array
    cell: jax.Array


class LSTM(RecurrenceBase):
    """Long short-term memory (Hochreiter & Schmidhuber, 1997), PyTorch's equations.

    Legend: B batch, T time, F input features, H ``hidden_size``.

    One step (``__call__``), with ``[i, g, f, o] = [x, h] @ W + b``::

        c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h' = sigmoid(o) * tanh(c')

    Args:
      graph: this module's node.
      hidden_size: H.
      rng: the `Rng` for initialization.
      is_static: `apply` uses a Python loop (``True``) or ``lax.scan`` (``False``).
      kernel_init, bias_init: for the gate `Linear` (LeCun normal / zeros; no
        forget-gate bias offset, as in PyTorch).
      dtype: compute dtype (default: promotion of input and param dtypes); the state
        has this dtype.
      param_dtype: dtype of the parameters (float32).

    Parameters: ``<path>/gates/kernel`` ``(F + H, 4H)`` and ``<path>/gates/bias``
    ``(4H,)``; the columns are the gates in the order i, g, f, o. A stored kernel whose
    shape cannot fit (not ``(F + H, 4H)``, e.g. a ported weight left transposed) raises
    a ``ValueError`` naming its path, its shape and the expected one.

    Calls:
      ``state, params = lstm.initial_state(params, x_t [B, F])``: zeros (a pair, like
      every blox call; pass ``state`` on, not the pair).
      ``lstm(params, x_t [B, F], state, is_reset=None)`` -> ``((h [B, H], LSTMState),
      params)``; ``lstm.apply(params, x [B, T, F], prev_state=None, is_reset=None [B, T],
      seq_lengths=None [B])`` -> ``((h [B, T, H], LSTMState), params)``: see
      `RecurrenceBase.apply` for resets and sequence lengths. ``apply`` needs rank-3
      inputs; ``prev_state`` must be an `LSTMState` (or a ``(hidden, cell)`` pair of
      ``[B, H]`` arrays), else it raises an error that says what to pass.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> lstm = bx.LSTM(g / 'lstm', hidden_size=4, rng=rng)
    >>> (h, state), params = lstm.apply(rng.seed(bx.Params(), seed=0), jnp.ones((2, 5, 3)))
    >>> h.shape, state.cell.shape
    ((2, 5, 4), (2, 4))
    """

    _STEP_INPUT_RANK = 2

    def __init__(
        self,
        graph: Graph,
        hidden_size: int,
        rng: Rng | None,
        is_static: bool = False,
        *,
        kernel_init: Callable | None = None,
        bias_init: Callable | None = None,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph, is_static=is_static)
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(
                f"LSTM '{self.path_str}': hidden_size must be a positive int, got {hidden_size!r}."
            )
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.param_dtype = param_dtype
        extra = {}
        if kernel_init is not None:
            extra["kernel_init"] = kernel_init
        if bias_init is not None:
            extra["bias_init"] = bias_init
        self.gates = Linear(
            graph.child("gates"),
            4 * hidden_size,
            rng,
            dtype=dtype,
            param_dtype=param_dtype,
            **extra,
        )

    def _state_dtype(self, params: Params, x: jax.Array) -> Any:
        kernel = params._get_value(self.gates.param_path("kernel"))
        pdt = getattr(kernel, "dtype", None) or self.param_dtype
        return compute_dtype(x, pdt, self.dtype)

    def initial_state(self, params: Params, inputs: Any) -> tuple[LSTMState, Params]:
        """Returns ``(LSTMState(zeros, zeros), params)`` for one step's inputs.

        Args:
          params: the current params (returned unchanged).
          inputs: one step's inputs ``[B, F]``; only B and the dtype are read.

        Returns:
          ``(state, params)``, a pair: hidden and cell are zeros ``[B, H]`` in the compute
          dtype (see `Linear`). Unpack it, ``state, params = lstm.initial_state(params,
          x_t)``, and pass ``state`` as ``prev_state``.
        """
        x = jnp.asarray(jax.tree.leaves(inputs)[0])
        shape = (x.shape[0], self.hidden_size)
        dt = self._state_dtype(params, x)
        return LSTMState(jnp.zeros(shape, dt), jnp.zeros(shape, dt)), params

    def _check_state(self, params: Params, prev_state: Any, inputs: Any) -> LSTMState:
        prev_state = super()._check_state(params, prev_state, inputs)
        where = f"LSTM '{self.path_str}'"
        expected = (jnp.shape(jax.tree.leaves(inputs)[0])[0], self.hidden_size)
        fix = (
            "Carry the state returned by the previous call, or build one with "
            "`state, params = lstm.initial_state(params, x_t)`."
        )
        if not (isinstance(prev_state, (tuple, list)) and len(prev_state) == 2):
            raise TypeError(
                f"{where}: prev_state must be an LSTMState(hidden, cell) with hidden and cell "
                f"[B, H] = {expected}, got {_describe(prev_state)}. {fix}"
            )
        h, c = prev_state
        hs, cs = getattr(h, "shape", None), getattr(c, "shape", None)
        if hs is None or cs is None or tuple(hs) != expected or tuple(cs) != expected:
            raise ValueError(
                f"{where}: prev_state must hold hidden and cell of shape [B, H] = {expected}, "
                f"got hidden: {_describe(h)}, cell: {_describe(c)}. {fix}"
            )
        return LSTMState(h, c)

    def _check_kernel(self, params: Params, x: jax.Array) -> None:
        path = self.gates.param_path("kernel")
        stored = getattr(params._get_value(path), "shape", None)
        if stored is None:
            return
        stored, hs = tuple(stored), self.hidden_size
        features = x.shape[-1]
        if len(stored) != 2 or stored[1] != 4 * hs:
            raise ValueError(
                stored_shape_error(
                    self,
                    path,
                    stored,
                    (features + hs, 4 * hs),
                    f" = (F + H, 4H) for F={features}, H={hs}",
                )
            )
        if stored[0] - hs != features:
            raise ValueError(
                f"LSTM '{self.path_str}' expects inputs with {stored[0] - hs} features "
                f"(gates kernel {stored} = (F + H, 4H) with H={hs}), got input shape "
                f"{tuple(x.shape)}. Fix the input's last dimension; or, if "
                f"'{format_path(path)}' was made for another input size, replace it or "
                "re-initialize."
            )

    def __call__(
        self,
        params: Params,
        inputs: jax.Array,
        prev_state: LSTMState | None = None,
        is_reset: jax.Array | None = None,
        is_training: bool = True,
    ) -> tuple[tuple[jax.Array, LSTMState], Params]:
        """One step. ``inputs``: ``[B, F]``; ``prev_state``: an `LSTMState` ``[B, H]``
        (from `initial_state` or the previous step); ``is_reset``: ``[B]``.

        Returns ``((h [B, H], LSTMState(h, c)), params)``."""
        if prev_state is None:
            raise ValueError(
                f"The LSTM __call__ method requires a valid prev_state ('{self.path_str}' "
                "runs one step). Get one with `state, params = lstm.initial_state(params, "
                "x_t)`, or run a whole sequence with lstm.apply(params, x)."
            )
        x = jnp.asarray(inputs)
        if x.ndim != 2:
            raise ValueError(
                f"LSTM '{self.path_str}': one step takes inputs of shape [B, F], got "
                f"{tuple(x.shape)}. For a sequence [B, T, F] use lstm.apply(params, x)."
            )
        self._check_kernel(params, x)
        state = self._check_state(params, prev_state, x)
        h, c = self.maybe_reset_state(params, state, x, is_reset)
        dt = self._state_dtype(params, x)
        gates, params = self.gates(params, jnp.concatenate([x.astype(dt), h], axis=-1))
        i, g, f, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, LSTMState(h, c)), params


def _describe(value: Any) -> str:
    """A short description of a value for error messages."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"array of shape {tuple(shape)}"
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__
