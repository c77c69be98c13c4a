"""`MultiHeadAttention` and RoPE: PyTorch references, dropout, KV cache, errors.

References: ``torch.nn.MultiheadAttention`` (self and cross attention, causal and key
padding masks) and ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)``
with rotary embeddings written in torch with complex numbers (grouped-query heads, a
broadcast mask), weights copied across, forward and gradients; NumPy complex rotation for
`apply_rotary`; a hand-written ``jax.lax`` version for attention dropout; a naive float64
NumPy attention for the masks by rank (``(T, S)``, ``(B, T, S)`` shared by the heads, also
when B == N, ``(B, N, T, S)``). The KV-cache decode is compared with the full causal
forward pass (itself checked against torch).

Tolerances: ``tol(dtype)`` (f32 rtol 1e-5 / atol 1e-6; f64 rtol 1e-10 / atol 1e-12).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import blox as bx
from tests.nn.torch_reference import (
    TORCH_DTYPES,
    assert_close,
    dtype_context,
    jit_grads,
    layout,
    load_weights,
    to_np,
)
from tests.tolerances import tol

DTYPES = ["float32", "float64"]
P = ("net", "attn")


def _seeded():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    return g, rng, rng.seed(bx.Params(), seed=0)


# ---------------------------------------------------------------------------
# torch.nn.MultiheadAttention
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["self-causal-padding", "cross"])
def test_attention_matches_torch_multihead_attention(dtype, mode):
    """bx.MultiHeadAttention vs nn.MultiheadAttention(batch_first=True): outputs, d/dx,
    d/dcontext and d/d every projection weight and bias.

    Weight mapping: ``in_proj_weight`` rows [q; k; v] (or ``q/k/v_proj_weight`` when the
    context width differs) -> ``query/key/value/kernel = W.T``; ``out_proj`` -> ``out``.
    Masks: torch's boolean masks mark *forbidden* positions, blox's mark allowed ones.
    """
    torch.manual_seed(0)
    tdt = TORCH_DTYPES[dtype]
    b, t, d, n = 2, 5, 8, 2
    cross = mode == "cross"
    s, dc = (4, 6) if cross else (t, d)
    ref = torch.nn.MultiheadAttention(
        d, n, batch_first=True, kdim=dc if cross else None, vdim=dc if cross else None, dtype=tdt
    )
    with torch.no_grad():  # non-zero biases
        ref.in_proj_bias.copy_(torch.linspace(-0.5, 0.5, 3 * d, dtype=tdt))
        ref.out_proj.bias.copy_(torch.linspace(0.2, -0.2, d, dtype=tdt))
    rs = np.random.default_rng(0)
    x = rs.standard_normal((b, t, d)).astype(dtype)
    c = rs.standard_normal((b, s, dc)).astype(dtype)
    r = rs.standard_normal((b, t, d)).astype(dtype)
    key_mask = np.ones((b, s), bool)
    key_mask[1, -2:] = False  # the second sequence has two padding positions

    x_t = torch.tensor(x, requires_grad=True)
    c_t = torch.tensor(c, requires_grad=True)
    kv = c_t if cross else x_t
    kwargs = {"key_padding_mask": torch.tensor(~key_mask)}
    if not cross:
        kwargs["attn_mask"] = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    y_t, _ = ref(x_t, kv, kv, need_weights=False, **kwargs)
    (y_t * torch.tensor(r)).sum().backward()

    if cross:
        wq, wk, wv = ref.q_proj_weight, ref.k_proj_weight, ref.v_proj_weight
        gq, gk, gv = (to_np(w.grad).T for w in (wq, wk, wv))
    else:
        wq, wk, wv = ref.in_proj_weight.chunk(3)
        gq, gk, gv = (a.T for a in np.split(to_np(ref.in_proj_weight.grad), 3))
    bq, bk, bv = np.split(to_np(ref.in_proj_bias), 3)
    gbq, gbk, gbv = np.split(to_np(ref.in_proj_bias.grad), 3)

    with dtype_context(dtype):
        g, rng, params = _seeded()
        attn = bx.MultiHeadAttention(g / "attn", d, n, rng, param_dtype=dtype)
        params = layout(attn, params, jnp.zeros((1, 2, d), dtype), jnp.zeros((1, 3, dc), dtype))
        weights = {
            (*P, "query", "kernel"): to_np(wq).T.copy(),
            (*P, "key", "kernel"): to_np(wk).T.copy(),
            (*P, "value", "kernel"): to_np(wv).T.copy(),
            (*P, "out", "kernel"): to_np(ref.out_proj.weight).T.copy(),
            (*P, "query", "bias"): bq,
            (*P, "key", "bias"): bk,
            (*P, "value", "bias"): bv,
            (*P, "out", "bias"): to_np(ref.out_proj.bias),
        }
        params = load_weights(params, weights)

        def run(params, x, c):
            return attn(
                params,
                x,
                c if cross else None,
                key_mask=jnp.asarray(key_mask),
                is_causal=not cross,
                is_training=False,
            )[0]

        y = run(params, jnp.asarray(x), jnp.asarray(c))
        assert_close(y, to_np(y_t), dtype, f"attention output ({mode})")

        def loss(params, x, c):
            return jnp.sum(run(params, x, c) * jnp.asarray(r))

        g_params, g_x, g_c = jit_grads(loss, params, jnp.asarray(x), jnp.asarray(c))

    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x")
    if cross:
        assert_close(g_c, to_np(c_t.grad), dtype, "d/d context")
    expected = {
        (*P, "query", "kernel"): gq,
        (*P, "key", "kernel"): gk,
        (*P, "value", "kernel"): gv,
        (*P, "out", "kernel"): to_np(ref.out_proj.weight.grad).T,
        (*P, "query", "bias"): gbq,
        (*P, "key", "bias"): gbk,
        (*P, "value", "bias"): gbv,
        (*P, "out", "bias"): to_np(ref.out_proj.bias.grad),
    }
    assert set(g_params.keys()) == set(expected)
    for path, want in expected.items():
        assert_close(g_params[path].value, want, dtype, f"d/d {'/'.join(path[2:])}")


# ---------------------------------------------------------------------------
# Grouped-query heads + RoPE vs F.scaled_dot_product_attention
# ---------------------------------------------------------------------------


def _torch_rope(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Half-split RoPE as a complex rotation: pair (x[i], x[i + H/2]) is the complex
    number x[i] + 1j x[i + H/2], multiplied by exp(1j * t * base**(-2i/H))."""
    _, t, _, h = x.shape
    half = h // 2
    freqs = base ** (-torch.arange(half, dtype=torch.float64) * 2 / h)
    angles = torch.arange(t, dtype=torch.float64)[:, None] * freqs[None, :]
    rot = torch.polar(torch.ones_like(angles), angles)[None, :, None, :]
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_query_rope_attention_matches_torch_sdpa(dtype):
    """N = 4 query heads sharing K = 2 key/value heads, RoPE on q and k, a (B, 1, T, S)
    boolean mask, no biases: vs torch projections + _torch_rope + SDPA(enable_gqa=True)."""
    tdt = TORCH_DTYPES[dtype]
    b, t, d, n, k, h = 2, 6, 12, 4, 2, 4
    rs = np.random.default_rng(1)
    x = rs.standard_normal((b, t, d)).astype(dtype)
    r = rs.standard_normal((b, t, d)).astype(dtype)
    w = {
        name: (rs.standard_normal(shape) / np.sqrt(shape[0])).astype(dtype)
        for name, shape in [
            ("query", (d, n * h)),
            ("key", (d, k * h)),
            ("value", (d, k * h)),
            ("out", (n * h, d)),
        ]
    }
    mask = rs.random((b, 1, t, t)) > 0.3
    mask[..., 0] = True  # every query sees at least one key

    x_t = torch.tensor(x, requires_grad=True)
    w_t = {name: torch.tensor(v, requires_grad=True) for name, v in w.items()}
    q = _torch_rope((x_t @ w_t["query"]).reshape(b, t, n, h))
    kk = _torch_rope((x_t @ w_t["key"]).reshape(b, t, k, h))
    vv = (x_t @ w_t["value"]).reshape(b, t, k, h)
    a = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        kk.transpose(1, 2),
        vv.transpose(1, 2),
        attn_mask=torch.tensor(mask),
        enable_gqa=True,
    )
    y_t = a.transpose(1, 2).reshape(b, t, n * h) @ w_t["out"]
    (y_t * torch.tensor(r, dtype=tdt)).sum().backward()

    with dtype_context(dtype):
        g, rng, params = _seeded()
        attn = bx.MultiHeadAttention(
            g / "attn",
            d,
            n,
            rng,
            num_kv_heads=k,
            head_dim=h,
            use_bias=False,
            use_rope=True,
            param_dtype=dtype,
        )
        params = layout(attn, params, jnp.zeros((1, 2, d), dtype))
        params = load_weights(params, {(*P, name, "kernel"): v for name, v in w.items()})

        def run(params, x):
            return attn(params, x, mask=jnp.asarray(mask), is_training=False)[0]

        assert_close(run(params, jnp.asarray(x)), to_np(y_t), dtype, "GQA + RoPE output")
        g_params, g_x = jit_grads(
            lambda p, x: jnp.sum(run(p, x) * jnp.asarray(r)), params, jnp.asarray(x)
        )
    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x")
    for name in w:
        assert_close(
            g_params[(*P, name, "kernel")].value, to_np(w_t[name].grad), dtype, f"d/d {name}"
        )


def test_apply_rotary_matches_complex_rotation_and_keeps_dot_products_relative():
    rs = np.random.default_rng(2)
    x = rs.standard_normal((2, 5, 3, 8))
    pos = np.array([[0, 1, 2, 3, 4], [7, 9, 11, 13, 15]])
    with jax.enable_x64(True):
        y = np.asarray(bx.apply_rotary(jnp.asarray(x), jnp.asarray(pos), base=100.0))
    theta = 100.0 ** (-np.arange(4) * 2 / 8)
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * pos[:, :, None, None] * theta)
    np.testing.assert_allclose(y, np.concatenate([z.real, z.imag], -1), **tol(jnp.float64))
    # f32 path, shared positions (T,).
    y32 = bx.apply_rotary(jnp.asarray(x, jnp.float32), jnp.arange(5))
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(
        1j * np.arange(5)[None, :, None, None] * 10000.0 ** (-np.arange(4) * 2 / 8)
    )
    assert y32.dtype == jnp.float32
    np.testing.assert_allclose(y32, np.concatenate([z.real, z.imag], -1), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"apply_rotary: positions must have shape \(5,\)"):
        bx.apply_rotary(jnp.ones((2, 5, 3, 8)), jnp.arange(4))
    with pytest.raises(ValueError, match=r"even head size H, got \(2, 5, 3, 7\)"):
        bx.apply_rotary(jnp.ones((2, 5, 3, 7)), jnp.arange(5))


# ---------------------------------------------------------------------------
# Masks by rank vs a NumPy reference
# ---------------------------------------------------------------------------


_PROJ = ("query", "key", "value", "out")


def _numpy_attention(x, w, b, n, mask4):
    """Naive float64 multi-head attention; ``mask4`` (B, N, T, S), True = may attend."""
    bsz, t, d = x.shape
    h = d // n
    q, k, v = ((x @ w[m] + b[m]).reshape(bsz, t, n, h) for m in ("query", "key", "value"))
    logits = np.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(h)
    logits = np.where(mask4, logits, -np.inf)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a = np.einsum("bnts,bsnh->btnh", p, v).reshape(bsz, t, d)
    return a @ w["out"] + b["out"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [2, 3], ids=["B==N", "B!=N"])
def test_mask_rank_says_what_it_holds_vs_numpy(batch, dtype):
    """(B, T, S) is one mask per sequence shared by the heads (Keras' convention), also
    when B == N, never (N, T, S); (B, N, T, S) is per sequence and head, (1, N, T, S) per
    head, (T, S) shared by all. Reference: naive NumPy attention in float64."""
    n, t, d = 2, 4, 8
    rs = np.random.default_rng(5)
    x = rs.standard_normal((batch, t, d))
    per_seq = rs.random((batch, t, t)) > 0.5
    per_head = rs.random((batch, n, t, t)) > 0.5
    per_seq[..., 0] = per_head[..., 0] = True  # every query sees at least one key
    with dtype_context(dtype):
        g, rng, params = _seeded()
        attn = bx.MultiHeadAttention(g / "attn", d, n, rng, param_dtype=dtype)
        _, params = attn(params, jnp.asarray(x, dtype), is_training=False)
        w = {m: np.asarray(params[(*P, m, "kernel")].value, np.float64) for m in _PROJ}
        bias = {m: np.asarray(params[(*P, m, "bias")].value, np.float64) for m in _PROJ}
        cases = {
            "(B, T, S)": (per_seq, per_seq[:, None]),
            "(B, N, T, S)": (per_head, per_head),
            "(1, N, T, S)": (per_head[:1], per_head[:1]),
            "(T, S)": (per_seq[0], per_seq[0][None, None]),
        }
        run = jax.jit(lambda p, x, m: attn(p, x, mask=m, is_training=False)[0])
        for name, (mask, mask4) in cases.items():
            y = run(params, jnp.asarray(x, dtype), jnp.asarray(mask))
            want = _numpy_attention(x, w, bias, n, np.broadcast_to(mask4, (batch, n, t, t)))
            assert_close(y, want.astype(dtype), dtype, f"mask {name}")


# ---------------------------------------------------------------------------
# Dropout on the attention weights
# ---------------------------------------------------------------------------


def test_attention_dropout_matches_hand_written_lax_and_only_in_training():
    b, t, d, n, k, rate = 2, 4, 8, 4, 2, 0.25
    g, rng, params = _seeded()
    attn = bx.MultiHeadAttention(g / "attn", d, n, rng, num_kv_heads=k, dropout_rate=rate)
    x = jax.random.normal(jax.random.key(1), (b, t, d))
    _, params = attn(params, x, is_training=False)
    params = params.locked()
    counter = int(rng.get_counter(params))

    y, p2 = attn(params, x, is_causal=True)
    assert int(rng.get_counter(p2)) == counter + 1
    y_eval, p3 = attn(params, x, is_causal=True, is_training=False)
    assert int(rng.get_counter(p3)) == counter

    # Reference: the documented math in jax.lax, mask key = fold_in(seed, counter); query
    # head h = K-index * G + G-index draws its (B, T, S) mask from fold_in(key, h).
    w = {m: params[(*P, m, "kernel")].value for m in ("query", "key", "value", "out")}
    bias = {m: params[(*P, m, "bias")].value for m in ("query", "key", "value", "out")}
    h = d // n
    q = (jax.lax.dot(x.reshape(-1, d), w["query"]) + bias["query"][None]).reshape(b, t, k, 2, h)
    kk = (jax.lax.dot(x.reshape(-1, d), w["key"]) + bias["key"][None]).reshape(b, t, k, h)
    vv = (jax.lax.dot(x.reshape(-1, d), w["value"]) + bias["value"][None]).reshape(b, t, k, h)
    logits = jnp.einsum("btkgh,bskh->bkgts", q, kk) / np.sqrt(h)
    causal = np.tril(np.ones((t, t), bool))
    logits = jnp.where(causal, logits, -0.7 * np.finfo(np.float32).max)
    probs = jax.nn.softmax(logits, axis=-1)
    key = jax.random.fold_in(rng.get_seed(params), counter)
    per_head = [
        jax.random.bernoulli(jax.random.fold_in(key, i), 1 - rate, (b, t, t)) for i in range(n)
    ]
    keep = jnp.stack(per_head, axis=1).reshape(probs.shape)
    probs_drop = jnp.where(keep, probs / (1 - rate), 0.0)

    def finish(p):
        a = jnp.einsum("bkgts,bskh->btkgh", p, vv).reshape(b * t, d)
        return (jax.lax.dot(a, w["out"]) + bias["out"][None]).reshape(b, t, d)

    np.testing.assert_allclose(y, finish(probs_drop), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y_eval, finish(probs), rtol=1e-5, atol=1e-5)
    assert not np.allclose(y, y_eval)


# ---------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------


def test_kv_cache_decoding_equals_full_causal_pass():
    """Prefill 3 tokens, then 1 token per jitted call: every output equals the full
    causal pass at that position (with RoPE, so the cached keys carry their positions);
    the cache is non-trainable state in Params."""
    b, t, d, length = 2, 7, 8, 10
    g, rng, params = _seeded()
    attn = bx.MultiHeadAttention(g / "attn", d, 4, rng, num_kv_heads=2, use_rope=True)
    x = jax.random.normal(jax.random.key(3), (b, t, d))
    key_mask = jnp.ones((b, t), bool)
    full, params = attn(params, x, is_causal=True, is_training=False)
    params = attn.init_cache(params.locked(), b, length)
    assert params.is_locked
    for name in ("cache_key", "cache_value", "cache_index"):
        assert not params[(*P, name)].trainable
    assert params[(*P, "cache_key")].value.shape == (b, length, 2, 2)

    step = jax.jit(lambda p, x: attn(p, x, decode=True, is_training=False))
    y0, params = attn(params, x[:, :3], decode=True, is_training=False)  # eager prefill
    outs = [y0]
    for i in range(3, t):
        y, params = step(params, x[:, i : i + 1])
        outs.append(y)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, **tol(jnp.float32))
    assert int(attn.cache_index(params)) == t
    np.testing.assert_array_equal(params[(*P, "cache_key")].value[:, t:], 0.0)
    # A padding key mask over the cache (B, L) is accepted in decode mode.
    y_masked, _ = attn(
        params,
        x[:, :1],
        decode=True,
        is_training=False,
        key_mask=jnp.concatenate([key_mask, jnp.ones((b, length - t), bool)], 1),
    )
    assert y_masked.shape == (b, 1, d)
    # init_cache again resets (new sequences).
    params = attn.init_cache(params, b, length)
    assert int(attn.cache_index(params)) == 0


def test_kv_cache_errors_and_overflow():
    g, rng, params = _seeded()
    attn = bx.MultiHeadAttention(g / "attn", 4, 2, rng)
    x = jnp.ones((1, 3, 4))
    _, params = attn(params, x)
    with pytest.raises(KeyError, match=r"'net/attn': decode=True needs a KV cache") as info:
        attn(params, x, decode=True)
    # A BloxKeyError: still a KeyError, printed as written (real newlines, no quotes).
    msg = str(info.value)
    assert "\n    params = model.init_cache(params, batch_size, max_length)\n" in msg
    assert not msg.startswith(("'", '"')) and "\\n" not in msg
    with pytest.raises(KeyError, match=r"needs a KV cache in params, and there is none"):
        attn.cache_index(params)
    params = attn.init_cache(params, 1, 4)
    _, p1 = attn(params, x, decode=True)
    with pytest.raises(
        ValueError,
        match=r"'net/attn': KV cache overflow: the cache holds 4 positions \(cache_key "
        r"\(1, 4, 2, 2\)\), 3 are filled and the input adds 2 \(x shape \(1, 2, 4\)\)\. "
        r"Create a larger cache .*max_length >= 5",
    ):
        attn(p1, x[:, :2], decode=True)
    with pytest.raises(ValueError, match=r"KV cache overflow: the cache holds 4 positions"):
        jax.jit(lambda p, x: attn(p, x, decode=True))(params, jnp.ones((1, 5, 4)))
    # Under jit the filled count is traced: an overflowing step returns NaN, not numbers.
    y, _ = jax.jit(lambda p, x: attn(p, x, decode=True))(p1, x[:, :2])
    assert np.isnan(np.asarray(y)).all()
    y_ok, _ = jax.jit(lambda p, x: attn(p, x, decode=True))(p1, x[:, :1])
    assert np.isfinite(np.asarray(y_ok)).all()
    with pytest.raises(ValueError, match=r"the KV cache was made for batch size 1"):
        attn(params, jnp.ones((2, 1, 4)), decode=True)
    with pytest.raises(ValueError, match=r"decode=True is for self-attention"):
        attn(params, x, x, decode=True)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_attention_errors_name_path_shapes_and_fix():
    g, rng, params = _seeded()
    with pytest.raises(
        ValueError,
        match=r"MultiHeadAttention 'net/a': num_heads = 3 does not divide model_size = 8.*"
        r"pass head_dim",
    ):
        bx.MultiHeadAttention(g / "a", 8, 3, rng)
    with pytest.raises(
        ValueError,
        match=r"'net/b': num_kv_heads = 3 must be a positive int dividing num_heads = 4.*"
        r"\[1, 2, 4\]",
    ):
        bx.MultiHeadAttention(g / "b", 8, 4, rng, num_kv_heads=3)
    attn = bx.MultiHeadAttention(g / "attn", 8, 2, rng)
    x = jnp.ones((2, 3, 8))
    _, params = attn(params, x)
    with pytest.raises(
        ValueError,
        match=r"MultiHeadAttention 'net/attn' expects x of shape \(B, T, 8\) \(model_size 8\), "
        r"got \(2, 3, 6\)",
    ):
        attn(params, jnp.ones((2, 3, 6)))
    with pytest.raises(
        ValueError,
        match=r"'net/attn': mask of shape \(3, 4\) does not match \(T, S\) = \(3, 3\), "
        r"\(B, T, S\) = \(2, 3, 3\) or \(B, N, T, S\) = \(2, 2, 3, 3\)",
    ):
        attn(params, x, mask=jnp.ones((3, 4), bool))
    with pytest.raises(ValueError, match=r"mask of shape \(3,\) does not match"):
        attn(params, x, mask=jnp.ones((3,), bool))
    with pytest.raises(
        ValueError, match=r"mask of shape \(4, 3, 3\) does not match .*a 3-D mask is \(B, T, S\)"
    ):
        attn(params, x, mask=jnp.ones((4, 3, 3), bool))
    with pytest.raises(ValueError, match=r"positions are used only by rotary embeddings"):
        attn(params, x, positions=jnp.arange(3))
    rope = bx.MultiHeadAttention(g / "rope", 8, 2, rng, use_rope=True)
    _, params = rope(params, x)
    with pytest.raises(
        ValueError, match=r"'net/rope': positions must be integers of shape \(T,\) = \(3,\)"
    ):
        rope(params, x, positions=jnp.arange(4))
    with pytest.raises(TypeError, match=r"'net/c': rng must be a blox Rng or None, got float"):
        bx.MultiHeadAttention(g / "c", 8, 2, 0.5)
    with pytest.raises(TypeError, match=r"'net/attn': mask must be boolean"):
        attn(params, x, mask=jnp.ones((3, 3)))
    with pytest.raises(ValueError, match=r"key_mask must be a boolean array of shape \(B, S\)"):
        attn(params, x, key_mask=jnp.ones((2, 4), bool))
    with pytest.raises(ValueError, match=r"context must have shape \(B, S, D_ctx\) with B = 2"):
        attn(params, x, jnp.ones((3, 3, 8)))
    # A (T, S) mask broadcasts.
    y, _ = attn(params, x, mask=jnp.tril(jnp.ones((3, 3), bool)))
    y_causal, _ = attn(params, x, is_causal=True)
    np.testing.assert_allclose(y, y_causal, **tol(jnp.float32))


def test_attend_step_alone_equals_numpy_gqa_and_its_dropout_bits_follow_first_head():
    """`attend` (the step a sequence-parallel subclass may replace) on projected heads:
    grouped-query heads with a causal and a padding mask equal naive float64 NumPy
    attention; with dropout, the heads ``first_head .. first_head + n - 1`` of a call on
    n heads drop the weights that a call on all N heads drops for them (as one device of
    the tensor-parallel layer does)."""
    b, t, n, k, h = 2, 5, 4, 2, 3
    rs = np.random.default_rng(11)
    q, kk, vv = (rs.standard_normal((b, t, m, h)) for m in (n, k, k))
    pad = np.arange(t)[None, :] < np.array([5, 3])[:, None]  # (B, S)
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    attn = bx.MultiHeadAttention(g / "attn", 12, n, rng, num_kv_heads=k)
    with dtype_context("float64"):
        mask = jnp.asarray(pad[:, None, None, :])
        y = attn.attend(*(jnp.asarray(a) for a in (q, kk, vv)), mask=mask, is_causal=True)
        assert y.dtype == jnp.float64
    logits = np.einsum("btnh,bsnh->bnts", q, np.repeat(kk, n // k, axis=2)) / np.sqrt(h)
    allowed = np.tril(np.ones((t, t), bool))[None, None] & pad[:, None, None, :]
    logits = np.where(allowed, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    want = np.einsum("bnts,bsnh->btnh", w, np.repeat(vv, n // k, axis=2))
    np.testing.assert_allclose(np.asarray(y), want, **tol(jnp.float64))

    drop = bx.MultiHeadAttention(g / "drop", 12, n, rng, num_kv_heads=k, dropout_rate=0.5)
    key = jax.random.key(3)
    qs, ks, vs = (jnp.asarray(a, jnp.float32) for a in (q, kk, vv))
    every = drop.attend(qs, ks, vs, is_causal=True, dropout_key=key)
    assert not np.allclose(np.asarray(every), np.asarray(drop.attend(qs, ks, vs, is_causal=True)))
    # Heads 2, 3 share key/value head 1: call on them alone, as device 1 of 2 would.
    part = drop.attend(qs[:, :, 2:], ks[:, :, 1:], vs[:, :, 1:], is_causal=True,
                       dropout_key=key, first_head=2)  # fmt: skip
    np.testing.assert_allclose(np.asarray(part), np.asarray(every[:, :, 2:]), **tol(jnp.float32))
    assert tuple(attn.head_layout()) == (n, k, 0, None)  # no shard_map: every head


def test_bf16_gradients_lower_under_strict_promotion_and_match_standard():
    """Under ``jax_numpy_dtype_promotion='strict'`` (the suite's default) a bfloat16
    attention's gradient compiles (jax.nn.dot_product_attention's backward does not
    lower there: the layer writes the same math out) and equals the gradient of the
    jax.nn.dot_product_attention path taken under 'standard' promotion."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    attn = bx.MultiHeadAttention(g / "attn", 32, 4, rng, num_kv_heads=2, param_dtype=jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(3).normal(size=(2, 8, 32)), jnp.bfloat16)
    params = attn(rng.seed(bx.Params(), seed=0), x, is_causal=True)[1].locked()
    train, rest = params.split()

    def loss(t):
        y, _ = attn(t.merge(rest), x, is_causal=True)
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    strict = jax.jit(jax.value_and_grad(loss))(train)
    with jax.numpy_dtype_promotion("standard"):
        standard = jax.jit(jax.value_and_grad(loss))(train)
    for a, b in zip(jax.tree.leaves(strict), jax.tree.leaves(standard), strict=True):
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), **tol(jnp.bfloat16)
        )
