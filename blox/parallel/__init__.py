"""Explicit parallelism as plain functions: the user declares the mesh, the partition
specs and every collective; blox validates and helps, and never partitions anything
behind the user's back.

* Mesh: `make_mesh`, `describe_mesh`, `bound_axes`; moving arrays: `place`.
* Rules (path pattern -> per-dimension axes): `param_specs`, `param_shardings`,
  `opt_state_specs`, `opt_state_shardings`, `sharding_table`, `transformer_tp_rules`.
* Checked collectives over pytrees: `psum`, `pmean`, `all_gather`, `reduce_scatter`,
  `ppermute`, `broadcast`.
* Data parallelism: `dp_value_and_grad` (inside your ``shard_map``), `make_dp_train_step`,
  `split_batch`.
* Fully sharded data parallelism (ZeRO-3): `fsdp_specs`, `fsdp_call` (inside your loss),
  `fsdp_value_and_grad`, `make_fsdp_train_step`, `bytes_per_device`.
* Tensor parallelism: `ColumnParallelLinear`, `RowParallelLinear`, `ParallelMLP`,
  `ParallelMultiHeadAttention`, `ParallelTransformerBlock`.
* Expert parallelism (inside your ``shard_map``): `ExpertParallelMoE`, `moe_ep_rules`,
  `ep_value_and_grad`, `ragged_dispatch_plan`.
* Context parallelism (inside your ``shard_map``): `ring_attention`,
  `allgather_attention`, `balance_sequence`, `unbalance_sequence`; the layers take
  ``context_axis=`` (`blox.nn.MultiHeadAttention`, `blox.nn.TransformerBlock`,
  `blox.nn.TransformerLM`); `check_context_parallel`, `cp_batch_spec`.
* Per-device RNG streams: `fold_seeds`, `restore_seeds`.
* Pipeline parallelism: `pipeline_value_and_grad`, `stack_stages`, `unstack_stages`,
  `Schedule`, `Action`, `Program`, `gpipe_schedule`, `one_f_one_b_schedule`,
  `interleaved_schedule`, `zero_bubble_schedule`, `zero_bubble_v_schedule`.
"""

from blox.parallel._collectives import all_gather as all_gather
from blox.parallel._collectives import broadcast as broadcast
from blox.parallel._collectives import pmean as pmean
from blox.parallel._collectives import ppermute as ppermute
from blox.parallel._collectives import psum as psum
from blox.parallel._collectives import reduce_scatter as reduce_scatter
from blox.parallel._context import allgather_attention as allgather_attention
from blox.parallel._context import balance_sequence as balance_sequence
from blox.parallel._context import check_context_parallel as check_context_parallel
from blox.parallel._context import ring_attention as ring_attention
from blox.parallel._context import unbalance_sequence as unbalance_sequence
from blox.parallel._dp import dp_value_and_grad as dp_value_and_grad
from blox.parallel._dp import make_dp_train_step as make_dp_train_step
from blox.parallel._dp import split_batch as split_batch
from blox.parallel._expert import ExpertParallelMoE as ExpertParallelMoE
from blox.parallel._expert import ep_value_and_grad as ep_value_and_grad
from blox.parallel._expert import moe_ep_rules as moe_ep_rules
from blox.parallel._expert import ragged_dispatch_plan as ragged_dispatch_plan
from blox.parallel._fsdp import bytes_per_device as bytes_per_device
from blox.parallel._fsdp import fsdp_call as fsdp_call
from blox.parallel._fsdp import fsdp_specs as fsdp_specs
from blox.parallel._fsdp import fsdp_value_and_grad as fsdp_value_and_grad
from blox.parallel._fsdp import make_fsdp_train_step as make_fsdp_train_step
from blox.parallel._mesh import bound_axes as bound_axes
from blox.parallel._mesh import describe_mesh as describe_mesh
from blox.parallel._mesh import make_mesh as make_mesh
from blox.parallel._mesh import place as place
from blox.parallel._pipeline import pipeline_value_and_grad as pipeline_value_and_grad
from blox.parallel._pipeline import stack_stages as stack_stages
from blox.parallel._pipeline import unstack_stages as unstack_stages
from blox.parallel._rng import fold_seeds as fold_seeds
from blox.parallel._rng import restore_seeds as restore_seeds
from blox.parallel._rules import cp_batch_spec as cp_batch_spec
from blox.parallel._rules import opt_state_shardings as opt_state_shardings
from blox.parallel._rules import opt_state_specs as opt_state_specs
from blox.parallel._rules import param_shardings as param_shardings
from blox.parallel._rules import param_specs as param_specs
from blox.parallel._rules import sharding_table as sharding_table
from blox.parallel._schedules import Action as Action
from blox.parallel._schedules import Program as Program
from blox.parallel._schedules import Schedule as Schedule
from blox.parallel._schedules import gpipe_schedule as gpipe_schedule
from blox.parallel._schedules import interleaved_schedule as interleaved_schedule
from blox.parallel._schedules import one_f_one_b_schedule as one_f_one_b_schedule
from blox.parallel._schedules import zero_bubble_schedule as zero_bubble_schedule
from blox.parallel._schedules import zero_bubble_v_schedule as zero_bubble_v_schedule
from blox.parallel._tp import ColumnParallelLinear as ColumnParallelLinear
from blox.parallel._tp import ParallelMLP as ParallelMLP
from blox.parallel._tp import ParallelMultiHeadAttention as ParallelMultiHeadAttention
from blox.parallel._tp import ParallelTransformerBlock as ParallelTransformerBlock
from blox.parallel._tp import RowParallelLinear as RowParallelLinear
from blox.parallel._tp import transformer_tp_rules as transformer_tp_rules

__all__ = sorted(n for n in dir() if not n.startswith("_"))
