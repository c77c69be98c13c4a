"""Data-parallel training with gradient accumulation: a CNN on scikit-learn's digits.

    python examples/dp_classifier.py                                   # 8 devices, 300 steps
    python examples/dp_classifier.py --data-parallel 1 --accumulate 4  # same losses, 1 device
    python examples/dp_classifier.py --size tiny --steps 5             # seconds (smoke test)

On CPU the script simulates 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
set before JAX starts unless XLA_FLAGS already sets a count). ``--data-parallel N`` puts N
of them on the mesh's ``data`` axis; ``--accumulate K`` splits each device's share of the
batch into K microbatches whose gradients are summed on the device, then all-reduced once
per step (`blox.parallel.make_dp_train_step`). Every step prints
``step=<n> loss=<repr(float(loss))>``: the runs for N = 1 and N = 8 (any K) print the same
losses to about 1e-6, because the step computes the large-batch gradient exactly.

Data and model as ``examples/digits_cnn.py`` (8x8 digits, conv 32 -> pool -> conv 64 ->
pool -> dense 10, Adam), without dropout so that runs on different meshes can be compared
number for number.
"""

from __future__ import annotations

import argparse
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

SIZES = {
    # name: (steps, global batch)
    "tiny": (5, 64),
    "default": (300, 64),
}


def load_data(seed: int = 0):
    """Digits as ``(N, 8, 8, 1)`` float32 in [0, 1] and int32 labels; 80 / 20 split."""
    from sklearn.datasets import load_digits  # the 'examples' extra

    digits = load_digits()
    x = (digits.images.astype(np.float32) / 16.0)[..., None]
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_train = int(0.8 * len(x))
    return x[order[:n_train]], y[order[:n_train]], x[order[n_train:]], y[order[n_train:]]


class DigitsCNN(bx.Module):
    """conv 32 -> ReLU -> pool -> conv 64 -> ReLU -> pool -> dense 10."""

    def __init__(self, graph: bx.Graph, rng: bx.Rng):
        super().__init__(graph)
        self.conv1 = bx.Conv(graph / "conv1", (3, 3), 32, rng)
        self.conv2 = bx.Conv(graph / "conv2", (3, 3), 64, rng)
        self.head = bx.Linear(graph / "head", 10, rng)

    def __call__(self, params: bx.Params, x: jax.Array) -> tuple[jax.Array, bx.Params]:
        x, params = self.conv1(params, x)
        x = bx.max_pool(jax.nn.relu(x), (2, 2))
        x, params = self.conv2(params, x)
        x = bx.max_pool(jax.nn.relu(x), (2, 2))
        return self.head(params, x.reshape(x.shape[0], -1))


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-parallel", type=int, default=8, help="devices on the data axis")
    parser.add_argument("--accumulate", type=int, default=1, help="microbatches per device")
    args = parser.parse_args(argv)
    steps, batch = SIZES[args.size]
    steps = args.steps or steps
    n = args.data_parallel
    if not 1 <= n <= len(jax.devices()):
        parser.error(f"--data-parallel must be in 1..{len(jax.devices())}")

    mesh = bp.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    print(bp.describe_mesh(mesh), f"| accumulate {args.accumulate}", flush=True)
    x_train, y_train, x_test, y_test = load_data(args.seed)

    graph = bx.Graph("net")
    rng = bx.Rng(graph / "rng")
    model = DigitsCNN(graph / "cnn", rng)
    params = rng.seed(bx.Params(), seed=args.seed)
    _, params = model(params, x_train[:2])
    params = params.locked()
    tx = optax.adam(1e-3)

    # Every parameter replicated (pure data parallelism), said by one explicit rule.
    rules = [(".*", None)]
    specs = bp.param_specs(params, rules, mesh)
    params = jax.device_put(params, bp.param_shardings(params, rules, mesh))
    trainable = params.split()[0]
    opt_state = jax.jit(
        tx.init,
        out_shardings=bp.opt_state_shardings(jax.eval_shape(tx.init, trainable), specs, mesh),
    )(trainable)

    def loss_fn(params, x, y):
        logits, params = model(params, x)
        loss = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))
        accuracy = jnp.mean((jnp.argmax(logits, -1) == y).astype(jnp.float32))
        return (loss, {"accuracy": accuracy}), params

    step = jax.jit(
        bp.make_dp_train_step(
            loss_fn, tx, mesh, microbatches=args.accumulate, has_aux=True, param_specs=specs
        ),
        donate_argnums=(0, 1),
    )

    @jax.jit
    def evaluate(params, x, y):
        logits, _ = model(params, x)
        return jnp.mean(jnp.argmax(logits, -1) == y)

    data_rng = np.random.default_rng(args.seed)
    losses = []
    with jax.default_matmul_precision("highest"):
        for i in range(1, steps + 1):
            idx = data_rng.integers(0, len(x_train), size=batch)
            params, opt_state, metrics = step(params, opt_state, x_train[idx], y_train[idx])
            losses.append(float(metrics["loss"]))
            print(f"step={i} loss={losses[-1]!r}", flush=True)
        accuracy = float(evaluate(params, x_test, y_test))
    print(f"test accuracy {accuracy:.4f} after {steps} steps (chance 0.10)")
    return losses


if __name__ == "__main__":
    main()
