"""`TransformerBlock` and `TransformerLM` against PyTorch; KV-cache decoding; benchmark smoke.

References: ``torch.nn.TransformerEncoderLayer(norm_first=True, batch_first=True)`` (the
pre-norm block, with a causal mask and key padding), and a small torch decoder-only LM
(``nn.Embedding`` + learned positions + those layers + ``nn.LayerNorm`` + tied output),
weights copied across; forward and gradients w.r.t. every weight. Left-padded batches
(every position kind) against each prompt run alone, with and without the KV cache.
Constructor signatures: options after ``rng`` keyword-only for the layers jax-blox lacks,
jax-blox's positional signatures kept for its own. Tolerances: ``tol(dtype)`` (f32 rtol
1e-5 / atol 1e-6; f64 rtol 1e-10 / atol 1e-12).
"""

from __future__ import annotations

import inspect

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


def _gelu_tanh(x):
    return F.gelu(x, approximate="tanh")


def _torch_layer(d, n, f, tdt, seed):
    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        d,
        n,
        f,
        dropout=0.0,
        activation=_gelu_tanh,
        batch_first=True,
        norm_first=True,
        dtype=tdt,
    )
    with torch.no_grad():  # non-trivial norms and biases
        for norm in (layer.norm1, layer.norm2):
            norm.weight.copy_(1.0 + 0.1 * torch.randn(d, dtype=tdt))
            norm.bias.copy_(0.1 * torch.randn(d, dtype=tdt))
        layer.self_attn.in_proj_bias.copy_(0.1 * torch.randn(3 * d, dtype=tdt))
    return layer.train()


def _layer_weights(prefix, layer):
    """torch TransformerEncoderLayer -> blox TransformerBlock parameter paths."""
    wq, wk, wv = (to_np(w).T.copy() for w in layer.self_attn.in_proj_weight.chunk(3))
    bq, bk, bv = np.split(to_np(layer.self_attn.in_proj_bias), 3)
    return {
        (*prefix, "norm1", "scale"): to_np(layer.norm1.weight),
        (*prefix, "norm1", "bias"): to_np(layer.norm1.bias),
        (*prefix, "attn", "query", "kernel"): wq,
        (*prefix, "attn", "key", "kernel"): wk,
        (*prefix, "attn", "value", "kernel"): wv,
        (*prefix, "attn", "query", "bias"): bq,
        (*prefix, "attn", "key", "bias"): bk,
        (*prefix, "attn", "value", "bias"): bv,
        (*prefix, "attn", "out", "kernel"): to_np(layer.self_attn.out_proj.weight).T.copy(),
        (*prefix, "attn", "out", "bias"): to_np(layer.self_attn.out_proj.bias),
        (*prefix, "norm2", "scale"): to_np(layer.norm2.weight),
        (*prefix, "norm2", "bias"): to_np(layer.norm2.bias),
        (*prefix, "mlp", "linear_0", "kernel"): to_np(layer.linear1.weight).T.copy(),
        (*prefix, "mlp", "linear_0", "bias"): to_np(layer.linear1.bias),
        (*prefix, "mlp", "linear_1", "kernel"): to_np(layer.linear2.weight).T.copy(),
        (*prefix, "mlp", "linear_1", "bias"): to_np(layer.linear2.bias),
    }


def _layer_grads(prefix, layer):
    """The gradients of `layer`'s weights, in blox layout (same keys as _layer_weights)."""
    gq, gk, gv = (a.T for a in np.split(to_np(layer.self_attn.in_proj_weight.grad), 3))
    gbq, gbk, gbv = np.split(to_np(layer.self_attn.in_proj_bias.grad), 3)
    return {
        (*prefix, "norm1", "scale"): to_np(layer.norm1.weight.grad),
        (*prefix, "norm1", "bias"): to_np(layer.norm1.bias.grad),
        (*prefix, "attn", "query", "kernel"): gq,
        (*prefix, "attn", "key", "kernel"): gk,
        (*prefix, "attn", "value", "kernel"): gv,
        (*prefix, "attn", "query", "bias"): gbq,
        (*prefix, "attn", "key", "bias"): gbk,
        (*prefix, "attn", "value", "bias"): gbv,
        (*prefix, "attn", "out", "kernel"): to_np(layer.self_attn.out_proj.weight.grad).T,
        (*prefix, "attn", "out", "bias"): to_np(layer.self_attn.out_proj.bias.grad),
        (*prefix, "norm2", "scale"): to_np(layer.norm2.weight.grad),
        (*prefix, "norm2", "bias"): to_np(layer.norm2.bias.grad),
        (*prefix, "mlp", "linear_0", "kernel"): to_np(layer.linear1.weight.grad).T,
        (*prefix, "mlp", "linear_0", "bias"): to_np(layer.linear1.bias.grad),
        (*prefix, "mlp", "linear_1", "kernel"): to_np(layer.linear2.weight.grad).T,
        (*prefix, "mlp", "linear_1", "bias"): to_np(layer.linear2.bias.grad),
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_block_matches_torch_pre_norm_encoder_layer(dtype):
    """bx.TransformerBlock vs nn.TransformerEncoderLayer(norm_first=True) with a causal
    mask and key padding: outputs, d/dx and d/d all 16 weights."""
    tdt = TORCH_DTYPES[dtype]
    b, t, d, n, f = 2, 5, 8, 2, 12
    layer = _torch_layer(d, n, f, tdt, seed=0)
    rs = np.random.default_rng(0)
    x = rs.standard_normal((b, t, d)).astype(dtype)
    r = rs.standard_normal((b, t, d)).astype(dtype)
    key_mask = np.ones((b, t), bool)
    key_mask[0, -1] = False
    x_t = torch.tensor(x, requires_grad=True)
    causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
    y_t = layer(x_t, src_mask=causal, src_key_padding_mask=torch.tensor(~key_mask))
    (y_t * torch.tensor(r)).sum().backward()

    with dtype_context(dtype):
        g = bx.Graph("net")
        rng = bx.Rng(g / "rng")
        block = bx.TransformerBlock(g / "block", d, n, rng, mlp_size=f, param_dtype=dtype)
        params = layout(block, rng.seed(bx.Params(), seed=0), jnp.zeros((1, 2, d), dtype))
        weights = _layer_weights(("net", "block"), layer)
        params = load_weights(params, weights)

        def run(params, x):
            return block(
                params, x, key_mask=jnp.asarray(key_mask), is_causal=True, is_training=False
            )[0]

        assert_close(jax.jit(run)(params, jnp.asarray(x)), to_np(y_t), dtype, "block output")
        g_params, g_x = jit_grads(
            lambda p, x: jnp.sum(run(p, x) * jnp.asarray(r)), params, jnp.asarray(x)
        )
    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x")
    want = _layer_grads(("net", "block"), layer)
    assert set(g_params.keys()) == set(want)
    for path, value in want.items():
        assert_close(g_params[path].value, value, dtype, "d/d " + "/".join(path[2:]))


def _assert_grad_close(actual, expected, dtype, what):
    """tol(dtype), with atol scaled by the gradient's largest magnitude: the LM's weight
    gradients reach ~10, and float32 sums over two layers carry ~1e-6 of absolute noise
    relative to that scale (rtol stays as in tol(dtype))."""
    t = tol(dtype)
    atol = t["atol"] * max(1.0, float(np.max(np.abs(expected))))
    actual = np.asarray(actual)
    assert actual.dtype == np.dtype(dtype) and actual.shape == np.shape(expected), what
    np.testing.assert_allclose(actual, expected, rtol=t["rtol"], atol=atol, err_msg=what)


class _TorchLM(torch.nn.Module):
    """Decoder-only LM: token embedding + learned positions, pre-norm causal layers,
    final LayerNorm, logits with the tied embedding."""

    def __init__(self, v, d, n, f, num_layers, max_len, tdt):
        super().__init__()
        torch.manual_seed(1)
        self.embed = torch.nn.Embedding(v, d, dtype=tdt)
        self.pos = torch.nn.Parameter(0.1 * torch.randn(max_len, d, dtype=tdt))
        self.layers = torch.nn.ModuleList(
            [_torch_layer(d, n, f, tdt, seed=10 + i) for i in range(num_layers)]
        )
        self.norm = torch.nn.LayerNorm(d, dtype=tdt)

    def forward(self, tokens):
        t = tokens.shape[1]
        h = self.embed(tokens) + self.pos[:t]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool), 1)
        for layer in self.layers:
            h = layer(h, src_mask=causal)
        return self.norm(h) @ self.embed.weight.T


@pytest.mark.parametrize("dtype", DTYPES)
def test_language_model_matches_torch_and_kv_cache_decoding(dtype):
    """bx.TransformerLM (learned positions, tied embeddings, 2 layers) vs _TorchLM: logits
    and d/d every weight; then token-by-token decoding with the KV cache reproduces the
    torch logits at every position (float32)."""
    tdt = TORCH_DTYPES[dtype]
    v, d, n, f, num_layers, max_len = 11, 8, 2, 16, 2, 8
    b, t = 2, 6
    ref = _TorchLM(v, d, n, f, num_layers, max_len, tdt)
    rs = np.random.default_rng(4)
    tokens = rs.integers(0, v, size=(b, t))
    r = rs.standard_normal((b, t, v)).astype(dtype)
    logits_t = ref(torch.tensor(tokens))
    (logits_t * torch.tensor(r)).sum().backward()

    root = ("lm", "model")
    weights = {
        (*root, "embed", "embedding"): to_np(ref.embed.weight),
        (*root, "pos", "embedding"): to_np(ref.pos),
        (*root, "final_norm", "scale"): to_np(ref.norm.weight),
        (*root, "final_norm", "bias"): to_np(ref.norm.bias),
    }
    want = {
        (*root, "embed", "embedding"): to_np(ref.embed.weight.grad),
        (*root, "pos", "embedding"): to_np(ref.pos.grad),
        (*root, "final_norm", "scale"): to_np(ref.norm.weight.grad),
        (*root, "final_norm", "bias"): to_np(ref.norm.bias.grad),
    }
    for i, layer in enumerate(ref.layers):
        weights |= _layer_weights((*root, f"block_{i}"), layer)
        want |= _layer_grads((*root, f"block_{i}"), layer)

    with dtype_context(dtype):
        g = bx.Graph("lm")
        rng = bx.Rng(g / "rng")
        lm = bx.TransformerLM(
            g / "model",
            v,
            d,
            num_layers,
            n,
            rng,
            max_length=max_len,
            position="learned",
            mlp_size=f,
            param_dtype=dtype,
        )
        params = layout(lm, rng.seed(bx.Params(), seed=0), jnp.zeros((1, 2), jnp.int32))
        params = load_weights(params, weights)
        forward = jax.jit(lambda p, tok: lm(p, tok, is_training=False)[0])
        assert_close(forward(params, jnp.asarray(tokens)), to_np(logits_t), dtype, "LM logits")

        def loss(params):
            return jnp.sum(lm(params, jnp.asarray(tokens), is_training=False)[0] * jnp.asarray(r))

        (g_params,) = jit_grads(loss, params)
        assert set(g_params.keys()) == set(want)
        for path, value in want.items():
            _assert_grad_close(g_params[path].value, value, dtype, "d/d " + "/".join(path[2:]))
        if dtype == "float64":
            return
        # KV-cache decoding, one token per jitted call.
        cache = lm.init_cache(params, b, max_len, dtype=dtype)
        step = jax.jit(lambda p, tok: lm(p, tok, decode=True, is_training=False))
        outs = []
        for i in range(t):
            out, cache = step(cache, jnp.asarray(tokens[:, i : i + 1]))
            outs.append(out)
        assert_close(jnp.concatenate(outs, 1), to_np(logits_t), dtype, "decoded logits")
        assert int(lm.cache_index(cache)) == t


def test_rope_rms_gqa_lm_decoding_equals_full_pass():
    """position='rope', RMSNorm, grouped-query heads, untied head: cached decoding equals the
    full causal pass (the training side is exercised by examples/char_lm.py's smoke test)."""
    g = bx.Graph("lm")
    rng = bx.Rng(g / "rng")
    lm = bx.TransformerLM(
        g / "model",
        13,
        16,
        1,
        4,
        rng,
        num_kv_heads=2,
        norm="rms",
        tie_embeddings=False,
        dropout_rate=0.1,
    )
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 13)
    _, params = lm(rng.seed(bx.Params(), seed=0), tokens, is_training=False)
    params = params.locked()
    assert ("lm", "model", "head", "kernel") in params
    full = jax.jit(lambda p, tok: lm(p, tok, is_training=False)[0])(params, tokens)
    cache = lm.init_cache(params, 2, 12)
    step = jax.jit(lambda p, tok: lm(p, tok, decode=True, is_training=False))
    outs = []
    for i in range(9):
        out, cache = step(cache, tokens[:, i : i + 1])
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, 1), full, rtol=2e-5, atol=2e-5)


def _left_padded(prompts, width):
    """Left-pads `prompts` to `width` with token 0; returns (tokens (B, width), mask)."""
    tokens = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :] = p
        mask[i, width - len(p) :] = True
    return tokens, mask


@pytest.mark.parametrize("position", ["rope", "learned", "sinusoidal", "none"])
def test_left_padded_batch_decodes_like_each_prompt_alone(position):
    """Prompts of lengths 5, 2 and 3, left-padded to 5 in one batch with a (B, L) key
    mask: the KV-cache prefill and four decode steps give every row the logits of its
    prompt decoded alone (batch 1, no padding); the full (non-cached) forward pass with a
    (B, T) key mask, too. Positions are per row for every kind."""
    v, d, length, steps = 17, 16, 10, 4
    g = bx.Graph("lm")
    rng = bx.Rng(g / "rng")
    lm = bx.TransformerLM(
        g / "model", v, d, 2, 4, rng, max_length=12, position=position, num_kv_heads=2
    )
    _, params = lm(rng.seed(bx.Params(), seed=0), jnp.zeros((1, 2), jnp.int32))
    params = params.locked()
    rs = np.random.default_rng(7)
    prompts = [rs.integers(1, v, n) for n in (5, 2, 3)]
    follow = rs.integers(1, v, (3, steps))  # the tokens fed after the prompts
    tokens, mask = _left_padded(prompts, 5)
    cache_mask = np.concatenate([mask, np.ones((3, length - 5), bool)], 1)

    step = jax.jit(lambda p, tok, m: lm(p, tok, key_mask=m, decode=True, is_training=False))
    cache = lm.init_cache(params, 3, length)
    prefill, cache = step(cache, jnp.asarray(tokens), jnp.asarray(cache_mask))
    decoded = []
    for s in range(steps):
        out, cache = step(cache, jnp.asarray(follow[:, s : s + 1]), jnp.asarray(cache_mask))
        decoded.append(out[:, 0])
    full, _ = jax.jit(lambda p, tok, m: lm(p, tok, key_mask=m, is_training=False))(
        params, jnp.asarray(tokens), jnp.asarray(mask)
    )

    # Each prompt alone (batch 1, no padding, no key mask), fed one token per call (one
    # compilation; cached decoding equals the full pass, see the tests above).
    alone_step = jax.jit(lambda p, tok: lm(p, tok, decode=True, is_training=False))
    for i, prompt in enumerate(prompts):
        pad, alone, want = 5 - len(prompt), lm.init_cache(params, 1, length), []
        for token in [*prompt, *follow[i]]:
            out, alone = alone_step(alone, jnp.full((1, 1), token, jnp.int32))
            want.append(np.asarray(out[0, 0]))
        n = len(prompt)
        assert_close(prefill[i, pad:], np.stack(want[:n]), "float32", f"row {i} prefill")
        assert_close(full[i, pad:], np.stack(want[:n]), "float32", f"row {i} full pass")
        for s in range(steps):
            assert_close(decoded[s][i], want[n + s], "float32", f"row {i} decode step {s}")


def test_explicit_positions_equal_the_key_mask_default():
    g = bx.Graph("lm")
    rng = bx.Rng(g / "rng")
    lm = bx.TransformerLM(g / "model", 13, 8, 1, 2, rng, max_length=8, position="learned")
    tokens, mask = _left_padded([[3, 4, 5], [6, 7]], 4)
    _, params = lm(rng.seed(bx.Params(), seed=0), jnp.asarray(tokens), is_training=False)
    by_mask, _ = lm(params, jnp.asarray(tokens), key_mask=jnp.asarray(mask), is_training=False)
    explicit = jnp.asarray([[0, 0, 1, 2], [0, 0, 0, 1]])
    np.testing.assert_array_equal(
        lm.row_positions(params, jnp.asarray(tokens), jnp.asarray(mask)), explicit
    )
    by_positions, _ = lm(
        params,
        jnp.asarray(tokens),
        key_mask=jnp.asarray(mask),
        positions=explicit,
        is_training=False,
    )
    np.testing.assert_array_equal(np.asarray(by_positions), np.asarray(by_mask))
    with pytest.raises(ValueError, match=r"'lm/model': positions must be integers of shape"):
        lm(params, jnp.asarray(tokens), positions=jnp.arange(3), is_training=False)
    with pytest.raises(ValueError, match=r"key_mask must be a boolean array of shape \(B, T\)"):
        lm(params, jnp.asarray(tokens), key_mask=jnp.ones((2, 5), bool), is_training=False)
    cache = lm.init_cache(params, 2, 6)
    with pytest.raises(
        ValueError, match=r"key_mask must be a boolean array of shape \(B, L\) = \(2, 6\)"
    ):
        lm(cache, jnp.asarray(tokens), key_mask=jnp.asarray(mask), decode=True)


def test_transformer_errors():
    g = bx.Graph("lm")
    rng = bx.Rng(g / "rng")
    with pytest.raises(ValueError, match=r"'lm/b/attn': num_heads = 3 does not divide model_size"):
        bx.TransformerBlock(g / "b", 8, 3, rng)
    with pytest.raises(ValueError, match=r"'lm/c/norm1': norm must be 'layer'"):
        bx.TransformerBlock(g / "c", 8, 2, rng, norm="batch")
    with pytest.raises(ValueError, match=r"position='learned' needs max_length"):
        bx.TransformerLM(g / "d", 10, 8, 1, 2, rng, position="learned")
    lm = bx.TransformerLM(g / "lm", 10, 8, 1, 2, rng, position="learned", max_length=4)
    params = rng.seed(bx.Params(), seed=0)
    with pytest.raises(ValueError, match=r"TransformerLM 'lm/lm' expects integer tokens of shape"):
        lm(params, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"input has T = 5 positions"):
        lm(params, jnp.ones((1, 5), jnp.int32))
    with pytest.raises(ValueError, match=r"max_length 6 exceeds the 4 learned positions"):
        lm.init_cache(params, 1, 6)
    _, params = lm(params, jnp.ones((1, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"'lm/lm/block_0/attn': KV cache overflow"):
        cache = lm.init_cache(params, 1, 3)
        lm(cache, jnp.ones((1, 4), jnp.int32), decode=True)


# Layers jax-blox 0.1.6 lacks: (graph, defining sizes..., rng) positional, then only
# keywords. jax-blox's own layers keep its positional signatures (test_conv.py checks
# Conv's; Embed and ConvTranspose are listed here).
_POSITIONAL = {
    bx.MultiHeadAttention: ("graph", "model_size", "num_heads", "rng"),
    bx.TransformerBlock: ("graph", "model_size", "num_heads", "rng"),
    bx.TransformerLM: ("graph", "vocab_size", "model_size", "num_layers", "num_heads", "rng"),
    bx.LearnedPositionalEmbedding: ("graph", "max_length", "rng"),
    bx.SinusoidalPositionalEncoding: ("graph",),
    bx.PReLU: ("graph", "num_parameters", "rng"),
    bx.ConvBNSiLU: ("graph", "kernel_size", "output_channels", "rng"),
    bx.Bottleneck: ("graph", "output_channels", "rng"),
    bx.C2f: ("graph", "output_channels", "rng"),
    bx.SPPF: ("graph", "output_channels", "rng"),
    bx.YOLONeck: ("graph", "rng"),
    bx.YOLOBackbone: ("graph", "rng"),
    bx.YOLOBackboneNeck: ("graph", "rng"),
}
_JAX_BLOX = {
    bx.Embed: ("graph num_embeddings embedding_size rng embedding_init embedding_metadata".split()),
    bx.ConvTranspose: (
        "graph kernel_size output_channels rng strides padding kernel_dilation "
        "feature_group_count use_bias kernel_init bias_init kernel_metadata bias_metadata"
    ).split(),
}


def _split_signature(cls):
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]  # drop self
    positional = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
    others = {p.kind for p in params if p.kind is not p.POSITIONAL_OR_KEYWORD}
    return positional, others


@pytest.mark.parametrize("cls", list(_POSITIONAL), ids=lambda c: c.__name__)
def test_options_after_rng_are_keyword_only(cls):
    positional, others = _split_signature(cls)
    assert positional == _POSITIONAL[cls]
    assert others <= {inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.parametrize("cls", list(_JAX_BLOX), ids=lambda c: c.__name__)
def test_jax_blox_layers_keep_their_positional_signatures(cls):
    positional, _ = _split_signature(cls)
    assert positional == tuple(_JAX_BLOX[cls])


def test_old_positional_orders_fail_loudly():
    """Code written for the old orders raises instead of building a different layer."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    # MultiHeadAttention(graph, num_heads=2, model_size=8, rng) in the old order.
    with pytest.raises(ValueError, match=r"num_heads = 8 does not divide model_size = 2"):
        bx.MultiHeadAttention(g / "attn", 2, 8, rng)
    with pytest.raises(TypeError, match=r"positional argument"):
        bx.LearnedPositionalEmbedding(g / "pos", 8, rng, jax.nn.initializers.zeros)
    with pytest.raises(TypeError, match=r"positional argument"):
        bx.SinusoidalPositionalEncoding(g / "sin", 100.0)
    with pytest.raises(TypeError, match=r"'net/act': rng must be a blox Rng or None.*init="):
        bx.PReLU(g / "act", 3, 0.1)  # PyTorch's PReLU(3, 0.1): init is keyword-only
    with pytest.raises(TypeError, match=r"positional argument"):
        bx.ConvBNSiLU(g / "cbs", 3, 16, rng, 2)
    with pytest.raises(TypeError, match=r"positional argument"):
        bx.C2f(g / "c2f", 16, rng, 2)
    with pytest.raises(TypeError, match=r"positional argument"):
        bx.YOLONeck(g / "neck", rng, (8, 16, 32))
