"""`WindowedSource`: fixed-length windows over HDF5 recordings, computed on the fly."""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, SupportsIndex

import numpy as np

from blox.data._hdf5 import HDF5Index

__all__ = ["WindowedSource"]

Signals = Mapping[str, str | Sequence[str]] | Sequence[str]


def _signal_map(signals: Signals) -> dict[str, tuple[str, ...]]:
    if isinstance(signals, str):
        raise TypeError(
            f"WindowedSource: signals must map names to datasets, got the string "
            f"{signals!r}. Write e.g. signals={{'u': ['u0', 'u1'], 'y': 'y'}} or "
            f"signals=[{signals!r}]."
        )
    if not isinstance(signals, Mapping):
        signals = {name: name for name in signals}
    out = {}
    for key, names in signals.items():
        names = (names,) if isinstance(names, str) else tuple(names)
        if not names:
            raise ValueError(f"WindowedSource: signal {key!r} lists no datasets.")
        out[str(key)] = names
    if not out:
        raise ValueError("WindowedSource: no signals given, e.g. signals={'u': 'u', 'y': 'y'}.")
    return out


class WindowedSource:
    """Windows of several signals over many HDF5 files: a Grain random-access source.

    Every file holds the same datasets; each signal (``'u'``, ``'y'``, any name) is made
    of one or more of them, each 1-D ``[T]`` (one channel) or 2-D ``[T, C]`` (C
    channels), concatenated along channels in the order given. File ``f`` of length
    ``T_f`` gives ``(T_f - window) // stride + 1`` windows; window ``i`` is found by
    bisecting the cumulative counts, so no per-window table is stored.

    ``source[i]`` is a dict of raw physical values ``{'u': [L, Cu], 'y': [L, Cy]}``
    (L = window); nothing is normalized. The source implements Grain's
    ``RandomAccessDataSource`` protocol (``len``, ``[]``), pickles (the index reopens its
    memory maps / h5py handles in each worker process), and gives `pipeline` a fast
    ``get_batch(ids)``.

    Legend: T file length, L window length, C channels of a signal.

    Args:
      files: HDF5 file paths.
      signals: ``{name: dataset or [datasets]}``, or a list of dataset names used as
        signal names.
      window: window length L; ``None`` makes each whole file one item (files of
        different lengths then cannot be batched together).
      stride: steps between the starts of consecutive windows of a file (>= 1).
      dtype: the dtype of the returned arrays (default float32); ``None`` keeps the
        files' dtype (the promotion of a signal's datasets). Complex datasets need a
        complex dtype (or ``None``): they are never cast to real.
      mmap_only: raise instead of reading chunked/compressed datasets through h5py.
      max_open_files: most memory maps and h5py handles open at once per process (see
        `HDF5Index`).
      cache_bytes: keep chunked/compressed datasets of at most this many bytes in
        memory after their first read, up to this many bytes per process (see
        `HDF5Index`; 0: no cache).

    A file changed after this source was built raises when a process opens it (see
    `HDF5Index`); `reindex` gives a source over the files as they are now.

    Every check runs here, at construction, so bad files fail before training starts
    rather than at the first read in a worker process. Raises ``ValueError`` naming the
    file and dataset for: a missing dataset, a dataset that does not hold numbers
    (strings, compound types), a complex dataset with a real `dtype`, a dataset of rank
    other than 1 or 2, datasets of one file with different lengths (``u`` and ``y`` must
    share the time axis), a window longer than a file, and (``mmap_only``) a dataset
    that cannot be memory-mapped; ``FileNotFoundError`` for a missing file.

    >>> import h5py, numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), 'run.h5')
    >>> with h5py.File(path, 'w') as f:
    ...     _ = f.create_dataset('u', data=np.arange(10.0))
    ...     _ = f.create_dataset('y', data=np.arange(20.0).reshape(10, 2))
    >>> src = WindowedSource([path], {'u': 'u', 'y': 'y'}, window=4, stride=3)
    >>> len(src), src.channels
    (3, {'u': 1, 'y': 2})
    >>> src[1]['u'][:, 0]
    array([3., 4., 5., 6.], dtype=float32)
    >>> src.location(2)
    (0, 6, 10)
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike],
        signals: Signals,
        *,
        window: int | None,
        stride: int = 1,
        dtype: Any = np.float32,
        mmap_only: bool = False,
        max_open_files: int = 32,
        cache_bytes: int = 0,
    ):
        self.signals = _signal_map(signals)
        self._dtype_arg = dtype
        names = list(dict.fromkeys(n for group in self.signals.values() for n in group))
        self.index = HDF5Index(
            files,
            names,
            mmap_only=mmap_only,
            max_open_files=max_open_files,
            cache_bytes=cache_bytes,
        )
        self.files = self.index.files
        if window is not None and (isinstance(window, bool) or int(window) != window or window < 1):
            raise ValueError(f"WindowedSource: window must be an int >= 1 or None, got {window!r}.")
        if isinstance(stride, bool) or int(stride) != stride or stride < 1:
            raise ValueError(f"WindowedSource: stride must be an int >= 1, got {stride!r}.")
        self.window = None if window is None else int(window)
        self.stride = int(stride)

        channels: dict[str, int] = {}
        dtypes: dict[str, np.dtype] = {}
        lengths = [self._file_length(f, channels, dtypes) for f in range(len(self.files))]
        self.lengths: tuple[int, ...] = tuple(lengths)
        self.channels: dict[str, int] = channels
        self.dtypes: dict[str, np.dtype] = {
            k: np.dtype(dtypes[k] if dtype is None else dtype) for k in self.signals
        }
        for key, out in self.dtypes.items():
            self._check_complex(key, out, "dtype")
        if self.window is None:
            counts = [1] * len(lengths)
        else:
            counts = [(t - self.window) // self.stride + 1 for t in lengths]
        self.counts: tuple[int, ...] = tuple(counts)
        self._ends: list[int] = np.cumsum(counts).tolist()

    def _file_length(self, f: int, channels: dict[str, int], dtypes: dict[str, np.dtype]) -> int:
        """The time steps of file `f`, after checking its datasets: rank 1 or 2, one
        length, at least `window`; each signal with the channels of the first file.
        Records each signal's channels in `channels` and promotes its dtype in `dtypes`."""
        file = self.files[f]
        sizes: dict[str, int] = {}
        for key, group in self.signals.items():
            n_ch, kinds = self._signal_layout(f, key, group, sizes)
            if channels.setdefault(key, n_ch) != n_ch:
                raise ValueError(
                    f"HDF5 file {file!r}: signal {key!r} has {n_ch} channels but "
                    f"{channels[key]} in {self.files[0]!r}; every file must give each "
                    "signal the same channels."
                )
            dtypes[key] = np.result_type(dtypes.get(key, kinds[0]), *kinds)
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"HDF5 file {file!r}: datasets have different lengths {sizes}; every "
                "dataset of a file must share the time axis (e.g. u and y sampled "
                "together). Trim them to a common length when writing the file, or "
                "list them in separate sources."
            )
        length = next(iter(sizes.values()))
        if self.window is not None and length < self.window:
            raise ValueError(
                f"HDF5 file {file!r} has {length} time steps (dataset "
                f"{next(iter(sizes))!r}), fewer than window={self.window}. Use a window "
                f"<= {length}, or leave this file out of the list."
            )
        return length

    def _signal_layout(
        self, f: int, key: str, group: tuple[str, ...], sizes: dict[str, int]
    ) -> tuple[int, list[np.dtype]]:
        """The channels of signal `key` in file `f` (its datasets' summed) and their
        dtypes; records each dataset's length in `sizes`."""
        n_ch, kinds = 0, []
        for name in group:
            info = self.index.info(f, name)
            if len(info.shape) not in (1, 2):
                raise ValueError(
                    f"HDF5 file {self.files[f]!r}, dataset {name!r} (signal {key!r}) has shape "
                    f"{info.shape}; expected [T] or [T, C] with time first. Reshape "
                    "it when writing the file, e.g. data.reshape(T, -1)."
                )
            sizes[name] = info.shape[0]
            n_ch += 1 if len(info.shape) == 1 else info.shape[1]
            kinds.append(info.dtype)
        return n_ch, kinds

    # -- Grain's RandomAccessDataSource protocol ----------------------------------

    def __len__(self) -> int:
        return self._ends[-1]

    def __getitem__(self, index: SupportsIndex) -> dict[str, np.ndarray]:
        f, start, stop = self.location(index)
        return self.read(f, start, stop)

    # -- windows --------------------------------------------------------------------

    def location(self, index: SupportsIndex) -> tuple[int, int, int]:
        """``(file number, start, stop)`` of window `index`: rows ``[start, stop)``."""
        i = int(index)
        n = self._ends[-1]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"WindowedSource: window {int(index)} out of range [0, {n}).")
        f = bisect.bisect_right(self._ends, i)
        local = i - (self._ends[f - 1] if f else 0)
        if self.window is None:
            return f, 0, self.lengths[f]
        start = local * self.stride
        return f, start, start + self.window

    def _check_complex(self, key: str, out: np.dtype, arg: str) -> None:
        if out.kind == "c":
            return
        if not hasattr(self, "_complex"):  # the first complex dataset of each signal
            self._complex = {
                k: next(
                    (
                        self.index.info(f, n)
                        for n in group
                        for f in range(len(self.files))
                        if self.index.info(f, n).dtype.kind == "c"
                    ),
                    None,
                )
                for k, group in self.signals.items()
            }
        info = self._complex[key]
        if info is not None:
            raise ValueError(
                f"HDF5 file {info.file!r}, dataset {info.name!r} (signal {key!r}) is "
                f"complex ({info.dtype}); {arg}={out} would drop its imaginary part. Pass "
                "dtype=None (keeps the file's complex dtype) or dtype=np.complex64, or "
                "store the real and imaginary parts as two datasets, e.g. "
                f"signals={{{key!r}: ['{info.name}_re', '{info.name}_im']}}."
            )

    def read(self, file: int, start: int, stop: int, *, dtype: Any = None) -> dict[str, np.ndarray]:
        """Rows ``[start, stop)`` of file number `file`: ``{signal: [stop - start, C]}``.

        `dtype` overrides the source's output dtype (e.g. float64 for statistics).
        """
        out = {}
        for key, group in self.signals.items():
            if dtype is not None:
                self._check_complex(key, np.dtype(dtype), "dtype")
            arr = np.empty((stop - start, self.channels[key]), dtype or self.dtypes[key])
            self._fill(arr, file, group, start, stop)
            out[key] = arr
        return out

    def _fill(
        self, arr: np.ndarray, file: int, group: tuple[str, ...], start: int, stop: int
    ) -> None:
        c = 0
        for name in group:
            data = self.index.array(file, name)[start:stop]
            if data.ndim == 1:
                arr[:, c] = data
                c += 1
            else:
                arr[:, c : c + data.shape[1]] = data
                c += data.shape[1]

    def get_batch(
        self, indices: Sequence[int] | np.ndarray, *, start: int = 0, stop: int | None = None
    ) -> dict[str, np.ndarray]:
        """Windows `indices` stacked: ``{signal: [B, L, C]}`` (what `pipeline` calls).

        `start` and `stop` select rows ``[start, stop)`` of every window (a TBPTT chunk).
        """
        locs = [self.location(i) for i in indices]
        lengths = {b - a for _, a, b in locs}
        if len(lengths) > 1:
            raise ValueError(
                f"WindowedSource: cannot stack whole-file items of lengths {sorted(lengths)} "
                "into one batch (window=None). Set a window length, or use batch_size=1."
            )
        length = lengths.pop() if lengths else (self.window or 0)
        lo, hi, _ = slice(start, stop).indices(length)
        hi = max(hi, lo)
        out = {}
        for key, group in self.signals.items():
            arr = np.empty((len(locs), hi - lo, self.channels[key]), self.dtypes[key])
            for row, (f, a, _) in enumerate(locs):
                self._fill(arr[row], f, group, a + lo, a + hi)
            out[key] = arr
        return out

    @property
    def item_length(self) -> int | None:
        """The window length L, or the common file length (``window=None``), or None."""
        if self.window is not None:
            return self.window
        return self.lengths[0] if len(set(self.lengths)) == 1 else None

    def blocks(
        self, block_rows: int = 1 << 16, *, dtype: Any = np.float64
    ) -> Iterator[dict[str, np.ndarray]]:
        """Every row of every file once, in blocks of at most `block_rows` rows.

        Windows overlap when ``stride < window``; statistics are taken over these blocks
        instead, so each sample counts once (see `channel_stats`).
        """
        for f, length in enumerate(self.lengths):
            for start in range(0, length, block_rows):
                yield self.read(f, start, min(start + block_rows, length), dtype=dtype)

    def reindex(self) -> WindowedSource:
        """A new source over the same files with the same arguments, indexed as the files
        are now (after they changed: reads of this one raise then; see `HDF5Index`).
        Build the pipeline again from the new source."""
        return WindowedSource(
            self.files,
            self.signals,
            window=self.window,
            stride=self.stride,
            dtype=self._dtype_arg,
            mmap_only=self.index.mmap_only,
            max_open_files=self.index.max_open_files,
            cache_bytes=self.index.cache_bytes,
        )

    def describe_sample(self, signal: str, row: int, channel: int) -> str:
        """Where value ``[row, channel]`` of signal `signal`'s `blocks` stream comes from,
        in words: the file, the dataset and its column, the time step (for error
        messages, e.g. `channel_stats`' finiteness check)."""
        ends = np.cumsum(self.lengths).tolist()
        f = bisect.bisect_right(ends, int(row))
        t = int(row) - (ends[f - 1] if f else 0)
        c = int(channel)
        for name in self.signals[signal]:
            shape = self.index.info(f, name).shape
            width = 1 if len(shape) == 1 else shape[1]
            if c < width:
                column = "" if len(shape) == 1 else f", column {c}"
                break
            c -= width
        return (
            f"HDF5 file {self.files[f]!r}, dataset {name!r}{column} (channel {int(channel)} "
            f"of signal {signal!r}), sample {t} of {self.lengths[f]}"
        )

    def __repr__(self) -> str:
        sig = {k: list(v) for k, v in self.signals.items()}
        return (
            f"WindowedSource({len(self.files)} files, signals={sig}, window={self.window}, "
            f"stride={self.stride}, {len(self)} windows)"
        )
