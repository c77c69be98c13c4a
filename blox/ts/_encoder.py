"""`EncoderModel`: the initial recurrent state from a window of past ``u`` and ``y``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from blox.core import Graph, Params, Rng
from blox.nn import MLP
from blox.ts._models import SysIdModel

__all__ = ["EncoderModel"]


class EncoderModel(SysIdModel):
    """A recurrent simulation model whose initial state is estimated by an encoder
    (SUBNET-style) instead of a warm-up.

    Legend: B batch, T time, Cu input / Cy output channels, n ``n_init``,
    H ``hidden_size``, L ``num_layers``.

    Shapes: ``u [B, T, Cu]`` and ``y [B, T, Cy]`` (only its first n steps are read) ->
    ``y_hat [B, T, Cy]``.

    An MLP maps the first n samples of normalized ``u`` and ``y`` (flattened,
    ``n (Cu + Cy)`` features) to the state of every recurrent layer at step n; the
    recurrent layers then simulate from ``u[:, n:]`` alone. The first n outputs are the
    measured ``y`` (the encoder's window), so ``n_skip >= n_init`` keeps them out of
    losses and metrics.

    Args:
      graph: this model's node.
      u_stats, y_stats: the training statistics (see `SysIdModel`).
      rng: the `Rng` for initialization.
      n_init: the encoder's window n (>= 1).
      hidden_size, num_layers, cell: the recurrent layers (as `RNNModel`).
      encoder_sizes: hidden widths of the encoder MLP (tanh between layers).
      n_skip: steps excluded from the loss; default and minimum `n_init`.
      is_static: Python-loop scan instead of ``lax.scan``.
      dtype, param_dtype: see `SysIdModel`.

    Returns (``model(params, u, y)``): ``((y_hat [B, T, Cy], state), params)`` with
    ``y_hat[:, :n] = y[:, :n]``; ``u`` and ``y`` need ``T > n``.

    Parameters: the normalizers, ``<path>/encoder/linear_<i>/{kernel,bias}`` (last
    layer ``(., L S H)``, S = 1 for GRU/RNN and 2 for LSTM), ``<path>/rnn/layer_<i>/...``,
    ``<path>/head/{kernel,bias}`` ``(H, Cy)``, ``(Cy,)``.

    >>> import blox as bx, jax.numpy as jnp
    >>> from blox.ts import EncoderModel
    >>> g = bx.Graph('m'); rng = bx.Rng(g / 'rng')
    >>> model = EncoderModel(g / 'enc', ([0.0], [1.0]), ([0.0], [1.0]), rng, n_init=10,
    ...                      hidden_size=8, cell='lstm')
    >>> u, y = jnp.ones((2, 30, 1)), jnp.zeros((2, 30, 1))
    >>> (y_hat, state), params = model(rng.seed(bx.Params(), seed=0), u, y)
    >>> y_hat.shape, model.n_skip, params[('m', 'enc', 'encoder', 'linear_1', 'bias')].value.shape
    ((2, 30, 1), 10, (16,))
    """

    def __init__(
        self,
        graph: Graph,
        u_stats: Any,
        y_stats: Any,
        rng: Rng | None,
        *,
        n_init: int,
        hidden_size: int = 64,
        num_layers: int = 1,
        cell: str = "gru",
        encoder_sizes: Sequence[int] = (64,),
        n_skip: int | None = None,
        is_static: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        if isinstance(n_init, bool) or not isinstance(n_init, int) or n_init < 1:
            raise ValueError(
                f"EncoderModel '{graph}': n_init must be a positive int, got {n_init!r}."
            )
        n_skip = n_init if n_skip is None else n_skip
        super().__init__(
            graph, u_stats, y_stats, n_skip=n_skip, dtype=dtype, param_dtype=param_dtype
        )
        if self.n_skip < n_init:
            raise ValueError(
                f"{self._where}: n_skip={n_skip} is below n_init={n_init}; the first n_init "
                "outputs are the measured y the encoder reads, so they must be skipped. "
                f"Use n_skip >= {n_init} (or leave it None)."
            )
        self.n_init = n_init
        self.rnn = self._make_rnn(rng, hidden_size, num_layers, cell, is_static)
        per_layer = 2 if cell == "lstm" else 1
        self.encoder = self._child(
            MLP,
            "encoder",
            (*tuple(encoder_sizes), num_layers * per_layer * hidden_size),
            rng,
            activation=jnp.tanh,
        )
        self.head = self._output_linear(rng)

    def encode(self, params: Params, u: ArrayLike, y: ArrayLike) -> tuple[Any, Params]:
        """The recurrent state at step n from raw ``u[:, :n]`` and ``y[:, :n]``
        (longer inputs are cut): ``(state, params)``."""
        u, y = self._u(u), self._y(y)
        n = self.n_init
        if u.shape[1] < n or y.shape[1] < n:
            raise ValueError(
                f"{self._where}: the encoder reads the first n_init={n} samples, got u "
                f"{tuple(u.shape)} and y {tuple(y.shape)}; give at least {n} steps."
            )
        z, params = self.u_norm(params, u[:, :n])
        yn, params = self.y_norm(params, y[:, :n])
        window = jnp.concatenate([z, yn.astype(z.dtype)], -1).reshape(z.shape[0], -1)
        code, params = self.encoder(params, window)
        zeros, params = self.rnn.initial_state(params, z[:, 0])
        leaves, tree = jax.tree.flatten(zeros)
        parts = jnp.split(code, len(leaves), axis=-1)
        values = [p.astype(x.dtype) for p, x in zip(parts, leaves, strict=True)]
        state = jax.tree.unflatten(tree, values)
        return state, params

    def __call__(
        self, params: Params, u: ArrayLike, y: ArrayLike
    ) -> tuple[tuple[jax.Array, Any], Params]:
        """Raw ``u`` ``[B, T, Cu]`` and ``y`` ``[B, T, Cy]`` -> ``((y_hat, state), params)``."""
        u, y = self._u(u), self._y(y)
        if y.shape[:2] != u.shape[:2] or u.shape[1] <= self.n_init:
            raise ValueError(
                f"{self._where}: u {tuple(u.shape)} and y {tuple(y.shape)} must share "
                f"[B, T] with T > n_init = {self.n_init}."
            )
        state, params = self.encode(params, u, y)
        z, params = self.u_norm(params, u[:, self.n_init :])
        (h, state), params = self.rnn(params, z, state)
        out, params = self.head(params, h)
        sim, params = self.y_norm.denormalize(params, out)
        y_hat = jnp.concatenate([y[:, : self.n_init].astype(sim.dtype), sim], axis=1)
        return (y_hat, state), params

    def forward(self, params, u, y=None, prev_state=None, is_reset=None):
        """The training outputs: ``model(params, u, y)``. The encoder replaces a carried
        state, so ``prev_state`` and ``is_reset`` must be ``None``."""
        if y is None or prev_state is not None or is_reset is not None:
            raise ValueError(
                f"{self._where}: the encoder model trains on whole windows: pass y and no "
                "prev_state / is_reset (no truncated BPTT; its state comes from the encoder)."
            )
        return self(params, u, y)

    def simulate(self, params, u, y=None):
        """Free run after the encoder's window: ``(y_hat [B, T, Cy], params)``."""
        if y is None:
            raise ValueError(f"{self._where}: the encoder needs the measured y of its window.")
        (y_hat, _), params = self(params, u, y)
        return y_hat, params
