"""blox.distributed in one process: shards and their checks, the global batch, RNG streams
(against hand-written ``fold_in`` loops), initialize() as a no-op and its errors, and the
roll call between threads standing in for processes."""

from __future__ import annotations

import threading
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from blox import distributed as bd
from blox.distributed._rendezvous import roll_call
from tests.tolerances import tol


def _mesh(shape=(8,), names=("data",)):
    return jax.make_mesh(shape, names)


# --- shards ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_process_shards_tile_the_batch_in_process_order(n):
    shards = bd.process_shards(32, num_processes=n)
    b = 32 // n
    assert [(s.index, s.count, s.start, s.stop) for s in shards] == [
        (p, n, p * b, (p + 1) * b) for p in range(n)
    ]
    rows = np.concatenate([np.arange(32)[s.slice] for s in shards])
    np.testing.assert_array_equal(rows, np.arange(32))  # disjoint and covering, in order


def test_process_shard_from_a_sharding_is_the_whole_batch_alone():
    sharding = NamedSharding(_mesh((4, 2), ("data", "model")), P("data"))
    assert bd.process_shard(16, sharding) == bd.ProcessShard(0, 1, 0, 16)
    assert bd.process_shard(16, process_id=1, num_processes=4).slice == slice(4, 8)


@pytest.mark.parametrize(
    "rows, match",
    [
        ([(0, 5), (4, 8)], r"processes 0 and 1 both load rows \[4, 5\)"),
        ([(0, 4), (5, 8)], r"rows \[4, 5\) of the global batch of 8 are loaded by no process"),
        ([(0, 4), (4, 9)], r"process 1 loads rows \[4, 9\), not a non-empty range"),
        ([slice(0, 8, 2)], "with a step"),
    ],
)
def test_check_shards_names_overlaps_gaps_and_bad_ranges(rows, match):
    with pytest.raises(ValueError, match=match):
        bd.check_shards(rows, 8)


def test_check_shards_accepts_replicas_and_slices():
    bd.check_shards([(0, 4), (0, 4), slice(4, 8), (4, 8)], 8)


def test_process_shards_errors():
    with pytest.raises(ValueError, match="does not split into 3 equal process shards"):
        bd.process_shards(8, num_processes=3)
    with pytest.raises(TypeError, match="must be a jax.sharding.Sharding"):
        bd.process_shards(8, P("data"))
    with pytest.raises(TypeError, match="global_batch_size must be an int"):
        bd.process_shards(8.0)
    with pytest.raises(ValueError, match="does not fit the sharding"):
        bd.process_shards(6, NamedSharding(_mesh(), P("data")))
    with pytest.raises(ValueError, match=r"process_id=2 is outside 0..1"):
        bd.process_shard(8, process_id=2, num_processes=2)


# --- global batch ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, jnp.bfloat16, np.int32])
def test_global_batch_places_the_rows_with_the_sharding(dtype):
    sharding = NamedSharding(_mesh((4, 2), ("data", "model")), P("data"))
    x = (np.arange(16 * 3) % 11).reshape(16, 3).astype(dtype)
    mask = np.arange(16) % 3 == 0
    out = bd.global_batch({"x": x, "mask": mask}, sharding, 16)
    assert out["x"].sharding == sharding and out["x"].dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    np.testing.assert_array_equal(np.asarray(out["mask"]), mask)
    # Device d of the data axis holds rows [4d, 4d+4).
    for shard in out["x"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), x[shard.index])


def test_global_batch_takes_a_tree_of_shardings():
    mesh = _mesh()
    batch = {"x": np.ones((8, 2), np.float32), "w": np.ones((8,), np.float32)}
    shardings = {"x": NamedSharding(mesh, P("data")), "w": NamedSharding(mesh, P())}
    out = bd.global_batch(batch, shardings, 8)
    assert out["w"].sharding.is_fully_replicated and not out["x"].sharding.is_fully_replicated


def test_global_batch_errors_name_the_leaf_and_the_rows():
    sharding = NamedSharding(_mesh(), P("data"))
    with pytest.raises(ValueError, match=r"\['y'\] holds 4 rows .* rows \[0, 8\) \(8 rows\)"):
        bd.global_batch({"x": np.ones((8, 1)), "y": np.ones((4, 1))}, sharding, 8)
    with pytest.raises(ValueError, match=r"\['x'\] holds a scalar"):
        bd.global_batch({"x": np.float32(1)}, sharding, 8)
    with pytest.raises(ValueError, match=r"loaded rows \[0, 4\) but the sharding puts rows"):
        bd.global_batch({"x": np.ones((8, 1))}, sharding, 8, rows=slice(0, 4))


# --- random streams -------------------------------------------------------------------


def test_named_key_is_fold_in_of_the_crc32_of_the_name():
    want = jax.random.fold_in(jax.random.key(3), zlib.crc32(b"dropout") & 0x7FFFFFFF)
    got = bd.named_key(3, "dropout")
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))
    assert not np.array_equal(
        jax.random.key_data(bd.named_key(3, "data")), jax.random.key_data(got)
    )
    same = bd.named_key(jax.random.key(3), "dropout")
    np.testing.assert_array_equal(jax.random.key_data(same), jax.random.key_data(want))
    with pytest.raises(TypeError, match="seed must be an int or a typed key"):
        bd.named_key(1.5, "x")
    with pytest.raises(TypeError, match="name must be a str"):
        bd.named_key(0, 3)


@pytest.mark.parametrize("n", [1, 2, 4])
def test_row_keys_do_not_depend_on_the_split(n):
    key = bd.named_key(0, "data")
    reference = np.stack([jax.random.key_data(jax.random.fold_in(key, i)) for i in range(8)])
    parts = [bd.row_keys(key, s) for s in bd.process_shards(8, num_processes=n)]
    got = np.concatenate([np.asarray(jax.random.key_data(k)) for k in parts])
    np.testing.assert_array_equal(got, reference)
    draws = jax.vmap(lambda k: jax.random.normal(k, (), jnp.bfloat16))(jnp.concatenate(parts))
    ref = np.array([jax.random.normal(jax.random.fold_in(key, i), (), jnp.bfloat16)
                    for i in range(8)], np.float32)  # fmt: skip
    np.testing.assert_allclose(np.asarray(draws, np.float32), ref, **tol(jnp.bfloat16))
    with pytest.raises(ValueError, match="needs a stop"):
        bd.row_keys(key, slice(0, None))


def test_device_keys_by_mesh_position_shared_along_other_axes():
    mesh = _mesh((4, 2), ("data", "model"))
    key = bd.named_key(0, "dropout")
    keys = bd.device_keys(key, mesh, "data")
    assert keys.shape == (4,)
    ref = np.stack([jax.random.key_data(jax.random.fold_in(key, i)) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(keys)), ref)

    def per_device(k):
        return jax.random.uniform(k[0], (1, 1))

    u = jax.shard_map(per_device, mesh=mesh, in_specs=P("data"), out_specs=P("data", "model"))(keys)
    u = np.asarray(u)
    expect = np.array([jax.random.uniform(jax.random.fold_in(key, i)) for i in range(4)])
    np.testing.assert_array_equal(u[:, 0], expect)
    np.testing.assert_array_equal(u[:, 1], expect)  # same key along the model axis
    both = bd.device_keys(key, mesh, ("data", "model"))
    want = jax.random.fold_in(jax.random.fold_in(key, 2), 1)
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(both))[2, 1], np.asarray(jax.random.key_data(want))
    )
    with pytest.raises(ValueError, match=r"axis 'batch' is not in the mesh.*\('data', 'model'\)"):
        bd.device_keys(key, mesh, "batch")


# --- initialize -----------------------------------------------------------------------


def test_initialize_alone_is_a_noop_that_describes(monkeypatch):
    for name in ("BLOX_COORDINATOR_ADDRESS", "BLOX_NUM_PROCESSES", "BLOX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    info = bd.initialize()
    assert (info.process_id, info.num_processes, info.source) == (0, 1, "single process")
    assert info.local_devices == tuple(jax.local_devices()) and len(info.devices) == 8
    assert not info.is_multiprocess and not jax.distributed.is_initialized()
    assert str(info).startswith("process 0 of 1 (single process): 8 local cpu devices")
    # A group of one given explicitly is also a single process.
    assert bd.initialize("localhost:1234", 1, 0).source == "arguments"


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(coordinator_address="h:1"), ValueError, "num_processes, process_id missing"),
        (dict(coordinator_address="h:1", num_processes=2, process_id=2), ValueError,
         r"process_id=2 is outside 0..1"),
        (dict(coordinator_address="h", num_processes=2, process_id=0), ValueError,
         "is not 'host:port'"),
        (dict(coordinator_address="h:1", num_processes="2", process_id=0), TypeError,
         "num_processes must be an int"),
        (dict(coordinator_address="h:1", num_processes=2, process_id=0), ValueError,
         "already started its backends"),
        (dict(initialization_timeout=0), ValueError, "must be positive"),
    ],
)  # fmt: skip
def test_initialize_errors(kwargs, error, match):
    jax.devices()  # the test process has started its backends
    with pytest.raises(error, match=match):
        bd.initialize(**kwargs)


def test_initialize_partial_environment(monkeypatch):
    monkeypatch.setenv("BLOX_NUM_PROCESSES", "2")
    monkeypatch.delenv("BLOX_COORDINATOR_ADDRESS", raising=False)
    monkeypatch.delenv("BLOX_PROCESS_ID", raising=False)
    with pytest.raises(ValueError, match="BLOX_COORDINATOR_ADDRESS, BLOX_PROCESS_ID not set"):
        bd.initialize()
    monkeypatch.setenv("BLOX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match=r"BLOX_NUM_PROCESSES='two' is not an integer"):
        bd.initialize()


# --- the roll call, with threads as processes -----------------------------------------


def _free_port() -> int:
    from blox.distributed._launch import free_port

    return free_port()


def _run_group(ids, count, timeout, port=None):
    """Runs roll_call for each id in a thread; returns {id: exception or None}."""
    port = port or _free_port()
    results = {}

    def member(i, slot):
        try:
            roll_call(f"127.0.0.1:{port}", i, count, timeout)
            results[slot] = None
        except Exception as e:  # noqa: BLE001 - collected for the assertions
            results[slot] = e

    threads = [threading.Thread(target=member, args=(i, s)) for s, i in enumerate(ids)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 30)
    return results


def test_roll_call_passes_when_everyone_comes():
    assert _run_group([2, 0, 1], 3, 10) == {0: None, 1: None, 2: None}


def test_roll_call_names_the_missing_processes():
    results = _run_group([0, 2], 4, 1.0)
    for r in results.values():
        assert isinstance(r, TimeoutError)
        assert "processes 1, 3 of 4 did not join within 1 s" in str(r)
    assert str(results[1]).startswith("process 2: process 0 reports:")


def test_roll_call_without_coordinator_names_process_0():
    (r,) = _run_group([1], 2, 1.0).values()
    assert isinstance(r, TimeoutError)
    assert "process 0 (the coordinator, 127.0.0.1:" in str(r)


def test_roll_call_rejects_duplicate_ids():
    results = _run_group([0, 1, 1], 3, 5)
    assert all(isinstance(r, ValueError) for r in results.values()), results
    assert "two processes say they are process 1" in str(results[0])
