"""CNN train step: blox (`Conv`, `max_pool`, `Linear`) vs hand-written raw JAX.

Run (``make bench``)::

    .venv/bin/python benchmarks/cnn_speed.py --out docs/benchmarks.md

Workload (issue 5): batch 64 of 28x28x1 images, conv 3x3 -> 32, ReLU, 2x2 max-pool,
conv 3x3 -> 64, ReLU, 2x2 max-pool, dense -> 10, softmax cross-entropy, one Adam step.
blox runs the documented split/grad/merge step on a `bx.Params`; raw JAX runs the same
math on a ``{str: array}`` dict with ``lax.conv_general_dilated`` (NHWC / HWIO, 'SAME'),
``lax.reduce_window`` (max, ``-inf`` init) and ``jnp.dot``. Before timing the script
asserts equal first losses and equal weights after one Adam step, and it reports the
optimised-HLO FLOPs and the number of ``transpose`` instructions of both compiled steps
(the default channels-last layout must add none). Timing is same-round, interleaved, in a
random order per cycle (see ``_timing.py``); the target is on the ratio of per-round minima.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time

import _raw
import _timing
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import Pair
from _workloads import stepper
from jax import lax

import blox as bx

TARGET = 1.03
NAMES = ("conv1", "conv2", "head")


# ---------------------------------------------------------------------------
# The model, both ways
# ---------------------------------------------------------------------------


class SmallCNN(bx.Module):
    """conv 32 -> ReLU -> max-pool -> conv 64 -> ReLU -> max-pool -> dense 10."""

    def __init__(self, graph: bx.Graph, rng: bx.Rng, num_classes: int = 10):
        super().__init__(graph)
        self.conv1 = bx.Conv(graph / "conv1", (3, 3), 32, rng)
        self.conv2 = bx.Conv(graph / "conv2", (3, 3), 64, rng)
        self.head = bx.Linear(graph / "head", num_classes, rng)

    def __call__(self, params: bx.Params, x: jax.Array) -> tuple[jax.Array, bx.Params]:
        x, params = self.conv1(params, x)
        x = bx.max_pool(jax.nn.relu(x), (2, 2))
        x, params = self.conv2(params, x)
        x = bx.max_pool(jax.nn.relu(x), (2, 2))
        return self.head(params, x.reshape(x.shape[0], -1))


def raw_forward(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The same network by hand on a dict (NHWC activations, HWIO kernels)."""
    dn = ("NHWC", "HWIO", "NHWC")
    for name in ("conv1", "conv2"):
        x = lax.conv_general_dilated(x, p[name + "/kernel"], (1, 1), "SAME", dimension_numbers=dn)
        x = jax.nn.relu(x + p[name + "/bias"])
        x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    x = x.reshape(x.shape[0], -1)
    return jnp.dot(x, p["head/kernel"]) + p["head/bias"]


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def blox_step(model: SmallCNN, tx: optax.GradientTransformation):
    def loss_fn(t, nt, x, y):
        logits, p = model(t.merge(nt), x)
        return cross_entropy(logits, y), p.split()[1]

    def step(params, opt_state, x, y):
        t, nt = params.split()
        (loss, nt2), g = jax.value_and_grad(loss_fn, has_aux=True)(t, nt, x, y)
        updates, opt_state = tx.update(g, opt_state, t)
        return optax.apply_updates(t, updates).merge(nt2), opt_state, loss

    return step


def raw_step(tx: optax.GradientTransformation):
    def loss_fn(p, x, y):
        return cross_entropy(raw_forward(p, x), y)

    def step(p, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        updates, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    return step


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------


def analyse(compiled) -> tuple[float, int]:
    """Optimised-HLO FLOPs (as ``_timing.flops``) and ``transpose`` instructions of a
    compiled step."""
    return _timing.compiled_flops(compiled), _timing.count_transposes(compiled)


def build(batch_size: int, donate: bool):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((batch_size, 28, 28, 1), dtype=np.float32))
    y = jnp.asarray(r.integers(0, 10, size=(batch_size,)), dtype=jnp.int32)
    tx = optax.adam(1e-3)

    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    model = SmallCNN(g / "cnn", rng)
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, x)
    params = params.locked()
    raw = {
        f"{n}/{w}": jnp.array(params[("net", "cnn", n, w)].value, copy=True)
        for n in NAMES
        for w in ("kernel", "bias")
    }
    assert len(params.split()[0]) == len(raw)

    def b_state():
        p = _raw.copy_tree(params)
        return p, tx.init(p.split()[0])

    def r_state():
        p = _raw.copy_tree(raw)
        return p, tx.init(p)

    # Compile each step once (AOT) and time the compiled executables themselves.
    b_jit = jax.jit(blox_step(model, tx)).lower(*b_state(), x, y).compile()
    r_jit = jax.jit(raw_step(tx)).lower(*r_state(), x, y).compile()
    bp, _, b_loss = b_jit(*b_state(), x, y)
    rp, _, r_loss = r_jit(*r_state(), x, y)
    b_loss, r_loss = float(b_loss), float(r_loss)
    np.testing.assert_allclose(b_loss, r_loss, rtol=1e-6, atol=1e-6)
    w_diff = max(
        float(jnp.max(jnp.abs(bp[("net", "cnn", *k.split("/"))].value - rp[k]))) for k in raw
    )
    assert w_diff <= 1e-6, w_diff
    checks = [
        f"first loss: blox {b_loss:.9g}, raw {r_loss:.9g} (|diff| {abs(b_loss - r_loss):.1e}); "
        f"max |weight diff| after one Adam step {w_diff:.1e}; leaves: blox {len(params)} "
        f"({len(raw)} trainable + Rng seed and counter), raw {len(raw)}"
    ]
    (b_flops, b_tr), (r_flops, r_tr) = analyse(b_jit), analyse(r_jit)
    flops, transposes = (b_flops, r_flops), (b_tr, r_tr)
    assert flops[0] == flops[1], flops
    assert transposes[0] <= transposes[1], transposes
    contenders = [
        stepper("blox", b_jit, *b_state(), x, y),
        stepper("raw", r_jit, *r_state(), x, y),
    ]
    pairs = [Pair("CNN train step", "blox", "raw", TARGET)]
    if donate:
        b_don = jax.jit(blox_step(model, tx), donate_argnums=(0, 1))
        r_don = jax.jit(raw_step(tx), donate_argnums=(0, 1))
        b_don = b_don.lower(*b_state(), x, y).compile()
        r_don = r_don.lower(*r_state(), x, y).compile()
        contenders += [
            stepper("blox+donate", b_don, *b_state(), x, y),
            stepper("raw+donate", r_don, *r_state(), x, y),
        ]
        pairs.append(Pair("CNN train step, donated", "blox+donate", "raw+donate", TARGET))
    return contenders, pairs, checks, flops, transposes


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def log(msg: str) -> None:
    print(msg, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 10; quick 2)")
    ap.add_argument("--steps", type=int, default=None, help="timed calls per round (default 50)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per round (default 5)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default 64; quick 8)")
    ap.add_argument("--quick", action="store_true", help="tiny counts and batch (smoke test)")
    ap.add_argument("--out", default=None, help="markdown file whose section is (re)written")
    args = ap.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 10)
    steps = args.steps or (3 if args.quick else 50)
    warmup = args.warmup or (1 if args.quick else 5)
    batch = args.batch or (8 if args.quick else 64)
    if min(rounds, steps, warmup, batch) < 1:
        ap.error("--rounds, --steps, --warmup and --batch must be positive")

    started = datetime.datetime.now(datetime.UTC)
    env = _timing.environment()
    command = _timing.command_line()
    log(f"blox CNN speed: {command}")
    log(f"{env['nproc']} CPUs ({env['cpu']}), {env['backend']}; jax {env['jax']}")
    t0 = time.perf_counter()
    contenders, pairs, checks, flops, transposes = build(batch, donate=not args.quick)
    log(f"built and checked in {time.perf_counter() - t0:.1f}s; {checks[0]}")
    log(f"HLO FLOPs blox {flops[0]:.0f} raw {flops[1]:.0f}; transposes {transposes}")
    results = _timing.run_rounds(contenders, rounds, steps, warmup)
    for p in _timing.compare(results, pairs):
        verdict = "PASS" if p.min_ratio <= TARGET else "FAIL"
        log(
            f"{p.name}: {p.num_us:.0f} vs {p.den_us:.0f} us/call, min-based ratio "
            f"{p.min_ratio:.3f}x (median-based {p.median_ratio:.3f}x) target <= {TARGET}x "
            f"{verdict}; per round: " + " ".join(f"{r:.3f}" for r in p.round_ratios)
        )
    report = render(env, command, started, rounds, steps, warmup, batch, args.quick, pairs,
                    checks, flops, transposes)  # fmt: skip
    log("\n" + report)
    if args.out:
        _timing.write_section(args.out, "cnn_speed", report, "Benchmarks")
        log(f"wrote {args.out}")
    return 0


def render(env, command, started, rounds, steps, warmup, batch, quick, pairs, checks, flops,
           transposes) -> str:  # fmt: skip
    rows = []
    for p in pairs:
        rows.append(
            [
                p.name,
                f"{p.num_us:.0f}",
                f"{p.den_us:.0f}",
                f"**{p.min_ratio:.3f}x**",
                f"{p.median_ratio:.3f}x",
                f"{min(p.round_ratios):.3f} - {max(p.round_ratios):.3f}",
                f"<= {TARGET:.2f}x",
                "PASS" if p.min_ratio <= TARGET else "FAIL",
            ]
        )
    header = [
        "workload",
        "blox us/call",
        "raw us/call",
        "ratio of minima",
        "ratio of medians",
        "per-round ratios (min - max)",
        "target",
        "verdict",
    ]
    lines = [
        "## CNN train step: blox vs raw JAX",
        "",
        *_timing.run_header(env, started, command),
        f"- Workload: batch {batch} of 28x28x1, conv 3x3 -> 32, ReLU, 2x2 max-pool, conv 3x3 "
        "-> 64, ReLU, 2x2 max-pool, dense -> 10, softmax cross-entropy, Adam (1e-3); float32, "
        "channels-last. blox: `bx.Conv`, `bx.max_pool`, `bx.Linear` in a `bx.Module`, the "
        "split/grad/merge step; raw: `lax.conv_general_dilated` (NHWC/HWIO, 'SAME'), "
        "`lax.reduce_window` (max), `jnp.dot` on a `{str: array}` dict.",
        f"- {rounds} rounds; per round and contender {warmup} warm-up calls, then {steps} "
        "timed calls, interleaved in a random order per cycle"
        + (". QUICK smoke run: batch and counts shrunk, numbers meaningless." if quick else "."),
        "",
        _timing.format_table(header, rows),
        "",
        "us/call: median over rounds of the per-round median. Ratio of minima: median over "
        "rounds of blox's per-round minimum over raw's (the target applies to it); ratio of "
        "medians: the same with per-round medians.",
        "",
        _timing.format_table(
            ["compiled train step", "blox", "raw", "equal"],
            [
                [
                    "optimised-HLO FLOPs",
                    f"{flops[0]:.0f}",
                    f"{flops[1]:.0f}",
                    "yes" if flops[0] == flops[1] else "NO",
                ],
                [
                    "`transpose` instructions",
                    str(transposes[0]),
                    str(transposes[1]),
                    "yes" if transposes[0] == transposes[1] else "NO",
                ],
            ],
        ),  # fmt: skip
        "",
        "FLOPs from `jax.jit(step).lower(*args).compile().cost_analysis()` (as "
        "`_timing.flops`); transposes counted in that executable's `as_text()`. Both "
        "contenders are timed as those AOT-compiled executables"
        + ("" if quick else "; the donated variants use `donate_argnums=(0, 1)`")
        + ".",
        "",
        "### Same-math checks",
        "",
    ]
    lines += [f"- {c}" for c in checks] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
