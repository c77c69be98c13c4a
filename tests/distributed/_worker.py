"""A process of a test group, started by ``python -m blox.launch`` from test_launch.py.

    _worker.py exit RANK CODE      rank RANK exits with CODE at once (no JAX); others sleep
    _worker.py raise RANK          joins the group; rank RANK raises; others loop collectives
    _worker.py loop                joins the group; every rank loops collectives forever
    _worker.py shards              joins the group; prints process_shards for two meshes
Every process first prints ``pid=<rank>:<pid>``.
"""

import json
import os
import sys
import time


def main() -> None:
    # Imported here: pytest's --doctest-modules imports this file, which must do nothing.
    mode = sys.argv[1]
    rank = int(os.environ.get("BLOX_PROCESS_ID", "0"))
    print(f"pid={rank}:{os.getpid()}", flush=True)

    if mode == "exit":
        if rank == int(sys.argv[2]):
            sys.exit(int(sys.argv[3]))
        time.sleep(600)
        sys.exit(0)

    from blox import distributed as bd

    info = bd.initialize()  # before JAX starts its backends
    print(f"joined {info.process_id} of {info.num_processes}", flush=True)

    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    if mode == "shards":
        n = jax.device_count()
        out = {}
        mesh = jax.make_mesh((n,), ("data",))
        out["data"] = bd.process_shards(16, NamedSharding(mesh, P("data")))
        # A 2-D mesh whose model axis spans the processes: devices [[0, 4], [1, 5], ...] by
        # process order, so process 0 and 1 hold the same rows.
        devices = np.array(jax.devices()).reshape(2, n // 2).T
        mesh2 = jax.sharding.Mesh(devices, ("data", "model"))
        out["model_across"] = bd.process_shards(16, NamedSharding(mesh2, P("data")))
        out["mine"] = bd.process_shard(16, NamedSharding(mesh, P("data")))
        print("shards=" + json.dumps(out), flush=True)
        sys.exit(0)

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = bd.global_batch(
        np.ones((jax.local_device_count(),), np.float32),
        NamedSharding(mesh, P("data")),
        jax.device_count(),
    )
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))
    print(f"sum={float(total(x))}", flush=True)
    if mode == "raise" and rank == int(sys.argv[2]):
        raise RuntimeError(f"boom from process {rank}")
    while True:
        total(x).block_until_ready()
        time.sleep(0.05)


if __name__ == "__main__":
    main()
