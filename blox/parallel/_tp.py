"""Tensor parallelism (Megatron-style): column- and row-parallel `Linear`, multi-head
attention with its heads split over the model axis, and the MLP and transformer blocks
built from them.

Every layer creates its parameters at the **same paths and shapes** as its `blox.nn`
counterpart (`Linear`, `MLP`, `MultiHeadAttention`, `TransformerBlock`), so one `Params`
(or one checkpoint) serves the sharded and the unsharded model. How a parameter is
sharded is said by the rules (`transformer_tp_rules`), not by the layer.

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

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from blox.core import Graph, Module, Params, Rng
from blox.core._sharding import row_out_sharding as _row_out_sharding
from blox.nn import Dropout, apply_rotary
from blox.nn._attention import attention_written_out, check_attention_config, dropout_keep_mask
from blox.nn._dtype import compute_dtype
from blox.nn._transformer import make_norm, pre_norm_residual
from blox.parallel._mesh import bound_axes, check_vma_enabled

__all__ = [
    "ColumnParallelLinear",
    "ParallelMLP",
    "ParallelMultiHeadAttention",
    "ParallelTransformerBlock",
    "RowParallelLinear",
    "transformer_tp_rules",
]

_kernel_init = jax.nn.initializers.lecun_normal()
_zeros = jax.nn.initializers.zeros


def _manual_size(axis: str, where: str) -> int | None:
    """The model-axis size when running inside shard_map over `axis`, else None."""
    if axis not in bound_axes():
        return None
    if not check_vma_enabled():
        raise ValueError(
            f"{where}: tensor-parallel layers need jax.shard_map(..., check_vma=True) (the "
            "default): with check_vma=False autodiff does not sum the gradient of a "
            "replicated input over the model axis, and gradients come out wrong. Remove "
            "check_vma=False."
        )
    return jax.lax.axis_size(axis)


class _ParallelLinear(Module):
    """Shared constructor and parameter access of the two parallel linear layers."""

    kind = "Linear"
    sharded_dim = 1  # of the kernel: 1 = columns (outputs), 0 = rows (inputs)

    def __init__(
        self,
        graph: Graph,
        output_size: int,
        rng: Rng | None,
        *,
        axis: str = "model",
        use_bias: bool = True,
        kernel_init: Callable = _kernel_init,
        bias_init: Callable = _zeros,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        if not isinstance(output_size, int) or isinstance(output_size, bool) or output_size <= 0:
            raise ValueError(
                f"{self.kind} '{self.path_str}': output_size must be a positive int, got "
                f"{output_size!r}."
            )
        if not isinstance(axis, str):
            raise TypeError(f"{self.kind} '{self.path_str}': axis must be a mesh-axis name.")
        self.output_size = output_size
        self.rng = rng
        self.axis = axis
        self.use_bias = use_bias
        self.kernel_init = kernel_init
        self.bias_init = bias_init
        self.dtype = dtype
        self.param_dtype = param_dtype

    def _param(self, params: Params, name: str, shape: tuple, dim: int | None, m: int | None):
        """Reads (manual: this device's shard) or lazily creates (global) a parameter of
        full shape `shape`, sharded over the model axis on `dim` (None: replicated)."""
        where = f"{self.kind} '{self.path_str}'"
        if m is None:
            init = self.kernel_init if name == "kernel" else self.bias_init
            return self.get_param(params, name, shape, init, dtype=self.param_dtype, rng=self.rng)
        path = self.param_path(name)
        value = params.value(path)
        if value is None:
            raise ValueError(
                f"{where}: parameter '{'/'.join(path)}' is missing inside shard_map. Create "
                "the params outside (a global init, e.g. jax.jit(init, out_shardings="
                "bp.param_shardings(...))) and pass them in with in_specs from "
                "bp.param_specs(params, rules)."
            )
        local = list(shape)
        if dim is not None:
            if shape[dim] % m:
                raise ValueError(
                    f"{where}: dimension {dim} of '{name}' {tuple(shape)} (size {shape[dim]}) "
                    f"is not divisible by the size {m} of model axis {self.axis!r}. Choose "
                    f"sizes divisible by {m} or a smaller model axis."
                )
            local[dim] //= m
        if tuple(value.shape) != tuple(local):
            split = (
                f"split over {self.axis!r} ({m}) on dimension {dim}"
                if dim is not None
                else ("replicated")
            )
            raise ValueError(
                f"{where}: inside shard_map '{name}' has local shape {tuple(value.shape)}, "
                f"expected {tuple(local)} (full {tuple(shape)}, {split}). Pass the params "
                "with in_specs=bp.param_specs(params, bp.transformer_tp_rules(...)) (or "
                "rules that shard it this way)."
            )
        return value, params

    def _check_input(self, x: jax.Array) -> None:
        if x.ndim == 0:
            raise ValueError(
                f"{self.kind} '{self.path_str}': input must not be scalar; expected shape "
                "(..., in_features)."
            )


class ColumnParallelLinear(_ParallelLinear):
    """A `Linear` whose output features (kernel columns) are split over the model axis.

    Shapes: ``(..., D_in)`` -> ``(..., D_out)`` globally; inside ``shard_map`` each device
    gets the full input ``(..., D_in)`` and returns its slice ``(..., D_out / M)`` of the
    outputs (M the model-axis size). No communication in forward; in backward the input
    gradient is summed over the model axis (autodiff, ``check_vma=True``).

    Args:
      graph: this module's node.
      output_size: ``D_out`` (the global size; M must divide it).
      rng: the `Rng` for initialization.
      axis: the model axis.
      use_bias, kernel_init, bias_init: as `Linear`.
      dtype: the compute dtype (default: promotion of input and parameter dtypes).
      param_dtype: the dtype parameters are created in (float32).

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

    kind = "ColumnParallelLinear"

    def __call__(
        self, params: Params, x: jax.Array, precision: Any = None
    ) -> tuple[jax.Array, Params]:
        """``x`` ``(..., D_in)`` -> ``((..., D_out) or its local slice, params)``."""
        x = jnp.asarray(x)
        self._check_input(x)
        m = _manual_size(self.axis, self.kind + f" '{self.path_str}'")
        full = (x.shape[-1], self.output_size)
        kernel, params = self._param(params, "kernel", full, 1, m)
        cd = compute_dtype(x, kernel.dtype, self.dtype)
        y = jnp.dot(x.astype(cd), kernel.astype(cd), precision=precision)
        if self.use_bias:
            bias, params = self._param(params, "bias", (self.output_size,), 0, m)
            y = y + jnp.expand_dims(bias.astype(cd), tuple(range(y.ndim - 1)))
        return y, params


class RowParallelLinear(_ParallelLinear):
    """A `Linear` whose input features (kernel rows) are split over the model axis.

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

    kind = "RowParallelLinear"
    sharded_dim = 0

    def __call__(
        self, params: Params, x: jax.Array, precision: Any = None
    ) -> tuple[jax.Array, Params]:
        """``x`` ``(..., D_in)`` (or its local slice) -> ``((..., D_out), params)``."""
        x = jnp.asarray(x)
        self._check_input(x)
        m = _manual_size(self.axis, self.kind + f" '{self.path_str}'")
        d_in = x.shape[-1] * (m or 1)
        kernel, params = self._param(params, "kernel", (d_in, self.output_size), 0, m)
        cd = compute_dtype(x, kernel.dtype, self.dtype)
        if m is None:
            y = jnp.dot(
                x.astype(cd),
                kernel.astype(cd),
                precision=precision,
                out_sharding=_row_out_sharding(x, self.axis),
            )
        else:
            partial = jnp.dot(x.astype(cd), kernel.astype(cd), precision=precision)
            y = jax.lax.psum(partial, self.axis)  # the one all-reduce of this layer
        if self.use_bias:
            bias, params = self._param(params, "bias", (self.output_size,), None, m)
            y = y + jnp.expand_dims(bias.astype(cd), tuple(range(y.ndim - 1)))
        return y, params


class ParallelMLP(Module):
    """Two-layer MLP, column- then row-parallel: ``Linear(F) -> activation ->
    Linear(D_out)`` with one all-reduce in forward (in the second layer).

    Shapes: ``(..., D_in)`` -> ``(..., D_out)``; inside ``shard_map`` the hidden
    activations ``(..., F / M)`` never leave the device.

    Args:
      graph: this module's node.
      hidden_size: F (M must divide it).
      output_size: D_out.
      rng: the `Rng` for initialization.
      axis: the model axis.
      activation: between the layers (default ``jax.nn.relu``, as `MLP`).
      use_bias, kernel_init, bias_init, dtype, param_dtype: for both layers.

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
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        use_bias: bool = True,
        kernel_init: Callable = _kernel_init,
        bias_init: Callable = _zeros,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        kw = dict(
            axis=axis,
            use_bias=use_bias,
            kernel_init=kernel_init,
            bias_init=bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.activation = activation
        self.linear_0 = ColumnParallelLinear(graph.child("linear_0"), hidden_size, rng, **kw)
        self.linear_1 = RowParallelLinear(graph.child("linear_1"), output_size, rng, **kw)

    def __call__(
        self, params: Params, x: jax.Array, precision: Any = None
    ) -> tuple[jax.Array, Params]:
        """``x`` ``(..., D_in)`` -> ``((..., D_out), params)``."""
        h, params = self.linear_0(params, x, precision=precision)
        return self.linear_1(params, self.activation(h), precision=precision)


class ParallelMultiHeadAttention(Module):
    """Multi-head attention with its heads split over the model axis (grouped-query
    heads included); the same parameters and math as `MultiHeadAttention`.

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
      num_kv_heads: K (default N; must divide N).
      head_dim: H (default D // N).
      output_size: default D.
      use_bias, dropout_rate, use_rope, rope_base, kernel_init, bias_init, dtype,
        param_dtype: as `MultiHeadAttention`. Attention dropout draws only this
        device's heads' masks, each from the head's own key (``fold_in(key, h)``, as
        `MultiHeadAttention` draws it), so it equals the unsharded layer's.

    Parameters: as `MultiHeadAttention` (``query``, ``key``, ``value``, ``out``, each a
    ``kernel`` and a ``bias``); rules in `transformer_tp_rules`. No KV cache (decode).

    Call: ``attn(params, x, context=None, *, mask=None, key_mask=None,
    is_causal=False, is_training=True)`` -> ``((B, T, output_size), params)``. ``mask``
    (boolean, True = may attend) as in `MultiHeadAttention`, read by its rank: ``(T, S)``
    for every sequence and head, ``(B, T, S)`` one per sequence shared by the heads (never
    ``(N, T, S)``), ``(B, N, T, S)`` per head (size-1 axes broadcast; give per-head masks
    as ``(B, N, T, S)`` or ``mask[None]``), always with all N heads: each device cuts out
    its own. ``key_mask`` ``(B, S)``. Inside ``shard_map`` B is the device's batch shard,
    so pass the masks sharded like ``x``.

    >>> import jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> attn = bp.ParallelMultiHeadAttention(g / 'attn', model_size=8, num_heads=2, rng=rng)
    >>> y, params = attn(rng.seed(bx.Params(), seed=0), jnp.ones((1, 5, 8)), is_causal=True)
    >>> y.shape
    (1, 5, 8)
    """

    def __init__(
        self,
        graph: Graph,
        model_size: int,
        num_heads: int,
        rng: Rng | None,
        *,
        axis: str = "model",
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        output_size: int | None = None,
        use_bias: bool = True,
        dropout_rate: float = 0.0,
        use_rope: bool = False,
        rope_base: float = 10000.0,
        kernel_init: Callable = _kernel_init,
        bias_init: Callable = _zeros,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        where = f"ParallelMultiHeadAttention '{self.path_str}'"
        head_dim, num_kv_heads = check_attention_config(
            where, model_size, num_heads, num_kv_heads, head_dim, dropout_rate, use_rope
        )
        self.axis = axis
        self.model_size = model_size
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.output_size = model_size if output_size is None else output_size
        self.dropout_rate = float(dropout_rate)
        self.use_rope = use_rope
        self.rope_base = float(rope_base)
        self.rng = rng
        kw = dict(
            axis=axis,
            use_bias=use_bias,
            kernel_init=kernel_init,
            bias_init=bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.query = ColumnParallelLinear(graph.child("query"), num_heads * head_dim, rng, **kw)
        self.key = ColumnParallelLinear(graph.child("key"), num_kv_heads * head_dim, rng, **kw)
        self.value = ColumnParallelLinear(graph.child("value"), num_kv_heads * head_dim, rng, **kw)
        self.out = RowParallelLinear(graph.child("out"), self.output_size, rng, **kw)

    def _layout(self, m: int | None) -> tuple[int, int, bool]:
        """(local query heads, local kv heads, kv replicated) for model-axis size m."""
        n, k = self.num_heads, self.num_kv_heads
        if m is None or m == 1:
            return n, k, False
        where = f"ParallelMultiHeadAttention '{self.path_str}'"
        if n % m:
            raise ValueError(
                f"{where}: num_heads = {n} is not divisible by the size {m} of model axis "
                f"{self.axis!r}, so the heads cannot be split evenly. Use num_heads in "
                f"multiples of {m} or a model axis dividing {n}."
            )
        if k % m == 0:
            return n // m, k // m, False
        if m % k == 0:
            return n // m, 1, True
        raise ValueError(
            f"{where}: num_kv_heads = {k} and the model axis size {m} do not divide one "
            "another; the key/value heads can be split (M divides K) or replicated (K "
            "divides M) only."
        )

    def __call__(
        self,
        params: Params,
        x: jax.Array,
        context: jax.Array | None = None,
        *,
        mask: ArrayLike | None = None,
        key_mask: ArrayLike | None = None,
        is_causal: bool = False,
        is_training: bool = True,
    ) -> tuple[jax.Array, Params]:
        """Attends from ``x`` ``(B, T, D)`` to ``context`` (default ``x``)."""
        where = f"ParallelMultiHeadAttention '{self.path_str}'"
        x = jnp.asarray(x)
        if x.ndim != 3 or x.shape[-1] != self.model_size:
            raise ValueError(
                f"{where} expects x of shape (B, T, {self.model_size}), got {tuple(x.shape)}."
            )
        ctx = x if context is None else jnp.asarray(context)
        b, t = x.shape[:2]
        s = ctx.shape[1]
        m = _manual_size(self.axis, where)
        nl, kl, kv_replicated = self._layout(m)
        h = self.head_dim
        idx = jax.lax.axis_index(self.axis) if m is not None and m > 1 else None

        q, params = self.query(params, x)
        if kv_replicated:
            # Key/value projections replicated: compute all K heads, keep the shared one.
            kk, params = self._replicated_kv(self.key, params, ctx)
            vv, params = self._replicated_kv(self.value, params, ctx)
            head = idx // (m // self.num_kv_heads)
            kk = jax.lax.dynamic_slice_in_dim(kk.reshape(b, s, self.num_kv_heads, h), head, 1, 2)
            vv = jax.lax.dynamic_slice_in_dim(vv.reshape(b, s, self.num_kv_heads, h), head, 1, 2)
        else:
            kk, params = self.key(params, ctx)
            vv, params = self.value(params, ctx)
        q = q.reshape(b, t, nl, h)
        kk = kk.reshape(b, s, kl, h)
        vv = vv.reshape(b, s, kl, h)
        if self.use_rope:
            q = apply_rotary(q, jnp.arange(t, dtype=jnp.int32), base=self.rope_base)
            kk = apply_rotary(kk, jnp.arange(s, dtype=jnp.int32), base=self.rope_base)
        full_mask = self._mask(mask, key_mask, (b, t, s), nl, idx)

        dropout = is_training and self.dropout_rate > 0.0
        if dropout or q.dtype == jnp.float64:
            keep = None
            if dropout:
                if self.rng is None:
                    raise ValueError(
                        f"{where}: dropout_rate > 0 needs an Rng in training mode: pass "
                        "rng=... to the constructor, or call with is_training=False."
                    )
                key, params = self.rng(params)
                keep = self._keep_mask(key, (b, t, s), nl, idx)
            a = self._attend(q, kk, vv, full_mask, is_causal, keep)
        else:
            with jax.numpy_dtype_promotion("standard"):
                a = jax.nn.dot_product_attention(q, kk, vv, mask=full_mask, is_causal=is_causal)
        return self.out(params, a.reshape(b, t, nl * h))

    def _replicated_kv(self, layer: ColumnParallelLinear, params: Params, ctx: jax.Array):
        """The full key/value projection with replicated parameters (K divides M)."""
        kernel = layer.get_param(params, "kernel", (ctx.shape[-1], layer.output_size))[0]
        cd = compute_dtype(ctx, kernel.dtype, layer.dtype)
        y = jnp.dot(ctx.astype(cd), kernel.astype(cd))
        if layer.use_bias:
            bias = layer.get_param(params, "bias", (layer.output_size,))[0]
            y = y + jnp.expand_dims(bias.astype(cd), tuple(range(y.ndim - 1)))
        return y, params

    def _mask(self, mask, key_mask, bts, nl, idx) -> jax.Array | None:
        where = f"ParallelMultiHeadAttention '{self.path_str}'"
        b, t, s = bts
        n = self.num_heads
        out = None
        if mask is not None:
            mask = jnp.asarray(mask)
            if mask.dtype != jnp.bool_:
                raise TypeError(f"{where}: mask must be boolean (True = may attend).")
            full = (b, n, t, s)
            # By rank, as MultiHeadAttention: (T, S), (B, T, S) shared by the heads (never
            # read as (N, T, S)), (B, N, T, S); then this device's heads are cut out.
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
                    f"{(t, s)}, (B, T, S) = {(b, t, s)} or (B, N, T, S) = {full} (B: this "
                    "device's batch shard; size-1 axes broadcast; a 3-D mask is (B, T, S), "
                    "shared by the heads: give per-head masks as (B, N, T, S) or mask[None] "
                    "for (1, N, T, S)). For padding use key_mask of shape (B, S)."
                )
            mask = mask4
            if mask.shape[1] == n and nl != n:
                start = 0 if idx is None else idx * nl
                mask = jax.lax.dynamic_slice_in_dim(mask, start, nl, 1)
            out = mask
        if key_mask is not None:
            key_mask = jnp.asarray(key_mask)
            if key_mask.shape != (b, s) or key_mask.dtype != jnp.bool_:
                raise ValueError(
                    f"{where}: key_mask must be a boolean array of shape (B, S) = {(b, s)}, "
                    f"got {key_mask.dtype} {tuple(key_mask.shape)}."
                )
            km = key_mask.reshape(b, 1, 1, s)
            out = km if out is None else jnp.logical_and(out, km)
        return out

    def _keep_mask(self, key, bts, nl, idx) -> jax.Array:
        """The dropout keep-mask ``(B, nl, T, S)`` of this device's heads only, each head
        drawn from its own key as `MultiHeadAttention` draws it (the same bits; the mask
        of all N heads is never drawn)."""
        heads = jnp.arange(nl, dtype=jnp.int32)
        if idx is not None:
            heads = heads + (idx * nl).astype(jnp.int32)
        return dropout_keep_mask(key, self.dropout_rate, heads, bts)

    def _attend(self, q, k, v, mask, causal, keep) -> jax.Array:
        """The math of ``jax.nn.dot_product_attention`` (as `MultiHeadAttention` writes it
        out), with an optional dropout keep-mask ``(B, n, T, S)``."""
        return attention_written_out(q, k, v, mask, causal, keep, self.dropout_rate)


class ParallelTransformerBlock(Module):
    """The pre-norm `TransformerBlock`, tensor-parallel: head-split attention and a
    column/row `ParallelMLP`, so **two all-reduces in forward** (one per row-parallel
    layer); the norms, residuals and dropout run replicated on every model shard::

        h = x + dropout(attn(norm1(x)))
        y = h + dropout(mlp(norm2(h)))

    Shapes: ``(B, T, D)`` -> ``(B, T, D)`` (full activations on every model shard).

    Args (as `TransformerBlock`): graph, model_size (D), num_heads (N), rng, and the
      keywords axis (the model axis), mlp_size (F, default 4 D), num_kv_heads,
      dropout_rate, attention_dropout_rate, activation (default ``jax.nn.gelu``), norm
      (``'layer'`` or ``'rms'``), epsilon, use_rope, use_bias, dtype, param_dtype.

    Parameters: the same paths and shapes as `TransformerBlock`: ``norm1``, ``attn/
    {query,key,value,out}``, ``norm2``, ``mlp/linear_0`` ``(D, F)``, ``mlp/linear_1``
    ``(F, D)``; a `Params` made by either block works in the other. Residual dropout
    masks are drawn from the same key on every model shard (do not fold the model axis
    into the seed; see `fold_seeds`).

    Call: ``block(params, x, *, mask=None, key_mask=None, is_causal=False,
    is_training=True)``; the masks as in `ParallelMultiHeadAttention` (a 3-D ``mask`` is
    ``(B, T, S)``, shared by the heads).

    >>> import jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> block = bp.ParallelTransformerBlock(g / 'block', model_size=8, num_heads=2, rng=rng)
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
        axis: str = "model",
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
    ):
        super().__init__(graph)
        self.model_size = model_size
        self.mlp_size = 4 * model_size if mlp_size is None else mlp_size
        self.norm1 = make_norm(graph.child("norm1"), norm, epsilon, dtype, param_dtype)
        self.attn = ParallelMultiHeadAttention(
            graph.child("attn"),
            model_size,
            num_heads,
            rng,
            axis=axis,
            num_kv_heads=num_kv_heads,
            dropout_rate=attention_dropout_rate,
            use_rope=use_rope,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.norm2 = make_norm(graph.child("norm2"), norm, epsilon, dtype, param_dtype)
        self.mlp = ParallelMLP(
            graph.child("mlp"),
            self.mlp_size,
            model_size,
            rng,
            axis=axis,
            activation=activation,
            use_bias=use_bias,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.dropout = Dropout(graph.child("dropout"), dropout_rate, rng)

    def __call__(
        self,
        params: Params,
        x: jax.Array,
        *,
        mask: ArrayLike | None = None,
        key_mask: ArrayLike | None = None,
        is_causal: bool = False,
        is_training: bool = True,
    ) -> tuple[jax.Array, Params]:
        """Applies the block to ``x`` ``(B, T, D)``; returns ``((B, T, D), params)``."""
        return pre_norm_residual(
            self, params, x, is_training, mask=mask, key_mask=key_mask, is_causal=is_causal
        )


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
