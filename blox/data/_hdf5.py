"""`HDF5Index`: where each dataset of each HDF5 file lives, found once with h5py.

Contiguous datasets are read through ``np.memmap`` at the byte offset h5py reports
(picklable: a path and an offset, safe in Grain's worker processes); chunked or compressed
ones fall back to h5py, opened lazily in each process that reads.
"""

from __future__ import annotations

import dataclasses
import logging
import os
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


class HDF5Index:
    """Where each requested dataset of each HDF5 file lives; reads rows of them.

    Each file is opened once with h5py (here, at construction) to record, for every
    requested dataset, its shape, dtype, layout and byte offset. Reads then go through
    ``np.memmap`` for contiguous datasets (one read-only map per file and process) and
    through h5py for chunked or compressed ones (one handle per file and process, opened
    on the first read). Nothing open is pickled: an index sent to a Grain worker process
    reopens what it needs there, so it is safe with ``mp_prefetch`` and
    ``grain.DataLoader`` workers.

    Files that need h5py get one logged notice each (logger ``'blox.data'``, level
    WARNING); with ``mmap_only=True`` they raise instead.

    Args:
      files: paths of HDF5 files.
      datasets: dataset paths inside every file (e.g. ``['u', 'y']``).
      mmap_only: raise a ``ValueError`` for any dataset that cannot be memory-mapped
        instead of falling back to h5py.

    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` for a file that is
    not HDF5, a missing dataset, a group given as a dataset, or (``mmap_only``) a
    chunked/compressed dataset; each message names the file, the dataset and the fix.

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
    ):
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
        self._infos: list[dict[str, DatasetInfo]] = [self._scan(f) for f in self.files]
        self._cache_pid: int | None = None
        self._maps: dict[int, np.memmap] = {}
        self._views: dict[tuple[int, str], np.ndarray] = {}
        self._handles: dict[int, h5py.File] = {}

    def _scan(self, file: str) -> dict[str, DatasetInfo]:
        if not os.path.exists(file):
            raise FileNotFoundError(
                f"HDF5 file {file!r} does not exist (looked from the working directory "
                f"{os.getcwd()!r}). Check the path, or pass an absolute one."
            )
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
                infos[name] = _describe(file, name, obj)
        slow = [i for i in infos.values() if not i.memmap]
        if slow and self.mmap_only:
            i = slow[0]
            raise ValueError(
                f"HDF5 file {file!r}, dataset {i.name!r}: {i.why_not_memmap()}, so it cannot "
                f"be memory-mapped (mmap_only=True). {_REWRITE.format(file=file, name=i.name)} "
                "Or pass mmap_only=False to read it through h5py (slower)."
            )
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
        # Maps and handles belong to the process that opened them; a forked or spawned
        # worker opens its own.
        pid = os.getpid()
        if self._cache_pid != pid:
            self._maps, self._views, self._handles, self._cache_pid = {}, {}, {}, pid

    def array(self, file: int, name: str) -> Any:
        """An array-like over the whole dataset: a ``np.memmap`` view or an h5py dataset.

        Slicing it (``a[start:stop]``) reads those rows only.
        """
        self._check_pid()
        view = self._views.get((file, name))
        if view is not None:
            return view
        info = self._infos[file][name]
        if info.memmap:
            mm = self._maps.get(file)
            if mm is None:
                mm = self._maps[file] = np.memmap(self.files[file], dtype=np.uint8, mode="r")
            view = np.ndarray(info.shape, dtype=info.dtype, buffer=mm, offset=info.offset)
            self._views[(file, name)] = view
            return view
        handle = self._handles.get(file)
        if handle is None:
            handle = self._handles[file] = h5py.File(self.files[file], "r")
        return handle[name]

    def read(self, file: int, name: str, start: int, stop: int) -> np.ndarray:
        """Rows ``[start, stop)`` of dataset `name` in file number `file`, as a new array."""
        return np.array(self.array(file, name)[start:stop])

    def close(self) -> None:
        """Closes this process's maps and h5py handles (later reads reopen them)."""
        for handle in self._handles.values():
            handle.close()
        self._maps, self._views, self._handles = {}, {}, {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(_maps={}, _views={}, _handles={}, _cache_pid=None)
        return state

    def __repr__(self) -> str:
        n_map = sum(i.memmap for infos in self._infos for i in infos.values())
        total = len(self.files) * len(self.datasets)
        return (
            f"HDF5Index({len(self.files)} files, datasets={list(self.datasets)}, "
            f"{n_map}/{total} memory-mapped)"
        )
