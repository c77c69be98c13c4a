"""blox: pure-functional neural networks in JAX with explicit state.

The whole mental model::

    outputs, params = model(params, inputs)

`Graph` names the structure, `Params` holds every array (weights, RNG state, running
statistics), modules are static configuration. Users call ``jax.jit``, ``jax.grad``,
``jax.vmap`` and ``jax.shard_map`` themselves. `Rng` does not fold ``vmap``/
``shard_map`` axes on its own: fold an axis index into the seed for per-lane keys.
"""

from importlib import metadata as _metadata

from blox import ckpt as ckpt
from blox import core as core
from blox import data as data
from blox import distributed as distributed
from blox import nn as nn
from blox import parallel as parallel
from blox import train as train
from blox import ts as ts
from blox.core import Graph as Graph
from blox.core import Module as Module
from blox.core import Param as Param
from blox.core import Params as Params
from blox.core import RecurrenceBase as RecurrenceBase
from blox.core import Rng as Rng
from blox.core import SequenceBase as SequenceBase
from blox.core import display as display
from blox.core import dynamic_scan as dynamic_scan
from blox.core import format_path as format_path
from blox.core import from_dict as from_dict
from blox.core import graph_tree as graph_tree
from blox.core import named_shardings as named_shardings
from blox.core import params_table as params_table
from blox.core import partition_specs as partition_specs
from blox.core import static_scan as static_scan
from blox.core import to_dict as to_dict
from blox.nn import *  # noqa: F403  (every layer, as listed in blox.nn.__all__)
from blox.train import *  # noqa: F403

try:
    __version__ = _metadata.version("blox")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = [
    "Graph",
    "Module",
    "Param",
    "Params",
    "RecurrenceBase",
    "Rng",
    "SequenceBase",
    "display",
    "dynamic_scan",
    "format_path",
    "from_dict",
    "graph_tree",
    "named_shardings",
    "params_table",
    "partition_specs",
    "static_scan",
    "to_dict",
    *nn.__all__,
    *train.__all__,
]
