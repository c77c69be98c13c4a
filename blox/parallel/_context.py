"""Context parallelism: attention over a sequence sharded on a mesh axis.

Two variants, both plain functions called inside the user's ``jax.shard_map`` with the
sequence axis named explicitly:

* `ring_attention`: K and V (one array) travel around the ring with ``ppermute`` while
  each device folds every visiting block into an online softmax (running max and
  denominator in float32). A ``jax.custom_vjp``: only the local q, k, v, the output and
  the log-sum-exp are kept for the backward, which rotates K, V and the dK, dV
  accumulators around the ring again.
* `allgather_attention`: K and V are all-gathered once, then the local queries attend to
  the whole sequence (autodiff gives the reduce-scatter of dK, dV).

`balance_sequence` / `unbalance_sequence` permute a sequence into the head-tail layout
(2C chunks, device r holds chunks r and 2C-1-r) that gives every device the same causal
work; the ring reads the global positions of the tokens for the causal mask and skips
the blocks that are provably fully masked (``lax.cond``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blox.parallel._collectives import _axis_size, check_axis
from blox.parallel._mesh import check_vma_enabled, varying_axes

__all__ = [
    "allgather_attention",
    "balance_sequence",
    "check_context_parallel",
    "ring_attention",
    "unbalance_sequence",
]

Axis = str | tuple[str, ...]

_INT_MAX = int(np.iinfo(np.int32).max)
_INT_MIN = int(np.iinfo(np.int32).min)


def _stats_dtype(dtype: Any) -> Any:
    return jnp.float64 if jnp.dtype(dtype) == jnp.float64 else jnp.float32


def _neg(sd: Any) -> jax.Array:
    return jnp.asarray(-0.7 * float(jnp.finfo(sd).max), sd)


# -- the head-tail layout --------------------------------------------------------------


def _head_tail_order(num_shards: int) -> np.ndarray:
    return np.array([c for r in range(num_shards) for c in (r, 2 * num_shards - 1 - r)])


def _permute_chunks(tree: Any, num_shards: int, axis: int, inverse: bool, op: str) -> Any:
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
        raise ValueError(f"{op}: num_shards must be a positive int, got {num_shards!r}.")
    order = _head_tail_order(num_shards)
    if inverse:
        order = np.argsort(order)

    def one(kp: Any, x: Any) -> Any:
        x = jnp.asarray(x)
        name = jax.tree_util.keystr(kp) or "<root>"
        if not -x.ndim <= axis < x.ndim:
            raise ValueError(
                f"{op}: leaf {name} of shape {tuple(x.shape)} has no sequence axis {axis}. "
                "Pass axis= the sequence dimension (1 for (B, T, ...), 0 for positions (T,))."
            )
        t = x.shape[axis]
        if t % (2 * num_shards):
            raise ValueError(
                f"{op}: leaf {name} has sequence length {t} (axis {axis} of shape "
                f"{tuple(x.shape)}), which 2 * num_shards = {2 * num_shards} does not divide: "
                f"the head-tail layout cuts the sequence into {2 * num_shards} equal chunks. "
                f"Pad the sequence to a multiple of {2 * num_shards}."
            )
        c = t // (2 * num_shards)
        idx = (order[:, None] * c + np.arange(c)[None, :]).reshape(-1)
        return jnp.take(x, jnp.asarray(idx, jnp.int32), axis=axis)

    return jax.tree_util.tree_map_with_path(one, tree)


def balance_sequence(tree: Any, num_shards: int, *, axis: int = 1) -> Any:
    """Permutes the sequence of every leaf of `tree` into the head-tail layout.

    The sequence (length T, dimension `axis`) is cut into ``2 * num_shards`` equal chunks
    and reordered ``0, 2C-1, 1, 2C-2, ..., C-1, C`` (C = `num_shards`), so that sharding
    the result contiguously over C devices gives device r the chunks r and 2C-1-r: one
    early and one late chunk, hence the same causal work on every device. Apply it to
    everything that is laid out along the sequence (tokens, targets, masks, segment ids)
    and to the positions, which `ring_attention` then reads for the causal mask. Do it
    on the global batch before placing it on the mesh (on the host, as a data pipeline
    does): on an array already sharded along the sequence the permutation would move
    data between devices (on an Explicit mesh JAX asks for an ``out_sharding``)::

        positions = bp.balance_sequence(jnp.arange(T), C, axis=0)   # (T,)

    Args:
      tree: a pytree of arrays, each with the sequence at dimension `axis`.
      num_shards: C, the size of the context axis.
      axis: the sequence dimension (default 1, for ``(B, T, ...)``).

    Returns:
      The tree with every leaf permuted along `axis`; `unbalance_sequence` undoes it.

    >>> import jax.numpy as jnp
    >>> from blox import parallel as bp
    >>> bp.balance_sequence(jnp.arange(8), 2, axis=0)
    Array([0, 1, 6, 7, 2, 3, 4, 5], dtype=int32)
    """
    return _permute_chunks(tree, num_shards, axis, False, "balance_sequence")


def unbalance_sequence(tree: Any, num_shards: int, *, axis: int = 1) -> Any:
    """Undoes `balance_sequence`: the head-tail layout back to sequence order.

    Args:
      tree: a pytree of arrays in the head-tail layout along `axis`.
      num_shards: C, as given to `balance_sequence`.
      axis: the sequence dimension (default 1).

    >>> import jax.numpy as jnp
    >>> from blox import parallel as bp
    >>> bp.unbalance_sequence(bp.balance_sequence(jnp.arange(8), 2, axis=0), 2, axis=0)
    Array([0, 1, 2, 3, 4, 5, 6, 7], dtype=int32)
    """
    return _permute_chunks(tree, num_shards, axis, True, "unbalance_sequence")


# -- checks and token metadata ----------------------------------------------------------


def _check_inputs(
    op: str,
    q: Any,
    k: Any,
    v: Any,
    axis: Any,
    positions: Any,
    segment_ids: Any,
    key_mask: Any,
    num_blocks: int,
) -> tuple[tuple[str, ...], jax.Array, jax.Array, jax.Array]:
    names = check_axis(axis, op)
    q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(
            f"{op}: q, k, v must be (B, T, N, H), (B, T, K, H), (B, T, K, H) (the local "
            f"shard of the sequence), got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}. Reshape the projections to heads first."
        )
    b, t, n, h = q.shape
    if k.shape != v.shape or k.shape[:2] != (b, t) or k.shape[3] != h:
        raise ValueError(
            f"{op}: k and v must both be (B, T, K, H) = ({b}, {t}, K, {h}) to match q "
            f"{tuple(q.shape)}, got k {tuple(k.shape)} and v {tuple(v.shape)}. Self-attention "
            "only: the queries and the keys are the same shard of the sequence."
        )
    if n % k.shape[2]:
        raise ValueError(
            f"{op}: the {k.shape[2]} key/value heads of k {tuple(k.shape)} do not divide "
            f"the {n} query heads of q {tuple(q.shape)}; each group of N / K query heads "
            "shares one key/value head."
        )
    if not (q.dtype == k.dtype == v.dtype) or not jnp.issubdtype(q.dtype, jnp.floating):
        raise TypeError(
            f"{op}: q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, "
            f"{v.dtype}. Cast them to one dtype (the softmax statistics are float32 anyway)."
        )
    if not isinstance(num_blocks, int) or num_blocks < 1 or t % num_blocks:
        raise ValueError(
            f"{op}: num_blocks = {num_blocks!r} must be a positive int dividing the local "
            f"sequence length T = {t} (q {tuple(q.shape)}). The head-tail layout needs 2 "
            "(the default); use num_blocks=1 for a local length that 2 does not divide."
        )
    if positions is not None:
        p = jnp.asarray(positions)
        if p.shape not in ((t,), (b, t)) or not jnp.issubdtype(p.dtype, jnp.integer):
            raise ValueError(
                f"{op}: positions must be integers of shape (T,) = ({t},) or (B, T) = "
                f"{(b, t)} (the global positions of this device's tokens), got {p.dtype} "
                f"{tuple(p.shape)}."
            )
    if segment_ids is not None:
        s = jnp.asarray(segment_ids)
        if s.shape not in ((t,), (b, t)) or not jnp.issubdtype(s.dtype, jnp.integer):
            raise ValueError(
                f"{op}: segment_ids must be integers of shape (T,) = ({t},) or (B, T) = "
                f"{(b, t)} (tokens attend only within their segment), got {s.dtype} "
                f"{tuple(s.shape)}."
            )
    if key_mask is not None:
        m = jnp.asarray(key_mask)
        if m.shape not in ((t,), (b, t)) or m.dtype != jnp.bool_:
            raise ValueError(
                f"{op}: key_mask must be boolean of shape (T,) = ({t},) or (B, T) = {(b, t)} "
                f"(False = padding, never attended), got {m.dtype} {tuple(m.shape)}."
            )
    return names, q, k, v


def _metadata(
    names: tuple[str, ...],
    b: int,
    t: int,
    causal: bool,
    positions: Any,
    segment_ids: Any,
    key_mask: Any,
) -> tuple[jax.Array, jax.Array, bool]:
    """The query metadata ``(B, T, 2)`` (position, segment) and this device's key
    metadata ``(B, T, 3)`` (position, segment, valid), int32; and whether the keys'
    metadata must be gathered (segments, a key mask, or causal with given positions)."""
    axis = names if len(names) > 1 else names[0]
    r = jax.lax.axis_index(axis).astype(jnp.int32)
    if positions is None:
        pos = r * jnp.int32(t) + jnp.arange(t, dtype=jnp.int32)
    else:
        pos = jnp.asarray(positions).astype(jnp.int32)
    seg = jnp.zeros((t,), jnp.int32) if segment_ids is None else jnp.asarray(segment_ids)
    valid = jnp.ones((t,), jnp.int32) if key_mask is None else jnp.asarray(key_mask)
    pos, seg, valid = (jnp.broadcast_to(a.astype(jnp.int32), (b, t)) for a in (pos, seg, valid))
    qmeta = jnp.stack([pos, seg], axis=-1)
    kmeta = jnp.stack([pos, seg, valid], axis=-1)
    gather = (causal and positions is not None) or segment_ids is not None or key_mask is not None
    return qmeta, kmeta, gather


def _all_key_metadata(names: tuple[str, ...], kmeta: jax.Array, gather: bool, c: int) -> jax.Array:
    """Every device's key metadata, ``(C, B, T, 3)``: one all-gather of the int32
    metadata, or (default positions, no masks) computed without communication."""
    axis = names if len(names) > 1 else names[0]
    if gather:
        return jax.lax.all_gather(kmeta, axis, axis=0, tiled=False)
    b, t, _ = kmeta.shape
    pos = jnp.arange(c * t, dtype=jnp.int32).reshape(c, 1, t)
    pos = jnp.broadcast_to(pos, (c, b, t))
    return jnp.stack([pos, jnp.zeros_like(pos), jnp.ones_like(pos)], axis=-1)


def _mask(qm: jax.Array, km: jax.Array, causal: bool) -> jax.Array:
    """``(B, Tq, Tk)``: key valid, same segment, and (causal) key position <= query's."""
    ok = (km[:, None, :, 2] != 0) & (qm[:, :, None, 1] == km[:, None, :, 1])
    if causal:
        ok = ok & (qm[:, :, None, 0] >= km[:, None, :, 0])
    return ok


def _plan(
    qmeta: jax.Array, kmeta_all: jax.Array, r: jax.Array, c: int, nb: int, causal: bool
) -> jax.Array:
    """``(C, nb, nb)`` bool: at step s (keys of device (r - s) mod C) whether the block
    (query block i, key block j) may hold a visible pair. False only where it provably
    holds none: its keys are all padding, its query and key segment ranges do not
    overlap, or (causal) its latest query precedes its earliest key."""
    b, t, _ = qmeta.shape
    tc = t // nb
    qm = qmeta.reshape(b, nb, tc, 2)
    q_max_pos = qm[..., 0].max(-1)
    q_min_seg, q_max_seg = qm[..., 1].min(-1), qm[..., 1].max(-1)
    km = kmeta_all.reshape(c, b, nb, tc, 3)
    valid = km[..., 2] != 0
    k_any = valid.any(-1)
    k_min_pos = jnp.where(valid, km[..., 0], _INT_MAX).min(-1)
    k_min_seg = jnp.where(valid, km[..., 1], _INT_MAX).min(-1)
    k_max_seg = jnp.where(valid, km[..., 1], _INT_MIN).max(-1)
    src = (r - jnp.arange(c, dtype=jnp.int32)) % c  # the keys' device at each step
    k_any, k_min_pos, k_min_seg, k_max_seg = (
        a[src][:, :, None, :] for a in (k_any, k_min_pos, k_min_seg, k_max_seg)
    )  # (C, B, 1, nb): key block j
    ok = k_any & (q_max_seg[None, :, :, None] >= k_min_seg)
    ok = ok & (q_min_seg[None, :, :, None] <= k_max_seg)
    if causal:
        ok = ok & (q_max_pos[None, :, :, None] >= k_min_pos)
    return ok.any(axis=1)


def _vary(tree: Any, axes: frozenset) -> Any:
    """Casts every leaf to varying over `axes` (the carries of the ring's scans must have
    the type of what the steps return); nothing under ``check_vma=False``."""
    if not axes:
        return tree

    def one(x: jax.Array) -> jax.Array:
        missing = tuple(sorted(axes - varying_axes(x)))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def _varying_union(names: tuple[str, ...], *xs: Any) -> frozenset:
    if not check_vma_enabled():
        return frozenset()
    out = frozenset(names)
    for x in jax.tree.leaves(xs):
        out = out | varying_axes(x)
    return out


# -- the ring ----------------------------------------------------------------------------


def _fwd_block(qi, kj, vj, qm, km, causal, scale, st):
    m, den, acc = st
    sd = m.dtype
    s = jnp.einsum("btkgh,bskh->bkgts", qi, kj, preferred_element_type=sd) * scale
    mask = _mask(qm, km, causal)[:, None, None]
    s = jnp.where(mask, s, _neg(sd))
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.where(mask, jnp.exp(s - m_new[..., None]), jnp.zeros((), sd))
    corr = jnp.exp(m - m_new)
    den = den * corr + p.sum(-1)
    pv = jnp.einsum("bkgts,bskh->btkgh", p.astype(vj.dtype), vj, preferred_element_type=sd)
    acc = acc * jnp.transpose(corr, (0, 3, 1, 2))[..., None] + pv
    return m_new, den, acc


def _bwd_block(qi, doi, lsei, di, kj, vj, qm, km, causal, scale, st):
    dq, dk, dv = st
    sd = dq.dtype
    s = jnp.einsum("btkgh,bskh->bkgts", qi, kj, preferred_element_type=sd) * scale
    mask = _mask(qm, km, causal)[:, None, None]
    p = jnp.where(mask, jnp.exp(s - lsei[..., None]), jnp.zeros((), sd))
    do32, q32, k32, v32 = (a.astype(sd) for a in (doi, qi, kj, vj))
    dv = dv + jnp.einsum("bkgts,btkgh->bskh", p, do32)
    dp = jnp.einsum("btkgh,bskh->bkgts", do32, v32)
    ds = p * (dp - di[..., None])
    dq = dq + jnp.einsum("bkgts,bskh->btkgh", ds, k32) * scale
    dk = dk + jnp.einsum("bkgts,btkgh->bskh", ds, q32) * scale
    return dq, dk, dv


def _keep(st: Any) -> Any:
    return st


def _blocks(x: jax.Array, nb: int, axis: int) -> jax.Array:
    """Cuts dimension `axis` (length T) into nb blocks, stacked on a new leading axis."""
    t = x.shape[axis]
    x = x.reshape(x.shape[:axis] + (nb, t // nb) + x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _unblocks(x: jax.Array, axis: int) -> jax.Array:
    """The inverse of `_blocks`: the leading block axis joined back into `axis`."""
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2 :])


def _ring_setup(axis, nb, q, kmeta_all):
    names = axis if isinstance(axis, tuple) else (axis,)
    ax = names if len(names) > 1 else names[0]
    c = _axis_size(names)
    r = jax.lax.axis_index(ax).astype(jnp.int32)
    perm = [(d, (d + 1) % c) for d in range(c)]
    return names, ax, c, r, perm, _stats_dtype(q.dtype)


def _ring_forward(axis, causal, scale, nb, q, kv, qmeta, kmeta_all, plan):
    """kv arrives in blocks, ``(nb, 2, B, T/nb, K, H)``; returns the output and the
    log-sum-exp ``(nb, B, K, G, T/nb)``."""
    names, ax, c, r, perm, sd = _ring_setup(axis, nb, q, kmeta_all)
    b, t, n, h = q.shape
    kh = kv.shape[4]
    g, tc = n // kh, t // nb
    qs = _blocks(q.reshape(b, t, kh, g, h), nb, 1)  # (nb, B, T/nb, K, G, H)
    qms = _blocks(qmeta, nb, 1)
    init = (
        jnp.full((nb, b, kh, g, tc), _neg(sd)),
        jnp.zeros((nb, b, kh, g, tc), sd),
        jnp.zeros((nb, b, tc, kh, g, h), sd),
    )
    init = _vary(init, _varying_union(names, q, kv, qmeta, kmeta_all, plan))

    def compute(states, kv_cur, step):
        kms = _blocks(kmeta_all[(r - step) % c], nb, 1)
        todo = plan[step].reshape(-1)

        def pair(states, ij):  # one (query block i, key block j); skipped if masked
            i, j = ij // nb, ij % nb
            block = functools.partial(
                _fwd_block, qs[i], kv_cur[j, 0], kv_cur[j, 1], qms[i], kms[j], causal, scale
            )
            st = jax.lax.cond(todo[ij], block, _keep, tuple(a[i] for a in states))
            return tuple(a.at[i].set(x) for a, x in zip(states, st, strict=True)), None

        return jax.lax.scan(pair, states, jnp.arange(nb * nb, dtype=jnp.int32))[0]

    def body(carry, step):
        kv_cur, states = carry
        kv_next = jax.lax.ppermute(kv_cur, ax, perm)  # overlaps with this step's blocks
        return (kv_next, compute(states, kv_cur, step)), None

    kv_last, states = kv, init
    if c > 1:
        (kv_last, states), _ = jax.lax.scan(body, (kv, init), jnp.arange(c - 1))
    m, den, acc = compute(states, kv_last, jnp.int32(c - 1))
    pos = den > 0
    lt = jnp.transpose(den, (0, 1, 4, 2, 3))[..., None]
    out = jnp.where(lt > 0, acc / jnp.where(lt > 0, lt, jnp.ones((), sd)), 0)
    lse = jnp.where(pos, m + jnp.log(jnp.where(pos, den, jnp.ones((), sd))), 0)
    return _unblocks(out, 1).reshape(b, t, n, h).astype(q.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _ring(axis, causal, scale, nb, q, kv, qmeta, kmeta_all, plan):
    return _ring_forward(axis, causal, scale, nb, q, kv, qmeta, kmeta_all, plan)[0]


def _ring_fwd(axis, causal, scale, nb, q, kv, qmeta, kmeta_all, plan):
    out, lse = _ring_forward(axis, causal, scale, nb, q, kv, qmeta, kmeta_all, plan)
    # Only this device's blocks are kept: q, K/V, the output and the log-sum-exp.
    return out, (q, kv, qmeta, kmeta_all, plan, out, lse)


def _ring_bwd(axis, causal, scale, nb, res, d_out):
    q, kv, qmeta, kmeta_all, plan, out, lse = res
    names, ax, c, r, perm, sd = _ring_setup(axis, nb, q, kmeta_all)
    b, t, n, h = q.shape
    kh = kv.shape[4]
    g = n // kh
    d_out = d_out.astype(q.dtype)
    delta = jnp.sum(d_out.astype(sd) * out.astype(sd), axis=-1).reshape(b, t, kh, g)
    deltas = _blocks(jnp.transpose(delta, (0, 2, 3, 1)), nb, 3)  # (nb, B, K, G, T/nb)
    qs = _blocks(q.reshape(b, t, kh, g, h), nb, 1)
    dos = _blocks(d_out.reshape(b, t, kh, g, h), nb, 1)
    qms = _blocks(qmeta, nb, 1)
    axes = _varying_union(names, q, kv, qmeta, kmeta_all, plan, d_out, out, lse)
    dq = _vary(jnp.zeros(qs.shape, sd), axes)
    dkv = _vary(jnp.zeros(kv.shape, sd), axes)  # travels with the K, V it belongs to

    def compute(dq, dkv, kv_cur, step):
        kms = _blocks(kmeta_all[(r - step) % c], nb, 1)
        todo = plan[step].reshape(-1)

        def pair(carry, ij):
            dq, dkv = carry
            i, j = ij // nb, ij % nb
            block = functools.partial(
                _bwd_block, qs[i], dos[i], lse[i], deltas[i], kv_cur[j, 0], kv_cur[j, 1],
                qms[i], kms[j], causal, scale,
            )  # fmt: skip
            st = (dq[i], dkv[j, 0], dkv[j, 1])
            dqi, dkj, dvj = jax.lax.cond(todo[ij], block, _keep, st)
            return (dq.at[i].set(dqi), dkv.at[j].set(jnp.stack([dkj, dvj]))), None

        return jax.lax.scan(pair, (dq, dkv), jnp.arange(nb * nb, dtype=jnp.int32))[0]

    def body(carry, step):
        kv_cur, dkv, dq = carry
        kv_next = jax.lax.ppermute(kv_cur, ax, perm)
        dq, dkv = compute(dq, dkv, kv_cur, step)
        return (kv_next, jax.lax.ppermute(dkv, ax, perm), dq), None

    kv_last = kv
    if c > 1:
        (kv_last, dkv, dq), _ = jax.lax.scan(body, (kv, dkv, dq), jnp.arange(c - 1))
    dq, dkv = compute(dq, dkv, kv_last, jnp.int32(c - 1))
    if c > 1:
        dkv = jax.lax.ppermute(dkv, ax, perm)  # home: the keys of device r + 1
    dq = _unblocks(dq, 1).reshape(q.shape).astype(q.dtype)
    return dq, dkv.astype(kv.dtype), None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis: Axis,
    causal: bool = False,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    key_mask: jax.Array | None = None,
    scale: float | None = None,
    num_blocks: int = 2,
    return_plan: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Ring attention (Liu et al., 2023) over the sequence sharded on `axis`; call it
    inside your ``jax.shard_map``.

    Legend: B batch, T the *local* sequence length (this device's shard), C the size of
    `axis`, N query heads, K key/value heads (N / K query heads share one, as in
    `MultiHeadAttention`), H head size. The shapes are blox's ``(B, T, N, H)``.

    ::

        kv = stack([k, v])                     # one array travels: (2, B, T, K, H)
        for step in range(C):                  # kv now holds device (r - step)'s keys
            if step < C - 1: nxt = ppermute(kv, axis, r -> r + 1)   # overlaps the math
            for each query block i, key block j (num_blocks each):
                if plan[step, i, j]:           # lax.cond: a fully masked block is skipped
                    m, l, acc = online_softmax_update(q_i, k_j, v_j, mask_ij)   # float32
            kv = nxt
        out = acc / l                          # 0 where a row sees no key

    The forward runs C - 1 ``ppermute``\\ s; the backward (a ``jax.custom_vjp``) keeps
    only the local q, K/V, output and log-sum-exp, and rotates K/V (C - 1 times) and the
    float32 dK/dV accumulators (C times, ending at their owner): 3C - 2 in all. Memory per
    device: the local blocks plus one (B, N, T/num_blocks, T/num_blocks) block of logits,
    never the (T, C T) matrix. Masks: a token attends to the keys that are valid
    (`key_mask`), in its segment (`segment_ids`) and, with `causal`, not later
    (`positions`); a query that sees no key gives 0 (no NaN, zero gradient).

    Args:
      q: ``(B, T, N, H)`` this device's queries.
      k, v: ``(B, T, K, H)`` this device's keys and values (the same dtype as q).
      axis: the mesh axis (or tuple of axes) the sequence is sharded over, bound by the
        enclosing ``shard_map``; device ``r`` holds shard ``r``.
      causal: query at position p attends to keys at positions <= p.
      positions: int ``(T,)`` or ``(B, T)``, the global positions of this device's
        tokens (for the causal mask). Default the contiguous layout ``r * T +
        arange(T)``; for the head-tail layout pass the shard of
        ``balance_sequence(jnp.arange(C * T), C, axis=0)``.
      segment_ids: int ``(T,)`` or ``(B, T)``: tokens attend only to keys of their own
        segment (packed sequences).
      key_mask: bool ``(T,)`` or ``(B, T)``; False marks padding keys.
      scale: the logit scale (default ``1 / sqrt(H)``).
      num_blocks: each device's tokens are cut into this many query and key blocks, and
        a block pair that is fully masked is skipped; the head-tail layout needs 2.
      return_plan: also return the plan, bool ``(C, num_blocks, num_blocks)``: entry
        ``[step, i, j]`` says whether this device computed query block i against key
        block j of device ``(r - step) mod C`` (the count of computed blocks is its sum).

    Returns:
      ``(B, T, N, H)`` in q's dtype, and the plan if `return_plan`.

    Segment ids, a key mask or (with `causal`) positions add one all-gather of their
    int32 values, ``(B, T, 3)`` per device; the default contiguous positions need none.
    """
    names, q, k, v = _check_inputs(
        "ring_attention", q, k, v, axis, positions, segment_ids, key_mask, num_blocks
    )
    b, t, n, h = q.shape
    c = _axis_size(names)
    qmeta, kmeta, gather = _metadata(names, b, t, bool(causal), positions, segment_ids, key_mask)
    kmeta_all = _all_key_metadata(names, kmeta, gather, c)
    r = jax.lax.axis_index(names if len(names) > 1 else names[0]).astype(jnp.int32)
    plan = _plan(qmeta, kmeta_all, r, c, num_blocks, bool(causal))
    scale = float(1.0 / np.sqrt(h) if scale is None else scale)
    kv = jnp.stack([_blocks(k, num_blocks, 1), _blocks(v, num_blocks, 1)], axis=1)
    out = _ring(names, bool(causal), scale, num_blocks, q, kv, qmeta, kmeta_all, plan)
    return (out, plan) if return_plan else out


def allgather_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    axis: Axis,
    causal: bool = False,
    positions: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    key_mask: jax.Array | None = None,
    scale: float | None = None,
) -> jax.Array:
    """Attention over the sequence sharded on `axis` by one all-gather of K and V; call
    it inside your ``jax.shard_map``.

    Shapes, masks and arguments as `ring_attention` (local ``(B, T, N, H)`` queries,
    ``(B, T, K, H)`` keys and values). K and V are stacked into one array and gathered
    once in their dtype (``all_gather`` over `axis`), then this device's queries attend
    to all C T keys, the math in float32 (float64 for float64 inputs); autodiff turns
    the gather into one reduce-scatter of dK, dV (summed in float32). Simpler and, with
    fast links, usually faster than the ring; the cost is memory: the whole sequence's
    K and V and the (B, N, T, C T) logits (kept for the backward) on every device. A
    query that sees no key gives 0.

    Args:
      q: ``(B, T, N, H)`` this device's queries.
      k, v: ``(B, T, K, H)`` this device's keys and values.
      axis: the mesh axis (or tuple of axes) of the sequence.
      causal, positions, segment_ids, key_mask, scale: as `ring_attention`.

    Returns:
      ``(B, T, N, H)`` in q's dtype.
    """
    names, q, k, v = _check_inputs(
        "allgather_attention", q, k, v, axis, positions, segment_ids, key_mask, 1
    )
    ax = names if len(names) > 1 else names[0]
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    c = _axis_size(names)
    sd = _stats_dtype(q.dtype)
    qmeta, kmeta, gather = _metadata(names, b, t, bool(causal), positions, segment_ids, key_mask)
    kmeta_all = _all_key_metadata(names, kmeta, gather, c)
    kmeta_all = jnp.moveaxis(kmeta_all, 0, 1).reshape(b, c * t, 3)
    kv = jax.lax.all_gather(jnp.stack([k, v]), ax, axis=2, tiled=True)  # (2, B, C T, K, H)
    kv = kv.astype(sd)  # the math in float32: a bf16 backward would round dS before dK
    scale = float(1.0 / np.sqrt(h) if scale is None else scale)
    qg = q.reshape(b, t, kh, g, h).astype(sd)
    s = jnp.einsum("btkgh,bskh->bkgts", qg, kv[0], preferred_element_type=sd) * scale
    mask = _mask(qmeta, kmeta_all, bool(causal))[:, None, None]
    s = jnp.where(mask, s, _neg(sd))
    m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
    p = jnp.where(mask, jnp.exp(s - m), jnp.zeros((), sd))
    lt = jnp.transpose(p.sum(-1), (0, 3, 1, 2))[..., None]
    acc = jnp.einsum("bkgts,bskh->btkgh", p, kv[1])
    out = jnp.where(lt > 0, acc / jnp.where(lt > 0, lt, jnp.ones((), sd)), 0)
    return out.reshape(b, t, n, h).astype(q.dtype)


# -- which layers run on a sharded sequence --------------------------------------------


def _sequence_mixing(module: Any, axis: str) -> str | None:
    """Why `module` cannot run on a sequence sharded over `axis` (None if it can)."""
    from blox.core import SequenceBase
    from blox.nn import MultiHeadAttention
    from blox.nn._conv import _ConvBase

    if isinstance(module, SequenceBase):
        return (
            "a recurrence carries its state from step to step along the whole sequence, "
            "so a shard cannot start without the previous shard's last state; run it on "
            "the whole sequence (outside the context-parallel shard_map)"
        )
    if isinstance(module, _ConvBase) and len(module.kernel_size) == 1:
        extent = (module.kernel_size[0] - 1) * module.kernel_dilation[0] + 1
        if extent > 1 or tuple(module.strides) != (1,):
            return (
                f"a 1-D convolution of window {extent} reads neighbouring time steps, "
                "which at the shard edges live on other devices (its padding would "
                "stand in for them); use kernel_size=1, or run it on the whole sequence"
            )
    if isinstance(module, MultiHeadAttention) and module.context_axis != axis:
        return (
            f"its context_axis is {module.context_axis!r}, so it would attend only within "
            f"this device's shard; build it with context_axis={axis!r}"
        )
    return None


def check_context_parallel(model: Any, context_axis: str) -> None:
    """Checks that every layer of `model` can run on a sequence sharded over
    `context_axis` (context parallelism), and raises naming the ones that cannot.

    Call it once, where the model is built. A layer that is per token (`Linear`,
    `MLP`, the norms, `Embed`, dropout, a 1-D convolution of window 1) needs nothing;
    attention must be built with ``context_axis`` (`MultiHeadAttention`,
    `TransformerBlock`, `TransformerLM`). What reads across time steps cannot run on a
    shard: the recurrences (`LSTM`, `GRU`, every `SequenceBase`, `Bidirectional`), 1-D
    convolutions wider than one step (causal or not; `blox.ts.TCN` is built of them),
    and attention without this ``context_axis``.

    Args:
      model: a blox `Module`; it and every module below its graph node are checked.
      context_axis: the mesh axis the sequence is sharded over.

    Raises:
      ValueError: naming every such layer (its path and type) and why.

    >>> import blox as bx
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> lm = bx.TransformerLM(g / 'lm', 11, 8, 1, 2, rng, context_axis='context')
    >>> bp.check_context_parallel(lm, 'context')   # passes: no error
    """
    from blox.core import Module

    if not isinstance(model, Module):
        raise TypeError(
            f"check_context_parallel: model must be a blox Module, got {type(model).__name__}."
        )
    if not isinstance(context_axis, str) or not context_axis:
        raise TypeError(
            f"check_context_parallel: context_axis must be one mesh-axis name, got "
            f"{context_axis!r}."
        )
    found = []
    for module in [model] + [m for _, m in model.graph.walk()]:
        why = _sequence_mixing(module, context_axis)
        if why is not None:
            found.append(f"  {type(module).__name__} '{module.path_str}': {why}.")
    if found:
        raise ValueError(
            f"check_context_parallel: {len(found)} layer(s) of {type(model).__name__} "
            f"'{model.path_str}' cannot run on a sequence sharded over {context_axis!r}:\n"
            + "\n".join(found)
        )
