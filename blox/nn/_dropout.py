"""`Dropout`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from blox.core import Graph, Module, Params, Rng

__all__ = ["Dropout"]


class Dropout(Module):
    """Inverted dropout: zeroes each element with probability `rate` and scales the rest
    by ``1 / (1 - rate)`` when ``is_training``; the identity otherwise.

    Shapes: any ``x`` -> same shape and dtype.

    Args:
      graph: this module's node.
      rate: drop probability in ``[0, 1)``.
      rng: the `Rng` that provides the mask keys (one key per call).

    Creates no parameters; it advances the `Rng` counter once per training call.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> drop = bx.Dropout(g / 'drop', 0.5, rng)
    >>> y, params = drop(rng.seed(bx.Params(), seed=0), jnp.ones((1000,)))
    >>> set(map(float, jnp.unique(y))) <= {0.0, 2.0}
    True
    """

    def __init__(self, graph: Graph, rate: float, rng: Rng):
        super().__init__(graph)
        if not 0.0 <= float(rate) < 1.0:
            raise ValueError(
                f"Dropout '{self.path_str}': rate must be in [0, 1), got {rate}. The "
                "Dropout rate is the probability of dropping an element."
            )
        self.rate = float(rate)
        self.rng = rng

    def __call__(
        self, params: Params, x: jax.Array, is_training: bool = True
    ) -> tuple[jax.Array, Params]:
        """Applies dropout; returns ``(x_dropped, params)``."""
        if not is_training or self.rate == 0.0:
            return x, params
        if self.rng is None:
            raise ValueError(
                f"Dropout '{self.path_str}' needs an Rng in training mode: "
                "Dropout(graph, rate, rng)."
            )
        key, params = self.rng(params)
        keep = jax.random.bernoulli(key, 1.0 - self.rate, jnp.shape(x))
        scale = jnp.asarray(1.0 / (1.0 - self.rate), dtype=x.dtype)
        return jnp.where(keep, x * scale, jnp.zeros((), x.dtype)), params
