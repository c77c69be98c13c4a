"""CheckpointManager: save policy, keep policy, final save, restore targets and shardings,
the data-iterator slot. References: the state that was saved (bit equality), NumPy."""

from __future__ import annotations

import logging

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

import blox as bx
from blox import ckpt
from tests.ckpt._common import init, tree_equal


def _state(step: int = 0, seed: int = 0):
    params, _ = init(seed)
    return {"params": params, "w": jnp.arange(6.0).reshape(2, 3) + step, "step": step}


@pytest.mark.parametrize("async_save", [True, False])
def test_save_every_max_to_keep_latest(tmp_path, async_save):
    with ckpt.CheckpointManager(
        tmp_path, save_every=2, max_to_keep=2, async_save=async_save, save_on_exit=False
    ) as mngr:
        assert mngr.latest_step() is None
        did = [mngr.save(s, _state(s)) for s in range(1, 8)]
        mngr.wait()
        assert did == [False, True, False, True, False, True, False]
        assert mngr.all_steps() == [4, 6]
        assert mngr.latest_step() == 6
        assert not mngr.should_save(7) and mngr.should_save(8)
    fresh = ckpt.CheckpointManager(tmp_path)
    restored = fresh.restore(_state(0, seed=1))
    tree_equal(restored, _state(6))
    assert isinstance(restored["step"], int) and restored["step"] == 6
    old = fresh.restore(_state(0, seed=1), step=4)
    np.testing.assert_array_equal(old["w"], np.arange(6.0).reshape(2, 3) + 4)
    fresh.close()


def test_keep_best_by_metric_keeps_latest_too(tmp_path):
    losses = {1: 0.5, 2: 0.1, 3: 0.9, 4: 0.2, 5: 0.7}
    with ckpt.CheckpointManager(
        tmp_path, max_to_keep=2, best_metric="eval/loss", best_mode="min"
    ) as mngr:
        for s, loss in losses.items():
            mngr.save(s, _state(s), metrics={"eval/loss": loss})
        mngr.wait()
        # The two smallest losses (steps 2 and 4), plus the latest step (needed to resume).
        assert mngr.all_steps() == [2, 4, 5]
        assert mngr.best_step() == 2
        assert mngr.metrics(4) == {"eval/loss": 0.2}


def test_keep_best_max_mode_with_a_function(tmp_path):
    with ckpt.CheckpointManager(
        tmp_path, max_to_keep=1, best_metric=lambda m: m["acc"], best_mode="max"
    ) as mngr:
        for s, acc in {1: 0.3, 2: 0.8, 3: 0.5}.items():
            mngr.save(s, _state(s), metrics={"acc": acc})
        mngr.wait()
        assert mngr.all_steps() == [2, 3]
        assert mngr.best_step() == 2


def test_final_save_on_exit_and_on_ctrl_c(tmp_path):
    with ckpt.CheckpointManager(tmp_path / "a", save_every=10) as mngr:
        for s in range(1, 4):
            mngr.save(s, _state(s))
    assert ckpt.CheckpointManager(tmp_path / "a").all_steps() == [3]

    with pytest.raises(KeyboardInterrupt):
        with ckpt.CheckpointManager(tmp_path / "b", save_every=10) as mngr:
            for s in range(1, 6):
                mngr.save(s, _state(s))
                if s == 4:
                    raise KeyboardInterrupt
    m = ckpt.CheckpointManager(tmp_path / "b")
    assert m.all_steps() == [4]
    tree_equal(m.restore(_state(0)), _state(4))


def test_other_exceptions_skip_the_final_save(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with ckpt.CheckpointManager(tmp_path, save_every=2) as mngr:
            mngr.save(2, _state(2))
            mngr.save(3, _state(3))
            raise RuntimeError("boom")
    assert ckpt.CheckpointManager(tmp_path).all_steps() == [2]


def test_final_save_skipped_when_arrays_were_donated(tmp_path, caplog):
    mngr = ckpt.CheckpointManager(tmp_path, save_every=10)
    state = {"w": jnp.ones(3)}
    mngr.save(1, state)
    state["w"].delete()  # what donation to a step that never returned leaves behind
    with caplog.at_level(logging.WARNING, logger="blox.ckpt._manager"):
        mngr.close()
    assert "donated" in caplog.text
    assert ckpt.CheckpointManager(tmp_path).latest_step() is None


def test_explicit_close_waits_and_refuses_later_saves(tmp_path):
    mngr = ckpt.CheckpointManager(tmp_path, save_every=5)
    mngr.save(1, _state(1))
    mngr.close()
    assert ckpt.CheckpointManager(tmp_path).all_steps() == [1]
    with pytest.raises(ValueError, match="is closed; create a new one"):
        mngr.save(2, _state(2))


def test_restore_into_abstract_target_with_shardings_from_metadata(tmp_path):
    params, _ = init(0, sharded=True)
    state = {"params": params, "step": 3}
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(3, state)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    abstract = jax.eval_shape(lambda: state)
    restored = ckpt.CheckpointManager(tmp_path).restore(abstract, mesh=mesh)
    kernel = restored["params"][("net", "fc1", "kernel")].value
    assert kernel.sharding == NamedSharding(mesh, PartitionSpec(None, "model"))
    bias = restored["params"][("net", "fc1", "bias")].value
    assert bias.sharding == NamedSharding(mesh, PartitionSpec())
    tree_equal(jax.device_get(restored["params"]), jax.device_get(state["params"]))
    # eval_shape turned the Python int into an int32 ShapeDtypeStruct: an array comes back.
    assert restored["step"].dtype == jnp.int32 and int(restored["step"]) == 3


def test_restore_uses_the_target_sharding_not_the_saved_one(tmp_path):
    # Saved on a (4, 2) mesh, sharded over both axes; restored onto a (2, 4) mesh with
    # another spec, and onto one device: the target's sharding wins, values are equal.
    saved_mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = np.arange(64, dtype=np.float32).reshape(8, 8)
    saved = {"x": jax.device_put(x, NamedSharding(saved_mesh, PartitionSpec("data", "model")))}
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, saved)
    new_mesh = jax.make_mesh((2, 4), ("data", "model"))
    want = NamedSharding(new_mesh, PartitionSpec("model", None))
    m = ckpt.CheckpointManager(tmp_path)
    out = m.restore({"x": jax.ShapeDtypeStruct((8, 8), jnp.float32, sharding=want)})
    assert out["x"].sharding == want
    np.testing.assert_array_equal(np.asarray(out["x"]), x)
    one = SingleDeviceSharding(jax.devices()[3])
    out = m.restore({"x": jax.device_put(jnp.zeros((8, 8)), one)})
    assert out["x"].sharding == one
    np.testing.assert_array_equal(np.asarray(out["x"]), x)


def test_numpy_leaves_and_python_numbers_come_back_as_such(tmp_path):
    state = {"a": np.arange(3, dtype=np.int64), "lr": 0.5, "step": 7, "done": False}
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(7, state)
    out = ckpt.CheckpointManager(tmp_path).restore(
        {"a": np.zeros(3, np.int64), "lr": 0.0, "step": 0, "done": True}
    )
    assert isinstance(out["a"], np.ndarray) and out["a"].tolist() == [0, 1, 2]
    assert out["lr"] == 0.5 and out["step"] == 7 and out["done"] is False


def test_grain_iterator_position_is_saved_with_the_step(tmp_path):
    ds = grain.MapDataset.range(20).shuffle(seed=3).map(lambda i: i * 10)
    it = iter(ds)
    uninterrupted = iter(ds)
    expected = [next(uninterrupted) for _ in range(20)]
    drawn = []
    with ckpt.CheckpointManager(tmp_path, save_every=3) as mngr:
        for step in range(1, 8):
            drawn.append(next(it))  # the step's batch
            mngr.save(step, {"step": step}, data_iterator=it)
            if step == 6:
                next(it)  # drawn after the save: not part of step 6's position
                break
    assert drawn == expected[:6]
    resumed = iter(ds)
    m = ckpt.CheckpointManager(tmp_path)
    state = m.restore({"step": 0}, data_iterator=resumed)
    assert state["step"] == 6
    assert [next(resumed) for _ in range(14)] == expected[6:]
    assert (tmp_path / "6" / "data" / "process_0-of-1.json").exists()


def test_grain_dataloader_iterator(tmp_path):
    source = grain.sources.RangeDataSource(0, 12, 1)
    loader = grain.DataLoader(
        data_source=source,
        sampler=grain.samplers.IndexSampler(12, shuffle=True, seed=1, num_epochs=1),
        worker_count=0,
    )
    it = iter(loader)
    first = [next(it) for _ in range(5)]
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(5, {"step": 5}, data_iterator=it)
    rest = [next(it) for _ in range(7)]
    it2 = iter(loader)
    ckpt.CheckpointManager(tmp_path).restore({"step": 0}, data_iterator=it2)
    assert [next(it2) for _ in range(7)] == rest
    assert len(set(first + rest)) == 12


# -- errors -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "exc", "match"),
    [
        ({"save_every": 0}, ValueError, "save_every must be an int >= 1"),
        ({"max_to_keep": 0}, ValueError, r"max_to_keep must be None \(keep all\)"),
        ({"best_mode": "lowest"}, ValueError, "best_mode must be 'min' or 'max'"),
        ({"best_metric": 3}, TypeError, "best_metric must be a metric name"),
    ],
)
def test_constructor_errors(tmp_path, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ckpt.CheckpointManager(tmp_path, **kwargs)


def test_save_errors(tmp_path):
    with ckpt.CheckpointManager(tmp_path, best_metric="eval/loss") as mngr:
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            mngr.save(-1, {"a": 1})
        with pytest.raises(ValueError, match="metrics has no 'eval/loss'.*it has \\['loss'\\]"):
            mngr.save(1, {"a": 1}, metrics={"loss": 1.0})
        with pytest.raises(TypeError, match="metrics must be a dict"):
            mngr.save(1, {"a": 1}, metrics=[1.0])
        with pytest.raises(TypeError, match="data_iterator must have get_state"):
            mngr.save(1, {"a": 1}, data_iterator=iter([1, 2]))
        with pytest.raises(TypeError, match="leaf 'name' is a str"):
            mngr.save(1, {"name": "run-1"})
        with pytest.raises(TypeError, match="leaf 'key' is a typed PRNG key"):
            mngr.save(1, {"key": jax.random.key(0)})
        mngr.save(5, {"a": 1}, metrics={"eval/loss": 1.0})
        mngr.wait()
        with pytest.raises(ValueError, match="already holds steps up to 5, so saving step 3"):
            mngr.save(3, {"a": 1}, metrics={"eval/loss": 1.0})


def test_restore_errors(tmp_path):
    mngr = ckpt.CheckpointManager(tmp_path / "empty")
    with pytest.raises(ValueError, match="no checkpoint in .*empty.*latest_step"):
        mngr.restore({"a": 1})
    with ckpt.CheckpointManager(tmp_path / "one") as m:
        m.save(2, {"a": 1})
    m = ckpt.CheckpointManager(tmp_path / "one")
    with pytest.raises(ValueError, match=r"step 9 is not in .*committed steps are \[2\]"):
        m.restore({"a": 1}, step=9)
    ds = grain.MapDataset.range(3)
    with pytest.raises(ValueError, match="has no data-iterator state"):
        m.restore({"a": 1}, data_iterator=iter(ds))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh"):
        m.restore({"a": jnp.ones(2)}, mesh="data")


def test_abstract_target_rules():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    p = bx.Params()
    p[("w",)] = bx.Param(jnp.zeros((4, 8)), metadata={"sharding": ("data", "model")})
    p[("b",)] = bx.Param(jnp.zeros((8,)))
    abstract = jax.eval_shape(lambda: {"p": p, "n": jnp.zeros(3)})
    abstract["i"] = 1
    t = ckpt.abstract_target(abstract, mesh=mesh)
    assert t["p"][("w",)].value.sharding.spec == PartitionSpec("data", "model")
    assert t["p"][("b",)].value.sharding.spec == PartitionSpec()
    assert t["n"].sharding == NamedSharding(mesh, PartitionSpec())
    assert t["i"] == 1
    t = ckpt.abstract_target(abstract)
    assert t["n"].sharding == SingleDeviceSharding(jax.local_devices()[0])
    bad = bx.Params()
    bad[("w",)] = bx.Param(jnp.zeros((4, 6)), metadata={"sharding": ("data", "model")})
    with pytest.raises(ValueError, match="'w' dimension 1 has size 6, which is not divisible"):
        ckpt.abstract_target(jax.eval_shape(lambda: bad), mesh=mesh)
