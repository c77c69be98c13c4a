"""A small YOLO-style backbone + neck, trained to find objects on generated images.

    python examples/yolo_blocks.py               # the demo
    python examples/yolo_blocks.py --size tiny   # seconds (smoke test)

What it shows: `bx.YOLOBackboneNeck` (Conv-BN-SiLU units, C2f blocks, SPPF, the FPN
upsample-and-concat / PAN neck) with a 1x1 `bx.Conv` head per scale, lazy initialization,
the parameter table, the output shape at every scale (strides 8, 16, 32), and a hand-written
train step that updates the trainable params with Optax and keeps the BatchNorm running
statistics (non-trainable params) returned by the forward pass.

The task: each generated image holds a few bright squares of three sizes on noise; each
scale predicts an "objectness" map (is there an object centre in this cell?) for the
squares of its size, the way YOLO assigns small objects to stride 8 and large ones to
stride 32. No downloads: the data are generated.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import blox as bx

SIZES = {
    # name: (image size, batch, steps, widths, depths)
    "tiny": (32, 8, 12, (8, 8, 8, 8, 8), (1, 1, 1, 1)),
    "default": (64, 32, 300, (16, 32, 64, 128, 256), (1, 2, 2, 1)),
}
STRIDES = (8, 16, 32)


def make_batch(rs: np.random.Generator, n: int, size: int) -> tuple[np.ndarray, list]:
    """Images (n, size, size, 3) and one objectness target (n, size/s, size/s, 1) per
    stride s: a square of side s (drawn in colour channel `level`) fills one cell of
    the stride-s grid."""
    x = rs.normal(0.0, 0.3, (n, size, size, 3)).astype(np.float32)
    targets = [np.zeros((n, size // s, size // s, 1), np.float32) for s in STRIDES]
    for i in range(n):
        for level, s in enumerate(STRIDES):
            cells = size // s
            cy, cx = rs.integers(0, cells, 2)
            x[i, cy * s : (cy + 1) * s, cx * s : (cx + 1) * s, level] += 1.5
            targets[level][i, cy, cx, 0] = 1.0
    return x, targets


def build(widths, depths):
    graph = bx.Graph("yolo")
    rng = bx.Rng(graph / "rng")
    features = bx.YOLOBackboneNeck(graph / "features", rng, widths=widths, depths=depths)
    heads = [bx.Conv(graph / f"head_p{level + 3}", (1, 1), 1, rng) for level in range(3)]
    return graph, rng, features, heads


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    size, batch, steps, widths, depths = SIZES[args.size]
    steps = args.steps or steps
    rs = np.random.default_rng(args.seed)
    _, rng, features, heads = build(widths, depths)

    def forward(params, x, is_training):
        feats, params = features(params, x, is_training=is_training)
        logits = []
        for head, f in zip(heads, feats, strict=True):
            y, params = head(params, f)
            logits.append(y)
        return (feats, logits), params

    # Lazy init: one forward pass on params holding a seeded Rng, then lock.
    x0, _ = make_batch(rs, batch, size)
    t0 = time.perf_counter()
    params = rng.seed(bx.Params(), seed=args.seed)
    (feats, logits), params = forward(params, jnp.asarray(x0), False)
    params = params.locked()
    print(bx.params_table(params))
    print(f"init: {time.perf_counter() - t0:.1f}s")
    for s, f, lg in zip(STRIDES, feats, logits, strict=True):
        print(f"stride {s:2d}: features {tuple(f.shape)}  objectness {tuple(lg.shape)}")

    tx = optax.adam(3e-3)
    opt_state = tx.init(params.split()[0])

    def loss_fn(trainable, non_trainable, x, targets):
        (_, logits), new = forward(trainable.merge(non_trainable), x, True)
        losses = [
            jnp.mean(optax.sigmoid_binary_cross_entropy(lg, t))
            for lg, t in zip(logits, targets, strict=True)
        ]
        return sum(losses) / 3.0, new

    @jax.jit
    def train_step(params, opt_state, x, targets):
        trainable, non_trainable = params.split()
        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable, x, targets
        )
        updates, opt_state = tx.update(grads, opt_state, trainable)
        _, new_stats = new.split()  # the running statistics after this batch
        return optax.apply_updates(trainable, updates).merge(new_stats), opt_state, loss

    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        x, targets = make_batch(rs, batch, size)
        params, opt_state, loss = train_step(params, opt_state, x, targets)
        losses.append(float(loss))
        print(f"step={step + 1} loss={losses[-1]!r}")  # the examples' contract (SPEC section 7)
        if step == 0:
            print(f"compile + first step: {time.perf_counter() - t0:.1f}s")
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {losses[-1]:.4f}")
    print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses


if __name__ == "__main__":
    main()
