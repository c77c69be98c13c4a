"""Train an MLP on a generated regression problem: the blox pattern end to end.

    python examples/mlp_regression.py            # the demo (`make demo`)
    python examples/mlp_regression.py --size tiny  # a few seconds (smoke test)

What it shows: a model defined on a `bx.Graph`, lazy initialization on params holding
a seeded `bx.Rng`, `params.locked()`, the split/grad/merge train step written by hand
with Optax Adam, `jax.jit` with buffer donation, and the final parameter table.
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
    # name: (train examples, steps, batch, hidden width)
    "tiny": (512, 60, 64, 32),
    "default": (8192, 2000, 256, 128),
}


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A smooth nonlinear function of 4 inputs plus noise (generated, no downloads)."""
    rs = np.random.default_rng(seed)
    x = rs.uniform(-2.0, 2.0, size=(n, 4)).astype(np.float32)
    y = (
        np.sin(x[:, 0]) * np.cos(x[:, 1])
        + 0.5 * x[:, 2] ** 2
        - 0.3 * x[:, 3]
        + 0.05 * rs.standard_normal(n)
    )
    return x, y[:, None].astype(np.float32)


def build(hidden: int):
    """The model: an MLP with dropout between the hidden layers."""
    graph = bx.Graph("net")
    rng = bx.Rng(graph.child("rng"))
    model = bx.Sequential(
        graph.child("body"),
        [
            bx.Linear(graph.child("fc1"), hidden, rng),
            jax.nn.gelu,
            bx.Dropout(graph.child("drop"), 0.05, rng),
            bx.Linear(graph.child("fc2"), hidden, rng),
            jax.nn.gelu,
            bx.Linear(graph.child("head"), 1, rng),
        ],
    )
    return graph, rng, model


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    n, steps, batch, hidden = SIZES[args.size]

    x_train, y_train = make_data(n, seed=args.seed)
    x_test, y_test = make_data(1024, seed=args.seed + 1)
    graph, rng, model = build(hidden)

    # Lazy init: structure is defined; one forward pass on seeded params creates it all.
    params = rng.seed(bx.Params(), seed=args.seed)
    _, params = model(params, x_train[:batch], is_training=False)
    params = params.locked()

    tx = optax.adam(optax.cosine_decay_schedule(3e-3, steps))
    opt_state = tx.init(params.split()[0])  # optimizer state for trainable params only

    def loss_fn(trainable, non_trainable, x, y):
        preds, new_params = model(trainable.merge(non_trainable), x, is_training=True)
        _, new_non_trainable = new_params.split()  # the advanced RNG counter
        return jnp.mean((preds - y) ** 2), new_non_trainable

    @jax.jit(donate_argnums=(0, 1))
    def train_step(params, opt_state, x, y):
        trainable, non_trainable = params.split()
        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable, x, y
        )
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        return trainable.merge(non_trainable), opt_state, loss

    @jax.jit
    def evaluate(params, x, y):
        preds, _ = model(params, x, is_training=False)
        return jnp.mean((preds - y) ** 2)

    print(f"blox {bx.__version__} | jax {jax.__version__} | {jax.devices()[0].platform}")
    print(f"training an MLP on {n} examples for {steps} steps (batch {batch})")
    data_rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    report = max(1, steps // 10)
    for step in range(1, steps + 1):
        idx = data_rng.integers(0, n, size=batch)
        params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
        if step == 1:
            loss.block_until_ready()
            print(
                f"step {step:5d}  loss {float(loss):.4f}  (compiled in "
                f"{time.perf_counter() - t0:.2f} s)"
            )
            t0 = time.perf_counter()
        elif step % report == 0 or step == steps:
            test = float(evaluate(params, x_test, y_test))
            print(f"step {step:5d}  loss {float(loss):.4f}  test mse {test:.4f}")
    elapsed = time.perf_counter() - t0
    print(f"{steps - 1} steps in {elapsed:.2f} s ({(steps - 1) / elapsed:.0f} steps/s)")
    final = float(evaluate(params, x_test, y_test))
    print(f"final test mse {final:.4f} (the target's variance is {float(np.var(y_test)):.4f})")
    print()
    bx.display(graph, params)
    return final


if __name__ == "__main__":
    main()
