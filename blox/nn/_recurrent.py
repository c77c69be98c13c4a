"""Recurrent layers: `LSTM`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from blox.core import Graph, Params, Rng
from blox.core._params import Path
from blox.core._sharding import reshard_like
from blox.nn._cell import CellBase, StoredWeight
from blox.nn._linear import Linear

__all__ = ["LSTM", "LSTMState"]


class LSTMState(NamedTuple):
    """The carried state of an `LSTM`: ``hidden`` and ``cell``, each ``[B, H]``."""

    hidden: jax.Array
    cell: jax.Array


class LSTM(CellBase):
    """Long short-term memory (Hochreiter & Schmidhuber, 1997), PyTorch's equations.

    Legend: B batch, T time, F input features, H ``hidden_size``.

    Shapes: one step ``x_t [B, F]`` -> ``h [B, H]``; a sequence (`apply`)
    ``x [B, T, F]`` -> ``[B, T, H]``, plus the final state.

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

    _STATE = LSTMState
    _STATE_ARTICLE = "an"

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
        super().__init__(graph, hidden_size, is_static, dtype=dtype, param_dtype=param_dtype)
        extra = {}
        if kernel_init is not None:
            extra["kernel_init"] = kernel_init
        if bias_init is not None:
            extra["bias_init"] = bias_init
        self.gates = Linear(
            graph.child("gates"),
            4 * self.hidden_size,
            rng,
            dtype=dtype,
            param_dtype=param_dtype,
            **extra,
        )

    def _dtype_kernel_path(self) -> Path:
        return self.gates.param_path("kernel")

    def _stored_weights(self, features: int) -> list[StoredWeight]:
        hs = self.hidden_size
        return [
            StoredWeight(
                self.gates.param_path("kernel"), (features + hs, 4 * hs), "(F + H, 4H)", hs
            ),
            StoredWeight(self.gates.param_path("bias"), (4 * hs,), "(4H,)"),
        ]

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
        x = jnp.asarray(inputs)
        state = self._check_step(params, x, prev_state)
        h, c = self.maybe_reset_state(params, state, x, is_reset)
        dt = self._state_dtype(params, x)
        gates, params = self.gates(params, jnp.concatenate([x.astype(dt), h], axis=-1))
        i, g, f, o = jnp.split(gates, 4, axis=-1)
        c_new = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h_new = jax.nn.sigmoid(o) * jnp.tanh(c_new)
        # The carried state keeps its sharding type (lax.scan needs it; Explicit meshes).
        h, c = reshard_like((h_new, c_new), (h, c))
        return (h, LSTMState(h, c)), params
