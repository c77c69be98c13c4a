"""Sharding trees derived from parameter metadata."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
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


def dot_out_sharding(
    x: jax.Array, kernel: jax.Array, *, transposed: bool = False
) -> NamedSharding | None:
    """The ``out_sharding`` that ``jnp.dot(x, kernel)`` (x ``(..., D_in)``, kernel
    ``(D_in, D_out)``; with ``transposed=True`` a kernel ``(D_out, D_in)`` used as
    ``kernel.T``, e.g. a tied embedding table) needs on an Explicit mesh, or None where
    JAX needs none.

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
    if transposed:
        k_spec = k_spec[::-1]
    if k_spec[0] is None:
        return None
    mesh = jax.typeof(x).sharding.mesh
    batch = _padded_spec(x_spec, n)[:-1]
    if not _all_explicit(mesh, (x_spec[n - 1], k_spec[0])):
        return None
    used = {a for e in batch for a in _axes_of(e)}
    return NamedSharding(mesh, PartitionSpec(*batch, _free_col(mesh, k_spec[1], used)))


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes over which the (traced) value `x` varies inside
    ``jax.shard_map`` (its ``check_vma`` type): ``jax.typeof(x).manual_axis_type.varying``.

    Empty outside ``shard_map`` and under ``check_vma=False``; `x` may be an array, a
    tracer, a ``jax.ShapeDtypeStruct`` or a Python scalar.
    """
    return frozenset(jax.typeof(x).manual_axis_type.varying)


def explicit_mesh(*arrays: jax.Array) -> Any:
    """The (abstract) mesh of the first array whose type carries one, if that mesh has
    Explicit axes; None off a mesh and on Auto meshes."""
    for a in arrays:
        mesh = getattr(jax.typeof(a).sharding, "mesh", None)
        if mesh is not None and not mesh.empty:
            return mesh if mesh.explicit_axes else None
    return None


def _free_col(mesh: Any, col: Any, used: set) -> Any:
    """An output's feature spec `col` (from a kernel or table), kept when its axes are
    Explicit and not `used` by the output's other dimensions, else None (replicated)."""
    if col is not None and (used & set(_axes_of(col)) or not _all_explicit(mesh, (col,))):
        return None
    return col


def _axes_size(mesh: Any, entry: Any) -> int:
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
    total = 1
    for a in _axes_of(entry):
        total *= sizes[a]
    return total


def conv_out_sharding(
    lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, out_shape: tuple[int, ...]
) -> NamedSharding | None:
    """The ``out_sharding`` that ``lax.conv_general_dilated(lhs, rhs, ...)`` needs on an
    Explicit mesh, or None where JAX infers it (a replicated kernel and unsharded input
    features, off-mesh arrays, Auto meshes).

    JAX infers a convolution's output sharding only for a fully replicated kernel and
    input features that are not sharded. Otherwise the output keeps the input's batch
    and spatial specs (a spatial spec only where the output size stays divisible by its
    axes), and its features follow the kernel's output-feature spec when those axes are
    free, else are replicated; the compiler inserts the collectives (an all-reduce for
    input features sharded in both operands).

    Args:
      lhs, rhs: the operands as passed to the convolution.
      dimension_numbers: ``lax.ConvDimensionNumbers`` (``lax.conv_dimension_numbers``).
      out_shape: the output shape.
    """
    lhs_dims, rhs_dims, out_dims = dimension_numbers
    l_spec = _padded_spec(jax.typeof(lhs).sharding.spec, lhs.ndim)
    r_spec = _padded_spec(jax.typeof(rhs).sharding.spec, rhs.ndim)
    if all(e is None for e in r_spec) and l_spec[lhs_dims[1]] is None:
        return None
    mesh = explicit_mesh(lhs, rhs)
    if mesh is None:
        return None
    out: list[Any] = [None] * len(out_shape)
    used: set = set()
    pairs = [(lhs_dims[0], out_dims[0])] + list(zip(lhs_dims[2:], out_dims[2:], strict=True))
    for l_dim, o_dim in pairs:
        entry = l_spec[l_dim]
        if entry is not None and out_shape[o_dim] % _axes_size(mesh, entry) == 0:
            out[o_dim] = entry
            used |= set(_axes_of(entry))
    col = _free_col(mesh, r_spec[rhs_dims[0]], used)
    if col is not None and out_shape[out_dims[1]] % _axes_size(mesh, col) == 0:
        out[out_dims[1]] = col
    return NamedSharding(mesh, PartitionSpec(*out))


def resolve_out_sharding(
    where: str, out_sharding: Any, ndim: int, legend: str
) -> tuple[NamedSharding | None, NamedSharding | None]:
    """A user's ``out_sharding`` for a layer's output of `ndim` dims, as ``(sharding for
    the op's out_sharding, sharding constraint)``: the first on a mesh with Explicit
    axes, the second on an Auto mesh.

    Args:
      where: the layer, as named in messages (``"Linear 'net/fc'"``).
      out_sharding: a ``NamedSharding``, or a ``PartitionSpec`` under ``jax.set_mesh``.
      ndim: the output's rank.
      legend: the output's layout for messages, e.g. ``"(..., 8)"``.

    Raises:
      TypeError: another type. ValueError: a ``PartitionSpec`` without a mesh set, more
        entries than dims, or an axis the mesh lacks; each names `where` and the fix.
    """
    if isinstance(out_sharding, PartitionSpec):
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            raise ValueError(
                f"{where}: out_sharding={out_sharding} is a PartitionSpec but no mesh is "
                "set. Call the layer under `with jax.set_mesh(mesh):` or pass "
                "out_sharding=NamedSharding(mesh, spec)."
            )
        spec = out_sharding
    elif isinstance(out_sharding, NamedSharding):
        mesh, spec = out_sharding.mesh, out_sharding.spec
    else:
        raise TypeError(
            f"{where}: out_sharding must be a jax.sharding.NamedSharding, a PartitionSpec "
            f"(under jax.set_mesh) or None, got {type(out_sharding).__name__}."
        )
    if len(spec) > ndim:
        raise ValueError(
            f"{where}: out_sharding {spec} has {len(spec)} entries but the output has "
            f"{ndim} dims {legend}. Give at most one entry per dimension."
        )
    for entry in spec:
        for axis in _axes_of(entry):
            if axis not in mesh.axis_names:
                raise ValueError(
                    f"{where}: out_sharding {spec} names mesh axis {axis!r}, but the mesh "
                    f"has axes {tuple(mesh.axis_names)}. Use one of those axes."
                )
    sharding = NamedSharding(mesh, spec)
    if mesh.explicit_axes:
        return sharding, None
    return None, sharding


def reshard_dim(x: jax.Array, dim: int, out: NamedSharding, out_dim: int) -> jax.Array:
    """`x` with dimension `dim` moved to the spec that dimension `out_dim` has in `out`
    (a 1-D bias onto an output's feature spec), when it is sharded otherwise; `x`
    itself when nothing changes. Only for arrays on `out`'s Explicit mesh."""
    spec = _padded_spec(out.spec, out_dim + 1)
    want = spec[out_dim]
    have = _padded_spec(jax.typeof(x).sharding.spec, x.ndim)
    if have[dim] is None or have[dim] == want:
        return x
    new = list(have)
    new[dim] = want
    return jax.sharding.reshard(x, NamedSharding(out.mesh, PartitionSpec(*new)))


def take_out_sharding(table: jax.Array, indices: jax.Array) -> NamedSharding | None:
    """The ``out_sharding`` of ``table.at[indices].get()`` (rows of a 2-D `table`) on an
    Explicit mesh, or None where JAX infers it (a replicated table, Auto meshes, off a
    mesh). The output ``indices.shape + (D,)`` keeps the indices' spec; its features
    follow the table's column spec when those axes are free, else are replicated (for
    a table sharded over its rows the compiler combines the partial lookups)."""
    t_spec = _padded_spec(jax.typeof(table).sharding.spec, 2)
    if all(e is None for e in t_spec):
        return None
    mesh = explicit_mesh(table, indices)
    if mesh is None:
        return None
    i_spec = _padded_spec(jax.typeof(indices).sharding.spec, indices.ndim)
    used = {a for e in i_spec for a in _axes_of(e)}
    return NamedSharding(mesh, PartitionSpec(*i_spec, _free_col(mesh, t_spec[1], used)))


def reshard_like(x: Any, like: Any) -> Any:
    """Each array of `x` moved to the sharding type of the array at the same place in
    `like` when the two differ on an Explicit mesh (a recurrent state carried through
    ``lax.scan`` must keep its type); `x` itself otherwise."""

    def one(a: jax.Array, b: jax.Array) -> jax.Array:
        if explicit_mesh(b) is None:
            return a
        want = jax.typeof(b).sharding
        have = jax.typeof(a).sharding
        if _padded_spec(have.spec, a.ndim) == _padded_spec(want.spec, b.ndim):
            return a
        return jax.sharding.reshard(a, want)

    return jax.tree.map(one, x, like)


def zeros_on_batch(shape: tuple[int, ...], dtype: Any, like: jax.Array) -> jax.Array:
    """Zeros of `shape` whose leading (batch) dimension takes the spec of `like`'s
    leading dimension on an Explicit mesh (a recurrent layer's initial state next to its
    batch-sharded input), the other dimensions replicated; plain zeros elsewhere."""
    mesh = explicit_mesh(like)
    spec = _padded_spec(jax.typeof(like).sharding.spec, like.ndim) if like.ndim else ()
    if mesh is None or not spec or spec[0] is None:
        return jnp.zeros(shape, dtype)
    out = PartitionSpec(spec[0], *([None] * (len(shape) - 1)))
    return jnp.zeros(shape, dtype, out_sharding=NamedSharding(mesh, out))


def split_out_sharding(x: jax.Array, dim: int, sizes: tuple[int, int]) -> NamedSharding | None:
    """The ``out_sharding`` of a reshape that splits dimension `dim` of `x` into two
    dimensions of `sizes`, on an Explicit mesh where `dim` is sharded (JAX refuses when
    the outer size is not divisible by the axes); None elsewhere. The axes go to the
    outer dimension when they divide it, else to the inner one, else nowhere
    (replicated); the compiler moves the data."""
    mesh = explicit_mesh(x)
    if mesh is None:
        return None
    spec = _padded_spec(jax.typeof(x).sharding.spec, x.ndim)
    entry = spec[dim]
    if entry is None:
        return None
    size = _axes_size(mesh, entry)
    outer = (entry, None) if sizes[0] % size == 0 else None
    if outer is None:
        outer = (None, entry) if sizes[1] % size == 0 else (None, None)
    return NamedSharding(mesh, PartitionSpec(*spec[:dim], *outer, *spec[dim + 1 :]))


def explicit_sharding(x: jax.Array) -> NamedSharding | None:
    """`x`'s sharding type on an Explicit mesh (to restore it after a reshape), or None
    off a mesh and on Auto meshes."""
    if explicit_mesh(x) is None:
        return None
    sh = jax.typeof(x).sharding
    return None if all(e is None for e in sh.spec) else sh
