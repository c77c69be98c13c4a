"""`HDF5Index`: where each dataset of each HDF5 file lives, found once with h5py.

Contiguous datasets are read through ``np.memmap`` at the byte offset h5py reports
(picklable: a path and an offset, safe in Grain's worker processes); chunked or compressed
ones fall back to h5py, opened lazily in each process that reads.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import math
import os
import threading
from collections.abc import Sequence
from typing import Any

import h5py
import numpy as np

__all__ = ["DatasetInfo", "HDF5Index"]

logger = logging.getLogger("blox.data")

_LAYOUTS = {
    h5py.h5d.CONTIGUOUS: "contiguous",
    h5py.h5d.CHUNKED: "chunked",
    h5py.h5d.COMPACT: "compact",
}

# Files whose h5py notice this process has logged: (real path, dataset) pairs. Only
# deduplicates a log line (one notice per file and process, however many indexes read it).
_NOTICED: set[tuple[str, str]] = set()
_NOTICED_LOCK = threading.Lock()

# Dataset kinds read as numbers: bool, signed/unsigned integers, floats, complex.
_NUMERIC_KINDS = "biufc"

_REWRITE = (
    "To memory-map it, store it contiguous: h5repack -l CONTI {file} out.h5, or in h5py "
    "f.create_dataset({name!r}, data=array) without chunks=, compression=, maxshape= or "
    "filters."
)


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What `HDF5Index` records about one dataset of one file.

    Attributes:
      file: the file's path.
      name: the dataset's path inside the file (e.g. ``'u'`` or ``'group/u'``).
      shape: the dataset's shape.
      dtype: its NumPy dtype (byte order included, e.g. ``'>f8'``).
      layout: ``'contiguous'``, ``'chunked'``, ``'compact'`` or ``'virtual'``.
      offset: the byte offset of the data in the file when it can be memory-mapped
        (contiguous, allocated, stored in the file itself), else ``None``.
      chunks: the chunk shape, or ``None``.
      compression: the compression filter's name, or ``None``.
    """

    file: str
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    layout: str
    offset: int | None
    chunks: tuple[int, ...] | None
    compression: str | None

    @property
    def memmap(self) -> bool:
        """Whether reads go through ``np.memmap`` (else through h5py)."""
        return self.offset is not None

    def why_not_memmap(self) -> str:
        """A short reason this dataset cannot be memory-mapped (empty when it can)."""
        if self.memmap:
            return ""
        if self.layout == "chunked":
            how = f"chunked {self.chunks}"
            return how + (f" with {self.compression} compression" if self.compression else "")
        if self.layout == "contiguous":
            return "contiguous but never written or stored in an external file"
        return f"stored with the {self.layout} layout"


def _what_dtype(dtype: np.dtype) -> str:
    """Words for a non-numeric dtype (the message of the dtype check)."""
    if h5py.check_string_dtype(dtype) is not None or dtype.kind in "SU":
        length = "variable-length" if dtype.kind == "O" else "fixed-length"
        return f"{length} strings"
    if h5py.check_vlen_dtype(dtype) is not None:
        return "variable-length sequences"
    if dtype.kind == "O":
        return "objects (references or variable-length data)"
    if dtype.names:
        return f"a compound type with fields {list(dtype.names)}"
    if dtype.subdtype is not None:
        return f"arrays of shape {dtype.shape} per element"
    return "opaque bytes"


def _check_numeric(file: str, name: str, dset: h5py.Dataset) -> None:
    dtype = np.dtype(dset.dtype)
    if dtype.kind in _NUMERIC_KINDS and dtype.subdtype is None and not dtype.names:
        return
    raise ValueError(
        f"HDF5 file {file!r}, dataset {name!r} holds {_what_dtype(dtype)} (dtype "
        f"{dtype}), not numbers; blox.data reads numeric datasets only (bool, int, float, "
        "complex). Leave it out of the dataset/signal names, or store it as numbers "
        "(e.g. text labels as integer codes, a compound type as one dataset per field)."
    )


def _describe(file: str, name: str, dset: h5py.Dataset) -> DatasetInfo:
    plist = dset.id.get_create_plist()
    layout = _LAYOUTS.get(plist.get_layout(), "virtual")
    offset = None
    if layout == "contiguous" and not dset.external and plist.get_nfilters() == 0:
        offset = dset.id.get_offset()  # None when the space was never allocated
    return DatasetInfo(
        file=file,
        name=name,
        shape=tuple(int(d) for d in dset.shape),
        dtype=np.dtype(dset.dtype),
        layout=layout,
        offset=None if offset is None else int(offset),
        chunks=None if dset.chunks is None else tuple(dset.chunks),
        compression=dset.compression,
    )


def _dataset_names(handle: h5py.File) -> list[str]:
    found: list[str] = []
    handle.visititems(lambda n, o: found.append(n) if isinstance(o, h5py.Dataset) else None)
    return found


@dataclasses.dataclass(frozen=True)
class _Stamp:
    """What identifies the bytes of a file as indexed: size, modification time, inode."""

    size: int
    mtime_ns: int
    inode: int

    @classmethod
    def of(cls, file: str) -> _Stamp:
        st = os.stat(file)
        return cls(size=int(st.st_size), mtime_ns=int(st.st_mtime_ns), inode=int(st.st_ino))

    def changes(self, now: _Stamp) -> str:
        """What differs from `now`, in words (empty when nothing does)."""
        out = []
        if now.size != self.size:
            out.append(f"size {self.size} -> {now.size} bytes")
        if now.mtime_ns != self.mtime_ns:
            out.append(f"modified at {_when(now.mtime_ns)} (indexed as {_when(self.mtime_ns)})")
        if now.inode != self.inode:
            out.append(f"inode {self.inode} -> {now.inode} (replaced by another file)")
        return ", ".join(out)


def _when(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.UTC).isoformat(
        timespec="microseconds"
    )


class HDF5Index:
    """Where each requested dataset of each HDF5 file lives; reads rows of them.

    Each file is opened once with h5py (here, at construction) to record, for every
    requested dataset, its shape, dtype, layout and byte offset; datasets that do not
    hold numbers (strings, compound types, references) are refused there, before any
    read. Reads then go through ``np.memmap`` for contiguous datasets (one read-only map
    per file) and through h5py for chunked or compressed ones (one handle per file,
    opened on the first read). At most `max_open_files` maps and handles are open at
    once in each process (least recently used closed first), so thousands of files
    stay within the OS limit on open files (``ulimit -n``: 256 on macOS, 1024 on Linux).
    Nothing open is pickled: an index sent to a Grain worker process reopens what it
    needs there, so it is safe with ``mp_prefetch`` and ``grain.DataLoader`` workers.

    **Files changed after indexing**: the byte offsets (and shapes) hold for the files
    as they were indexed. Each file's size, modification time (``st_mtime_ns``) and inode
    are recorded here, and each process checks them whenever it opens the file (its
    first read, and again after `close` or after the file left the `max_open_files`
    window), not on every read: a Grain worker checks its pickled copy against the file
    on disk. A file that changed (rewritten, replaced, appended to) raises a
    ``ValueError`` naming the file and what changed; `reindex` (or building the index
    again) records the files as they are now. A file changed while a process holds it
    open is not seen until that process reopens it (`close` forces that), nor is a
    rewrite that keeps the size and inode within the file system's timestamp
    granularity.

    Files that need h5py get one logged notice each per process (logger
    ``'blox.data'``, level WARNING; a second index over the same file logs nothing);
    with ``mmap_only=True`` they raise instead.

    **In-memory cache** (``cache_bytes > 0``): a dataset read through h5py (chunked or
    compressed) whose size is at most `cache_bytes` is read whole on its first use,
    decompressed, and later windows are sliced from memory; the cache holds at most
    `cache_bytes` in each process (least recently used dropped first). Use it for small
    compressed recordings that fit in memory (the TSFast ``cache=True`` case): the h5py
    path decompresses whole chunks for every window, many times slower than a memory
    map. Each worker process keeps its own cache, so the memory is ``cache_bytes``
    times the number of processes. Memory-mapped datasets are never cached (the OS page
    cache already keeps them).

    Args:
      files: paths of HDF5 files.
      datasets: dataset paths inside every file (e.g. ``['u', 'y']``).
      mmap_only: raise a ``ValueError`` for any dataset that cannot be memory-mapped
        instead of falling back to h5py.
      max_open_files: most memory maps plus h5py handles open at once in one process
        (>= 1).
      cache_bytes: the in-memory cache's size per process in bytes (0: no cache).

    Raises ``FileNotFoundError`` for a missing file (also when a file indexed here is
    gone at a later open) and ``ValueError`` for a file changed since it was indexed
    (at open), a file that is not HDF5, a missing dataset, a group given as a dataset,
    a dataset that does not hold numbers, or (``mmap_only``) a chunked/compressed
    dataset; each message names the file, the dataset and the fix.

    >>> import h5py, numpy as np, tempfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), 'run.h5')
    >>> with h5py.File(path, 'w') as f:
    ...     _ = f.create_dataset('u', data=np.arange(6.0))
    >>> index = HDF5Index([path], ['u'])
    >>> index.info(0, 'u').memmap, index.info(0, 'u').shape
    (True, (6,))
    >>> index.read(0, 'u', 2, 5)
    array([2., 3., 4.])
    """

    def __init__(
        self,
        files: Sequence[str | os.PathLike],
        datasets: Sequence[str],
        *,
        mmap_only: bool = False,
        max_open_files: int = 32,
        cache_bytes: int = 0,
    ):
        for arg, value, low in (
            ("max_open_files", max_open_files, 1),
            ("cache_bytes", cache_bytes, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < low:
                raise ValueError(f"HDF5Index: {arg} must be an int >= {low}, got {value!r}.")
        if isinstance(files, str | os.PathLike):
            raise TypeError(
                f"HDF5Index: files must be a list of paths, got the single path {files!r}. "
                f"Wrap it in a list: [{str(files)!r}]."
            )
        if isinstance(datasets, str):
            raise TypeError(
                f"HDF5Index: datasets must be a list of names, got the string {datasets!r}. "
                f"Wrap it in a list: [{datasets!r}]."
            )
        self.files: tuple[str, ...] = tuple(os.fspath(f) for f in files)
        self.datasets: tuple[str, ...] = tuple(datasets)
        if not self.files:
            raise ValueError("HDF5Index: no files given. Pass at least one HDF5 file path.")
        if not self.datasets:
            raise ValueError("HDF5Index: no dataset names given, e.g. datasets=['u', 'y'].")
        self.mmap_only = bool(mmap_only)
        self.max_open_files = int(max_open_files)
        self.cache_bytes = int(cache_bytes)
        self._stamps: list[_Stamp] = []
        self._infos: list[dict[str, DatasetInfo]] = [self._scan(f) for f in self.files]
        self._reset()

    def _reset(self) -> None:
        # Per-process state: open maps/handles (LRU), cached arrays (LRU), their lock.
        self._cache_pid: int | None = os.getpid()
        self._lock = threading.Lock()
        # ('map', file) -> (np.memmap, {name: view});  ('h5', file) -> h5py.File
        self._open: collections.OrderedDict[tuple[str, int], Any] = collections.OrderedDict()
        self._cached: collections.OrderedDict[tuple[int, str], np.ndarray] = (
            collections.OrderedDict()
        )
        self._cached_bytes = 0

    def _scan(self, file: str) -> dict[str, DatasetInfo]:
        if not os.path.exists(file):
            raise FileNotFoundError(
                f"HDF5 file {file!r} does not exist (looked from the working directory "
                f"{os.getcwd()!r}). Check the path, or pass an absolute one."
            )
        stamp = _Stamp.of(file)  # before reading: a later change is then seen at open
        try:
            handle = h5py.File(file, "r")
        except OSError as e:
            raise ValueError(
                f"{file!r} could not be opened as an HDF5 file ({e}). Pass HDF5 files "
                "(.h5/.hdf5) written by h5py, MATLAB v7.3 or another HDF5 writer."
            ) from e
        infos = {}
        with handle:
            for name in self.datasets:
                obj = handle.get(name)
                if obj is None:
                    found = _dataset_names(handle)
                    raise ValueError(
                        f"HDF5 file {file!r} has no dataset {name!r}; it holds "
                        f"{sorted(found)}. Fix the signal names (or the file list) so that "
                        "every file holds every dataset."
                    )
                if not isinstance(obj, h5py.Dataset):
                    raise ValueError(
                        f"HDF5 file {file!r}: {name!r} is a group, not a dataset; it holds "
                        f"{sorted(obj.keys())}. Name a dataset inside it, e.g. "
                        f"'{name}/{next(iter(obj.keys()), 'x')}'."
                    )
                _check_numeric(file, name, obj)
                infos[name] = _describe(file, name, obj)
        slow = [i for i in infos.values() if not i.memmap]
        if slow and self.mmap_only:
            i = slow[0]
            raise ValueError(
                f"HDF5 file {file!r}, dataset {i.name!r}: {i.why_not_memmap()}, so it cannot "
                f"be memory-mapped (mmap_only=True). {_REWRITE.format(file=file, name=i.name)} "
                "Or pass mmap_only=False to read it through h5py (slower)."
            )
        self._stamps.append(stamp)
        real = os.path.realpath(file)
        with _NOTICED_LOCK:
            slow = [i for i in slow if (real, i.name) not in _NOTICED]
            _NOTICED.update((real, i.name) for i in slow)
        if slow:
            logger.warning(
                "HDF5 file %r: %s read through h5py, not a memory map (%s). %s",
                file,
                ", ".join(repr(i.name) for i in slow),
                "; ".join(f"{i.name!r} {i.why_not_memmap()}" for i in slow),
                _REWRITE.format(file=file, name=slow[0].name),
            )
        return infos

    def info(self, file: int, name: str) -> DatasetInfo:
        """The `DatasetInfo` of dataset `name` in file number `file`."""
        return self._infos[file][name]

    def _check_pid(self) -> None:
        # Maps, handles and cached arrays belong to the process that opened them; a
        # forked or spawned worker opens its own.
        if self._cache_pid != os.getpid():
            self._reset()

    def _opened(self, key: tuple[str, int]) -> Any:
        """The open map or handle `key` (opened if needed; least recently used closed)."""
        with self._lock:
            entry = self._open.get(key)
            if entry is not None:
                self._open.move_to_end(key)
                return entry
            kind, file = key
            self._verify(file)
            if kind == "map":
                entry = (np.memmap(self.files[file], dtype=np.uint8, mode="r"), {})
            else:
                entry = h5py.File(self.files[file], "r")
            self._open[key] = entry
            while len(self._open) > self.max_open_files:
                # Dropping the reference closes a map once no read still uses it (views
                # keep it alive); an h5py file closes when its last dataset object goes.
                self._open.popitem(last=False)
            return entry

    def _verify(self, file: int) -> None:
        """Raises when file number `file` is no longer the file that was indexed."""
        path = self.files[file]
        try:
            now = _Stamp.of(path)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"HDF5 file {path!r} was indexed but is gone (moved or deleted). Put it "
                "back, or build the source again without it."
            ) from None
        changes = self._stamps[file].changes(now)
        if changes:
            raise ValueError(
                f"HDF5 file {path!r} changed after it was indexed ({changes}): the byte "
                "offsets and shapes recorded then would read other bytes now. Re-index it "
                "in the main process: source = source.reindex() (a WindowedSource or "
                "HDF5Index; or build it again), then build the pipeline again from it "
                "(worker processes hold a pickled copy of the old index)."
            )

    def reindex(self) -> HDF5Index:
        """A new index of the same files and datasets, with the same options, as they
        are now (the offsets, shapes and file stamps recorded again)."""
        return HDF5Index(
            self.files,
            self.datasets,
            mmap_only=self.mmap_only,
            max_open_files=self.max_open_files,
            cache_bytes=self.cache_bytes,
        )

    def _cached_array(self, file: int, name: str, info: DatasetInfo) -> np.ndarray | None:
        if not self.cache_bytes or info.memmap:
            return None
        nbytes = math.prod(info.shape) * info.dtype.itemsize
        if nbytes > self.cache_bytes:
            return None
        key = (file, name)
        with self._lock:
            arr = self._cached.get(key)
            if arr is not None:
                self._cached.move_to_end(key)
                return arr
        arr = np.asarray(self._opened(("h5", file))[name][()])
        with self._lock:
            if key not in self._cached:
                self._cached[key] = arr
                self._cached_bytes += arr.nbytes
            while self._cached_bytes > self.cache_bytes:
                _, old = self._cached.popitem(last=False)
                self._cached_bytes -= old.nbytes
        return arr

    def array(self, file: int, name: str) -> Any:
        """An array-like over the whole dataset: a ``np.memmap`` view, a cached array or
        an h5py dataset.

        Slicing it (``a[start:stop]``) reads those rows only. Use it right away: an h5py
        dataset becomes unreadable once `max_open_files` later files have been opened.
        """
        self._check_pid()
        info = self._infos[file][name]
        if info.memmap:
            mm, views = self._opened(("map", file))
            view = views.get(name)
            if view is None:
                view = np.ndarray(info.shape, dtype=info.dtype, buffer=mm, offset=info.offset)
                views[name] = view
            return view
        cached = self._cached_array(file, name, info)
        if cached is not None:
            return cached
        return self._opened(("h5", file))[name]

    def read(self, file: int, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of dataset `name` in file number `file`, as a new array."""
        return np.array(self.array(file, name)[start:stop])

    def close(self) -> None:
        """Closes this process's maps and h5py handles and empties the cache (later reads
        reopen them)."""
        self._check_pid()
        with self._lock:
            for (kind, _), entry in self._open.items():
                if kind == "h5":
                    entry.close()
            self._open.clear()
            self._cached.clear()
            self._cached_bytes = 0

    @property
    def open_files(self) -> int:
        """How many memory maps and h5py handles this process holds open now."""
        self._check_pid()
        return len(self._open)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for key in ("_cache_pid", "_lock", "_open", "_cached", "_cached_bytes"):
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()

    def __repr__(self) -> str:
        n_map = sum(i.memmap for infos in self._infos for i in infos.values())
        total = len(self.files) * len(self.datasets)
        return (
            f"HDF5Index({len(self.files)} files, datasets={list(self.datasets)}, "
            f"{n_map}/{total} memory-mapped)"
        )
