"""blox data: Grain pipelines over HDF5 recordings and in-memory arrays.

Grain is the engine (index shuffle, batching, worker processes, prefetch, iterator
state); blox adds the sources and the recipes:

- `HDF5Index` finds each dataset's byte offset once with h5py and reads contiguous
  datasets through ``np.memmap`` (picklable, safe in worker processes), chunked or
  compressed ones through h5py; a file changed after indexing raises when a process
  opens it (``reindex()`` indexes it again).
- `WindowedSource` cuts many files and several signals into windows computed on the fly:
  ``{'u': [L, Cu], 'y': [L, Cy]}`` in raw physical units.
- `ArraySource` serves in-memory arrays such as ``{'x': images, 'y': labels}``.
- `pipeline` builds the Grain dataset of batches: shuffled by seed or in order, repeated,
  sharded per process, in TBPTT order, with workers and prefetch; its iterators save and
  restore their state.
- `channel_stats` streams per-channel means and standard deviations over the training
  split, refusing NaN and inf with their place; `Normalize` holds them as non-trainable
  params inside the model (raw-in/raw-out).
- `call_in_subprocess` keeps scikit-learn (OpenMP) work out of the process that runs
  Grain's shuffle (docs/data.md, "scikit-learn").
"""

from blox.data._arrays import ArraySource as ArraySource
from blox.data._hdf5 import DatasetInfo as DatasetInfo
from blox.data._hdf5 import HDF5Index as HDF5Index
from blox.data._normalize import Normalize as Normalize
from blox.data._pipeline import pipeline as pipeline
from blox.data._stats import ChannelStats as ChannelStats
from blox.data._stats import channel_stats as channel_stats
from blox.data._subprocess import call_in_subprocess as call_in_subprocess
from blox.data._windows import WindowedSource as WindowedSource

__all__ = sorted(n for n in dir() if not n.startswith("_"))
