"""Train-step helpers of `blox.train` against raw JAX on a plain ``{str: array}`` dict.

Run (part of ``make bench``)::

    .venv/bin/python benchmarks/train_step.py --out docs/benchmarks.md

Workload: tiny MLP 32->64->64->10 (``bx.MLP``), batch 32, MSE, Adam, every step jitted
with ``donate_argnums=(0, 1)``. Contenders, timed in the same rounds:

* raw: ``jax.value_and_grad`` + Optax on a dict (``_raw.train_step``); the (a) and (b)
  pairs are also timed without donation, against raw without donation;
* (a) the hand-written split/grad/merge step (``_workloads.split_merge_step``);
* (b) ``bx.make_train_step(loss_fn, tx)``;
* (c) ``bx.steps_per_dispatch(bx.make_train_step(...), 10)``: one call = 10 steps, against
  "raw x10": 10 raw step calls in a row (dispatched asynchronously, waited for once), so
  the same-round ratio is per step.

Before timing, all contenders are checked to do the same math (equal losses and weights).
Method and ratios as in ``core_overhead.py`` (see ``_timing.py``).
"""

from __future__ import annotations

import sys

import _raw
import _timing
import _workloads
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import Contender, CountArgs, Counts, Pair, log

import blox as bx

K = 10
NAMES = ("linear_0", "linear_1", "linear_2")
PATH = ("net", "mlp")
# 20 rounds: per-round ratios of this ~270 us step spread over +-4 % on a shared 2-core
# machine, so 10 rounds left the median about 1 % uncertain against a 1.05x target.
COUNTS = CountArgs(steps=200, warmup=20, quick_steps=5, quick_warmup=2, rounds=20)


def build():
    x, y = _raw.batch(32, 32, 10)
    tx = optax.adam(1e-3)
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    model = bx.MLP(g / "mlp", (64, 64, 10), rng)
    params = model(rng.seed(bx.Params(), seed=0), x)[1].locked()
    raw = {
        f"{n}/{w}": jnp.array(params[(*PATH, n, w)].value, copy=True)
        for n in NAMES
        for w in ("kernel", "bias")
    }

    def loss_fn(p, x, y):
        y_hat, p = model(p, x)
        return bx.mse(y_hat, y), p

    hand = jax.jit(_workloads.split_merge_step(model, tx), donate_argnums=(0, 1))
    helper_fn = bx.make_train_step(loss_fn, tx)
    helper = jax.jit(helper_fn, donate_argnums=(0, 1))
    multi = jax.jit(bx.steps_per_dispatch(helper_fn, K), donate_argnums=(0, 1))
    raw_step = jax.jit(_raw.train_step(NAMES, tx), donate_argnums=(0, 1))
    xs, ys = jnp.stack([x] * K), jnp.stack([y] * K)

    b_state, r_state = _workloads.fresh_states(tx, params, raw)

    # Same math: one step of (a), (b) and raw; K steps of (c) and raw.
    checks = []
    rp, ro, r_loss = raw_step(*r_state(), x, y)
    for name, fn in (("(a)", hand), ("(b)", lambda p, o, x, y: _unpack(helper(p, o, x, y)))):
        bp, _, b_loss = fn(*b_state(), x, y)
        diff = _max_diff(bp, rp)
        np.testing.assert_allclose(float(b_loss), float(r_loss), rtol=1e-6, atol=1e-6)
        assert diff <= 1e-6, (name, diff)
        checks.append(
            f"{name}: first loss {float(b_loss):.9g} vs raw {float(r_loss):.9g}; max |weight "
            f"diff| after one Adam step {diff:.1e}"
        )
    rp, ro = r_state()
    for _ in range(K):
        rp, ro, r_loss = raw_step(rp, ro, x, y)
    mp, _, m = multi(*b_state(), xs, ys)
    diff = _max_diff(mp, rp)
    assert diff <= 1e-5, diff
    np.testing.assert_allclose(float(m["loss"][-1]), float(r_loss), rtol=1e-5)
    checks.append(
        f"(c): loss of step {K} {float(m['loss'][-1]):.9g} vs raw {float(r_loss):.9g}; max "
        f"|weight diff| after {K} Adam steps {diff:.1e}"
    )
    sp, _, s_losses = jax.jit(_raw_scan(_raw.train_step(NAMES, tx)))(*r_state(), xs, ys)
    diff = _max_diff(mp, sp)
    assert diff <= 1e-5, diff
    np.testing.assert_allclose(np.asarray(m["loss"]), np.asarray(s_losses), rtol=1e-5)
    checks.append(
        f"raw `lax.scan`: losses of the {K} steps equal (c)'s (rtol 1e-5); max |weight diff| "
        f"after {K} Adam steps {diff:.1e}"
    )

    hand_nd = jax.jit(_workloads.split_merge_step(model, tx))
    helper_nd = jax.jit(helper_fn)
    raw_nd = jax.jit(_raw.train_step(NAMES, tx))
    contenders = [
        _workloads.stepper("raw", raw_step, *r_state(), x, y),
        _workloads.stepper("(a) hand", hand, *b_state(), x, y),
        _workloads.stepper("(b) helper", lambda *a: _unpack(helper(*a)), *b_state(), x, y),
        _multi_contender(multi, b_state(), xs, ys),
        # Its own jit object: sharing `raw_step`'s executable would keep that code and
        # its buffers hot for "raw" (11 runs per cycle against 1 for each blox step).
        _raw_k_contender(
            jax.jit(_raw.train_step(NAMES, tx), donate_argnums=(0, 1)), r_state(), x, y
        ),
        _workloads.stepper(
            "raw scan x10",
            jax.jit(_raw_scan(_raw.train_step(NAMES, tx)), donate_argnums=(0, 1)),
            *r_state(),
            xs,
            ys,
        ),
        _workloads.stepper("raw, not donated", raw_nd, *r_state(), x, y),
        _workloads.stepper("(a) hand, not donated", hand_nd, *b_state(), x, y),
        _workloads.stepper(
            "(b) helper, not donated", lambda *a: _unpack(helper_nd(*a)), *b_state(), x, y
        ),
    ]
    pairs = [
        Pair("(a) hand-written split/grad/merge step", "(a) hand", "raw", 1.05),
        Pair("(b) bx.make_train_step", "(b) helper", "raw", 1.05),
        Pair(f"(c) bx.steps_per_dispatch k={K}, per step", "(c) multi", "raw x10", 0.65),
        Pair(
            f"(c) bx.steps_per_dispatch k={K} vs raw `lax.scan` of {K} steps",
            "(c) multi",
            "raw scan x10",
            1.05,
        ),
        Pair(
            "(a) hand-written step, not donated",
            "(a) hand, not donated",
            "raw, not donated",
            1.05,
        ),
        Pair(
            "(b) bx.make_train_step, not donated",
            "(b) helper, not donated",
            "raw, not donated",
            1.05,
        ),
    ]
    return contenders, pairs, checks


def _max_diff(blox_params, raw: dict) -> float:
    """The largest |blox - raw| over the MLP's weights."""
    return max(
        float(jnp.max(jnp.abs(blox_params[(*PATH, *k.split("/"))].value - v)))
        for k, v in raw.items()
    )


def _unpack(out):
    params, opt_state, metrics = out
    return params, opt_state, metrics["loss"]


def _multi_contender(multi, state, xs, ys) -> Contender:
    s = list(state)

    def call():
        s[0], s[1], m = multi(s[0], s[1], xs, ys)
        return m["loss"]

    return Contender("(c) multi", call)


def _raw_k_contender(step, state, x, y) -> Contender:
    s = list(state)

    def call():
        for _ in range(K):
            s[0], s[1], loss = step(s[0], s[1], x, y)
        return loss

    return Contender("raw x10", call)


def _raw_scan(step):
    """The raw step run over stacked batches by a hand-written ``lax.scan``."""

    def run(p, o, xs, ys):
        def body(carry, batch):
            p, o, loss = step(*carry, *batch)
            return (p, o), loss

        (p, o), losses = jax.lax.scan(body, (p, o), (xs, ys))
        return p, o, losses

    return run


def render(env, command, started, counts: Counts, quick: bool, pairs, checks) -> str:
    header = ["step", "blox us/call", "raw us/call", "ratio (median of rounds)"]
    header += ["min-based ratio", "per-round ratios (min - max)", "target", "verdict"]
    lines = [
        *_timing.report_head(
            "Train step helpers: blox.train vs raw JAX",
            env,
            started,
            command,
            counts,
            "numbers meaningless" if quick else None,
        ),
        "Workload: tiny MLP 32->64->64->10 (`bx.MLP`), batch 32, MSE, `optax.adam(1e-3)`, "
        "every step `jax.jit(..., donate_argnums=(0, 1))` (the *not donated* rows: plain "
        "`jax.jit`, against plain raw). (a) is the split/grad/merge step "
        "written by hand, (b) `bx.make_train_step(loss_fn, tx)`, (c) "
        f"`bx.steps_per_dispatch(bx.make_train_step(loss_fn, tx), {K})` with {K} stacked "
        f"batches; its reference is {K} raw step calls in a row, dispatched asynchronously "
        "and waited for once (what a training loop does), so the (c) ratio is per step; "
        f"the second (c) row compares it with the raw step run over the same {K} batches "
        "by a hand-written `lax.scan` (the same program, so its target is <= 1.05x).",
        "",
        _timing.format_table(header, [_timing.ratio_row(p) for p in pairs]),
        "",
        *_timing.same_math_section(checks),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, counts = COUNTS.parse(argv, __doc__, "few calls (smoke test)")
    started, env, command = _timing.start_run("blox train step")
    contenders, pairs, checks = build()
    for c in checks:
        log(f"   {c}")
    results = _timing.run_rounds(contenders, *counts)
    for p in _timing.compare(results, pairs):
        log(
            f"   {p.name}: {p.num_us:.1f} vs {p.den_us:.1f} us/call, ratio {p.median_ratio:.3f}x "
            f"(min-based {p.min_ratio:.3f}x) target <= {p.target:.2f}x {p.verdict}"
        )
    report = render(env, command, started, counts, args.quick, pairs, checks)
    _timing.publish(report, args.out, "train_step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
