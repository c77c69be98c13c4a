"""The composition matrix: every stateful feature on every path.

Rows (`FEATURES`) are the stateful features of a model: dropout through an `Rng` (and
the same with the `Rng` left out of ``rngs=``), BatchNorm running statistics (per shard,
and averaged over ``'data'``), integer state that depends on the data, RNG counters
drawn on both ends of the model, a masked loss weighted by ``aux['weight']`` over a
padded batch (NaN on all-padding microbatches), a bf16 compute policy over a tree of
mixed dtypes, and gradient accumulation. Columns (`PATHS`) are the ways to train it: one device, one
device with accumulation, DP, FSDP, TP, each pipeline schedule, DP x PP, FSDP x PP and
DP x TP x PP. A cell runs one step of its path and compares the loss, the gradients (or
the params after one SGD step of rate 1) and the non-trainable state (RNG counters and
seeds, BatchNorm statistics, call counts) with a one-device reference written here in
plain ``jax.value_and_grad`` from the cell's stated semantics (`semantics`), never with
numbers the path produced.

Where paths differ on purpose, the reference computes the difference: a path that
folds the data index into the `Rng` seeds (DP, FSDP, TP, and the pipelines with a data
axis) is compared with one-device runs of each data shard whose seeds are folded by the
shard's index (``jax.random.fold_in(seed, d)``); per-shard BatchNorm statistics are the
mean over the shards of one-device statistics of each shard's rows; state is threaded
through the microbatches of a shard in order. A cell that cannot compose says why and
asserts the named error it raises (`Cell.error`).

One model per feature: ``first_fn`` (an embedding `Linear` under ``net/``), ``n``
identical units (column- then row-parallel `Linear`, plus the feature's layer; units run
one per pipeline stage, at ``s0/``, ``s1/``, ... on the paths that take one `Params`),
``last_fn`` (the head and the loss). The column- and row-parallel layers split over
``'model'`` on the paths with a model axis and are built unsharded (``axis=None``, the
same parameters) on the others; every layer is called through `blox.parallel.fsdp_call`
(a plain call outside FSDP), so one model serves every path.

``docs/composition.md`` holds the matrix as `render_doc` writes it;
`test_doc_matches_the_table` fails when the two differ (regenerate with
``python -m tests.test_composition_matrix > docs/composition.md``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from pathlib import Path as FsPath
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp
from tests.tolerances import tol

B, D_IN, WIDTH, HIDDEN, OUT = 16, 4, 8, 8, 2  # batch rows, input, activation, TP hidden, targets
LR = 1.0  # SGD rate of the step paths: the params after a step show the gradients whole
DOC = FsPath(__file__).resolve().parents[1] / "docs" / "composition.md"


# -- the table -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Feature:
    """A row: the stateful feature and the semantics every path must keep.

    Attributes:
      name: the row id.
      title: what the model does (docs).
      unit: the layer each unit adds after its row-parallel `Linear`: ``'dropout'``,
        ``'batchnorm'``, ``'runstats'`` (`RunningMeanStd`), ``'counter'`` (a call count
        and a running mean), ``'tally'``
        (an int32 count of positive activations: integer state that depends on the
        data) or ``''``.
      sync_bn: the BatchNorm (or RunningMeanStd) merges its statistics over ``'data'``
        (``axis_name``).
      shared_rng: ``first_fn`` adds noise from the shared `Rng` (``net/rng``) and
        ``last_fn`` scales the loss by a draw from it: one counter advanced on both ends.
      weighted: a masked mean over a padded batch, weighted by ``aux['weight']``.
      guard: the masked mean divides by ``max(count, 1)``; False: by ``count``, so an
        all-padding microbatch's loss is ``0 / 0`` (NaN), its gradients too.
      dtype: the layers' compute dtype.
      row_dtype: the dtype each unit's row-parallel `Linear` stores its params in (the
        other params are float32).
      micro: microbatches per data shard multiply by this (accumulation).
      list_rngs: the steps get every `Rng` in ``rngs=``; False: none.
      rtol, atol: the tolerances when they are not the dtype's (`tests.tolerances`).
      semantics: the row's rule, as the docs state it.
    """

    name: str
    title: str
    unit: str = ""
    sync_bn: bool = False
    shared_rng: bool = False
    weighted: bool = False
    guard: bool = True
    dtype: Any = None
    row_dtype: Any = jnp.float32
    micro: int = 1
    list_rngs: bool = True
    rtol: float | None = None
    atol: float | None = None
    semantics: str = ""

    @property
    def model_key(self) -> Feature:
        """What the model depends on (not the names, `micro`, `list_rngs`, the
        tolerances)."""
        return replace(
            self, name="", title="", micro=1, list_rngs=True, rtol=None, atol=None, semantics=""
        )

    def tol(self) -> dict:
        t = dict(tol(self.dtype or jnp.float32))
        if self.rtol is not None:
            t["rtol"] = self.rtol
        if self.atol is not None:
            t["atol"] = self.atol
        return t


FEATURES = (
    Feature(
        "dropout",
        "Dropout(0.5) in every unit, keys from the unit's own `Rng`",
        unit="dropout",
        semantics=(
            "masks drawn from each unit's seed and counter; a path with a data axis folds "
            "the shard index into every listed seed (`rngs=`), so the reference runs each "
            "shard on one device with `fold_in(seed, d)`; counters advance once per "
            "microbatch, seeds come back unchanged"
        ),
    ),
    Feature(
        "unlisted_rng",
        "the dropout model, its `Rng`s not listed in the step's `rngs=`",
        unit="dropout",
        list_rngs=False,
        semantics=(
            "a step with a data axis cannot keep per-shard masks without folding the seed: "
            "it raises, naming the `Rng` and `rngs=`; without a data "
            "axis there is nothing to fold and the cell equals the one-device run"
        ),
    ),
    Feature(
        "batchnorm",
        "BatchNorm (no `axis_name`) in every unit",
        unit="batchnorm",
        semantics=(
            "each shard normalizes with its own microbatch statistics; the running "
            "statistics are threaded through a shard's microbatches in order, then "
            "averaged over the data shards (the mean of one-device statistics per shard)"
        ),
    ),
    Feature(
        "batchnorm_sync",
        "BatchNorm(axis_name='data') in every unit",
        unit="batchnorm",
        sync_bn=True,
        semantics=(
            "statistics over the same microbatch of every data shard: the one-device run "
            "over the global microbatches (microbatch j of every shard together); without "
            "a data axis there is none to average over: the layer raises, naming itself "
            "and `axis_name`"
        ),
    ),
    Feature(
        "running_stats",
        "RunningMeanStd(axis_name='data', clip=5) in every unit: running mean, variance "
        "and count of its inputs (non-trainable), the output normalized by them",
        unit="runstats",
        sync_bn=True,
        # TP's partial sums over 'model' round apart from one device's products, and the
        # normalization divides by the statistics' deviation: up to 8e-6 absolute on
        # gradient entries up to 5 (the embedding's bias), 2e-4 relative on a small one
        rtol=1e-4,
        atol=1e-5,
        semantics=(
            "each microbatch is normalized by the statistics of every earlier one, then "
            "merged in: with the data shards merged together (microbatch j of every shard "
            "at once), the one-device run over the global microbatches, so every shard "
            "stores the statistics of all rows seen; without a data axis the layer raises, "
            "naming itself and `axis_name`"
        ),
    ),
    Feature(
        "int_state",
        "an int32 count of the positive activations in every unit (`_Tally`)",
        unit="tally",
        semantics=(
            "one device counts every row; data shards count different rows, and an "
            "integer cannot be averaged: a step with a data axis raises, naming the leaf "
            "(docs/parallel.md: integer state that differs per shard is reported)"
        ),
    ),
    Feature(
        "rng_counters",
        "one shared `Rng` drawn in `first_fn` (input noise) and in `last_fn` (loss scale)",
        shared_rng=True,
        semantics=(
            "the shared counter advances twice per microbatch, in the one-device order "
            "(first_fn, then last_fn, microbatch by microbatch): no two draws share a key; "
            "with a data axis the seed is folded per shard"
        ),
    ),
    Feature(
        "weighted_loss",
        "masked mean `sum(err * mask) / sum(mask)` over a padded batch, `aux['weight'] = "
        "sum(mask)`, twice the microbatches: all-padding ones (loss and gradients NaN) "
        "wherever they hold 4 rows or fewer",
        weighted=True,
        guard=False,
        micro=2,
        semantics=(
            "the global masked mean over all real rows, whatever the split: parts weighted "
            "by their weight, a weight-0 part contributes 0 to loss and gradients even when "
            "they are NaN"
        ),
    ),
    Feature(
        "bf16",
        "bf16 compute (`dtype=bfloat16` layers, a bf16 policy) over float32 params, but "
        "each unit's row-parallel `Linear` stores its params in bf16 (a mixed tree)",
        dtype=jnp.bfloat16,
        row_dtype=jnp.bfloat16,
        semantics=(
            "the one-device bf16 model's loss and gradients to bf16 tolerance; each "
            "gradient comes back in its param's dtype (bf16 ones reduced in float32 inside: "
            "`reduce_dtype`), the state float32"
        ),
    ),
    Feature(
        "accumulation",
        "twice the microbatches, a unit with a call count and a running mean",
        unit="counter",
        micro=2,
        semantics=(
            "loss and gradients are the mean over all microbatches; the count advances "
            "once per microbatch and the running mean is threaded through a shard's "
            "microbatches in order, then averaged over the shards"
        ),
    ),
)


@dataclass(frozen=True)
class PathSpec:
    """A column: how one step is run.

    Attributes:
      name: the column id.
      title: the API (docs).
      mesh: ``((axis, size), ...)``; empty: one device.
      k: microbatches per data shard (a pipeline's ``m``), before `Feature.micro`.
      schedule: the pipeline schedule (``None``: a train step that takes one `Params`).
      v: virtual stages of an interleaved pipeline.
      fsdp: weights sharded over ``'data'`` (`fsdp_specs`).
      tp: the units' weights sharded over ``'model'``.
      remat: a pipeline recomputes each stage's forward in its backward.
      gather: FSDP's ``gather`` (``'per_layer'`` or ``'per_step'``).
      semantics: what the path does to the microbatches and the seeds (docs).
    """

    name: str
    title: str
    mesh: tuple = ()
    k: int = 1
    schedule: str | None = None
    v: int = 1
    fsdp: bool = False
    tp: bool = False
    remat: bool = False
    gather: str = "per_layer"
    semantics: str = ""

    @property
    def data(self) -> int:
        """The data shards: the batch is split over ``'data'`` (or ``'expert'``)."""
        return dict(self.mesh).get("data", dict(self.mesh).get("expert", 1))

    @property
    def units(self) -> int:
        return dict(self.mesh).get("stage", 1) * self.v if self.schedule else 2

    @property
    def folds(self) -> bool:
        """The path folds the shard index into the `Rng` seeds (the batch is split)."""
        return "data" in dict(self.mesh) or "expert" in dict(self.mesh)


_PIPE = "pipeline_value_and_grad, 2 stages"
PATHS = (
    PathSpec("one_device", "make_train_step", semantics="the reference itself: whole batch"),
    PathSpec(
        "accumulation",
        "make_train_step(accumulation_steps=2)",
        k=2,
        semantics="2 microbatches in order",
    ),
    PathSpec(
        "dp",
        "make_dp_train_step, data=2",
        (("data", 2),),
        semantics="2 shards, seeds folded by shard",
    ),
    PathSpec(
        "fsdp",
        "make_fsdp_train_step, data=2, fsdp_call per layer",
        (("data", 2),),
        fsdp=True,
        semantics="2 shards, seeds folded by shard",
    ),
    PathSpec(
        "tp",
        "make_dp_train_step(param_specs=TP), data=1 x model=2",
        (("data", 1), ("model", 2)),
        tp=True,
        semantics="1 shard, seeds folded by index 0",
    ),
    PathSpec("gpipe", f"{_PIPE}, gpipe", (("stage", 2),), 2, "gpipe", semantics="m=2"),
    PathSpec("1f1b", f"{_PIPE}, 1f1b", (("stage", 2),), 2, "1f1b", semantics="m=2"),
    PathSpec("1f1b-2f", f"{_PIPE}, 1f1b-2f", (("stage", 2),), 2, "1f1b-2f", semantics="m=2"),
    PathSpec(
        "interleaved",
        f"{_PIPE} x 2 chunks, interleaved",
        (("stage", 2),),
        2,
        "interleaved",
        v=2,
        semantics="m=2, 4 units",
    ),
    PathSpec("zb", f"{_PIPE}, zb-h1", (("stage", 2),), 2, "zb", semantics="m=2"),
    PathSpec(
        "zbv",
        f"{_PIPE} x 2 chunks in a V, zb-v",
        (("stage", 2),),
        2,
        "zbv",
        v=2,
        semantics="m=2, 4 units, stacked in the V's order",
    ),
    PathSpec(
        "dp_pp",
        f"{_PIPE}, 1f1b, data_axis, data=2",
        (("data", 2), ("stage", 2)),
        2,
        "1f1b",
        semantics="2 shards x m=2, seeds folded by shard",
    ),
    PathSpec(
        "fsdp_pp",
        f"{_PIPE}, 1f1b, FSDP stage_specs, data=2",
        (("data", 2), ("stage", 2)),
        2,
        "1f1b",
        fsdp=True,
        semantics="2 shards x m=2, seeds folded by shard",
    ),
    PathSpec(
        "dp_tp_pp",
        f"{_PIPE}, 1f1b, TP stage_specs, data=2 x model=2",
        (("data", 2), ("stage", 2), ("model", 2)),
        2,
        "1f1b",
        tp=True,
        semantics="2 shards x m=2, seeds folded by shard (not by model)",
    ),
    PathSpec(
        "ep",
        "ep_value_and_grad in a shard_map, expert=2 (a model without experts)",
        (("expert", 2),),
        semantics="2 shards over the expert axis, as DP",
    ),
)


class Cell(NamedTuple):
    """One cell: a feature on a path, and the error it must raise if it cannot compose
    (``(exception type, message regex, why)``; None: it composes)."""

    feature: Feature
    path: PathSpec
    error: tuple | None = None


_UNLISTED = (
    ValueError,
    r"the Rng '[^']+' drew keys inside the step .* not in rngs=",
    "an Rng that draws on a data axis but is not in `rngs=` would draw the same masks on "
    "every shard",
)

_INT_STATE = (
    ValueError,
    r"non-trainable parameter '(s0|stage)/tally/count' \(int32\) differs between the shards",
    "an integer that differs between the data shards cannot be averaged back into one "
    "replicated value",
)

_UNBOUND = (
    ValueError,
    r"BatchNorm '(s0|stage)/bn': axis_name='data' is not bound here",
    "without a data axis there is nothing to average the statistics over (build the "
    "layer with `axis_name=None` there)",
)

_UNBOUND_RMS = (
    ValueError,
    r"RunningMeanStd '(s0|stage)/rms': axis_name='data' is not bound here",
    "without a data axis there is no batch of the shards to merge (build the layer with "
    "`axis_name=None` there)",
)

# Cells that cannot compose, with the error they raise and why.
ERRORS: dict[tuple[str, str], tuple] = {
    **{("unlisted_rng", p.name): _UNLISTED for p in PATHS if p.folds},
    **{("batchnorm_sync", p.name): _UNBOUND for p in PATHS if "data" not in dict(p.mesh)},
    **{("running_stats", p.name): _UNBOUND_RMS for p in PATHS if "data" not in dict(p.mesh)},
    **{("int_state", p.name): _INT_STATE for p in PATHS if p.folds},
}

# Cells that fail on today's tree: a defect whose fix has not landed.
# They are not run (not skipped: absent) until the fix lands; the doc lists them.
PENDING: dict[tuple[str, str], str] = {}
# What each pending label stands for (the observed and the expected numbers).
DEFECTS: dict[str, str] = {}

CELLS = [
    Cell(f, p, ERRORS.get((f.name, p.name)))
    for f in FEATURES
    for p in PATHS
    if (f.name, p.name) not in PENDING
]


def semantics(cell: Cell) -> str:
    """The cell's semantics, in words: what its reference computes (the docs print it
    short, `_short`; a failing cell prints it whole)."""
    f, p = cell.feature, cell.path
    if cell.error is not None:
        return f"raises {cell.error[0].__name__}, because {cell.error[2]}"
    split = f"{p.data} data shard(s) x {p.k * f.micro} microbatch(es) in order"
    if p.schedule:
        split += f", {p.units} units on {dict(p.mesh)['stage']} stages"
    seeds = "every Rng seed folded by the shard index" if p.folds else "the seeds as stored"
    stats = ", statistics over microbatch j of every shard" if f.sync_bn else ""
    return f"equals one device run over {split}, {seeds}{stats}; {f.semantics}"


# -- the model -----------------------------------------------------------------------------


class Model(NamedTuple):
    first_fn: Any  # (params, x) -> (h, params)
    stage_fn: Any  # (params, h) -> (h, params): a unit under 'stage/'
    last_fn: Any  # (params, h, targets) -> ((loss, aux), params)
    loss_fn: Any  # (params, x, targets) -> ((loss, aux), params) over the flat params
    units: list  # the flat model's units, s0/ .. s{n-1}/
    rngs: list  # every Rng of the flat model
    stage_rng: Any
    shared_rng: Any


class _Counter(bx.Module):
    """Non-trainable state threaded through the microbatches: a call count and a
    running mean of the input."""

    def __call__(self, params, h):
        n, params = self.get_param(
            params, "calls", (), jax.nn.initializers.zeros, dtype=jnp.int32, trainable=False
        )
        mu, params = self.get_param(
            params, "mean", (h.shape[-1],), jax.nn.initializers.zeros, trainable=False
        )
        params = self.set_param(params, "calls", n + 1)
        mean = jnp.mean(h.astype(jnp.float32), axis=0)
        return h, self.set_param(params, "mean", 0.9 * mu + 0.1 * mean)


class _Tally(bx.Module):
    """Integer state that depends on the data: counts the positive activations seen."""

    def __call__(self, params, h):
        n, params = self.get_param(
            params, "count", (), jax.nn.initializers.zeros, dtype=jnp.int32, trainable=False
        )
        return h, self.set_param(params, "count", n + jnp.sum(h > 0).astype(jnp.int32))


def _unit(root: str, feature: Feature, tp: str | None):
    """One unit at Graph(root): ``h + tanh(row(tanh(col(h))))`` then the feature's layer;
    `tp`: the model axis the column/row layers split over (None: unsharded)."""
    g = bx.Graph(root)
    rng = bx.Rng(g / "rng")
    col = bp.ColumnParallelLinear(g / "col", HIDDEN, rng, axis=tp, dtype=feature.dtype)
    row = bp.RowParallelLinear(
        g / "row", WIDTH, rng, axis=tp, dtype=feature.dtype, param_dtype=feature.row_dtype
    )
    layer = {
        "dropout": lambda: bx.Dropout(g / "drop", 0.5, rng),
        "batchnorm": lambda: bx.BatchNorm(g / "bn", axis_name="data" if feature.sync_bn else None),
        "runstats": lambda: bx.RunningMeanStd(
            g / "rms", clip=5.0, axis_name="data" if feature.sync_bn else None
        ),
        "counter": lambda: _Counter(g / "count"),
        "tally": lambda: _Tally(g / "tally"),
        "": lambda: None,
    }[feature.unit]()

    def unit(params, h):
        z, params = bp.fsdp_call(col, params, h)
        z, params = bp.fsdp_call(row, params, jnp.tanh(z))
        if layer is not None:
            z, params = layer(params, z)
        return h + jnp.tanh(z).astype(h.dtype), params

    return unit, rng


def model(feature: Feature, n_units: int, tp: str | None = None) -> Model:
    """The row's model; `tp`: the model axis of a tensor-parallel path (the layers raise
    inside a shard_map whose mesh lacks their axis), None elsewhere (same params)."""
    return _model(feature.model_key, n_units, tp)


@functools.cache
def _model(feature: Feature, n_units: int, tp: str | None) -> Model:
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    embed = bx.Linear(g / "embed", WIDTH, rng, dtype=feature.dtype)
    head = bx.Linear(g / "head", OUT, rng, dtype=feature.dtype)

    def first_fn(params, x):
        h, params = bp.fsdp_call(embed, params, x)
        if feature.shared_rng:
            key, params = rng(params)
            h = h + (0.1 * jax.random.normal(key, h.shape)).astype(h.dtype)
        return h, params

    def last_fn(params, h, targets):
        out, params = bp.fsdp_call(head, params, h)
        err = jnp.sum((out.astype(jnp.float32) - targets["y"]) ** 2, axis=-1)
        if feature.weighted:
            mask = targets["mask"]
            n = jnp.sum(mask.astype(jnp.int32))
            count = jnp.maximum(n, 1) if feature.guard else n
            loss = jnp.sum(jnp.where(mask, err, 0.0)) / count.astype(jnp.float32)
            aux = {"weight": n}
        else:
            loss, aux = jnp.mean(err), {}
        if feature.shared_rng:
            key, params = rng(params)
            loss = loss * (1.0 + 0.5 * jax.random.uniform(key))
        return (loss, aux), params

    stage_fn, stage_rng = _unit("stage", feature, tp)
    flat = [_unit(f"s{i}", feature, tp) for i in range(n_units)]
    units = [u for u, _ in flat]

    def loss_fn(params, x, targets):
        h, params = first_fn(params, x)
        for u in units:
            h, params = u(params, h)
        return last_fn(params, h, targets)

    return Model(
        first_fn, stage_fn, last_fn, loss_fn, units, [rng] + [r for _, r in flat], stage_rng, rng
    )


def _data():
    r = np.random.default_rng(0)
    x = r.normal(size=(B, D_IN)).astype(np.float32)
    y = r.normal(size=(B, OUT)).astype(np.float32)
    # Rows 4 to 7 are padding: an all-padding microbatch wherever the microbatches hold 4
    # rows or fewer (the weighted row's DP, FSDP and pipeline paths), uneven weights
    # everywhere.
    mask = np.array([1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 1, 0, 1], bool)
    return x, {"y": y, "mask": mask}


def init(feature: Feature, n_units: int):
    # the values of the model without cross-shard statistics (one device binds no axis)
    return _init(replace(feature.model_key, sync_bn=False, guard=True), n_units)


@functools.cache
def _init(feature: Feature, n_units: int):
    """``(shared, stages)`` in the pipeline layout (host NumPy leaves) and the same
    values as one flat `Params` (``net/``, ``s0/``, ...)."""
    m = model(feature, n_units)
    x, t = _data()

    def make():
        shared = m.shared_rng.seed(bx.Params(), seed=0)
        h, shared = m.first_fn(shared, jnp.asarray(x[:2]))
        _, shared = m.last_fn(shared, h, jax.tree.map(lambda a: jnp.asarray(a[:2]), t))
        stages = []
        for s in range(n_units):
            p = m.stage_rng.seed(bx.Params(), seed=10 + s)
            stages.append(m.stage_fn(p, h)[1].locked())
        return shared.locked(), stages

    shared, stages = jax.tree.map(np.asarray, jax.jit(make)())
    return shared, stages, to_flat(shared, stages)


def to_flat(shared: bx.Params, stages: list) -> bx.Params:
    tree = dict(bx.to_dict(shared, with_info=True))
    for s, st in enumerate(stages):
        tree[f"s{s}"] = bx.to_dict(st, with_info=True)["stage"]
    return bx.from_dict(tree).locked()


def from_flat(flat: bx.Params, n_units: int) -> tuple[bx.Params, list]:
    tree = bx.to_dict(flat, with_info=True)
    shared = bx.from_dict({"net": tree["net"]})
    stages = [bx.from_dict({"stage": tree[f"s{s}"]}) for s in range(n_units)]
    return shared, stages


# -- the reference -------------------------------------------------------------------------


def _rows(tree, lo, hi):
    return jax.tree.map(lambda a: a[lo:hi], tree)


def reference(feature: Feature, n_units: int, data: int, k: int, folds: bool):
    """The cell's expected ``(loss, grads, state)``; see `_reference`. Statistics synced
    over the data axis are those of the global microbatches: one shard whose microbatch
    ``j`` is microbatch ``j`` of every shard, in shard order. The reference's masked mean
    divides by ``max(count, 1)`` (equal on every part of nonzero weight)."""
    key = replace(feature.model_key, guard=True)
    if not feature.sync_bn:
        return _reference(key, n_units, data, k, folds, None)
    r = B // (data * k)
    order = tuple(d * k * r + j * r + i for j in range(k) for d in range(data) for i in range(r))
    return _reference(replace(key, sync_bn=False), n_units, 1, k, False, order)


@functools.cache
def _reference(feature: Feature, n_units: int, data: int, k: int, folds: bool, order: tuple | None):
    """On one device, from the semantics: the batch (its rows in `order`) cut into
    `data` shards of `k` microbatches; per shard the seeds folded by its index (`folds`)
    and the state threaded through its microbatches in order; the loss the mean of the
    parts (weighted by ``aux['weight']``, a weight-0 part contributing 0); floating state
    averaged over the shards, integer state equal on all shards (checked)."""
    m = model(feature, n_units)
    _, _, flat = init(feature, n_units)
    x, t = _data()
    if order is not None:
        x, t = jax.tree.map(lambda a: a[np.asarray(order)], (x, t))
    rows = B // (data * k)

    def total(trainable, state):
        parts, finals = [], []
        for d in range(data):
            st = state
            seeds = []
            if folds:
                p = trainable.merge(st)
                for r in m.rngs:
                    seeds.append(r.get_seed(p))
                    p = r.seed(p, seed=jax.random.fold_in(r.get_seed(p), d))
                st = p.split()[1]
            for j in range(k):
                lo = (d * k + j) * rows
                (loss, aux), p = m.loss_fn(
                    trainable.merge(st), jnp.asarray(x[lo : lo + rows]), _rows(t, lo, lo + rows)
                )
                st = p.split()[1]
                w = aux.get("weight")
                parts.append((loss, None if w is None else w.astype(jnp.float32)))
            p = trainable.merge(st)
            for r, s in zip(m.rngs, seeds, strict=False):
                p = r.seed(p, seed=s)
            finals.append(p.split()[1])
        if feature.weighted:
            num = sum(jnp.where(w > 0, loss * w, 0.0) for loss, w in parts)
            den = sum(w for _, w in parts)
            loss = num / den
        else:
            loss = sum(loss for loss, _ in parts) / len(parts)
        leaves = [jax.tree.leaves(f) for f in finals]
        mean = []
        for vals in zip(*leaves, strict=True):
            if jnp.issubdtype(vals[0].dtype, jnp.floating):
                mean.append(sum(vals) / len(vals))
            else:
                mean.append(jnp.stack(vals))  # every shard's, checked equal below
        return loss, jax.tree.unflatten(jax.tree.structure(finals[0]), mean)

    trainable, state = flat.split()
    with jax.default_matmul_precision("highest"):
        (loss, st), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(trainable, state)
    for key, v in st.arrays().items():
        if not jnp.issubdtype(v.dtype, jnp.floating):
            v = np.asarray(v)
            assert (v == v[0]).all(), (key, v)  # integer state equal on every shard
    st = jax.tree.map(lambda v: v if jnp.issubdtype(v.dtype, jnp.floating) else v[0], st)
    return loss, grads, st


# -- the paths -----------------------------------------------------------------------------


def _mesh(path: PathSpec):
    names = tuple(a for a, _ in path.mesh)
    shape = tuple(n for _, n in path.mesh)
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _tp_rules():
    return [
        ("col/kernel", (None, "model")),
        ("col/bias", ("model",)),
        ("row/kernel", ("model", None)),
        (".*", None),
    ]


def _put(tree, specs, mesh):
    return jax.tree.map(
        lambda a, s: jax.device_put(a, NamedSharding(mesh, s)),
        tree,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )


def run(feature: Feature, path: PathSpec):
    """The path's ``(loss, grads, state)`` after one step: the gradients for a pipeline;
    for a train step (grads None), the params after one SGD step. Cached per model,
    microbatches and path (`rngs=` matters only where there is a data axis to fold)."""
    listed = feature.list_rngs or not path.folds
    return _run(replace(feature.model_key, micro=feature.micro, list_rngs=listed), path)


@functools.cache
def _run(feature: Feature, path: PathSpec):
    n = path.units
    m = model(feature, n, "model" if path.tp else None)
    shared, stages, flat = init(feature, n)
    x, t = _data()
    k = path.k * feature.micro
    tx = optax.sgd(LR)
    rngs = m.rngs if feature.list_rngs else []
    with jax.default_matmul_precision("highest"):
        if path.schedule is None:
            return _run_step(path, m, flat, x, t, k, tx, rngs)
        return _run_pipeline(path, m, shared, stages, x, t, k, rngs)


def _run_step(path, m, flat, x, t, k, tx, rngs):
    if "expert" in dict(path.mesh):
        return _run_ep(path, m, flat, x, t, k, rngs)
    if not path.mesh:
        step = jax.jit(bx.make_train_step(m.loss_fn, tx, has_aux=True, accumulation_steps=k))
        params = jax.device_put(flat)
        new, _, metrics = step(params, tx.init(params.split()[0]), x, t)
        return metrics["loss"], None, new
    mesh = _mesh(path)
    if path.fsdp:
        specs = bp.fsdp_specs(flat, mesh, min_size=16)
        step = bp.make_fsdp_train_step(
            m.loss_fn, tx, mesh, specs, microbatches=k, has_aux=True, rngs=rngs, gather=path.gather
        )
    else:
        rules = _tp_rules() if path.tp else [(".*", None)]
        specs = bp.param_specs(flat, rules, mesh)
        step = bp.make_dp_train_step(
            m.loss_fn, tx, mesh, microbatches=k, has_aux=True, param_specs=specs, rngs=rngs
        )
    params = _put(flat, specs, mesh)
    opt = jax.device_put(tx.init(flat.split()[0]), NamedSharding(mesh, P()))
    new, _, metrics = jax.jit(step)(params, opt, x, t)
    return metrics["loss"], None, new


def _run_ep(path, m, flat, x, t, k, rngs):
    """`ep_value_and_grad` (no train step exists for it) in its shard_map, then SGD."""
    mesh = _mesh(path)
    f = bp.ep_value_and_grad(
        m.loss_fn, expert_axis="expert", data_axes=None, has_aux=True, microbatches=k, rngs=rngs
    )
    rep, split = P(), P("expert")
    sm = jax.shard_map(f, mesh=mesh, in_specs=(rep, split, split), out_specs=((rep, rep), rep, rep))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    (loss, _), grads, new = jax.jit(sm)(put(flat, rep), put(x, split), put(t, split))
    trained = jax.tree.map(lambda a, g: a - LR * g, new.split()[0], grads)
    return loss, None, trained.merge(new.split()[1])


def _run_pipeline(path, m, shared, stages, x, t, k, rngs):
    mesh = _mesh(path)
    v = path.v
    one = stages[0]
    specs = None
    if path.tp:
        specs = bp.param_specs(one, _tp_rules(), mesh)
    if path.fsdp:
        specs = bp.fsdp_specs(one, mesh, min_size=16)
    step = bp.pipeline_value_and_grad(
        m.stage_fn,
        m.last_fn,
        mesh,
        schedule=path.schedule,
        num_microbatches=k,
        first_fn=m.first_fn,
        data_axis="data" if path.folds else None,
        stage_specs=specs,
        virtual_stages=v if v > 1 else None,
        has_aux=True,
        rngs=[m.stage_rng, m.shared_rng] if rngs else (),
        remat=path.remat,
    )
    # the units stacked in the schedule's order (model order but for ZB-V's V), and back
    order = list(range(len(stages)))
    if path.schedule == "zbv":
        order = list(bp.zero_bubble_v_schedule(2, k).stacking_order)
    stacked = bp.stack_stages([stages[i] for i in order], virtual_stages=v)
    (loss, _), (g, g_sh), (new_st, new_sh) = jax.jit(step)(stacked, shared, x, t)

    def in_model_order(tree):
        parts = bp.unstack_stages(tree, virtual_stages=v)
        return [parts[order.index(i)] for i in range(len(order))]

    grads = to_flat(g_sh, in_model_order(g))
    state = to_flat(new_sh.split()[1], [s.split()[1] for s in in_model_order(new_st)])
    return loss, grads, state


# -- the cells -----------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _shared_compiles():
    """The models, initial values, references and runs are cached across the cells of
    this module (one compile per model, reference and path) and dropped after it."""
    yield
    for cached in (_model, _init, _reference, _run):
        cached.cache_clear()


def _close(got, want, what, t, why):
    got, want = dict(got.arrays()), dict(want.arrays())
    assert got.keys() == want.keys(), (what, sorted(got.keys() ^ want.keys()), why)
    for key in want:
        a, b = np.asarray(got[key]), np.asarray(want[key])
        if jnp.issubdtype(b.dtype, jnp.floating):
            assert a.dtype == b.dtype, (what, key, a.dtype, b.dtype, why)
            np.testing.assert_allclose(
                a, b, **t, err_msg=f"{what} {'/'.join(key)} (path vs reference); {why}"
            )
        else:
            np.testing.assert_array_equal(a, b, err_msg=f"{what} {'/'.join(key)}; {why}")


@pytest.mark.parametrize("cell", CELLS, ids=[f"{c.feature.name}-{c.path.name}" for c in CELLS])
def test_cell(cell: Cell):
    f, p = cell.feature, cell.path
    if cell.error is not None:
        with pytest.raises(cell.error[0], match=cell.error[1]):
            run(f, p)
        return
    t = f.tol()
    ref_loss, ref_grads, ref_state = reference(f, p.units, p.data, p.k * f.micro, p.folds)
    loss, grads, state = run(f, p)
    why = f"{f.name} on {p.name}, which {semantics(cell)}"
    np.testing.assert_allclose(float(loss), float(ref_loss), **t, err_msg=f"loss; {why}")
    if grads is not None:  # a pipeline: gradients and state
        _close(grads, ref_grads, "gradient", t, why)
        _close(state, ref_state, "state", t, why)
    else:  # a train step: the params after one SGD step, and the state
        _, _, flat = init(f, p.units)
        tr = flat.split()[0]
        want = jax.tree.map(lambda a, g: a - LR * g, tr, ref_grads)
        _close(state.split()[0], want, "params after one SGD step", t, why)
        _close(state.split()[1], ref_state, "state", t, why)


# -- the docs ------------------------------------------------------------------------------


def _short(cell: Cell) -> str:
    """The cell as the matrix prints it."""
    f, p = cell.feature, cell.path
    if (f.name, p.name) in PENDING:
        return f"pending ({PENDING[f.name, p.name]})"
    if cell.error is not None:
        return f"raises `{cell.error[0].__name__}`"
    return (
        f"= {p.data}x{p.k * f.micro}"
        + (" f" if p.folds and f.list_rngs else "")
        + (" s" if f.sync_bn else "")
    )


_INTRO = """\
# The composition matrix: every stateful feature on every path

Each path of blox (one device, accumulation, DP, FSDP, TP, every pipeline schedule and
their products, expert parallelism) holds in its own tests. This page is the matrix of
their seams: every *stateful feature* of a model (rows) trained on every *path*
(columns). A cell runs one step of the path and compares its loss, its gradients (or the
params after one SGD step of rate 1) and its non-trainable state (RNG counters and
seeds, BatchNorm statistics, call counts) with a reference computed on one device from
the cell's semantics, in plain `jax.value_and_grad`. `tests/test_composition_matrix.py`
holds the table this page is generated from and fails when the two differ (`python -m
tests.test_composition_matrix > docs/composition.md` rewrites the page).

The model of each row: `first_fn` (an embedding `Linear`), 2 identical units (4 for the
interleaved and ZB-V schedules: 2 stages x 2 chunks) of a column-parallel and a row-parallel
`Linear` plus the row's layer, with a residual, and `last_fn` (a head `Linear` and the
loss). A unit is a pipeline stage; the paths that take one `Params` hold the units at
`s0/`, `s1/`, ... with the same values. The column- and row-parallel layers split over
`model` on the paths with a model axis and are built unsharded (`axis=None`, the same
parameters) on the others; every layer is called through `bp.fsdp_call` (a plain call
outside FSDP), so one model serves every path. The batch
has 16 rows. The `ep` column runs `ep_value_and_grad` (which has no train step) on this
model, which has no experts: it checks how expert parallelism carries the state of the
rest of a model, its batch split over the expert axis as DP splits it. Context
parallelism splits a sequence axis, which this model of rows does not have: its steps
(DP and FSDP over `('data', 'context')`, dropout per data and context shard) are
checked against one device in `tests/parallel/test_context_steps.py`, and inside
pipeline stages in `tests/parallel/test_context_pipeline.py`.
"""

_SAME = """\
## Reading a cell

`= D x k` means: equal to the one-device reference that cuts the batch into `D` data
shards of `k` microbatches each (contiguous rows, shard-major), runs every shard's
microbatches in order on one device with the non-trainable state threaded through them,
and then takes

* the loss and the gradients: the mean over all `D k` parts (weighted by
  `aux['weight']` when the loss reports one; a part of weight 0 contributes 0);
* floating state (BatchNorm statistics, running means): the mean over the shards of
  each shard's final state; integer state (RNG counters, call counts): each shard's
  final state, which must be equal on all shards;
* `s`: the statistics of microbatch `j` taken over microbatch `j` of every shard
  together (`axis_name='data'`): the reference is one shard of the global microbatches;
* `f`: every `Rng` seed folded by the shard's index (`jax.random.fold_in(seed, d)`) for
  the shard's forward passes and restored after; without `f`, the seeds as stored.

`raises E`: the cell cannot compose, and the step raises `E` with a message that names
the cause and the fix. `pending (...)`: the cell fails on today's tree, a defect whose
fix has not landed; the test leaves it out until it does (the reason is in the test's
`PENDING`).

Tolerances: float32 cells to `rtol=1e-5, atol=1e-6`, bf16 cells to `rtol=atol=2e-2`
(`tests/tolerances.py`).
"""

_DIFFER = """\
## Where paths differ on purpose

* **Dropout and every other draw on a data axis** (DP, FSDP, TP, DP x PP, FSDP x PP,
  DP x TP x PP, and EP, whose batch is split over the expert axis): the step folds the
  data-shard index into the seed of every `Rng` in `rngs=`, so the shards draw
  different masks; one device (and a pipeline without a data axis) draws from the
  stored seed. The reference runs each shard on one device
  with `fold_in(seed, d)`. The model axis is never folded: tensor-parallel shards hold
  parts of the same rows and drop the same activations. A data axis of size 1 (the TP
  column) still folds index 0, so it differs from one device too.
* **BatchNorm without `axis_name`** normalizes each shard (and each microbatch) with
  its own statistics, so its loss and gradients are those of the per-shard runs, and
  its running statistics are the mean over the shards of each shard's one-device
  statistics. `BatchNorm(axis_name='data')` averages the statistics over the shards
  instead ([parallel.md](parallel.md)): its cells equal one device run over the global
  microbatches, and where no `data` axis is bound (one device, a pipeline without a
  data axis) the layer raises.
* **Integer state that depends on the data** (a count of what a shard saw) differs
  between the shards and cannot be averaged: the steps with a data axis raise, naming
  the leaf. Integer state that advances the same on every shard (RNG counters, call
  counts) comes back as on one device.
* **Accumulation and pipeline microbatches** run the microbatches of a shard in order:
  BatchNorm sees one microbatch at a time, counters advance once per microbatch, and
  the loss is the mean (or the weighted mean) of the microbatch losses.
* **An `Rng` left out of `rngs=`** on a data axis would draw the same masks on every
  shard: the steps raise, naming the `Rng` and `rngs=`.
* **A bf16 policy** is written here as the layers' `dtype=bfloat16`, the one form every
  path takes: `make_train_step(policy=Policy(...))` casts the trainable params and the
  batch inside the step, but the DP, FSDP and pipeline steps take no `policy=`; with
  them, cast in the loss function (`policy.cast_to_compute`) or give the layers a
  compute `dtype`.
* **A shared `Rng` drawn by `first_fn` and `last_fn`** of a pipeline (which run on
  different stages) advances its counter as one device does, both ends' draws counted
  and no key drawn twice ([pipeline.md](pipeline.md)).
"""


def render_doc() -> str:
    """docs/composition.md as the table says it."""
    out = [_INTRO, "## Rows: the stateful features", ""]
    out += ["| feature | the model | semantics on every path |", "|---|---|---|"]
    out += [f"| `{f.name}` | {f.title} | {f.semantics} |" for f in FEATURES]
    out += ["", "## Columns: the paths", ""]
    out += ["| path | the step | data shards x microbatches, seeds |", "|---|---|---|"]
    out += [f"| `{p.name}` | `{p.title}` | {p.semantics} |" for p in PATHS]
    out += ["", "## The matrix", ""]
    out += ["| feature | " + " | ".join(f"`{p.name}`" for p in PATHS) + " |"]
    out += ["|---" * (len(PATHS) + 1) + "|"]
    every = [Cell(f, p, ERRORS.get((f.name, p.name))) for f in FEATURES for p in PATHS]
    for f in FEATURES:
        row = [_short(c) for c in every if c.feature is f]
        out += [f"| `{f.name}` | " + " | ".join(row) + " |"]
    errors: dict[tuple, list] = {}
    for c in every:
        if c.error is not None:
            errors.setdefault((c.feature.name, *c.error[:1], c.error[2]), []).append(c.path.name)
    if errors:
        out += ["", "Cells that cannot compose raise, and say why:", ""]
        out += [
            f"* `{name}` on {', '.join(f'`{p}`' for p in paths)}: `{exc.__name__}`, because {why}."
            for (name, exc, why), paths in errors.items()
        ]
    if PENDING:
        out += ["", "Pending cells:", ""]
        out += [
            f"* {', '.join(f'`{f}` on `{p}`' for (f, p), v in PENDING.items() if v == label)}"
            f": {DEFECTS[label]}."
            for label in dict.fromkeys(PENDING.values())
        ]
    out += ["", _SAME, _DIFFER]
    return "\n".join(out).rstrip() + "\n"


def test_doc_matches_the_table():
    """docs/composition.md is the table: a cell changed here and not there fails."""
    assert DOC.read_text() == render_doc(), (
        "docs/composition.md differs from the table in tests/test_composition_matrix.py; "
        "rewrite it: python -m tests.test_composition_matrix > docs/composition.md"
    )


if __name__ == "__main__":
    print(render_doc(), end="")
