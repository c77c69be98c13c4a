"""Train an MLP on a generated regression problem: the blox pattern end to end.

    python examples/mlp_regression.py              # the demo (`make demo`)
    python examples/mlp_regression.py --size tiny  # a few seconds (smoke test)

What it shows: a model defined on a `bx.Graph`, lazy initialization on params holding
a seeded `bx.Rng`, `params.locked()`, the train step from `bx.make_train_step` (the
split/grad/merge pattern: gradients on trainable params only, the Rng counter carried as
non-trainable state) with Optax Adam on a flat-then-cosine schedule, `jax.jit` with
buffer donation, the `bx.fit` loop (progress bar, evaluation, per-epoch log with compile
time and throughput), the loss curve saved as a PNG, and the final parameter table.
"""

from __future__ import annotations

import argparse
import os

import jax
import numpy as np
import optax

import blox as bx

SIZES = {
    # name: (train examples, epochs, batch, hidden width)
    "tiny": (512, 8, 64, 32),
    "default": (8192, 60, 256, 128),
}
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "mlp_regression.png")


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
    parser.add_argument("--plot", default=DEFAULT_PLOT, help="where to save the loss curve")
    args = parser.parse_args(argv)
    n, epochs, batch, hidden = SIZES[args.size]
    steps_per_epoch = n // batch

    x_train, y_train = make_data(n, seed=args.seed)
    x_test, y_test = make_data(1024, seed=args.seed + 1)
    graph, rng, model = build(hidden)

    # Lazy init: structure is defined; one forward pass on seeded params creates it all.
    params = rng.seed(bx.Params(), seed=args.seed)
    _, params = model(params, x_train[:batch], is_training=False)
    params = params.locked()

    schedule = bx.flat_cosine_schedule(3e-3, epochs * steps_per_epoch, pct_start=0.5)
    tx = optax.adam(schedule)
    opt_state = tx.init(params.split()[0])  # optimizer state for trainable params only

    def loss_fn(params, x, y):
        preds, params = model(params, x, is_training=True)  # advances the Rng counter
        return bx.mse(preds, y), params

    train_step = jax.jit(bx.make_train_step(loss_fn, tx), donate_argnums=(0, 1))

    @jax.jit
    def evaluate(params, x, y):
        preds, _ = model(params, x, is_training=False)
        return {"loss": bx.mse(preds, y)}

    data_rng = np.random.default_rng(args.seed)

    def epoch_batches(epoch: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """A fresh shuffle per epoch (a list, so the progress bar knows its length)."""
        order = data_rng.permutation(n)[: steps_per_epoch * batch].reshape(steps_per_epoch, -1)
        return [(x_train[idx], y_train[idx]) for idx in order]

    print(f"blox {bx.__version__} | jax {jax.__version__} | {jax.devices()[0].platform}")
    print(
        f"training an MLP on {n} examples: {epochs} epochs x {steps_per_epoch} steps "
        f"(batch {batch})"
    )
    result = bx.fit(
        train_step,
        params,
        opt_state,
        epoch_batches,
        epochs=epochs,
        eval_fn=lambda p: evaluate(p, x_test, y_test),
        loggers=[bx.StdoutLogger(keys=["train/loss", "eval/loss", "time/steps_per_s"])],
    )
    params, history = result.params, result.history
    first = history.rows[0]
    steps_per_s = np.median(history["time/steps_per_s"])
    print(
        f"compile (first step) {first['time/compile_s']:.2f} s; then {steps_per_s:.0f} "
        f"steps/s ({steps_per_s * batch:.0f} examples/s); stopped: {result.stopped}"
    )
    final = float(evaluate(params, x_test, y_test)["loss"])
    print(f"final test mse {final:.4f} (the target's variance is {float(np.var(y_test)):.4f})")
    if args.plot:
        bx.plot_history(history, ["train/loss", "eval/loss"], path=args.plot, logy=True)
        print(f"loss curve saved to {os.path.relpath(args.plot)}")
    print()
    bx.display(graph, params)
    return final


if __name__ == "__main__":
    main()
