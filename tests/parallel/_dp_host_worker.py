"""A process of a 2-process group started by ``python -m blox.launch`` from
``test_dp_multiprocess.py``: the DP step fed with each process's own rows (refused) and
with the global batch that `blox.distributed.global_batch` assembles (trained).

Prints ``result=<json>``: for each wrong way of passing the rows, the error message (or
``null`` if none was raised), and the loss and kernel of one step on the global batch next
to the same step computed on this process's CPU with plain ``jax.value_and_grad`` over all
rows (the reference).
"""

import json
import os


def main() -> None:
    # Imported here: pytest's --doctest-modules imports this file, which must do nothing.
    from blox import distributed as bd

    bd.initialize()  # before JAX starts its backends
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import blox as bx
    from blox import parallel as bp

    rank = int(os.environ.get("BLOX_PROCESS_ID", "0"))
    rows, n = 8, jax.process_count()
    r = np.random.default_rng(0)  # the same global rows in every process
    x = r.normal(size=(rows, 3)).astype(np.float32)
    y = r.normal(size=(rows, 2)).astype(np.float32)
    mine = slice(rank * rows // n, (rank + 1) * rows // n)
    x_local, y_local = x[mine], y[mine]

    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 2, rng)
    host = fc(rng.seed(bx.Params(), seed=0), jnp.zeros((1, 3)))[1].locked()

    def loss_fn(p, x, y):
        y_hat, p = fc(p, x, precision="highest")
        return jnp.mean((y_hat - y) ** 2), p

    tx = optax.sgd(0.5)
    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    rep = NamedSharding(mesh, P())
    params = jax.device_put(host, rep)
    opt_state = jax.device_put(tx.init(host.split()[0]), rep)
    raw = bp.make_dp_train_step(loss_fn, tx, mesh)
    step = jax.jit(raw)

    def error(f, *batch):
        try:
            f(params, opt_state, *batch)
        except ValueError as e:
            return str(e)
        return None

    out = {
        "jit_numpy": error(step, x_local, y_local),
        "eager_numpy": error(raw, x_local, y_local),
        "jit_local_array": error(step, jnp.asarray(x_local), jnp.asarray(y_local)),
    }
    # The same under jit on an Auto mesh (its traced types carry no sharding either).
    auto = bp.make_mesh((jax.device_count(),), ("data",), axis_types="auto")
    auto_step = jax.jit(bp.make_dp_train_step(loss_fn, tx, auto))
    out["auto_jit_numpy"] = error(auto_step, x_local, y_local)
    # The FSDP step shares the DP step's batch checks.
    specs = bp.fsdp_specs(host, mesh, min_size=1)
    fsdp_step = jax.jit(bp.make_fsdp_train_step(loss_fn, tx, mesh, specs))
    out["fsdp_jit_numpy"] = error(fsdp_step, x_local, y_local)
    batch = bd.global_batch((x_local, y_local), NamedSharding(mesh, P("data")), rows)
    new, _, metrics = step(params, opt_state, *batch)
    kernel = jax.jit(lambda p: p["net", "fc", "kernel"].value, out_shardings=rep)(new)
    out["loss"] = float(metrics["loss"])
    out["kernel"] = np.asarray(kernel.addressable_data(0)).tolist()

    # The reference: one device of this process, all rows, plain jax.
    t = host.split()[0]
    ref_loss, grads = jax.value_and_grad(lambda t: loss_fn(t, x, y)[0])(t)
    ref = optax.apply_updates(t, tx.update(grads, tx.init(t), t)[0])
    out["ref_loss"] = float(ref_loss)
    out["ref_kernel"] = np.asarray(ref["net", "fc", "kernel"].value).tolist()
    print("result=" + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
