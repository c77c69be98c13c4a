"""A pre-norm `TransformerBlock` and a small decoder-only `TransformerLM`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from blox.core import Graph, Module, Params, Rng
from blox.nn._attention import MultiHeadAttention, check_context_config
from blox.nn._dropout import Dropout
from blox.nn._embed import Embed
from blox.nn._linear import MLP, Linear
from blox.nn._norm import LayerNorm, RMSNorm
from blox.nn._position import (
    LearnedPositionalEmbedding,
    SinusoidalPositionalEncoding,
    context_shard,
    global_positions,
)

__all__ = ["TransformerBlock", "TransformerLM"]


_default_embedding_init = jax.nn.initializers.normal(0.02)


def make_norm(graph: Graph, kind: str, epsilon: float, dtype: Any, param_dtype: Any) -> Module:
    if kind == "layer":
        return LayerNorm(graph, epsilon, dtype=dtype, param_dtype=param_dtype)
    if kind == "rms":
        return RMSNorm(graph, epsilon, dtype=dtype, param_dtype=param_dtype)
    raise ValueError(
        f"'{'/'.join(graph.path)}': norm must be 'layer' (LayerNorm) or 'rms' (RMSNorm), "
        f"got {kind!r}."
    )


class TransformerBlock(Module):
    """A pre-norm transformer block (as GPT-2 and PyTorch's
    ``nn.TransformerEncoderLayer(norm_first=True)``)::

        h = x + dropout(attn(norm1(x)))
        y = h + dropout(mlp(norm2(h)))        mlp = Linear(F) -> activation -> Linear(D)

    Shapes: ``(B, T, D)`` -> ``(B, T, D)``.

    Args:
      graph: this module's node.
      model_size: D.
      num_heads: N (must divide D).
      rng: the `Rng` for initialization and dropout.
      mlp_size: F (default 4 D).
      num_kv_heads: grouped-query key/value heads (default N).
      dropout_rate: dropout after the attention and after the MLP (residual branches).
      attention_dropout_rate: dropout on the attention weights.
      activation: the MLP activation (default ``jax.nn.gelu``, the tanh approximation
        used by GPT-2; PyTorch's ``'gelu'`` is the exact one,
        ``functools.partial(jax.nn.gelu, approximate=False)``).
      norm: ``'layer'`` (`LayerNorm`) or ``'rms'`` (`RMSNorm`).
      epsilon: the norms' epsilon (1e-5).
      use_rope: rotary positions inside the attention.
      use_bias: biases in the attention projections and the MLP.
      dtype, param_dtype: passed to every sub-layer.
      tp_axis: tensor parallelism (Megatron-style) over this mesh axis, or None
        (default): the attention's heads are split over it (`MultiHeadAttention`'s
        ``tp_axis``) and the MLP is column- then row-split (`MLP`'s ``tp_axis``), so
        inside a ``jax.shard_map`` binding the axis the block does **two all-reduces
        in forward**, one per row-split layer; the norms, residuals and dropout run
        replicated on every device (residual dropout draws the same mask on each:
        do not fold the model axis into the seed; see `blox.parallel.fold_seeds`).
        Outside such a ``shard_map`` the block computes the unsharded math. The
        parameters keep their paths and global shapes (shard them with
        `blox.parallel.transformer_tp_rules`); `blox.parallel.ParallelTransformerBlock`
        is this block with ``tp_axis`` set.
      context_axis: context parallelism over this mesh axis, or None (default): inside
        a ``jax.shard_map`` binding it, ``x`` is this device's shard of the sequence
        and the attention runs over the axis (`MultiHeadAttention`'s ``context_axis``:
        global ``positions``, per-token ``key_mask`` / ``segment_ids``, no general
        ``mask``, no attention dropout or decoding); the norms, the MLP and the
        residual dropout are per token and need nothing. Combines with ``tp_axis``.
      context_variant: ``'ring'`` (default) or ``'allgather'``.

    Initializers: LeCun normal kernels and zero biases (`Linear`), ones/zeros for the
    norms.

    Parameters (children): ``norm1``, ``attn`` (`MultiHeadAttention`: ``query``,
    ``key``, ``value``, ``out``), ``norm2``, ``mlp/linear_0`` ``(D, F)``,
    ``mlp/linear_1`` ``(F, D)``.

    The constructor takes ``(graph, model_size, num_heads, rng)`` positionally (the
    order of `MultiHeadAttention` and `TransformerLM`); every option is keyword-only.

    Call: ``block(params, x, *, mask=None, key_mask=None, segment_ids=None,
    is_causal=False, positions=None, is_training=True, decode=False)``; the keywords
    go to the attention (``positions``, the RoPE positions, only with ``use_rope=True``
    or ``context_axis``).

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> block = bx.TransformerBlock(g / 'block', 8, 2, rng)   # model_size 8, 2 heads
    >>> y, params = block(rng.seed(bx.Params(), seed=0), jnp.ones((1, 4, 8)), is_causal=True)
    >>> y.shape
    (1, 4, 8)
    """

    def __init__(
        self,
        graph: Graph,
        model_size: int,
        num_heads: int,
        rng: Rng | None,
        *,
        mlp_size: int | None = None,
        num_kv_heads: int | None = None,
        dropout_rate: float = 0.0,
        attention_dropout_rate: float = 0.0,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
        norm: str = "layer",
        epsilon: float = 1e-5,
        use_rope: bool = False,
        use_bias: bool = True,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        tp_axis: str | None = None,
        context_axis: str | None = None,
        context_variant: str = "ring",
    ):
        super().__init__(graph)
        self.model_size = model_size
        self.mlp_size = 4 * model_size if mlp_size is None else mlp_size
        self.activation = activation
        self.tp_axis = tp_axis
        self.context_axis = context_axis
        self.context_variant = context_variant
        self.norm1 = make_norm(graph.child("norm1"), norm, epsilon, dtype, param_dtype)
        self.attn = MultiHeadAttention(
            graph.child("attn"),
            model_size,
            num_heads,
            rng,
            num_kv_heads=num_kv_heads,
            dropout_rate=attention_dropout_rate,
            use_rope=use_rope,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            tp_axis=tp_axis,
            context_axis=context_axis,
            context_variant=context_variant,
        )
        self.norm2 = make_norm(graph.child("norm2"), norm, epsilon, dtype, param_dtype)
        self.mlp = MLP(
            graph.child("mlp"),
            (self.mlp_size, model_size),
            rng,
            activation=activation,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
            tp_axis=tp_axis,
        )
        self.dropout = Dropout(graph.child("dropout"), dropout_rate, rng)

    def __call__(
        self,
        params: Params,
        x: jax.Array,
        *,
        mask: ArrayLike | None = None,
        key_mask: ArrayLike | None = None,
        segment_ids: ArrayLike | None = None,
        is_causal: bool = False,
        positions: ArrayLike | None = None,
        is_training: bool = True,
        decode: bool = False,
    ) -> tuple[jax.Array, Params]:
        """Applies the block to ``x`` ``(B, T, D)``; returns ``((B, T, D), params)``."""
        h, params = self.norm1(params, x)
        h, params = self.attn(
            params,
            h,
            mask=mask,
            key_mask=key_mask,
            segment_ids=segment_ids,
            is_causal=is_causal,
            positions=positions,
            is_training=is_training,
            decode=decode,
        )
        h, params = self.dropout(params, h, is_training=is_training)
        x = x + h.astype(x.dtype)
        h, params = self.norm2(params, x)
        h, params = self.mlp(params, h)
        h, params = self.dropout(params, h, is_training=is_training)
        return x + h.astype(x.dtype), params


def _check_lm_config(where: str, position: str, max_length: Any, num_layers: Any) -> None:
    """`TransformerLM`'s position encoding and depth, or an error naming `where`."""
    if position not in ("rope", "learned", "sinusoidal", "none"):
        raise ValueError(
            f"{where}: position must be 'rope', 'learned', 'sinusoidal' or 'none', got "
            f"{position!r}."
        )
    if position == "learned" and max_length is None:
        raise ValueError(f"{where}: position='learned' needs max_length=<int>.")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{where}: num_layers must be a positive int, got {num_layers!r}.")


def _position_module(
    graph: Graph, position: str, max_length: Any, rng: Rng | None, param_dtype: Any
) -> Module | None:
    """The additive position encoding at ``graph / 'pos'`` (None for RoPE or none)."""
    if position == "learned":
        return LearnedPositionalEmbedding(
            graph.child("pos"), max_length, rng, param_dtype=param_dtype
        )
    if position == "sinusoidal":
        return SinusoidalPositionalEncoding(graph.child("pos"))
    return None


class TransformerLM(Module):
    """A decoder-only (causal) transformer language model built from `TransformerBlock`::

        h = embed(tokens) [+ positions]       (B, T, D)
        h = dropout(h); h = block_i(h) for i < num_layers (causal)
        logits = final_norm(h) @ embed.embedding.T   (tied; or a `Linear` head)

    Legend: B batch, T tokens, V ``vocab_size``, D ``model_size``, L cache length.

    Shapes: integer ``tokens (B, T)`` -> ``logits (B, T, V)``; with ``decode=True``
    the T new tokens are appended to the KV cache (``init_cache``, L slots).

    Args:
      graph: this module's node.
      vocab_size: V.
      model_size: D.
      num_layers: the number of blocks.
      num_heads: N.
      rng: the `Rng` for initialization and dropout.
      max_length: the largest number of positions (needed for ``position='learned'``).
      position: ``'rope'`` (rotary, in every attention), ``'learned'``
        (`LearnedPositionalEmbedding`), ``'sinusoidal'``
        (`SinusoidalPositionalEncoding`) or ``'none'``.
      mlp_size, num_kv_heads, dropout_rate, attention_dropout_rate, activation, norm,
        epsilon, use_bias, dtype, param_dtype: as in `TransformerBlock`.
      tie_embeddings: output logits with the transposed input embedding
        (`Embed.attend`) instead of a separate ``head`` `Linear`.
      embedding_init: for the token `Embed` (default normal, std 0.02 as GPT-2).
      context_axis, context_variant: context parallelism, as in `TransformerBlock`.
        Inside a ``jax.shard_map`` binding ``context_axis``, ``tokens`` ``(B, T)`` are
        this device's shard of each sequence and the default positions (of every
        ``position`` kind) are the global ones of the contiguous layout, ``index * T +
        arange(T)``; pass ``positions`` for another layout (and always with a
        ``key_mask``: the per-row count of earlier tokens spans the devices).
        Decoding there raises.

    Parameters (children): ``embed/embedding (V, D)``, ``pos/embedding (L, D)`` (learned
    positions), ``block_<i>/...`` (see `TransformerBlock`), ``final_norm``, and
    ``head/kernel (D, V)`` + ``head/bias`` if not tied.

    Calls:
      ``lm(params, tokens (B, T) int, *, key_mask=None, positions=None,
      is_training=True, decode=False)`` -> ``(logits (B, T, V), params)``.
      ``key_mask`` ``(B, T)`` marks padding (False) to ignore. With ``decode=True``
      after `init_cache`, the tokens are appended to each block's KV cache
      (``key_mask``, if given, is then ``(B, L)`` over the cache slots, and marks the
      tokens still to come True); generating is ``logits, params = lm(params,
      token[:, None], key_mask=..., decode=True, is_training=False)`` one token at a
      time.

    Positions are per row, for every ``position`` kind: a token's position is the
    number of unmasked tokens before it in its row (``cumsum(key_mask) - 1``, 0 on
    padding; without a ``key_mask``, ``arange(T)``, or ``cache_index + arange(T)``
    when decoding). So a batch of left-padded prompts, decoded with its
    ``key_mask``, gives each row the logits of its prompt decoded alone. Pass
    ``positions`` (int ``(T,)`` or ``(B, T)``) to set them yourself (ignored with
    ``position='none'``); `row_positions` returns the default ones.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('lm'); rng = bx.Rng(g / 'rng')
    >>> lm = bx.TransformerLM(g / 'model', vocab_size=11, model_size=8, num_layers=1,
    ...                       num_heads=2, rng=rng)
    >>> tokens = jnp.array([[1, 2, 3]])
    >>> logits, params = lm(rng.seed(bx.Params(), seed=0), tokens, is_training=False)
    >>> params = lm.init_cache(params.locked(), batch_size=1, max_length=8)
    >>> step_logits, params = lm(params, tokens[:, :1], decode=True, is_training=False)
    >>> logits.shape, step_logits.shape, int(lm.cache_index(params))
    ((1, 3, 11), (1, 1, 11), 1)
    """

    def __init__(
        self,
        graph: Graph,
        vocab_size: int,
        model_size: int,
        num_layers: int,
        num_heads: int,
        rng: Rng | None,
        *,
        max_length: int | None = None,
        position: str = "rope",
        mlp_size: int | None = None,
        num_kv_heads: int | None = None,
        dropout_rate: float = 0.0,
        attention_dropout_rate: float = 0.0,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.gelu,
        norm: str = "layer",
        epsilon: float = 1e-5,
        use_bias: bool = True,
        tie_embeddings: bool = True,
        embedding_init: Callable = _default_embedding_init,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        context_axis: str | None = None,
        context_variant: str = "ring",
    ):
        super().__init__(graph)
        where = f"TransformerLM '{self.path_str}'"
        self.context_axis, _ = check_context_config(where, context_axis, context_variant, None)
        _check_lm_config(where, position, max_length, num_layers)
        self.vocab_size = vocab_size
        self.model_size = model_size
        self.position = position
        self.max_length = max_length
        self.tie_embeddings = tie_embeddings
        self.dtype = dtype
        self.embed = Embed(
            graph.child("embed"),
            vocab_size,
            model_size,
            rng,
            embedding_init,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.pos = _position_module(graph, position, max_length, rng, param_dtype)
        self.dropout = Dropout(graph.child("dropout"), dropout_rate, rng)
        self.blocks = [
            TransformerBlock(
                graph.child(f"block_{i}"),
                model_size,
                num_heads,
                rng,
                mlp_size=mlp_size,
                num_kv_heads=num_kv_heads,
                dropout_rate=dropout_rate,
                attention_dropout_rate=attention_dropout_rate,
                activation=activation,
                norm=norm,
                epsilon=epsilon,
                use_rope=position == "rope",
                use_bias=use_bias,
                dtype=dtype,
                param_dtype=param_dtype,
                context_axis=context_axis,
                context_variant=context_variant,
            )
            for i in range(num_layers)
        ]
        self.final_norm = make_norm(graph.child("final_norm"), norm, epsilon, dtype, param_dtype)
        self.head = (
            None
            if tie_embeddings
            else Linear(graph.child("head"), vocab_size, rng, dtype=dtype, param_dtype=param_dtype)
        )

    def init_cache(
        self, params: Params, batch_size: int, max_length: int, *, dtype: Any = None
    ) -> Params:
        """Returns params with an empty KV cache in every block (see
        `MultiHeadAttention.init_cache`); call it again to start new sequences."""
        if self.position == "learned" and max_length > self.max_length:
            raise ValueError(
                f"TransformerLM '{self.path_str}': a cache of max_length {max_length} exceeds "
                f"the {self.max_length} learned positions. Use max_length <= "
                f"{self.max_length}."
            )
        for block in self.blocks:
            params = block.attn.init_cache(params, batch_size, max_length, dtype=dtype)
        return params

    def _check_context_call(self, decode: bool, key_mask: Any, positions: Any) -> None:
        where = f"TransformerLM '{self.path_str}' (context_axis={self.context_axis!r})"
        if decode:
            raise ValueError(
                f"{where}: decode=True inside a jax.shard_map over the context axis is not "
                "supported (the KV cache holds the whole sequence). Decode outside the "
                "shard_map: the model then computes the unsharded math with the same params."
            )
        if key_mask is not None and positions is None:
            raise ValueError(
                f"{where}: with a key_mask on a sharded sequence the default positions (the "
                "count of earlier unmasked tokens in the row) span the devices; pass "
                "positions= explicitly, e.g. the shard of lm.row_positions(params, "
                "global_tokens, global_key_mask) computed before sharding."
            )

    def cache_index(self, params: Params) -> jax.Array:
        """The number of tokens in the KV cache (int32 scalar)."""
        return self.blocks[0].attn.cache_index(params)

    def row_positions(
        self,
        params: Params,
        tokens: ArrayLike,
        key_mask: ArrayLike | None = None,
        *,
        decode: bool = False,
    ) -> jax.Array | None:
        """The positions `__call__` gives ``tokens`` ``(B, T)`` by default: ``(B, T)``
        ``cumsum(key_mask) - 1`` (0 on padding) read at the tokens' slots when a
        ``key_mask`` is given, else ``cache_index + arange(T)`` ``(T,)`` when decoding,
        else None (``arange(T)``)."""
        b, t = jnp.shape(tokens)
        where = f"TransformerLM '{self.path_str}'"
        if key_mask is None:
            if decode:
                return self.cache_index(params) + jnp.arange(t, dtype=jnp.int32)
            return None
        key_mask = jnp.asarray(key_mask)
        width = self.blocks[0].attn._cache_length(params) if decode else t
        if key_mask.shape != (b, width) or key_mask.dtype != jnp.bool_:
            over = f"(B, L) = {(b, width)} over the cache slots" if decode else f"(B, T) = {(b, t)}"
            raise ValueError(
                f"{where}: key_mask must be a boolean array of shape {over} (False = "
                f"padding), got {key_mask.dtype} {tuple(key_mask.shape)}."
            )
        counts = jnp.cumsum(key_mask.astype(jnp.int32), axis=1) - 1
        counts = jnp.maximum(counts, 0)
        if not decode:
            return counts
        return jax.lax.dynamic_slice_in_dim(counts, self.cache_index(params), t, axis=1)

    def __call__(
        self,
        params: Params,
        tokens: jax.Array,
        *,
        key_mask: ArrayLike | None = None,
        positions: ArrayLike | None = None,
        is_training: bool = True,
        decode: bool = False,
    ) -> tuple[jax.Array, Params]:
        """Maps ``tokens`` ``(B, T)`` to ``(logits (B, T, V), params)``."""
        where = f"TransformerLM '{self.path_str}'"
        tokens = jnp.asarray(tokens)
        if tokens.ndim != 2:
            raise ValueError(
                f"{where} expects integer tokens of shape (B, T), got "
                f"{tuple(tokens.shape)}. Add a batch axis with tokens[None]."
            )
        b, t = tokens.shape
        shard = context_shard(self.context_axis, where)
        span = t if shard is None else t * shard[1]
        if self.position == "learned" and not decode and span > self.max_length:
            on = "" if shard is None else f" over {shard[1]} shards of {self.context_axis!r}"
            raise ValueError(
                f"{where}: input has T = {span} positions (tokens shape {tuple(tokens.shape)}"
                f"{on}) but position='learned' holds max_length = {self.max_length}. Use a "
                "shorter input or a larger max_length."
            )
        given = positions
        if shard is not None:
            self._check_context_call(decode, key_mask, positions)
        if positions is None and shard is not None:
            positions = global_positions(shard, t)
        elif positions is None:
            positions = self.row_positions(params, tokens, key_mask, decode=decode)
        else:
            positions = jnp.asarray(positions)
            if positions.shape not in ((t,), (b, t)) or not jnp.issubdtype(
                positions.dtype, jnp.integer
            ):
                raise ValueError(
                    f"{where}: positions must be integers of shape (T,) = ({t},) or (B, T) = "
                    f"{(b, t)}, got {positions.dtype} {tuple(positions.shape)}."
                )
        h, params = self.embed(params, tokens)
        if self.pos is not None:
            h, params = self.pos(params, h, positions)
        h, params = self.dropout(params, h, is_training=is_training)
        rope = positions if self.position == "rope" else None
        if shard is not None:  # the global positions (None: the blocks' contiguous ones)
            rope = None if given is None else positions
        for block in self.blocks:
            h, params = block(
                params,
                h,
                key_mask=key_mask,
                is_causal=True,
                positions=rope,
                is_training=is_training,
                decode=decode,
            )
        h, params = self.final_norm(params, h)
        if self.head is None:
            return self.embed.attend(params, h)
        return self.head(params, h)
