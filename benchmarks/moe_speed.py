"""Mixture of experts: the `bx.MoE` layer step against the same math written densely and
against a dense MLP of the same active parameters (one device).

Run::

    .venv/bin/python benchmarks/moe_speed.py --out docs/benchmarks.md

For each E in {8, 32} experts and k in {1, 2} experts per token, one forward and
backward step (gradients of ``sum(y * c)`` with respect to every parameter) of:

* **moe**: ``bx.MoE(E, F, top_k=k)``, dropless: each token's k chosen experts only, the
  tokens sorted by expert and multiplied by the tiled grouped matmul (XLA:CPU);
* **moe ragged_dot**: the same layer through ``jax.lax.ragged_dot`` (what it runs on
  other backends; XLA:CPU runs it as about one full matmul per expert);
* **loop**: the same math in plain JAX, a Python loop over the E experts, each run on
  every token and weighted by its gate (0 where the token did not choose it): E / k
  times the expert FLOPs, the cost of writing an MoE without grouped matmuls;
* **dense**: a SwiGLU MLP of hidden size k F, so the same active parameters (and expert
  FLOPs) per token as the MoE, without a router or a dispatch.

Before timing, the script asserts that moe and loop give the same outputs and gradients
(rtol 1e-4). Reported: us per call, tokens per second, and the same-round ratios
moe / loop and moe / dense (median over rounds of per-round minima; the median ratio
too). Timing is same-round and interleaved (``_timing.py``).
"""

from __future__ import annotations

import sys

import _timing
import jax
import jax.numpy as jnp
import numpy as np
from _timing import Contender, CountArgs, Pair, log

import blox as bx
from blox.nn import _moe

COUNTS = CountArgs(steps=10, warmup=2, quick_steps=2, quick_warmup=1, rounds=5)
CONFIGS = [(8, 1), (8, 2), (32, 1), (32, 2)]


def build(e: int, k: int, tokens: int, d: int, f: int):
    """The three contenders for E = `e`, k = `k` and a same-math check line."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    moe = bx.MoE(g / "moe", e, f, rng, top_k=k)
    r = np.random.default_rng(e * 10 + k)
    x = jnp.asarray(r.standard_normal((tokens, d)), jnp.float32)
    c = jnp.asarray(r.standard_normal((tokens, d)), jnp.float32)
    _, params = moe(rng.seed(bx.Params(), seed=0), x)
    arr = {"/".join(p[2:]): v for p, v in params.split()[0].arrays().items()}
    w = {n: arr[n] for n in ("router/kernel", "experts/gate", "experts/up", "experts/down")}
    dense = {
        "gate": jnp.asarray(r.standard_normal((d, k * f)) / np.sqrt(d), jnp.float32),
        "up": jnp.asarray(r.standard_normal((d, k * f)) / np.sqrt(d), jnp.float32),
        "down": jnp.asarray(r.standard_normal((k * f, d)) / np.sqrt(k * f), jnp.float32),
    }

    def moe_objective(w, x):
        p = params
        for name, v in w.items():
            p = p.unlocked()
            p[("net", "moe", *name.split("/"))] = bx.Param(v)
        (y, _), _ = moe(p, x)
        return jnp.sum(y * c), y

    def loop_objective(w, x):
        probs = jax.nn.softmax(
            jnp.dot(x, w["router/kernel"], precision=jax.lax.Precision.HIGHEST), axis=-1
        )
        _, chosen = jax.lax.top_k(jax.lax.stop_gradient(probs), k)
        mask = jnp.sum(jax.nn.one_hot(chosen, e, dtype=x.dtype), axis=1)  # (N, E)
        gates = probs * mask
        y = jnp.zeros_like(x)
        for i in range(e):  # every expert on every token
            h = jax.nn.silu(x @ w["experts/gate"][i]) * (x @ w["experts/up"][i])
            y = y + gates[:, i : i + 1] * (h @ w["experts/down"][i])
        return jnp.sum(y * c), y

    def dense_objective(w, x):
        y = (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]
        return jnp.sum(y * c), y

    steps = {}
    for name, fn, weights in (
        ("moe", moe_objective, w),
        ("moe ragged_dot", moe_objective, w),
        ("loop", loop_objective, w),
        ("dense", dense_objective, dense),
    ):
        step = jax.jit(jax.value_and_grad(fn, has_aux=True))
        steps[name] = (step, weights)
    limit = _moe._TILED_MAX_BYTES
    _moe._TILED_MAX_BYTES = 0  # compiled now, with ragged_dot; later calls reuse it
    try:
        (_, y_r), g_r = steps["moe ragged_dot"][0](w, x)
    finally:
        _moe._TILED_MAX_BYTES = limit
    (_, y_m), g_m = steps["moe"][0](w, x)
    (_, y_l), g_l = steps["loop"][0](w, x)
    for y, grads in ((y_l, g_l), (y_r, g_r)):
        np.testing.assert_allclose(np.asarray(y_m), np.asarray(y), rtol=1e-4, atol=1e-5)
        for n in w:
            np.testing.assert_allclose(
                np.asarray(g_m[n]), np.asarray(grads[n]), rtol=1e-4, atol=1e-5, err_msg=n
            )
    check = (
        f"E={e}, k={k}: moe, moe ragged_dot and loop outputs and all gradients agree (rtol 1e-4)"
    )
    contenders = [
        Contender(f"{name} E={e} k={k}", lambda s=s, p=p: s(p, x)[0][0])
        for name, (s, p) in steps.items()
    ]
    return contenders, check


def main(argv: list[str] | None = None) -> int:
    args, counts = COUNTS.parse(argv, __doc__, "tiny counts and shapes (smoke test)")
    started, env, command = _timing.start_run("blox MoE speed")
    tokens, d, f = (64, 16, 32) if args.quick else (1024, 64, 128)
    contenders, checks = [], []
    with jax.default_matmul_precision("highest"):
        for e, k in CONFIGS:
            c, check = build(e, k, tokens, d, f)
            contenders += c
            checks.append(check)
            log(check)
        results = _timing.run_rounds(contenders, *counts)
    pairs = []
    for e, k in CONFIGS:
        tag = f"E={e} k={k}"
        pairs += [
            Pair(f"moe / loop, {tag}", f"moe {tag}", f"loop {tag}"),
            Pair(f"moe / dense, {tag}", f"moe {tag}", f"dense {tag}"),
            Pair(f"moe / moe ragged_dot, {tag}", f"moe {tag}", f"moe ragged_dot {tag}"),
        ]
    pairs = _timing.compare_and_log(results, pairs)
    rows = []
    for i, (e, k) in enumerate(CONFIGS):
        loop, dense, ragged = pairs[3 * i : 3 * i + 3]
        per_s = lambda us: f"{tokens / us * 1e6:,.0f}"  # noqa: E731
        rows.append(
            [
                e,
                k,
                f"{loop.num_us:,.0f}",
                per_s(loop.num_us),
                f"{loop.den_us:,.0f}",
                per_s(loop.den_us),
                f"{dense.den_us:,.0f}",
                per_s(dense.den_us),
                f"**{loop.min_ratio:.3f}x** ({loop.median_ratio:.3f}x)",
                f"**{dense.min_ratio:.3f}x** ({dense.median_ratio:.3f}x)",
                f"{ragged.den_us:,.0f}",
                f"**{ragged.min_ratio:.3f}x** ({ragged.median_ratio:.3f}x)",
            ]
        )
    header = [
        "E",
        "k",
        "moe us",
        "moe tokens/s",
        "loop us",
        "loop tokens/s",
        "dense us",
        "dense tokens/s",
        "moe / loop",
        "moe / dense",
        "ragged_dot us",
        "moe / ragged_dot",
    ]
    quick = "shapes and counts shrunk, numbers meaningless" if args.quick else None
    lines = [
        *_timing.report_head(
            "Mixture of experts: MoE layer vs loop vs dense", env, started, command, counts, quick
        ),  # fmt: skip
        f"One forward + backward step (gradients of `sum(y * c)` for every parameter) on one "
        f"device, {tokens} tokens of width D={d}, SwiGLU experts of hidden size F={f}: "
        "**moe** `bx.MoE(E, F, top_k=k)` dropless (the tokens sorted by expert, the tiled "
        "grouped matmul it runs on XLA:CPU); **ragged_dot** the same layer through "
        "`jax.lax.ragged_dot` (its path on other backends); **loop** the same math by "
        "hand, every expert on every token weighted by its gate (0 where not chosen); "
        "**dense** a SwiGLU MLP of hidden size k F (the same active parameters per token). "
        "Ratios: median over rounds of the per-round minima (of the medians in brackets); "
        "below 1 the MoE is faster.",
        "",
        _timing.format_table(header, rows),
        "",
        *_timing.same_math_section(checks),
    ]
    _timing.publish("\n".join(lines), args.out, "moe_speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
