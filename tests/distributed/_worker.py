"""A process of a test group, started by ``python -m blox.launch`` from test_launch.py.

    _worker.py exit RANK CODE      rank RANK exits with CODE at once (no JAX); others sleep
    _worker.py raise RANK          joins the group; rank RANK raises; others loop collectives
    _worker.py loop                joins the group; every rank loops collectives forever
    _worker.py shards              joins the group; prints process_shards for two meshes
    _worker.py sysexit RANK CODE   joins; rank RANK calls sys.exit(CODE); others loop
    _worker.py noinit SECONDS      never joins: sleeps SECONDS, then exits 0
    _worker.py ckpt RANK DIR HOW   joins; rank RANK raises (HOW=raise) or calls
                                   sys.exit(4) (HOW=exit) while the others save a
                                   sharded state with blox.ckpt into DIR (a barrier)
    _worker.py atexit RANK DIR     joins; registers an atexit handler and a buffered
                                   log (logging.handlers.MemoryHandler) writing into
                                   DIR; rank RANK raises, others loop
    _worker.py devices             joins; prints the environment's device settings
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

    if mode == "noinit":
        time.sleep(float(sys.argv[2]))
        print("done without joining", flush=True)
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

    if mode == "devices":
        keys = ("BLOX_LOCAL_RANK", "BLOX_LOCAL_WORLD_SIZE", "JAX_LOCAL_DEVICE_IDS")
        print("env=" + json.dumps({k: os.environ.get(k) for k in keys}), flush=True)
        sys.exit(0)

    if mode == "atexit":
        import atexit
        import logging
        import logging.handlers

        out = sys.argv[3]
        target = logging.FileHandler(os.path.join(out, f"log.{rank}"))
        buffered = logging.handlers.MemoryHandler(capacity=1000, target=target)
        log = logging.getLogger("worker")
        log.addHandler(buffered)
        log.setLevel(logging.INFO)
        log.info("buffered line from process %d", rank)  # written only on flush

        def goodbye():
            with open(os.path.join(out, f"atexit.{rank}"), "w") as f:
                f.write("ran")

        atexit.register(goodbye)

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    x = bd.global_batch(
        np.ones((jax.local_device_count(),), np.float32),
        NamedSharding(mesh, P("data")),
        jax.device_count(),
    )
    total = jax.jit(lambda x: x.sum(), out_shardings=NamedSharding(mesh, P()))
    print(f"sum={float(total(x))}", flush=True)
    if mode in ("raise", "atexit") and rank == int(sys.argv[2]):
        raise RuntimeError(f"boom from process {rank}")
    if mode == "sysexit" and rank == int(sys.argv[2]):
        sys.exit(int(sys.argv[3]))
    if mode == "ckpt":
        from blox import ckpt

        with ckpt.CheckpointManager(sys.argv[3]) as mngr:
            state = {"x": x * 2.0, "step": 1}
            if rank == int(sys.argv[2]) and sys.argv[4] == "raise":
                raise RuntimeError(f"boom from process {rank} before its save")
            if rank == int(sys.argv[2]):
                print("exiting with 4 before the save", flush=True)
                sys.exit(4)
            print("saving", flush=True)
            mngr.save(1, state)
        print("saved", flush=True)
        time.sleep(600)
    while True:
        total(x).block_until_ready()
        time.sleep(0.05)


if __name__ == "__main__":
    main()
