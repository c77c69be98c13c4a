"""The description saved next to a checkpoint, and the mismatch errors of restore (a test
each: missing, unexpected, shape, dtype, trainable flag), with nothing restored."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import blox as bx
from blox import ckpt
from tests.ckpt._common import build, init


def _saved(tmp_path, state, step=1):
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(step, state)
    return ckpt.CheckpointManager(tmp_path)


def test_description_lists_versions_mesh_and_every_parameter(tmp_path):
    params, _ = init(0, sharded=True)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    params = jax.device_put(params, bx.named_shardings(params, mesh))
    tx = optax.adam(1e-3)
    state = {"params": params, "opt_state": tx.init(params.split()[0]), "step": 4}
    d = _saved(tmp_path, state, 4).description()
    json.dumps(d)  # plain JSON
    assert d["versions"] == {
        "blox": bx.__version__,
        "jax": jax.__version__,
        "orbax": d["versions"]["orbax"],
    }
    assert d["mesh"] == {"axis_names": ["data", "model"], "axis_sizes": [4, 2]}
    leaves = d["leaves"]
    # Every parameter, with its path, shape, dtype, spec, trainable flag and metadata.
    for path, p in params.items():
        name = "params/" + "/".join(path)
        e = leaves[name]
        assert e["shape"] == list(p.value.shape) and e["dtype"] == p.value.dtype.name
        assert e["param"] == {
            "path": "/".join(path),
            "trainable": p.trainable,
            "metadata": json.loads(json.dumps(p.metadata)),
        }
        assert e["spec"] == list(p.value.sharding.spec) or (
            e["spec"] == [] and p.value.sharding.spec == PartitionSpec()
        )
    assert leaves["params/net/fc1/kernel"]["spec"] == [None, "model"]
    assert leaves["params/net/rng/seed"]["param"]["metadata"]["tag"] == "rng_seed"
    assert leaves["opt_state/0/mu/net/fc1/kernel"]["param"]["trainable"] is True
    assert leaves["opt_state/0/count"] == {
        "kind": "array",
        "shape": [],
        "dtype": "int32",
        "spec": None,
        "checksum": "00000000-00000000",  # of the count 0 (tests/ckpt/test_integrity.py)
    }
    assert leaves["step"]["kind"] == "int"
    assert set(leaves) == {
        *(f"params/{'/'.join(k)}" for k in params.keys()),
        *(f"opt_state/0/{m}/{'/'.join(k)}" for m in ("mu", "nu") for k in params.split()[0]),
        "opt_state/0/count",
        "step",
    }
    # The files next to the arrays hold the same text (the checksums, computed while the
    # step is written, in their own file).
    on_disk = json.loads((tmp_path / "4" / "blox" / "metadata").read_text())
    sums = json.loads((tmp_path / "4" / "blox" / "checksums.json").read_text())
    for name, value in sums.items():
        on_disk["leaves"][name]["checksum"] = value
    assert on_disk == d


def _other_width_state(hidden):
    params, _ = init(0, hidden=hidden)
    return {"params": params, "step": 1}


def test_missing_paths_are_listed_with_shapes(tmp_path):
    params, _ = init(0)
    partial = params.split(lambda path, _: path[1] != "head")[0]
    mngr = _saved(tmp_path, {"params": partial})
    with pytest.raises(ckpt.RestoreMismatchError) as info:
        mngr.restore({"params": params})
    e = info.value
    assert isinstance(e, ValueError)
    assert e.missing == [
        ("params/net/head/bias", "float32[2]"),
        ("params/net/head/kernel", "float32[8, 2]"),
    ]
    assert not e.unexpected and not e.mismatched
    with pytest.raises(
        ValueError,
        match=r"(?s)missing from the checkpoint \(2\):\n    params/net/head/bias: float32\[2\]"
        r"\n    params/net/head/kernel: float32\[8, 2\].*Nothing was restored",
    ):
        mngr.restore({"params": params})


def test_unexpected_paths_are_listed_with_shapes(tmp_path):
    params, _ = init(0)
    mngr = _saved(tmp_path, {"params": params, "extra": jnp.zeros((3, 1), jnp.bfloat16)})
    with pytest.raises(
        ckpt.RestoreMismatchError,
        match=r"unexpected \(in the checkpoint, not in the target\) \(1\):\n    extra: "
        r"bfloat16\[3, 1\]",
    ):
        mngr.restore({"params": params})


def test_shape_mismatch_lists_both_shapes(tmp_path):
    mngr = _saved(tmp_path, _other_width_state(8))
    with pytest.raises(ckpt.RestoreMismatchError) as info:
        mngr.restore(_other_width_state(16))
    assert ("params/net/fc1/kernel", "float32[4, 8]", "float32[4, 16]") in info.value.mismatched
    assert len(info.value.mismatched) == 3  # fc1 kernel and bias, head kernel
    with pytest.raises(
        ValueError,
        match=r"shape/dtype mismatch \(3\):\n    params/net/fc1/bias: saved float32\[8\], "
        r"target float32\[16\]",
    ):
        mngr.restore(_other_width_state(16))


def test_dtype_mismatch_and_allow_dtype_cast(tmp_path):
    params, _ = init(0)
    mngr = _saved(tmp_path, {"params": params})
    as_bf16 = jax.tree.map(
        lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, params
    )
    with pytest.raises(
        ckpt.RestoreMismatchError,
        match=r"params/net/fc1/kernel: saved float32\[4, 8\], target bfloat16\[4, 8\]",
    ):
        mngr.restore({"params": as_bf16})
    out = mngr.restore({"params": as_bf16}, allow_dtype_cast=True)["params"]
    k = out[("net", "fc1", "kernel")].value
    assert k.dtype == jnp.bfloat16
    ref = np.asarray(params[("net", "fc1", "kernel")].value).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(k), ref)


def test_trainable_flag_mismatch(tmp_path):
    params, _ = init(0)
    mngr = _saved(tmp_path, {"params": params})
    frozen = params.unlocked()
    p = frozen[("net", "head", "kernel")]
    frozen[("net", "head", "kernel")] = p.replace(trainable=False)
    with pytest.raises(
        ckpt.RestoreMismatchError,
        match=r"trainable flag differs \(1\):\n    params/net/head/kernel: saved True, "
        r"target False",
    ):
        mngr.restore({"params": frozen.locked()})


def test_nothing_is_restored_on_mismatch(tmp_path):
    # The error is raised before any array is read: the target object is untouched and no
    # partial result exists to be used by mistake.
    mngr = _saved(tmp_path, _other_width_state(8))
    target = _other_width_state(16)
    before = jax.tree.map(np.asarray, target)
    with pytest.raises(ckpt.RestoreMismatchError):
        mngr.restore(target)
    jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, target))


def test_python_numbers_restore_into_scalar_arrays_of_the_same_kind(tmp_path):
    mngr = _saved(tmp_path, {"step": 3, "lr": 0.25})
    out = mngr.restore(
        {"step": jax.ShapeDtypeStruct((), jnp.int32), "lr": jax.ShapeDtypeStruct((), jnp.float32)}
    )
    assert int(out["step"]) == 3 and float(out["lr"]) == 0.25
    with pytest.raises(ckpt.RestoreMismatchError, match="step: saved Python int, target float32"):
        mngr.restore({"step": jnp.zeros(()), "lr": 0.0})


def test_compare_and_describe_directly():
    _, rng, model = build()
    a = describe_state(rng, model, 8)
    assert ckpt.compare(a, a) is None
    err = ckpt.compare(a, describe_state(rng, model, 8, extra=True), where="here")
    assert isinstance(err, ckpt.RestoreMismatchError)
    assert err.missing == [("x", "float32[2]")] and "here" in str(err)


def describe_state(rng, model, hidden, extra=False):
    params, _ = init(0, hidden)
    state = {"params": params}
    if extra:
        state["x"] = jnp.zeros(2)
    return ckpt.describe(state)


def test_describe_spec_of_named_sharding():
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    x = jax.device_put(jnp.zeros((8, 4)), NamedSharding(mesh, PartitionSpec(("a", "b"))))
    e = ckpt.describe({"x": x})["leaves"]["x"]
    assert e["spec"] == [["a", "b"]] and e["shape"] == [8, 4]
