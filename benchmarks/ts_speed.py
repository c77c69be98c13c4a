"""System-identification speed: a blox GRU sysid train step and a long free-run
simulation against the same math written in raw JAX.

Run (``make bench``)::

    .venv/bin/python benchmarks/ts_speed.py --out docs/benchmarks.md

Workloads: ``blox.ts.RNNModel(cell='gru', hidden_size=64)`` with internal
normalization (non-trainable statistics), the loss in per-channel normalized units
(`blox.ts.make_sysid_step`, one Adam step) on ``u, y [32, 1000, 1]``; and the free-run
simulation of ``100,000`` steps (``model.simulate``, a ``lax.scan``) of one sequence.
Reference: a ``{str: array}`` dict, ``(u - mean) / std``, the PyTorch GRU equations in a
hand-written ``lax.scan``, the head, ``* std + mean``, and ``mean(((y_hat - y) / std)^2)``.
Before timing, the first losses, the weights after one step and the simulations are
asserted equal. Timing is same-round (see ``_timing.py``); the target is on the ratio of
minima.
"""

from __future__ import annotations

import sys
import time

import _timing
import _workloads
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import Contender, CountArgs, Pair, log

import blox as bx
from blox.ts import RNNModel, make_sysid_step

TARGET = 1.03
COUNTS = CountArgs(steps=20, warmup=3, quick_steps=3, quick_warmup=1)
U_STATS = ([0.1], [0.5])
Y_STATS = ([-0.2], [2.0])


def raw_gru(p: dict[str, jax.Array], u: jax.Array) -> jax.Array:
    """The GRU model by hand: normalize, ``lax.scan`` of the GRU cell, head, denormalize."""
    z = (u - p["u_mean"]) / p["u_std"]
    hidden = p["recurrent_kernel"].shape[0]
    w, uu, b, bu = p["kernel"], p["recurrent_kernel"], p["bias"], p["recurrent_bias"]

    def body(h, z_t):
        gi, gh = jnp.dot(z_t, w) + b, jnp.dot(h, uu) + bu
        ri, zi, ni = jnp.split(gi, 3, axis=-1)
        rh, zh, nh = jnp.split(gh, 3, axis=-1)
        r, g = jax.nn.sigmoid(ri + rh), jax.nn.sigmoid(zi + zh)
        n = jnp.tanh(ni + r * nh)
        h = (1 - g) * n + g * h
        return h, h

    h0 = jnp.zeros((u.shape[0], hidden), u.dtype)
    _, hs = jax.lax.scan(body, h0, jnp.swapaxes(z, 0, 1))
    out = jnp.dot(jnp.swapaxes(hs, 0, 1), p["head_kernel"]) + p["head_bias"]
    return out * p["y_std"] + p["y_mean"]


def raw_step(tx: optax.GradientTransformation):
    def loss_fn(p, stats, u, y):
        y_hat = raw_gru({**p, **stats}, u)
        return jnp.mean(jnp.square((y_hat - y) / stats["y_std"]))

    def step(p, opt_state, u, y, stats):
        loss, g = jax.value_and_grad(loss_fn)(p, stats, u, y)
        updates, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, loss, stats

    return step


def blox_step(model: RNNModel, tx: optax.GradientTransformation):
    inner = make_sysid_step(model, tx)

    def step(params, opt_state, u, y):
        params, opt_state, _, metrics = inner(params, opt_state, None, {"u": u, "y": y})
        return params, opt_state, metrics["loss"]

    return step


def build(quick: bool):
    batch, window, hidden = 32, (50 if quick else 1000), 64
    sim_steps = 1000 if quick else 100_000
    rs = np.random.default_rng(0)
    u = jnp.asarray(rs.standard_normal((batch, window, 1), dtype=np.float32) * 0.5 + 0.1)
    y = jnp.asarray(np.cumsum(np.asarray(u), axis=1) * 0.1 - 0.2, jnp.float32)
    u_sim = jnp.asarray(rs.standard_normal((1, sim_steps, 1), dtype=np.float32))
    tx = optax.adam(1e-3)

    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    model = RNNModel(g / "gru", U_STATS, Y_STATS, rng, hidden_size=hidden)
    _, params = model(rng.seed(bx.Params(), seed=0), u[:, :2])
    params = params.locked()
    base = ("net", "gru")
    paths = {
        "kernel": (*base, "rnn", "layer_0", "kernel"),
        "recurrent_kernel": (*base, "rnn", "layer_0", "recurrent_kernel"),
        "bias": (*base, "rnn", "layer_0", "bias"),
        "recurrent_bias": (*base, "rnn", "layer_0", "recurrent_bias"),
        "head_kernel": (*base, "head", "kernel"),
        "head_bias": (*base, "head", "bias"),
    }
    stat_paths = {
        "u_mean": (*base, "u_norm", "mean"),
        "u_std": (*base, "u_norm", "std"),
        "y_mean": (*base, "y_norm", "mean"),
        "y_std": (*base, "y_norm", "std"),
    }
    raw = _workloads.raw_dict(params, paths)
    stats = _workloads.raw_dict(params, stat_paths)
    b_jit, r_jit = jax.jit(blox_step(model, tx)), jax.jit(raw_step(tx))
    b_state, r_state = _workloads.fresh_states(tx, params, raw)

    def r_plain(p, o, u, y):
        p, o, loss, _ = r_jit(p, o, u, y, stats)
        return p, o, loss

    b_loss, r_loss, w_diff = _workloads.assert_same_step(
        b_jit, r_plain, b_state, r_state, u, y, paths
    )
    key = f"GRU sysid train step B={batch} T={window} H={hidden}, normalized MSE, Adam"
    b_sim = jax.jit(lambda p, u: model.simulate(p, u)[0])
    r_sim = jax.jit(lambda p, u: raw_gru({**p, **stats}, u))
    sim_b, sim_r = b_sim(params, u_sim), r_sim(raw, u_sim)
    sim_diff = float(jnp.max(jnp.abs(sim_b - sim_r)))
    assert sim_diff <= 1e-4, sim_diff
    sim_key = f"GRU free-run simulation, {sim_steps:,} steps, B=1, H={hidden}"
    checks = [
        f"{key}: first loss blox {b_loss:.9g}, raw {r_loss:.9g} (|diff| "
        f"{abs(b_loss - r_loss):.1e}); max |weight diff| after one Adam step {w_diff:.1e}",
        f"{sim_key}: max |output diff| blox vs raw {sim_diff:.1e}",
    ]
    contenders = [
        _workloads.stepper("blox", b_jit, *b_state(), u, y),
        _workloads.stepper("raw", r_jit, *r_state(), u, y, extra=stats),
        Contender("blox sim", lambda: b_sim(params, u_sim)),
        Contender("raw sim", lambda: r_sim(raw, u_sim)),
    ]
    pairs = [Pair(key, "blox", "raw", TARGET), Pair(sim_key, "blox sim", "raw sim", TARGET)]
    return contenders, pairs, checks


def render(env, command, started, counts, quick, pairs, checks) -> str:
    lines = [
        *_timing.report_head(
            "System identification: GRU train step and free run, blox vs raw JAX",
            env,
            started,
            command,
            counts,
            "sizes shrunk, numbers meaningless" if quick else None,
        ),
        "blox: `blox.ts.RNNModel(cell='gru', hidden_size=64)` (normalization params "
        "non-trainable, `lax.scan` through `dynamic_scan`), `make_sysid_step` (loss in "
        "normalized units, Adam); free run: `jax.jit(model.simulate)`. Raw: the same "
        "equations on a `{str: array}` dict with a hand-written `lax.scan`.",
        "",
        _timing.min_ratio_table(pairs),
        "",
        *_timing.same_math_section(checks),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    quick_help = "T=50, 1,000 simulated steps and few calls (smoke test)"
    args, counts = COUNTS.parse(argv, __doc__, quick_help)
    started, env, command = _timing.start_run("blox ts speed")
    t0 = time.perf_counter()
    contenders, pairs, checks = build(args.quick)
    log(f"built and checked in {time.perf_counter() - t0:.1f}s; " + "; ".join(checks))
    results = _timing.run_rounds(contenders, *counts)
    pairs = _timing.compare_and_log(results, pairs)
    report = render(env, command, started, counts, args.quick, pairs, checks)
    _timing.publish(report, args.out, "ts_speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
