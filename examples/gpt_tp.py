"""A small GPT-style character LM trained data- x tensor-parallel on a 2-D device mesh.

    python examples/gpt_tp.py --mesh 2x4                 # data 2 x model 4, 200 steps
    python examples/gpt_tp.py --mesh 1x1                 # one device: the same losses
    python examples/gpt_tp.py --size tiny --steps 3 --mesh 1x8   # seconds (smoke test)

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

Text: the source of a few standard-library modules (as ``examples/char_lm.py``).
"""

from __future__ import annotations

import argparse
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

import blox as bx  # noqa: E402
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


class GPT(bx.Module):
    """Token embedding -> ParallelTransformerBlock x L (RoPE, causal) -> LayerNorm ->
    logits with the tied embedding."""

    def __init__(self, graph, vocab, width, layers, heads, rng):
        super().__init__(graph)
        self.embed = bx.Embed(graph / "embed", vocab, width, rng)
        self.blocks = [
            bp.ParallelTransformerBlock(
                graph / f"block_{i}", model_size=width, num_heads=heads, rng=rng, use_rope=True
            )
            for i in range(layers)
        ]
        self.final_norm = bx.LayerNorm(graph / "final_norm")

    def __call__(self, params, tokens):
        h, params = self.embed(params, tokens)
        for block in self.blocks:
            h, params = block(params, h, is_causal=True)
        h, params = self.final_norm(params, h)
        return self.embed.attend(params, h)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mesh", default="2x4", help="DxM: data x model devices")
    args = parser.parse_args(argv)
    width, layers, heads, context, batch, steps, lr = SIZES[args.size]
    steps = args.steps or steps
    try:
        d, m = (int(v) for v in args.mesh.lower().split("x"))
    except ValueError:
        parser.error(f"--mesh must look like 2x4, got {args.mesh!r}")

    mesh = bp.make_mesh((d, m), ("data", "model"), devices=jax.devices()[: d * m])
    print(bp.describe_mesh(mesh), flush=True)
    data = load_tokens()

    graph = bx.Graph("gpt")
    rng = bx.Rng(graph / "rng")
    model = GPT(graph / "lm", len(CHARS), width, layers, heads, rng)
    rules = bp.transformer_tp_rules("model") + [
        ("embed/embedding", None),  # replicated (the tied output head)
        ("rng/(seed|counter)", None),
    ]

    def init():
        params = rng.seed(bx.Params(), seed=args.seed)
        _, params = model(params, jnp.zeros((1, context), jnp.int32))
        return params.locked()

    abstract = jax.eval_shape(init)
    print(bp.sharding_table(abstract, rules, mesh), flush=True)
    specs = bp.param_specs(abstract, rules, mesh)
    params = jax.jit(init, out_shardings=bp.param_shardings(abstract, rules, mesh))()
    tx = optax.adamw(lr, weight_decay=0.01)
    trainable = params.split()[0]
    opt_state = jax.jit(
        tx.init,
        out_shardings=bp.opt_state_shardings(jax.eval_shape(tx.init, trainable), specs, mesh),
    )(trainable)

    def loss_fn(params, x, y):
        logits, params = model(params, x)
        ll = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(ll, y[..., None], axis=-1)), params

    step = jax.jit(
        bp.make_dp_train_step(loss_fn, tx, mesh, param_specs=specs), donate_argnums=(0, 1)
    )
    data_rng = np.random.default_rng(args.seed)
    losses = []
    with jax.default_matmul_precision("highest"):
        for i in range(1, steps + 1):
            starts = data_rng.integers(0, len(data) - context - 1, size=batch)
            chunk = np.stack([data[s : s + context + 1] for s in starts])
            params, opt_state, metrics = step(params, opt_state, chunk[:, :-1], chunk[:, 1:])
            losses.append(float(metrics["loss"]))
            print(f"step={i} loss={losses[-1]!r}", flush=True)
    return losses


if __name__ == "__main__":
    main()
