"""A small GPT-style character LM trained pipeline-parallel (GPipe, 1F1B, interleaved 1F1B
or zero-bubble ZB-H1) over P stages.

    python examples/pipeline_lm.py                              # 1F1B, 4 stages, 200 steps
    python examples/pipeline_lm.py --schedule gpipe             # GPipe: the same losses
    python examples/pipeline_lm.py --schedule zb                # ZB-H1 (B and W split)
    python examples/pipeline_lm.py --schedule zbv --stages 2    # ZB-V (2 chunks in a V)
    python examples/pipeline_lm.py --schedule interleaved --stages 2 --virtual-stages 2
    python examples/pipeline_lm.py --schedule none              # one device, no pipeline
    python examples/pipeline_lm.py --data-parallel 2            # data 2 x stage 4 mesh
    python examples/pipeline_lm.py --data-parallel 2 --stages 2 --tensor-parallel 2  # 3-D
    python examples/pipeline_lm.py --size tiny --steps 3        # seconds (smoke test)

On CPU the script simulates 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
set before JAX starts unless XLA_FLAGS already sets a count).

The model is the one of ``examples/gpt_tp.py`` cut into stages: token embedding (stage 0,
`first_fn`) -> P stages of identical pre-norm `blox.TransformerBlock`\\ s (RoPE, causal;
4 blocks in all, 4 / P per stage, `stage_fn`) -> final LayerNorm and the tied embedding as the
output head, with the mean cross-entropy (stage P - 1, `last_fn`). Each block is
initialized alone (seed ``seed * 1000 + b`` for block ``b``), so the model is the same on
every mesh; the P stages' params are stacked along a leading stage dimension
(`blox.parallel.stack_stages`), sharded over the ``stage`` mesh axis; the embedding and the
final norm (``shared``) are replicated. With ``--schedule interleaved`` each device holds
``--virtual-stages V`` chunks instead (V P chunks of ``4 / (V P)`` blocks; chunk ``c`` of
device ``s`` runs the model's chunk ``c P + s``; params stacked ``(V, P, ...)``), the same
blocks in the same order; ``--schedule zbv`` (ZB-V) holds 2 chunks per device in a V
(device ``s`` runs chunks ``s`` and ``2 P - 1 - s``: the params are stacked in the
schedule's ``stacking_order``). ``--schedule gpipe|1f1b|1f1b-2f|interleaved|zb|zbv``
builds the step with `blox.parallel.pipeline_value_and_grad` on a ``data`` x ``stage``
x ``model`` mesh of D x P x T devices (the global batch split over ``data``, each data
row split into ``--microbatches M`` microbatches; with ``--tensor-parallel T`` > 1 each
stage's blocks are `blox.parallel.ParallelTransformerBlock`\\ s whose heads and MLP
columns are split over ``model``, laid out by ``bp.transformer_tp_rules()`` passed as
``stage_specs``: the same params, the same math); ``--schedule none`` runs the same stacked params
stage after stage on one device with ``jax.value_and_grad`` of the full batch (the mean
of M equal microbatch means is the full-batch mean). The gradients go to one
``optax.adamw`` update in every case, so all print the same losses (to about 1e-6).

Before training the script prints the schedule table (pipelined runs), then
``temp_bytes=<int>``: the temp (scratch) bytes of the compiled step from
``jax.jit(step).lower(...).compile().memory_analysis()`` (all devices of the mesh; GPipe
stashes M microbatches' activations per stage, 1F1B at most P). Then each step prints
``step=<n> loss=<repr(float(loss))>``.

Text: the source of a few standard-library modules (as ``examples/gpt_tp.py``); the
windows of step ``n`` depend only on ``(seed, n)``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import inspect
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import blox as bx  # noqa: E402
from blox import parallel as bp  # noqa: E402

MODULES = ["textwrap", "string", "bisect", "heapq", "fractions", "difflib"]
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
SIZES = {
    # name: (width, transformer blocks in all, heads, context, global batch, steps, lr)
    "tiny": (32, 4, 4, 16, 16, 5, 3e-3),
    "default": (128, 4, 8, 64, 32, 200, 3e-3),
}


def load_tokens() -> np.ndarray:
    text = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    index = {c: i for i, c in enumerate(CHARS)}
    return np.array([index.get(c, 1) for c in text], dtype=np.int32)


def window_starts(seed: int, step: int, batch: int, n_tokens: int, context: int) -> np.ndarray:
    """Where the windows of step `step`'s global batch start: a function of ``(seed,
    step)`` only."""
    return np.random.default_rng((seed, step)).integers(0, n_tokens - context - 1, size=batch)


class Stage(bx.Module):
    """One pipeline stage: ``layers`` pre-norm transformer blocks (RoPE, causal);
    ``(B, T, D) -> (B, T, D)``."""

    def __init__(self, graph, width, layers, heads, rng, parallel=False):
        super().__init__(graph)
        block = bp.ParallelTransformerBlock if parallel else bx.TransformerBlock
        self.blocks = [
            block(graph / f"block_{i}", width, heads, rng, use_rope=True) for i in range(layers)
        ]

    def __call__(self, params, h):
        for block in self.blocks:
            h, params = block(params, h, is_causal=True)
        return h, params


def build(
    width: int,
    blocks: int,
    heads: int,
    context: int,
    stages: int,
    seed: int,
    parallel=False,
    virtual_stages: int = 1,
    order: tuple[int, ...] | None = None,
):
    """The model's three functions and its initial ``(stage_params, shared_params)``:
    stage params stacked ``(P, ...)`` (``(V, P, ...)`` with `virtual_stages` V > 1), shared
    params (embedding, final norm) replicated.

    The model does not depend on the mesh: `blocks` transformer blocks in all, block ``b``
    initialized alone with seed ``seed * 1000 + b``; (virtual) stage ``s`` of the
    ``V P`` runs blocks ``s k`` to ``s k + k - 1`` (``k = blocks / (V P)``, as its
    ``block_0 .. block_{k-1}``). `parallel`: the stage's blocks are tensor-parallel (the
    same params, run inside the pipeline's ``shard_map`` with the ``model`` axis bound).
    `order`: the chunks in the order they are stacked (ZB-V's ``Schedule.stacking_order``;
    default ``0 .. V P - 1``)."""
    chunks = stages * virtual_stages
    k = blocks // chunks
    g = bx.Graph("lm")
    rng = bx.Rng(g / "rng")
    embed = bx.Embed(g / "embed", len(CHARS), width, rng)
    final_norm = bx.LayerNorm(g / "final_norm")
    sg = bx.Graph("stage")
    stage = Stage(sg / "body", width, k, heads, bx.Rng(sg / "rng"), parallel=parallel)

    def first_fn(params, tokens):
        return embed(params, tokens)

    def stage_fn(params, h):
        return stage(params, h)

    def last_fn(params, h, targets):
        h, params = final_norm(params, h)
        logits, params = embed.attend(params, h)
        ll = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(ll, targets[..., None], axis=-1)), params

    tokens = jnp.zeros((1, context), jnp.int32)

    @jax.jit
    def init_shared():
        h, shared = first_fn(rng.seed(bx.Params(), seed=seed), tokens)
        return last_fn(shared, h, tokens)[1].locked()

    def block_init(j):
        """Jitted init of one block at the path of a stage's ``block_j``."""
        bg = bx.Graph("stage")
        brng = bx.Rng(bg / "rng")
        one = bx.TransformerBlock(bg / "body" / f"block_{j}", width, heads, brng, use_rope=True)

        @jax.jit
        def init(block_seed):  # one compile for the P stages
            h = jnp.zeros((1, context, width), jnp.float32)
            return one(brng.seed(bx.Params(), seed=block_seed), h, is_causal=True)[1].locked()

        return init

    def init():
        inits = [block_init(j) for j in range(k)]
        per_stage = [
            functools.reduce(
                lambda a, b: a.merge(b),
                [inits[j](jnp.int32(seed * 1000 + s * k + j)) for j in range(k)],
            )
            for s in range(chunks)
        ]
        if order is not None:
            per_stage = [per_stage[c] for c in order]
        return bp.stack_stages(per_stage, virtual_stages=virtual_stages), init_shared()

    return first_fn, stage_fn, last_fn, init


def sequential_value_and_grad(first_fn, stage_fn, last_fn, stages: int):
    """``step(stage_params, shared_params, x, y)`` with the pipeline step's contract, on
    one device: the stages run one after the other on the full batch."""

    def loss_fn(trainable, stage_state, shared_state, x, y):
        tr_stage, tr_shared = trainable
        stage_params = tr_stage.merge(stage_state)
        h, shared = first_fn(tr_shared.merge(shared_state), x)
        new_states = []
        for s in range(stages):
            h, p = stage_fn(jax.tree.map(lambda v, s=s: v[s], stage_params), h)
            new_states.append(p.split()[1])
        loss, shared = last_fn(shared, h, y)
        stacked = jax.tree.map(lambda *vs: jnp.stack(vs), *new_states)
        return loss, (stacked, shared.split()[1])

    def step(stage_params, shared_params, x, y):
        (tr_s, st_s), (tr_sh, st_sh) = stage_params.split(), shared_params.split()
        (loss, (st_s, st_sh)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            (tr_s, tr_sh), st_s, st_sh, x, y
        )
        return loss, grads, (stage_params.merge(st_s), shared_params.merge(st_sh))

    return step


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--schedule",
        choices=["gpipe", "1f1b", "1f1b-2f", "interleaved", "zb", "zbv", "none"],
        default="1f1b",
    )
    parser.add_argument("--stages", type=int, default=4, help="P, pipeline stages (devices)")
    parser.add_argument(
        "--virtual-stages",
        type=int,
        default=2,
        help="V, stage chunks per device (--schedule interleaved only)",
    )
    parser.add_argument("--microbatches", type=int, default=None, help="M (default 2 P)")
    parser.add_argument("--data-parallel", type=int, default=1, help="D, data-parallel rows")
    parser.add_argument(
        "--tensor-parallel", type=int, default=1, help="T, the model axis (TP inside stages)"
    )
    args = parser.parse_args(argv)
    width, layers, heads, context, batch, steps, lr = SIZES[args.size]
    steps = args.steps if args.steps is not None else steps
    p, d, tp = args.stages, args.data_parallel, args.tensor_parallel
    m = args.microbatches if args.microbatches is not None else 2 * p
    v = {"interleaved": args.virtual_stages, "zbv": 2}.get(args.schedule, 1)
    if p < 1 or d < 1 or tp < 1 or m < 1 or steps < 0:
        parser.error(
            "--stages, --data-parallel, --tensor-parallel and --microbatches must be >= 1, "
            "--steps >= 0"
        )
    if args.schedule == "interleaved" and v < 2:
        parser.error(f"--schedule interleaved needs --virtual-stages >= 2; got {v}")
    if args.schedule != "none" and p * d * tp > jax.device_count():
        parser.error(
            f"--stages {p} x --data-parallel {d} x --tensor-parallel {tp} needs {p * d * tp} "
            f"devices; there are {jax.device_count()}"
        )
    if layers % (v * p):
        parser.error(
            f"--stages {p} x --virtual-stages {v} must divide the {layers} blocks of --size "
            f"{args.size}" + (" (try --stages 2)" if v > 1 else "")
        )
    if heads % tp:
        parser.error(f"--tensor-parallel {tp} must divide the {heads} heads of --size {args.size}")
    if args.schedule in ("1f1b", "1f1b-2f", "zb", "zbv") and m < p:
        parser.error(
            f"{args.schedule} needs --microbatches >= --stages ({p}); got {m} (or use gpipe)"
        )
    if args.schedule == "interleaved" and m % p:
        parser.error(f"interleaved needs --microbatches a multiple of --stages ({p}); got {m}")
    if batch % (m * d):
        parser.error(
            f"the global batch of --size {args.size} is {batch}, which --microbatches {m} x "
            f"--data-parallel {d} = {m * d} does not divide"
        )

    data = load_tokens()
    parallel = args.schedule != "none" and tp > 1
    # ZB-V places chunks c and 2P - 1 - c on device c: the params stack in its order
    order = bp.zero_bubble_v_schedule(p, m).stacking_order if args.schedule == "zbv" else None
    first_fn, stage_fn, last_fn, init = build(
        width, layers, heads, context, p, args.seed, parallel=parallel, virtual_stages=v,
        order=order,
    )  # fmt: skip
    tx = optax.adamw(lr, weight_decay=0.01)

    if args.schedule == "none":
        mesh = None
        grad_fn = sequential_value_and_grad(first_fn, stage_fn, last_fn, p)
        stage_params, shared = init()
        put_batch = jnp.asarray
    else:
        mesh = bp.make_mesh(
            (d, p, tp), ("data", "stage", "model"), devices=jax.devices()[: d * p * tp]
        )
        print(bp.describe_mesh(mesh), flush=True)
        stage_params, shared = init()
        # One stage's layout (TP: heads and MLP columns over 'model'; else replicated).
        rules = bp.transformer_tp_rules() if parallel else []
        lead = (0,) * (1 if v == 1 else 2)  # leaves (P, ...), or (V, P, ...) when interleaved
        one_stage = jax.tree.map(lambda a: a[lead], stage_params)
        specs = bp.param_specs(one_stage, rules, mesh, replicate_rest=True)
        grad_fn = bp.pipeline_value_and_grad(
            stage_fn,
            last_fn,
            mesh,
            schedule=args.schedule,
            virtual_stages=v if v > 1 else None,
            num_microbatches=m,
            first_fn=first_fn,
            stage_axis="stage",
            data_axis="data",
            stage_specs=specs,
        )
        table = {
            "gpipe": lambda: bp.gpipe_schedule(p, m),
            "1f1b": lambda: bp.one_f_one_b_schedule(p, m),
            "1f1b-2f": lambda: bp.one_f_one_b_schedule(p, m, forwards_per_slot=2),
            "interleaved": lambda: bp.interleaved_schedule(p, m, v),
            "zb": lambda: bp.zero_bubble_schedule(p, m),
            "zbv": lambda: bp.zero_bubble_v_schedule(p, m),
        }[args.schedule]()
        print(table, flush=True)
        stage_dims = ("stage",) if v == 1 else (None, "stage")
        stage_shardings = jax.tree.map(
            lambda spec: NamedSharding(mesh, P(*stage_dims, *(spec or ()))), specs
        )
        stage_params = jax.device_put(stage_params, stage_shardings)
        shared = jax.device_put(shared, NamedSharding(mesh, P()))
        batch_sharding = NamedSharding(mesh, P("data"))

        def put_batch(a):
            return jax.device_put(a, batch_sharding)

    # Under the mesh (explicit sharding), jit places the optimizer's scalar step count too.
    ctx = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
    with ctx:
        opt_state = jax.jit(tx.init)((stage_params.split()[0], shared.split()[0]))

    def train_step(stage_params, shared, opt_state, x, y):
        loss, grads, new = grad_fn(stage_params, shared, x, y)
        stage_params, shared = new
        trainable = (stage_params.split()[0], shared.split()[0])
        updates, opt_state = tx.update(grads, opt_state, trainable)
        tr_s, tr_sh = optax.apply_updates(trainable, updates)
        stage_params = tr_s.merge(stage_params.split()[1])
        shared = tr_sh.merge(shared.split()[1])
        return stage_params, shared, opt_state, loss

    def batch_of(i):
        starts = window_starts(args.seed, i, batch, len(data), context)
        chunk = np.stack([data[s : s + context + 1] for s in starts])
        return put_batch(chunk[:, :-1]), put_batch(chunk[:, 1:])

    losses = []
    with ctx, jax.default_matmul_precision("highest"):
        x, y = batch_of(1)
        step = (
            jax.jit(train_step, donate_argnums=(0, 1, 2))
            .lower(stage_params, shared, opt_state, x, y)
            .compile()
        )
        print(f"temp_bytes={int(step.memory_analysis().temp_size_in_bytes)}", flush=True)
        for i in range(1, steps + 1):
            x, y = batch_of(i)
            stage_params, shared, opt_state, loss = step(stage_params, shared, opt_state, x, y)
            losses.append(float(loss))
            print(f"step={i} loss={losses[-1]!r}", flush=True)
    return losses


if __name__ == "__main__":
    main()
