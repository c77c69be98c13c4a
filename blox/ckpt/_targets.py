"""The restore target: every array leaf as a ``jax.ShapeDtypeStruct`` with the sharding it
must have *now* (taken from the target, or derived from sharding rules or parameter
metadata on a mesh)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from blox.core._params import Param, Params, format_path
from blox.core._sharding import partition_specs

__all__ = ["abstract_target"]


def _is_params(x: Any) -> bool:
    return isinstance(x, Params)


def _is_array_like(value: Any) -> bool:
    if isinstance(value, (bool, int, float)) or isinstance(value, (np.ndarray, np.generic)):
        return False  # restored as the same Python / NumPy type
    return getattr(value, "shape", None) is not None and getattr(value, "dtype", None) is not None


def _on_mesh(sharding: Any, mesh: Mesh) -> bool:
    return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


def _reference(nodes: list[Params]) -> Params:
    """One entry per parameter path: the parameter's shape, taken as the leaf of highest
    rank, then largest size, at that path (the parameter itself, or Adam's moments of its
    shape; Adafactor's factored statistics are smaller), with its flags and metadata."""
    best: dict[tuple, tuple[tuple, tuple, Any, Param]] = {}
    for node in nodes:
        for key, param in node.items():
            shape = tuple(int(d) for d in getattr(param.value, "shape", ()))
            dtype = getattr(param.value, "dtype", np.float32)
            rank = (len(shape), int(np.prod(shape, dtype=np.int64)))
            if key not in best or rank > best[key][0]:
                best[key] = (rank, shape, dtype, param)
    items = [
        (key, param.replace(value=jax.ShapeDtypeStruct(shape, dtype)))
        for key, (_, shape, dtype, param) in best.items()
    ]
    return Params.from_items(items, locked=False)


def _fitted_specs(nodes: list[Params], mesh: Mesh, rules: Sequence | None) -> list[Params]:
    """A `Params` of ``PartitionSpec`` per node: each parameter's spec (by `rules`, else by
    its ``metadata['sharding']``), given to every leaf it fits and replicated elsewhere,
    the rule of `blox.parallel.opt_state_specs`."""
    from blox.parallel import opt_state_specs, param_specs

    ref = _reference(nodes)
    specs = param_specs(ref, rules, mesh) if rules is not None else partition_specs(ref, mesh)
    return opt_state_specs(list(nodes), specs, mesh)


def _build(
    state: Any, mesh: Mesh | None, rules: Sequence | None
) -> tuple[Any, dict[str, PartitionSpec]]:
    """The target, and the leaves that `mesh` lays out replicated because nothing said
    otherwise (no sharding on the mesh, no rule, no metadata): ``{name: spec}``."""
    if rules is not None and mesh is None:
        raise ValueError(
            "abstract_target/restore: rules=... lay parameters out on a mesh; pass mesh=... "
            "too (the mesh of this run, e.g. blox.parallel.make_mesh((2, 4), ('data', "
            "'model')))."
        )
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=_is_params)
    nodes = [x for _, x in flat if isinstance(x, Params)]
    fitted = iter(_fitted_specs(nodes, mesh, rules) if mesh is not None and nodes else ())
    defaulted: dict[str, PartitionSpec] = {}

    def place(value: Any, name: str, spec: PartitionSpec | None, by_default: bool) -> Any:
        if not _is_array_like(value):
            return value
        own = getattr(value, "sharding", None)
        if mesh is None:
            sharding = own if own is not None else SingleDeviceSharding(jax.local_devices()[0])
        elif _on_mesh(own, mesh):
            sharding = own
        else:
            sharding = NamedSharding(mesh, spec if spec is not None else PartitionSpec())
            if by_default:
                defaulted[name] = sharding.spec
        return jax.ShapeDtypeStruct(tuple(value.shape), value.dtype, sharding=sharding)

    out = []
    for key_path, x in flat:
        prefix = jax.tree_util.keystr(key_path, simple=True, separator="/")
        if isinstance(x, Params):
            specs = next(fitted).leaves() if mesh is not None else (None,) * len(x)
            values = []
            for (key, param), spec in zip(x.items(), specs, strict=True):
                name = f"{prefix}/{format_path(key)}" if prefix else format_path(key)
                no_meta = not param.sharding
                values.append(place(param.value, name, spec, rules is None and no_meta))
            out.append(x.with_leaves(values))
        else:
            out.append(place(x, prefix or "<root>", None, True))
    return jax.tree_util.tree_unflatten(treedef, out), defaulted


def abstract_target(
    state: Any, *, mesh: Mesh | None = None, rules: Sequence[tuple[str, Any]] | None = None
) -> Any:
    """The abstract state a checkpoint is restored into, with the shardings of *now*.

    Each array leaf becomes a ``jax.ShapeDtypeStruct`` whose sharding is, in order:

    1. the leaf's own sharding (a concrete ``jax.Array``'s, or the ``sharding`` of a
       ``ShapeDtypeStruct``, e.g. from ``jax.eval_shape`` of a ``jax.jit`` with
       ``out_shardings``), when `mesh` is not given or the sharding is a
       ``NamedSharding`` on `mesh`;
    2. with `mesh`, for a `Params` leaf: its parameter's spec from `rules`
       (`blox.parallel.param_specs`: first match wins, every parameter matched) or, without
       `rules`, from its ``metadata['sharding']`` (`blox.partition_specs`); this also covers
       Optax state, whose moments are `Params` of the same paths. A leaf whose shape the
       spec does not fit (Adafactor's factored row/column statistics, its ``(1,)``
       placeholders) is replicated, as in `blox.parallel.opt_state_specs`; the
       parameter's shape is that of the highest-rank, largest leaf at its path;
    3. with `mesh`, any other leaf: replicated over `mesh`;
    4. without `mesh`: the first local device.

    The shardings saved in the checkpoint are never used, so a checkpoint written on one
    mesh is restored onto the target's mesh (resharding on read). NumPy arrays and Python
    numbers are kept as they are (restored as the same type).

    Args:
      state: the structure to restore into, concrete or abstract (``jax.eval_shape``).
      mesh: the mesh of this run: every array leaf is laid out on it (a concrete leaf on
        another mesh or on one device is moved to it).
      rules: ``(pattern, spec)`` sharding rules for the `Params` leaves (e.g.
        ``bp.transformer_tp_rules('model') + [('.*', None)]``); needs `mesh`.

    Returns:
      The same tree with ``ShapeDtypeStruct`` array leaves.

    Raises:
      ValueError: `rules` without `mesh`; a parameter that no rule matches, a rule that
        matches nothing, or a spec that does not fit (from `blox.parallel.param_specs` /
        `blox.partition_specs`).
      TypeError: `mesh` is not a ``jax.sharding.Mesh``.

    >>> import blox as bx, jax, jax.numpy as jnp
    >>> p = bx.Params(); p[('w',)] = bx.Param(jnp.zeros((8, 2)), metadata={'sharding': ('d', None)})
    >>> mesh = jax.make_mesh((1,), ('d',))
    >>> t = abstract_target(jax.eval_shape(lambda: p), mesh=mesh)
    >>> t[('w',)].value.sharding.spec
    P('d', None)
    """
    check_mesh(mesh, "abstract_target")
    return _build(state, mesh, rules)[0]


def check_mesh(mesh: Any, where: str) -> None:
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(
            f"{where}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}. "
            "Build one with jax.make_mesh((n,), ('data',))."
        )
