"""Sharding trees derived from parameter metadata."""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

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


# ---------------------------------------------------------------------------
# Output shardings of matmuls on Explicit meshes (shared by `Linear` and the
# tensor-parallel layers of `blox.parallel`).
# ---------------------------------------------------------------------------


def _axes_of(entry: Any) -> tuple:
    """The mesh-axis names of one PartitionSpec entry (None -> ())."""
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _padded_spec(spec: Any, ndim: int) -> tuple:
    spec = tuple(spec)
    return spec + (None,) * (ndim - len(spec))


def _all_explicit(mesh: Any, entries: tuple) -> bool:
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    return all(types.get(a) == AxisType.Explicit for e in entries for a in _axes_of(e))


def row_out_sharding(x: jax.Array, axis: str) -> NamedSharding | None:
    """On an Explicit mesh, the output sharding of ``x @ W`` with W sharded on its rows
    over `axis`: x's batch dims kept, the feature dim replicated (the compiler
    all-reduces). None when `axis` is not an Explicit axis of x's mesh (Auto meshes,
    off-mesh arrays): then JAX needs no ``out_sharding``."""
    sh = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sh, "mesh", None)
    if mesh is None or axis not in getattr(mesh, "axis_names", ()):
        return None
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    if types[axis] != AxisType.Explicit:
        return None
    spec = _padded_spec(sh.spec, x.ndim)
    return NamedSharding(mesh, PartitionSpec(*spec[:-1], None))


def dot_out_sharding(x: jax.Array, kernel: jax.Array) -> NamedSharding | None:
    """The ``out_sharding`` that ``jnp.dot(x, kernel)`` (x ``(..., D_in)``, kernel
    ``(D_in, D_out)``) needs on an Explicit mesh, or None where JAX needs none.

    JAX refuses to guess the output sharding only when the contracting dimension is
    sharded in both operands (x's last dim and the kernel's rows). Then the output keeps
    x's batch-dim spec, and its feature dim follows the kernel's columns when those axes
    are free (not used by x's batch dims), else it is replicated; the compiler inserts
    the all-reduce (or reduce-scatter). Off-mesh and on Auto meshes the array types
    carry no axes, so this returns None after two attribute lookups.
    """
    x_spec = jax.typeof(x).sharding.spec
    n = x.ndim
    if len(x_spec) < n or x_spec[n - 1] is None:
        return None
    k_sh = jax.typeof(kernel).sharding
    k_spec = _padded_spec(k_sh.spec, 2)
    if k_spec[0] is None:
        return None
    mesh = jax.typeof(x).sharding.mesh
    batch = _padded_spec(x_spec, n)[:-1]
    if not _all_explicit(mesh, (x_spec[n - 1], k_spec[0])):
        return None
    used = {a for e in batch for a in _axes_of(e)}
    col = k_spec[1]
    if col is not None and (used & set(_axes_of(col)) or not _all_explicit(mesh, (col,))):
        col = None
    return NamedSharding(mesh, PartitionSpec(*batch, col))
