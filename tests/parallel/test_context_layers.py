"""Context parallelism as a mode of the nn layers: `TransformerBlock` /
`MultiHeadAttention` / `TransformerLM` built with ``context_axis`` and run inside a
``jax.shard_map`` over the sequence equal the same layers (same params) on the whole
sequence on one device: outputs, every parameter gradient and the input gradient, for
the ring and the all-gather variant, with RoPE and grouped-query heads, padding and
packed segments, the head-tail layout (positions passed), combined with tensor
parallelism, and learned absolute positions; what cannot run on a sharded sequence
raises naming the layer; `check_context_parallel` and `cp_batch_spec`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp
from blox import ts
from tests.tolerances import tol

F32 = tol(jnp.float32)
D, N, K, B, T = 32, 4, 2, 2, 32
AX = "context"


def _pair(make, x, call_kw, name="block"):
    """The plain layer and the context-parallel one on two graphs with the same paths,
    and one Params for both."""
    g1, g2 = bx.Graph("net"), bx.Graph("net")
    r1, r2 = bx.Rng(g1 / "rng"), bx.Rng(g2 / "rng")
    ref, cp = make(g1 / name, r1, {}), make(g2 / name, r2, {"context_axis": AX})
    params = r1.seed(bx.Params(), seed=0)
    _, params = ref(params, x, **call_kw)
    return ref, cp, params.locked()


def _block(g, r, kw, **more):
    return bx.TransformerBlock(
        g, D, N, r, num_kv_heads=K, mlp_size=2 * D, use_rope=True, **kw, **more
    )


def _x(seed=0, shape=(B, T, D)):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _compare(ref, cp, params, x, mesh, ref_kw, seq_kw, x_spec, p_specs=None, perm=None):
    """Output and gradients (params and x) of ``sum(sin(layer(x)))`` under the
    shard_map (sequence over 'context'; ``seq_kw`` leaves sharded like x's first two
    dimensions) against the plain layer on the whole sequence (``ref_kw``). ``perm``:
    the order of the sequence the sharded run sees (the head-tail layout)."""
    t_ref, rest = params.split()
    perm = np.arange(x.shape[1]) if perm is None else perm
    seq_spec = P(*tuple(x_spec)[:2])
    p_specs = P() if p_specs is None else p_specs

    def run(t, x, seq):
        def body(p, x, seq):
            return cp(p, x, **seq)[0]

        specs = jax.tree.map(lambda _: seq_spec, seq)
        f = jax.shard_map(body, mesh=mesh, in_specs=(p_specs, x_spec, specs), out_specs=x_spec)
        return f(t.merge(rest), x, seq)

    def cp_loss(t, x, seq):
        y = run(t, x, seq)
        return jnp.sum(jnp.sin(y)), y

    def ref_loss(t, x):
        y = ref(t.merge(rest), x, **ref_kw)[0]
        return jnp.sum(jnp.sin(y)), y

    with jax.default_matmul_precision("highest"):
        xs = jax.device_put(x[:, perm], NamedSharding(mesh, x_spec))
        seq = {k: jax.device_put(v, NamedSharding(mesh, seq_spec)) for k, v in seq_kw.items()}
        (_, y), (gt, gx) = jax.jit(jax.value_and_grad(cp_loss, (0, 1), has_aux=True))(
            t_ref, xs, seq
        )
        (_, y0), (gt0, gx0) = jax.value_and_grad(ref_loss, (0, 1), has_aux=True)(t_ref, x)
    inv = np.argsort(perm)
    np.testing.assert_allclose(np.asarray(y)[:, inv], np.asarray(y0), **F32)
    np.testing.assert_allclose(np.asarray(gx)[:, inv], np.asarray(gx0), rtol=1e-5, atol=2e-5)
    scale = max(float(np.max(np.abs(np.asarray(v)))) for v in gt0.leaves())
    for path in gt0.keys():
        np.testing.assert_allclose(
            np.asarray(gt[path].value),
            np.asarray(gt0[path].value),
            rtol=1e-5,
            atol=1e-5 * scale,
            err_msg=str(path),
        )


def _masks():
    """Row 0: two packed segments; row 1: right padding (the last 5 keys)."""
    seg = np.zeros((B, T), np.int32)
    seg[0, T // 3 :] = 1
    valid = np.ones((B, T), bool)
    valid[1, -5:] = False
    return jnp.asarray(seg), jnp.asarray(valid)


@pytest.mark.parametrize("variant,types", [("ring", "explicit"), ("allgather", "auto")])
def test_block_on_4_context_shards_equals_whole_sequence(variant, types):
    """RoPE at the global positions (the contiguous default), GQA, causal, packed
    segments and padding keys: forward, every parameter gradient and dx."""
    x = _x()
    seg, valid = _masks()
    kw = dict(is_causal=True, segment_ids=seg, key_mask=valid)
    ref, cp, params = _pair(lambda g, r, c: _block(g, r, c, context_variant=variant), x, kw)
    mesh = bp.make_mesh((4,), (AX,), devices=jax.devices()[:4], axis_types=types)

    class Seq:  # the keywords, with is_causal fixed
        def __call__(self, p, x, **seq):
            return cp(p, x, is_causal=True, **seq)

    _compare(ref, Seq(), params, x, mesh, kw, dict(segment_ids=seg, key_mask=valid), P(None, AX))


def test_tp_x_cp_head_tail_layout_with_positions_equals_whole_sequence():
    """Heads over 'model' (2) and the sequence over 'context' (4) in the head-tail
    layout: the caller passes the permuted global positions (RoPE and causal mask)."""
    x = _x(1)
    kw = dict(is_causal=True)
    ref, cp, params = _pair(lambda g, r, c: _block(g, r, c, tp_axis="model"), x, kw)
    mesh = bp.make_mesh((2, 4), ("model", AX), axis_types="auto")
    perm = bp.balance_sequence(jnp.arange(T), 4, axis=0)
    np.testing.assert_array_equal(  # the layout written out: chunks r and 2C-1-r
        np.asarray(perm).reshape(8, 4)[:, 0], 4 * np.array([0, 7, 1, 6, 2, 5, 3, 4])
    )
    specs = bp.param_specs(params, bp.transformer_tp_rules() + [("rng/.*", None)], mesh)
    positions = jnp.broadcast_to(perm, (B, T))

    class Seq:
        def __call__(self, p, x, **seq):
            return cp(p, x, is_causal=True, **seq)

    _compare(ref, Seq(), params, x, mesh, kw, dict(positions=positions), P(None, AX), specs, perm)


def test_lm_with_learned_positions_on_context_shards_equals_whole_sequence():
    """TransformerLM(position='learned'): the embedding rows of the global positions;
    and a LearnedPositionalEmbedding alone (default positions) on its shard."""
    g1, g2 = bx.Graph("net"), bx.Graph("net")
    r1, r2 = bx.Rng(g1 / "rng"), bx.Rng(g2 / "rng")
    kw = dict(position="learned", max_length=T, mlp_size=2 * D)
    ref = bx.TransformerLM(g1 / "lm", 11, D, 1, N, r1, **kw)
    cp = bx.TransformerLM(g2 / "lm", 11, D, 1, N, r2, context_axis=AX, **kw)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 11, (B, T)), jnp.int32)
    params = r1.seed(bx.Params(), seed=0)
    y0, params = ref(params, tokens, is_training=False)
    mesh = bp.make_mesh((4,), (AX,), devices=jax.devices()[:4], axis_types="auto")
    f = jax.jit(
        jax.shard_map(
            lambda p, t: cp(p, t, is_training=False)[0],
            mesh=mesh,
            in_specs=(P(), P(None, AX)),
            out_specs=P(None, AX),
        )
    )
    with jax.default_matmul_precision("highest"):
        y0 = ref(params, tokens, is_training=False)[0]
        np.testing.assert_allclose(np.asarray(f(params, tokens)), np.asarray(y0), **F32)
    pos = bx.LearnedPositionalEmbedding(g2 / "pe", T, r2, context_axis=AX)
    h = _x(2)
    _, pp = pos(r2.seed(bx.Params(), seed=0), h)
    g = jax.shard_map(
        lambda p, h: pos(p, h)[0], mesh=mesh, in_specs=(P(), P(None, AX)), out_specs=P(None, AX)
    )
    table = np.asarray(pp[("net", "pe", "embedding")].value)
    np.testing.assert_allclose(np.asarray(g(pp, h)), np.asarray(h) + table[None], **F32)


def _shard_eval(fn, mesh, *args, specs):
    out = specs[1]
    jax.eval_shape(jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out), *args)


def test_what_cannot_run_on_a_sharded_sequence_raises_naming_the_layer():
    x = _x()
    mesh = bp.make_mesh((4,), (AX,), devices=jax.devices()[:4], axis_types="auto")
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    attn = bx.MultiHeadAttention(g / "attn", D, N, rng, context_axis=AX, dropout_rate=0.1)
    params = rng.seed(bx.Params(), seed=0)
    _, params = attn(params, x, is_training=False)
    specs = (P(), P(None, AX))
    cases = {
        "general \\(T, S\\) mask": dict(mask=jnp.ones((T // 4, T // 4), bool)),
        "decode=True": dict(decode=True, is_training=False),
        "cross-attention": dict(context=jnp.ones((B, 4, D))),
        "attention dropout": dict(is_training=True),
    }
    for msg, kw in cases.items():
        with pytest.raises(ValueError, match=f"MultiHeadAttention 'net/attn'.*{msg}"):
            _shard_eval(lambda p, x, kw=kw: attn(p, x, **kw)[0], mesh, params, x, specs=specs)
    with pytest.raises(ValueError, match="key_mask must be .*\\(B, T\\) = \\(2, 8\\)"):
        _shard_eval(
            lambda p, x: attn(p, x, key_mask=jnp.ones((B, T), bool), is_training=False)[0],
            mesh, params, x, specs=specs,
        )  # fmt: skip
    lm = bx.TransformerLM(g / "lm", 11, D, 1, N, rng, context_axis=AX)
    tok = jnp.zeros((B, T), jnp.int32)
    _, lp = lm(rng.seed(bx.Params(), seed=0), tok)
    with pytest.raises(ValueError, match="TransformerLM 'net/lm'.*pass positions="):
        _shard_eval(lambda p, t: lm(p, t, key_mask=t >= 0)[0], mesh, lp, tok, specs=specs)
    other = bp.make_mesh((4,), ("seq",), devices=jax.devices()[:4], axis_types="auto")
    with pytest.raises(ValueError, match="context_axis='context' is not an axis of the enclosing"):
        _shard_eval(lambda p, x: attn(p, x, is_training=False)[0], other, params, x,
                    specs=(P(), P(None, "seq")))  # fmt: skip
    with pytest.raises(ValueError, match="context_variant must be 'ring'.*got 'flash'"):
        bx.MultiHeadAttention(g / "a2", D, N, rng, context_axis=AX, context_variant="flash")
    with pytest.raises(ValueError, match="context_axis and tp_axis are both 'm'"):
        bx.TransformerBlock(g / "b2", D, N, rng, context_axis="m", tp_axis="m")
    with pytest.raises(TypeError, match="context_axis must be one mesh-axis name"):
        bx.SinusoidalPositionalEncoding(g / "p2", context_axis=("a", "b"))
    # Outside a shard_map binding the axis the layer is the plain one (same numbers).
    y, _ = attn(params, x, is_training=False, is_causal=True)
    plain = bx.MultiHeadAttention(bx.Graph("net") / "attn", D, N, None)
    np.testing.assert_allclose(
        np.asarray(y), np.asarray(plain(params, x, is_causal=True)[0]), **F32
    )


def test_check_context_parallel_names_the_layers_that_read_across_time():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    ok = bx.TransformerLM(g / "lm", 11, 8, 1, 2, rng, context_axis=AX)
    bp.check_context_parallel(ok, AX)  # every attention has the axis
    bp.check_context_parallel(bx.Conv(g / "pointwise", (1,), 4, rng), AX)
    m = g / "model"
    seq = bx.Sequential(
        m,
        [
            bx.LSTM(m / "lstm", 8, rng),
            bx.Conv(m / "conv", (3,), 8, rng, padding="CAUSAL"),
            bx.MultiHeadAttention(m / "attn", 8, 2, rng),
        ],
    )
    with pytest.raises(ValueError) as e:
        bp.check_context_parallel(seq, AX)
    text = str(e.value)
    assert "3 layer(s)" in text
    for name in ("LSTM 'net/model/lstm'", "Conv 'net/model/conv'", "'net/model/attn'"):
        assert name in text
    assert "build it with context_axis='context'" in text
    tcn = ts.TCNBlocks(g / "tcn", 8, rng, kernel_size=2, dilations=(1, 2))
    with pytest.raises(ValueError, match="Conv 'net/tcn/.*1-D convolution of window 2"):
        bp.check_context_parallel(tcn, AX)
    with pytest.raises(ValueError, match="attend only within this device's shard"):
        bp.check_context_parallel(ok, "seq")


def test_segment_ids_off_cp_equal_the_written_out_mask():
    """The new ``segment_ids`` keyword of the plain layer: the same as the (B, T, S)
    mask ``seg[:, :, None] == seg[:, None, :]`` written by hand."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    attn = bx.MultiHeadAttention(g / "attn", D, N, rng, num_kv_heads=K)
    x = _x(3)
    seg, valid = _masks()
    params = rng.seed(bx.Params(), seed=0)
    y, params = attn(params, x, segment_ids=seg, key_mask=valid, is_causal=True)
    s = np.asarray(seg)
    mask = jnp.asarray(s[:, :, None] == s[:, None, :])
    y0, _ = attn(params, x, mask=mask, key_mask=valid, is_causal=True)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y0), **F32)
    with pytest.raises(ValueError, match="segment_ids must be integers of shape"):
        attn(params, x, segment_ids=seg[:, :5])


def test_cp_batch_spec():
    assert bp.cp_batch_spec() == P("data", AX)
    assert bp.cp_batch_spec(("replica", "data"), "seq") == P(("replica", "data"), "seq")
    assert bp.cp_batch_spec(None) == P(None, AX)
    mesh = bp.make_mesh((2, 4), ("data", AX))
    assert bp.cp_batch_spec("data", AX, mesh) == P("data", AX)
    with pytest.raises(ValueError, match="name an axis twice"):
        bp.cp_batch_spec(AX, AX)
    with pytest.raises(ValueError, match="\\['seq'\\] not axes of the mesh"):
        bp.cp_batch_spec("data", "seq", mesh)
