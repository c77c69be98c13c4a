"""Export/import of nested NumPy dicts, and the PyTorch port example (torch as reference)."""

from __future__ import annotations

import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import blox as bx
from blox import ckpt
from tests.ckpt._common import init
from tests.scripts import ROOT, run_script


def test_export_is_plain_numpy_and_import_restores_exactly():
    params, _ = init(0)
    tree = ckpt.export_params(params)
    assert isinstance(tree["net"]["fc1"]["kernel"], np.ndarray)
    assert tree["net"]["rng"]["seed"].dtype == np.uint32
    other, _ = init(5)
    back = ckpt.import_params(tree, like=other)
    assert jax.tree.structure(back) == jax.tree.structure(params)  # flags, metadata, lock
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params), strict=True):
        assert isinstance(a, jax.Array)
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_import_low_precision_and_cast():
    like = bx.Params()
    like[("w",)] = bx.Param(jnp.zeros((3,), jnp.bfloat16))
    x = np.array([1.0, 1 / 3, 2.5], np.float64)
    with pytest.raises(ValueError, match="'w' has dtype float64, the model expects bfloat16"):
        ckpt.import_params({"w": x}, like=like)
    got = ckpt.import_params({"w": x}, like=like, cast=True)[("w",)].value
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), x.astype(jnp.bfloat16))


def test_import_places_arrays_with_the_sharding_of_like():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    like = bx.Params()
    like[("w",)] = bx.Param(jnp.zeros((4, 8)), metadata={"sharding": (None, "model")})
    target = ckpt.abstract_target(jax.eval_shape(lambda: like), mesh=mesh)
    x = np.arange(32, dtype=np.float32).reshape(4, 8)
    got = ckpt.import_params({"w": x}, like=target)[("w",)].value
    assert got.sharding == NamedSharding(mesh, PartitionSpec(None, "model"))
    np.testing.assert_array_equal(np.asarray(got), x)


def test_import_errors_list_paths_and_shapes():
    params, _ = init(0)
    tree = ckpt.export_params(params)
    del tree["net"]["head"]
    tree["net"]["extra"] = {"w": np.zeros(2)}
    with pytest.raises(ValueError, match=r"Missing: \['net/head/bias', 'net/head/kernel'\]"):
        ckpt.import_params(tree, like=params)
    tree = ckpt.export_params(params)
    tree["net"]["head"]["kernel"] = tree["net"]["head"]["kernel"].T
    with pytest.raises(ValueError, match=r"'net/head/kernel' has shape \(2, 8\).*\(8, 2\)"):
        ckpt.import_params(tree, like=params)
    with pytest.raises(TypeError, match="like must be bx.Params"):
        ckpt.import_params(tree, like=tree)
    with pytest.raises(TypeError, match="import_params expects nested dicts"):
        ckpt.import_params([1], like=params)
    with pytest.raises(TypeError, match="export_params expects bx.Params"):
        ckpt.export_params({"params": params})


@pytest.mark.slow
def test_port_pytorch_example_matches_torch():
    pytest.importorskip("torch")  # a test dependency; the example itself says how to install
    out = run_script("examples/port_pytorch.py", "--size", "tiny")
    err = float(re.search(r"max \|blox - torch\| = (\S+)", out).group(1))
    assert err < 1e-5, out  # float32 tolerance for a conv + LSTM of this size
    for path in ("crnn/lstm/gates/kernel", "crnn/bn/running_var", "crnn/conv/kernel"):
        assert path in out


@pytest.mark.slow
def test_port_pytorch_example_without_torch_says_how_to_install():
    code = (
        "import sys; sys.modules['torch'] = None; sys.argv = ['port_pytorch.py', '--size', "
        "'tiny']; import runpy; runpy.run_path('examples/port_pytorch.py', run_name='__main__')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs PyTorch" in proc.stderr and "pip install torch" in proc.stderr
