"""Recurrent-layer speed: a blox LSTM train step against hand-written raw JAX.

Run (``make bench``)::

    .venv/bin/python benchmarks/layers_speed.py --out docs/benchmarks.md

Workload: ``bx.LSTM`` (hidden 64, ``lax.scan``) over ``x [16, 200, 8]`` with a dense
head ``bx.Linear(1)`` on every step, MSE to a fixed target, one Adam step (the split /
grad / merge step of ``_workloads.split_merge_step``). Reference: the same math written
by hand on a ``{str: array}`` dict: ``lax.scan`` over time of
``[i, g, f, o] = [x_t, h] @ W + b``, ``c = sigmoid(f) c + sigmoid(i) tanh(g)``,
``h = sigmoid(o) tanh(c)``, then ``h @ W_head + b_head``. Before timing, the first
losses and the weights after one Adam step are asserted equal; the report gives the
optimised-HLO FLOPs and the number of ``transpose`` ops in the optimised HLO of both
steps. Timing is same-round (see ``_timing.py``); the target is on the ratio of minima.
"""

from __future__ import annotations

import sys
import time

import _raw
import _timing
import _workloads
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import Contender, CountArgs, Pair, log

import blox as bx

TARGET = 1.03
COUNTS = CountArgs(steps=50, warmup=5, quick_steps=3, quick_warmup=1)


class LSTMRegressor(bx.Module):
    """``bx.LSTM`` then a ``bx.Linear`` head on every step: ``[B, T, F] -> [B, T, 1]``."""

    def __init__(self, graph: bx.Graph, hidden: int, rng: bx.Rng):
        super().__init__(graph)
        self.lstm = bx.LSTM(graph / "lstm", hidden, rng)
        self.head = bx.Linear(graph / "head", 1, rng)

    def __call__(self, params: bx.Params, x: jax.Array):
        (h, _), params = self.lstm.apply(params, x)
        return self.head(params, h)


def raw_forward(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The same math by hand: batch-major in and out, ``lax.scan`` over time."""
    hidden = p["head/kernel"].shape[0]
    w, b = p["lstm/kernel"], p["lstm/bias"]

    def body(carry, x_t):
        h, c = carry
        i, g, f, o = jnp.split(jnp.dot(jnp.concatenate([x_t, h], axis=-1), w) + b, 4, axis=-1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
        return (h, c), h

    zeros = jnp.zeros((x.shape[0], hidden), x.dtype)
    _, hs = jax.lax.scan(body, (zeros, zeros), jnp.swapaxes(x, 0, 1))
    return jnp.dot(jnp.swapaxes(hs, 0, 1), p["head/kernel"]) + p["head/bias"]


def raw_step(tx: optax.GradientTransformation):
    def loss_fn(p, x, y):
        return _raw.mse(raw_forward(p, x), y)

    def step(p, opt_state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        updates, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss

    return step


def hlo_stats(jitted, *args) -> tuple[float, int]:
    """FLOPs (XLA cost analysis) and ``transpose`` instructions of the optimised HLO."""
    compiled = jitted.lower(*args).compile()
    return _timing.compiled_flops(compiled), _timing.count_transposes(compiled)


BATCH, FEATURES, HIDDEN = 16, 8, 64


def lstm_workload(steps: int):
    """``(model, params, raw, paths, x, y, tx)`` of the LSTM step: the blox model and its
    locked params, the same weights as the raw dict (its paths in `params`), a batch of
    `steps` time steps and the optimizer. Also used by ``callgrind_step.py``."""
    rs = np.random.default_rng(0)
    x = jnp.asarray(rs.standard_normal((BATCH, steps, FEATURES), dtype=np.float32))
    y = jnp.asarray(np.sin(np.cumsum(np.asarray(x)[..., :1], axis=1)).astype(np.float32))
    tx = optax.adam(1e-3)

    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    model = LSTMRegressor(g / "model", HIDDEN, rng)
    _, params = model(rng.seed(bx.Params(), seed=0), x)
    params = params.locked()
    base = ("net", "model")
    names = ["lstm/gates/kernel", "lstm/gates/bias", "head/kernel", "head/bias"]
    paths = {n.replace("/gates", ""): (*base, *n.split("/")) for n in names}
    return model, params, _workloads.raw_dict(params, paths), paths, x, y, tx


def build_lstm(quick: bool) -> tuple[list[Contender], list[Pair], list[str], list[list[str]]]:
    batch, steps, features, hidden = BATCH, (10 if quick else 200), FEATURES, HIDDEN
    model, params, raw, paths, x, y, tx = lstm_workload(steps)
    b_step, r_step = _workloads.split_merge_step(model, tx), raw_step(tx)
    b_jit, r_jit = jax.jit(b_step), jax.jit(r_step)
    b_state, r_state = _workloads.fresh_states(tx, params, raw)
    b_loss, r_loss, w_diff = _workloads.assert_same_step(
        b_jit, r_jit, b_state, r_state, x, y, paths
    )
    key = f"LSTM B={batch} T={steps} F={features} H={hidden} + dense head, Adam step"
    checks = [
        f"{key}: first loss blox {b_loss:.9g}, raw {r_loss:.9g} (|diff| "
        f"{abs(b_loss - r_loss):.1e}); max |weight diff| after one Adam step {w_diff:.1e}"
    ]
    b_args, r_args = (*b_state(), x, y), (*r_state(), x, y)
    (b_flops, b_tr), (r_flops, r_tr) = hlo_stats(b_jit, *b_args), hlo_stats(r_jit, *r_args)
    hlo = [
        [key, f"{b_flops:.0f}", f"{r_flops:.0f}", "yes" if b_flops == r_flops else "NO"]
        + [str(b_tr), str(r_tr), "yes" if b_tr <= r_tr else "NO"]
    ]
    contenders = [
        _workloads.stepper("blox", b_jit, *b_state(), x, y),
        _workloads.stepper("raw", r_jit, *r_state(), x, y),
    ]
    pairs = [Pair(f"{key}", "blox", "raw", TARGET)]
    if not quick:  # the smoke run skips the donated pair (two more compilations)
        b_don = jax.jit(b_step, donate_argnums=(0, 1))
        r_don = jax.jit(r_step, donate_argnums=(0, 1))
        contenders += [
            _workloads.stepper("blox+donate", b_don, *b_state(), x, y),
            _workloads.stepper("raw+donate", r_don, *r_state(), x, y),
        ]
        pairs.append(Pair(f"{key}, donated", "blox+donate", "raw+donate", TARGET))
    return contenders, pairs, checks, hlo


def render(env, command, started, counts, quick, pairs, checks, hlo) -> str:
    lines = [
        *_timing.report_head(
            "Layers: recurrent train step, blox vs raw JAX",
            env,
            started,
            command,
            counts,
            "sizes shrunk, numbers meaningless" if quick else None,
        ),
        "blox: `bx.LSTM(hidden=64)` (`lax.scan` through `dynamic_scan`: the carry holds the "
        "state and the params a step replaces, the weights are closed over) and a "
        "`bx.Linear(1)` head on every step, MSE, the split/grad/merge Adam step. "
        "Raw: the same equations on a `{str: array}` dict with a hand-written `lax.scan`. "
        "The *min-based ratio* is the median over rounds of the ratio of per-round minima "
        "(the target); the *median ratio* uses per-round medians.",
        "",
        _timing.min_ratio_table(pairs),
        "",
        "### Optimised HLO of the train step",
        "",
        _timing.format_table(
            [
                "workload",
                "blox FLOPs",
                "raw FLOPs",
                "equal",
                "blox transposes",
                "raw transposes",
                "no extra",
            ],
            hlo,
        ),
        "",
        "FLOPs from `compile().cost_analysis()['flops']`; transposes counted as "
        "`transpose(` instructions in `compile().as_text()`.",
        "",
        *_timing.same_math_section(checks),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args, counts = COUNTS.parse(argv, __doc__, quick_help="T=10 and few calls (smoke test)")
    started, env, command = _timing.start_run("blox layers speed")
    t0 = time.perf_counter()
    contenders, pairs, checks, hlo = build_lstm(args.quick)
    log(f"built and checked in {time.perf_counter() - t0:.1f}s; " + "; ".join(checks))
    log("HLO (FLOPs blox/raw, transposes blox/raw): " + " ".join(hlo[0][1:]))
    results = _timing.run_rounds(contenders, *counts)
    pairs = _timing.compare_and_log(results, pairs)
    report = render(env, command, started, counts, args.quick, pairs, checks, hlo)
    _timing.publish(report, args.out, "layers_speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
