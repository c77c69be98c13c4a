"""Per-process data: which rows of the global batch each process loads, checks that the
processes' rows are disjoint and cover the batch, and the global ``jax.Array`` assembled
from the per-process pieces."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Sharding

__all__ = ["ProcessShard", "check_shards", "global_batch", "process_shard", "process_shards"]


class ProcessShard(NamedTuple):
    """The rows ``[start, stop)`` of the global batch one process loads.

    ``index`` and ``count`` number the *distinct* row blocks (processes that hold the
    same rows, e.g. along a model axis that spans processes, share an index): pass them
    as ``shard_index=``, ``shard_count=`` to `blox.data.pipeline`.
    """

    index: int
    count: int
    start: int
    stop: int

    @property
    def slice(self) -> slice:
        """``slice(start, stop)``, for ``array[shard.slice]``."""
        return slice(self.start, self.stop)

    @property
    def size(self) -> int:
        """``stop - start``: this process's rows."""
        return self.stop - self.start


def check_shards(rows: Sequence[tuple[int, int] | slice], global_batch_size: int) -> None:
    """Checks that the row ranges the processes load, one ``(start, stop)`` or slice per
    process, tile the global batch: inside ``[0, global_batch_size)``, pairwise disjoint
    or identical (replicas), and together covering every row.

    Raises:
      ValueError: naming the processes whose rows overlap, the rows no process loads, or a
        range outside the batch.

    >>> from blox import distributed as bd
    >>> bd.check_shards([(0, 4), (4, 8)], 8)
    >>> bd.check_shards([(0, 5), (4, 8)], 8)
    Traceback (most recent call last):
    ...
    ValueError: check_shards: processes 0 and 1 both load rows [4, 5) ...
    """
    ranges = []
    for p, r in enumerate(rows):
        if isinstance(r, slice):
            if r.step not in (None, 1):
                raise ValueError(f"check_shards: process {p} has slice {r} with a step; use 1.")
            r = (r.start or 0, global_batch_size if r.stop is None else r.stop)
        start, stop = int(r[0]), int(r[1])
        if not 0 <= start < stop <= global_batch_size:
            raise ValueError(
                f"check_shards: process {p} loads rows [{start}, {stop}), not a non-empty "
                f"range inside the global batch [0, {global_batch_size})."
            )
        ranges.append((start, stop))
    for a in range(len(ranges)):
        for b in range(a + 1, len(ranges)):
            (s0, e0), (s1, e1) = ranges[a], ranges[b]
            if ranges[a] != ranges[b] and max(s0, s1) < min(e0, e1):
                raise ValueError(
                    f"check_shards: processes {a} and {b} both load rows "
                    f"[{max(s0, s1)}, {min(e0, e1)}) (process {a}: [{s0}, {e0}), process {b}: "
                    f"[{s1}, {e1})); each row of the global batch of {global_batch_size} "
                    "must be loaded by one block of processes. Load "
                    "bd.process_shard(...).slice on every process."
                )
    covered = np.zeros(global_batch_size, bool)
    for start, stop in ranges:
        covered[start:stop] = True
    if not covered.all():
        gaps = np.flatnonzero(~covered)
        first = int(gaps[0])
        last = first
        while last + 1 < global_batch_size and not covered[last + 1]:
            last += 1
        raise ValueError(
            f"check_shards: rows [{first}, {last + 1}) of the global batch of "
            f"{global_batch_size} are loaded by no process ({len(gaps)} rows missing in all; "
            f"ranges: {ranges}). Load bd.process_shard(...).slice on every process."
        )


def _rows_by_process(sharding: Sharding, global_batch_size: int) -> dict[int, list[tuple]]:
    rows: dict[int, set[tuple[int, int]]] = {}
    for device, index in sharding.devices_indices_map((global_batch_size,)).items():
        start, stop, _ = index[0].indices(global_batch_size)
        rows.setdefault(device.process_index, set()).add((start, stop))
    return {p: sorted(r) for p, r in rows.items()}


def _merge(blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[list[int]] = []
    for start, stop in blocks:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    return [(a, b) for a, b in merged]


def _check_size(global_batch_size: Any) -> int:
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int | np.integer):
        raise TypeError(
            f"global_batch_size must be an int, got {type(global_batch_size).__name__}."
        )
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size} must be positive.")
    return int(global_batch_size)


def process_shards(
    global_batch_size: int,
    sharding: Sharding | None = None,
    *,
    num_processes: int | None = None,
) -> tuple[ProcessShard, ...]:
    """The rows each process loads, one `ProcessShard` per process (checked with
    `check_shards`).

    With a `sharding` (the batch's, e.g. ``NamedSharding(mesh, P('data'))``), a process
    loads exactly the rows its devices hold, so the split follows the mesh; processes
    whose devices hold the same rows (a replicated or model axis across processes) load
    the same rows. Without one, the batch is cut into `num_processes` (default
    ``jax.process_count()``) equal blocks in process order, as `blox.data.pipeline`'s
    ``shard_index``/``shard_count`` do.

    Args:
      global_batch_size: rows of the global batch (its leading dimension).
      sharding: the global batch's sharding; only its leading dimension matters.
      num_processes: the process count when no sharding is given.

    Returns:
      ``shards[p]`` for process ``p``.

    Raises:
      ValueError: a batch that does not split evenly, or a sharding that gives one
        process rows that are not one contiguous block (order the mesh's data axis by
        process, as ``jax.make_mesh`` does on CPU).

    >>> from blox import distributed as bd
    >>> [s.slice for s in bd.process_shards(8, num_processes=2)]
    [slice(0, 4, None), slice(4, 8, None)]
    """
    size = _check_size(global_batch_size)
    if sharding is None:
        n = jax.process_count() if num_processes is None else int(num_processes)
        if n < 1 or size % n:
            raise ValueError(
                f"process_shards: the global batch of {size} rows does not split into {n} "
                f"equal process shards; use a global batch size divisible by {n}."
            )
        b = size // n
        return tuple(ProcessShard(p, n, p * b, (p + 1) * b) for p in range(n))
    if not isinstance(sharding, Sharding):
        raise TypeError(
            f"process_shards: sharding must be a jax.sharding.Sharding (e.g. "
            f"NamedSharding(mesh, P('data'))), got {type(sharding).__name__}."
        )
    try:
        by_process = _rows_by_process(sharding, size)
    except ValueError as e:
        raise ValueError(
            f"process_shards: a global batch of {size} rows does not fit the sharding "
            f"{sharding}: {e}. Use a batch size divisible by the data axis."
        ) from None
    blocks = {}
    for p, rows in sorted(by_process.items()):
        merged = _merge(rows)
        if len(merged) != 1:
            raise ValueError(
                f"process_shards: the devices of process {p} hold rows {merged} of the "
                f"global batch of {size}, not one contiguous block, so the process cannot "
                "load one slice. Order the devices of the mesh's batch axis by process "
                "(e.g. jax.make_mesh, or np.array(jax.devices()) reshaped)."
            )
        blocks[p] = merged[0]
    distinct = sorted(set(blocks.values()))
    check_shards([blocks[p] for p in sorted(blocks)], size)
    return tuple(
        ProcessShard(distinct.index(blocks[p]), len(distinct), *blocks[p]) for p in sorted(blocks)
    )


def process_shard(
    global_batch_size: int,
    sharding: Sharding | None = None,
    *,
    process_id: int | None = None,
    num_processes: int | None = None,
) -> ProcessShard:
    """The rows of the global batch that this process (or `process_id`) loads: its entry
    of `process_shards`.

    Each process reads only ``shard.size`` rows, e.g. ``x[shard.slice]`` of a memory map
    or ``pipeline(..., shard_index=shard.index, shard_count=shard.count)``, and
    `global_batch` assembles the global array.

    >>> from blox import distributed as bd
    >>> bd.process_shard(8, process_id=1, num_processes=2).slice
    slice(4, 8, None)
    """
    shards = process_shards(global_batch_size, sharding, num_processes=num_processes)
    p = jax.process_index() if process_id is None else int(process_id)
    if not 0 <= p < len(shards):
        raise ValueError(
            f"process_shard: process_id={p} is outside 0..{len(shards) - 1} "
            f"({len(shards)} processes)."
        )
    return shards[p]


def global_batch(
    local_batch: Any,
    sharding: Sharding | Any,
    global_batch_size: int,
    *,
    rows: slice | tuple[int, int] | None = None,
) -> Any:
    """The global ``jax.Array`` batch assembled from each process's rows
    (``jax.make_array_from_process_local_data`` per leaf, every process calling it).

    Every leaf of `local_batch` holds this process's rows along its leading dimension:
    ``process_shard(global_batch_size, sharding).size`` of them. In a single process this
    is the whole batch, placed with `sharding`.

    Args:
      local_batch: a pytree of arrays ``(b, ...)``: this process's rows.
      sharding: the global batch's sharding, one for all leaves or a pytree of them
        matching `local_batch`.
      global_batch_size: ``B``, the leading dimension of the global arrays.
      rows: the rows ``[start, stop)`` this process loaded, if its loader chose them:
        checked against the rows the sharding puts on this process's devices.

    Returns:
      The pytree of global arrays ``(B, ...)``, sharded with `sharding`.

    Raises:
      ValueError: a leaf with the wrong number of rows (naming the leaf path, the rows
        expected and the fix), or `rows` that differ from the sharding's rows.

    >>> import jax, numpy as np
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from blox import distributed as bd
    >>> mesh = jax.make_mesh((jax.device_count(),), ('data',))
    >>> sharding = NamedSharding(mesh, P('data'))
    >>> shard = bd.process_shard(16, sharding)
    >>> x = np.arange(16.0)[shard.slice]        # this process reads only its rows
    >>> bd.global_batch({'x': x}, sharding, 16)['x'].shape
    (16,)
    """
    size = _check_size(global_batch_size)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(local_batch)
    if isinstance(sharding, Sharding):
        shardings = [sharding] * len(leaves)
    else:
        shardings = treedef.flatten_up_to(sharding)
    out = []
    for (path, leaf), sh in zip(leaves, shardings, strict=True):
        where = jax.tree_util.keystr(path) or "the batch"
        shard = process_shard(size, sh)
        if rows is not None:
            start, stop = (rows.start or 0, rows.stop) if isinstance(rows, slice) else rows
            if (start, stop) != (shard.start, shard.stop):
                raise ValueError(
                    f"global_batch: process {jax.process_index()} loaded rows [{start}, "
                    f"{stop}) but the sharding puts rows [{shard.start}, {shard.stop}) of the "
                    f"global batch of {size} on its devices; load "
                    "bd.process_shard(global_batch_size, sharding).slice instead."
                )
        leaf = np.asarray(leaf) if not isinstance(leaf, jax.Array) else leaf
        if leaf.ndim == 0 or leaf.shape[0] != shard.size:
            got = "a scalar" if leaf.ndim == 0 else f"{leaf.shape[0]} rows (shape {leaf.shape})"
            raise ValueError(
                f"global_batch: {where} holds {got} on process {jax.process_index()}, but "
                f"its share of the global batch of {size} is rows [{shard.start}, "
                f"{shard.stop}) ({shard.size} rows). Load x[bd.process_shard({size}, "
                "sharding).slice] on each process."
            )
        out.append(jax.make_array_from_process_local_data(sh, leaf, (size, *leaf.shape[1:])))
    return jax.tree_util.tree_unflatten(treedef, out)
