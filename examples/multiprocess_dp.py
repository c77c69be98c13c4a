"""Data-parallel regression written with ``jax.shard_map``: one script, 1 process or N.

    python examples/multiprocess_dp.py --size tiny                 # one process
    python -m blox.launch -n 2 --devices-per-process 4 \\
        examples/multiprocess_dp.py --size tiny                    # two processes x 4 devices

What it shows: `bd.initialize()` first thing (a no-op alone, the group's join under the
launcher or a scheduler); a 1-D ``data`` mesh over every device of every process; params
created by ``jax.jit(init, out_shardings=replicated)`` so every process holds the same
replicated copy; each process generating only its rows of every global batch
(`bd.process_shard`, with per-row keys from `bd.row_keys`, so the batch does not depend
on the split) and `bd.global_batch` assembling the global ``jax.Array``; a train step in
``jax.shard_map`` with the gradient all-reduce written out (``lax.pmean`` over
``'data'``). 2 processes x 4 devices print the same ``step=<n> loss=<repr>`` lines as
1 process x 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import distributed as bd

SIZES = {
    # name: (global batch, hidden width, default steps)
    "tiny": (32, 16, 4),
    "default": (256, 64, 200),
}


def make_rows(key: jax.Array, shard: bd.ProcessShard) -> dict[str, np.ndarray]:
    """This process's rows of one global batch: ``x ~ U(-2, 2)^4`` and a smooth target
    plus noise, drawn from one key per global row (the same rows whatever the split)."""
    keys = bd.row_keys(key, shard)

    def one(k):
        kx, kn = jax.random.split(k)
        x = jax.random.uniform(kx, (4,), minval=-2.0, maxval=2.0)
        y = jnp.sin(x[0]) * jnp.cos(x[1]) + 0.5 * x[2] ** 2 - 0.3 * x[3]
        return x, (y + 0.05 * jax.random.normal(kn, ()))[None]

    x, y = jax.vmap(one)(keys)
    return {"x": np.asarray(x), "y": np.asarray(y)}


def main(argv: list[str] | None = None) -> None:
    info = bd.initialize()  # before any other JAX call
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--save-params", default=None, help="process 0 writes params (.npz)")
    args = parser.parse_args(argv)
    batch, hidden, steps = SIZES[args.size]
    steps = args.steps if args.steps is not None else steps
    print(info, flush=True)

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    if batch % mesh.shape["data"]:
        raise ValueError(
            f"the global batch of {batch} does not split over {mesh.shape['data']} devices; "
            "use a device count that divides it."
        )
    replicated = NamedSharding(mesh, P())
    batch_sharding = NamedSharding(mesh, P("data"))
    shard = bd.process_shard(batch, batch_sharding)  # the rows this process generates

    graph = bx.Graph("net")
    rng = bx.Rng(graph / "rng")
    model = bx.MLP(graph / "mlp", (hidden, hidden, 1), rng, activation=jax.nn.tanh)

    def init():
        params = rng.seed(bx.Params(), seed=args.seed)
        _, params = model(params, jnp.zeros((1, 4)))
        return params.locked()

    params = jax.jit(init, out_shardings=replicated)()
    tx = optax.adam(args.lr)
    opt_state = jax.jit(lambda p: tx.init(p.split()[0]), out_shardings=replicated)(params)

    def per_device(params, opt_state, x, y):
        trainable, rest = params.split()

        def loss_fn(trainable):
            pred, _ = model(trainable.merge(rest), x)
            return jnp.mean((pred - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(trainable)
        # The explicit all-reduce: every device's shard has the same size, so the mean of
        # the per-device means is the global mean.
        loss, grads = jax.lax.pmean((loss, grads), "data")
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates).merge(rest), opt_state, loss

    train_step = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=(P(), P(), P()),
        )
    )

    data_key = bd.named_key(args.seed, "data")
    for step in range(1, steps + 1):
        rows = make_rows(jax.random.fold_in(data_key, step), shard)
        global_rows = bd.global_batch(rows, batch_sharding, batch)
        params, opt_state, loss = train_step(params, opt_state, global_rows["x"], global_rows["y"])
        print(f"step={step} loss={float(loss)!r}", flush=True)

    if args.save_params and jax.process_index() == 0:
        flat = {
            jax.tree_util.keystr(path): np.asarray(leaf.addressable_data(0))
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]
        }
        np.savez(args.save_params, **flat)


if __name__ == "__main__":
    main()
