"""Sharding trees derived from parameter metadata."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from blox.core._params import Params, _thaw, format_path

__all__ = ["partition_specs", "named_shardings"]


def _spec_for(path, value, meta, mesh: Mesh | None) -> PartitionSpec:
    sharding = meta.get("sharding", ()) or ()
    where = f"'{format_path(path)}'"
    if not sharding:
        return PartitionSpec()
    shape = getattr(value, "shape", None)
    if shape is not None and len(sharding) != len(shape):
        raise ValueError(
            f"Parameter {where} has shape {tuple(shape)} ({len(shape)} dims) but its "
            f"metadata['sharding'] {tuple(sharding)} has {len(sharding)} entries. Give one "
            "entry (a mesh-axis name, a tuple of names, or None) per dimension."
        )
    if mesh is not None:
        sizes = dict(zip(mesh.axis_names, mesh.devices.shape, strict=True))
        for dim, entry in enumerate(sharding):
            if entry is None:
                continue
            names = entry if isinstance(entry, tuple) else (entry,)
            total = 1
            for name in names:
                if name not in sizes:
                    raise ValueError(
                        f"Parameter {where} is sharded over mesh axis {name!r} (dimension "
                        f"{dim}), but the mesh has axes {tuple(mesh.axis_names)}. Add the axis "
                        "to the mesh or change the parameter's metadata['sharding']."
                    )
                total *= sizes[name]
            if shape is not None and shape[dim] % total:
                raise ValueError(
                    f"Parameter {where} dimension {dim} has size {shape[dim]}, which is not "
                    f"divisible by the size {total} of mesh axis {entry!r} (mesh "
                    f"{dict(sizes)}). Choose a size divisible by {total} or shard another "
                    "dimension."
                )
    return PartitionSpec(*sharding)


def partition_specs(params: Params, mesh: Mesh | None = None) -> Params:
    """A `Params` of ``PartitionSpec`` leaves, one per parameter, from
    ``metadata['sharding']`` (absent means replicated).

    Args:
      params: concrete or abstract params (e.g. from ``jax.eval_shape(init)``).
      mesh: when given, axis names and divisibility are checked against it.

    Raises:
      ValueError: an entry count that differs from the rank, an axis the mesh lacks,
        or a dimension not divisible by its axis size; the message names the path.
    """
    if not isinstance(params, Params):
        raise TypeError(f"partition_specs expects Params, got {type(params).__name__}.")
    s = params._struct
    specs = tuple(
        _spec_for(k, v, _thaw(info[1]), mesh)
        for k, v, info in zip(s.keys, params._values, s.infos, strict=True)
    )
    return Params._make(s, specs)


def named_shardings(params: Params, mesh: Mesh) -> Params:
    """The ``NamedSharding`` tree for ``jax.jit(init, out_shardings=...)``.

    Derived from each parameter's ``metadata['sharding']`` and checked against `mesh`
    (see `partition_specs`). The result has the same tree structure as `params`, so
    it can also be used with ``jax.device_put`` and for optimizer state built with
    ``jax.tree.map``.

    Example::

        abstract = jax.eval_shape(init)
        params = jax.jit(init, out_shardings=bx.named_shardings(abstract, mesh))()
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"named_shardings expects a jax.sharding.Mesh, got {type(mesh).__name__}. "
            "Build one with jax.make_mesh((n,), ('model',))."
        )
    specs = partition_specs(params, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=_is_spec)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)
