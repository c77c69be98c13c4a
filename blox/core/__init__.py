"""The blox core: `Graph`, `Param`, `Params`, `Module`, `Rng`, scans, sharding, display."""

from blox.core._convert import from_dict as from_dict
from blox.core._convert import to_dict as to_dict
from blox.core._display import display as display
from blox.core._display import graph_tree as graph_tree
from blox.core._display import params_table as params_table
from blox.core._graph import Graph as Graph
from blox.core._module import Module as Module
from blox.core._params import Param as Param
from blox.core._params import Params as Params
from blox.core._params import format_path as format_path
from blox.core._rng import Rng as Rng
from blox.core._sequence import RecurrenceBase as RecurrenceBase
from blox.core._sequence import SequenceBase as SequenceBase
from blox.core._sequence import dynamic_scan as dynamic_scan
from blox.core._sequence import static_scan as static_scan
from blox.core._sharding import named_shardings as named_shardings
from blox.core._sharding import partition_specs as partition_specs

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
]
