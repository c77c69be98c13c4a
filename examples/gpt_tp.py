"""A small GPT-style character LM trained data- x tensor-parallel on a 2-D device mesh.

    python examples/gpt_tp.py --mesh 2x4                 # data 2 x model 4, 200 steps
    python examples/gpt_tp.py --mesh 1x1                 # one device: the same losses
    python examples/gpt_tp.py --size tiny --steps 3 --mesh 1x8   # seconds (smoke test)
    python -m blox.launch -n 2 --devices-per-process 4 \\
        examples/gpt_tp.py --size tiny --mesh 2x4                # 2 processes x 4 devices
    python examples/gpt_tp.py --mesh 8x1 --fsdp          # FSDP (ZeRO-3): the same losses
    python examples/gpt_tp.py --mesh 4x2 --ckpt-dir /tmp/gpt --steps 100   # save ...
    python examples/gpt_tp.py --mesh 2x4 --ckpt-dir /tmp/gpt --steps 200   # ... resume at TP=4
    python examples/gpt_tp.py --mesh 1x1 --experts 4 --top-k 2   # MoE MLPs, one device
    python examples/gpt_tp.py --mesh 2x1 --experts 4 --top-k 2 --expert-parallel 4  # EP
    python examples/gpt_tp.py --mesh 2x1 --context-parallel 4    # sequence over 4 devices
    python examples/gpt_tp.py --mesh 1x2 --context-parallel 4 --cp-variant allgather

On CPU the script simulates 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
set before JAX starts unless XLA_FLAGS already sets a count). ``--mesh DxM`` builds a
``data`` x ``model`` mesh of D * M devices. The transformer blocks are
`blox.parallel.ParallelTransformerBlock` (attention heads and MLP columns split over
``model``, one all-reduce per row-parallel layer); the parameters are laid out by
`transformer_tp_rules` plus two rules for the embedding and the RNG, printed as a table;
they are created sharded by ``jax.jit(init, out_shardings=...)``. The step is
`make_dp_train_step` with those specs: batch over ``data``, gradients all-reduced over
``data`` once. Every step prints ``step=<n> loss=<repr(float(loss))>``; the losses agree
across meshes (1x1, 8x1, 2x4, 1x8) to about 1e-6.

One script, one process or N: `blox.distributed.initialize` runs first (a no-op alone;
under ``python -m blox.launch`` or a cluster scheduler it joins the group), the mesh spans
every device of every process, and each process builds only its rows of every global
batch (`blox.distributed.process_shard`; processes along a ``model`` axis that spans them
build the same rows), assembled by `blox.distributed.global_batch`. The windows of step
``n`` depend only on ``(seed, n)``, the same in every process.

``--ckpt-dir DIR`` checkpoints ``{params, opt_state, step}`` with
`blox.ckpt.CheckpointManager` every ``--save-every K`` steps and at the end (also on
Ctrl-C). When DIR holds a checkpoint the run resumes from its latest step up to ``--steps
N`` (the run's total), on any ``--mesh``: the arrays are read straight into this run's
shardings (derived from the rules), so a checkpoint written at TP = 2 resumes at TP = 4
or TP = 1. On the same mesh the resumed lines equal those of a run that never stopped,
bit for bit.

``--fsdp`` shards the parameters and the optimizer state over ``data`` too
(`blox.parallel.fsdp_specs` on top of the TP specs) and trains with
`make_fsdp_train_step`: each layer's weights are all-gathered just before use (the
model calls its layers through `blox.parallel.fsdp_call`) and their gradients leave as a
reduce-scatter. The script prints ``param_bytes_per_device=<int>`` (read from the
arrays' shardings) once before training; the losses equal those of ``--mesh 1x1``.

``--experts E --top-k K`` makes every block's MLP a mixture of E experts
(`blox.nn.MoE`, K experts per token, SwiGLU experts of hidden size 2 x width, a
balancing loss weighted 0.01 and a z-loss 0.001 added to the loss, the routing bias
updated inside the loss from each step's global loads). Dropless by default;
``--capacity-factor C`` caps each expert at C x its even share of a device's tokens
(what overflows is dropped, so the losses then depend on how many devices share the
batch). ``--expert-parallel N`` adds an ``expert`` mesh axis of N devices (the mesh is
D x N x M: data x expert x model): the batch is split over data x expert, the experts
over ``expert`` (`blox.parallel.ExpertParallelMoE`, tokens sent to their experts and
back with all-to-alls; with M > 1 each expert's hidden features are also split over
``model``), and the step is `blox.parallel.ep_value_and_grad` in the script's own
``jax.shard_map``, then the optimizer outside it. Dropless, the losses equal those of
the same MoE on ``--mesh 1x1`` (to about 1e-6). With experts the script prints
``expert_bytes_per_device=<int>`` once, and after each step line a line ``moe step=<n>
dropped=<fraction of the routed choices dropped> load=<each expert's share of them>``.

``--context-parallel C`` adds a ``context`` mesh axis of C devices (the mesh is D x M x
C: data x model x context) and splits every sequence over it: the batch is laid out by
`blox.parallel.cp_batch_spec` (rows over ``data``, the sequence over ``context``), the
blocks are built with ``context_axis='context'`` (their attention runs
`blox.parallel.ring_attention`, or `blox.parallel.allgather_attention` with
``--cp-variant allgather``; RoPE at the global positions of each device's tokens), and
the step reduces the loss and the gradients over ``('data', 'context')``; with
``--fsdp`` the parameters are sharded over both. The losses equal those of ``--mesh
1x1``. With ``--experts`` (dense MoE, no ``--expert-parallel``) the routing loads are
global over data x context. The script prints ``attn_temp_bytes=<int>`` once: the
compiled temporary bytes, per device, of one attention forward and backward (the
gradient with respect to its input) of the first block on this run's shard of the batch.

Text: the source of a few standard-library modules (as ``examples/char_lm.py``).
"""

from __future__ import annotations

import argparse
import contextlib
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
from blox import ckpt  # noqa: E402
from blox import distributed as bd  # noqa: E402
from blox import parallel as bp  # noqa: E402

MODULES = ["textwrap", "string", "bisect", "heapq", "fractions", "difflib"]
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
SIZES = {
    # name: (width, layers, heads, context, global batch, steps, learning rate)
    "tiny": (32, 1, 8, 16, 8, 5, 3e-3),
    "default": (128, 2, 8, 64, 32, 200, 3e-3),
}


def load_tokens() -> np.ndarray:
    text = "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    index = {c: i for i, c in enumerate(CHARS)}
    return np.array([index.get(c, 1) for c in text], dtype=np.int32)


class MoEBlock(bx.Module):
    """A pre-norm block whose MLP is a mixture of experts (`make_moe`)::

    h = x + attn(norm1(x))          # ParallelMultiHeadAttention (heads over model)
    y = h + moe(norm2(h))           # returns (y, moe's aux)
    """

    def __init__(self, graph, width, heads, rng, make_moe, **cp):
        super().__init__(graph)
        self.norm1 = bx.LayerNorm(graph / "norm1")
        self.attn = bp.ParallelMultiHeadAttention(
            graph / "attn", width, heads, rng, use_rope=True, **cp
        )
        self.norm2 = bx.LayerNorm(graph / "norm2")
        self.moe = make_moe(graph / "moe")

    def __call__(self, params, x, *, is_causal=True):
        h, params = self.norm1(params, x)
        a, params = self.attn(params, h, is_causal=is_causal)
        h = x + a
        z, params = self.norm2(params, h)
        (y, aux), params = self.moe(params, z)
        return (h + y, aux), params


class GPT(bx.Module):
    """Token embedding -> ParallelTransformerBlock x L (RoPE, causal; `MoEBlock` with
    `make_moe`) -> LayerNorm -> logits with the tied embedding. Returns ``((logits, [the
    MoE aux of each block]), params)``."""

    def __init__(self, graph, vocab, width, layers, heads, rng, make_moe=None, **cp):
        super().__init__(graph)
        self.embed = bx.Embed(graph / "embed", vocab, width, rng)
        if make_moe is None:
            self.blocks = [
                bp.ParallelTransformerBlock(
                    graph / f"block_{i}",
                    model_size=width,
                    num_heads=heads,
                    rng=rng,
                    use_rope=True,
                    **cp,
                )
                for i in range(layers)
            ]
        else:
            self.blocks = [
                MoEBlock(graph / f"block_{i}", width, heads, rng, make_moe, **cp)
                for i in range(layers)
            ]
        self.final_norm = bx.LayerNorm(graph / "final_norm")

    def __call__(self, params, tokens):
        # fsdp_call: under --fsdp each layer's weights are gathered over `data` just
        # before use and dropped after; otherwise it is the plain call.
        h, params = bp.fsdp_call(self.embed, params, tokens)
        auxes = []
        for block in self.blocks:
            h, params = bp.fsdp_call(block, params, h, is_causal=True)
            if isinstance(h, tuple):  # an MoEBlock: (h, aux)
                h, aux = h
                auxes.append(aux)
        h, params = self.final_norm(params, h)
        logits, params = bp.fsdp_call(self.embed.attend, params, h)
        return (logits, auxes), params


def ep_train_step(loss_fn, tx, mesh, specs, batch_spec):
    """``step(params, opt_state, x, y) -> (params, opt_state, metrics)`` with expert
    parallelism: `ep_value_and_grad` inside ``jax.shard_map`` (batch over data x expert,
    params laid out by `specs`), then the optimizer on the global arrays."""
    grad_fn = bp.ep_value_and_grad(loss_fn, expert_axis="expert", data_axes="data", has_aux=True)
    trainable_specs = specs.split()[0]
    run = jax.shard_map(
        grad_fn,
        mesh=mesh,
        in_specs=(specs, batch_spec, batch_spec),
        out_specs=((P(), P()), trainable_specs, specs),
    )

    def step(params, opt_state, x, y):
        (loss, moe), grads, params = run(params, x, y)
        trainable, rest = params.split()
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates).merge(rest), opt_state, {"loss": loss, **moe}

    return step


def window_starts(seed: int, step: int, batch: int, n_tokens: int, context: int) -> np.ndarray:
    """Where the windows of step `step`'s global batch start: a function of ``(seed,
    step)`` only, so every process, and a resumed run, draws the same windows."""
    return np.random.default_rng((seed, step)).integers(0, n_tokens - context - 1, size=batch)


def attention_temp_bytes(attn, abstract, specs, mesh, x_shape, x_spec) -> int:
    """The compiled temporary bytes per device of one forward and backward (the
    gradient with respect to its input) of `attn` on this run's shard of the batch,
    inside a ``jax.shard_map`` over `mesh` (the context-parallel attention where the
    mesh has a ``context`` axis)."""

    def one(params, x):
        return jax.grad(lambda x: jnp.sum(attn(params, x, is_causal=True)[0]))(x)

    run = jax.shard_map(one, mesh=mesh, in_specs=(specs, x_spec), out_specs=x_spec)
    sds = lambda s, spec: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, spec))  # noqa: E731
    params = jax.tree.map(sds, abstract, specs)
    x = sds(jax.ShapeDtypeStruct(x_shape, jnp.float32), x_spec)
    with jax.default_matmul_precision("highest"):
        compiled = jax.jit(run).lower(params, x).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> list[float]:
    info = bd.initialize()  # first: joins the group under blox.launch, a no-op alone
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=None, help="the run's total steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mesh", default="2x4", help="DxM: data x model devices")
    parser.add_argument(
        "--fsdp", action="store_true", help="shard params and optimizer state over data"
    )
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint here; resume if it holds one")
    parser.add_argument("--save-every", type=int, default=50, help="steps between checkpoints")
    parser.add_argument("--experts", type=int, default=None, help="E: MoE MLPs of E experts")
    parser.add_argument("--top-k", type=int, default=2, help="K: experts per token")
    parser.add_argument(
        "--capacity-factor", type=float, default=None, help="per-device expert capacity"
    )
    parser.add_argument(
        "--expert-parallel", type=int, default=None, help="N: experts split over N devices"
    )
    parser.add_argument(
        "--context-parallel", type=int, default=None, help="C: sequences split over C devices"
    )
    parser.add_argument(
        "--cp-variant",
        choices=("ring", "allgather"),
        default=None,
        help="the context-parallel attention (default ring)",
    )
    args = parser.parse_args(argv)
    width, layers, heads, context, batch, steps, lr = SIZES[args.size]
    steps = args.steps or steps
    try:
        d, m = (int(v) for v in args.mesh.lower().split("x"))
    except ValueError:
        parser.error(f"--mesh must look like 2x4, got {args.mesh!r}")
    if not (d >= 1 and m >= 1 and d * m <= jax.device_count()):
        parser.error(f"--mesh {args.mesh} needs {d * m} devices; there are {jax.device_count()}")
    if args.save_every < 1:
        parser.error("--save-every must be >= 1")
    ep = args.expert_parallel
    if args.experts is None and (ep is not None or args.capacity_factor is not None):
        parser.error("--expert-parallel and --capacity-factor need --experts E")
    if args.experts is not None and args.fsdp:
        parser.error("--experts does not combine with --fsdp in this example")
    if ep is not None and not (ep >= 1 and args.experts % ep == 0):
        parser.error(f"--expert-parallel {ep} must divide --experts {args.experts}")
    cp = args.context_parallel
    if args.cp_variant is not None and cp is None:
        parser.error("--cp-variant needs --context-parallel C")
    if cp is not None and not (cp >= 1 and context % cp == 0):
        parser.error(f"--context-parallel {cp} must divide the context length {context}")
    if cp is not None and ep is not None:
        parser.error(
            "--context-parallel does not combine with --expert-parallel in this example (the "
            "expert-parallel step, ep_value_and_grad, splits the batch over data x expert "
            "only); use --experts without --expert-parallel, or drop --context-parallel"
        )
    n = (ep or 1) * (cp or 1)
    extra = (
        "" if n == 1 else f" x {'--expert-parallel' if cp is None else '--context-parallel'} {n}"
    )
    if d * n * m > jax.device_count():
        parser.error(f"--mesh {args.mesh}{extra} needs {d * n * m} devices")
    if info.is_multiprocess and d * n * m != jax.device_count():
        parser.error(
            f"with {info.num_processes} processes the mesh must use every device: "
            f"--mesh {args.mesh}{extra} uses {d * n * m} of {jax.device_count()}"
        )

    cp_kw = {}
    if cp is not None:  # data x model x context; the rows over data, the sequence over context
        names = ("data", "model", "context")
        mesh = bp.make_mesh((d, m, cp), names, devices=jax.devices()[: d * m * cp])
        batch_axes = ("data", "context")
        cp_kw = dict(context_axis="context", context_variant=args.cp_variant or "ring")
    elif ep is None:
        mesh = bp.make_mesh((d, m), ("data", "model"), devices=jax.devices()[: d * m])
        batch_axes = "data"
    else:
        names = ("data", "expert", "model")
        mesh = bp.make_mesh((d, n, m), names, devices=jax.devices()[: d * n * m])
        batch_axes = ("data", "expert")
    print(bp.describe_mesh(mesh), flush=True)
    data = load_tokens()

    graph = bx.Graph("gpt")
    rng = bx.Rng(graph / "rng")
    make_moe, moe_rules = None, []
    if args.experts is not None:
        cfg = dict(
            top_k=args.top_k,
            capacity_factor=args.capacity_factor,
            balance_weight=0.01,
            z_weight=1e-3,
            routing_bias=True,
        )
        if ep is None:  # every device holds every expert; the loads are global over the batch
            make_moe = lambda g: bx.MoE(
                g, args.experts, 2 * width, rng, token_axes=batch_axes, **cfg
            )  # noqa: E731
            moe_rules = [("moe/.*", None)]
        else:
            tp = "model" if m > 1 else None
            make_moe = lambda g: bp.ExpertParallelMoE(  # noqa: E731
                g, args.experts, 2 * width, rng, token_axes=batch_axes, model_axis=tp, **cfg
            )
            moe_rules = bp.moe_ep_rules("expert", model_axis=tp) + [("moe/router/.*", None)]
    model = GPT(graph / "lm", len(CHARS), width, layers, heads, rng, make_moe, **cp_kw)
    rules = (
        moe_rules
        # the dense MLP's rules only where the blocks have one
        + [r for r in bp.transformer_tp_rules("model") if not (moe_rules and "mlp/" in r[0])]
        + [
            ("embed/embedding", None),  # replicated (the tied output head)
            ("rng/(seed|counter)", None),
        ]
    )

    def init():
        params = rng.seed(bx.Params(), seed=args.seed)
        _, params = model(params, jnp.zeros((1, context), jnp.int32))
        return params.locked()

    abstract = jax.eval_shape(init)
    print(bp.sharding_table(abstract, rules, mesh), flush=True)
    specs = bp.param_specs(abstract, rules, mesh)
    tp_specs = specs  # the attention measured below takes its whole (TP-split) weights
    if args.fsdp:  # ZeRO-3: every large trainable leaf also sharded over the batch axes
        specs = bp.fsdp_specs(abstract, mesh, axis=batch_axes, base=specs)
    shardings = jax.tree.map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
    params = jax.jit(init, out_shardings=shardings)()
    print(f"param_bytes_per_device={bp.bytes_per_device(params)}", flush=True)
    if make_moe is not None:
        experts = params.split(lambda path, _: "experts" in path)[0]
        print(f"expert_bytes_per_device={bp.bytes_per_device(experts)}", flush=True)
    tx = optax.adamw(lr, weight_decay=0.01)
    trainable = params.split()[0]
    opt_state = jax.jit(
        tx.init,
        out_shardings=bp.opt_state_shardings(jax.eval_shape(tx.init, trainable), specs, mesh),
    )(trainable)

    def loss_fn(params, x, y):
        (logits, auxes), params = model(params, x)
        ll = jax.nn.log_softmax(logits, axis=-1)
        loss = -jnp.mean(jnp.take_along_axis(ll, y[..., None], axis=-1))
        if make_moe is None:
            return loss, params
        for block, aux in zip(model.blocks, auxes, strict=True):
            loss = loss + aux["aux_loss"]
            params = block.moe.update_bias(params, aux["load"], 1e-3)  # global loads
        moe = {k: sum(a[k] for a in auxes) for k in ("dropped", "load")}
        return (loss, moe), params

    has_aux = make_moe is not None
    batch_spec = bp.cp_batch_spec("data", "context") if cp is not None else P(batch_axes)
    bspec = dict(axis=batch_axes, batch_spec=batch_spec)
    if args.fsdp:
        step_fn = bp.make_fsdp_train_step(loss_fn, tx, mesh, specs, **bspec)
    elif ep is None:
        step_fn = bp.make_dp_train_step(
            loss_fn, tx, mesh, param_specs=specs, has_aux=has_aux, **bspec
        )
    else:
        step_fn = ep_train_step(loss_fn, tx, mesh, specs, batch_spec)
    step = jax.jit(step_fn, donate_argnums=(0, 1))
    x_shape = (batch, context, width)
    attn = model.blocks[0].attn
    attn_bytes = attention_temp_bytes(attn, abstract, tp_specs, mesh, x_shape, batch_spec)
    print(f"attn_temp_bytes={attn_bytes}", flush=True)
    # The rows as global_batch lays them out (over the data axes); under context
    # parallelism the step then splits each row's sequence over `context` itself.
    batch_sharding = NamedSharding(mesh, P(batch_spec[0]))
    shard = bd.process_shard(batch, batch_sharding)  # the rows this process builds
    state = {"params": params, "opt_state": opt_state, "step": 0}
    losses = []
    with contextlib.ExitStack() as stack:
        mngr = None
        if args.ckpt_dir is not None:
            mngr = stack.enter_context(
                ckpt.CheckpointManager(args.ckpt_dir, save_every=args.save_every)
            )
            if mngr.latest_step() is not None:
                state = mngr.restore(state)  # read into this run's mesh and shardings
                print(f"resumed from step {state['step']} of {args.ckpt_dir}", flush=True)
        with jax.default_matmul_precision("highest"):
            for i in range(state["step"] + 1, steps + 1):
                starts = window_starts(args.seed, i, batch, len(data), context)[shard.slice]
                chunk = np.stack([data[s : s + context + 1] for s in starts])
                xy = bd.global_batch({"x": chunk[:, :-1], "y": chunk[:, 1:]}, batch_sharding, batch)
                params, opt_state, metrics = step(
                    state["params"], state["opt_state"], xy["x"], xy["y"]
                )
                state = {"params": params, "opt_state": opt_state, "step": i}
                losses.append(float(metrics["loss"]))
                print(f"step={i} loss={losses[-1]!r}", flush=True)
                if has_aux:
                    load = np.asarray(metrics["load"])
                    dropped = float(metrics["dropped"]) / load.sum()
                    shares = " ".join(f"{v:.4f}" for v in load / load.sum())
                    print(f"moe step={i} dropped={dropped:.6f} load={shares}", flush=True)
                if mngr is not None:
                    mngr.save(i, state)  # writes every --save-every steps; the last on exit
    return losses


if __name__ == "__main__":
    main()
