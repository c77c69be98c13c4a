"""`CRNN`: a TCN front end feeding stacked recurrent layers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from blox.core import Graph, Params, Rng
from blox.ts._models import SysIdModel
from blox.ts._tcn import TCNBlocks

__all__ = ["CRNN"]


class CRNN(SysIdModel):
    """A convolutional-recurrent simulation model: `TCNBlocks` front, RNN back.

    Legend: B batch, T time, Cu input / Cy output channels, C ``channels``,
    H ``hidden_size``.

    Shapes: ``u [B, T, Cu]`` -> ``y_hat [B, T, Cy]``, plus the recurrent state.

    ``y = denorm(head(rnn(TCNBlocks(norm(u)))))``: the causal convolutions extract local
    features over `receptive_field` samples, the recurrent layers carry the long memory.
    The state (the recurrent layers') is carried across truncated-BPTT chunks; the
    convolution front sees each chunk alone (zero history at a chunk's start), so give
    chunks much longer than the receptive field.

    Args:
      graph: this model's node.
      u_stats, y_stats: the training statistics (see `SysIdModel`).
      rng: the `Rng` for initialization.
      channels, kernel_size, dilations, activation: the `TCNBlocks` front (default
        dilations ``(1, 2, 4)``).
      hidden_size, num_layers, cell: the recurrent back (as `RNNModel`).
      n_skip: warm-up steps excluded from the loss.
      is_static: Python-loop scan instead of ``lax.scan``.
      dtype, param_dtype: see `SysIdModel`.

    Returns (``model(params, u, prev_state=None, is_reset=None)``):
      ``((y [B, T, Cy], state), params)``, ``state`` a tuple of layer states.

    Parameters: the normalizers, ``<path>/tcn/...`` (`TCNBlocks`),
    ``<path>/rnn/layer_<i>/...``, ``<path>/head/{kernel,bias}`` ``(H, Cy)``, ``(Cy,)``.

    >>> import blox as bx, jax.numpy as jnp
    >>> from blox.ts import CRNN
    >>> g = bx.Graph('m'); rng = bx.Rng(g / 'rng')
    >>> model = CRNN(g / 'crnn', ([0.0], [1.0]), ([0.0], [1.0]), rng, channels=8,
    ...              hidden_size=8, cell='lstm')
    >>> (y, state), params = model(rng.seed(bx.Params(), seed=0), jnp.ones((2, 40, 1)))
    >>> y.shape, state[0].cell.shape
    ((2, 40, 1), (2, 8))
    """

    def __init__(
        self,
        graph: Graph,
        u_stats: Any,
        y_stats: Any,
        rng: Rng | None,
        *,
        channels: int = 32,
        kernel_size: int = 3,
        dilations: Sequence[int] = (1, 2, 4),
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
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
        self.tcn = self._child(
            TCNBlocks,
            "tcn",
            channels,
            rng,
            kernel_size=kernel_size,
            dilations=dilations,
            activation=activation,
        )
        self.rnn = self._make_rnn(rng, hidden_size, num_layers, cell, is_static)
        self.head = self._output_linear(rng)

    @property
    def receptive_field(self) -> int:
        """The receptive field of the convolution front, in samples."""
        return self.tcn.receptive_field

    def initial_state(self, params: Params, u_t: ArrayLike) -> tuple[Any, Params]:
        """``(state, params)``: zeros for every recurrent layer, for ``u_t`` ``[B, Cu]``."""
        return self._zero_rnn_state(params, u_t)

    def _core(self, params, z, prev_state, is_reset):
        h, params = self.tcn(params, z)
        (h, state), params = self.rnn(params, h, prev_state, is_reset)
        out, params = self.head(params, h)
        return (out, state), params
