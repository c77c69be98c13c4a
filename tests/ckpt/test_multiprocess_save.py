"""A checkpoint saved by 2 processes (``python -m blox.launch -n 2
--devices-per-process 4``) restores in 1 process, onto other layouts.

The group saves a train state laid out on a (4, 2) ``data`` x ``model`` mesh that spans
both processes (a TP-sharded kernel, replicated weights, an Adam state after two updates,
a bf16 array, an array split over both axes, a Python int step). Each process writes only
the shards it holds. This process (8 simulated devices, one process) restores it onto an
(8,) data mesh and onto one device.

Reference: the same state computed here in one process, from the same seed with the same
element-wise arithmetic (bit for bit whatever the layout: the random initializers use
partitionable Threefry, the made-up gradients are ``0.5 * w + 0.1``), and ``np.arange``
for the split array.

Each process also saves the position of its shard of a `blox.data.pipeline` (after STEP
batches): restored by one process it raises naming both process counts, and
``data_from_step=True`` positions the one-process pipeline at batch STEP,
whose next batch is the uninterrupted one-process pipeline's (the reference).

This file is also the worker: ``python tests/ckpt/test_multiprocess_save.py DIR`` (under
the launcher) saves the state into DIR.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from blox import ckpt

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
STEP, WIDTH, HIDDEN = 7, 8, 16
TX = optax.adam(1e-2)
RULES = [("fc1/kernel", (None, "model")), ("fc1/bias", ("model",)), ("fc2/.*|rng/.*", None)]


def _init():
    graph = bx.Graph("net")
    rng = bx.Rng(graph / "rng")
    fc1 = bx.Linear(graph / "fc1", HIDDEN, rng)
    fc2 = bx.Linear(graph / "fc2", 2, rng)
    params = rng.seed(bx.Params(), seed=3)
    h, params = fc1(params, jnp.zeros((1, WIDTH)))
    _, params = fc2(params, h)
    return params.locked()


def _data(shard_index=0, shard_count=1):
    from blox.data import ArraySource, pipeline

    source = ArraySource({"x": np.arange(64.0).reshape(32, 2)})
    return pipeline(
        source, batch_size=4, shuffle=True, seed=1, num_epochs=None, drop_remainder=True,
        shard_index=shard_index, shard_count=shard_count, read_threads=0, prefetch=0,
    )  # fmt: skip


def _update(params, opt_state):
    trainable, rest = params.split()
    grads = jax.tree.map(lambda w: 0.5 * w + 0.1, trainable)
    with jax.numpy_dtype_promotion("standard"):  # optax mixes float and int32 counts
        updates, opt_state = TX.update(grads, opt_state, trainable)
    return optax.apply_updates(trainable, updates).merge(rest), opt_state


def _state(param_shardings=None, opt_shardings=None, grid_sharding=None):
    """The train state, laid out by the given shardings (``None``: the default device)."""
    params = jax.jit(_init, out_shardings=param_shardings)()
    opt_state = jax.jit(lambda p: TX.init(p.split()[0]), out_shardings=opt_shardings)(params)
    update = jax.jit(_update, out_shardings=(param_shardings, opt_shardings))
    for _ in range(2):
        params, opt_state = update(params, opt_state)
    grid = np.arange(8 * 6, dtype=np.float32).reshape(8, 6) / 7
    if grid_sharding is None:
        grid_arr = jnp.asarray(grid)
    else:
        grid_arr = jax.make_array_from_callback(grid.shape, grid_sharding, lambda i: grid[i])
    half = jax.jit(lambda p: p[("net", "fc1", "kernel")].value.astype(jnp.bfloat16))(params)
    return {"params": params, "opt_state": opt_state, "grid": grid_arr, "half": half, "step": 0}


def worker(directory: str) -> None:
    """Runs in each process of the group: saves the (4, 2)-mesh state into `directory`."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from blox import parallel as bp

    mesh = bp.make_mesh((4, 2), ("data", "model"))
    abstract = jax.eval_shape(_init)
    specs = bp.param_specs(abstract, RULES, mesh)
    trainable = jax.eval_shape(lambda p: p.split()[0], abstract)
    state = _state(
        bp.param_shardings(abstract, RULES, mesh),
        bp.opt_state_shardings(jax.eval_shape(TX.init, trainable), specs, mesh),
        NamedSharding(mesh, P("data", "model")),
    )
    state["step"] = STEP
    kernel = state["params"][("net", "fc1", "kernel")].value
    assert not kernel.is_fully_addressable  # the state really spans the processes
    it = iter(_data(jax.process_index(), jax.process_count()))
    for _ in range(STEP):
        next(it)
    with ckpt.CheckpointManager(directory) as mngr:
        mngr.save(STEP, state, data_iterator=it)
    print(f"saved step {STEP} from process {jax.process_index()}", flush=True)


def _launch_save(directory: Path) -> str:
    from tests.scripts import LAUNCH, run_ok  # the test process only (not the worker)

    return run_ok(
        *LAUNCH, "-n", "2", "--devices-per-process", "4",
        str(Path(__file__).relative_to(ROOT)), str(directory), timeout=300,
    )  # fmt: skip


def test_saved_by_two_processes_restored_in_one(tmp_path):
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from blox import parallel as bp

    out = _launch_save(tmp_path)
    assert "[0] saved step 7 from process 0" in out and "[1] saved step 7 from process 1" in out
    # Each process wrote its own shards.
    written = sorted(p.name for p in (tmp_path / str(STEP) / "state").glob("ocdbt.process_*"))
    assert written == ["ocdbt.process_0", "ocdbt.process_1"], written

    reference = jax.tree.map(np.asarray, _state())  # one process, one device
    mngr = ckpt.CheckpointManager(tmp_path)
    assert mngr.latest_step() == STEP
    description = mngr.description()
    assert description["process_count"] == 2
    assert description["mesh"]["axis_names"] == ["data", "model"]
    assert description["mesh"]["axis_sizes"] == [4, 2]
    assert description["leaves"]["params/net/fc1/kernel"]["spec"] == [None, "model"]

    mesh = bp.make_mesh((8,), ("data",))
    abstract = jax.eval_shape(_init)
    specs = bp.param_specs(abstract, [(".*", None)], mesh)
    trainable = jax.eval_shape(lambda p: p.split()[0], abstract)
    on_mesh = _state(
        bp.param_shardings(abstract, [(".*", None)], mesh),
        bp.opt_state_shardings(jax.eval_shape(TX.init, trainable), specs, mesh),
        NamedSharding(mesh, P("data")),
    )
    on_device = jax.eval_shape(_state)  # abstract, no sharding: the first local device
    on_device["step"] = 0
    for target, layout in [(on_mesh, "(8,) data mesh"), (on_device, "one device")]:
        restored = mngr.restore(target)
        assert restored["step"] == STEP and type(restored["step"]) is int
        got = jax.tree_util.tree_flatten_with_path(restored)[0]
        want = jax.tree.leaves({**reference, "step": STEP})
        assert len(got) == len(want) > 10
        for (path, leaf), value in zip(got, want, strict=True):
            name = f"{layout}: {jax.tree_util.keystr(path)}"
            if isinstance(leaf, int):
                assert leaf == value, name
                continue
            assert leaf.dtype == value.dtype, name
            assert np.asarray(leaf).tobytes() == np.asarray(value).tobytes(), name
            if layout == "one device":
                assert leaf.sharding.device_set == {jax.local_devices()[0]}, name
            else:
                assert leaf.sharding.mesh.shape == mesh.shape, name
        grid = restored["grid"]
        assert grid.addressable_shards[0].data.shape == ((1, 6) if "mesh" in layout else (8, 6))
    # The data positions are one per process of the saving group.
    it = iter(_data())
    with pytest.raises(ValueError, match=f"step {STEP} was saved by 2 processes and is restored"):
        mngr.restore(on_device, data_iterator=it)
    mngr.restore(on_device, data_iterator=it, data_from_step=True)
    reference = iter(_data())
    for _ in range(STEP):
        next(reference)
    np.testing.assert_array_equal(next(it)["x"], next(reference)["x"])
    mngr.close()


if __name__ == "__main__":
    from blox import distributed as bd

    bd.initialize()  # before any other JAX call
    worker(sys.argv[1])
