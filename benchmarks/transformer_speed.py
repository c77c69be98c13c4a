"""Transformer speed: a small LM Adam step vs raw JAX, and KV-cache decode per token.

Run (``make bench``)::

    .venv/bin/python benchmarks/transformer_speed.py --out docs/benchmarks.md

(1) Train step: ``bx.TransformerLM`` (learned positions, pre-norm blocks, tied output)
against a hand-written raw-JAX LM on a plain ``{str: array}`` dict with the same math,
in the same run: equal first losses and weights after one Adam step are asserted before
timing; the optimised-HLO FLOPs of both steps are reported. Same-round ratios (see
`_timing.py`).

(2) Decode: one jitted ``lm(params, token, decode=True)`` call per token at several
cache fill levels (the KV cache is a fixed-size buffer, so the per-token time should
stay flat), next to a full forward pass over the same prefix without a cache.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import _timing
import _workloads
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import Contender, CountArgs, Counts, Pair, log

import blox as bx


@dataclass
class Cfg:
    vocab: int
    d: int
    layers: int
    heads: int
    mlp: int
    batch: int
    seq: int
    cache: int
    rounds: int
    steps: int
    warmup: int
    quick: bool


COUNTS = CountArgs(steps=30, warmup=5, quick_steps=3, quick_warmup=1)


def make_cfg(quick: bool, counts: Counts) -> Cfg:
    if quick:
        base = dict(vocab=32, d=32, layers=1, heads=2, mlp=64, batch=2, seq=16, cache=32)
    else:
        base = dict(vocab=96, d=128, layers=2, heads=4, mlp=512, batch=16, seq=64, cache=256)
    return Cfg(**base, **counts._asdict(), quick=quick)


# ---------------------------------------------------------------------------
# Raw JAX: the same LM on a dict
# ---------------------------------------------------------------------------


def _layer_norm(x, scale, bias, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    c = x - mean
    var = jnp.mean(c * c, axis=-1, keepdims=True)
    return c * jax.lax.rsqrt(var + eps) * scale + bias


def raw_forward(p: dict, tokens: jax.Array, cfg: Cfg) -> jax.Array:
    b, t = tokens.shape
    h_dim = cfg.d // cfg.heads
    emb = p["embed/embedding"]
    h = emb.at[tokens].get(mode="fill", fill_value=jnp.nan, wrap_negative_indices=False)
    h = h + p["pos/embedding"][:t]
    for i in range(cfg.layers):
        pre = f"block_{i}/"
        a = _layer_norm(h, p[pre + "norm1/scale"], p[pre + "norm1/bias"])
        q = (a @ p[pre + "attn/query/kernel"] + p[pre + "attn/query/bias"]).reshape(
            b, t, cfg.heads, h_dim
        )
        k = (a @ p[pre + "attn/key/kernel"] + p[pre + "attn/key/bias"]).reshape(
            b, t, cfg.heads, h_dim
        )
        v = (a @ p[pre + "attn/value/kernel"] + p[pre + "attn/value/bias"]).reshape(
            b, t, cfg.heads, h_dim
        )
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, cfg.d)
        h = h + (o @ p[pre + "attn/out/kernel"] + p[pre + "attn/out/bias"])
        m = _layer_norm(h, p[pre + "norm2/scale"], p[pre + "norm2/bias"])
        m = jax.nn.gelu(m @ p[pre + "mlp/linear_0/kernel"] + p[pre + "mlp/linear_0/bias"])
        h = h + (m @ p[pre + "mlp/linear_1/kernel"] + p[pre + "mlp/linear_1/bias"])
    h = _layer_norm(h, p["final_norm/scale"], p["final_norm/bias"])
    return jnp.einsum("btd,vd->btv", h, emb)


def xent(logits: jax.Array, targets: jax.Array) -> jax.Array:
    ll = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(ll, targets[..., None], axis=-1))


# ---------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------


def build_lm(cfg: Cfg, max_length: int):
    g = bx.Graph("lm")
    rng = bx.Rng(g / "rng")
    lm = bx.TransformerLM(
        g / "model",
        cfg.vocab,
        cfg.d,
        cfg.layers,
        cfg.heads,
        rng,
        max_length=max_length,
        position="learned",
        mlp_size=cfg.mlp,
    )
    return rng, lm


def train_workload(cfg: Cfg, log) -> tuple[list[Contender], list[Pair], list[str], list]:
    tx = optax.adam(1e-3)
    rs = np.random.default_rng(0)
    data = jnp.asarray(rs.integers(0, cfg.vocab, size=(cfg.batch, cfg.seq + 1)), jnp.int32)
    x, y = data[:, :-1], data[:, 1:]

    rng, lm = build_lm(cfg, cfg.seq)
    params = rng.seed(bx.Params(), seed=0)
    _, params = lm(params, x, is_training=False)
    params = params.locked()

    def b_loss(t, nt, x, y):
        logits, p = lm(t.merge(nt), x, is_training=True)
        return xent(logits, y), p.split()[1]

    def b_step(params, opt, x, y):
        t, nt = params.split()
        (loss, nt), g = jax.value_and_grad(b_loss, has_aux=True)(t, nt, x, y)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt = tx.update(g, opt, t)
            t = optax.apply_updates(t, updates)
        return t.merge(nt), opt, loss

    prefix = ("lm", "model")
    paths = {"/".join(path[2:]): path for path in params.keys() if path[:2] == prefix}
    raw = _workloads.raw_dict(params, paths)
    assert len(raw) == len(params.split()[0]), (len(raw), len(params.split()[0]))

    def r_step(p, opt, x, y):
        loss, g = jax.value_and_grad(lambda p: xent(raw_forward(p, x, cfg), y))(p)
        with jax.numpy_dtype_promotion("standard"):
            updates, opt = tx.update(g, opt, p)
            p = optax.apply_updates(p, updates)
        return p, opt, loss

    b_state, r_state = _workloads.fresh_states(tx, params, raw)

    # Compiled once each; the executables give the FLOPs and run the checks and timing.
    b_jit = jax.jit(b_step, donate_argnums=(0, 1)).lower(*b_state(), x, y).compile()
    r_jit = jax.jit(r_step, donate_argnums=(0, 1)).lower(*r_state(), x, y).compile()

    bl, rl, w_diff = _workloads.assert_same_step(b_jit, r_jit, b_state, r_state, x, y, paths)
    checks = [
        f"LM train step: first loss blox {bl:.9g}, raw {rl:.9g} (|diff| {abs(bl - rl):.1e}); "
        f"max |weight diff| after one Adam step {w_diff:.1e}; {len(raw)} trainable leaves "
        f"(blox params also hold the Rng seed and counter)"
    ]
    flops = [("LM train step", _timing.compiled_flops(b_jit), _timing.compiled_flops(r_jit))]
    nb, nr = _timing.count_transposes(b_jit), _timing.count_transposes(r_jit)
    checks.append(
        f"transpose ops in the optimised HLO of the step: blox {nb}, raw {nr}"
        + (" (equal)" if nb == nr else " (DIFFERENT)")
    )

    contenders = [
        _workloads.stepper("blox", b_jit, *b_state(), x, y),
        _workloads.stepper("raw", r_jit, *r_state(), x, y),
    ]
    pairs = [Pair("LM train step (donated)", "blox", "raw", target=1.03)]
    for c in checks:
        log(f"   check: {c}")
    return contenders, pairs, checks, flops


def decode_workload(cfg: Cfg) -> tuple[list[Contender], list[int], list[str]]:
    rng, lm = build_lm(cfg, cfg.cache)
    tokens = jnp.asarray(
        np.random.default_rng(1).integers(0, cfg.vocab, size=(1, cfg.cache)), jnp.int32
    )
    params = rng.seed(bx.Params(), seed=0)
    _, params = lm(params, tokens[:, :2], is_training=False)
    params = lm.init_cache(params.locked(), 1, cfg.cache)
    # Fill the cache once with real keys/values (a full prefill), then time one decode call
    # at each fill level by setting the cache index.
    _, filled = jax.jit(lambda p, t: lm(p, t, decode=True, is_training=False))(
        params, tokens[:, : cfg.cache - 1]
    )
    step = jax.jit(lambda p, t: lm(p, t, decode=True, is_training=False))
    full = jax.jit(lambda p, t: lm(p, t, is_training=False)[0])
    fills = [1, cfg.cache // 4, cfg.cache // 2, 3 * cfg.cache // 4, cfg.cache - 1]
    fills = sorted(set(fills[::2] if cfg.quick else fills))
    contenders = []
    for f in fills:
        p = filled
        for block in lm.blocks:
            p = block.attn.set_param(p, "cache_index", jnp.asarray(f - 1, jnp.int32))
        tok = tokens[:, f - 1 : f]

        def call(p=p, tok=tok):
            logits, _ = step(p, tok)
            return logits

        contenders.append(Contender(f"decode@{f}", call))
        prefix = tokens[:, :f]
        contenders.append(Contender(f"full@{f}", lambda prefix=prefix: full(params, prefix)))
    notes = [
        f"one sequence, KV cache of L = {cfg.cache} positions per layer; a decode call embeds "
        "one token, writes its keys/values at the cache index (`dynamic_update_slice`) and "
        "attends over the whole fixed-size buffer with a mask."
    ]
    return contenders, fills, notes


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    COUNTS.add_to(ap, quick_help="tiny sizes and counts (smoke test)")
    args = ap.parse_args(argv)
    cfg = make_cfg(args.quick, COUNTS.resolve(ap, args))
    started, env, command = _timing.start_run("transformer speed")

    t0 = time.perf_counter()
    log("\n== LM train step")
    contenders, pairs, checks, flops = train_workload(cfg, log)
    results = _timing.run_rounds(contenders, cfg.rounds, cfg.steps, cfg.warmup)
    pairs = _timing.compare(results, pairs)
    log(f"   done in {time.perf_counter() - t0:.1f}s")

    t0 = time.perf_counter()
    log("\n== KV-cache decode")
    dec, fills, notes = decode_workload(cfg)
    dec_results = _timing.run_rounds(dec, cfg.rounds, cfg.steps, cfg.warmup)
    log(f"   done in {time.perf_counter() - t0:.1f}s")

    report = render(env, command, started, cfg, pairs, checks, flops, dec_results, fills, notes)
    _timing.publish(report, args.out, "transformer_speed")
    return 0


def render(env, command, started, cfg, pairs, checks, flops, dec_results, fills, notes) -> str:
    rows = [
        _timing.ratio_row(p, primary="min", us_digits=0, target_suffix=" (min-based)")
        for p in pairs
    ]
    dec_rows = []
    first = f"decode@{fills[0]}"
    for f in fills:
        med = statistics.median(r[f"decode@{f}"].median for r in dec_results)
        mn = statistics.median(r[f"decode@{f}"].min for r in dec_results)
        rel = statistics.median(r[f"decode@{f}"].min / r[first].min for r in dec_results)
        full = statistics.median(r[f"full@{f}"].min for r in dec_results)
        dec_rows.append(
            [f, f"{1e6 * med:.0f}", f"{1e6 * mn:.0f}", f"{rel:.3f}x", f"{1e6 * full:.0f}"]
        )
    lines = [
        "## Transformer: LM train step vs raw JAX, KV-cache decoding",
        "",
        *_timing.run_header(env, started, command),
        f"- Model: vocab {cfg.vocab}, width {cfg.d}, {cfg.layers} pre-norm blocks, "
        f"{cfg.heads} heads, MLP {cfg.mlp}, learned positions, tied output; batch "
        f"{cfg.batch} x {cfg.seq} tokens, next-token cross-entropy, Adam. {cfg.rounds} rounds "
        f"of {cfg.warmup} warm-up + {cfg.steps} timed calls per contender, interleaved"
        + (". QUICK smoke run: sizes shrunk, numbers meaningless." if cfg.quick else "."),
        "",
        "### LM train step",
        "",
        "blox: `bx.TransformerLM` with the split/grad/merge step; raw: the same math "
        "hand-written on a `{str: array}` dict (`raw_forward` in the script: the same "
        "`jax.nn.dot_product_attention`, LayerNorm with `rsqrt`, tanh-GELU, tied "
        "`einsum` logits, and the same NaN-filling token lookup). Both jitted with "
        "`donate_argnums=(0, 1)`.",
        "",
        _timing.format_table(
            [
                "workload",
                "blox us/step",
                "raw us/step",
                "ratio of minima",
                "ratio of medians",
                "per-round ratios",
                "target",
                "verdict",
            ],
            rows,
        ),
        "",
        "### Optimised-HLO FLOPs",
        "",
        _timing.format_table(
            ["workload", "blox FLOPs", "raw FLOPs", "equal"],
            [[k, f"{b:.0f}", f"{r:.0f}", "yes" if b == r else "NO"] for k, b, r in flops],
        ),
        "",
        *_timing.same_math_section(checks),
        "### KV-cache decode: per-token time vs cache fill",
        "",
        *[f"- {n}" for n in notes],
        "",
        _timing.format_table(
            [
                "cached tokens",
                "decode us/token (median)",
                "decode us/token (min)",
                f"min vs fill {fills[0]}",
                "full forward over the prefix, no cache (us, min)",
            ],
            dec_rows,
        ),
        "",
        "The decode time stays flat as the cache fills (the work is fixed by the buffer "
        "size); recomputing the prefix without a cache grows with its length.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
