"""Mixture of experts: `MoE`, a token-choice top-k router over E expert MLPs."""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from blox.core import Graph, Module, Params, Rng
from blox.core._sharding import explicit_mesh, explicit_sharding
from blox.nn._dtype import compute_dtype

__all__ = ["MoE"]

_kernel_init = jax.nn.initializers.lecun_normal()
# Expert kernels (E, D_in, D_out): fan-in over D_in, one independent matrix per expert.
_expert_init = jax.nn.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)
_zeros = jax.nn.initializers.zeros


# `jax.lax.ragged_dot` has no batching rule unless all three operands are batched (JAX
# 0.10), so `jax.vmap` of a layer call (shared weights, batched tokens) would fail. The
# grouped matmul below runs a vmapped call as a loop over the batch, and its gradient is
# written out (custom_vjp) so that differentiation never meets the loop's custom_vmap.


def _explicit_out(a: jax.Array) -> NamedSharding | None:
    """A replicated ``out_sharding`` on an Explicit mesh (JAX infers none for
    ``ragged_dot``; the layer gathers its operands there), else None."""
    mesh = explicit_mesh(a)
    return None if mesh is None else NamedSharding(mesh, PartitionSpec())


@jax.custom_batching.sequential_vmap
def _ragged(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    return jax.lax.ragged_dot(lhs, rhs, sizes, out_sharding=_explicit_out(lhs))


@jax.custom_batching.sequential_vmap
def _ragged_rhs_grad(lhs: jax.Array, ct: jax.Array, sizes: jax.Array) -> jax.Array:
    """``(G, K, N)``: for each group g, ``lhs[rows of g].T @ ct[rows of g]``."""
    dn = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(lhs, ct, sizes, dn, out_sharding=_explicit_out(lhs))


@jax.custom_vjp
def grouped_matmul(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array) -> jax.Array:
    """``lhs`` ``(M, K)`` rows sorted by group, ``rhs`` ``(G, K, N)``, ``sizes`` ``(G,)``
    rows per group -> ``(M, N)``: ``jax.lax.ragged_dot`` that also runs under
    ``jax.vmap`` (as a loop)."""
    return _ragged(lhs, rhs, sizes)


def _grouped_fwd(lhs, rhs, sizes):
    return _ragged(lhs, rhs, sizes), (lhs, rhs, sizes)


def _like(g: jax.Array, primal: jax.Array) -> jax.Array:
    """A cotangent summed over the manual axes it varies over and its primal does not
    (inside ``shard_map``: the transpose of the implicit broadcast of, e.g., replicated
    weights), in the primal's dtype."""
    from blox.parallel._mesh import varying_axes  # blox.parallel imports blox.nn

    extra = tuple(sorted(varying_axes(g) - varying_axes(primal)))
    if extra:
        g = jax.lax.psum(g, extra)
    return g.astype(primal.dtype)


def _grouped_bwd(res, ct):
    lhs, rhs, sizes = res
    d_lhs = _ragged(ct, jnp.swapaxes(rhs, 1, 2), sizes)
    d_rhs = _ragged_rhs_grad(lhs, ct, sizes)
    return _like(d_lhs, lhs), _like(d_rhs, rhs), None


grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)


_TILE = 64  # rows per tile of `tiled_grouped_matmul`
_TILED_MAX_BYTES = 1 << 28  # its gathered weights at most (else ragged_dot)


def tiled_grouped_matmul(
    lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, precision: Any = None, tile: int = _TILE
) -> jax.Array:
    """`grouped_matmul` as dense batched matmuls over fixed tiles of rows (XLA:CPU runs
    ``ragged_dot`` as about one full matmul per group, G times the work).

    The rows (sorted by group) are cut at every tile boundary and every group boundary:
    at most ``M / tile + G`` segments, each in one tile and one group. Each segment's tile
    is multiplied by its group's matrix (rows outside the segment masked to 0) and the
    products are summed back per tile: ``(M + G tile) K N`` multiply-adds, about 2x a
    dense matmul at M = G tile. Plain gathers, einsums and scatter-adds, so autodiff and
    ``jax.vmap`` work as for any JAX function.
    """
    m, k = lhs.shape
    g, _, n = rhs.shape
    t = max(1, min(tile, m))
    tiles = -(-m // t)
    mp = tiles * t
    x = jnp.pad(lhs, ((0, mp - m), (0, 0))).reshape(tiles, t, k)
    ends = jnp.cumsum(sizes.astype(jnp.int32))
    cuts = jnp.sort(jnp.concatenate([jnp.arange(0, mp, t, dtype=jnp.int32), ends - sizes]))
    stops = jnp.concatenate([cuts[1:], jnp.full((1,), mp, jnp.int32)])
    tile_of = jnp.minimum(cuts // t, tiles - 1)
    group_of = jnp.minimum(jnp.searchsorted(ends, cuts, side="right"), g - 1)
    rows = tile_of[:, None] * t + jnp.arange(t, dtype=jnp.int32)[None, :]  # (P, t)
    keep = (rows >= cuts[:, None]) & (rows < stops[:, None]) & (rows < m)
    y = jnp.einsum("ptk,pkn->ptn", x[tile_of], rhs[group_of], precision=precision)
    y = jnp.where(keep[..., None], y, jnp.zeros((), y.dtype))
    out = jnp.zeros((tiles, t, n), y.dtype).at[tile_of].add(y)
    return out.reshape(mp, n)[:m]


def _grouped(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, precision: Any) -> jax.Array:
    """`grouped_matmul`, or `tiled_grouped_matmul` on XLA:CPU when its gathered weights
    stay small."""
    g, k, n = rhs.shape
    segments = -(-lhs.shape[0] // _TILE) + g
    small = segments * k * n * rhs.dtype.itemsize <= _TILED_MAX_BYTES
    if jax.default_backend() == "cpu" and small:
        return tiled_grouped_matmul(lhs, rhs, sizes, precision)
    return grouped_matmul(lhs, rhs, sizes)


class _Node(Module):
    """A module with no call of its own: it only owns parameters under its path."""


def _replicated(a: jax.Array) -> jax.Array:
    """`a` moved to a replicated layout on an Explicit mesh (else unchanged)."""
    sh = explicit_sharding(a)
    if sh is None:
        return a
    return jax.sharding.reshard(a, NamedSharding(sh.mesh, PartitionSpec()))


class MoE(Module):
    """A sparse mixture-of-experts MLP: each token goes to the ``top_k`` of E expert
    MLPs that its router scores highest, and their outputs are summed, weighted by
    the router's gate weights (token choice, as Mixtral, DeepSeek-V3, Qwen3-MoE)::

        logits = x @ router            (N, E), computed in float32
        scores = softmax(logits) or sigmoid(logits)
        experts(t) = top_k(scores[t] + bias)        (the bias only chooses)
        gates[t] = scores[t, experts(t)]            (/ their sum if normalize)
        y[t] = sum_j gates[t, j] * expert_{experts(t)_j}(x[t])  [+ shared(x[t])]
        expert_e(x) = (act(x @ gate_e) * (x @ up_e)) @ down_e     (gated, SwiGLU)
                    = act(x @ up_e) @ down_e                      (gated=False)

    Legend: N tokens (every leading axis of ``x`` flattened), D ``x.shape[-1]``,
    E ``num_experts``, F ``hidden_size``, k ``top_k``, G ``groups``, C capacity.

    Shapes: ``x (..., D)`` -> ``(y (..., D), aux)``, ``aux`` a dict of float32
    scalars and ``aux['load'] (E,)`` (below).

    Dispatch:
      * **dropless** (``capacity_factor=None``, default): the ``N k`` (token, choice)
        pairs are sorted by expert and each expert multiplies its contiguous rows
        (``jax.lax.ragged_dot``); no token is dropped.
      * **capacity** (``capacity_factor=c``): the tokens are split into G contiguous
        groups of ``N / G`` (a group is what one data shard holds; with expert
        parallelism each device's tokens are one group), and each expert takes at most
        ``C = min(ceil(c k N / (G E)), N / G)`` choices per group into a fixed
        ``(G, E, C, D)`` buffer. Choices past C are **dropped** (they add nothing to
        ``y``) in this order: within a group, every top-1 choice is placed before any
        top-2 choice, and so on, and within one rank in token order. ``c = E / k``
        (``C = N / G``) is the worst case: nothing is ever dropped.

    Losses and statistics (``aux``), from **global token counts**: with
    ``token_axes`` (mesh-axis names over which the tokens are split, bound by the
    enclosing ``jax.shard_map``) every sum over tokens below is also a ``psum`` over
    those axes, so splitting the batch does not change them (the same value on every
    shard). Without ``token_axes``, or where none of them is bound (a global call: all
    the tokens are here), they are over this call's N tokens.

      * ``aux['balance_loss']``: ``mean_e(density_e * prob_e) * E**2``, with
        ``density_e`` the fraction of tokens that chose expert e (counting every
        choice: ``sum_e density_e = k``) and ``prob_e`` the mean router probability of
        e (the softmax scores; for sigmoid scores, each token's scores divided by their
        sum). It is ``k`` when routing is uniform. Only ``prob`` carries a gradient.
      * ``aux['z_loss']``: ``mean_t logsumexp(logits[t])**2`` (ST-MoE's router z-loss).
      * ``aux['aux_loss']``: ``balance_weight * balance_loss + z_weight * z_loss``: add it
        to your training loss. (Not named ``'loss'``: returned as a step's aux, it would
        clash with the step's own ``metrics['loss']``.)
      * ``aux['load']`` ``(E,)``: the number of choices routed to each expert (before
        drops), the input of `update_bias`.
      * ``aux['dropped']``: the number of dropped choices (0 when dropless).

    All of ``aux`` is float32 (counts included, so a data-parallel step that averages
    floating metrics over shards keeps global counts unchanged).

    Aux-loss-free balancing (``routing_bias=True``, DeepSeek-V3): a non-trainable
    ``(E,)`` bias is added to the scores **only to choose** the experts (never in the
    gate weights, and no gradient flows through it). Update it in your step with
    ``params = moe.update_bias(params, aux['load'], rate)``.

    Args:
      graph: this module's node.
      num_experts: E.
      hidden_size: F, each expert's hidden width.
      rng: the `Rng` for initialization.
      top_k: k, the experts per token (keyword-only, as all that follow).
      score: ``'softmax'`` or ``'sigmoid'``.
      normalize: divide each token's k gate weights by their sum.
      gated: gated experts (``act(x @ gate) * (x @ up)``; SwiGLU with ``jax.nn.silu``)
        or plain two-layer MLPs.
      activation: default ``jax.nn.silu``.
      shared_hidden_size: the hidden width of a shared expert every token also goes
        through (added ungated, DeepSeek-style), or None.
      capacity_factor: None (dropless) or c > 0 (capacity dispatch).
      groups: G, the number of contiguous token groups capacity is counted in (must
        divide N).
      balance_weight, z_weight: the weights of the two losses in ``aux['aux_loss']``
        (default 0.01 and 0).
      routing_bias: keep the aux-loss-free bias (non-trainable).
      token_axes: a mesh-axis name or tuple of names the tokens are split over (see
        above), or None.
      kernel_init: the experts' initializer (default truncated normal, fan-in per
        expert); router_init: the router's (default LeCun normal).
      dtype: the experts' compute dtype (default: the promotion of the input and
        expert-parameter dtypes).
      param_dtype: the dtype parameters are created in (default float32).

    Dtype policy: the router (logits, scores, top-k, gate weights, losses) runs in
    float32 (float64 for float64 inputs), whatever the input dtype; the experts and the
    combine run in the compute dtype, the gate weights cast to it. ``y`` has the
    compute dtype.

    Parameters created (under the layer's path):
      ``<path>/router/kernel`` ``(D, E)``; ``<path>/router/bias`` ``(E,)`` zeros,
      non-trainable (with ``routing_bias``);
      ``<path>/experts/gate`` ``(E, D, F)`` (gated only), ``<path>/experts/up``
      ``(E, D, F)``, ``<path>/experts/down`` ``(E, F, D)``;
      ``<path>/shared/gate``, ``<path>/shared/up`` ``(D, F_s)`` and
      ``<path>/shared/down`` ``(F_s, D)`` (with ``shared_hidden_size``; ``gate`` only
      when gated).

    Call: ``(y, aux), params = moe(params, x, precision=None)``, ``x`` ``(..., D)``,
    ``y`` of the same shape. On an Explicit mesh (global mode, under ``jax.jit``) the
    layer gathers ``x`` and its parameters and computes the unsharded math; shard the
    experts with `blox.parallel.ExpertParallelMoE` instead. Under ``jax.vmap`` the
    dropless grouped matmul runs as a loop over the mapped axis (``ragged_dot`` has no
    batching rule for weights shared by the mapped calls).

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> moe = bx.MoE(g / 'moe', num_experts=4, hidden_size=8, rng=rng, top_k=2)
    >>> (y, aux), params = moe(rng.seed(bx.Params(), seed=0), jnp.ones((2, 3, 6)))
    >>> y.shape, params[('net', 'moe', 'experts', 'up')].value.shape, aux['load'].shape
    ((2, 3, 6), (4, 6, 8), (4,))
    >>> float(aux['load'].sum())       # 6 tokens x 2 choices
    12.0
    """

    kind = "MoE"

    def __init__(
        self,
        graph: Graph,
        num_experts: int,
        hidden_size: int,
        rng: Rng | None,
        *,
        top_k: int = 2,
        score: str = "softmax",
        normalize: bool = False,
        gated: bool = True,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
        shared_hidden_size: int | None = None,
        capacity_factor: float | None = None,
        groups: int = 1,
        balance_weight: float = 0.01,
        z_weight: float = 0.0,
        routing_bias: bool = False,
        token_axes: Hashable | tuple[Hashable, ...] | None = None,
        kernel_init: Callable = _expert_init,
        router_init: Callable = _kernel_init,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        where = f"{self.kind} '{self.path_str}'"
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}: {name} must be a positive int, got {v!r}.")
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
            raise ValueError(
                f"{where}: top_k must be an int in [1, num_experts={num_experts}], got {top_k!r}."
            )
        if score not in ("softmax", "sigmoid"):
            raise ValueError(f"{where}: score must be 'softmax' or 'sigmoid', got {score!r}.")
        if capacity_factor is not None and not float(capacity_factor) > 0:
            raise ValueError(
                f"{where}: capacity_factor must be None (dropless) or > 0, got "
                f"{capacity_factor!r}. capacity_factor=num_experts/top_k never drops."
            )
        if not isinstance(groups, int) or isinstance(groups, bool) or groups < 1:
            raise ValueError(f"{where}: groups must be a positive int, got {groups!r}.")
        if shared_hidden_size is not None and (
            not isinstance(shared_hidden_size, int) or shared_hidden_size < 1
        ):
            raise ValueError(
                f"{where}: shared_hidden_size must be None or a positive int, got "
                f"{shared_hidden_size!r}."
            )
        if token_axes is not None and not isinstance(token_axes, tuple):
            token_axes = (token_axes,)
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.rng = rng
        self.top_k = top_k
        self.score = score
        self.normalize = normalize
        self.gated = gated
        self.activation = activation
        self.shared_hidden_size = shared_hidden_size
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.groups = groups
        self.balance_weight = float(balance_weight)
        self.z_weight = float(z_weight)
        self.routing_bias = routing_bias
        self.token_axes = token_axes
        self.kernel_init = kernel_init
        self.router_init = router_init
        self.dtype = dtype
        self.param_dtype = param_dtype
        self.router = _Node(graph.child("router"))
        self.experts = _Node(graph.child("experts"))
        self.shared = _Node(graph.child("shared")) if shared_hidden_size else None

    # -- parameters ----------------------------------------------------------------------

    def _router_params(self, params: Params, d: int):
        kernel, params = self.router.get_param(
            params,
            "kernel",
            (d, self.num_experts),
            self.router_init,
            dtype=self.param_dtype,
            rng=self.rng,
        )
        bias = None
        if self.routing_bias:
            bias, params = self.router.get_param(
                params,
                "bias",
                (self.num_experts,),
                _zeros,
                dtype=self.param_dtype,
                trainable=False,
                rng=self.rng,
            )
        return kernel, bias, params

    def expert_shapes(self, d: int) -> dict[str, tuple[int, ...]]:
        """The full shapes of the expert kernels for model size ``d``, by name."""
        e, f = self.num_experts, self.hidden_size
        names = ("gate", "up") if self.gated else ("up",)
        out = {n: (e, d, f) for n in names}
        out["down"] = (e, f, d)
        return out

    def _expert_params(self, params: Params, d: int):
        weights = {}
        for name, shape in self.expert_shapes(d).items():
            weights[name], params = self.experts.get_param(
                params, name, shape, self.kernel_init, dtype=self.param_dtype, rng=self.rng
            )
        return weights, params

    def _shared_params(self, params: Params, d: int):
        f = self.shared_hidden_size
        names = ("gate", "up") if self.gated else ("up",)
        weights = {}
        for name in names:
            weights[name], params = self.shared.get_param(
                params, name, (d, f), _kernel_init, dtype=self.param_dtype, rng=self.rng
            )
        weights["down"], params = self.shared.get_param(
            params, "down", (f, d), _kernel_init, dtype=self.param_dtype, rng=self.rng
        )
        return weights, params

    # -- routing -------------------------------------------------------------------------

    def capacity(self, num_tokens: int) -> int:
        """C, the choices each expert takes per group for `num_tokens` tokens in all
        (capacity dispatch only)."""
        if self.capacity_factor is None:
            raise ValueError(f"{self.kind} '{self.path_str}' is dropless: it has no capacity.")
        per_group = num_tokens // self.groups
        c = math.ceil(self.capacity_factor * self.top_k * per_group / self.num_experts)
        return max(1, min(c, per_group))

    def route(
        self, params: Params, x: jax.Array
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], Params]:
        """The router alone: ``((experts (N, k) int32, gates (N, k), logits (N, E)),
        params)`` for ``x`` ``(N, D)``, all in float32 (float64 for float64 inputs)."""
        kernel, bias, params = self._router_params(params, x.shape[-1])
        wide = jnp.float64 in (jnp.dtype(x.dtype), jnp.dtype(kernel.dtype))
        rd = jnp.float64 if wide else jnp.float32
        logits = jnp.dot(
            _replicated(x).astype(rd),
            _replicated(kernel).astype(rd),
            precision=jax.lax.Precision.HIGHEST,
        )
        scores = (
            jax.nn.softmax(logits, axis=-1) if self.score == "softmax" else (jax.nn.sigmoid(logits))
        )
        choose = scores
        if bias is not None:
            choose = scores + jax.lax.stop_gradient(_replicated(bias).astype(rd))[None, :]
        _, experts = jax.lax.top_k(jax.lax.stop_gradient(choose), self.top_k)
        gates = jnp.take_along_axis(scores, experts, axis=-1)
        if self.normalize:
            gates = gates / jnp.sum(gates, axis=-1, keepdims=True)
        return (experts.astype(jnp.int32), gates, logits), params

    def _token_sum(self, v: Any) -> Any:
        """`v` summed over the bound ``token_axes``: none bound (a global call, all the
        tokens are here) sums nothing; some bound but not all raises."""
        if self.token_axes is None:
            return v
        from blox.parallel._mesh import bound_axes  # blox.parallel imports blox.nn

        bound = bound_axes()
        here = [a for a in self.token_axes if a in bound]
        if not here:
            return v
        if len(here) < len(self.token_axes):
            missing = [a for a in self.token_axes if a not in bound]
            raise ValueError(
                f"{self.kind} '{self.path_str}': token_axes {self.token_axes} are only "
                f"partly bound here (missing {missing}; bound: {bound}). Run the layer "
                "inside a shard_map over all of them, or list only the axes the tokens "
                "are split over."
            )
        return jax.lax.psum(v, tuple(here) if len(here) > 1 else here[0])

    def _aux(self, experts: jax.Array, logits: jax.Array, dropped: jax.Array) -> dict:
        n, e = logits.shape
        scores = (
            jax.nn.softmax(logits, axis=-1) if self.score == "softmax" else (jax.nn.sigmoid(logits))
        )
        probs = (
            scores if self.score == "softmax" else scores / jnp.sum(scores, axis=-1, keepdims=True)
        )
        counts = jnp.sum(jax.nn.one_hot(experts, e, dtype=logits.dtype), axis=(0, 1))
        lse = jax.nn.logsumexp(logits, axis=-1)
        sums = (counts, jnp.sum(probs, axis=0), jnp.sum(lse * lse), dropped.astype(logits.dtype))
        total = jnp.asarray(n, logits.dtype)
        (counts, prob_sum, z_sum, dropped), total = self._token_sum((sums, total))
        counts = jax.lax.stop_gradient(counts)
        balance = jnp.mean((counts / total) * (prob_sum / total)) * (e * e)
        z = z_sum / total
        loss = self.balance_weight * balance + self.z_weight * z
        f32 = jnp.float32
        return {
            "aux_loss": loss.astype(f32),
            "balance_loss": balance.astype(f32),
            "z_loss": z.astype(f32),
            "load": counts.astype(f32),
            "dropped": jax.lax.stop_gradient(dropped).astype(f32),
        }

    # -- experts -------------------------------------------------------------------------

    def _ffn(self, w: dict, x: jax.Array, cd: Any, precision: Any, matmul: Callable):
        up = matmul(x, w["up"].astype(cd))
        if self.gated:
            h = self.activation(matmul(x, w["gate"].astype(cd))) * up
        else:
            h = self.activation(up)
        return matmul(h, w["down"].astype(cd))

    def expert_sorted(
        self, w: dict, xs: jax.Array, group_sizes: jax.Array, cd: Any, precision: Any
    ) -> jax.Array:
        """Dropless experts: rows ``xs`` ``(M, D)`` sorted by expert, ``group_sizes``
        ``(E,)`` rows per expert -> ``(M, D)``."""

        def mm(a, b):
            return _grouped(a, b, group_sizes, precision)

        return self._ffn(w, xs, cd, precision, mm)

    def expert_buffers(self, w: dict, buf: jax.Array, cd: Any, precision: Any) -> jax.Array:
        """Capacity experts: buffers ``(G, E, C, D)`` -> ``(G, E, C, D)``."""

        def mm(a, b):
            return jnp.einsum("gecd,edf->gecf", a, b, precision=precision)

        return self._ffn(w, buf, cd, precision, mm)

    def _dropless(self, w, xt, experts, gates, cd, precision):
        n, k = experts.shape
        flat = experts.reshape(-1)  # choice a = t * k + j
        order = jnp.argsort(flat, stable=True)
        xs = xt[order // k]
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        ys = self.expert_sorted(w, xs, group_sizes, cd, precision)
        back = jnp.zeros_like(ys).at[order].set(ys, unique_indices=True)
        y = jnp.sum(back.reshape(n, k, -1) * gates.astype(cd)[..., None], axis=1)
        return y, jnp.zeros((), jnp.int32)

    def dispatch_slots(self, experts: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
        """Capacity dispatch of ``experts`` ``(G, M, k)`` (M tokens per group): each
        choice's slot ``e * C + position`` in its group's ``(E * C)`` buffer rows, and
        whether it is kept (``position < C``). Positions count, per expert, the choices
        before it in the order top-1 of every token (in token order), then top-2, ...."""
        g, m, k = experts.shape
        e = self.num_experts
        ranked = jnp.swapaxes(experts, 1, 2).reshape(g, k * m)  # priority order
        one_hot = jax.nn.one_hot(ranked, e, dtype=jnp.int32)
        before = jnp.cumsum(one_hot, axis=1) - one_hot
        pos = jnp.sum(before * one_hot, axis=-1)
        pos = jnp.swapaxes(pos.reshape(g, k, m), 1, 2)
        keep = pos < capacity
        slot = jnp.where(keep, experts * capacity + pos, e * capacity)
        return slot, keep

    def plan_capacity(self, num_tokens: int) -> int | None:
        """The capacity this call dispatches with for `num_tokens` tokens: None for the
        dropless path, else C (`capacity`)."""
        return None if self.capacity_factor is None else self.capacity(num_tokens)

    def _capacity(self, w, xt, experts, gates, cd, precision, c):
        n, k = experts.shape
        g, e = self.groups, self.num_experts
        m = n // g
        slot, keep = self.dispatch_slots(experts.reshape(g, m, k), c)
        xg = xt.astype(cd).reshape(g, m, 1, -1)
        src = jnp.broadcast_to(xg, (g, m, k, xg.shape[-1]))

        def scatter(s, v):
            buf = jnp.zeros((e * c, v.shape[-1]), v.dtype)
            return buf.at[s.reshape(-1)].set(v.reshape(m * k, -1), mode="drop")

        buf = jax.vmap(scatter)(slot, src).reshape(g, e, c, -1)
        out = self.expert_buffers(w, buf, cd, precision).reshape(g, e * c, -1)

        def gather(o, s):
            return o.at[s.reshape(-1)].get(mode="fill", fill_value=0)

        got = jax.vmap(gather)(out, slot).reshape(n, k, -1)
        weight = jnp.where(keep.reshape(n, k), gates, jnp.zeros((), gates.dtype)).astype(cd)
        y = jnp.sum(got * weight[..., None], axis=1)
        return y, jnp.sum(~keep)

    # -- call ----------------------------------------------------------------------------

    def __call__(
        self, params: Params, x: jax.Array, precision: Any = None
    ) -> tuple[tuple[jax.Array, dict], Params]:
        """``x`` ``(..., D)`` -> ``((y (..., D), aux), params)``; see the class docstring."""
        where = f"{self.kind} '{self.path_str}'"
        x = jnp.asarray(x)
        if x.ndim == 0:
            raise ValueError(
                f"{where}: input must not be scalar; expected shape (..., D). Use x[None, "
                "None] for one token of one feature."
            )
        d = x.shape[-1]
        self._check_stored(params, d, x.shape)
        out_sharding = explicit_sharding(x)
        xt = _replicated(x).reshape(-1, d)
        n = xt.shape[0]
        if (self.capacity_factor is not None or self._manual()) and n % self.groups:
            raise ValueError(
                f"{where}: groups={self.groups} does not divide the {n} tokens of input "
                f"shape {tuple(x.shape)}. Use a number of groups that divides {n} (one "
                "group per data shard)."
            )
        (experts, gates, logits), params = self.route(params, xt)
        w, params = self._expert_params(params, d)
        w = {k: _replicated(v) for k, v in w.items()}
        cd = compute_dtype(x, w["up"].dtype, self.dtype)
        c = self.plan_capacity(n)
        if c is None:
            y, dropped = self._dropless(w, xt.astype(cd), experts, gates, cd, precision)
        else:
            y, dropped = self._capacity(w, xt, experts, gates, cd, precision, c)
        if self.shared is not None:
            ws, params = self._shared_params(params, d)
            ws = {k: _replicated(v) for k, v in ws.items()}

            def mm(a, b):
                return jnp.dot(a, b, precision=precision)

            y = y + self._ffn(ws, xt.astype(cd), cd, precision, mm)
        aux = self._aux(experts, logits, dropped)
        y = y.reshape(x.shape).astype(cd)
        if out_sharding is not None:
            y = jax.sharding.reshard(y, out_sharding)
        return (y, aux), params

    def _manual(self) -> bool:
        """Whether the experts are split over a bound mesh axis (expert parallelism)."""
        return False

    def _check_stored(self, params: Params, d: int, shape: tuple) -> None:
        stored = self.router.peek_param(params, "kernel")
        if stored is None:
            return
        want = stored.shape[0]
        if want != d:
            raise ValueError(
                f"{self.kind} '{self.path_str}' expects inputs of shape (..., {want}) "
                f"(router kernel {tuple(stored.shape)} = (D, E)), got input shape "
                f"{tuple(shape)}. Fix the input's last dimension, or re-initialize."
            )

    # -- aux-loss-free balancing ---------------------------------------------------------

    def update_bias(self, params: Params, load: jax.Array, rate: float = 1e-3) -> Params:
        """One aux-loss-free update of the routing bias (DeepSeek-V3)::

            delta = rate * sign(mean(load) - load);  bias += delta - mean(delta)

        An under-loaded expert's bias rises (it is chosen more), an over-loaded one's
        falls; the step is centred (zero mean), so the biases do not drift. Only the
        bias changes: it takes part in choosing experts, never in the gate weights.

        Args:
          params: params holding ``<path>/router/bias`` (``routing_bias=True``).
          load: ``(E,)`` tokens per expert, ``aux['load']`` (global counts with
            ``token_axes``, so every shard makes the same update).
          rate: the step size (DeepSeek-V3: 1e-3).

        Returns:
          New params with the bias updated, in its stored dtype.
        """
        where = f"{self.kind} '{self.path_str}'"
        if not self.routing_bias:
            raise ValueError(
                f"{where} has no routing bias: build it with routing_bias=True to use update_bias."
            )
        bias = self.router.peek_param(params, "bias")
        if bias is None:
            raise ValueError(
                f"{where}: parameter '{self.path_str}/router/bias' is missing; call the "
                "layer once to create it."
            )
        load = jnp.asarray(load)
        if load.shape != (self.num_experts,):
            raise ValueError(
                f"{where}: load must have shape (E,) = ({self.num_experts},) (aux['load']), "
                f"got {tuple(load.shape)}."
            )
        load = load.astype(jnp.float32)
        delta = rate * jnp.sign(jnp.mean(load) - load)
        delta = delta - jnp.mean(delta)
        new = (bias.astype(jnp.float32) + delta).astype(bias.dtype)
        return self.router.set_param(params, "bias", new)
