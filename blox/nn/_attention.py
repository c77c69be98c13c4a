"""`MultiHeadAttention`: self/cross attention, masks, grouped-query heads, KV cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from blox.core import Graph, Module, Params, Rng
from blox.core._errors import BloxKeyError
from blox.nn._linear import Linear, tp_axis_size
from blox.nn._position import apply_rotary, check_context_axis, context_shard, global_positions

__all__ = ["MultiHeadAttention"]


def _checked_key_mask(where: str, key_mask: Any, dims: str, shape: tuple, note: str) -> jax.Array:
    """`key_mask` as an array, raising, naming `where`, unless it is boolean of `shape`."""
    key_mask = jnp.asarray(key_mask)
    if key_mask.shape != shape or key_mask.dtype != jnp.bool_:
        raise ValueError(
            f"{where}: key_mask must be a boolean array of shape {dims} = {shape} ({note}), "
            f"got {key_mask.dtype} {tuple(key_mask.shape)}."
        )
    return key_mask


class HeadLayout(NamedTuple):
    """The heads one call of `MultiHeadAttention` computes (`MultiHeadAttention.
    head_layout`): all of them, or one device's share under tensor parallelism.

    Attributes:
      num_heads: the query heads here, n (N, or N / M over a model axis of M devices).
      num_kv_heads: the key/value heads here (K, K / M, or 1 when replicated).
      first: the global index of the first query head here (an int, or a traced
        int32 inside ``shard_map``).
      kv_head: with replicated key/value projections (K divides M), the index of the
        one key/value head this device's query heads share; else None.
    """

    num_heads: int
    num_kv_heads: int
    first: Any
    kv_head: Any


_default_kernel_init = jax.nn.initializers.lecun_normal()

_NO_CACHE = (
    "MultiHeadAttention '{path}': decode=True needs a KV cache in params, and there is "
    "none. Create it once before decoding:\n"
    "    params = model.init_cache(params, batch_size, max_length)\n"
    "    logits, params = model(params, tokens, decode=True)"
)

_OVERFLOW = (
    "MultiHeadAttention '{path}': KV cache overflow: the cache holds {length} positions "
    "(cache_key {shape}), {index} are filled and the input adds {new} (x shape {xshape}). "
    "Create a larger cache with init_cache(params, batch_size, max_length) (max_length >= "
    "{need}), or start a new sequence with init_cache."
)


def _large_negative(dtype: Any) -> jax.Array:
    # The value jax.nn.dot_product_attention uses for masked logits (so both paths agree).
    m = min(float(jnp.finfo(dtype).max), float(jnp.finfo(jnp.float32).max))
    return jnp.asarray(-0.7 * m, dtype=dtype)


def dropout_keep_mask(
    key: jax.Array, dropout_rate: float, heads: jax.Array, shape: tuple[int, int, int]
) -> jax.Array:
    """The attention-dropout keep-mask of the query heads `heads` (global head indices,
    an int ``(n,)`` array), ``(B, n, T, S)`` for ``shape = (B, T, S)``.

    Head ``h`` draws its own mask, ``jax.random.bernoulli(jax.random.fold_in(key, h),
    1 - dropout_rate, (B, T, S))``, so a device of a tensor-parallel layer draws only
    its own heads' bits and they equal the unsharded layer's bits for those heads.
    """
    b, t, s = shape
    keep_p = 1.0 - dropout_rate

    def one(h: jax.Array) -> jax.Array:
        return jax.random.bernoulli(jax.random.fold_in(key, h), keep_p, (b, t, s))

    return jnp.moveaxis(jax.vmap(one)(heads), 0, 1)


def attention_written_out(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    causal: bool,
    keep: jax.Array | None = None,
    dropout_rate: float = 0.0,
) -> jax.Array:
    """The math of ``jax.nn.dot_product_attention`` written out (used by
    `MultiHeadAttention.attend` with dropout and in float64).

    ``q (B, T, N, H)``, ``k, v (B, S, K, H)`` (``K`` key/value heads, each shared by
    ``N / K`` query heads), a boolean `mask` broadcastable to ``(B, N, T, S)``; logits
    and softmax in float32 (float64 for float64 inputs). `keep`, a boolean dropout
    keep-mask ``(B, N, T, S)`` (`dropout_keep_mask`; query head ``n`` is key/value head
    ``n // (N / K)``), zeroes the dropped weights and scales the kept ones by
    ``1 / (1 - dropout_rate)``.
    Returns ``(B, T, N, H)``.
    """
    b, t, n, h = q.shape
    s, kh = k.shape[1], k.shape[2]
    g = n // kh
    sd = jnp.float64 if q.dtype == jnp.float64 else jnp.float32
    qg = q.reshape(b, t, kh, g, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", qg, k, preferred_element_type=sd)
    logits = logits * jnp.asarray(1.0 / np.sqrt(h), sd)
    if causal:
        tri = jnp.tril(jnp.ones((t, s), dtype=bool)).reshape(1, 1, t, s)
        mask = tri if mask is None else jnp.logical_and(mask, tri)
    if mask is not None:
        mask = jnp.broadcast_to(mask, (b, n, t, s)).reshape(b, kh, g, t, s)
        logits = jnp.where(mask, logits, _large_negative(sd))
    probs = jax.nn.softmax(logits, axis=-1)
    if keep is not None:
        keep = keep.reshape(b, kh, g, t, s)
        scale = jnp.asarray(1.0 / (1.0 - dropout_rate), sd)
        probs = jnp.where(keep, probs * scale, jnp.zeros((), sd))
    out = jnp.einsum("bkgts,bskh->btkgh", probs.astype(v.dtype), v)
    return out.reshape(b, t, n, h)


def check_attention_config(
    where: str,
    model_size: Any,
    num_heads: Any,
    num_kv_heads: Any,
    head_dim: int | None,
    dropout_rate: float,
    use_rope: bool,
) -> tuple[int, int]:
    """The constructor checks of `MultiHeadAttention` (and of layers built on its
    configuration); returns ``(head_dim, num_kv_heads)`` with their
    defaults (``model_size // num_heads``, ``num_heads``) filled in. `where` names the
    layer in the errors."""
    for name, v in (("model_size", model_size), ("num_heads", num_heads)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{where}: {name} must be a positive int, got {v!r}.")
    if head_dim is None:
        if model_size % num_heads:
            raise ValueError(
                f"{where}: num_heads = {num_heads} does not divide model_size = "
                f"{model_size}, so the head size D / N is not an integer. Choose "
                f"num_heads dividing {model_size}, or pass head_dim explicitly."
            )
        head_dim = model_size // num_heads
    if num_kv_heads is None:
        num_kv_heads = num_heads
    if not isinstance(num_kv_heads, int) or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            f"{where}: num_kv_heads = {num_kv_heads!r} must be a positive int dividing "
            f"num_heads = {num_heads} (each group of num_heads / num_kv_heads query "
            f"heads shares one key/value head). Use e.g. num_kv_heads in "
            f"{[k for k in range(1, num_heads + 1) if num_heads % k == 0]}."
        )
    if not 0.0 <= float(dropout_rate) < 1.0:
        raise ValueError(f"{where}: dropout_rate must be in [0, 1), got {dropout_rate}.")
    if use_rope and head_dim % 2:
        raise ValueError(f"{where}: use_rope needs an even head_dim, got {head_dim}.")
    return head_dim, num_kv_heads


_CONTEXT_VARIANTS = ("ring", "allgather")


def check_context_config(
    where: str, context_axis: Any, context_variant: Any, tp_axis: Any
) -> tuple[str | None, str]:
    """The constructor checks of ``context_axis`` / ``context_variant`` (shared by the
    layers that take them); returns them."""
    context_axis = check_context_axis(context_axis, where)
    if context_variant not in _CONTEXT_VARIANTS:
        raise ValueError(
            f"{where}: context_variant must be 'ring' (K/V blocks passed around the ring, "
            "memory of one block) or 'allgather' (K/V gathered once), got "
            f"{context_variant!r}."
        )
    if context_axis is not None and context_axis == tp_axis:
        raise ValueError(
            f"{where}: context_axis and tp_axis are both {context_axis!r}; the sequence and "
            "the heads must be split over different mesh axes (e.g. context_axis='context', "
            "tp_axis='model')."
        )
    return context_axis, context_variant


class MultiHeadAttention(Module):
    """Multi-head dot-product attention (Vaswani et al., 2017), with grouped-query heads
    (Ainslie et al., 2023), optional rotary positions and an optional KV cache.

    Legend: B batch, T query length, S key length, D ``model_size``, N ``num_heads``,
    K ``num_kv_heads``, H ``head_dim``, L cache length.

    Shapes: ``x (B, T, D)`` and ``context (B, S, D_ctx)`` (default ``x``) ->
    ``(B, T, output_size)``; ``mask`` ``(T, S)``, ``(B, T, S)`` or ``(B, N, T, S)``
    (True = may attend), ``key_mask`` ``(B, S)`` (``(B, L)`` when decoding).

    ::

        q = x @ Wq + bq            (B, T, N, H)
        k = context @ Wk + bk      (B, S, K, H)      context = x for self-attention
        v = context @ Wv + bv      (B, S, K, H)
        a = softmax(q k^T / sqrt(H) + mask) v     query head n uses kv head n // (N/K)
        y = a @ Wo + bo            (B, T, output_size)

    ``graph, model_size, num_heads, rng`` may be positional, in this order (the order of
    `TransformerBlock` and `TransformerLM`); every argument after ``rng`` is keyword-only.

    Args:
      graph: this module's node.
      model_size: D, the feature size of the queries' input ``x``.
      num_heads: N.
      rng: the `Rng` for initialization and attention dropout.
      num_kv_heads: K (default N); must divide N. K = 1 is multi-query attention.
      head_dim: H (default D // N; then N must divide D).
      output_size: the output feature size (default D).
      use_bias: biases in the four projections.
      dropout_rate: dropout on the attention weights, applied only when
        ``is_training``. It draws one key from `rng` per call, and query head ``h``
        keeps the weights where ``jax.random.bernoulli(jax.random.fold_in(key, h),
        1 - dropout_rate, (B, T, S))`` is true (so the tensor-parallel layer, which
        draws only its own heads, drops the same weights).
      use_rope: apply rotary position embeddings (`apply_rotary`) to q and k.
      rope_base: the RoPE base.
      kernel_init, bias_init: for the projections; default LeCun normal (fan-in) and
        zeros.
      dtype: the compute dtype; default the promotion of the input and parameter dtypes.
      param_dtype: the dtype parameters are created in (float32).
      tp_axis: the mesh axis of tensor parallelism (Megatron-style), or None
        (default). See below.
      context_axis: the mesh axis the sequence is sharded over (context parallelism),
        or None (default). See below.
      context_variant: ``'ring'`` (default; `blox.parallel.ring_attention`) or
        ``'allgather'`` (`blox.parallel.allgather_attention`), the attention used under
        ``context_axis``.

    Tensor parallelism (``tp_axis`` set; M the axis size): inside a ``jax.shard_map``
    that binds ``tp_axis``, device m computes query heads ``m*N/M ... (m+1)*N/M - 1``:
    the query, key and value projections are column-split (`Linear`'s ``tp_split``,
    head-major columns), the attention is local, and the output projection is
    row-split, so **one all-reduce** in forward. Key/value heads are split the same way
    when M divides K; when K divides M (e.g. multi-query, K = 1) the key/value
    projections are replicated (rules ``shard_kv=False``) and each device keeps the one
    head its query heads share. Masks are given for all N heads (a per-head mask is
    cut to this device's); attention dropout draws only this device's heads, with the
    unsharded layer's bits. The parameters are this device's shards, passed with
    ``in_specs`` from `blox.parallel.param_specs` and
    `blox.parallel.transformer_tp_rules`; their paths and global shapes are those of
    the unsharded layer, so one `Params` serves both. Outside such a ``shard_map`` the
    layer computes the unsharded math (e.g. under ``jax.jit`` on arrays sharded by the
    rules). N not divisible by M, K and M not dividing one another, a ``tp_axis``
    that the enclosing ``shard_map``'s mesh lacks, ``check_vma=False`` and KV-cache
    decoding inside the ``shard_map`` raise, naming the layer and the fix.
    `blox.parallel.ParallelMultiHeadAttention` is this layer with ``tp_axis`` set.

    Context parallelism (``context_axis`` set; C the axis size): inside a
    ``jax.shard_map`` that binds ``context_axis``, ``x`` is this device's shard of the
    sequence, ``(B, T, D)`` with T = the global length / C, and `attend` runs
    `blox.parallel.ring_attention` (or `blox.parallel.allgather_attention`) over the
    axis: the projections stay local, the keys and values travel. Self-attention
    only. ``positions`` are the **global** positions of the local tokens: they rotate
    q and k (RoPE) and decide the causal mask; by default ``index * T + arange(T)``,
    the contiguous layout (device ``index`` holds tokens ``index*T ... index*T+T-1``);
    for the head-tail layout of `blox.parallel.balance_sequence` pass the same
    permutation of ``arange(C T)`` cut to this shard. ``key_mask`` ``(B, T)`` and
    ``segment_ids`` are this shard's. A general ``mask``, cross-attention (a
    ``context``), attention dropout in training and KV-cache decoding raise, naming the
    layer and the fix. Combined with ``tp_axis`` each device attends with its heads over
    its part of the sequence. A query that sees no key (a padding token with every
    earlier key masked) gives 0 here and a uniform average of the values outside CP.
    Outside such a ``shard_map`` the layer computes the unsharded math on the whole
    sequence (same params).

    Parameters: ``<path>/query/kernel`` ``(D, N*H)``, ``<path>/key/kernel``
    ``(D_ctx, K*H)``, ``<path>/value/kernel`` ``(D_ctx, K*H)``, ``<path>/out/kernel``
    ``(N*H, output_size)``, and a ``bias`` for each (if ``use_bias``). The columns of
    a projection are ordered head-major: head ``n`` is columns ``n*H:(n+1)*H``. With
    a cache (`init_cache`), the non-trainable ``<path>/cache_key`` and
    ``<path>/cache_value`` ``(B, L, K, H)`` and ``<path>/cache_index`` (int32 scalar).

    Call: ``attn(params, x, context=None, *, mask=None, key_mask=None,
    segment_ids=None, is_causal=False, positions=None, is_training=True,
    decode=False)`` -> ``(y, params)``:

    - ``x`` ``(B, T, D)``; ``context`` ``(B, S, D_ctx)`` for cross-attention.
    - ``mask``: boolean, True = may attend. Its rank says what it holds: ``(T, S)``
      one mask for every sequence and head; ``(B, T, S)`` one per sequence, shared
      by the heads (Keras' ``attention_mask``); ``(B, N, T, S)`` one per sequence and
      head (size-1 axes broadcast, e.g. ``(B, 1, T, S)`` as Flax's
      ``make_attention_mask`` builds, or ``(1, N, T, S)``). A 3-D mask is never read
      as ``(N, T, S)``, whatever B and N are: give per-head masks as ``mask[None]``.
    - ``key_mask``: boolean ``(B, S)``; False marks padding keys (never attended).
    - ``segment_ids``: int ``(T,)`` or ``(B, T)``, self-attention only: a token attends
      only to keys of its own segment (packed sequences).
    - ``is_causal``: query t attends to keys ``s <= t`` (by index in the sequence,
      or by cache slot when decoding).
    - ``positions``: int ``(T,)`` or ``(B, T)``, the RoPE positions of the T tokens
      of ``x`` (and of the keys, in self-attention); only with ``use_rope=True`` or
      ``context_axis`` (there also the causal mask's positions).
      Default ``arange(T)``, or ``cache_index + arange(T)`` when decoding. Per-row
      positions make a left-padded row equal to its prompt run alone (RoPE depends
      only on position differences, so a shared offset changes nothing but
      rounding).
    - ``decode``: incremental self-attention with the KV cache: the T new tokens go
      into cache slots ``cache_index + arange(T)``, their keys and values are written
      there, they attend causally to every slot filled so far, and the index advances
      by T. The work per call is fixed by L (masking, not slicing), so the per-token
      cost does not grow as the cache fills. ``key_mask``, if given, is ``(B, L)``
      over the cache slots, and ``mask``'s S is L.

    A query row whose keys are all masked gets a uniform average of the values (the
    behaviour of ``jax.nn.dot_product_attention``), not NaN.

    Dtype policy: projections compute in the promotion of the input and parameter
    dtypes (or ``dtype``); the softmax runs in float32 (float64 for float64). The
    attention itself is ``jax.nn.dot_product_attention`` except with dropout in
    training, in float64 (whose softmax jax computes in float32) and for bfloat16 /
    float16 under ``jax_numpy_dtype_promotion='strict'`` (whose backward jax cannot
    lower), where the same math is written out.

    KV-cache overflow: eagerly (cache index a concrete value) a call that would write
    past L raises ``ValueError``; under ``jax.jit`` the index is a traced value, so
    such a call returns NaN outputs instead (never another position's numbers).

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> attn = bx.MultiHeadAttention(g / 'attn', 8, 2, rng)   # model_size 8, 2 heads
    >>> params = rng.seed(bx.Params(), seed=0)
    >>> y, params = attn(params, jnp.ones((1, 5, 8)), is_causal=True)
    >>> y.shape, params[('net', 'attn', 'query', 'kernel')].value.shape
    ((1, 5, 8), (8, 8))
    """

    def __init__(
        self,
        graph: Graph,
        model_size: int,
        num_heads: int,
        rng: Rng | None,
        *,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        output_size: int | None = None,
        use_bias: bool = True,
        dropout_rate: float = 0.0,
        use_rope: bool = False,
        rope_base: float = 10000.0,
        kernel_init: Callable = _default_kernel_init,
        bias_init: Callable = jax.nn.initializers.zeros,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
        tp_axis: str | None = None,
        context_axis: str | None = None,
        context_variant: str = "ring",
    ):
        super().__init__(graph)
        where = self._where()
        self.context_axis, self.context_variant = check_context_config(
            where, context_axis, context_variant, tp_axis
        )
        if rng is not None and not isinstance(rng, Rng):
            raise TypeError(
                f"{where}: rng must be a blox Rng or None, got {type(rng).__name__} "
                f"{rng!r}. The signature is {type(self).__name__}(graph, model_size, num_heads, "
                "rng, *, options...); pass the options by keyword."
            )
        head_dim, num_kv_heads = check_attention_config(
            where, model_size, num_heads, num_kv_heads, head_dim, dropout_rate, use_rope
        )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.model_size = model_size
        self.output_size = model_size if output_size is None else output_size
        self.dropout_rate = float(dropout_rate)
        self.use_rope = use_rope
        self.rope_base = float(rope_base)
        self.rng = rng
        self.dtype = dtype
        self.param_dtype = param_dtype

        self.tp_axis = tp_axis

        def lin(name: str, size: int, split: str) -> Linear:
            return Linear(
                graph.child(name),
                size,
                rng,
                use_bias=use_bias,
                kernel_init=kernel_init,
                bias_init=bias_init,
                dtype=dtype,
                param_dtype=param_dtype,
                tp_axis=tp_axis,
                tp_split=split,
            )

        self.query = lin("query", num_heads * head_dim, "column")
        self.key = lin("key", num_kv_heads * head_dim, "column")
        self.value = lin("value", num_kv_heads * head_dim, "column")
        self.out = lin("out", self.output_size, "row")

    # -- KV cache -----------------------------------------------------------------

    def init_cache(
        self, params: Params, batch_size: int, max_length: int, *, dtype: Any = None
    ) -> Params:
        """Returns params with an empty KV cache for `batch_size` sequences of up to
        `max_length` tokens (replacing any existing cache; works on locked params).

        Args:
          params: the current params.
          batch_size: B.
          max_length: L.
          dtype: the cache dtype (default ``param_dtype``).
        """
        dtype = self.param_dtype if dtype is None else dtype
        shape = (int(batch_size), int(max_length), self.num_kv_heads, self.head_dim)
        values = {
            "cache_key": jnp.zeros(shape, dtype),
            "cache_value": jnp.zeros(shape, dtype),
            "cache_index": jnp.zeros((), jnp.int32),
        }
        was_locked = params.is_locked
        for name, value in values.items():
            if self.param_path(name) in params:
                params = self.set_param(params, name, value)
            else:
                _, params = self.get_param(
                    params.unlocked(),
                    name,
                    value.shape,
                    lambda *_, v=value: v,
                    dtype=value.dtype,
                    trainable=False,
                    metadata={"tag": "kv_cache"},
                )
                params = params.locked() if was_locked else params
        return params

    def cache_index(self, params: Params) -> jax.Array:
        """The number of cached positions (int32 scalar)."""
        index = self.peek_param(params, "cache_index")
        if index is None:
            raise BloxKeyError(_NO_CACHE.format(path=self.path_str))
        return index

    # -- call ---------------------------------------------------------------------

    def __call__(
        self,
        params: Params,
        x: jax.Array,
        context: jax.Array | None = None,
        *,
        mask: ArrayLike | None = None,
        key_mask: ArrayLike | None = None,
        segment_ids: ArrayLike | None = None,
        is_causal: bool = False,
        positions: ArrayLike | None = None,
        is_training: bool = True,
        decode: bool = False,
    ) -> tuple[jax.Array, Params]:
        """Attends from ``x`` ``(B, T, D)`` to ``context`` (default ``x``); returns
        ``((B, T, output_size), params)``. The steps: `head_layout` (this device's
        heads), `project`, the positions and KV cache, the masks, `attend`, and the
        output projection."""
        x, ctx = self._check_inputs(x, context, decode)
        b, t = x.shape[:2]
        shard = context_shard(self.context_axis, self._where())
        if shard is not None:
            self._check_context_call(context, mask, decode, is_training)
        if positions is not None:
            positions = self._check_positions(positions, b, t)
        if segment_ids is not None:
            segment_ids = self._check_segment_ids(segment_ids, b, t, context, decode)
        heads = self.head_layout()
        if shard is not None:
            return self._context_call(
                params, x, heads, shard, key_mask, segment_ids, is_causal, positions
            )
        if decode and heads.num_heads != self.num_heads:
            raise ValueError(
                f"{self._where()}: decode=True inside jax.shard_map over tp_axis "
                f"{self.tp_axis!r} is not supported (the KV cache holds all heads). Decode "
                "outside the shard_map (the layer then computes the unsharded math)."
            )
        q, kk, vv, params = self.project(params, x, ctx, heads)
        overflow, base_mask, causal = None, None, is_causal
        if decode:
            q, kk, vv, base_mask, overflow, params = self._decode_step(
                params, x, (q, kk, vv), positions
            )
            causal = False
        elif self.use_rope:
            q_pos = jnp.arange(t, dtype=jnp.int32) if positions is None else positions
            k_pos = q_pos if context is None else jnp.arange(ctx.shape[1], dtype=jnp.int32)
            q = apply_rotary(q, q_pos, base=self.rope_base)
            kk = apply_rotary(kk, k_pos, base=self.rope_base)
        full = (b, self.num_heads, t, kk.shape[1])
        if segment_ids is not None:
            seg = jnp.broadcast_to(segment_ids, (b, t))
            same = (seg[:, :, None] == seg[:, None, :])[:, None]
            base_mask = same if base_mask is None else jnp.logical_and(base_mask, same)
        full_mask = self._combine_masks(base_mask, mask, key_mask, full, heads)
        key, params = self._dropout_key(params, is_training)
        a = self.attend(
            q, kk, vv, mask=full_mask, is_causal=causal, dropout_key=key, first_head=heads.first
        )
        y, params = self.out(params, a.reshape(b, t, heads.num_heads * self.head_dim))
        if overflow is not None:
            y = jnp.where(overflow, jnp.asarray(jnp.nan, y.dtype), y)
        return y, params

    def _context_call(
        self,
        params: Params,
        x: jax.Array,
        heads: HeadLayout,
        shard: tuple[jax.Array, int],
        key_mask: ArrayLike | None,
        segment_ids: jax.Array | None,
        is_causal: bool,
        positions: jax.Array | None,
    ) -> tuple[jax.Array, Params]:
        """The call on this device's shard of the sequence (a bound ``context_axis``):
        RoPE at the global positions, then `attend` over the axis."""
        b, t = x.shape[:2]
        q, kk, vv, params = self.project(params, x, x, heads)
        if self.use_rope:
            rope = global_positions(shard, t) if positions is None else positions
            q = apply_rotary(q, rope, base=self.rope_base)
            kk = apply_rotary(kk, rope, base=self.rope_base)
        if key_mask is not None:
            key_mask = _checked_key_mask(
                self._where(), key_mask, "(B, T)", (b, t),
                "this device's shard of the sequence; False = padding",
            )  # fmt: skip
        a = self.attend(
            q,
            kk,
            vv,
            is_causal=is_causal,
            first_head=heads.first,
            positions=positions,
            key_mask=key_mask,
            segment_ids=segment_ids,
        )
        return self.out(params, a.reshape(b, t, heads.num_heads * self.head_dim))

    def _check_context_call(self, context: Any, mask: Any, decode: bool, is_training: bool) -> None:
        """Refuses what cannot run on a sequence sharded over ``context_axis``."""
        where = f"{self._where()} (context_axis={self.context_axis!r})"
        if decode:
            raise ValueError(
                f"{where}: decode=True inside a jax.shard_map over the context axis is not "
                "supported (the KV cache holds the whole sequence). Decode outside the "
                "shard_map: the layer then computes the unsharded math with the same params."
            )
        if context is not None:
            raise ValueError(
                f"{where}: cross-attention (a context of shape {tuple(jnp.shape(context))}) "
                "is not supported on a sharded sequence; context parallelism is "
                "self-attention. Use a layer with context_axis=None for cross-attention."
            )
        if mask is not None:
            raise ValueError(
                f"{where}: a general (T, S) mask (got shape {tuple(jnp.shape(mask))}) cannot "
                "be applied to a sequence sharded over the context axis (the keys travel "
                "between devices). Express it with is_causal=True, key_mask (B, T) for "
                "padding and segment_ids (B, T) for packed sequences, which are sharded "
                "with the tokens."
            )
        if is_training and self.dropout_rate > 0.0:
            raise ValueError(
                f"{where}: attention dropout (dropout_rate={self.dropout_rate}) is not "
                "supported under context parallelism (the attention weights are never "
                "formed whole). Build the layer with dropout_rate=0.0 (residual dropout in "
                "TransformerBlock is fine), or call with is_training=False."
            )

    def _check_segment_ids(
        self, segment_ids: ArrayLike, b: int, t: int, context: Any, decode: bool
    ) -> jax.Array:
        where = self._where()
        if context is not None or decode:
            raise ValueError(
                f"{where}: segment_ids are for self-attention without decode (queries and "
                "keys are the same tokens); build a mask (B, T, S) for cross-attention or "
                "decoding."
            )
        seg = jnp.asarray(segment_ids)
        if seg.shape not in ((t,), (b, t)) or not jnp.issubdtype(seg.dtype, jnp.integer):
            raise ValueError(
                f"{where}: segment_ids must be integers of shape (T,) = ({t},) or (B, T) = "
                f"{(b, t)}, got {seg.dtype} {tuple(seg.shape)}."
            )
        return seg

    # -- the steps ----------------------------------------------------------------

    def head_layout(self) -> HeadLayout:
        """The heads this call computes: all of them, or inside a ``jax.shard_map``
        binding ``tp_axis`` (M devices) this device's ``N / M`` query heads and their
        key/value heads (split when M divides K, else one replicated head shared by
        this device's queries, when K divides M)."""
        where = self._where()
        n, k = self.num_heads, self.num_kv_heads
        m = tp_axis_size(self.tp_axis, where, "heads")
        if m is None or m == 1:
            return HeadLayout(n, k, 0, None)
        if n % m:
            raise ValueError(
                f"{where}: num_heads = {n} is not divisible by the size {m} of model axis "
                f"{self.tp_axis!r}, so the heads cannot be split evenly. Use num_heads in "
                f"multiples of {m} or a model axis dividing {n}."
            )
        if k % m and m % k:
            raise ValueError(
                f"{where}: num_kv_heads = {k} and the model axis size {m} do not divide one "
                "another; the key/value heads can be split (M divides K) or replicated (K "
                "divides M) only."
            )
        idx = jax.lax.axis_index(self.tp_axis)
        first = idx * (n // m)
        if k % m == 0:
            return HeadLayout(n // m, k // m, first, None)
        return HeadLayout(n // m, 1, first, idx // (m // k))

    def project(
        self, params: Params, x: jax.Array, context: jax.Array, heads: HeadLayout
    ) -> tuple[jax.Array, jax.Array, jax.Array, Params]:
        """The query, key and value projections of `heads`' heads: ``q (B, T, n, H)``,
        ``k, v (B, S, k, H)``. Column-split over ``tp_axis`` inside its ``shard_map``;
        with replicated key/value heads the full projections are computed and the one
        head this device shares is kept."""
        b, t = x.shape[:2]
        s, h = context.shape[1], self.head_dim
        kv_split = None if heads.kv_head is None else "replicated"
        q, params = self.query(params, x)
        kk, params = self.key(params, context, tp_split=kv_split)
        vv, params = self.value(params, context, tp_split=kv_split)
        kk = kk.reshape(b, s, -1, h)
        vv = vv.reshape(b, s, -1, h)
        if heads.kv_head is not None:
            kk = jax.lax.dynamic_slice_in_dim(kk, heads.kv_head, 1, 2)
            vv = jax.lax.dynamic_slice_in_dim(vv, heads.kv_head, 1, 2)
        return q.reshape(b, t, heads.num_heads, h), kk, vv, params

    def attend(
        self,
        q: jax.Array,
        k: jax.Array,
        v: jax.Array,
        *,
        mask: jax.Array | None = None,
        is_causal: bool = False,
        dropout_key: jax.Array | None = None,
        first_head: Any = 0,
        positions: jax.Array | None = None,
        key_mask: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """The attention of projected heads, ``q (B, T, n, H)``, ``k, v (B, S, k, H)``
        -> ``(B, T, n, H)`` (query head ``i`` uses key/value head ``i // (n / k)``).

        Inside a ``jax.shard_map`` binding ``context_axis``, q, k, v are this device's
        shard of the sequence and the masks come per token, as the context-parallel
        functions take them: `positions` (global, for the causal mask; default the
        contiguous layout), `key_mask` ``(B, T)`` and `segment_ids`; this step then
        returns `blox.parallel.ring_attention` (``context_variant='ring'``) or
        `blox.parallel.allgather_attention` over the axis. Elsewhere `key_mask` and
        `segment_ids`, if given, are folded into `mask` (and `positions` ignored).

        `mask` is boolean, broadcastable to ``(B, n, T, S)``; `dropout_key` (training
        with ``dropout_rate > 0``) drops weights with the keep-mask of the global query
        heads ``first_head + arange(n)`` (`dropout_keep_mask`, the bits the unsharded
        layer draws for them). ``jax.nn.dot_product_attention``, or the same math
        written out with dropout and in float64. A subclass may override this step
        (e.g. attention over a sequence sharded across devices); the projections,
        masks and output stay as they are."""
        if context_shard(self.context_axis, self._where()) is not None:
            from blox.parallel import _context  # parallel imports nn

            opts = dict(
                axis=self.context_axis,
                causal=is_causal,
                positions=positions if is_causal else None,
                segment_ids=segment_ids,
                key_mask=key_mask,
            )
            if self.context_variant == "allgather":
                return _context.allgather_attention(q, k, v, **opts)
            nb = 2 if q.shape[1] % 2 == 0 else 1
            return _context.ring_attention(q, k, v, num_blocks=nb, **opts)
        b, t, s = q.shape[0], q.shape[1], k.shape[1]
        if key_mask is not None:
            km = jnp.asarray(key_mask).reshape(b, 1, 1, s)
            mask = km if mask is None else jnp.logical_and(mask, km)
        if segment_ids is not None:
            seg = jnp.broadcast_to(jnp.asarray(segment_ids), (b, t))
            same = (seg[:, :, None] == seg[:, None, :])[:, None]
            mask = same if mask is None else jnp.logical_and(mask, same)
        # jax.nn.dot_product_attention's backward does not lower for bf16/fp16 under
        # strict dtype promotion (its transposed dot mixes f32 and bf16 when it is
        # lowered, outside any scope of ours): the same math written out there.
        low_strict = (
            q.dtype in (jnp.bfloat16, jnp.float16)
            and jax.config.jax_numpy_dtype_promotion == "strict"
        )
        if dropout_key is None and q.dtype != jnp.float64 and not low_strict:
            # jax's own promotion of bf16 logits to f32 is not strict-clean; scope it.
            with jax.numpy_dtype_promotion("standard"):
                return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
        keep = None
        if dropout_key is not None:
            b, t, n, _ = q.shape
            heads = first_head + jnp.arange(n, dtype=jnp.int32)
            keep = dropout_keep_mask(dropout_key, self.dropout_rate, heads, (b, t, k.shape[1]))
        return attention_written_out(q, k, v, mask, is_causal, keep, self.dropout_rate)

    def _where(self) -> str:
        return f"{type(self).__name__} '{self.path_str}'"

    def _check_inputs(
        self, x: ArrayLike, context: ArrayLike | None, decode: bool
    ) -> tuple[jax.Array, jax.Array]:
        where = self._where()
        x = jnp.asarray(x)
        if x.ndim != 3 or x.shape[-1] != self.model_size:
            raise ValueError(
                f"{where} expects x of shape (B, T, {self.model_size}) (model_size "
                f"{self.model_size}), got {tuple(x.shape)}. Fix the input's feature size, "
                "or jax.vmap over extra leading axes."
            )
        if decode and context is not None:
            raise ValueError(
                f"{where}: decode=True is for self-attention; got a context of shape "
                f"{tuple(jnp.shape(context))}. Compute cross-attention without decode."
            )
        ctx = x if context is None else jnp.asarray(context)
        if ctx.ndim != 3 or ctx.shape[0] != x.shape[0]:
            raise ValueError(
                f"{where}: context must have shape (B, S, D_ctx) with B = {x.shape[0]} (x "
                f"shape {tuple(x.shape)}), got {tuple(ctx.shape)}."
            )
        return x, ctx

    def _decode_step(
        self,
        params: Params,
        x: jax.Array,
        qkv: tuple[jax.Array, jax.Array, jax.Array],
        positions: jax.Array | None,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, Params]:
        """Writes the new keys and values into the KV cache; returns ``(q, keys,
        values, visibility mask, overflow flag, params)`` over all L cache slots."""
        q, kk, vv = qkv
        t = q.shape[1]
        index = self._decode_index(params, x)
        slots = index + jnp.arange(t, dtype=jnp.int32)
        if self.use_rope:
            rope = slots if positions is None else positions
            q = apply_rotary(q, rope, base=self.rope_base)
            kk = apply_rotary(kk, rope, base=self.rope_base)
        ck = self.peek_param(params, "cache_key")
        cv = self.peek_param(params, "cache_value")
        length = ck.shape[1]
        start = (jnp.int32(0), index, jnp.int32(0), jnp.int32(0))
        ck = jax.lax.dynamic_update_slice(ck, kk.astype(ck.dtype), start)
        cv = jax.lax.dynamic_update_slice(cv, vv.astype(cv.dtype), start)
        params = self.set_param(params, "cache_key", ck)
        params = self.set_param(params, "cache_value", cv)
        params = self.set_param(params, "cache_index", index + jnp.int32(t))
        overflow = index + jnp.int32(t) > length
        visible = jnp.arange(length, dtype=jnp.int32)[None, :] <= slots[:, None]
        mask = visible.reshape(1, 1, t, length)
        return q, ck.astype(q.dtype), cv.astype(q.dtype), mask, overflow, params

    def _dropout_key(self, params: Params, is_training: bool) -> tuple[jax.Array | None, Params]:
        """One key from `rng` for the attention dropout (None when it is off)."""
        if not (is_training and self.dropout_rate > 0.0):
            return None, params
        if self.rng is None:
            raise ValueError(
                f"{self._where()}: dropout_rate > 0 needs an Rng in training mode: pass "
                "rng=... to the constructor, or call with is_training=False."
            )
        return self.rng(params)

    def _cache_length(self, params: Params) -> int:
        ck = self.peek_param(params, "cache_key")
        if ck is None:
            raise BloxKeyError(_NO_CACHE.format(path=self.path_str))
        return ck.shape[1]

    def _decode_index(self, params: Params, x: jax.Array) -> jax.Array:
        index = self.peek_param(params, "cache_index")
        ck = self.peek_param(params, "cache_key")
        if index is None or ck is None:
            raise BloxKeyError(_NO_CACHE.format(path=self.path_str))
        b, t = x.shape[:2]
        length = ck.shape[1]
        if ck.shape[0] != b:
            raise ValueError(
                f"MultiHeadAttention '{self.path_str}': the KV cache was made for batch "
                f"size {ck.shape[0]} (cache_key {tuple(ck.shape)}), got x of shape "
                f"{tuple(x.shape)}. Call init_cache(params, {b}, max_length)."
            )
        concrete = None if isinstance(index, jax.core.Tracer) else int(index)
        if t > length or (concrete is not None and concrete + t > length):
            raise ValueError(
                _OVERFLOW.format(
                    path=self.path_str,
                    length=length,
                    shape=tuple(ck.shape),
                    index="?" if concrete is None else concrete,
                    new=t,
                    xshape=tuple(x.shape),
                    need=(concrete or 0) + t,
                )
            )
        return index

    def _check_positions(self, positions: ArrayLike, b: int, t: int) -> jax.Array:
        where = f"MultiHeadAttention '{self.path_str}'"
        if not self.use_rope and self.context_axis is None:
            raise ValueError(
                f"{where}: positions are used only by rotary embeddings, and this layer has "
                "use_rope=False. Drop positions=..., or construct it with use_rope=True "
                "(absolute positions are added to the inputs instead, e.g. by "
                "LearnedPositionalEmbedding)."
            )
        positions = jnp.asarray(positions)
        if positions.shape not in ((t,), (b, t)) or not jnp.issubdtype(
            positions.dtype, jnp.integer
        ):
            raise ValueError(
                f"{where}: positions must be integers of shape (T,) = ({t},) or (B, T) = "
                f"{(b, t)}, got {positions.dtype} {tuple(positions.shape)}."
            )
        return positions

    def _combine_masks(
        self,
        base: jax.Array | None,
        mask: ArrayLike | None,
        key_mask: ArrayLike | None,
        full: tuple[int, int, int, int],
        heads: HeadLayout,
    ) -> jax.Array | None:
        """The boolean mask ``(B, n | 1, T, S)`` of `heads`' query heads: `base` (the
        cache slots' visibility), `mask` (checked by its rank against the ``full``
        ``(B, N, T, S)``; a per-head mask is cut to this device's heads) and
        `key_mask`; None when there is none."""
        where = self._where()
        b, n, t, s = full
        out = base
        if mask is not None:
            mask = jnp.asarray(mask)
            if mask.dtype != jnp.bool_:
                raise TypeError(
                    f"{where}: mask must be boolean (True = may attend), got dtype "
                    f"{mask.dtype}. Use mask.astype(bool), or mask > 0."
                )
            # By rank: (T, S), (B, T, S) shared by the heads (Keras), (B, N, T, S).
            if mask.ndim == 3:
                mask4 = mask.reshape(mask.shape[0], 1, *mask.shape[1:])
            else:
                mask4 = mask.reshape((1,) * max(4 - mask.ndim, 0) + mask.shape)
            try:
                ok = 2 <= mask.ndim <= 4 and np.broadcast_shapes(mask4.shape, full) == full
            except ValueError:
                ok = False
            if not ok:
                raise ValueError(
                    f"{where}: mask of shape {tuple(mask.shape)} does not match (T, S) = "
                    f"{(t, s)}, (B, T, S) = {(b, t, s)} or (B, N, T, S) = {full} (size-1 "
                    "axes broadcast; a 3-D mask is (B, T, S), shared by the heads: give "
                    "per-head masks as (B, N, T, S) or mask[None] for (1, N, T, S)). For "
                    "padding use key_mask of shape (B, S)."
                )
            mask = mask4
            if mask.shape[1] == n and heads.num_heads != n:
                mask = jax.lax.dynamic_slice_in_dim(mask, heads.first, heads.num_heads, 1)
            out = mask if out is None else jnp.logical_and(out, mask)
        if key_mask is not None:
            key_mask = _checked_key_mask(where, key_mask, "(B, S)", (b, s), "False = padding")
            km = key_mask.reshape(b, 1, 1, s)
            out = km if out is None else jnp.logical_and(out, km)
        return out
