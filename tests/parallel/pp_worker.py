"""A process of the pipeline's multi-process test (tests/parallel/test_pipeline_multiprocess.py),
started by ``python -m blox.launch -n 2 --devices-per-process 4`` or alone on 8 devices.

It builds a small pipelined model on a (data 2, stage 4) mesh over all devices (the stage
axis across both processes when launched), runs one 1F1B step, splits the stage params and the
gradients with `unstack_stages` and prints, per stage, ``stage=<k> params_equal=<bool>
grad=<repr of the sum of |grad|>``, then ``loss=<repr>``; then ``refused=<json>``: the
error the step raises when each process passes its own host (NumPy) rows instead of a
global batch (null if none), when launched.
"""

import json
import sys


def main() -> None:
    # Imported here: pytest's --doctest-modules imports this file, which must do nothing.
    from blox import distributed as bd

    bd.initialize()  # before JAX starts its backends (a single process without the launcher)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import blox as bx
    from blox import parallel as bp

    p, width = 4, 8
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    embed = bx.Linear(g / "embed", width, rng)
    sg = bx.Graph("stage")
    srng = bx.Rng(sg / "rng")
    fc = bx.Linear(sg / "fc", width, srng)

    def first_fn(params, x):
        return embed(params, x, precision="highest")

    def stage_fn(params, h):
        y, params = fc(params, h, precision="highest")
        return h + jnp.tanh(y), params

    def last_fn(params, h, y):
        return jnp.mean((h - y) ** 2), params

    x0 = jnp.zeros((1, 3))
    shared = first_fn(rng.seed(bx.Params(), seed=0), x0)[1].locked()
    h0 = jnp.zeros((1, width))
    stages = [stage_fn(srng.seed(bx.Params(), seed=1 + s), h0)[1].locked() for s in range(p)]
    host = [jax.tree.map(np.asarray, s) for s in stages]
    r = np.random.default_rng(0)
    x = r.normal(size=(16, 3)).astype(np.float32)
    y = r.normal(size=(16, width)).astype(np.float32)

    # The stage axis spans the processes (process 0 holds stages 0 and 1, process 1 stages
    # 2 and 3, each for both data rows): no process holds a whole stage-sharded array.
    devices = np.array(jax.devices()).reshape(p, 2).T
    mesh = jax.sharding.Mesh(devices, ("data", "stage"))

    def put(a, spec):  # a global array from the same host value on every process
        a = np.asarray(a)
        sharding = NamedSharding(mesh, spec)
        return jax.make_array_from_callback(a.shape, sharding, lambda idx: a[idx])

    stacked = jax.tree.map(lambda a: put(a, P("stage")), bp.stack_stages(stages))
    shared_g = jax.tree.map(lambda a: put(a, P()), shared)
    step = jax.jit(
        bp.pipeline_value_and_grad(
            stage_fn,
            last_fn,
            mesh,
            schedule="1f1b",
            num_microbatches=4,
            first_fn=first_fn,
            data_axis="data",
        )
    )
    loss, (g_stage, _), _ = step(stacked, shared_g, put(x, P("data")), put(y, P("data")))
    back = bp.unstack_stages(stacked)
    grads = bp.unstack_stages(g_stage)
    for k in range(p):
        same = all(
            np.array_equal(np.asarray(a), b)
            for a, b in zip(jax.tree.leaves(back[k]), jax.tree.leaves(host[k]), strict=True)
        )
        total = sum(float(np.abs(np.asarray(v)).sum()) for v in jax.tree.leaves(grads[k]))
        print(f"stage={k} params_equal={same} grad={total!r}", flush=True)
    print(f"loss={float(np.asarray(loss))!r}", flush=True)
    if jax.process_count() > 1:  # this process's rows as host arrays: refused
        half = slice(jax.process_index() * 8, jax.process_index() * 8 + 8)
        try:
            step(stacked, shared_g, x[half], y[half])
            refused = None
        except ValueError as e:
            refused = str(e)
        print("refused=" + json.dumps(refused), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
