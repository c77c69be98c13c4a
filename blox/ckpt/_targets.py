"""The restore target: every array leaf as a ``jax.ShapeDtypeStruct`` with the sharding it
must have *now* (taken from the target, or derived from parameter metadata and a mesh)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from blox.core._params import Params
from blox.core._sharding import partition_specs

__all__ = ["abstract_target"]


def _default_sharding(mesh: Mesh | None, spec: PartitionSpec | None) -> Any:
    if mesh is None:
        return SingleDeviceSharding(jax.local_devices()[0])
    return NamedSharding(mesh, spec if spec is not None else PartitionSpec())


def _leaf(value: Any, mesh: Mesh | None, spec: PartitionSpec | None) -> Any:
    if isinstance(value, (bool, int, float)) or isinstance(value, (np.ndarray, np.generic)):
        return value  # restored as the same Python / NumPy type
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return value  # describe() has already explained why this cannot be restored
    sharding = getattr(value, "sharding", None)
    if sharding is None:
        sharding = _default_sharding(mesh, spec)
    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=sharding)


def abstract_target(state: Any, *, mesh: Mesh | None = None) -> Any:
    """The abstract state a checkpoint is restored into, with the shardings of *now*.

    Each array leaf becomes a ``jax.ShapeDtypeStruct`` whose sharding is, in order:

    1. the leaf's own sharding: a concrete ``jax.Array``'s, or the ``sharding`` of a
       ``ShapeDtypeStruct`` (e.g. from ``jax.eval_shape`` of a ``jax.jit`` with
       ``out_shardings``);
    2. when the leaf has none and `mesh` is given: for a `Params` leaf, the
       ``NamedSharding`` from its ``metadata['sharding']`` (`blox.named_shardings`; this
       also covers Optax state, whose moments are `Params` of the same structure); for any
       other leaf, replicated over `mesh`;
    3. otherwise the first local device.

    The shardings saved in the checkpoint are never used, so a checkpoint written on one
    mesh is restored onto the target's mesh (resharding on read). NumPy arrays and Python
    numbers are kept as they are (restored as the same type).

    Args:
      state: the structure to restore into, concrete or abstract (``jax.eval_shape``).
      mesh: the current mesh, for leaves that carry no sharding.

    Returns:
      The same tree with ``ShapeDtypeStruct`` array leaves.

    >>> import blox as bx, jax, jax.numpy as jnp
    >>> p = bx.Params(); p[('w',)] = bx.Param(jnp.zeros((8, 2)), metadata={'sharding': ('d', None)})
    >>> mesh = jax.make_mesh((1,), ('d',))
    >>> t = abstract_target(jax.eval_shape(lambda: p), mesh=mesh)
    >>> t[('w',)].value.sharding.spec
    P('d', None)
    """
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(
            f"abstract_target: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}. "
            "Build one with jax.make_mesh((n,), ('data',))."
        )

    def node(x: Any) -> Any:
        if isinstance(x, Params):
            specs = partition_specs(x, mesh) if mesh is not None else None
            spec_values = specs._values if specs is not None else (None,) * len(x)
            values = tuple(_leaf(v, mesh, s) for v, s in zip(x._values, spec_values, strict=True))
            return Params._make(x._struct, values)
        return _leaf(x, mesh, None)

    return jax.tree.map(node, state, is_leaf=lambda x: isinstance(x, Params))
