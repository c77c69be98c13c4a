"""`pipeline`: a Grain dataset of batches from a random-access source."""

from __future__ import annotations

from typing import Any

import grain
import numpy as np
from absl import flags

from blox.data._tbptt import ChunkSplit, tbptt_chunks

__all__ = ["pipeline"]

IS_FIRST = "is_first"


def _check_int(name: str, value: Any, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
        raise ValueError(f"pipeline: {name} must be an int >= {low}, got {value!r}.")
    return int(value)


def _stack(source: Any, ids: np.ndarray, start: int | None, stop: int | None) -> dict:
    get_batch = getattr(source, "get_batch", None)
    if get_batch is not None:
        if start is None:
            return get_batch(ids)
        return get_batch(ids, start=start, stop=stop)
    items = [source[int(i)] for i in ids]
    if start is not None:
        items = [{k: v[start:stop] for k, v in item.items()} for item in items]
    if not items:
        raise ValueError(
            f"pipeline: this shard's part of a final partial batch is empty and {source!r} "
            "has no get_batch to build an empty one. Use drop_remainder=True."
        )
    return {k: np.stack([item[k] for item in items]) for k in items[0]}


def _allow_grain_flag_reads() -> None:
    # Grain 0.2.18 reads the absl flag --grain_enable_multiprocess_worker_profiling when it
    # starts worker processes and jaxlib has profiler hooks (jaxlib >= 0.10); outside
    # `absl.app.run` the flags are unparsed and that read raises UnparsedFlagAccessError.
    # Marking them parsed keeps every flag at its default (an `absl.app` program that
    # parses its own command line is unaffected).
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


class _ReadRows:
    """Index batch -> this shard's rows, read from the source (picklable)."""

    def __init__(self, source: Any, lo: int, hi: int):
        self.source, self.lo, self.hi = source, lo, hi

    def __call__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return _stack(self.source, np.asarray(ids)[self.lo : self.hi], None, None)


class _ReadChunk:
    """``(ids, k)`` -> chunk k of this shard's rows, with the first-chunk flags."""

    def __init__(self, source: Any, lo: int, hi: int, chunk: int):
        self.source, self.lo, self.hi, self.chunk = source, lo, hi, chunk

    def __call__(self, element: tuple[np.ndarray, int]) -> dict[str, np.ndarray]:
        ids, k = element
        ids = np.asarray(ids)[self.lo : self.hi]
        out = _stack(self.source, ids, k * self.chunk, (k + 1) * self.chunk)
        out[IS_FIRST] = np.full((len(ids),), k == 0)
        return out


def pipeline(
    source: Any,
    *,
    batch_size: int,
    shuffle: bool = False,
    seed: int | None = None,
    num_epochs: int | None = 1,
    drop_remainder: bool = False,
    tbptt_chunk: int | None = None,
    shard_index: int = 0,
    shard_count: int = 1,
    num_workers: int = 0,
    read_threads: int = 2,
    prefetch: int = 4,
) -> grain.IterDataset:
    """A Grain dataset of batches ``{name: [B, ...]}`` from a random-access source.

    Built from Grain's own pieces, index first so that only the rows a process needs
    are ever read::

        grain.MapDataset.range(len(source))
            .shuffle(seed)                         # if shuffle: Grain's index shuffle
            .batch(batch_size, drop_remainder)     # global batches of item ids
            [TBPTT: each id batch -> its chunks]   # grain.experimental.FlatMapMapDataset
            .map(read this shard's rows)           # source.get_batch(ids)
            .repeat(num_epochs)                    # each epoch shuffled anew
            .to_iter_dataset(grain.ReadOptions(read_threads, prefetch))
            .mp_prefetch(num_workers)              # if num_workers > 0

    Iterate with ``it = iter(ds)``; ``it.get_state()`` is a small JSON-able dict and
    ``it.set_state(state)`` on a fresh iterator of the same pipeline resumes exactly
    (with workers too). The batches do not depend on ``num_workers``, ``read_threads``
    or ``prefetch``. Close iterators of pipelines with workers (``it.close()``).

    **Sharding across processes**: ``batch_size`` is the *global* batch; process
    ``shard_index`` of ``shard_count`` reads rows ``[shard_index * b, (shard_index + 1)
    * b)`` of every global batch (``b = batch_size // shard_count``), so the processes
    together see exactly the batches of a single process, and
    ``jax.make_array_from_process_local_data`` assembles them. Pass
    ``shard_index=jax.process_index(), shard_count=jax.process_count()`` (nothing is
    read from JAX implicitly). A final partial batch (``drop_remainder=False``) gives
    shards fewer rows, possibly none.

    **TBPTT order** (``tbptt_chunk=c``): every item (window of length L) is cut into
    ``K = L // c`` consecutive chunks; a group of ``batch_size`` items gives K batches in
    a row, and row i of batch ``b + 1`` continues row i of batch ``b``. Each batch
    carries ``'is_first'`` ``[B]`` bool, True on the rows whose chunk starts an item:
    reset a carried recurrent state there (e.g. ``is_reset = jnp.zeros((B, c),
    bool).at[:, 0].set(batch['is_first'])``).

    Args:
      source: a random-access source (`WindowedSource`, `ArraySource`, or anything with
        ``len`` and ``[]`` returning dicts of arrays; ``get_batch(ids, start=, stop=)``
        is used when present).
      batch_size: the global batch size.
      shuffle: shuffle items (train) or keep their order (valid/test).
      seed: the shuffle seed (required with ``shuffle``), an int in ``[0, 2**32)``.
      num_epochs: passes over the data; ``None`` repeats forever (step-based
        training: take as many batches as steps).
      drop_remainder: drop a final partial batch (of each epoch).
      tbptt_chunk: chunk length for TBPTT order, or ``None``.
      shard_index: this process's shard.
      shard_count: number of shards (processes); must divide ``batch_size``.
      num_workers: Grain worker processes (0: read in this process).
      read_threads: threads reading batches in each process (0: read on demand).
      prefetch: batches buffered per process (and per worker), >= ``read_threads``.

    Returns:
      A ``grain.IterDataset`` of dicts ``{name: [B_local, ...]}`` (plus ``'is_first'``
      ``[B_local]`` in TBPTT order), ``B_local = batch_size // shard_count``.

    >>> import numpy as np
    >>> from blox.data import ArraySource, pipeline
    >>> src = ArraySource({'x': np.arange(10.0), 'y': np.arange(10) % 2})
    >>> ds = pipeline(src, batch_size=4, shuffle=True, seed=0, drop_remainder=True)
    >>> it = iter(ds)
    >>> first = next(it)
    >>> state = it.get_state()           # after one batch
    >>> second = next(it)
    >>> resumed = iter(ds); resumed.set_state(state)
    >>> bool((next(resumed)['x'] == second['x']).all())
    True
    """
    batch_size = _check_int("batch_size", batch_size, 1)
    shard_count = _check_int("shard_count", shard_count, 1)
    shard_index = _check_int("shard_index", shard_index, 0)
    num_workers = _check_int("num_workers", num_workers, 0)
    read_threads = _check_int("read_threads", read_threads, 0)
    prefetch = _check_int("prefetch", prefetch, 0)
    if num_epochs is not None:
        num_epochs = _check_int("num_epochs", num_epochs, 1)
    if shard_index >= shard_count:
        raise ValueError(
            f"pipeline: shard_index={shard_index} must be < shard_count={shard_count} (shards "
            "are numbered from 0, e.g. shard_index=jax.process_index())."
        )
    if batch_size % shard_count:
        raise ValueError(
            f"pipeline: batch_size={batch_size} (the global batch) is not divisible by "
            f"shard_count={shard_count}. Use a multiple of {shard_count}, e.g. batch_size="
            f"{(batch_size // shard_count + 1) * shard_count}."
        )
    if read_threads and prefetch < read_threads:
        raise ValueError(
            f"pipeline: prefetch={prefetch} is smaller than read_threads={read_threads}, so "
            f"some threads would idle. Use prefetch >= {read_threads}."
        )
    if shuffle:
        if seed is None:
            raise ValueError(
                "pipeline: shuffle=True needs a seed (shuffling is deterministic; nothing is "
                "drawn from global state). Pass e.g. seed=0."
            )
        if (
            isinstance(seed, bool)
            or not isinstance(seed, int | np.integer)
            or not (0 <= seed < 2**32)
        ):
            raise ValueError(f"pipeline: seed must be an int in [0, 2**32), got {seed!r}.")
    if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
        raise TypeError(
            f"pipeline: source must support len() and [] (Grain's RandomAccessDataSource), "
            f"got {type(source).__name__}. Wrap arrays in ArraySource({{'x': x, 'y': y}})."
        )
    n = len(source)
    if n == 0:
        raise ValueError(f"pipeline: the source {source!r} is empty.")
    local = batch_size // shard_count
    lo, hi = shard_index * local, (shard_index + 1) * local

    ids = grain.MapDataset.range(n)
    if shuffle:
        ids = ids.shuffle(seed=int(seed))
    ids = ids.batch(batch_size, drop_remainder=drop_remainder)
    if len(ids) == 0:
        raise ValueError(
            f"pipeline: {n} items make no full batch of {batch_size} and drop_remainder=True. "
            "Use a smaller batch_size or drop_remainder=False."
        )
    if tbptt_chunk is None:
        ds = ids.map(_ReadRows(source, lo, hi))
    else:
        if tbptt_chunk is not None and IS_FIRST in getattr(source, "signals", {}):
            raise ValueError(f"pipeline: a signal is named {IS_FIRST!r}; rename it for TBPTT.")
        num_chunks = tbptt_chunks(source, tbptt_chunk)
        chunks = grain.experimental.FlatMapMapDataset(ids, ChunkSplit(num_chunks))
        ds = chunks.map(_ReadChunk(source, lo, hi, int(tbptt_chunk)))
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    it_ds = ds.to_iter_dataset(
        grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=prefetch)
    )
    if num_workers:
        _allow_grain_flag_reads()
        it_ds = it_ds.mp_prefetch(
            grain.MultiprocessingOptions(
                num_workers=num_workers, per_worker_buffer_size=max(prefetch, 1)
            )
        )
    return it_ds
