"""Raw-JAX references: the benchmark models on a plain ``{str: array}`` dict.

No blox import (the jax-blox peer script reuses this module in another venv). The
math matches `blox.Linear` / `blox.MLP` exactly: ``y = x @ kernel + bias`` per
layer, ReLU between layers (not after the last), mean squared error loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = ["batch", "copy_tree", "forward", "mse", "train_step"]


def forward(names: Sequence[str], p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The dense stack: layer ``name`` uses ``p[name + '/kernel']``, ``p[name + '/bias']``."""
    last = len(names) - 1
    for i, name in enumerate(names):
        x = jnp.dot(x, p[name + "/kernel"]) + p[name + "/bias"]
        if i < last:
            x = jax.nn.relu(x)
    return x


def mse(y_hat: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((y_hat - y) ** 2)


def train_step(names: Sequence[str], tx: optax.GradientTransformation):
    """``step(params, opt_state, x, y) -> (params, opt_state, loss)`` on a dict."""

    def loss_fn(p, x, y):
        return mse(forward(names, p, x), y)

    def step(p, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        updates, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    return step


def batch(batch_size: int, d_in: int, d_out: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """A fixed regression batch ``(x, y)`` in float32."""
    r = np.random.default_rng(seed)
    x = r.standard_normal((batch_size, d_in), dtype=np.float32)
    y = r.standard_normal((batch_size, d_out), dtype=np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def copy_tree(tree: Any) -> Any:
    """Fresh device buffers for every leaf (so donating one copy leaves others valid)."""

    def _copy(a):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            data = jnp.array(jax.random.key_data(a), copy=True)
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(a))
        return jnp.array(a, copy=True)

    return jax.tree.map(_copy, tree)
