"""Recurrent layers: `LSTM`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from blox.core import Graph, Params, RecurrenceBase, Rng
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
    ``(4H,)``; the columns are the gates in the order i, g, f, o.

    Calls:
      ``lstm(params, x_t [B, F], state, is_reset=None)`` -> ``((h [B, H], LSTMState),
      params)``; ``lstm.apply(params, x [B, T, F], prev_state=None, is_reset=None [B, T],
      seq_lengths=None [B])`` -> ``((h [B, T, H], LSTMState), params)``: see
      `RecurrenceBase.apply` for resets and sequence lengths.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> lstm = bx.LSTM(g / 'lstm', hidden_size=4, rng=rng)
    >>> (h, state), params = lstm.apply(rng.seed(bx.Params(), seed=0), jnp.ones((2, 5, 3)))
    >>> h.shape, state.cell.shape
    ((2, 5, 4), (2, 4))
    """

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
        """Zeros ``[B, H]`` for hidden and cell; B is ``inputs.shape[0]``; the dtype is
        the compute dtype (see `Linear`)."""
        x = jnp.asarray(jax.tree.leaves(inputs)[0])
        shape = (x.shape[0], self.hidden_size)
        dt = self._state_dtype(params, x)
        return LSTMState(jnp.zeros(shape, dt), jnp.zeros(shape, dt)), params

    def __call__(
        self,
        params: Params,
        inputs: jax.Array,
        prev_state: LSTMState | None = None,
        is_reset: jax.Array | None = None,
        is_training: bool = True,
    ) -> tuple[tuple[jax.Array, LSTMState], Params]:
        """One step. ``inputs``: ``[B, F]``; ``is_reset``: ``[B]``."""
        if prev_state is None:
            raise ValueError(
                f"The LSTM __call__ method requires a valid prev_state ('{self.path_str}' "
                "runs one step). Get one from lstm.initial_state(params, x_t), or run a whole "
                "sequence with lstm.apply(params, x)."
            )
        x = jnp.asarray(inputs)
        if x.ndim != 2:
            raise ValueError(
                f"LSTM '{self.path_str}': one step takes inputs of shape [B, F], got "
                f"{tuple(x.shape)}. For a sequence [B, T, F] use lstm.apply(params, x)."
            )
        kernel = params._get_value(self.gates.param_path("kernel"))
        if kernel is not None and hasattr(kernel, "shape"):
            expected = kernel.shape[0] - self.hidden_size
            if x.shape[-1] != expected:
                raise ValueError(
                    f"LSTM '{self.path_str}' expects inputs with {expected} features "
                    f"(gates kernel {tuple(kernel.shape)} = (F + H, 4H) with H="
                    f"{self.hidden_size}), got input shape {tuple(x.shape)}."
                )
        h, c = self.maybe_reset_state(params, prev_state, x, is_reset)
        dt = self._state_dtype(params, x)
        gates, params = self.gates(params, jnp.concatenate([x.astype(dt), h], axis=-1))
        i, g, f, o = jnp.split(gates, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, LSTMState(h, c)), params
