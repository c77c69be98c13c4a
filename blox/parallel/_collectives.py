"""Checked collectives over pytrees: the ``jax.lax`` ones, with the axis checked at trace
time.

Each is exactly the ``jax.lax`` collective applied to every leaf; the only addition is
that an axis name which is not bound where the function is traced (no enclosing
``jax.shard_map`` over a mesh with that axis, nor ``jax.vmap(..., axis_name=...)``)
raises a `ValueError` naming the axis, the axes that are bound, and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from blox.parallel._mesh import bound_axes, check_vma_enabled

__all__ = ["all_gather", "broadcast", "pmean", "ppermute", "psum", "reduce_scatter"]

Axis = str | tuple[str, ...]

_UNBOUND = (
    "{op}: axis {missing} is not bound here; the axes bound where it is called are "
    "{bound}. Collectives run only inside jax.shard_map (over the mesh axes it makes manual) "
    "or jax.vmap(..., axis_name=...). {fix}"
)
_FIX_NONE = (
    "Call it inside the function you pass to shard_map:\n"
    "    grads = bp.{op}(grads, {axis!r})              # wrong: plain jit, no axis bound\n"
    "    step = jax.shard_map(step, mesh=mesh, in_specs=..., out_specs=...)  # right: "
    "{axis!r} is bound inside step"
)
_FIX_SOME = "Use one of the bound axes, or add {missing} to the mesh and to shard_map's axis_names."


def _axes(axis: Any, op: str) -> tuple[str, ...]:
    names = axis if isinstance(axis, tuple) else (axis,)
    if not names or not all(isinstance(n, str) for n in names):
        raise TypeError(
            f"{op}: the axis must be a mesh-axis name or a tuple of names, got {axis!r}."
        )
    return names


def check_axis(axis: Axis, op: str = "collective") -> tuple[str, ...]:
    """Raises `ValueError` unless every name in `axis` is bound where this is traced."""
    names = _axes(axis, op)
    bound = bound_axes()
    missing = [n for n in names if n not in bound]
    if missing:
        miss = ", ".join(repr(n) for n in missing)
        fix = (_FIX_NONE if not bound else _FIX_SOME).format(op=op, axis=axis, missing=miss)
        raise ValueError(
            _UNBOUND.format(op=op, missing=miss, bound=bound if bound else "none", fix=fix)
        )
    return names


def _axis_size(names: tuple[str, ...]) -> int:
    size = 1
    for n in names:
        size *= jax.lax.axis_size(n)
    return size


def _name(kp: Any) -> str:
    return jax.tree_util.keystr(kp) or "<root>"


def _leaves(tree: Any, op: str) -> None:
    for kp, x in jax.tree_util.tree_leaves_with_path(tree):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{op}: leaf {_name(kp)} is a {type(x).__name__}, not an array.")


def psum(tree: Any, axis: Axis) -> Any:
    """Sum of every leaf over `axis` (``jax.lax.psum``).

    Args:
      tree: a pytree of arrays (e.g. gradients as `Params`).
      axis: a bound axis name, or a tuple of names.

    Returns:
      The same tree, each leaf summed over the devices along `axis`.

    Under ``shard_map(check_vma=True)`` (the default) a leaf that does not vary over
    `axis` is multiplied by the axis size, exactly as ``jax.lax.psum`` does.

    >>> import jax, jax.numpy as jnp
    >>> from blox import parallel as bp
    >>> jax.vmap(lambda x: bp.psum({'a': x}, 'i'), axis_name='i')(jnp.arange(3.0))['a']
    Array([3., 3., 3.], dtype=float32)
    """
    names = check_axis(axis, "psum")
    _leaves(tree, "psum")
    return jax.lax.psum(tree, names if len(names) > 1 else names[0])


def pmean(tree: Any, axis: Axis) -> Any:
    """Mean of every leaf over `axis` (``jax.lax.pmean``).

    Gradients of a loss taken inside ``shard_map`` with replicated (``P()``) params are
    *already summed* over the data axis by autodiff (check_vma=True): ``pmean`` of those
    is **not** the data-parallel gradient. See `dp_value_and_grad` and docs/parallel.md.

    >>> import jax, jax.numpy as jnp
    >>> from blox import parallel as bp
    >>> jax.vmap(lambda x: bp.pmean(x, 'i'), axis_name='i')(jnp.arange(3.0))
    Array([1., 1., 1.], dtype=float32)
    """
    names = check_axis(axis, "pmean")
    _leaves(tree, "pmean")
    return jax.lax.pmean(tree, names if len(names) > 1 else names[0])


def _check_dim(x: Any, dim: int, op: str, kp: Any) -> int:
    nd = x.ndim
    if not -nd <= dim < nd:
        raise ValueError(
            f"{op}: leaf {_name(kp)} of shape {tuple(x.shape)} has no dimension {dim}."
        )
    return dim % nd


def all_gather(tree: Any, axis: Axis, *, dim: int = 0, tiled: bool = True) -> Any:
    """Gathers every leaf's shards over `axis` (``jax.lax.all_gather``).

    Args:
      tree: a pytree of arrays.
      axis: a bound axis name.
      dim: the dimension along which the shards are joined.
      tiled: concatenate along `dim` (``(.., n, ..)`` -> ``(.., n * A, ..)``, default);
        with ``tiled=False`` a new axis of size A is inserted at `dim`.

    The result is the same on every device along `axis`; under ``check_vma=True`` it is
    typed invariant over `axis` (``to='invarying'``), so it may leave the ``shard_map``
    with an out_spec that omits `axis`.

    >>> import jax, jax.numpy as jnp
    >>> from blox import parallel as bp
    >>> f = lambda x: bp.all_gather(x, 'i', tiled=False)
    >>> jax.vmap(f, axis_name='i')(jnp.arange(3.0))[0]
    Array([0., 1., 2.], dtype=float32)
    """
    names = check_axis(axis, "all_gather")
    _leaves(tree, "all_gather")
    ax = names if len(names) > 1 else names[0]

    def one(kp, x):
        d = _check_dim(x, dim, "all_gather", kp) if tiled else dim % (x.ndim + 1)
        # Every device holds the same result: type it invariant (check_vma=True), so it
        # can leave a shard_map replicated (out_specs without the axis).
        to = "invarying" if check_vma_enabled() else "varying"
        return jax.lax.all_gather(x, ax, axis=d, tiled=tiled, to=to)

    return jax.tree_util.tree_map_with_path(one, tree)


def reduce_scatter(tree: Any, axis: Axis, *, dim: int = 0) -> Any:
    """Sums every leaf over `axis` and keeps this device's slice of dimension `dim`
    (``jax.lax.psum_scatter`` with ``tiled=True``): ``(.., n, ..)`` -> ``(.., n / A, ..)``.

    Raises:
      ValueError: `dim` is not divisible by the axis size A (names the leaf and shape).
    """
    names = check_axis(axis, "reduce_scatter")
    _leaves(tree, "reduce_scatter")
    size = _axis_size(names)
    ax = names if len(names) > 1 else names[0]

    def one(kp, x):
        d = _check_dim(x, dim, "reduce_scatter", kp)
        if x.shape[d] % size:
            raise ValueError(
                f"reduce_scatter: leaf {_name(kp)} of shape {tuple(x.shape)}: "
                f"dimension {d} (size {x.shape[d]}) is not divisible by the size {size} of "
                f"axis {axis!r}. Pad it or scatter another dimension."
            )
        return jax.lax.psum_scatter(x, ax, scatter_dimension=d, tiled=True)

    return jax.tree_util.tree_map_with_path(one, tree)


def ppermute(tree: Any, axis: str, perm: Sequence[tuple[int, int]]) -> Any:
    """Sends every leaf from device ``src`` to device ``dst`` along `axis` for each
    ``(src, dst)`` pair of `perm` (``jax.lax.ppermute``); devices that receive nothing
    get zeros.

    Raises:
      ValueError: an index outside ``[0, axis size)``, or a repeated source or
        destination.

    >>> import jax, jax.numpy as jnp
    >>> from blox import parallel as bp
    >>> shift = lambda x: bp.ppermute(x, 'i', [(0, 1), (1, 2), (2, 0)])
    >>> jax.vmap(shift, axis_name='i')(jnp.arange(3.0))
    Array([2., 0., 1.], dtype=float32)
    """
    (name,) = check_axis(axis, "ppermute")
    _leaves(tree, "ppermute")
    size = jax.lax.axis_size(name)
    pairs = [tuple(int(i) for i in p) for p in perm]
    bad = [p for p in pairs if len(p) != 2 or not all(0 <= i < size for i in p)]
    if bad:
        raise ValueError(
            f"ppermute: pairs {bad} are not (src, dst) indices in [0, {size}) for axis "
            f"{axis!r} of size {size}."
        )
    for k, what in ((0, "source"), (1, "destination")):
        seen = [p[k] for p in pairs]
        if len(set(seen)) != len(seen):
            raise ValueError(
                f"ppermute: a {what} index appears twice in perm {pairs}; each device sends "
                "to at most one device and receives from at most one."
            )
    return jax.lax.ppermute(tree, name, pairs)


def broadcast(tree: Any, axis: str, source: int = 0) -> Any:
    """Every device along `axis` gets the value of device `source` (for every leaf).

    Written as ``psum(where(axis_index == source, x, 0))``: exact for numbers (the other
    terms are zeros), one all-reduce per leaf; bool leaves are broadcast as ints.

    >>> import jax, jax.numpy as jnp
    >>> from blox import parallel as bp
    >>> jax.vmap(lambda x: bp.broadcast(x, 'i', source=2), axis_name='i')(jnp.arange(3.0))
    Array([2., 2., 2.], dtype=float32)
    """
    (name,) = check_axis(axis, "broadcast")
    _leaves(tree, "broadcast")
    size = jax.lax.axis_size(name)
    if not isinstance(source, int) or not 0 <= source < size:
        raise ValueError(
            f"broadcast: source {source!r} is not an index in [0, {size}) of axis {axis!r}."
        )
    here = jax.lax.axis_index(name) == source

    def one(x):
        if x.dtype == jnp.bool_:
            y = jnp.where(here, x.astype(jnp.int32), jnp.zeros((), jnp.int32))
            return jax.lax.psum(y, name).astype(jnp.bool_)
        return jax.lax.psum(jnp.where(here, x, jnp.zeros((), x.dtype)), name)

    return jax.tree.map(one, tree)
