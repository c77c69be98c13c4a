"""Pipeline parallelism: GPipe vs 1F1B (plain, and with slots of one backward or two
forwards) vs the same model run sequentially, p = 4 stages.

Run (``make bench``)::

    .venv/bin/python benchmarks/pipeline_speed.py --out docs/benchmarks.md

On CPU the script simulates 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``);
the pipeline runs on a 4-device ``stage`` mesh, the sequential model on one device.

Model: ``first_fn`` a Linear embedding (16 -> D), p = 4 identical residual MLP stages
(``h + W2 gelu(W1 LayerNorm(h))``, D -> 4D -> D), ``last_fn`` a Linear head (D -> 16) and
the mean squared error. Each microbatch has ``R`` rows, so the global batch is ``R m`` and
both the work and GPipe's stash grow with ``m``. One timed call = loss and gradients of
one global batch (``bp.pipeline_value_and_grad`` for GPipe, 1F1B and ``'1f1b-2f'``, 1F1B
whose slots hold one backward or two forwards; ``jax.value_and_grad``
of the stages run one after the other for the sequential model). Before timing, the script
asserts the loss and every gradient of every schedule equal the sequential ones
(rtol 1e-5, highest matmul precision).

Reported per m (4 to 64) and schedule: the table's slot count, step time and time per
microbatch (median over rounds of the per-round median; same-round ratios to the
sequential model and of ``1f1b-2f`` to ``1f1b``; the per-microbatch time over that of
m = 4, which the runtime keeps flat), the compiled temp bytes
(``jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes``), the
compiled program's ``copy`` count, and the idle fraction three ways: (p - 1)/(m + p - 1);
from the schedule table with a backward of two forwards (``Schedule.idle_fraction(1, 2)``);
and *busy-time weighted*: the measured time of each cell the runtime runs, on one
microbatch, one device, alone (a forward; stage p - 1's forward also differentiates
``last_fn``; a backward; stage 0's backward also recomputes and differentiates
``first_fn``; all cells timed interleaved, min over repeats) placed in the table's cells
(``Schedule.idle_fraction(forward=..., backward=...)``); the runtime is slot-synchronous
(a ``ppermute`` closes every slot), so a slot lasts as long as its busiest stage (the sum
of its cell's actions) and idle = 1 - sum(busy) / (p x sum of the slot lengths). The
busy fraction is 1 - idle. The plots (temp memory and time per microbatch vs m; the busy
fraction vs m) go to ``docs/img/pipeline_memory.png`` and ``docs/img/pipeline_busy.png``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import _timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import Contender, CountArgs, Pair, log  # noqa: E402

import blox as bx  # noqa: E402
from blox import parallel as bp  # noqa: E402

COUNTS = CountArgs(steps=10, warmup=2, quick_steps=2, quick_warmup=1, rounds=5)
P_STAGES, D_IO = 4, 16
PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "img",
                    "pipeline_memory.png")  # fmt: skip
SCHEDULES = ("gpipe", "1f1b", "1f1b-2f")


def build_model(width: int):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    embed = bx.Linear(g / "embed", width, rng)
    head = bx.Linear(g / "head", D_IO, rng)
    sg = bx.Graph("stage")
    srng = bx.Rng(sg / "rng")
    norm = bx.LayerNorm(sg / "norm")
    fc1 = bx.Linear(sg / "fc1", 4 * width, srng)
    fc2 = bx.Linear(sg / "fc2", width, srng)

    def first_fn(params, x):
        return embed(params, x)

    def stage_fn(params, h):
        a, params = norm(params, h)
        a, params = fc1(params, a)
        a, params = fc2(params, jax.nn.gelu(a))
        return h + a, params

    def last_fn(params, h, y):
        out, params = head(params, h)
        return jnp.mean((out - y) ** 2), params

    x0 = jnp.zeros((1, D_IO))
    shared = rng.seed(bx.Params(), seed=0)
    h, shared = first_fn(shared, x0)
    shared = last_fn(shared, h, x0)[1].locked()
    stages = [stage_fn(srng.seed(bx.Params(), seed=1 + s), h)[1].locked() for s in range(P_STAGES)]
    return first_fn, stage_fn, last_fn, shared, stages


def sequential_step(first_fn, stage_fn, last_fn):
    """``step(stage_params, shared, x, y) -> (loss, (stage_grads, shared_grads))`` on one
    device, the stages one after the other on the whole batch."""

    def loss_fn(tr, st_stage, st_shared, x, y):
        tr_stage, tr_shared = tr
        stage_params = tr_stage.merge(st_stage)
        h, shared = first_fn(tr_shared.merge(st_shared), x)
        for s in range(P_STAGES):
            h, _ = stage_fn(jax.tree.map(lambda v, s=s: v[s], stage_params), h)
        return last_fn(shared, h, y)[0]

    def step(stage_params, shared, x, y):
        (tr_s, st_s), (tr_sh, st_sh) = stage_params.split(), shared.split()
        return jax.value_and_grad(loss_fn)((tr_s, tr_sh), st_s, st_sh, x, y)

    return step


def slot_busy_times(first_fn, stage_fn, last_fn, shared, stage, rows, number, repeat):
    """Measured seconds of the (forward, backward) cells the runtime runs on one
    microbatch, for stage kinds 'first', 'mid', 'last' (one device): a forward is the
    stage's VJP forward (stage 0: after ``first_fn``; stage p - 1: plus the value and
    gradient of ``last_fn``), a backward pulls a cotangent back through the stage (stage
    0: and through a recomputed ``first_fn``)."""
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(rows, D_IO)), jnp.float32)
    y = jnp.asarray(r.normal(size=(rows, D_IO)), jnp.float32)
    width = stage["stage", "fc2", "bias"].value.shape[0]
    h = jnp.asarray(r.normal(size=(rows, width)), jnp.float32)
    tr, st = stage.split()
    tr_sh, st_sh = shared.split()

    def stage_out(tr, h):
        return stage_fn(tr.merge(st), h)[0]

    def forward(kind, tr, tr_sh, h):
        if kind == "first":
            h = first_fn(tr_sh.merge(st_sh), x)[0]
        out, pull = jax.vjp(stage_out, tr, h)
        if kind == "last":
            loss, grads = jax.value_and_grad(lambda p, o: last_fn(p.merge(st_sh), o, y)[0], (0, 1))(
                tr_sh, out
            )
            return loss, grads, pull
        return out, pull

    def backward(kind, tr, tr_sh, h, ct):
        _, pull = jax.vjp(stage_out, tr, h)  # (its forward is what the stash replaces)
        d_tr, d_h = pull(ct)
        if kind == "first":
            _, pf = jax.vjp(lambda p: first_fn(p.merge(st_sh), x)[0], tr_sh)
            return d_tr, pf(d_h)
        return d_tr, d_h

    fns = {}
    for kind in ("first", "mid", "last"):
        fwd = jax.jit(lambda a, b, c, k=kind: jax.tree.leaves(forward(k, a, b, c)[:2]))
        bwd = jax.jit(lambda a, b, c, d, k=kind: backward(k, a, b, c, d))
        args = (tr, tr_sh, h)
        fns[kind, "F"] = lambda f=fwd, a=args: jax.block_until_ready(f(*a))
        fns[kind, "B"] = lambda f=bwd, a=args: jax.block_until_ready(f(*a, h))
    fwd_only = jax.jit(lambda a, c: stage_out(a, c))
    fns["only"] = lambda: jax.block_until_ready(fwd_only(tr, h))
    for f in fns.values():
        f()
    # Interleaved (every cell once per repeat), min over repeats: the machine's load
    # drifts, and a cell timed in a quiet moment would look cheaper than one timed later.
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeat):
        for key, f in fns.items():
            best[key] = min(best[key], _timing.per_call_us(f, number, 1))
    # a backward without its forward (the backward jit recomputes the forward first)
    return {
        k: (best[k, "F"], max(best[k, "B"] - best["only"], 0.0)) for k in ("first", "mid", "last")
    }


def weighted_idle(schedule, busy) -> float:
    """`Schedule.idle_fraction` with the measured per-stage forward / backward times."""
    p = schedule.num_stages
    kinds = ["first"] + ["mid"] * (p - 2) + ["last"]
    return schedule.idle_fraction(
        forward=[busy[k][0] for k in kinds], backward=[busy[k][1] for k in kinds]
    )


def save_plot(ms, mem, per_mb, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx_) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    for name, style in (("gpipe", "o-"), ("1f1b", "s-"), ("1f1b-2f", "d-"), ("sequential", "^--")):
        ax.plot(ms, [mem[name, m] / 2**20 for m in ms], style, label=name)
        bx_.plot(ms, [per_mb[name, m] / 1e3 for m in ms], style, label=name)
    for a, label, title in (
        (ax, "compiled temp memory (MiB)", "temp memory"),
        (bx_, "step time / m (ms)", "time per microbatch"),
    ):
        a.set_xscale("log", base=2)
        a.set_xticks(ms, [str(m) for m in ms])
        a.set_xlabel("microbatches m (rows per microbatch fixed)")
        a.set_ylabel(label)
        a.set_title(f"p = {P_STAGES}: {title} vs m")
        a.grid(alpha=0.3)
        a.set_ylim(bottom=0)
        a.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def save_busy_plot(ms, idle, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 3.4), dpi=100)
    ax.plot(ms, [1 - (P_STAGES - 1) / (m + P_STAGES - 1) for m in ms], "k--",
            label="textbook 1 - (p-1)/(m+p-1)")  # fmt: skip
    for name, style in (("gpipe", "o-"), ("1f1b", "s-"), ("1f1b-2f", "d-")):
        ax.plot(ms, [1 - idle[name, m][1] for m in ms], style, label=f"{name} (measured cells)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("busy fraction")
    ax.set_ylim(0, 1)
    ax.set_title(f"p = {P_STAGES}: busy fraction of the slot-synchronous runtime")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def copy_count(compiled) -> int:
    """``copy`` instructions in the compiled program (XLA copies what a conditional or a
    loop carries when it cannot alias it)."""
    return len(re.findall(r"= \S+ copy\(", compiled.as_text()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    COUNTS.add_to(ap, quick_help="tiny model, m in {4, 8} (smoke test)")
    ap.add_argument("--plot", default=PLOT, help="where to save the memory-vs-m PNG ('' none)")
    args = ap.parse_args(argv)
    rounds, steps, warmup = COUNTS.resolve(ap, args)
    started, env, command = _timing.start_run("blox pipeline speed")
    if len(jax.devices()) < 8:
        log("needs 8 devices")
        return 1
    width, rows = (16, 4) if args.quick else (128, 64)
    ms = [4, 8] if args.quick else [4, 8, 16, 32, 64]
    mesh = bp.make_mesh((P_STAGES,), ("stage",), devices=jax.devices()[:P_STAGES])
    first_fn, stage_fn, last_fn, shared, stages = build_model(width)
    stacked = bp.stack_stages(stages)
    seq = jax.jit(sequential_step(first_fn, stage_fn, last_fn))
    contenders, mem, checks, idle, copies, slots = [], {}, [], {}, {}, {}
    with jax.default_matmul_precision("highest"):
        busy = slot_busy_times(first_fn, stage_fn, last_fn, shared, stages[0], rows,
                               number=5 if args.quick else 50, repeat=3)  # fmt: skip
        for m in ms:
            r = np.random.default_rng(m)
            x = jnp.asarray(r.normal(size=(rows * m, D_IO)), jnp.float32)
            y = jnp.asarray(r.normal(size=(rows * m, D_IO)), jnp.float32)
            ref_loss, (ref_g, ref_g_sh) = seq(stacked, shared, x, y)
            mem["sequential", m] = seq.lower(stacked, shared, x, y).compile().memory_analysis()
            contenders.append(
                Contender(f"seq m={m}", lambda x=x, y=y: seq(stacked, shared, x, y)[0])
            )
            for name in SCHEDULES:
                fn = jax.jit(bp.pipeline_value_and_grad(
                    stage_fn, last_fn, mesh, schedule=name, num_microbatches=m,
                    first_fn=first_fn))  # fmt: skip
                compiled = fn.lower(stacked, shared, x, y).compile()
                mem[name, m] = compiled.memory_analysis()
                copies[name, m] = copy_count(compiled)
                loss, (g, g_sh), _ = fn(stacked, shared, x, y)
                err = max(
                    float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                    for a, b in zip(
                        jax.tree.leaves((g, g_sh)), jax.tree.leaves((ref_g, ref_g_sh)), strict=True
                    )  # fmt: skip
                )
                rel = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
                np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
                for a, b in zip(jax.tree.leaves((g, g_sh)), jax.tree.leaves((ref_g, ref_g_sh)),
                                strict=True):  # fmt: skip
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
                checks.append(f"{name} m={m}: loss rel. error {rel:.1e}, max |grad diff| / max "
                              f"|grad| per leaf {err:.1e} vs the sequential model")  # fmt: skip
                sched = {"gpipe": bp.gpipe_schedule(P_STAGES, m),
                         "1f1b": bp.one_f_one_b_schedule(P_STAGES, m),
                         "1f1b-2f": bp.one_f_one_b_schedule(P_STAGES, m, forwards_per_slot=2),
                         }[name]  # fmt: skip
                slots[name, m] = sched.num_slots
                idle[name, m] = (sched.idle_fraction(1.0, 2.0), weighted_idle(sched, busy))
                contenders.append(
                    Contender(f"{name} m={m}", lambda fn=fn, x=x, y=y: fn(stacked, shared, x, y)[0])
                )
        mem = {k: int(v.temp_size_in_bytes) for k, v in mem.items()}
        for c in checks:
            log(c)
        results = _timing.run_rounds(contenders, rounds, steps, warmup)
    pairs = _timing.compare(
        results,
        [Pair(f"{n} m={m}", f"{n} m={m}", f"seq m={m}") for m in ms for n in SCHEDULES]
        + [Pair(f"packed m={m}", f"1f1b-2f m={m}", f"1f1b m={m}") for m in ms],
    )
    ratio = {p.name: p for p in pairs}
    us = {name: 1e6 * float(np.median([r[name].median for r in results])) for name in results[0]}
    per_mb = {(n, m): us[f"{'seq' if n == 'sequential' else n} m={m}"] / m
              for m in ms for n in (*SCHEDULES, "sequential")}  # fmt: skip
    rows_out = []
    for m in ms:
        theory = (P_STAGES - 1) / (m + P_STAGES - 1)
        for n in SCHEDULES:
            pr = ratio[f"{n} m={m}"]
            rows_out.append([
                n, m, slots[n, m], rows * m, f"{us[f'{n} m={m}']:.0f}", f"{per_mb[n, m]:.0f}",
                f"{per_mb[n, m] / per_mb[n, ms[0]]:.2f}", f"{us[f'seq m={m}']:.0f}",
                f"{pr.median_ratio:.2f}x", f"{mem[n, m]:,}", f"{mem['sequential', m]:,}",
                f"{mem[n, m] / mem[n, ms[0]]:.2f}", copies[n, m], f"{theory:.3f}",
                f"{idle[n, m][0]:.3f}", f"{idle[n, m][1]:.3f}", f"{1 - idle[n, m][1]:.3f}",
            ])  # fmt: skip
            log(" | ".join(str(c) for c in rows_out[-1]))
    busy_rows = []
    for m in ms:
        busy_rows.append([
            m, f"{1 - (P_STAGES - 1) / (m + P_STAGES - 1):.3f}",
            *(f"{1 - idle[n, m][1]:.3f}" for n in SCHEDULES),
            f"{ratio[f'packed m={m}'].median_ratio:.2f}x",
        ])  # fmt: skip
        log(" | ".join(str(c) for c in busy_rows[-1]))
    if args.plot:
        save_plot(ms, mem, per_mb, args.plot)
        busy_plot = os.path.join(os.path.dirname(args.plot), "pipeline_busy.png")
        save_busy_plot(ms, idle, busy_plot)
        log(f"saved {args.plot}, {busy_plot}")
    header = ["schedule", "m", "slots", "global batch", "us/step", "us per microbatch",
              f"per microbatch / m={ms[0]}", "sequential us/step",
              "ratio to sequential (median)", "temp bytes", "sequential temp bytes",
              f"temp / temp(m={ms[0]})", "copy ops", "(p-1)/(m+p-1)", "idle, table (B = 2 F)",
              "idle, busy-time weighted", "busy fraction (model)"]  # fmt: skip
    b = {k: f"{v[0]:.0f} / {v[1]:.0f}" for k, v in busy.items()}
    lines = [
        f"## Pipeline parallelism: GPipe vs 1F1B vs sequential, p = {P_STAGES}",
        "",
        "Schedules: `gpipe`, `1f1b` (one action per slot) and `1f1b-2f` (1F1B whose slots "
        "hold one backward or two forwards: `one_f_one_b_schedule(p, m, forwards_per_slot=2)`).",
        "",
        *_timing.run_header(env, started, command),
        f"- Model: Linear embedding {D_IO} -> {width} (stage 0), {P_STAGES} residual MLP "
        f"stages (LayerNorm, {width} -> {4 * width} -> {width}, gelu), Linear head -> "
        f"{D_IO} and MSE (stage {P_STAGES - 1}); {rows} rows per microbatch, so the global "
        "batch (and the work) grows with m. One step = loss + all gradients; pipelines on a "
        f"{P_STAGES}-device `stage` mesh (`bp.pipeline_value_and_grad`), the sequential model "
        "(`jax.value_and_grad`, stages in turn, whole batch) on one device. Float32, highest "
        "matmul precision.",
        _timing.counts_bullet(
            rounds,
            steps,
            warmup,
            "interleaved in a random order per cycle",
            "model and counts shrunk, numbers meaningless" if args.quick else None,
        ),  # fmt: skip
        f"- Measured busy time of one forward / one backward cell on one microbatch (us; "
        f"stage 0's backward recomputes and differentiates the embedding, stage {P_STAGES - 1}'s "
        f"forward differentiates the head and loss): first {b['first']}, middle {b['mid']}, "
        f"last {b['last']}.",
        "",
        "Busy fraction (1 - idle) of the slot-synchronous runtime, from the measured cell "
        "times placed in each schedule's table (see below), next to the textbook "
        "1 - (p-1)/(m+p-1); and the measured step time of `1f1b-2f` over plain `1f1b` "
        "(median over rounds of the same-round ratio):",
        "",
        _timing.format_table(
            ["m", "textbook", *(f"busy, {n}" for n in SCHEDULES), "step time 1f1b-2f / 1f1b"],
            busy_rows,
        ),
        "",
        "![busy fraction vs m](img/pipeline_busy.png)",
        "",
        _timing.format_table(header, rows_out),
        "",
        "Idle fractions: `(p-1)/(m+p-1)` is the textbook bubble; *table (B = 2 F)* weighs the "
        "cells of the schedule the runtime follows with a forward of 1 and a backward of 2 "
        "on every stage (`Schedule.idle_fraction(1, 2)`: the textbook bubble for GPipe, more "
        "for plain 1F1B, whose slots pair a forward on one stage with a backward on the "
        "next); "
        "*busy-time weighted* puts the measured forward / backward times above into the "
        "table's cells and, since every slot ends with a `ppermute` (slot-synchronous), lets "
        "each slot last as long as its slowest cell: idle = 1 - sum(busy) / (p x sum of the "
        "slot lengths), a slot's length being the largest sum of the times of the actions "
        "one stage runs in it (two forwards in a `1f1b-2f` slot). It differs from the count "
        "where forwards and backwards, or the first, middle and last stages, take different "
        "times (a stage waits in a slot for the busiest one). It is a model built from "
        "measured times, not a wall-clock measurement: the 8 simulated devices share this "
        "machine's cores, so the pipelines' step times do not show the stages running in "
        "parallel and their ratio to the sequential model is the runtime's overhead (scan, "
        "switch, ring buffers, ppermutes, stage-sharded gradients), not a speedup.",
        "",
        "Linear in m: no buffer that grows with m is an operand of the per-slot conditional "
        "(the cell reads its microbatch's entries before it and its outputs are written "
        "after it), so the copy count does not change with m and the time per microbatch "
        "stays flat (it falls while the p - 1 fill and drain slots are amortized).",
        "",
        "Temp memory (per device, of the compiled program): GPipe stashes all m "
        "microbatches' activation residuals per stage and grows about linearly with m; "
        "1F1B stashes at most p (`1f1b-2f`: 2p) and stays flat. Plot: "
        "`docs/img/pipeline_memory.png`.",
        "",
        *_timing.same_math_section(checks),
    ]
    _timing.publish("\n".join(lines), args.out, "pipeline_speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
