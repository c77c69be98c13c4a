"""Context parallelism: `ring_attention` and `allgather_attention` equal a hand-written
single-device softmax attention (output and dQ/dK/dV) on 8 simulated devices, causal and
not, with GQA, padding and packed segments, in the contiguous and the head-tail layout;
the ring runs C - 1 ppermutes forward and 3C - 2 forward+backward; the head-tail layout
balances the blocks the ring computes; memory per device; the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from blox import parallel as bp
from tests.parallel.test_pipeline_slots import _subjaxprs
from tests.tolerances import tol

AX = "context"


def reference(q, k, v, causal, seg, valid):
    """Softmax attention over the whole sequence, written out: q (B, T, N, H), k, v
    (B, T, K, H), segment ids and key validity (B, T); rows that see no key give 0."""
    b, t, n, h = q.shape
    g = n // k.shape[2]
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    kk, vv = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, kk) / np.sqrt(h)
    mask = (seg[:, :, None] == seg[:, None, :]) & valid[:, None, :]
    if causal:
        mask = mask & jnp.tril(jnp.ones((t, t), bool))[None]
    mask = mask[:, None]
    s = jnp.where(mask, s, -jnp.inf)
    top = jnp.max(s, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(top), top, 0.0)), 0.0)
    den = e.sum(-1, keepdims=True)
    return jnp.einsum("bnts,bsnh->btnh", e / jnp.where(den > 0, den, 1.0), vv)


def head_tail(t, c):
    """The head-tail order written out: chunk r, then chunk 2C-1-r, for each device r."""
    n = t // (2 * c)
    chunks = [i for r in range(c) for i in (r, 2 * c - 1 - r)]
    return np.concatenate([np.arange(i * n, (i + 1) * n) for i in chunks])


def make_case(b, t, n, kh, h, dtype, seed=0):
    """Random q, k, v, cotangent; rows: 0 plain, 1 left-padded (its first queries see
    no key under a causal mask), 2 three packed segments, 3 padded and segmented."""
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, t, n, h), jnp.float32).astype(dtype)
    k = jax.random.normal(ks[1], (b, t, kh, h), jnp.float32).astype(dtype)
    v = jax.random.normal(ks[2], (b, t, kh, h), jnp.float32).astype(dtype)
    cot = jax.random.normal(ks[3], (b, t, n, h), jnp.float32)
    pos = np.arange(t)
    seg = np.zeros((b, t), np.int32)
    valid = np.ones((b, t), bool)
    if b > 1:
        valid[1, : t // 5] = False
    if b > 2:
        seg[2] = (pos >= t // 3).astype(np.int32) + (pos >= t // 2).astype(np.int32)
    if b > 3:
        seg[3] = (pos >= 3 * t // 4).astype(np.int32)
        valid[3, -t // 7 :] = False
    return q, k, v, cot, jnp.asarray(seg), jnp.asarray(valid)


def cp_function(fn, mesh, causal, balanced_rows, seg, valid, **kw):
    """f(q, k, v) in sequence order: rows in `balanced_rows` are permuted to the
    head-tail layout (tokens, positions, segment ids, key mask), the sequence is sharded
    over 'context' (the batch over 'data' if the mesh has it), and the output is
    permuted back."""
    b, t = seg.shape
    c = mesh.shape[AX]
    perm = np.stack([head_tail(t, c) if i in balanced_rows else np.arange(t) for i in range(b)])
    inv = np.argsort(perm, axis=1)

    def take(x, p):
        return jnp.take_along_axis(x, jnp.asarray(p).reshape(p.shape + (1,) * (x.ndim - 2)), 1)

    pos, seg_in, valid_in = jnp.asarray(perm, jnp.int32), take(seg, perm), take(valid, perm)
    bax = "data" if "data" in mesh.axis_names else None
    spec = P(bax, AX)

    def inner(q, k, v, pos, seg, valid):
        return fn(q, k, v, axis=AX, causal=causal, positions=pos, segment_ids=seg,
                  key_mask=valid, **kw)  # fmt: skip

    sm = jax.shard_map(inner, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec)
    explicit = all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    place = jax.sharding.reshard if explicit else jax.lax.with_sharding_constraint

    def shard(x, spec=spec):
        return place(x, NamedSharding(mesh, spec))

    def f(q, k, v):
        args = [take(a, perm) for a in (q, k, v)] + [pos, seg_in, valid_in]
        return take(shard(sm(*[shard(a) for a in args]), P()), inv)

    return f


def check(mesh, causal, n, kh, dtype=jnp.float32, b=4, t=128, fns=None, **kw):
    q, k, v, cot, seg, valid = make_case(b, t, n, kh, 8, dtype)
    fns = fns or (bp.ring_attention, bp.allgather_attention)
    loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v).astype(jnp.float32) * cot)  # noqa: E731
    want, want_g = jax.jit(jax.value_and_grad(
        lambda q, k, v: (lambda o: (jnp.sum(o * cot), o))(reference(q, k, v, causal, seg, valid)),
        argnums=(0, 1, 2), has_aux=True))(q, k, v)  # fmt: skip
    want = want[1]
    fs = [cp_function(fn, mesh, causal, {2, 3}, seg, valid, **kw) for fn in fns]

    @jax.jit
    def run(q, k, v):
        return [(f(q, k, v), jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)) for f in fs]

    got = run(q, k, v)
    tl = tol(dtype)
    if dtype == jnp.float32:  # gradients: sums over the sequence, 2e-6 absolute
        tl = dict(rtol=1e-5, atol=2e-6)
    for fn, (out, grads) in zip(fns, got, strict=True):
        assert out.dtype == dtype and all(gr.dtype == dtype for gr in grads)
        np.testing.assert_allclose(np.asarray(out, np.float32), want, **tl, err_msg=fn.__name__)
        for name, gr, w in zip("qkv", grads, want_g, strict=True):
            np.testing.assert_allclose(
                np.asarray(gr, np.float32), w, **tl, err_msg=f"{fn.__name__} d{name}"
            )
        if causal and b > 1:  # row 1's first queries see only padding: exactly 0
            assert not np.any(np.asarray(out[1, : t // 5], np.float32))
        assert all(np.all(np.isfinite(np.asarray(gr, np.float32))) for gr in grads)


MESH8 = None


def mesh8():
    global MESH8
    if MESH8 is None:
        MESH8 = bp.make_mesh((8,), (AX,))
    return MESH8


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("heads", [(8, 2), (2, 2)], ids=["gqa", "mha"])
def test_c8_matches_single_device(causal, heads):
    """C = 8, Explicit mesh; rows cover plain, padded, segmented, and (rows 2, 3) the
    head-tail layout."""
    check(mesh8(), causal, *heads)


def test_c8_bfloat16():
    check(mesh8(), True, 8, 2, dtype=jnp.bfloat16)


@pytest.mark.parametrize(
    "shape, types", [((4, 2), "explicit"), ((2, 4), "auto")], ids=["C2-explicit", "C4-auto"]
)
def test_data_x_context(shape, types):
    """The batch over 'data', the sequence over 'context' (C = 2, 4): causal, GQA,
    padded."""
    mesh = bp.make_mesh(shape, ("data", AX), axis_types=types)
    check(mesh, True, 8, 2)


def test_check_vma_false_and_one_block():
    mesh = mesh8()
    q, k, v, cot, seg, valid = make_case(2, 64, 4, 2, 8, jnp.float32)
    spec = P(None, AX)
    f = jax.jit(jax.shard_map(
        lambda q, k, v: bp.ring_attention(q, k, v, axis=AX, causal=True, num_blocks=1),
        mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False))  # fmt: skip
    sh = NamedSharding(mesh, spec)
    out = f(*(jax.device_put(a, sh) for a in (q, k, v)))
    ones = jnp.ones((2, 64), bool)
    np.testing.assert_allclose(out, reference(q, k, v, True, seg * 0, ones), **tol(jnp.float32))


# -- collectives that run -----------------------------------------------------------------


def count_run(jaxpr, name) -> int:
    """How many `name` equations one device runs: each times the trip counts of the scans
    around it; of a conditional's branches, the one that runs the most."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == name:
            n += 1
            continue
        subs = _subjaxprs(eqn)
        n += max((count_run(j, name) for j, k in subs if k is None), default=0)
        n += sum(k * count_run(j, name) for j, k in subs if k is not None)
    return n


@pytest.mark.parametrize("c", [2, 4, 8])
def test_ring_collectives(c):
    mesh = bp.make_mesh((8 // c, c), ("data", AX))
    spec = P("data", AX)
    x = jax.ShapeDtypeStruct((8, 8 * c, 4, 8), jnp.float32, sharding=NamedSharding(mesh, spec))

    def layer(fn, **kw):
        sm = jax.shard_map(lambda q, k, v: fn(q, k, v, axis=AX, causal=True, **kw), mesh=mesh,
                           in_specs=(spec,) * 3, out_specs=spec)  # fmt: skip
        fwd = jax.make_jaxpr(sm)(x, x, x).jaxpr
        grad = jax.make_jaxpr(jax.grad(lambda q, k, v: jnp.sum(sm(q, k, v)), (0, 1, 2)))
        return fwd, grad(x, x, x).jaxpr

    fwd, both = layer(bp.ring_attention)
    assert count_run(fwd, "ppermute") == c - 1
    assert count_run(both, "ppermute") == 3 * c - 2
    assert count_run(fwd, "all_gather") == 0  # default positions: nothing gathered
    fwd, both = layer(bp.ring_attention, key_mask=jnp.ones((8,), bool))
    assert count_run(fwd, "ppermute") == c - 1
    assert count_run(both, "ppermute") == 3 * c - 2
    assert count_run(fwd, "all_gather") == 1  # the int32 key metadata, once
    fwd, both = layer(bp.allgather_attention)
    assert count_run(fwd, "all_gather") == 1 and count_run(fwd, "ppermute") == 0
    assert count_run(both, "reduce_scatter") == 1


# -- load balance -------------------------------------------------------------------------


def test_head_tail_balances_the_ring():
    """The blocks each device computes (the ring's plan: its lax.cond predicates), equal
    to the blocks that hold a visible pair, counted here from the positions."""
    c, t, nb = 8, 8 * 32, 2
    mesh = mesh8()
    x = jax.device_put(jnp.ones((1, t, 1, 4)), NamedSharding(mesh, P(None, AX)))
    on_mesh = lambda a: jax.device_put(jnp.asarray(a, jnp.int32), NamedSharding(mesh, P(AX)))  # noqa: E731
    balanced, contiguous = on_mesh(head_tail(t, c)), on_mesh(np.arange(t))

    def plans(x, bal, cont):
        out = []
        for causal, pos in ((True, bal), (True, cont), (False, bal)):
            _, plan = bp.ring_attention(x, x, x, axis=AX, causal=causal, positions=pos,
                                        return_plan=True)  # fmt: skip
            out.append(plan[None])
        return out

    sm = jax.jit(jax.shard_map(plans, mesh=mesh, in_specs=(P(None, AX), P(AX), P(AX)),
                               out_specs=P(AX)))  # fmt: skip
    causal_bal, causal_cont, full = (np.asarray(p) for p in sm(x, balanced, contiguous))

    def expected(pos):  # [device, step, i, j]: any key position <= some query position
        blocks = np.asarray(pos).reshape(c, nb, t // (c * nb))
        want = np.zeros((c, c, nb, nb), bool)
        for r in range(c):
            for s in range(c):
                for i in range(nb):
                    for j in range(nb):
                        want[r, s, i, j] = blocks[(r - s) % c, j].min() <= blocks[r, i].max()
        return want

    np.testing.assert_array_equal(causal_bal, expected(balanced))
    np.testing.assert_array_equal(causal_cont, expected(contiguous))
    assert full.all()
    per_device = causal_bal.sum(axis=(1, 2, 3))
    assert per_device.max() / per_device.min() <= 1.05, per_device
    assert per_device.sum() <= 0.6 * full.sum(), (per_device.sum(), full.sum())
    contiguous_counts = causal_cont.sum(axis=(1, 2, 3))  # device r: 4 r + 3 blocks
    np.testing.assert_array_equal(contiguous_counts, 4 * np.arange(c) + 3)


def test_balance_sequence_round_trip():
    x = {"tokens": jnp.arange(2 * 16).reshape(2, 16), "pos": jnp.arange(16)}
    b = bp.balance_sequence({"tokens": x["tokens"]}, 4)
    np.testing.assert_array_equal(b["tokens"], np.asarray(x["tokens"])[:, head_tail(16, 4)])
    np.testing.assert_array_equal(bp.balance_sequence(x["pos"], 4, axis=0), head_tail(16, 4))
    back = bp.unbalance_sequence(b, 4)
    np.testing.assert_array_equal(back["tokens"], x["tokens"])


# -- memory -------------------------------------------------------------------------------


@pytest.mark.full_optimizations
def test_ring_memory_per_device():
    """Forward + backward temporaries of the ring at T = 2048 over 8 devices are at most
    1.25x those of single-device attention at T / 8 (the benchmark shows T = 8192)."""
    c, t, n, h = 8, 2048, 2, 16
    mesh = mesh8()
    spec = P(None, AX)
    g = jax.ShapeDtypeStruct((1, t, n, h), jnp.float32, sharding=NamedSharding(mesh, spec))
    ring = jax.shard_map(lambda q, k, v: bp.ring_attention(q, k, v, axis=AX, causal=True),
                         mesh=mesh, in_specs=(spec,) * 3, out_specs=spec)  # fmt: skip
    one = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    loss = lambda f: jax.grad(lambda q, k, v: jnp.sum(f(q, k, v)), (0, 1, 2))  # noqa: E731
    opts = {"xla_cpu_use_fusion_emitters": True}

    def temp(f, *args):
        compiled = jax.jit(f).lower(*args).compile(compiler_options=opts)
        return compiled.memory_analysis().temp_size_in_bytes

    local = jax.ShapeDtypeStruct((1, t // c, n, h), jnp.float32)
    single = temp(loss(one), local, local, local)
    ring_bytes = temp(loss(ring), g, g, g)
    assert ring_bytes <= 1.25 * single, (ring_bytes, single)


# -- errors -------------------------------------------------------------------------------


def test_errors():
    x = jnp.ones((1, 8, 4, 2))
    with pytest.raises(ValueError, match="axis 'context' is not bound"):
        bp.ring_attention(x, x, x, axis=AX)
    mesh = mesh8()

    def trace(fn, q, k, v, **kw):
        sm = jax.shard_map(lambda q, k, v: fn(q, k, v, axis=AX, **kw), mesh=mesh,
                           in_specs=P(None, AX), out_specs=P(None, AX))  # fmt: skip
        return jax.eval_shape(sm, q, k, v)

    sh = NamedSharding(mesh, P(None, AX))
    q = jax.ShapeDtypeStruct((1, 16, 4, 2), jnp.float32, sharding=sh)
    kv3 = jax.ShapeDtypeStruct((1, 16, 3, 2), jnp.float32, sharding=sh)
    with pytest.raises(ValueError, match="3 key/value heads .* do not divide the 4"):
        trace(bp.ring_attention, q, kv3, kv3)
    kv = jax.ShapeDtypeStruct((1, 16, 2, 2), jnp.bfloat16, sharding=sh)
    with pytest.raises(TypeError, match="share one floating dtype"):
        trace(bp.allgather_attention, q, kv, kv)
    with pytest.raises(ValueError, match=r"must be \(B, T, N, H\)"):
        trace(bp.ring_attention, jax.ShapeDtypeStruct((1, 16, 8), jnp.float32, sharding=sh), q, q)
    with pytest.raises(ValueError, match="num_blocks = 4 .* dividing the local"):
        trace(bp.ring_attention, q, q, q, num_blocks=4)  # local T = 2
    with pytest.raises(ValueError, match=r"positions must be integers of shape \(T,\)"):
        trace(bp.ring_attention, q, q, q, positions=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="key_mask must be boolean"):
        trace(bp.allgather_attention, q, q, q, key_mask=jnp.ones((1, 2), jnp.int32))
    with pytest.raises(ValueError, match="2 \\* num_shards = 8 does not divide"):
        bp.balance_sequence(jnp.ones((2, 12)), 4)
    with pytest.raises(ValueError, match="has no sequence axis 1"):
        bp.unbalance_sequence(jnp.ones((8,)), 2)
