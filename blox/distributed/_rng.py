"""Random streams from one seed that do not depend on how the run is split into processes:
named streams, one key per global row (for host-side data work) and one key per mesh
position (for device work)."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = ["device_keys", "named_key", "row_keys"]


def named_key(seed: int | jax.Array, name: str) -> jax.Array:
    """The key of the stream `name` (``'data'``, ``'dropout'``, ``'init'``...) of `seed`:
    ``fold_in(key(seed), crc32(name) & 0x7FFFFFFF)``, the same in every process and every run (a
    stable hash, unlike Python's salted ``hash``).

    Args:
      seed: an int seed or a typed key (``jax.random.key``).
      name: the stream's name.

    Returns:
      A typed key, ``()``.

    >>> from blox import distributed as bd
    >>> bool((bd.named_key(0, 'data') == bd.named_key(0, 'data')).all())
    True
    """
    if not isinstance(name, str):
        raise TypeError(f"named_key: name must be a str, got {type(name).__name__}.")
    if isinstance(seed, jax.Array) and jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
        key = seed
    elif isinstance(seed, int | np.integer) and not isinstance(seed, bool):
        key = jax.random.key(int(seed))
    else:
        raise TypeError(
            f"named_key: seed must be an int or a typed key (jax.random.key(s)), got "
            f"{type(seed).__name__}."
        )
    return jax.random.fold_in(key, zlib.crc32(name.encode()) & 0x7FFFFFFF)


def row_keys(key: jax.Array, rows: slice | tuple[int, int] | Any) -> jax.Array:
    """One key per global row ``start..stop-1``: ``fold_in(key, row)``.

    A process draws the random numbers of its rows only (noise, augmentation, synthetic
    data), and they are the numbers a single process would draw for those rows: the
    global batch is the same whatever the split. Fold the step in first
    (``jax.random.fold_in(key, step)``) for a fresh batch per step.

    Args:
      key: a typed key, ``()``.
      rows: ``slice(start, stop)``, ``(start, stop)`` or a `ProcessShard`.

    Returns:
      Keys ``(stop - start,)``, built on this process's default device.

    >>> import jax
    >>> from blox import distributed as bd
    >>> k = bd.named_key(0, 'data')
    >>> all_rows = bd.row_keys(k, slice(0, 8))
    >>> second = bd.row_keys(k, bd.process_shard(8, process_id=1, num_processes=2))
    >>> bool((jax.random.key_data(all_rows[4:]) == jax.random.key_data(second)).all())
    True
    """
    if hasattr(rows, "start") and hasattr(rows, "stop") and not isinstance(rows, slice):
        rows = (rows.start, rows.stop)
    if isinstance(rows, slice):
        if rows.stop is None or rows.step not in (None, 1):
            raise ValueError(f"row_keys: rows={rows} needs a stop and no step.")
        rows = (rows.start or 0, rows.stop)
    start, stop = (int(r) for r in rows)
    if not 0 <= start <= stop:
        raise ValueError(f"row_keys: rows [{start}, {stop}) is not a range of row indices.")
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(start, stop, dtype=jnp.uint32))


def device_keys(key: jax.Array, mesh: Mesh, axes: str | Sequence[str]) -> jax.Array:
    """One key per position along the mesh `axes`, as a global array sharded over them:
    the key at position ``(i, j, ...)`` is ``fold_in(fold_in(key, i), j)...``.

    Inside ``jax.shard_map(..., in_specs=P(*axes))`` each device sees its own key
    (shape ``(1,) * len(axes)``) and devices that differ only along other axes (a model
    axis) share it. The keys depend on mesh positions, not on processes, so 2 processes
    x 4 devices and 1 process x 8 devices draw the same numbers. Each process builds
    only the keys of its own devices (``jax.make_array_from_callback``).

    Args:
      key: a typed key, ``()``.
      mesh: the device mesh.
      axes: an axis name or several.

    Returns:
      Keys of shape ``tuple(mesh.shape[a] for a in axes)``, sharded ``P(*axes)``.

    Raises:
      ValueError: an axis the mesh lacks (the message lists its axes).

    >>> import jax
    >>> from jax.sharding import PartitionSpec as P
    >>> from blox import distributed as bd
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> keys = bd.device_keys(bd.named_key(0, 'dropout'), mesh, 'data')
    >>> keys.shape == (jax.device_count(),)
    True
    """
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for a in names:
        if a not in mesh.shape:
            raise ValueError(
                f"device_keys: axis {a!r} is not in the mesh, whose axes are "
                f"{tuple(mesh.axis_names)}; pass one of them."
            )
    shape = tuple(mesh.shape[a] for a in names)
    sharding = NamedSharding(mesh, PartitionSpec(*names))
    data = jax.random.key_data(key)

    def one(index: tuple[slice, ...]) -> np.ndarray:
        ranges = [range(*s.indices(n)) for s, n in zip(index[: len(shape)], shape, strict=True)]
        out = np.empty((*[len(r) for r in ranges], *data.shape), data.dtype)
        for pos in np.ndindex(*out.shape[: len(names)]):
            k = key
            for r, p in zip(ranges, pos, strict=True):
                k = jax.random.fold_in(k, r[p])
            out[pos] = np.asarray(jax.random.key_data(k))
        return out

    impl = jax.random.key_impl(key)
    raw = jax.make_array_from_callback((*shape, *data.shape), _raw(sharding, data.ndim), one)
    return jax.random.wrap_key_data(raw, impl=impl)


def _raw(sharding: NamedSharding, extra: int) -> NamedSharding:
    """The sharding of the raw key data: the key's own dimensions unsharded."""
    spec = PartitionSpec(*sharding.spec, *([None] * extra))
    return NamedSharding(sharding.mesh, spec)
