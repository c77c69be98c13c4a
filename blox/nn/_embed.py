"""`Embed`: a lookup table of vectors, with `attend` for a tied output projection."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from blox.core import Graph, Module, Params, Rng
from blox.core._module import is_local_shard, stored_shape_error
from blox.core._sharding import dot_out_sharding, take_out_sharding
from blox.nn._dtype import compute_dtype

__all__ = ["Embed"]

_default_embedding_init = jax.nn.initializers.variance_scaling(1.0, "fan_in", "normal", out_axis=0)


class Embed(Module):
    """A table of ``num_embeddings`` vectors of size ``embedding_size``, looked up by index.

    Legend: V ``num_embeddings`` (vocabulary), D ``embedding_size``.

    Shapes: integer ``indices (...)`` -> ``(..., D)``; `attend`: ``(..., D)`` ->
    ``(..., V)``.

    ``embed(params, indices)`` maps integer ``indices`` of any shape ``(...)`` to
    ``(..., D)``; ``embed.attend(params, x)`` maps ``(..., D)`` to ``(..., V)`` with
    ``x @ embedding.T``, the output projection of a language model whose input and
    output embeddings are tied.

    Args:
      graph: this module's node.
      num_embeddings: V.
      embedding_size: D.
      rng: the `Rng` that provides the initialization key.
      embedding_init: ``init(key, (V, D), dtype)``; default variance scaling 1.0,
        fan-in, normal, with ``out_axis=0`` (so the fan-in is D and each entry has
        variance ``1 / D``), as in Flax.
      embedding_metadata: stored with the table, e.g. ``{'sharding': (None, 'model')}``.
      dtype: the compute/output dtype; default the stored table's dtype for lookups
        and the promotion of the input and table dtypes for `attend`.
      param_dtype: the dtype the table is created in (float32).

    Parameters: ``<path>/embedding`` ``(V, D)``.

    Indices must be integers. An index outside ``[0, V)``, negative ones included
    (which cannot be checked under ``jax.jit``), gives a row of NaN, never another
    row's vector (``table.at[i].get(mode='fill', wrap_negative_indices=False)``;
    PyTorch raises, which JAX cannot do on traced values).

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> embed = bx.Embed(g / 'embed', num_embeddings=10, embedding_size=4, rng=rng)
    >>> params = rng.seed(bx.Params(), seed=0)
    >>> x, params = embed(params, jnp.array([[1, 2, 3]]))
    >>> logits, params = embed.attend(params, x)
    >>> x.shape, logits.shape
    ((1, 3, 4), (1, 3, 10))
    """

    def __init__(
        self,
        graph: Graph,
        num_embeddings: int,
        embedding_size: int,
        rng: Rng | None,
        embedding_init: Callable = _default_embedding_init,
        embedding_metadata: dict | None = None,
        *,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        for name, v in (("num_embeddings", num_embeddings), ("embedding_size", embedding_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(
                    f"Embed '{self.path_str}': {name} must be a positive int, got {v!r}."
                )
        self.num_embeddings = num_embeddings
        self.embedding_size = embedding_size
        self.rng = rng
        self.embedding_init = embedding_init
        self.embedding_metadata = embedding_metadata
        self.dtype = dtype
        self.param_dtype = param_dtype

    def embedding(self, params: Params) -> tuple[jax.Array, Params]:
        """Returns ``(table (V, D), params)``, creating the table if it is missing."""
        self._check_table(params)
        return self.get_param(
            params,
            "embedding",
            (self.num_embeddings, self.embedding_size),
            self.embedding_init,
            dtype=self.param_dtype,
            metadata=self.embedding_metadata,
            rng=self.rng,
        )

    def _check_table(self, params: Params) -> None:
        path = self.param_path("embedding")
        stored = getattr(params.value(path), "shape", None)
        expected = (self.num_embeddings, self.embedding_size)
        if stored is not None and tuple(stored) != expected:
            if is_local_shard(tuple(stored), expected):  # a shard inside jax.shard_map
                return
            raise ValueError(
                stored_shape_error(
                    self,
                    path,
                    tuple(stored),
                    expected,
                    f" = (V, D) for num_embeddings={self.num_embeddings}, "
                    f"embedding_size={self.embedding_size}",
                    hint="the table is (num_embeddings, embedding_size), one row per token "
                    "(torch.nn.Embedding's weight has this layout and is copied as is); a "
                    "(D, V) matrix such as a tied output kernel is stored as its transpose, "
                    f"e.g. params[{path!r}] = bx.Param(kernel.T).",
                )
            )

    def __call__(self, params: Params, indices: jax.Array) -> tuple[jax.Array, Params]:
        """Looks up ``indices`` ``(...)`` (integers); returns ``((..., D), params)``."""
        indices = jnp.asarray(indices)
        if not jnp.issubdtype(indices.dtype, jnp.integer):
            raise TypeError(
                f"Embed '{self.path_str}': indices must be integers, got dtype "
                f"{indices.dtype} with shape {tuple(indices.shape)}. Cast them, e.g. "
                "tokens.astype(jnp.int32); to project vectors use embed.attend(params, x)."
            )
        table, params = self.embedding(params)
        # Negative indices are out of range too (no NumPy-style wrap-around).
        # On an Explicit mesh a sharded table needs the lookup's output sharding.
        out = table.at[indices].get(
            mode="fill",
            fill_value=jnp.nan,
            wrap_negative_indices=False,
            out_sharding=take_out_sharding(table, indices),
        )
        if self.dtype is not None:
            out = out.astype(self.dtype)
        return out, params

    def attend(
        self, params: Params, x: jax.Array, precision: Any = None
    ) -> tuple[jax.Array, Params]:
        """``x @ embedding.T``: ``(..., D)`` -> ``((..., V), params)``.

        Computes in `dtype` if given, else in the promotion of ``x.dtype`` and the
        table's dtype.
        """
        x = jnp.asarray(x)
        self._check_table(params)  # a wrong stored table is its own fault, not the input's
        if x.ndim == 0 or x.shape[-1] != self.embedding_size:
            raise ValueError(
                f"Embed '{self.path_str}'.attend expects inputs of shape (..., "
                f"{self.embedding_size}) (embedding ({self.num_embeddings}, "
                f"{self.embedding_size})), got shape {tuple(x.shape)}. Project the input "
                "to embedding_size features first."
            )
        table, params = self.embedding(params)
        cd = compute_dtype(x, table.dtype, self.dtype)
        x, table = x.astype(cd), table.astype(cd)
        y = jnp.einsum(
            "...d,vd->...v",
            x,
            table,
            precision=precision,
            out_sharding=dot_out_sharding(x, table, transposed=True),
        )
        return y, params
