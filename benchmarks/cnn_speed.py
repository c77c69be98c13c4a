"""CNN train step: blox (`Conv`, `max_pool`, `Linear`) vs hand-written raw JAX.

Run (``make bench``)::

    .venv/bin/python benchmarks/cnn_speed.py --out docs/benchmarks.md

Workload: batch 64 of 28x28x1 images, conv 3x3 -> 32, ReLU, 2x2 max-pool,
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
import sys
import time

import _timing
import _workloads
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import CountArgs, Pair, log
from _workloads import stepper
from jax import lax

import blox as bx

TARGET = 1.03
NAMES = ("conv1", "conv2", "head")
COUNTS = CountArgs(steps=50, warmup=5, quick_steps=3, quick_warmup=1)


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
    paths = {f"{n}/{w}": ("net", "cnn", n, w) for n in NAMES for w in ("kernel", "bias")}
    raw = _workloads.raw_dict(params, paths)
    assert len(params.split()[0]) == len(raw)
    b_state, r_state = _workloads.fresh_states(tx, params, raw)

    # Compile each step once (AOT) and time the compiled executables themselves.
    b_jit = jax.jit(blox_step(model, tx)).lower(*b_state(), x, y).compile()
    r_jit = jax.jit(raw_step(tx)).lower(*r_state(), x, y).compile()
    b_loss, r_loss, w_diff = _workloads.assert_same_step(
        b_jit, r_jit, b_state, r_state, x, y, paths
    )
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    COUNTS.add_to(ap, quick_help="tiny counts and batch (smoke test)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default 64; quick 8)")
    args = ap.parse_args(argv)
    rounds, steps, warmup = COUNTS.resolve(ap, args)
    batch = args.batch or (8 if args.quick else 64)
    if batch < 1:
        ap.error("--batch must be positive")

    started, env, command = _timing.start_run("blox CNN speed")
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
    _timing.publish(report, args.out, "cnn_speed")
    return 0


def render(env, command, started, rounds, steps, warmup, batch, quick, pairs, checks, flops,
           transposes) -> str:  # fmt: skip
    rows = [_timing.ratio_row(p, primary="min", us_digits=0) for p in pairs]
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
        _timing.counts_bullet(
            rounds,
            steps,
            warmup,
            "interleaved in a random order per cycle",
            "batch and counts shrunk, numbers meaningless" if quick else None,
        ),
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
        *_timing.same_math_section(checks),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
