"""Positional encodings: sinusoidal, learned and rotary (RoPE)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from blox.core import Graph, Module, Params, Rng
from blox.core._module import stored_shape_error
from blox.core._params import format_path
from blox.nn._linear import axis_is_bound

__all__ = [
    "LearnedPositionalEmbedding",
    "SinusoidalPositionalEncoding",
    "apply_rotary",
    "sinusoidal_encoding",
]


_default_position_init = jax.nn.initializers.normal(0.02)


def _float_dtype(*dtypes: Any) -> Any:
    wide = any(jnp.dtype(d) == jnp.float64 for d in dtypes)
    return jnp.dtype(jnp.float64) if wide else jnp.dtype(jnp.float32)


def sinusoidal_encoding(
    positions: ArrayLike,
    dim: int,
    *,
    max_timescale: float = 10000.0,
    dtype: Any = jnp.float32,
) -> jax.Array:
    """The sinusoidal position table of Vaswani et al. (2017), interleaved::

        pe[..., p, 2i]     = sin(p / max_timescale ** (2i / dim))
        pe[..., p, 2i + 1] = cos(p / max_timescale ** (2i / dim))

    Shapes: ``positions (...)`` -> ``(..., dim)``.

    Args:
      positions: integer or float positions, any shape ``(...)`` (e.g. ``(T,)`` or
        ``(B, T)``).
      dim: the (even) feature size D.
      max_timescale: the base of the geometric progression of wavelengths.
      dtype: the output dtype (angles are computed in float32, or float64 when
        ``dtype`` is float64).

    Returns:
      ``(..., dim)``.

    >>> import jax.numpy as jnp
    >>> pe = sinusoidal_encoding(jnp.arange(3), 4)
    >>> pe.shape, [float(v) for v in pe[0]]
    ((3, 4), [0.0, 1.0, 0.0, 1.0])
    """
    if not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(
            f"sinusoidal_encoding: dim must be a positive even int, got {dim!r}; the "
            "features are (sin, cos) pairs."
        )
    cd = _float_dtype(dtype)
    pos = jnp.asarray(positions).astype(cd)
    inv = jnp.exp(jnp.arange(0, dim, 2, dtype=cd) * jnp.asarray(-jnp.log(max_timescale) / dim, cd))
    angles = pos[..., None] * jnp.broadcast_to(inv, (*pos.shape, dim // 2))
    pe = jnp.stack([jnp.sin(angles), jnp.cos(angles)], axis=-1)
    return pe.reshape(*pos.shape, dim).astype(dtype)


def apply_rotary(x: ArrayLike, positions: ArrayLike, *, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding (RoPE, Su et al., 2021), "half-split" layout.

    Shapes: ``x (B, T, N, H)`` (or ``(T, N, H)``), ``positions (T,)`` or ``(B, T)`` ->
    the shape of ``x``.

    Legend: B batch, T time, N heads, H head size (even). Each head vector is split
    into halves ``x1 = x[..., :H/2]``, ``x2 = x[..., H/2:]`` and the pair
    ``(x1[i], x2[i])`` is rotated by the angle ``p * base ** (-2i / H)``::

        out1 = x1 * cos - x2 * sin
        out2 = x2 * cos + x1 * sin

    This is the layout of GPT-NeoX and of the Hugging Face Llama port
    (``rotate_half``); the original Llama code rotates adjacent pairs instead, which
    is the same map up to a fixed permutation of the features.

    Args:
      x: ``(B, T, N, H)`` (or ``(T, N, H)``).
      positions: ``(T,)`` or ``(B, T)`` integer positions of the T tokens.
      base: the base of the wavelengths.

    Returns:
      An array shaped and typed like ``x``. Angles are computed in float32 (float64
      for float64 inputs).

    >>> import jax.numpy as jnp
    >>> q = jnp.ones((1, 2, 1, 2))
    >>> [round(float(v), 4) for v in apply_rotary(q, jnp.arange(2))[0, 1, 0]]
    [-0.3012, 1.3818]
    """
    x = jnp.asarray(x)
    positions = jnp.asarray(positions)
    if x.ndim < 3 or x.shape[-1] % 2:
        raise ValueError(
            f"apply_rotary: x must have shape (B, T, N, H) or (T, N, H) with an even head "
            f"size H, got {tuple(x.shape)}."
        )
    t = x.shape[-3]
    if positions.shape not in ((t,), (*x.shape[:-3], t)):
        raise ValueError(
            f"apply_rotary: positions must have shape ({t},) or {(*x.shape[:-3], t)} for x "
            f"of shape {tuple(x.shape)} (B, T, N, H), got {tuple(positions.shape)}."
        )
    half = x.shape[-1] // 2
    cd = _float_dtype(x.dtype)
    inv = jnp.exp(jnp.arange(half, dtype=cd) * jnp.asarray(-2.0 * jnp.log(base) / (2 * half), cd))
    angles = positions.astype(cd)[..., None] * jnp.broadcast_to(inv, (*positions.shape, half))
    angles = jnp.broadcast_to(angles[..., None, :], (*x.shape[:-1], half))
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xs = x.astype(cd)
    x1, x2 = xs[..., :half], xs[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


_CONTEXT_AXIS_NOT_IN_MESH = (
    "{where}: context_axis={axis!r} is not an axis of the enclosing jax.shard_map's mesh "
    "(axes {names}), so the layer cannot find its shard of the sequence. Build the layer "
    "with context_axis set to the mesh's sequence axis (one of {names}), or call it inside a "
    "shard_map whose mesh has an axis {axis!r}; with context_axis=None the sequence is local."
)


def check_context_axis(axis: Any, where: str) -> str | None:
    """The constructor check of a ``context_axis`` argument: None or one axis name."""
    if axis is not None and not (isinstance(axis, str) and axis):
        raise TypeError(
            f"{where}: context_axis must be one mesh-axis name (a str) or None, got {axis!r}."
        )
    return axis


def context_shard(axis: str | None, where: str) -> tuple[jax.Array, int] | None:
    """``(index, size)`` along the context (sequence) axis `axis` where an enclosing
    ``jax.shard_map`` binds it (this device holds shard ``index`` of ``size``
    contiguous shards of the sequence), else None (the sequence is whole: the layer
    computes the unsharded math). Raises, naming `where`, when `axis` is not an axis of
    the enclosing ``shard_map``'s mesh at all."""
    if axis is None or not axis_is_bound(axis, _CONTEXT_AXIS_NOT_IN_MESH, where=where):
        return None
    return jax.lax.axis_index(axis).astype(jnp.int32), jax.lax.axis_size(axis)


def global_positions(shard: tuple[jax.Array, int] | None, t: int) -> jax.Array:
    """The positions of this device's `t` tokens: ``index * t + arange(t)`` (the
    contiguous layout) on a context `shard`, else ``arange(t)``."""
    local = jnp.arange(t, dtype=jnp.int32)
    return local if shard is None else shard[0] * jnp.int32(t) + local


def _positions_for(
    where: str, x: jax.Array, positions: ArrayLike | None, context_axis: str | None = None
) -> jax.Array:
    if x.ndim < 2:
        raise ValueError(f"{where}: input must have shape (..., T, D), got {tuple(x.shape)}.")
    t = x.shape[-2]
    if positions is None:
        return global_positions(context_shard(context_axis, where), t)
    positions = jnp.asarray(positions)
    if positions.shape[-1:] != (t,) or positions.ndim > x.ndim - 1:
        raise ValueError(
            f"{where}: positions must have shape (T,) = ({t},) or (B, T) for input of shape "
            f"{tuple(x.shape)}, got {tuple(positions.shape)}."
        )
    return positions


def _add(x: jax.Array, pe: jax.Array) -> jax.Array:
    with jax.numpy_dtype_promotion("standard"):
        out_dtype = jnp.promote_types(x.dtype, pe.dtype)
    return x.astype(out_dtype) + jnp.broadcast_to(pe.astype(out_dtype), x.shape)


class SinusoidalPositionalEncoding(Module):
    """Adds the fixed `sinusoidal_encoding` of each token's position to its features.

    Shapes: ``x`` ``(B, T, D)`` (D even) -> ``(B, T, D)``, same dtype.

    Args:
      graph: this module's node.
      max_timescale: see `sinusoidal_encoding` (keyword-only).

      context_axis: the mesh axis the sequence is sharded over (context parallelism),
        or None (default). Inside a ``jax.shard_map`` binding it, the default positions
        are the global ones of this device's tokens in the contiguous layout, ``index *
        T + arange(T)`` (T local); pass ``positions`` for another layout (the head-tail
        one of `blox.parallel.balance_sequence`).

    Call: ``enc(params, x, positions=None)``; ``positions`` ``(T,)`` or ``(B, T)``
    defaults to ``arange(T)``; pass ``(B, T)`` positions when rows are offset
    differently (left-padded prompts, decoding: `TransformerLM` does this).

    Creates no parameters.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net')
    >>> enc = bx.SinusoidalPositionalEncoding(g / 'pos')
    >>> y, _ = enc(bx.Params(), jnp.zeros((1, 3, 4)))
    >>> [float(v) for v in y[0, 0]]
    [0.0, 1.0, 0.0, 1.0]
    """

    def __init__(
        self, graph: Graph, *, max_timescale: float = 10000.0, context_axis: str | None = None
    ):
        super().__init__(graph)
        self.max_timescale = float(max_timescale)
        self.context_axis = check_context_axis(
            context_axis, f"SinusoidalPositionalEncoding '{self.path_str}'"
        )

    def __call__(
        self, params: Params, x: jax.Array, positions: ArrayLike | None = None
    ) -> tuple[jax.Array, Params]:
        """Returns ``(x + pe[positions], params)``."""
        x = jnp.asarray(x)
        where = f"SinusoidalPositionalEncoding '{self.path_str}'"
        pos = _positions_for(where, x, positions, self.context_axis)
        if x.shape[-1] % 2:
            raise ValueError(
                f"{where}: the feature size must be even, got input shape {tuple(x.shape)}."
            )
        pe = sinusoidal_encoding(
            pos, x.shape[-1], max_timescale=self.max_timescale, dtype=_float_dtype(x.dtype)
        )
        return _add(x, pe).astype(x.dtype), params


class LearnedPositionalEmbedding(Module):
    """Adds a learned vector per position (as in GPT-2 and BERT).

    Shapes: ``x`` ``(B, T, D)`` -> ``(B, T, D)``, T <= ``max_length``.

    ``graph, max_length, rng`` may be positional; every argument after ``rng`` is
    keyword-only.

    Args:
      graph: this module's node.
      max_length: the number of positions L.
      rng: the `Rng` that provides the initialization key.
      embedding_init: default normal with standard deviation 0.02 (GPT-2).
      embedding_metadata: stored with the table.
      param_dtype: the dtype of the table (float32).
      context_axis: the mesh axis the sequence is sharded over (context parallelism),
        or None (default). Inside a ``jax.shard_map`` binding it, the default positions
        are the global ones of this device's tokens in the contiguous layout, ``index *
        T + arange(T)`` (T local, C T <= L); pass ``positions`` for another layout.

    Call: ``pos(params, x, positions=None)``; ``positions`` ``(T,)`` or ``(B, T)``
    defaults to ``arange(T)``; pass ``(B, T)`` positions when rows are offset
    differently (left-padded prompts, decoding: `TransformerLM` does this). A
    position outside ``[0, L)`` (not checkable under ``jax.jit``) gives NaN features.

    Dtype: the output is the promotion of the input and table dtypes.

    Parameters: ``<path>/embedding`` ``(L, D)``.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> pos = bx.LearnedPositionalEmbedding(g / 'pos', max_length=16, rng=rng)
    >>> y, params = pos(rng.seed(bx.Params(), seed=0), jnp.zeros((2, 5, 8)))
    >>> y.shape, params[('net', 'pos', 'embedding')].value.shape
    ((2, 5, 8), (16, 8))
    """

    def __init__(
        self,
        graph: Graph,
        max_length: int,
        rng: Rng | None,
        *,
        embedding_init: Callable = _default_position_init,
        embedding_metadata: dict | None = None,
        param_dtype: Any = jnp.float32,
        context_axis: str | None = None,
    ):
        super().__init__(graph)
        self.context_axis = check_context_axis(
            context_axis, f"LearnedPositionalEmbedding '{self.path_str}'"
        )
        if not isinstance(max_length, int) or max_length <= 0:
            raise ValueError(
                f"LearnedPositionalEmbedding '{self.path_str}': max_length must be a "
                f"positive int, got {max_length!r}."
            )
        self.max_length = max_length
        self.rng = rng
        self.embedding_init = embedding_init
        self.embedding_metadata = embedding_metadata
        self.param_dtype = param_dtype

    def __call__(
        self, params: Params, x: jax.Array, positions: ArrayLike | None = None
    ) -> tuple[jax.Array, Params]:
        """Returns ``(x + embedding[positions], params)``."""
        x = jnp.asarray(x)
        where = f"LearnedPositionalEmbedding '{self.path_str}'"
        shard = context_shard(self.context_axis, where) if positions is None else None
        pos = _positions_for(where, x, positions, self.context_axis)
        span = x.shape[-2] * (1 if shard is None else shard[1])
        if positions is None and span > self.max_length:
            of = "" if shard is None else f" over {shard[1]} shards of context axis"
            of = of and f"{of} {self.context_axis!r}"
            raise ValueError(
                f"{where}: input has T = {span} positions (shape {tuple(x.shape)}{of}) "
                f"but the table holds max_length = {self.max_length}. Use a shorter input or "
                "a larger max_length."
            )
        d = x.shape[-1]
        path = self.param_path("embedding")
        stored = getattr(params.value(path), "shape", None)
        stored = None if stored is None else tuple(stored)
        # The table's first axis follows from max_length alone: a stored table that differs
        # there (a transposed (D, L) copy, another max_length) is blamed, not the input.
        if stored is not None and (len(stored) != 2 or stored[0] != self.max_length):
            raise ValueError(
                stored_shape_error(
                    self,
                    path,
                    stored,
                    (self.max_length, d),
                    f" = (L, D) for max_length={self.max_length} and input shape {tuple(x.shape)}",
                    hint="the table is (max_length, D), one row per position (the layout of "
                    "a torch.nn.Embedding(max_length, D) weight); store the transpose of a "
                    f"(D, max_length) copy, e.g. params[{path!r}] = bx.Param(table.T).",
                )
            )
        if stored is not None and stored[1] != d:
            raise ValueError(
                f"{where} expects inputs of shape (..., {stored[1]}) (embedding "
                f"{stored} = (L, D)), got {tuple(x.shape)}. Fix the input's last dimension; "
                f"or, if '{format_path(path)}' was made for another feature size, replace it "
                f"with a {(self.max_length, d)} table or re-initialize."
            )
        table, params = self.get_param(
            params,
            "embedding",
            (self.max_length, d),
            self.embedding_init,
            dtype=self.param_dtype,
            metadata=self.embedding_metadata,
            rng=self.rng,
        )
        if positions is None and shard is None:  # arange(T): a static slice
            pe = jax.lax.slice_in_dim(table, 0, x.shape[-2], axis=0)
        else:
            pe = table.at[pos].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)
        return _add(x, pe), params
