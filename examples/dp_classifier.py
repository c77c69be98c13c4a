"""Data-parallel training with gradient accumulation: a CNN on scikit-learn's digits.

    python examples/dp_classifier.py                                   # 8 devices, 300 steps
    python examples/dp_classifier.py --data-parallel 1 --accumulate 4  # same losses, 1 device
    python examples/dp_classifier.py --size tiny --steps 5             # seconds (smoke test)
    python -m blox.launch -n 2 --devices-per-process 4 \\
        examples/dp_classifier.py --size tiny                          # 2 processes x 4 devices
    python examples/dp_classifier.py --ckpt-dir /tmp/dp --save-every 50   # resumable

On CPU the script simulates 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``,
set before JAX starts unless XLA_FLAGS already sets a count). ``--data-parallel N`` puts N
of them on the mesh's ``data`` axis; ``--accumulate K`` splits each device's share of the
batch into K microbatches whose gradients are summed on the device, then all-reduced once
per step (`blox.parallel.make_dp_train_step`). Every step prints
``step=<n> loss=<repr(float(loss))>``: the runs for N = 1 and N = 8 (any K) print the same
losses to about 1e-6, because the step computes the large-batch gradient exactly.

One script, one process or N: `blox.distributed.initialize` runs first (a no-op alone;
under ``python -m blox.launch`` or a cluster scheduler it joins the group), the mesh spans
every device of every process, and each process loads only its rows of every global batch
(`blox.distributed.process_shard`; the batch's row indices come from ``(seed, step)``, the
same in every process), assembled into the global array by
`blox.distributed.global_batch`. 2 processes x 4 devices print the same lines as 1 process
x 8 devices (to about 1e-6: the all-reduce adds in another order).

``--ckpt-dir DIR`` checkpoints ``{params, opt_state, step}`` with
`blox.ckpt.CheckpointManager` every ``--save-every K`` steps and at the end (also on
Ctrl-C). When DIR already holds a checkpoint the run resumes from its latest step and
prints the remaining lines up to ``--steps N`` (the run's total): bit for bit the lines of
a run that never stopped, on the same mesh and process count. The batches depend only on
``(seed, step)``, so nothing else needs saving.

Data and model as ``examples/digits_cnn.py`` (8x8 digits, conv 32 -> pool -> conv 64 ->
pool -> dense 10, Adam), without dropout so that runs on different meshes can be compared
number for number.
"""

from __future__ import annotations

import argparse
import contextlib
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


def batch_rows(seed: int, step: int, batch: int, n_train: int) -> np.ndarray:
    """The training-set rows of step `step`'s global batch: a function of ``(seed, step)``
    only, so every process, and a resumed run, draws the same rows."""
    return np.random.default_rng((seed, step)).integers(0, n_train, size=batch)


def main(argv: list[str] | None = None) -> list[float]:
    info = bd.initialize()  # first: joins the group under blox.launch, a no-op alone
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=None, help="the run's total steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data-parallel", type=int, default=8, help="devices on the data axis")
    parser.add_argument("--accumulate", type=int, default=1, help="microbatches per device")
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint here; resume if it holds one")
    parser.add_argument("--save-every", type=int, default=100, help="steps between checkpoints")
    args = parser.parse_args(argv)
    steps, batch = SIZES[args.size]
    steps = args.steps or steps
    n = args.data_parallel
    if not 1 <= n <= jax.device_count():
        parser.error(f"--data-parallel must be in 1..{jax.device_count()}")
    if info.is_multiprocess and n != jax.device_count():
        parser.error(
            f"with {info.num_processes} processes the mesh must use every device: pass "
            f"--data-parallel {jax.device_count()}"
        )
    if args.save_every < 1:
        parser.error("--save-every must be >= 1")

    mesh = bp.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    print(bp.describe_mesh(mesh), f"| accumulate {args.accumulate}", flush=True)
    x_train, y_train, x_test, y_test = load_data(args.seed)

    graph = bx.Graph("net")
    rng = bx.Rng(graph / "rng")
    model = DigitsCNN(graph / "cnn", rng)

    def init():
        params = rng.seed(bx.Params(), seed=args.seed)
        _, params = model(params, jnp.zeros((2, *x_train.shape[1:]), jnp.float32))
        return params.locked()

    # Every parameter replicated (pure data parallelism), said by one explicit rule; the
    # params are created in place on every device of every process.
    rules = [(".*", None)]
    abstract = jax.eval_shape(init)
    specs = bp.param_specs(abstract, rules, mesh)
    params = jax.jit(init, out_shardings=bp.param_shardings(abstract, rules, mesh))()
    tx = optax.adam(1e-3)
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

    batch_sharding = NamedSharding(mesh, P("data"))
    shard = bd.process_shard(batch, batch_sharding)  # the rows this process loads
    state = {"params": params, "opt_state": opt_state, "step": 0}
    losses = []
    with contextlib.ExitStack() as stack:
        mngr = None
        if args.ckpt_dir is not None:
            mngr = stack.enter_context(
                ckpt.CheckpointManager(args.ckpt_dir, save_every=args.save_every)
            )
            if mngr.latest_step() is not None:
                state = mngr.restore(state)  # into this run's shardings
                print(f"resumed from step {state['step']} of {args.ckpt_dir}", flush=True)
        with jax.default_matmul_precision("highest"):
            for i in range(state["step"] + 1, steps + 1):
                rows = batch_rows(args.seed, i, batch, len(x_train))[shard.slice]
                xy = bd.global_batch(
                    {"x": x_train[rows], "y": y_train[rows]}, batch_sharding, batch
                )
                params, opt_state, metrics = step(
                    state["params"], state["opt_state"], xy["x"], xy["y"]
                )
                state = {"params": params, "opt_state": opt_state, "step": i}
                losses.append(float(metrics["loss"]))
                print(f"step={i} loss={losses[-1]!r}", flush=True)
                if mngr is not None:
                    mngr.save(i, state)  # writes every --save-every steps; the last on exit
            replicated = NamedSharding(mesh, P())
            x_test, y_test = (jax.device_put(a, replicated) for a in (x_test, y_test))
            accuracy = float(evaluate(state["params"], x_test, y_test))
    print(f"test accuracy {accuracy:.4f} after {state['step']} steps (chance 0.10)")
    return losses


if __name__ == "__main__":
    main()
