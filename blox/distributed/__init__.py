"""Many processes through ``jax.distributed``: the same script as 1 process or as N.

* Joining: `initialize` (a no-op for a single process; explicit settings, the ``BLOX_*``
  variables ``python -m blox.launch`` sets, or a scheduler JAX detects), `describe`,
  `ProcessInfo`. A process that does not join is named in a ``TimeoutError``.
* Launching on one machine: ``python -m blox.launch -n N [--devices-per-process K]
  SCRIPT [ARGS...]``, or `launch` from Python: rank-prefixed output, the first non-zero
  exit code, no process left behind when one fails.
* Per-process data: `process_shard` / `process_shards` (the rows each process loads,
  `ProcessShard`), `check_shards` (disjoint and covering), `global_batch` (the global
  ``jax.Array`` from each process's rows).
* Random streams independent of the process split: `named_key`, `row_keys`,
  `device_keys`.

See docs/multihost.md.
"""

from blox.distributed._data import ProcessShard as ProcessShard
from blox.distributed._data import check_shards as check_shards
from blox.distributed._data import global_batch as global_batch
from blox.distributed._data import process_shard as process_shard
from blox.distributed._data import process_shards as process_shards
from blox.distributed._init import ProcessInfo as ProcessInfo
from blox.distributed._init import describe as describe
from blox.distributed._init import initialize as initialize
from blox.distributed._launch import launch as launch
from blox.distributed._rng import device_keys as device_keys
from blox.distributed._rng import named_key as named_key
from blox.distributed._rng import row_keys as row_keys

__all__ = sorted(n for n in dir() if not n.startswith("_"))
