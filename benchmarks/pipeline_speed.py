"""Pipeline parallelism: GPipe vs 1F1B (plain, and with slots of one backward or two
forwards) vs interleaved 1F1B (v = 2) vs ZB-H1 and ZB-V (zero bubble) vs the same model
run sequentially, p = 4 stages.

Run (``make bench``)::

    .venv/bin/python benchmarks/pipeline_speed.py --out docs/benchmarks.md

On CPU the script simulates 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``);
the pipeline runs on a 4-device ``stage`` mesh, the sequential model on one device.

Model: ``first_fn`` a Linear embedding (16 -> D), 2p = 8 identical residual MLP blocks
(``h + W2 gelu(W1 LayerNorm(h))``, D -> 2D -> D), ``last_fn`` a Linear head (D -> 16) and
the mean squared error. A stage runs two blocks (GPipe, 1F1B, ZB-H1); the interleaved
schedule and ZB-V cut the same 8 blocks into v p = 8 chunks of one block (two per device;
ZB-V's in a V: device s runs blocks s and 7 - s, stacked in its ``stacking_order``). Each
microbatch has ``R`` rows, so the global batch is ``R m`` and both the work and GPipe's
stash grow with ``m``. One timed call = loss and gradients of one global batch
(``bp.pipeline_value_and_grad`` for GPipe, 1F1B, ``'1f1b-2f'`` (1F1B whose slots hold
one backward or two forwards), ``'interleaved'`` with ``virtual_stages=2``, ``'zb'`` and
``'zbv'``;
``jax.value_and_grad`` of the blocks run one after the other for the sequential model).
Before timing, the script asserts the loss and every gradient of every schedule equal the
sequential ones (the same blocks stacked the schedule's way; rtol 1e-5, highest matmul
precision).

``--json FILE`` also writes one record per schedule and m: ``schedule``, ``m``,
``step_s_per_microbatch``, ``temp_bytes``, ``table_idle`` (the table with B = 2 F, or
F = B = W for ``zb`` and ``zbv``), ``busy_fraction`` (from the measured cells, each
``ppermute`` holding its two ends), ``busy_fraction_slot_bound`` (the same, every slot
as long as its slowest cell), and the slowest
stage's cells in seconds: ``cell_f_s``, ``cell_b_s`` / ``cell_w_s`` (the runtime's own
split backward's B and W, measured from the stash; null without a split) and
``cell_backward_s`` (the same stage's fused backward, the reference for B + W).
``--quick`` keeps the model, with m = 8 and 32 and fewer rounds.

Reported per m (4 to 64) and schedule: the table's slot count, step time and time per
microbatch (median over rounds of the per-round median; same-round ratios to the
sequential model and of ``1f1b-2f`` to ``1f1b``; the per-microbatch time over that of
m = 4, which the runtime keeps flat), the compiled temp bytes
(``jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes``), the
compiled program's ``copy`` count, and the idle fraction three ways: (p - 1)/(m + p - 1);
from the schedule table with a backward of two forwards (``Schedule.idle_fraction(1, 2)``);
and from the measured time of each cell the runtime runs, on one microbatch, one
device, inside one jitted loop (no dispatch per cell), in a child process pinned to one
core (`pinned_cells`), from the runtime's own code
(`runtime_cells`: a
forward; the last stage's forward also differentiates ``last_fn``; the whole backward;
stage 0's backward also recomputes and differentiates ``first_fn``; for ZB-H1 and ZB-V
the input-gradient B and the weight-gradient W apart; for the interleaved schedule and
ZB-V the cells of a one-block chunk; all cells timed interleaved, min over repeats)
placed in the table's cells (``Schedule.idle_fraction(forward=..., backward=...,
weight=..., sync=...)``, one cost per virtual stage): with ``sync='pairs'`` each
``ppermute`` pair waits for both its ends (the runtime's synchronisation), with
``'slot'`` every slot lasts as long as its busiest stage (the bound); idle = 1 -
sum(busy) / (p x the step's length). The busy fraction is 1 - idle. The plots (temp
memory and time per microbatch vs m; the busy fraction vs m) go to
``docs/img/pipeline_memory.png`` and ``docs/img/pipeline_busy.png``.
"""

from __future__ import annotations

import argparse
import functools
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
from jax import lax  # noqa: E402

import blox as bx  # noqa: E402
from blox import parallel as bp  # noqa: E402

COUNTS = CountArgs(steps=10, warmup=2, quick_steps=2, quick_warmup=1, rounds=5)
P_STAGES, D_IO = 4, 16
WIDTH, ROWS = 128, 64  # the blocks' width, the rows of a microbatch
PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "img",
                    "pipeline_memory.png")  # fmt: skip
SCHEDULES = ("gpipe", "1f1b", "1f1b-2f", "interleaved", "zb", "zbv")
V_CHUNKS = 2  # the interleaved schedule's chunks per device
BLOCKS = V_CHUNKS * P_STAGES  # residual MLP blocks in all: 2 per stage, 1 per chunk
STYLES = ("o-", "s-", "d-", "v-", "x-", "*-")  # plot markers, one per schedule
SYNCS = ("slot", "pairs")  # the two ways `Schedule.idle_fraction` lines the slots up


def _virtual(name: str) -> int:
    return V_CHUNKS if name in ("interleaved", "zbv") else 1


def table_of(name: str, m: int):
    """The `Schedule` the runtime follows for `name` at p = `P_STAGES`."""
    if name == "gpipe":
        return bp.gpipe_schedule(P_STAGES, m)
    if name == "interleaved":
        return bp.interleaved_schedule(P_STAGES, m, V_CHUNKS)
    if name == "zb":
        return bp.zero_bubble_schedule(P_STAGES, m)
    if name == "zbv":
        return bp.zero_bubble_v_schedule(P_STAGES, m)
    return bp.one_f_one_b_schedule(P_STAGES, m, forwards_per_slot=2 if name == "1f1b-2f" else 1)


def build_model(width: int):
    """``first_fn, last_fn, shared`` and, per chunks per device ``v`` (1 and
    `V_CHUNKS`), ``(stage_fn, stacked params)``: the same `BLOCKS` blocks (block ``b``
    initialized alone with seed ``1 + b``) cut into ``v p`` stages of ``BLOCKS / (v p)``."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    embed = bx.Linear(g / "embed", width, rng)
    head = bx.Linear(g / "head", D_IO, rng)

    def first_fn(params, x):
        return embed(params, x)

    def last_fn(params, h, y):
        out, params = head(params, h)
        return jnp.mean((out - y) ** 2), params

    def block(j):
        sg = bx.Graph("stage")
        srng = bx.Rng(sg / "rng")
        node = sg / f"block_{j}"
        norm = bx.LayerNorm(node / "norm")
        fc1 = bx.Linear(node / "fc1", 2 * width, srng)
        fc2 = bx.Linear(node / "fc2", width, srng)

        def apply(params, h):
            a, params = norm(params, h)
            a, params = fc1(params, a)
            a, params = fc2(params, jax.nn.gelu(a))
            return h + a, params

        return apply, srng

    x0 = jnp.zeros((1, D_IO))
    shared = rng.seed(bx.Params(), seed=0)
    h, shared = first_fn(shared, x0)
    shared = last_fn(shared, h, x0)[1].locked()
    layouts = {}
    for v in (1, V_CHUNKS):
        k = BLOCKS // (v * P_STAGES)
        blocks = [block(j) for j in range(k)]

        def stage_fn(params, h, blocks=blocks):
            for apply, _ in blocks:
                h, params = apply(params, h)
            return h, params

        def init(b, j, blocks=blocks):
            apply, srng = blocks[j]
            return apply(srng.seed(bx.Params(), seed=1 + b), h)[1]

        chunks = [
            functools.reduce(lambda a, b: a.merge(b), [init(c * k + j, j) for j in range(k)])
            for c in range(v * P_STAGES)
        ]
        layouts[v] = (stage_fn, [c.locked() for c in chunks])
    return first_fn, last_fn, shared, layouts


def stacked(chunks, order):
    """The model stages `chunks` stacked in a schedule's `stacking_order`."""
    v = len(chunks) // P_STAGES
    return bp.stack_stages([chunks[k] for k in order], virtual_stages=v)


def model_order(tree, order, v: int):
    """Stage-stacked leaves (as a schedule's `stacking_order` stacks them) restacked in
    model order."""
    if list(order) == sorted(order):
        return tree
    parts = bp.unstack_stages(tree, virtual_stages=v)
    return bp.stack_stages([parts[list(order).index(k)] for k in range(len(order))],
                           virtual_stages=v)  # fmt: skip


def _model_stage(stage_params, k: int, v: int):
    """Model stage ``k`` of params stacked ``(p, ...)`` or ``(v, p, ...)``."""
    idx = (k,) if v == 1 else (k // P_STAGES, k % P_STAGES)
    return jax.tree.map(lambda a: a[idx], stage_params)


def sequential_step(first_fn, stage_fn, last_fn, v: int = 1):
    """``step(stage_params, shared, x, y) -> (loss, (stage_grads, shared_grads))`` on one
    device, the ``v p`` stages one after the other on the whole batch."""

    def loss_fn(tr, st_stage, st_shared, x, y):
        tr_stage, tr_shared = tr
        stage_params = tr_stage.merge(st_stage)
        h, shared = first_fn(tr_shared.merge(st_shared), x)
        for k in range(v * P_STAGES):
            h, _ = stage_fn(_model_stage(stage_params, k, v), h)
        return last_fn(shared, h, y)[0]

    def step(stage_params, shared, x, y):
        (tr_s, st_s), (tr_sh, st_sh) = stage_params.split(), shared.split()
        return jax.value_and_grad(loss_fn)((tr_s, tr_sh), st_s, st_sh, x, y)

    return step


POSITIONS = ("first", "mid", "last")  # stage 0 (after first_fn), a middle stage, the last


def runtime_cells(first_fn, stage_fn, last_fn, shared, stage, rows, number, repeat):
    """Seconds of the cells the runtime runs on one microbatch, per stage position
    (`POSITIONS`), each inside one jitted loop (`in_loop`), from the runtime's own code
    (`blox.parallel._pipeline`,
    products row-major as on a CPU mesh): ``F`` (the stage's VJP forward, residuals out;
    stage 0 runs ``first_fn`` first, the last stage then takes the value and gradient of
    ``last_fn``), ``backward`` (the whole backward from the stash: the B of tables
    without W), ``B`` and ``W`` (the split backward's input part, returning what the
    runtime writes, and its weight part; stage 0's backward and B also pull the
    cotangent back through a recomputed ``first_fn``). Every cell is timed interleaved
    with the others, min over `repeat` rounds of `number` calls: the machine's load
    drifts, and a cell timed in a quiet moment would look cheaper than one timed later.
    ``{position: {'F', 'backward', 'B', 'W'}}``."""
    from blox.parallel import _pipeline as pl

    fns = pl._Fns(lambda params, h: stage_fn(params, h), None, None)
    r = np.random.default_rng(2)
    width = stage["stage", "block_0", "fc2", "bias"].value.shape[0]
    h = jnp.asarray(r.normal(size=(rows, width)), jnp.float32)
    x, y = (jnp.asarray(r.normal(size=(rows, D_IO)), jnp.float32) for _ in range(2))
    tr, st = stage.split()
    tr_sh, st_sh = shared.split()
    layout = pl._residual_layout(fns, tr, st, h)
    leaves = jax.jit(lambda tr, h: jax.tree.leaves(pl._stage_vjp(fns, tr, st, h)[1]))(tr, h)
    res = [v for v, k in zip(leaves, layout.stashed, strict=True) if k]
    pres = [v for v, k in zip(leaves, layout.stashed, strict=True) if not k]
    sb = pl._split_backward(layout, res, pres, h, row_major=True)
    stashed = set(sb.ins[: sb.n_res])  # values B keeps that stay in the stash entry
    computed = [i for i, k in enumerate(sb.keep) if k not in stashed]
    kept = jax.jit(lambda r, q, ct: pl._backward_input(sb, r, q, ct)[1])(res, pres, h)

    def forward(pos, tr, tr_sh, h):
        if pos == "first":
            h = first_fn(tr_sh.merge(st_sh), x)[0]
        out, vjp_fn, _ = pl._stage_vjp(fns, tr, st, h)
        stash = [v for v, k in zip(jax.tree.leaves(vjp_fn), layout.stashed, strict=True) if k]
        if pos == "last":
            loss = lambda p, o: last_fn(p.merge(st_sh), o, y)[0]  # noqa: E731
            return stash, jax.value_and_grad(loss, (0, 1))(tr_sh, out)
        return stash, out

    def through_first(pos, tr_sh, d_h):
        if pos != "first":
            return d_h
        return jax.vjp(lambda p: first_fn(p.merge(st_sh), x)[0], tr_sh)[1](d_h)

    def whole(pos, r, q, ct, tr_sh):
        d_tr, d_h = pl._backward_whole(sb, r, q, ct)
        return d_tr, through_first(pos, tr_sh, d_h)

    def backward_input(pos, r, q, ct, tr_sh):
        d_h, values = pl._backward_input(sb, r, q, ct)
        return through_first(pos, tr_sh, d_h), [values[i] for i in computed]

    w = lambda q, kept: pl._backward_weight(sb, q, kept)  # noqa: E731
    cells = {}
    for pos in POSITIONS:
        cells[pos, "F"] = (functools.partial(forward, pos), (tr, tr_sh, h))
        cells[pos, "backward"] = (functools.partial(whole, pos), (res, pres, h, tr_sh))
        cells[pos, "B"] = (functools.partial(backward_input, pos), (res, pres, h, tr_sh))
    cells["W"] = (w, (pres, kept))
    loops = {key: in_loop(cell, args) for key, (cell, args) in cells.items()}
    calls = {(key, k): functools.partial(run, k) for key, run in loops.items() for k in LOOP_TRIPS}
    for c in calls.values():
        c()
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeat):
        for key, c in calls.items():
            best[key] = min(best[key], _timing.per_call_us(c, number, 1) * 1e-6)
    (k1, k2) = LOOP_TRIPS
    per = {key: (best[key, k2] - best[key, k1]) / (k2 - k1) for key in cells}
    return {
        pos: {**{k: per[pos, k] for k in ("F", "backward", "B")}, "W": per["W"]}
        for pos in POSITIONS
    }


LOOP_TRIPS = (2, 10)  # the two loop lengths `in_loop` times; a cell = the difference / 8


def in_loop(cell, args):
    """``run(trips)``: a call of one jitted loop (compiled once, the trip count an
    argument) that runs ``cell(*args)`` `trips` times, as the runtime's scan runs its
    cells: no dispatch per cell. Each trip's operands pass an ``optimization_barrier``
    with a counter the loop carries, so that XLA hoists nothing out of the loop; the last
    trip's outputs are returned (and so computed on every trip)."""

    def loop(args, trips):
        def body(_, carry):
            a, c = lax.optimization_barrier((args, carry[0]))
            return c + 1.0, cell(*a)

        out = jax.tree.map(jnp.zeros_like, jax.eval_shape(cell, *args))
        return lax.fori_loop(0, trips, body, (jnp.float32(0), out))

    f = jax.jit(loop)
    return lambda trips: jax.block_until_ready(f(args, jnp.int32(trips)))


def write_cells(path: str, width: int, rows: int, number: int) -> int:
    """`runtime_cells` of both layouts (a stage of two blocks, a one-block chunk), written
    to `path` as JSON ``{v: {position: {cell: seconds}}}``."""
    import json

    first_fn, last_fn, shared, chunked = build_model(width)
    out = {}
    with jax.default_matmul_precision("highest"):
        for v, (fn, chunks) in chunked.items():
            stage = _model_stage(stacked(chunks, range(len(chunks))), 1, v)
            out[v] = runtime_cells(first_fn, fn, last_fn, shared, stage, rows, number, repeat=7)
    with open(path, "w") as f:
        json.dump(out, f)
    return 0


def pinned_cells(width: int, rows: int, number: int) -> dict:
    """`write_cells` run in a child process pinned to one core (``os.sched_setaffinity``,
    where the OS has it): unpinned on this 2-core machine, XLA's threads split some
    cells over both cores in some processes and not in others, so that one cell (W)
    measured 75, 92 or 110 us from one process to the next; pinned, 107-113 us in
    every one. A device runs its cells alone, as one pinned core does."""
    import json
    import subprocess
    import tempfile

    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    pin = (lambda: os.sched_setaffinity(0, cores[:1])) if cores else None
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "cells.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--cells-only", path, str(number)]
        subprocess.run(cmd, check=True, preexec_fn=pin)
        with open(path) as f:
            cells = json.load(f)
    if not cores:
        log("cells timed unpinned: this OS has no sched_setaffinity")
    return {int(v): c for v, c in cells.items()}


def weighted_idle(schedule, cells, sync: str) -> float:
    """`Schedule.idle_fraction` with the measured cells (`runtime_cells`), one cost per
    virtual stage: stage 0 ``'first'``, the last ``'last'``, the others ``'mid'``; `sync`
    as there (``'pairs'``: a ``ppermute`` holds only its two ends; ``'slot'``: the bound
    where every slot lasts as long as its slowest cell)."""
    n = schedule.num_stages * schedule.virtual_stages
    kinds = ["first"] + ["mid"] * (n - 2) + ["last"]
    cost = lambda key: [1e6 * cells[k][key] for k in kinds]  # noqa: E731
    if schedule.split_backward:
        return schedule.idle_fraction(cost("F"), cost("B"), cost("W"), sync=sync)
    return schedule.idle_fraction(cost("F"), cost("backward"), 0.0, sync=sync)


def save_plot(ms, mem, per_mb, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx_) = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    for name, style in (*zip(SCHEDULES, STYLES, strict=True), ("sequential", "^--")):
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
    for name, style in zip(SCHEDULES, STYLES, strict=True):
        ax.plot(ms, [1 - idle[name, m][2] for m in ms], style, label=f"{name} (measured cells)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ms, [str(m) for m in ms])
    ax.set_xlabel("microbatches m")
    ax.set_ylabel("busy fraction")
    ax.set_ylim(0, 1)
    ax.set_title(f"p = {P_STAGES}: busy fraction from the measured cells")
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
    COUNTS.add_to(ap, quick_help="m = 8 and 32 only, fewer rounds (the default model)")
    ap.add_argument("--plot", default=PLOT, help="where to save the memory-vs-m PNG ('' none)")
    ap.add_argument("--json", default="", help="also write the records (a JSON list) here")
    ap.add_argument("--cells-only", nargs=2, metavar=("FILE", "NUMBER"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cells_only:  # the child of `pinned_cells`
        return write_cells(args.cells_only[0], WIDTH, ROWS, int(args.cells_only[1]))
    rounds, steps, warmup = COUNTS.resolve(ap, args)
    started, env, command = _timing.start_run("blox pipeline speed")
    if len(jax.devices()) < 8:
        log("needs 8 devices")
        return 1
    width, rows = WIDTH, ROWS
    ms = [8, 32] if args.quick else [4, 8, 16, 32, 64]
    mesh = bp.make_mesh((P_STAGES,), ("stage",), devices=jax.devices()[:P_STAGES])
    first_fn, last_fn, shared, chunked = build_model(width)
    # the stages stacked in model order, per chunks per device
    layouts = {v: (fn, stacked(chunks, range(len(chunks)))) for v, (fn, chunks) in chunked.items()}
    # the sequential model, timed with the stages' layout; the references per layout
    seqs = {v: jax.jit(sequential_step(first_fn, layouts[v][0], last_fn, v)) for v in layouts}
    seq, seq_params = seqs[1], layouts[1][1]
    contenders, mem, checks, idle, copies, slots = [], {}, [], {}, {}, {}
    with jax.default_matmul_precision("highest"):
        # the runtime's own cells (F, fused backward, split B and W), per layout and position
        cells = pinned_cells(width, rows, number=20 if args.quick else 50)
        for m in ms:
            r = np.random.default_rng(m)
            x = jnp.asarray(r.normal(size=(rows * m, D_IO)), jnp.float32)
            y = jnp.asarray(r.normal(size=(rows * m, D_IO)), jnp.float32)
            refs = {v: seqs[v](layouts[v][1], shared, x, y) for v in layouts}
            mem["sequential", m] = seq.lower(seq_params, shared, x, y).compile().memory_analysis()
            contenders.append(
                Contender(f"seq m={m}", lambda x=x, y=y: seq(seq_params, shared, x, y)[0])
            )
            for name in SCHEDULES:
                v = _virtual(name)
                sched = table_of(name, m)
                stage_fn, chunks = chunked[v]
                params = stacked(chunks, sched.stacking_order)
                ref_loss, (ref_g, ref_g_sh) = refs[v]
                fn = jax.jit(bp.pipeline_value_and_grad(
                    stage_fn, last_fn, mesh, schedule=name, num_microbatches=m,
                    first_fn=first_fn, virtual_stages=v if v > 1 else None))  # fmt: skip
                compiled = fn.lower(params, shared, x, y).compile()
                mem[name, m] = compiled.memory_analysis()
                copies[name, m] = copy_count(compiled)
                loss, (g, g_sh), _ = fn(params, shared, x, y)
                g = model_order(g, sched.stacking_order, v)
                err = max(
                    float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
                    for a, b in zip(
                        jax.tree.leaves((g, g_sh)), jax.tree.leaves((ref_g, ref_g_sh)), strict=True
                    )  # fmt: skip
                )
                rel = abs(float(loss) - float(ref_loss)) / abs(float(ref_loss))
                np.testing.assert_allclose(float(loss), float(refs[1][0]), rtol=1e-5)
                for a, b in zip(jax.tree.leaves((g, g_sh)), jax.tree.leaves((ref_g, ref_g_sh)),
                                strict=True):  # fmt: skip
                    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
                checks.append(f"{name} m={m}: loss rel. error {rel:.1e}, max |grad diff| / max "
                              f"|grad| per leaf {err:.1e} vs the sequential model")  # fmt: skip
                slots[name, m] = sched.num_slots
                # the table with a backward of two forwards (ZB-H1: B and W one each)
                table_idle = (
                    sched.idle_fraction(1.0, 1.0, 1.0)
                    if sched.split_backward
                    else sched.idle_fraction(1.0, 2.0)
                )
                idle[name, m] = (table_idle, *(weighted_idle(sched, cells[v], k) for k in SYNCS))
                contenders.append(
                    Contender(
                        f"{name} m={m}", lambda fn=fn, p=params, x=x, y=y: fn(p, shared, x, y)[0]
                    )
                )
        mem = {k: int(v.temp_size_in_bytes) for k, v in mem.items()}
        for c in checks:
            log(c)
        results = _timing.run_rounds(contenders, rounds, steps, warmup)
    pairs = _timing.compare(
        results,
        [Pair(f"{n} m={m}", f"{n} m={m}", f"seq m={m}") for m in ms for n in SCHEDULES]
        + [Pair(f"packed m={m}", f"1f1b-2f m={m}", f"1f1b m={m}") for m in ms]
        + [
            Pair(f"{n} vs 1f1b m={m}", f"{n} m={m}", f"1f1b m={m}")
            for m in ms
            for n in ("interleaved", "zb", "zbv")
        ],
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
                f"{mem[n, m] / mem[n, ms[0]]:.2f}", f"{mem[n, m] / mem['1f1b', m]:.2f}",
                copies[n, m], f"{theory:.3f}",
                f"{idle[n, m][0]:.3f}", f"{idle[n, m][1]:.3f}", f"{idle[n, m][2]:.3f}",
                f"{1 - idle[n, m][2]:.3f}",
            ])  # fmt: skip
            log(" | ".join(str(c) for c in rows_out[-1]))
    busy_rows = []
    for m in ms:
        busy_rows.append([
            m, f"{1 - (P_STAGES - 1) / (m + P_STAGES - 1):.3f}",
            *(f"{1 - idle[n, m][2]:.3f} ({1 - idle[n, m][1]:.3f})" for n in SCHEDULES),
            f"{ratio[f'packed m={m}'].median_ratio:.2f}x",
            f"{ratio[f'interleaved vs 1f1b m={m}'].median_ratio:.2f}x",
            f"{ratio[f'zb vs 1f1b m={m}'].median_ratio:.2f}x",
            f"{ratio[f'zbv vs 1f1b m={m}'].median_ratio:.2f}x",
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
              f"temp / temp(m={ms[0]})", "temp / 1f1b temp", "copy ops", "(p-1)/(m+p-1)",
              "idle, table (B = 2 F)",
              "idle, measured cells, slot bound", "idle, measured cells, pairs",
              "busy fraction (pairs)"]  # fmt: skip
    b = {v: {k: " / ".join(f"{1e6 * cv[k][c]:.0f}" for c in ("F", "backward", "B", "W"))
             for k in POSITIONS} for v, cv in cells.items()}  # fmt: skip
    lines = [
        f"## Pipeline parallelism: GPipe vs 1F1B vs interleaved vs ZB-H1 vs ZB-V vs "
        f"sequential, p = {P_STAGES}",
        "",
        "Schedules: `gpipe`, `1f1b` (one action per slot), `1f1b-2f` (1F1B whose slots "
        "hold one backward or two forwards: `one_f_one_b_schedule(p, m, forwards_per_slot=2)`), "
        f"`interleaved` (interleaved 1F1B, {V_CHUNKS} chunks per device: "
        f"`interleaved_schedule(p, m, {V_CHUNKS})`), `zb` (ZB-H1, the backward split into "
        "the input-gradient B and the weight-gradient W: `zero_bubble_schedule(p, m)`) and "
        "`zbv` (ZB-V, two chunks per device in a V, the backward split: "
        "`zero_bubble_v_schedule(p, m)`).",
        "",
        *_timing.run_header(env, started, command),
        f"- Model: Linear embedding {D_IO} -> {width} (stage 0), {BLOCKS} residual MLP "
        f"blocks (LayerNorm, {width} -> {2 * width} -> {width}, gelu), two per stage (one per "
        f"chunk for `interleaved` and `zbv`), Linear head -> {D_IO} and MSE (the last stage); "
        f"{rows} "
        "rows per microbatch, so the global batch (and the work) grows with m. One step = "
        f"loss + all gradients; pipelines on a {P_STAGES}-device `stage` mesh "
        "(`bp.pipeline_value_and_grad`), the sequential model (`jax.value_and_grad`, blocks "
        "in turn, whole batch) on one device. Float32, highest matmul precision.",
        _timing.counts_bullet(
            rounds,
            steps,
            warmup,
            "interleaved in a random order per cycle",
            "m = 8 and 32 only, fewer rounds and calls" if args.quick else None,
        ),  # fmt: skip
        "- Measured busy time of the runtime's cells on one microbatch, each run inside "
        "one jitted loop as the runtime's scan runs it, in a child process pinned to one "
        "core (a device runs its cells alone; unpinned, XLA's threads split some cells "
        "over the two cores in some processes and not others) (no dispatch per cell: the time of "
        f"a loop of {LOOP_TRIPS[1]} trips less one of {LOOP_TRIPS[0]}, over the difference; "
        "min over rounds), F / whole backward / B (input part) / W "
        "(weight part), us (stage 0's backward and B recompute and differentiate the "
        "embedding, the last stage's forward differentiates the head and loss): a stage of "
        f"two blocks: first {b[1]['first']}, middle {b[1]['mid']}, last {b[1]['last']}; a "
        f"chunk of one block: first {b[V_CHUNKS]['first']}, middle {b[V_CHUNKS]['mid']}, "
        f"last {b[V_CHUNKS]['last']}.",
        "",
        "Busy fraction (1 - idle) of the runtime, from the measured cell times placed in "
        "each schedule's table, with each `ppermute` holding only its two ends (in "
        "parentheses: the slot bound, every slot as long as its slowest cell; see below), "
        "next to the textbook "
        "1 - (p-1)/(m+p-1); and the measured step times of `1f1b-2f`, `interleaved`, `zb` "
        "and `zbv` over plain `1f1b` (median over rounds of the same-round ratio):",
        "",
        _timing.format_table(
            [
                "m",
                "textbook",
                *(f"busy, {n}" for n in SCHEDULES),
                "step time 1f1b-2f / 1f1b",
                "step time interleaved / 1f1b",
                "step time zb / 1f1b",
                "step time zbv / 1f1b",
            ],
            busy_rows,
        ),  # fmt: skip
        "",
        "![busy fraction vs m](img/pipeline_busy.png)",
        "",
        _timing.format_table(header, rows_out),
        "",
        "Idle fractions: `(p-1)/(m+p-1)` is the textbook bubble; *table (B = 2 F)* weighs the "
        "cells of the schedule the runtime follows with a forward of 1 and a backward of 2 "
        "on every stage (`Schedule.idle_fraction(1, 2)`: the textbook bubble for GPipe, more "
        "for plain 1F1B, whose slots pair a forward on one stage with a backward on the "
        "next; for `zb` and `zbv` B = W = 1, `idle_fraction(1, 1, 1)`; `interleaved` and "
        "`zbv` count chunk cells); "
        "*measured cells* put the measured forward / backward times above into the "
        "table's cells (a cell lasts the sum of the times of its actions: two forwards in a "
        "`1f1b-2f` slot) and idle = 1 - sum(busy) / (p x the step's length), where "
        "`Schedule.idle_fraction(..., sync=...)` lines the devices up in one of two ways. "
        "*pairs* (the runtime's own synchronisation): a slot's sends are `ppermute`s over "
        "the pairs that send, each pair waits for both its ends, and a device without a "
        "transfer in a slot goes straight on. *slot bound*: every slot lasts as long as its "
        "slowest cell, as if each ended with a barrier (the pessimistic bound). Both differ "
        "from the count where forwards and backwards, or the first, middle and last stages, "
        "take different times. It is a model built from "
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
        "1F1B stashes at most p (`1f1b-2f`: 2p) and stays flat; `interleaved` up to "
        f"2 (p - 1) + (v - 1) p + 1 chunk stashes of half a stage (the bound "
        f"1 + (p - 1)/(v p) = {1 + (P_STAGES - 1) / (V_CHUNKS * P_STAGES):.3f} x 1F1B's); `zb` "
        "p microbatches from F to W (B writes what W needs over stash arrays W does not "
        "read), `zbv` up to 2 p chunk-microbatches of half a stage. Plot: "
        "`docs/img/pipeline_memory.png`.",
        "",
        *_timing.same_math_section(checks),
    ]
    _timing.publish("\n".join(lines), args.out, "pipeline_speed")
    if args.json:
        write_json(args.json, ms, us, mem, idle, cells)
    return 0


def slowest_cells(name, cells) -> dict:
    """The cells of the schedule's slowest stage position (the most F + backward;
    `runtime_cells`), in seconds; B and W only for a split backward."""
    c = cells[_virtual(name)]
    pos = max(POSITIONS, key=lambda k: c[k]["F"] + c[k]["backward"])
    split = table_of(name, 8).split_backward
    return {
        "cell_f_s": c[pos]["F"],
        "cell_b_s": c[pos]["B"] if split else None,
        "cell_w_s": c[pos]["W"] if split else None,
        "cell_backward_s": c[pos]["backward"],
    }


def write_json(path, ms, us, mem, idle, cells) -> None:
    """One record per schedule and m (the keys docs/benchmarks.md's pipeline section
    lists); the busy fraction from the measured cells."""
    import json

    out = []
    for m in ms:
        for n in SCHEDULES:
            out.append({
                "schedule": n, "m": m, "step_s_per_microbatch": us[f"{n} m={m}"] * 1e-6 / m,
                "temp_bytes": mem[n, m], "table_idle": idle[n, m][0],
                "busy_fraction": 1 - idle[n, m][2],
                "busy_fraction_slot_bound": 1 - idle[n, m][1], **slowest_cells(n, cells),
            })  # fmt: skip
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    log(f"wrote {len(out)} records to {path}")


if __name__ == "__main__":
    sys.exit(main())
