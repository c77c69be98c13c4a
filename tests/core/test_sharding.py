"""Sharding trees derived from metadata, checked against the mesh (8 simulated devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import blox as bx


def _model(kernel_sharding=(None, "model"), width=8):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", width, rng, kernel_metadata={"sharding": kernel_sharding})
    head = bx.Linear(g / "head", 2, rng, kernel_metadata={"sharding": ("model", None)})

    def init():
        p = rng.seed(bx.Params(), seed=0)
        h, p = fc(p, jnp.ones((4, 6)))
        _, p = head(p, h)
        return p.locked()

    return init


def test_named_shardings_tree_matches_metadata_and_drives_jit_init():
    init = _model()
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    abstract = jax.eval_shape(init)
    shardings = bx.named_shardings(abstract, mesh)
    assert jax.tree.structure(shardings) == jax.tree.structure(abstract)
    assert shardings[("net", "fc", "kernel")].value == NamedSharding(
        mesh, PartitionSpec(None, "model")
    )
    assert shardings[("net", "fc", "bias")].value == NamedSharding(mesh, PartitionSpec())
    params = jax.jit(init, out_shardings=shardings)()
    kernel = params[("net", "fc", "kernel")].value
    assert kernel.sharding.spec == PartitionSpec(None, "model")
    assert {s.data.shape for s in kernel.addressable_shards} == {(6, 2)}
    np.testing.assert_array_equal(kernel, init()[("net", "fc", "kernel")].value)
    # The same tree places optimizer state built with jax.tree.map.
    specs = bx.partition_specs(abstract)
    assert specs[("net", "head", "kernel")].value == PartitionSpec("model", None)


def test_multi_axis_entry():
    init = _model(kernel_sharding=(None, ("data", "model")))
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    sh = bx.named_shardings(jax.eval_shape(init), mesh)
    assert sh[("net", "fc", "kernel")].value.spec == PartitionSpec(None, ("data", "model"))


def test_unknown_axis_names_the_path_and_mesh_axes():
    init = _model(kernel_sharding=(None, "tensor"))
    mesh = jax.make_mesh((8,), ("model",))
    with pytest.raises(
        ValueError, match=r"'net/fc/kernel' is sharded over mesh axis 'tensor'.*\('model',\)"
    ):
        bx.named_shardings(jax.eval_shape(init), mesh)


def test_indivisible_dimension_names_sizes():
    init = _model(width=6)
    mesh = jax.make_mesh((4,), ("model",))
    with pytest.raises(
        ValueError, match=r"'net/fc/kernel' dimension 1 has size 6.*not divisible by the size 4"
    ):
        bx.named_shardings(jax.eval_shape(init), mesh)


def test_wrong_number_of_entries():
    init = _model(kernel_sharding=("model",))
    mesh = jax.make_mesh((4,), ("model",))
    with pytest.raises(ValueError, match=r"'net/fc/kernel' has shape \(6, 8\) \(2 dims\)"):
        bx.named_shardings(jax.eval_shape(init), mesh)
    with pytest.raises(TypeError, match="expects a jax.sharding.Mesh"):
        bx.named_shardings(jax.eval_shape(init), ("model",))
