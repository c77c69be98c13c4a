"""Tensor parallelism (Megatron-style) under the names users call: column- and
row-parallel `Linear`, multi-head attention with its heads split over the model axis,
and the MLP and transformer blocks built from them.

Tensor parallelism is a mode of the `blox.nn` layers themselves (their ``tp_axis``
argument: `Linear` with ``tp_split``, `MLP`, `MultiHeadAttention`, `TransformerBlock`);
each class here is its `blox.nn` layer with the model axis set (``axis=``) and nothing
else added, so it creates its parameters at the **same paths and shapes** and one
`Params` (or one checkpoint) serves the sharded and the unsharded model. How a
parameter is sharded is said by the rules (`transformer_tp_rules`), not by the layer.

Each layer runs in one of two modes, chosen by where it is called:

* **Manual** (inside ``jax.shard_map`` with the model axis bound): the parameters are
  this device's shards and the collectives are explicit: a row-parallel layer does one
  ``psum`` over the model axis in forward; nothing else communicates in forward. Under
  ``check_vma=True`` (the default) autodiff gives the matching backward collectives (the
  gradient of a replicated input is summed over the model axis).
* **Global** (under ``jax.jit`` with sharded arrays, no ``shard_map``): the layer computes
  the unsharded math; on an *Explicit* mesh a row-parallel matmul contracts a sharded
  dimension, so the layer passes the ``out_sharding`` JAX needs (batch dims kept, the
  feature dim replicated); on an *Auto* mesh the compiler chooses.
"""

from __future__ import annotations

from typing import Any

from blox.core import Graph, Rng
from blox.nn import MLP, Linear, MultiHeadAttention, TransformerBlock

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelMultiHeadAttention",
    "ParallelTransformerBlock",
    "RowParallelLinear",
    "transformer_tp_rules",
]


class ColumnParallelLinear(Linear):
    """A `Linear` whose output features (kernel columns) are split over the model axis:
    ``Linear(..., tp_axis=axis, tp_split='column')``.

    Shapes: ``(..., D_in)`` -> ``(..., D_out)`` globally; inside ``shard_map`` each device
    gets the full input ``(..., D_in)`` and returns its slice ``(..., D_out / M)`` of the
    outputs (M the model-axis size). No communication in forward; in backward the input
    gradient is summed over the model axis (autodiff, ``check_vma=True``).

    Args:
      graph: this module's node.
      output_size: ``D_out`` (the global size; M must divide it).
      rng: the `Rng` for initialization.
      axis: the model axis.
      **kwargs: keyword arguments of `Linear` (``use_bias``, ``kernel_init``,
        ``bias_init``, ``dtype``, ``param_dtype``, ...).

    Parameters (as `Linear`): ``<path>/kernel`` ``(D_in, D_out)`` (rule
    ``(None, axis)``), ``<path>/bias`` ``(D_out,)`` (rule ``(axis,)``).

    >>> import jax, jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> layer = bp.ColumnParallelLinear(g / 'fc', 4, rng)
    >>> y, params = layer(rng.seed(bx.Params(), seed=0), jnp.ones((2, 3)))  # global mode
    >>> y.shape, params[('net', 'fc', 'kernel')].value.shape
    ((2, 4), (3, 4))
    """

    def __init__(
        self, graph: Graph, output_size: int, rng: Rng | None, *, axis: str = "model", **kwargs: Any
    ):
        super().__init__(graph, output_size, rng, tp_axis=axis, tp_split="column", **kwargs)


class RowParallelLinear(Linear):
    """A `Linear` whose input features (kernel rows) are split over the model axis:
    ``Linear(..., tp_axis=axis, tp_split='row')``.

    Shapes: ``(..., D_in)`` -> ``(..., D_out)``; inside ``shard_map`` each device takes its
    slice ``(..., D_in / M)`` of the input (the output of a `ColumnParallelLinear`),
    multiplies by its rows of the kernel, and the partial products are summed with **one
    all-reduce** (``psum`` over the model axis); the bias is added after it. Globally on
    an Explicit mesh the matmul gets ``out_sharding`` (batch dims kept, features
    replicated); on an Auto mesh the compiler places the all-reduce.

    Args: as `ColumnParallelLinear`.

    Parameters (as `Linear`): ``<path>/kernel`` ``(D_in, D_out)`` (rule ``(axis, None)``),
    ``<path>/bias`` ``(D_out,)`` (replicated).

    >>> import jax, jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> layer = bp.RowParallelLinear(g / 'fc', 4, rng)
    >>> y, params = layer(rng.seed(bx.Params(), seed=0), jnp.ones((2, 3)))  # global mode
    >>> y.shape
    (2, 4)
    """

    def __init__(
        self, graph: Graph, output_size: int, rng: Rng | None, *, axis: str = "model", **kwargs: Any
    ):
        super().__init__(graph, output_size, rng, tp_axis=axis, tp_split="row", **kwargs)


class ParallelMLP(MLP):
    """Two-layer MLP, column- then row-parallel: ``Linear(F) -> activation ->
    Linear(D_out)`` with one all-reduce in forward (in the second layer);
    ``MLP(graph, (F, D_out), rng, tp_axis=axis, ...)``.

    Shapes: ``(..., D_in)`` -> ``(..., D_out)``; inside ``shard_map`` the hidden
    activations ``(..., F / M)`` never leave the device.

    Args:
      graph: this module's node.
      hidden_size: F (M must divide it).
      output_size: D_out.
      rng: the `Rng` for initialization.
      axis: the model axis.
      **kwargs: keyword arguments of `MLP` (``activation``, default ``jax.nn.relu``,
        ``use_bias``, ``kernel_init``, ``bias_init``, ``dtype``, ``param_dtype``).

    Parameters (as ``MLP(graph, (F, D_out))``): ``<path>/linear_0/kernel`` ``(D_in, F)``,
    ``<path>/linear_0/bias`` ``(F,)``, ``<path>/linear_1/kernel`` ``(F, D_out)``,
    ``<path>/linear_1/bias`` ``(D_out,)``.

    >>> import jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> mlp = bp.ParallelMLP(g / 'mlp', 8, 3, rng)
    >>> y, params = mlp(rng.seed(bx.Params(), seed=0), jnp.ones((2, 3)))
    >>> y.shape
    (2, 3)
    """

    def __init__(
        self,
        graph: Graph,
        hidden_size: int,
        output_size: int,
        rng: Rng | None,
        *,
        axis: str = "model",
        **kwargs: Any,
    ):
        super().__init__(graph, (hidden_size, output_size), rng, tp_axis=axis, **kwargs)


class ParallelMultiHeadAttention(MultiHeadAttention):
    """Multi-head attention with its heads split over the model axis (grouped-query
    heads included): ``MultiHeadAttention(..., tp_axis=axis)``, the same parameters and
    math.

    Legend: B batch, T query length, S key length, D ``model_size``, N ``num_heads``, K
    ``num_kv_heads``, H ``head_dim``, M the model-axis size.

    Shapes: ``x (B, T, D)``, ``context (B, S, D_ctx)`` (default ``x``) ->
    ``(B, T, output_size)`` on every model shard; masks as `MultiHeadAttention`.

    Inside ``shard_map`` device m holds query heads ``m*N/M ... (m+1)*N/M - 1`` (the
    query/key/value projections are column-parallel, head-major columns) and computes
    their attention locally; the output projection is row-parallel: **one all-reduce**
    in forward. Key/value heads: if M divides K they are split the same way; if K
    divides M (e.g. multi-query, K = 1) the key/value projections are replicated and
    each device uses the one key/value head its query heads share.

    Args:
      graph: this module's node.
      model_size: D.
      num_heads: N (M must divide it).
      rng: the `Rng` for initialization and attention dropout.
      axis: the model axis.
      **kwargs: keyword arguments of `MultiHeadAttention` (``num_kv_heads``,
        ``head_dim``, ``output_size``, ``use_bias``, ``dropout_rate``, ``use_rope``,
        ``rope_base``, ``kernel_init``, ``bias_init``, ``dtype``, ``param_dtype``).
        Attention dropout draws only this device's heads' masks, each from the head's
        own key (``fold_in(key, h)``, as `MultiHeadAttention` draws it), so it equals
        the unsharded layer's.

    Parameters: as `MultiHeadAttention` (``query``, ``key``, ``value``, ``out``, each a
    ``kernel`` and a ``bias``); rules in `transformer_tp_rules`. KV-cache decoding runs
    outside ``shard_map`` only.

    Call: as `MultiHeadAttention`. ``mask`` (boolean, True = may attend) is read by its
    rank: ``(T, S)`` for every sequence and head, ``(B, T, S)`` one per sequence shared
    by the heads (never ``(N, T, S)``), ``(B, N, T, S)`` per head (size-1 axes
    broadcast; give per-head masks as ``(B, N, T, S)`` or ``mask[None]``), always with
    all N heads: each device cuts out its own. ``key_mask`` ``(B, S)``. Inside
    ``shard_map`` B is the device's batch shard, so pass the masks sharded like ``x``.

    >>> import jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> attn = bp.ParallelMultiHeadAttention(g / 'attn', model_size=8, num_heads=2, rng=rng)
    >>> y, params = attn(rng.seed(bx.Params(), seed=0), jnp.ones((1, 5, 8)), is_causal=True)
    >>> y.shape
    (1, 5, 8)
    """

    def __init__(self, graph: Graph, model_size: int, num_heads: int, rng: Rng | None, *,
                 axis: str = "model", **kwargs: Any):  # fmt: skip
        super().__init__(graph, model_size, num_heads, rng, tp_axis=axis, **kwargs)


class ParallelTransformerBlock(TransformerBlock):
    """The pre-norm `TransformerBlock`, tensor-parallel: ``TransformerBlock(...,
    tp_axis=axis)``, head-split attention and a column/row MLP, so **two all-reduces in
    forward** (one per row-parallel layer); the norms, residuals and dropout run
    replicated on every model shard::

        h = x + dropout(attn(norm1(x)))
        y = h + dropout(mlp(norm2(h)))

    Shapes: ``(B, T, D)`` -> ``(B, T, D)`` (full activations on every model shard).

    Args:
      graph: this module's node.
      model_size: D.
      num_heads: N (the model-axis size must divide it).
      rng: the `Rng` for initialization and dropout.
      axis: the model axis.
      **kwargs: keyword arguments of `TransformerBlock` (``mlp_size`` (F, default
        4 D), ``num_kv_heads``, ``dropout_rate``, ``attention_dropout_rate``,
        ``activation`` (default ``jax.nn.gelu``), ``norm`` (``'layer'`` or ``'rms'``),
        ``epsilon``, ``use_rope``, ``use_bias``, ``dtype``, ``param_dtype``).

    Parameters: the same paths and shapes as `TransformerBlock`: ``norm1``, ``attn/
    {query,key,value,out}``, ``norm2``, ``mlp/linear_0`` ``(D, F)``, ``mlp/linear_1``
    ``(F, D)``; a `Params` made by either block works in the other. Residual dropout
    masks are drawn from the same key on every model shard (do not fold the model axis
    into the seed; see `fold_seeds`).

    Call: as `TransformerBlock` (``block(params, x, *, mask=None, key_mask=None,
    is_causal=False, is_training=True, ...)``); the masks as in
    `ParallelMultiHeadAttention` (a 3-D ``mask`` is ``(B, T, S)``, shared by the heads).

    >>> import jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> block = bp.ParallelTransformerBlock(g / 'block', 8, 2, rng, mlp_size=16)
    >>> params = rng.seed(bx.Params(), seed=0)
    >>> y, params = block(params, jnp.ones((1, 4, 8)), is_causal=True)   # global mode
    >>> y.shape, params[('net', 'block', 'mlp', 'linear_0', 'kernel')].value.shape
    ((1, 4, 8), (8, 16))
    """

    def __init__(self, graph: Graph, model_size: int, num_heads: int, rng: Rng | None, *,
                 axis: str = "model", **kwargs: Any):  # fmt: skip
        super().__init__(graph, model_size, num_heads, rng, tp_axis=axis, **kwargs)


def transformer_tp_rules(axis: str = "model", *, shard_kv: bool = True) -> list[tuple[str, Any]]:
    """The sharding rules of Megatron-style tensor parallelism for `TransformerBlock` /
    `ParallelTransformerBlock` parameters (any prefix, e.g. ``lm/block_3/...``).

    Column-parallel (output features split): ``attn/{query,key,value}`` and
    ``mlp/linear_0`` kernels ``(None, axis)``, their biases ``(axis,)``. Row-parallel
    (input features split): ``attn/out`` and ``mlp/linear_1`` kernels ``(axis, None)``,
    biases replicated. Norm scales and biases replicated. With ``shard_kv=False``
    (``num_kv_heads`` smaller than the model axis, e.g. multi-query attention) the
    key/value projections are replicated.

    Embeddings, heads and RNG state are not covered: add rules for them (or use
    ``replicate_rest=True``).

    >>> from blox import parallel as bp
    >>> bp.transformer_tp_rules()[0]
    ('attn/query/kernel', (None, 'model'))
    """
    kv_kernel = (None, axis) if shard_kv else None
    kv_bias = (axis,) if shard_kv else None
    return [
        ("attn/query/kernel", (None, axis)),
        ("attn/query/bias", (axis,)),
        ("attn/(key|value)/kernel", kv_kernel),
        ("attn/(key|value)/bias", kv_bias),
        ("attn/out/kernel", (axis, None)),
        ("attn/out/bias", None),
        ("mlp/linear_0/kernel", (None, axis)),
        ("mlp/linear_0/bias", (axis,)),
        ("mlp/linear_1/kernel", (axis, None)),
        ("mlp/linear_1/bias", None),
        (r"\w*norm\w*/(scale|bias)", None),
    ]
