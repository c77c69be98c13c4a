"""`pipeline`: a Grain dataset of batches from a random-access source."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import grain
import numpy as np
from absl import flags

from blox.data._tbptt import ChunkSplit, tbptt_chunks

__all__ = ["pipeline"]

logger = logging.getLogger("blox.data")

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


def _probe(source: Any, chunk: int | None) -> None:
    """Reads item 0 here, at build time, so that a source that cannot be read, or one
    that gives a TBPTT pipeline an ``'is_first'`` array, fails now and in this process
    (not at the first read, possibly in a worker process mid-epoch)."""
    try:
        if getattr(source, "get_batch", None) is not None:
            first = source.get_batch(np.zeros((1,), np.int64))
        else:
            first = source[0]
    except (ValueError, TypeError, OSError, KeyError, IndexError) as e:
        kind = next(
            t for t in (OSError, TypeError, KeyError, IndexError, ValueError) if isinstance(e, t)
        )
        raise kind(f"pipeline: reading item 0 of {source!r} failed at build time: {e}") from e
    if not isinstance(first, Mapping):
        raise TypeError(
            f"pipeline: {source!r} gives items of type {type(first).__name__}; items must be "
            "dicts of arrays such as {'u': [L, C], 'y': [L, C]}."
        )
    if chunk is not None and IS_FIRST in first:
        raise ValueError(
            f"pipeline: {source!r} has an array or signal named {IS_FIRST!r}, which TBPTT "
            f"order (tbptt_chunk={chunk}) adds to every batch; rename it (e.g. "
            f"ArraySource({{'first': ...}}) or signals={{'first': ...}})."
        )


def _allow_grain_flag_reads() -> None:
    # Grain 0.2.18 reads the absl flag --grain_enable_multiprocess_worker_profiling when it
    # starts worker processes and jaxlib has profiler hooks (jaxlib >= 0.10); outside
    # `absl.app.run` the flags are unparsed and that read raises UnparsedFlagAccessError.
    # Marking them parsed keeps every flag at its default (an `absl.app` program that
    # parses its own command line is unaffected).
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def _epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of epoch `epoch`: `seed` itself for epoch 0, then one drawn from
    ``np.random.SeedSequence([seed, epoch])`` (no overlap between neighbouring seeds)."""
    if epoch == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), int(epoch)]).generate_state(1)[0])


class _EpochShuffle:
    """Global index -> item id: epoch ``e`` permuted by Grain's index shuffle with
    `_epoch_seed` (seed, e) (picklable; used through ``MapDataset.map_with_index``)."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed = n, int(seed)
        self._last = (0, _epoch_seed(self.seed, 0))

    def __call__(self, index: int, _item: int) -> int:
        epoch, i = divmod(int(index), self.n)
        last_epoch, s = self._last
        if epoch != last_epoch:
            s = _epoch_seed(self.seed, epoch)
            self._last = (epoch, s)
        return int(grain.experimental.index_shuffle(i, max_index=self.n - 1, seed=s, rounds=4))


class _ClosingIterator(grain.DatasetIterator):
    """A worker pipeline's iterator that lets go of Grain's iterator on ``close()``.

    Grain's iterators close again in ``__del__``; one still referenced at interpreter
    exit (e.g. ``it`` at a script's top level) does so after the modules are torn down
    and prints "Exception ignored in ... __del__". Releasing it on ``close()`` lets it
    be collected while the modules still exist. Batches are plain NumPy arrays (copied
    out of Grain's shared memory, whose blocks print the same noise when still held at
    exit).
    """

    def __init__(self, inner: grain.DatasetIterator, num_workers: int):
        super().__init__()
        self._inner = inner
        self._num_workers = num_workers

    def __next__(self) -> Any:
        if self._inner is None:
            raise ValueError("pipeline: this iterator was closed; make a new one with iter(ds).")
        batch = next(self._inner)
        # Arrays from workers arrive in shared memory (Grain's SharedMemoryArray), whose
        # __del__ fails at interpreter exit when the program still holds them: a copy
        # into a plain array (one memcpy in this process) frees the block right away.
        return {
            k: np.array(v) if isinstance(v, np.ndarray) and type(v) is not np.ndarray else v
            for k, v in batch.items()
        }

    def get_state(self) -> dict[str, Any]:
        if self._inner is None:
            raise ValueError("pipeline: this iterator was closed; make a new one with iter(ds).")
        return self._inner.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        if self._inner is None:
            raise ValueError("pipeline: this iterator was closed; make a new one with iter(ds).")
        self._inner.set_state(state)

    # Grain's index hooks (``grain.experimental.set_next_index``/``get_next_index``), which
    # `blox.ckpt`'s ``data_from_step`` uses to reposition a resumed iterator.
    def _set_next_index(self, index: int) -> None:
        if self._inner is None:
            raise ValueError("pipeline: this iterator was closed; make a new one with iter(ds).")
        try:
            self._inner._set_next_index(index)
        except NotImplementedError as e:  # Grain interleaves several workers' streams
            raise ValueError(
                f"pipeline: an iterator over num_workers={self._num_workers} worker processes "
                f"cannot be repositioned to batch {index} (Grain supports set_next_index in "
                "process or with one worker). Build the resumed pipeline with num_workers=0 "
                "or 1, or restore its saved state (get_state/set_state) instead."
            ) from e

    def _get_next_index(self) -> int:
        if self._inner is None:
            raise ValueError("pipeline: this iterator was closed; make a new one with iter(ds).")
        return self._inner._get_next_index()

    def close(self) -> None:
        inner, self._inner = getattr(self, "_inner", None), None
        if inner is not None:
            inner.close()


class _ClosingIterDataset(grain.IterDataset):
    """`pipeline`'s dataset when it has worker processes: iterators are `_ClosingIterator`."""

    def __init__(self, parent: grain.IterDataset, num_workers: int):
        super().__init__(parent)
        self._num_workers = num_workers

    def __iter__(self) -> _ClosingIterator:
        return _ClosingIterator(self._parent.__iter__(), self._num_workers)

    def __str__(self) -> str:
        return "ClosingIterDataset"


def _shard_rows(ids: Any, index: int, count: int) -> np.ndarray:
    """Shard `index` of `count` of an id batch: its `index`-th of `count` equal, contiguous
    parts (a full batch or a partial one that the pipeline checked splits evenly)."""
    ids = np.asarray(ids)
    part = len(ids) // count
    return ids[index * part : (index + 1) * part]


class _ReadRows:
    """Index batch -> this shard's rows, read from the source (picklable)."""

    def __init__(self, source: Any, index: int, count: int):
        self.source, self.index, self.count = source, index, count

    def __call__(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        return _stack(self.source, _shard_rows(ids, self.index, self.count), None, None)


class _ReadChunk:
    """``(ids, k)`` -> chunk k of this shard's rows, with the first-chunk flags."""

    def __init__(self, source: Any, index: int, count: int, chunk: int):
        self.source, self.index, self.count, self.chunk = source, index, count, chunk

    def __call__(self, element: tuple[np.ndarray, int]) -> dict[str, np.ndarray]:
        ids, k = element
        ids = _shard_rows(ids, self.index, self.count)
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

    **Epochs**: epoch 0 is shuffled by Grain's index shuffle with `seed` (the order of
    ``grain.MapDataset.range(n).shuffle(seed)``), epoch ``e >= 1`` with the seed drawn
    from ``np.random.SeedSequence([seed, e])``, so no epoch of one seed repeats an epoch
    of a neighbouring seed (``seed + e`` would make seed 0's second epoch seed 1's first).

    **Checked at build time**: item 0 is read once here, so a source that cannot be
    read fails now, in this process, not in a worker process mid-epoch.

    **Partial batches**: with ``len(source) % batch_size = p != 0`` and
    ``drop_remainder=False``, every epoch ends with a batch of ``p`` items, endless
    pipelines (``num_epochs=None``) included: a jitted step compiles once more for that
    shape, once in all (``jax.jit`` caches it), not once per epoch. The build logs it
    once (logger ``'blox.data'``, level INFO). With ``shard_count > 1`` the partial batch
    is split like a full one, ``p // shard_count`` rows per shard, so it is refused only
    when ``shard_count`` does not divide ``p`` (the shards would get unequal parts,
    which ``blox.distributed.global_batch`` refuses): pass ``drop_remainder=True`` there,
    or a ``batch_size`` whose remainder the shards split evenly.

    **Sharding across processes**: ``batch_size`` is the *global* batch; process
    ``shard_index`` of ``shard_count`` reads rows ``[shard_index * b, (shard_index + 1)
    * b)`` of every global batch (``b = batch_size // shard_count``), so the processes
    together see exactly the batches of a single process, and
    ``jax.make_array_from_process_local_data`` assembles them. Pass
    ``shard_index=jax.process_index(), shard_count=jax.process_count()`` (nothing is
    read from JAX implicitly). A final partial batch must split evenly over the shards
    (see above).

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
      drop_remainder: drop a final partial batch (of each epoch); needed when there is
        one and ``shard_count`` does not divide its size.
      tbptt_chunk: chunk length for TBPTT order, or ``None``.
      shard_index: this process's shard.
      shard_count: number of shards (processes); must divide ``batch_size``.
      num_workers: Grain worker processes (0: read in this process).
      read_threads: threads reading batches in each process (0: read on demand).
      prefetch: batches buffered per process (and per worker), >= ``read_threads``.

    Returns:
      A ``grain.IterDataset`` of dicts ``{name: [B_local, ...]}`` (plus ``'is_first'``
      ``[B_local]`` in TBPTT order), ``B_local = batch_size // shard_count`` (``p //
      shard_count`` for a final partial batch of ``p``).

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
    _check_layout(batch_size, shard_index, shard_count, read_threads, prefetch)
    if shuffle:
        _check_seed(seed)
    n = _source_length(source)
    _check_partial_batch(n, batch_size, shard_count, drop_remainder)
    chunk = num_chunks = None
    if tbptt_chunk is not None:
        num_chunks = tbptt_chunks(source, tbptt_chunk)
        chunk = int(tbptt_chunk)
    _probe(source, chunk)

    ids = _id_batches(n, batch_size, seed if shuffle else None, drop_remainder)
    if chunk is None:
        ds = ids.map(_ReadRows(source, shard_index, shard_count))
    else:
        chunks = grain.experimental.FlatMapMapDataset(ids, ChunkSplit(num_chunks))
        ds = chunks.map(_ReadChunk(source, shard_index, shard_count, chunk))
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    return _iter_dataset(ds, read_threads, prefetch, num_workers)


def _check_layout(
    batch_size: int, shard_index: int, shard_count: int, read_threads: int, prefetch: int
) -> None:
    """The shard is one of `shard_count`, which split the global batch evenly, and the
    buffer keeps every read thread busy."""
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


def _check_seed(seed: Any) -> None:
    """A shuffled pipeline has a seed, an int in ``[0, 2**32)``."""
    if seed is None:
        raise ValueError(
            "pipeline: shuffle=True needs a seed (shuffling is deterministic; nothing is "
            "drawn from global state). Pass e.g. seed=0."
        )
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not (0 <= seed < 2**32):
        raise ValueError(f"pipeline: seed must be an int in [0, 2**32), got {seed!r}.")


def _source_length(source: Any) -> int:
    """The number of items of a random-access source (``len`` and ``[]``), not zero."""
    if not hasattr(source, "__len__") or not hasattr(source, "__getitem__"):
        raise TypeError(
            f"pipeline: source must support len() and [] (Grain's RandomAccessDataSource), "
            f"got {type(source).__name__}. Wrap arrays in ArraySource({{'x': x, 'y': y}})."
        )
    n = len(source)
    if n == 0:
        raise ValueError(f"pipeline: the source {source!r} is empty.")
    return n


def _check_partial_batch(n: int, batch_size: int, shard_count: int, drop_remainder: bool) -> None:
    """A final partial batch (kept) must split evenly over the shards; it is logged once."""
    partial = 0 if drop_remainder else n % batch_size
    if partial % shard_count:
        raise ValueError(
            f"pipeline: {n} items leave a final partial batch of {partial} (batch_size="
            f"{batch_size}) each epoch, which shard_count={shard_count} shards would get as "
            f"unequal parts ({partial} rows do not split into {shard_count} equal parts), "
            "and blox.distributed.global_batch refuses unequal parts. Pass "
            "drop_remainder=True (shuffled epochs drop different items), or a global "
            f"batch_size whose remainder of {n} items is a multiple of {shard_count}."
        )
    if partial:
        logger.info(
            "pipeline: %d items in batches of %d leave a partial batch of %d at the end of "
            "every epoch%s. A jitted step compiles once more for that shape (once in all, "
            "not once per epoch); a step that splits its batch over devices needs their "
            "number to divide %d. Pass drop_remainder=True to drop it.",
            n,
            batch_size,
            partial,
            f" ({partial // shard_count} rows per shard)" if shard_count > 1 else "",
            partial,
        )


def _id_batches(
    n: int, batch_size: int, seed: int | None, drop_remainder: bool
) -> grain.MapDataset:
    """Global batches of item ids, shuffled anew each epoch when `seed` is given."""
    ids = grain.MapDataset.range(n)
    if seed is not None:
        ids = ids.map_with_index(_EpochShuffle(n, int(seed)))
    ids = ids.batch(batch_size, drop_remainder=drop_remainder)
    if len(ids) == 0:
        raise ValueError(
            f"pipeline: {n} items make no full batch of {batch_size} and drop_remainder=True. "
            "Use a smaller batch_size or drop_remainder=False."
        )
    return ids


def _iter_dataset(
    ds: grain.MapDataset, read_threads: int, prefetch: int, num_workers: int
) -> grain.IterDataset:
    """`ds` read by `read_threads` threads into a buffer of `prefetch` batches, in
    `num_workers` worker processes when there are any."""
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
        it_ds = _ClosingIterDataset(it_ds, num_workers)
    return it_ds
