"""Train a small CNN on real handwritten digits (scikit-learn's 8x8 digits, no download).

    python examples/digits_cnn.py               # ~600 steps; reaches >= 97 % test accuracy
    python examples/digits_cnn.py --size tiny   # a few seconds (smoke test)

Data: ``sklearn.datasets.load_digits`` ships 1797 grey-scale 8x8 images (values 0..16) of
the digits 0-9 with scikit-learn (``pip install 'blox[examples]'``). They are scaled to
[0, 1], shuffled with a fixed seed and split 80 / 20 into train and test sets.

Model (channels-last, ``(B, 8, 8, 1)``): `Conv` 3x3 -> 32, ReLU, 2x2 `max_pool`,
`Conv` 3x3 -> 64, ReLU, 2x2 `max_pool`, flatten, `Dropout`, `Linear` -> 10; softmax
cross-entropy; Optax Adam. The train step is the split/grad/merge pattern written out by
hand, jitted with buffer donation.
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
    # name: (steps, batch size)
    "tiny": (100, 64),
    "default": (600, 64),
}
TARGET_ACCURACY = 0.97  # what the default size reaches (checked at the end)


def load_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits as ``(N, 8, 8, 1)`` float32 in [0, 1] and int32 labels; 80 / 20 split."""
    from sklearn.datasets import load_digits  # optional dependency: the 'examples' extra

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_train = int(0.8 * len(x))
    train, test = order[:n_train], order[n_train:]
    return x[train], y[train], x[test], y[test]


class DigitsCNN(bx.Module):
    """conv 32 -> ReLU -> pool -> conv 64 -> ReLU -> pool -> dropout -> dense 10."""

    def __init__(self, graph: bx.Graph, rng: bx.Rng):
        super().__init__(graph)
        self.conv1 = bx.Conv(graph / "conv1", (3, 3), 32, rng)
        self.conv2 = bx.Conv(graph / "conv2", (3, 3), 64, rng)
        self.drop = bx.Dropout(graph / "drop", 0.3, rng)
        self.head = bx.Linear(graph / "head", 10, rng)

    def __call__(
        self, params: bx.Params, x: jax.Array, is_training: bool = True
    ) -> tuple[jax.Array, bx.Params]:
        x, params = self.conv1(params, x)  # (B, 8, 8, 32)
        x = bx.max_pool(jax.nn.relu(x), (2, 2))  # (B, 4, 4, 32)
        x, params = self.conv2(params, x)  # (B, 4, 4, 64)
        x = bx.max_pool(jax.nn.relu(x), (2, 2))  # (B, 2, 2, 64)
        x = x.reshape(x.shape[0], -1)  # (B, 256)
        x, params = self.drop(params, x, is_training=is_training)
        return self.head(params, x)  # (B, 10) logits


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels))


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    steps, batch = SIZES[args.size]

    x_train, y_train, x_test, y_test = load_data(args.seed)
    graph = bx.Graph("net")
    rng = bx.Rng(graph / "rng")
    model = DigitsCNN(graph / "cnn", rng)

    # Lazy init: one forward pass on params holding a seeded Rng, then lock.
    params = rng.seed(bx.Params(), seed=args.seed)
    _, params = model(params, x_train[:batch], is_training=False)
    params = params.locked()

    tx = optax.adam(optax.cosine_decay_schedule(3e-3, steps))
    opt_state = tx.init(params.split()[0])

    def loss_fn(trainable, non_trainable, x, y):
        logits, new_params = model(trainable.merge(non_trainable), x, is_training=True)
        return cross_entropy(logits, y), new_params.split()[1]  # the advanced Rng counter

    @jax.jit(donate_argnums=(0, 1))
    def train_step(params, opt_state, x, y):
        trainable, non_trainable = params.split()
        (loss, non_trainable), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable, x, y
        )
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates).merge(non_trainable), opt_state, loss

    @jax.jit
    def evaluate(params, x, y):
        logits, _ = model(params, x, is_training=False)
        return cross_entropy(logits, y), jnp.mean(jnp.argmax(logits, -1) == y)

    print(f"blox {bx.__version__} | jax {jax.__version__} | {jax.devices()[0].platform}")
    print(
        f"digits: {len(x_train)} train / {len(x_test)} test images of 8x8; {steps} steps of "
        f"batch {batch}"
    )
    data_rng = np.random.default_rng(args.seed)
    report = max(1, steps // 10)
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        idx = data_rng.integers(0, len(x_train), size=batch)
        params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
        if step == 1 or step % report == 0 or step == steps:
            test_loss, test_acc = evaluate(params, x_test, y_test)
            print(
                f"step {step:4d}  loss {float(loss):.4f}  test loss {float(test_loss):.4f}  "
                f"test accuracy {float(test_acc):.4f}"
            )
    elapsed = time.perf_counter() - t0
    _, accuracy = evaluate(params, x_test, y_test)
    accuracy = float(accuracy)
    print(f"{steps} steps in {elapsed:.1f} s (compilation included)")
    print(f"final test accuracy {accuracy:.4f} (chance 0.10)")
    if args.size == "default":
        verdict = "reached" if accuracy >= TARGET_ACCURACY else "NOT reached"
        print(f"target test accuracy >= {TARGET_ACCURACY:.2f}: {verdict}")
    print()
    bx.display(graph, params)
    return accuracy


if __name__ == "__main__":
    main()
