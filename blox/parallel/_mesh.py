"""Building and describing a device mesh, and asking which axes are bound where."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from blox.core._guards import stale_mesh
from blox.core._sharding import varying_axes as varying_axes  # defined in core (scans use it)

__all__ = ["bound_axes", "describe_mesh", "make_mesh", "place"]

_AXIS_TYPES = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}


def _axis_types(axis_types: Any, n: int) -> tuple[AxisType, ...] | None:
    if axis_types is None:
        return None
    if isinstance(axis_types, (str, AxisType)):
        axis_types = (axis_types,) * n
    out = []
    for t in axis_types:
        if isinstance(t, str) and t.lower() in _AXIS_TYPES:
            t = _AXIS_TYPES[t.lower()]
        if not isinstance(t, AxisType) or t == AxisType.Manual:
            raise ValueError(
                f"make_mesh: axis type {t!r} is not 'explicit' or 'auto'. Pass "
                "axis_types='explicit' (JAX's default: shardings are part of array types) or "
                "'auto' (the compiler propagates shardings), or one per axis."
            )
        out.append(t)
    if len(out) != n:
        raise ValueError(
            f"make_mesh: {len(out)} axis types {tuple(out)} for {n} axes; give one per axis "
            "or a single one for all."
        )
    return tuple(out)


def make_mesh(
    axis_shapes: Sequence[int | None],
    axis_names: Sequence[str],
    *,
    devices: Sequence[Any] | None = None,
    axis_types: str | AxisType | Sequence[str | AxisType] | None = None,
) -> Mesh:
    """A `jax.sharding.Mesh` with named axes, at most one of whose lengths is inferred.

    ``make_mesh((-1, 2), ('data', 'model'))`` on 8 devices gives ``data=4, model=2``.
    The product of the lengths must equal the number of devices used.

    Args:
      axis_shapes: one length per axis; at most one may be ``-1`` or ``None`` (inferred
        from the device count).
      axis_names: one distinct string per axis.
      devices: the devices to use (default: all of ``jax.devices()``). Pass e.g.
        ``jax.devices()[:2]`` to use a subset.
      axis_types: ``'explicit'`` (JAX's default: shardings are part of array types and
        a matmul over a sharded contracting dimension needs an ``out_sharding``),
        ``'auto'`` (the compiler propagates shardings), or one per axis. ``None`` keeps
        ``jax.make_mesh``'s default.

    Returns:
      The mesh (built by ``jax.make_mesh``, so the device order follows the hardware).

    Raises:
      ValueError: names not distinct strings, a count that differs from the shapes, two
        inferred lengths, a length that is not positive, or lengths whose product does
        not equal (or, with an inferred one, divide) the device count; the message
        names the axes, the lengths and the device count.

    >>> import jax
    >>> from blox import parallel as bp
    >>> mesh = bp.make_mesh((-1,), ('data',))
    >>> mesh.shape['data'] == len(jax.devices())
    True
    """
    names = tuple(axis_names)
    shapes = tuple(axis_shapes)
    if (
        not names
        or not all(isinstance(n, str) and n for n in names)
        or len(set(names)) != len(names)
    ):
        raise ValueError(
            f"make_mesh: axis_names must be distinct non-empty strings, got {names!r}. "
            "Use e.g. ('data', 'model')."
        )
    if len(shapes) != len(names):
        raise ValueError(
            f"make_mesh: {len(shapes)} lengths {shapes} for {len(names)} axes {names}; give "
            "one length per axis (-1 for the one to infer)."
        )
    devices = list(jax.devices() if devices is None else devices)
    n_dev = len(devices)
    if n_dev == 0:
        raise ValueError("make_mesh: the device list is empty.")
    given = dict(zip(names, shapes, strict=True))
    inferred = [i for i, s in enumerate(shapes) if s is None or s == -1]
    if len(inferred) > 1:
        which = ", ".join(names[i] for i in inferred)
        raise ValueError(
            f"make_mesh: axes {which} all ask to be inferred ({given}); "
            "at most one length may be -1/None. Give the others explicitly."
        )
    for name, s in zip(names, shapes, strict=True):
        if s is None or s == -1:
            continue
        if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or s < 1:
            raise ValueError(
                f"make_mesh: axis {name!r} has length {s!r}; lengths must be positive ints "
                "(or -1/None for the inferred one)."
            )
    known = math.prod(int(s) for i, s in enumerate(shapes) if i not in inferred)
    layout = ", ".join(
        f"{n}={'?' if i in inferred else int(s)}" for i, (n, s) in enumerate(given.items())
    )
    if inferred:
        if n_dev % known:
            raise ValueError(
                f"make_mesh: the lengths of the other axes ({layout}) multiply to {known}, "
                f"which does not divide the {n_dev} devices, so axis "
                f"{names[inferred[0]]!r} cannot be inferred. Choose lengths whose product "
                f"divides {n_dev}."
            )
        shapes = tuple(n_dev // known if i in inferred else int(s) for i, s in enumerate(shapes))
    elif known != n_dev:
        hint = (
            f"pass devices=jax.devices()[:{known}] to use a subset"
            if known < n_dev and n_dev % known == 0
            else f"choose lengths whose product is {n_dev}"
        )
        raise ValueError(
            f"make_mesh: axes ({layout}) need {known} devices, but {n_dev} are used. Make "
            f"one length -1 to infer it, or {hint}."
        )
    types = _axis_types(axis_types, len(names))
    return jax.make_mesh(shapes, names, axis_types=types, devices=devices)


def describe_mesh(mesh: Mesh) -> str:
    """A one-line description: axis names and lengths, axis types, device count and
    kind, and process count.

    >>> import jax
    >>> from blox import parallel as bp
    >>> print(bp.describe_mesh(bp.make_mesh((1,), ('data',), devices=jax.devices()[:1])))
    Mesh(data=1; Explicit) over 1 cpu device (cpu), 1 process
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"describe_mesh expects a jax.sharding.Mesh, got {type(mesh).__name__}. Build one "
            "with blox.parallel.make_mesh."
        )
    axes = ", ".join(f"{n}={s}" for n, s in mesh.shape.items())
    types = {t.name for t in mesh.axis_types}
    kind = types.pop() if len(types) == 1 else ", ".join(t.name for t in mesh.axis_types)
    devs = mesh.devices.ravel()
    n = len(devs)
    kinds = sorted({d.device_kind for d in devs})
    platform = devs[0].platform
    procs = len({d.process_index for d in devs})
    return (
        f"Mesh({axes}; {kind}) over {n} {platform} device{'s' if n != 1 else ''} "
        f"({', '.join(kinds)}), {procs} process{'es' if procs != 1 else ''}"
    )


def bound_axes() -> tuple[str, ...]:
    """The axis names bound where this is called (traced): the manual axes of an
    enclosing ``jax.shard_map`` and the ``axis_name`` of an enclosing ``jax.vmap``.

    Collectives (``psum`` ...) work only over these. Outside any such transform the
    result is ``()``; a mesh set with ``jax.set_mesh`` does not bind its axes.

    >>> from blox import parallel as bp
    >>> bp.bound_axes()
    ()
    """
    manual = tuple(jax.sharding.get_abstract_mesh().manual_axes)
    return manual + tuple(n for n in _vmap_axis_names() if n not in manual)


def _vmap_axis_names() -> tuple[str, ...]:
    """Axis names bound by enclosing ``jax.vmap(..., axis_name=...)``.

    JAX has no public accessor for these (0.10); this is the one private read in blox's
    parallel code, kept here so a JAX release that moves it fails in one place, loudly.
    """
    try:
        from jax._src import core

        env = core.get_axis_env()
        return tuple(env.axis_names())
    except (ImportError, AttributeError) as e:  # pragma: no cover - depends on JAX
        raise RuntimeError(
            f"blox.parallel.bound_axes: this JAX ({jax.__version__}) no longer exposes the "
            "vmap axis environment where blox reads it (jax._src.core.get_axis_env). Install "
            "a JAX version within blox's pinned range (see pyproject.toml)."
        ) from e


# ---------------------------------------------------------------------------
# Internal helpers shared by the other modules
# ---------------------------------------------------------------------------


def check_vma_enabled() -> bool:
    """Whether the enclosing ``shard_map`` tracks varying axes (``check_vma=True``).

    Read from the public type system: under ``check_vma=True`` ``axis_index`` of a manual
    axis is typed as varying over it; under ``check_vma=False`` nothing is. Outside any
    ``shard_map`` there is nothing to track (False).
    """
    manual = jax.sharding.get_abstract_mesh().manual_axes
    if not manual:
        return False
    return manual[0] in varying_axes(jax.lax.axis_index(manual[0]))


def constrain(x: Any, mesh: Mesh, spec: PartitionSpec) -> Any:
    """Puts `x` (traced or concrete) on ``NamedSharding(mesh, spec)``: a ``reshard`` when
    every axis in `spec` is Explicit, else a sharding constraint (Auto axes)."""
    names = [n for e in spec if e is not None for n in (e if isinstance(e, tuple) else (e,))]
    types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
    explicit = [n for n, t in types.items() if t == AxisType.Explicit]
    # reshard accepts Explicit axes only; a constraint handles Auto ones.
    if all(n in explicit for n in (names or types)):
        return jax.sharding.reshard(x, NamedSharding(mesh, spec))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# ---------------------------------------------------------------------------
# Moving a pytree between devices and meshes
# ---------------------------------------------------------------------------


def _is_target(t: Any) -> bool:
    return isinstance(t, (jax.Device, jax.sharding.Sharding, Mesh, PartitionSpec))


def _target_sharding(target: Any, mesh: Mesh | None = None) -> jax.sharding.Sharding:
    if isinstance(target, Mesh):
        return NamedSharding(target, PartitionSpec())
    if isinstance(target, jax.sharding.Sharding):
        return target
    if isinstance(target, jax.Device):
        return jax.sharding.SingleDeviceSharding(target)
    if isinstance(target, PartitionSpec):
        if mesh is None:
            raise TypeError(
                f"place: a PartitionSpec target ({target}) needs the mesh: "
                "bp.place(params, specs, mesh=mesh)."
            )
        return NamedSharding(mesh, target)
    raise TypeError(
        f"place: target must be a jax.Device, a jax.sharding.Sharding, a Mesh (replicated "
        f"over it) or a tree of those (or of PartitionSpecs, with mesh=), got "
        f"{type(target).__name__}. E.g. bp.place(params, jax.devices()[0]), "
        "bp.place(batch, NamedSharding(mesh, P('data'))) or bp.place(params, specs, mesh=mesh)."
    )


def _whole(x: jax.Array, device: Any, name: str) -> Any:
    """`x` as one single-device array holding its whole value, with no mesh in its type
    (a shard of a replicated copy: no host round trip)."""
    if not x.is_fully_addressable:
        raise ValueError(
            f"place: leaf {name} spans devices of other processes ({len(x.sharding.device_set)} "
            "devices); one process cannot move it onto one device. Gather it first, e.g. "
            "jax.experimental.multihost_utils.process_allgather(x)."
        )
    if not x.is_fully_replicated:
        sharding = x.sharding
        if isinstance(sharding, NamedSharding):
            x = jax.device_put(x, NamedSharding(sharding.mesh, PartitionSpec()))
        else:
            return np.asarray(x)  # another kind of sharding: via the host
    shards = x.addressable_shards
    local = next((s for s in shards if s.device == device), shards[0])
    return local.data


def place(tree: Any, target: Any, *, mesh: Mesh | None = None) -> Any:
    """Every array of `tree` (params, optimizer state, a rollout, a batch) moved onto
    `target`: one device, a ``Sharding``, a ``Mesh`` (replicated over it), or a tree of
    those, one per leaf (e.g. the ``PartitionSpec`` tree of `fsdp_specs` with `mesh`).

    Use it instead of ``jax.device_put(tree, device)`` to take arrays off a mesh, e.g.
    the learner's params to an actor's device. JAX 0.10's ``device_put`` of an array
    laid out on a mesh with Explicit axes (blox's default) onto one device keeps that
    mesh in the array's type: it prints as single-device, and the next ``jax.jit``
    fails with "Length of device assignment 1 is not equal to the size of the mesh ...
    enter your jit into a mesh context via jax.set_mesh", which does not help. `place`
    gives each leaf a single-device array with no mesh in its type (the whole value,
    copied from the local shard of a replicated layout, gathered first if sharded), then
    ``device_put``s it on `target`. A leaf that stays on the same devices (a rollout
    onto the mesh it is on, params onto their FSDP layout) is resharded directly.

    Args:
      tree: any pytree of arrays (``jax.Array``, NumPy, Python scalars); `Params` keep
        their paths, flags and metadata.
      target: a ``jax.Device``, a ``jax.sharding.Sharding`` (e.g. ``NamedSharding(mesh,
        P('data'))`` for a batch) or a ``Mesh`` (every leaf replicated, ``P()``); or a
        tree with one of those (or a ``PartitionSpec``) per leaf of `tree`, such as the
        specs from `fsdp_specs` or `param_specs`.
      mesh: the mesh of ``PartitionSpec`` targets.

    Returns:
      The same tree with every leaf on `target`.

    Raises:
      TypeError: a `target` of another type, or PartitionSpecs without `mesh`.
      ValueError: a leaf that spans devices of other processes (naming it); a target
        tree with another number of leaves.

    >>> import jax, jax.numpy as jnp, blox as bx
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from blox import parallel as bp
    >>> mesh = bp.make_mesh((4,), ('data',), devices=jax.devices()[:4])
    >>> params = bx.Params()
    >>> params[('fc', 'kernel')] = bx.Param(jnp.ones((8, 2)))
    >>> params = bp.place(params, mesh)                  # replicated on the learner mesh
    >>> actor = bp.place(params, jax.devices()[5])       # the actor's copy
    >>> actor[('fc', 'kernel')].value.sharding.device_set == {jax.devices()[5]}
    True
    >>> float(jax.jit(lambda p: p.value(('fc', 'kernel')).sum())(actor))
    16.0
    """
    if _is_target(target):
        targets = None
        sharding = _target_sharding(target, mesh)
    else:
        targets = jax.tree.leaves(target, is_leaf=_is_target)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    if targets is not None and len(targets) != len(leaves):
        raise ValueError(
            f"place: the target tree has {len(targets)} leaves for the {len(leaves)} leaves "
            "of the tree; give one target per leaf (e.g. the specs of these params), or a "
            "single device, sharding or mesh for all."
        )
    out = []
    for i, (kp, x) in enumerate(leaves):
        name = jax.tree_util.keystr(kp) or "<root>"
        s = sharding if targets is None else _target_sharding(targets[i], mesh)
        if isinstance(x, jax.core.Tracer):
            raise TypeError(
                f"place: leaf {name} is traced (place was called inside jax.jit); it moves "
                "concrete arrays between calls. Under jit use jax.sharding.reshard or "
                "out_shardings."
            )
        if isinstance(x, jax.Array):
            same = x.sharding.device_set == s.device_set and stale_mesh(x) is None
            if not same:
                single = (
                    next(iter(s.device_set))
                    if isinstance(s, jax.sharding.SingleDeviceSharding)
                    else None
                )
                x = _whole(x, single, name)
        out.append(jax.device_put(x, s))
    return jax.tree_util.tree_unflatten(treedef, out)
