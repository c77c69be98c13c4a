"""Pipeline parallelism: p devices over a mesh axis, m microbatches, run slot by slot
after a static `Schedule` table (GPipe, 1F1B, interleaved 1F1B, ZB-H1 or yours) with
``jax.shard_map`` + ``lax.ppermute``.

The runtime, top to bottom:

* `pipeline_value_and_grad` resolves the schedule and returns ``step``, a
  ``jax.shard_map`` (``check_vma=True``) of `_pipeline_body` over the whole mesh.
* `_pipeline_body` (one device) runs named steps. `_local`: its share of the arguments,
  typed as varying over the stage and data axes, the data index folded into the listed
  `Rng` seeds. `_probe`: checks the three functions once at trace time (`_check_fns`: no
  new parameter, every drawing `Rng` listed; `_check_int_state`; `_shared_plan`: how the
  shared state that ``first_fn`` and ``last_fn`` change is merged) and probes the stage's
  VJP once (`_residual_layout`): which residuals depend on the activation or the stage's
  state (stashed per microbatch) and which only on the params. `_context`: what every
  slot sees (`_Ctx`: the program, the residuals of the params, computed once per step and
  per chunk, and the traced backward `_SplitBackward` where it runs). `_buffers`: stash,
  forward inbox, backward inbox and the ``kept`` cotangents a split backward passes from
  B to W (`_Buffers`), sized by `Schedule.program`. Then one ``lax.scan`` of `_slot` over
  the table's time slots accumulates gradients and the loss terms (``loss / (m D)``, or
  ``loss * weight``) in the reduction dtype, and `_reduce` sums them (``psum`` over the
  stage axis and the data axis; stage leaves sharded over the data axis (FSDP) arrive
  reduce-scattered by ``fsdp_call``), divides by the total weight and casts back to the
  params' dtypes.
* `_slot` (one time slot) runs this device's cell of the program, one action after the
  other (`_lane`; a cell may hold several, e.g. two forwards under ``'1f1b-2f'``): each
  reads the entries the program names (``dynamic_slice``: inbox, stash, kept cotangent,
  its microbatch, its chunk's params, residuals and state), runs `_forward_cell`,
  `_backward_cell`, `_weight_cell` or `_idle_cell` (a ``lax.switch`` whose operands are
  all of one microbatch's or one chunk's size) and writes its entries back at the top
  level (``dynamic_update_slice``); the cells that compute a gradient add it to the
  chunk's accumulator (forward and idle cells do no gradient arithmetic). Then the slot
  moves each action's activation to the next virtual stage and its cotangent to the
  previous one: only the transfers the static program makes in that slot (`_Sends`: the
  slot's sends grouped into partial permutations, one ``ppermute`` each, in a
  ``lax.switch`` over the slot's pattern; under 1F1B one per slot, none where no device
  sends), the slot's only synchronisation (circular with virtual stages). The receiver's
  inbox entry comes from the program, so only the activation travels. No buffer whose
  size grows with ``m`` is an operand of a conditional, so a slot costs the same at any
  ``m``.

What is stashed between a microbatch's forward and its backward: the stage's VJP
residuals that depend on its input activation or its non-trainable state (with
``remat=True``: only the stage input and what `remat_policy` saves) and the shared state
``first_fn`` saw. Not stashed: residuals of the params alone (casts for mixed precision,
transposes), computed once per step; ``last_fn``, which the last stage differentiates in
its forward slot (it keeps only the cotangent of its output); ``first_fn``, which stage 0
recomputes in its backward slot. A split backward (tables with ``W`` actions;
`_SplitBackward`): the stage's backward is traced once as a jaxpr and cut in two. ``B``
runs the equations the input cotangent needs and keeps what the rest reads of its values
(the cotangents where the weights are used: ``dy`` of each ``y = x @ w``); ``W`` runs the
rest (the weight-gradient products) from those and the stashed inputs, deriving no
cotangent again: a stage of ``n`` chained products runs ``n`` of them in ``B`` and ``n``
in ``W``, the whole backward's ``2 n``. ``B`` writes what it keeps over the stash
arrays of its type that ``W`` does not read (the stash entry lives until the ``W``), and
only what finds no such array goes to a separate buffer, so the split costs about 1F1B's
memory. Where ``B`` would keep a weight gradient itself (an equation feeding both
halves, e.g. a ``lax.scan`` over the stage's layers), ``W`` instead re-runs the weight
half from the cotangent ``B`` received, as a fused backward costs. On a CPU mesh the
tables without ``W`` run the whole backward through the same equations too, so that
every product runs on row-major operands (`_product`: XLA:CPU runs ``x^T dy`` outside
its fast matmul kernel, at 2.3 times the time).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import Literal
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from blox.core import Params, Rng
from blox.core._guards import (
    check_no_new_params,
    check_reduce_dtype,
    check_rngs_listed,
    reduce_dtype_of,
)
from blox.core._params import Path, format_path
from blox.parallel._dp import (
    WEIGHT_KEY,
    _aux_finish,
    _aux_terms,
    _axis_names,
    _check_batch_rows,
    _check_global_batch,
    _check_rngs,
    _weight,
)
from blox.parallel._fsdp import _sharded_dims, _with_marks, _without_marks
from blox.parallel._mesh import constrain, varying_axes
from blox.parallel._rng import fold_seeds, restore_seeds
from blox.parallel._schedules import BACKWARD, FORWARD, IDLE, WEIGHT, Schedule, schedule_from

__all__ = ["pipeline_value_and_grad", "stack_stages", "unstack_stages"]

_BAD_RETURN = (
    "{where} must return (outputs, params), the params being those the module returned; "
    "got {got}. Write it as:\n    def {name}(params, {args}):\n"
    "        out, params = block(params, ...)\n        return out, params"
)


def _check_virtual(fn: str, virtual_stages: Any) -> int:
    if (
        not isinstance(virtual_stages, (int, np.integer))
        or isinstance(virtual_stages, bool)
        or virtual_stages < 1
    ):
        raise ValueError(
            f"{fn}: virtual_stages must be an int >= 1 (the stage chunks per device), got "
            f"{virtual_stages!r}."
        )
    return int(virtual_stages)


def stack_stages(stages: list[Params], *, virtual_stages: int = 1) -> Params:
    """Stacks ``p`` per-stage `Params` of the same structure into one whose every leaf has
    a leading stage dimension ``p`` (to shard over the pipeline axis with
    ``PartitionSpec(axis)``); with ``virtual_stages=v``, ``v p`` stages into leaves with
    leading dimensions ``(v, p)`` (``PartitionSpec(None, axis)``: device ``s`` holds the
    model's stages ``s, p + s, ..., (v - 1) p + s``, the chunks of an interleaved schedule).

    Args:
      stages: ``p`` (or ``v p``) Params with identical paths, shapes and dtypes, in model
        order (e.g. one transformer block initialized ``p`` times with different seeds).
      virtual_stages: ``v >= 1``, the stage chunks per device.

    Returns:
      Params with leaves ``(p, *shape)``; with ``v > 1``, ``(v, p, *shape)`` whose
      ``[c, s]`` is model stage ``c p + s``.

    Raises:
      ValueError: the list is empty, its length is not a multiple of ``v``, or the
        structures differ (names the path).

    Example:
      >>> import jax.numpy as jnp, blox as bx
      >>> from blox.parallel import stack_stages
      >>> g = bx.Graph('s'); rng = bx.Rng(g / 'rng'); lin = bx.Linear(g / 'fc', 2, rng)
      >>> def init(seed):
      ...     return lin(rng.seed(bx.Params(), seed=seed), jnp.zeros((1, 2)))[1]
      >>> stacked = stack_stages([init(k) for k in range(8)], virtual_stages=2)
      >>> stacked['s', 'fc', 'kernel'].value.shape
      (2, 4, 2, 2)
    """
    v = _check_virtual("stack_stages", virtual_stages)
    if not stages:
        raise ValueError("stack_stages: got no stages; pass a list of p >= 1 Params.")
    if len(stages) % v:
        raise ValueError(
            f"stack_stages: got {len(stages)} stages, not a multiple of virtual_stages={v}; "
            f"pass v * p stages (p devices on the stage axis), in model order."
        )
    ref = jax.tree_util.tree_structure(stages[0])
    for k, st in enumerate(stages[1:], 1):
        if jax.tree_util.tree_structure(st) != ref:
            a = {format_path(p) for p in stages[0].keys()}
            b = {format_path(p) for p in st.keys()}
            diff = sorted(a ^ b) or ["(same paths; trainable flags or lock differ)"]
            raise ValueError(
                f"stack_stages: stage {k} has a different structure from stage 0 at "
                f"{diff[:3]}; every stage must be the same module."
            )
        for path in st.keys():
            if jnp.shape(st[path].value) != jnp.shape(stages[0][path].value):
                raise ValueError(
                    f"stack_stages: '{format_path(path)}' has shape "
                    f"{jnp.shape(st[path].value)} in stage {k} but "
                    f"{jnp.shape(stages[0][path].value)} in stage 0."
                )
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *stages)
    if v == 1:
        return stacked
    return jax.tree.map(lambda x: jnp.reshape(x, (v, x.shape[0] // v, *x.shape[1:])), stacked)


def unstack_stages(stacked: Params, *, virtual_stages: int = 1) -> list[Params]:
    """The inverse of `stack_stages`: ``p`` Params, one per stage (``v p`` in model order
    with ``virtual_stages=v``).

    Concrete arrays are split on their devices by one jitted indexing (no transfer to the
    host), so stage-sharded arrays of any mesh split, also when the mesh spans several
    processes (every process calls it, as any computation on a global array); each
    returned leaf is then replicated over the input's mesh, so every process can read it
    (``np.asarray``). Traced arrays are indexed in place.

    Args:
      stacked: Params whose leaves have a leading stage dimension ``p`` (``(v, p)`` with
        virtual stages), as `stack_stages` or `pipeline_value_and_grad` return them.
      virtual_stages: ``v >= 1``, the stage chunks per device.

    Returns:
      ``p`` (``v p``) Params with leaves ``shape[1:]`` (``shape[2:]``); with ``v > 1``
      entry ``c p + s`` is ``stacked[c, s]``.

    Raises:
      ValueError: with ``v > 1``, a leaf whose leading dimension is not ``v``.

    Example:
      >>> import jax.numpy as jnp, blox as bx
      >>> from blox.parallel import stack_stages, unstack_stages
      >>> g = bx.Graph('s'); rng = bx.Rng(g / 'rng'); lin = bx.Linear(g / 'fc', 2, rng)
      >>> def init(seed):
      ...     return lin(rng.seed(bx.Params(), seed=seed), jnp.zeros((1, 2)))[1]
      >>> stages = unstack_stages(stack_stages([init(0), init(1)]))
      >>> len(stages), stages[1]['s', 'fc', 'kernel'].value.shape
      (2, (2, 2))
    """
    v = _check_virtual("unstack_stages", virtual_stages)
    leaves = jax.tree.leaves(stacked)
    if not leaves:
        return []
    if v > 1:
        for kp, x in jax.tree_util.tree_leaves_with_path(stacked):
            if jnp.ndim(x) < 2 or x.shape[0] != v:
                raise ValueError(
                    f"unstack_stages: leaf {jax.tree_util.keystr(kp)} has shape "
                    f"{jnp.shape(x)}, whose leading dimension should be virtual_stages={v} "
                    "(leaves (v, p, ...) from stack_stages(..., virtual_stages=v)); pass the "
                    "virtual_stages the params were stacked with."
                )
    p = leaves[0].shape[1 if v > 1 else 0]
    index = tuple((c, s) for c in range(v) for s in range(p)) if v > 1 else tuple(range(p))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        return _split_stages(stacked, index)
    meshes = {x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding)}
    if len(meshes) == 1 and all(isinstance(x.sharding, NamedSharding) for x in leaves):
        return _unstack_whole(stacked, index, meshes.pop())
    return _unstack_whole(stacked, index, None)


def _split_stages(tree: Any, index: tuple) -> list:
    return [jax.tree.map(lambda x, k=k: x[k], tree) for k in index]


def _unstack_replicated(tree: Any, index: tuple, mesh: Mesh | None) -> list:
    """`_split_stages`, each piece replicated over `mesh` (None: where XLA puts it)."""
    if mesh is not None:
        tree = jax.tree.map(lambda x: constrain(x, mesh, PartitionSpec()), tree)
    return _split_stages(tree, index)


# One jitted function (not a fresh one per call): compiled once per shapes, index and mesh.
_unstack_whole = jax.jit(_unstack_replicated, static_argnums=(1, 2))


def _check_out(out: Any, where: str, name: str, args: str) -> tuple[Any, Params]:
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Params)):
        raise TypeError(
            _BAD_RETURN.format(where=where, got=type(out).__name__, name=name, args=args)
        )
    return out


def _split_batch(tree: Any, m: int) -> Any:
    """``(b, ...)`` -> ``(m, b / m, ...)`` (divisibility checked by `_check_step_args`)."""
    return jax.tree.map(lambda x: jnp.reshape(x, (m, x.shape[0] // m, *x.shape[1:])), tree)


def _take(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, i, keepdims=False), tree)


def _put(tree: Any, i: jax.Array, values: Any, ok: jax.Array | None = None) -> Any:
    """Writes `values` at index `i` of every buffer (where `ok`, else keeps the entry)."""

    def one(b, v):
        v = v.astype(b.dtype)
        if ok is not None:
            v = jnp.where(ok, v, lax.dynamic_index_in_dim(b, i, keepdims=False))
        return lax.dynamic_update_index_in_dim(b, v, i, 0)

    return jax.tree.map(one, tree, values)


def _vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """Marks every leaf as varying over `axes` (``lax.pcast``) where it is not yet."""

    def one(x):
        missing = tuple(a for a in axes if a not in varying_axes(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


# -- the model's three functions -----------------------------------------------------------
class _Fns(NamedTuple):
    """The user's functions, return values checked: ``stage(params, h)``,
    ``first(params, x)`` (None: identity), ``last(params, h, y)`` (``has_aux``: it returns
    ``((loss, aux), params)``)."""

    stage: Callable[[Params, Any], tuple[Any, Params]]
    first: Callable[[Params, Any], tuple[Any, Params]] | None
    last: Callable[[Params, Any, Any], tuple[Any, Params]]
    has_aux: bool = False
    plain_stage: Callable[[Params, Any], tuple[Any, Params]] | None = None  # without remat


def _stage_vjp(fns: _Fns, tr: Params, st: Params, h: Any) -> tuple[Any, Any, Params]:
    """``(h_out, vjp_fn, new_state)`` of the stage, differentiable in ``(tr, h)``."""

    def f(tr, h):
        out, new = fns.stage(tr.merge(st), h)
        return out, new.split()[1]

    return jax.vjp(f, tr, h, has_aux=True)


def _first(fns: _Fns, tr_sh: Params, st_sh: Params, x: Any) -> tuple[Any, Params]:
    """``first_fn`` on stage 0: ``(h, new shared state)``."""
    if fns.first is None:
        return x, st_sh
    h, new = _check_out(fns.first(tr_sh.merge(st_sh), x), "first_fn", "first_fn", "x")
    return h, new.split()[1]


class _Terms(NamedTuple):
    """One microbatch's contributions to the step's sums (zeros where no loss is
    computed): the loss term (``loss / (m D)``, or ``loss * weight``), the aux leaves'
    terms (`blox.parallel` DP's convention) and the weight (None when `last_fn` gives
    none). Floating terms are in the reduction dtype."""

    loss: jax.Array
    aux: Any
    w: jax.Array | None


def _last_out(fns: _Fns, out: Any) -> tuple[jax.Array, Any, Params]:
    """``(loss, aux, params)`` from what ``last_fn`` returned, checked."""
    value, new = _check_out(out, "last_fn", "last_fn", "h, y")
    if fns.has_aux:
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(
                "pipeline_value_and_grad: with has_aux=True, last_fn returns ((loss, aux), "
                f"params); got a first element of type {type(value).__name__}."
            )
        loss, aux = value
    else:
        loss, aux = value, None
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(
            f"pipeline_value_and_grad: last_fn must return a floating scalar loss, got "
            f"{loss.dtype} of shape {loss.shape}; reduce it, e.g. jnp.mean(...)."
        )
    if isinstance(aux, dict) and WEIGHT_KEY in aux:
        w = jnp.asarray(aux[WEIGHT_KEY])
        if w.shape != () or not (
            jnp.issubdtype(w.dtype, jnp.floating) or jnp.issubdtype(w.dtype, jnp.integer)
        ):
            raise ValueError(
                "pipeline_value_and_grad: last_fn's aux['weight'] must be a number scalar "
                "(the real examples or tokens its loss averages over, e.g. jnp.sum(mask)), "
                f"got {w.dtype} of shape {tuple(w.shape)}."
            )
    return loss, aux, new


def _last_loss(
    fns: _Fns, tr_sh: Params, st_sh: Params, h: Any, y: Any, n: int, reduce: Any
) -> tuple[jax.Array, tuple[_Terms, Params]]:
    """``(objective, (terms, new shared state))`` of ``last_fn`` on one microbatch: the
    objective is what the backward differentiates, ``loss / n`` (``n = m D``) or, with a
    weight, ``loss * weight`` (0 where the weight is 0, even for a NaN loss)."""
    loss, aux, new = _last_out(fns, fns.last(tr_sh.merge(st_sh), h, y))
    acc = reduce_dtype_of(loss.dtype, reduce)
    w = _weight(aux, loss.astype(acc))  # the weight in the reduction dtype
    if w is None:
        obj = loss / jnp.asarray(n, loss.dtype)
    else:
        w = lax.stop_gradient(w)
        obj = jnp.where(w > 0, loss * w.astype(loss.dtype), jnp.zeros((), loss.dtype))
    terms = _Terms(lax.stop_gradient(obj).astype(acc), _aux_terms(aux, w, n, reduce), w)
    return obj, (terms, new.split()[1])


# -- what the backward needs: the stage's VJP residuals ---------------------------------------
class _Layout(NamedTuple):
    """The stage VJP's closure, probed once: its tree structure, per leaf whether it
    depends on the activation or the state (``True``: stashed per microbatch; ``False``:
    a function of the params alone, computed once per step), and the leaves' types."""

    treedef: Any
    stashed: tuple[bool, ...]
    avals: tuple[Any, ...]


def _residual_layout(
    fns: _Fns, tr: Params, st: Params, h: Any, data_axis: str | None = None
) -> _Layout:
    """Traces the stage's VJP (abstractly, ``jax.make_jaxpr``) and follows the data flow
    from ``(st, h)`` to each residual. With FSDP stage leaves (`data_axis`): raises if a
    residual kept per microbatch is a weight gathered over `data_axis`."""
    closed, shape = jax.make_jaxpr(
        lambda tr, st, h: _stage_vjp(fns, tr, st, h)[1], return_shape=True
    )(tr, st, h)
    jaxpr = closed.jaxpr
    dep = set(jaxpr.invars[len(jax.tree.leaves(tr)) :])
    for eqn in jaxpr.eqns:
        if any(not isinstance(v, Literal) and v in dep for v in eqn.invars):
            dep.update(eqn.outvars)
    stashed = tuple(not isinstance(v, Literal) and v in dep for v in jaxpr.outvars)
    if data_axis is not None:
        _check_no_gathered_stash(jaxpr, stashed, tr, data_axis)
    return _Layout(jax.tree.structure(shape), stashed, tuple(closed.out_avals))


# What a gathered weight may go through and still be the weight (in the stash).
_SAME_VALUE = frozenset(
    {"pvary", "pcast", "copy", "copy_p", "convert_element_type", "reshape", "transpose"}
)


def _check_no_gathered_stash(jaxpr: Any, stashed: tuple, tr: Params, data_axis: str) -> None:
    """Raises if a residual kept per microbatch is an ``all_gather`` over `data_axis`
    (FSDP's gathered full weight: ``fsdp_call(..., remat=False)``), naming the leaf."""
    made = {o: e for e in jaxpr.eqns for o in e.outvars}
    leaves = dict(zip(jaxpr.invars[: len(jax.tree.leaves(tr))], tr.keys(), strict=True))

    def gathered(v):
        e = made.get(v)
        while e is not None and e.primitive.name in _SAME_VALUE:
            e = made.get(e.invars[0])
        axes = e.params.get("axis_name", ()) if e is not None else ()
        axes = axes if isinstance(axes, tuple) else (axes,)
        return (
            e if e is not None and e.primitive.name == "all_gather" and data_axis in axes else None
        )

    def source(v, seen):
        if v in leaves:
            return leaves[v]
        if v in seen or v not in made:
            return None
        seen.add(v)
        for a in made[v].invars:
            if not isinstance(a, Literal) and (found := source(a, seen)) is not None:
                return found
        return None

    for v, kept in zip(jaxpr.outvars, stashed, strict=True):
        e = None if isinstance(v, Literal) or not kept else gathered(v)
        if e is None:
            continue
        path = source(e.invars[0], set())
        name = f"'{format_path(path)}'" if path is not None else "an FSDP stage weight"
        raise ValueError(
            f"pipeline_value_and_grad: the stage keeps the gathered (full) weight {name} of "
            f"shape {tuple(v.aval.shape)} for its backward, once per microbatch in flight: "
            "stage_fn calls blox.parallel.fsdp_call(..., remat=False), which keeps the "
            "layer's residuals, full weights included. Inside a pipeline that costs more "
            "memory than no FSDP at all; call fsdp_call with remat='weights' (the default) "
            "or remat=True: the backward gathers the weight again."
        )


def _residuals(layout: _Layout, vjp_fn: Any) -> list[Any]:
    leaves = jax.tree.leaves(vjp_fn)
    got = [(jnp.shape(v), jnp.result_type(v)) for v in leaves]
    want = [(a.shape, a.dtype) for a in layout.avals]
    if got != want:
        raise RuntimeError(
            "pipeline_value_and_grad: the stage's VJP residuals differ between two traces "
            f"({len(got)} vs {len(want)} arrays); stage_fn must trace the same way each time."
        )
    return leaves


def _param_residuals(layout: _Layout, fns: _Fns, tr: Params, st: Params, h: Any) -> list:
    """The residuals that depend on the params only (once per step, outside the scan)."""
    leaves = _residuals(layout, _stage_vjp(fns, tr, st, h)[1])
    return [v for v, s in zip(leaves, layout.stashed, strict=True) if not s]


def _rebuild_vjp(layout: _Layout, stashed: list, param_res: list) -> Any:
    it_s, it_p = iter(stashed), iter(param_res)
    leaves = [next(it_s) if s else next(it_p) for s in layout.stashed]
    return jax.tree.unflatten(layout.treedef, leaves)


# -- the split backward: B (the input cotangent) and W (the weight gradient) -----------------
# The stage's backward, traced once as a jaxpr of (stashed residuals, residuals of the
# params, output cotangent) -> (weight gradient, input cotangent), its calls inlined.
# B runs the equations the input cotangent needs and keeps the values the rest reads
# that it computed (the cotangents where the weights are used, e.g. ``dy`` of each
# ``y = x @ w``); W runs the rest from those, the stash and the params: together one
# backward, no cotangent derived twice.
_INLINE = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"})


class _Eqn(NamedTuple):
    """One equation of the flattened backward: ``prim`` None copies ``ins[0]``. Atoms are
    `Literal`\\ s or keys ``(scope, var)`` (a jaxpr inlined twice gets two scopes)."""

    prim: Any
    params: dict
    ins: tuple
    outs: tuple


class _SplitBackward(NamedTuple):
    """The backward's equations and which of them B and W run (see above).

    Attributes:
      eqns: the flattened equations.
      consts: ``{key: value}`` of the jaxprs' constants.
      ins: keys of the inputs: stashed residuals, residuals of the params, cotangent.
      outs: atoms of the outputs: the weight-gradient leaves, then the input cotangent's.
      n_res: how many inputs are stashed residuals.
      n_tr: how many outputs are weight-gradient leaves.
      out_tree: the outputs' tree structure ``(d_tr, d_h)``.
      b, w: the equations (indices, in order) B and W run.
      keep: the keys B keeps for W.
      slots: per kept value, the stash array of the microbatch's entry B overwrites with
        it (the stash entry lives until W; a value the stash had no free array of its
        type for: None, kept in the ``kept`` buffer from B to W).
      extra_avals: the types of the values kept in the ``kept`` buffer.
      row_major: run the products on row-major operands (XLA:CPU; `_product`).
      swapped: the products `_product` runs swapped (`_swapped_products`).
    """

    eqns: tuple
    consts: dict
    ins: tuple
    outs: tuple
    n_res: int
    n_tr: int
    out_tree: Any
    b: tuple
    w: tuple
    keep: tuple
    slots: tuple
    extra_avals: tuple
    row_major: bool = False
    swapped: frozenset = frozenset()


def _flatten(jaxpr: Any, consts: list, scope: list, env_in: list, out: list, cvals: dict):
    """Appends `jaxpr`'s equations to `out` (calls inlined, each in a new scope); returns
    the atoms of its outputs."""
    me = (len(scope),)
    scope.append(None)
    key = lambda v: v if isinstance(v, Literal) else (me, v)  # noqa: E731
    for cv, val in zip(jaxpr.constvars, consts, strict=True):
        cvals[key(cv)] = val
    for iv, atom in zip(jaxpr.invars, env_in, strict=True):
        out.append(_Eqn(None, {}, (atom,), (key(iv),)))
    for eqn in jaxpr.eqns:
        sub = eqn.params.get("jaxpr") if eqn.primitive.name in _INLINE else None
        inner = getattr(sub, "jaxpr", sub)
        if inner is not None and len(inner.invars) == len(eqn.invars):
            got = _flatten(
                inner, list(getattr(sub, "consts", ())), scope, [key(a) for a in eqn.invars],
                out, cvals,
            )  # fmt: skip
            for o, atom in zip(eqn.outvars, got, strict=True):
                out.append(_Eqn(None, {}, (atom,), (key(o),)))
            continue
        out.append(_Eqn(eqn.primitive, eqn.params, tuple(map(key, eqn.invars)),
                        tuple(map(key, eqn.outvars))))  # fmt: skip
    return [key(v) for v in jaxpr.outvars]


def _split_backward(
    layout: _Layout, stash: list, param_res: list, h: Any, row_major: bool = False
) -> _SplitBackward:
    """Traces the stage's backward (abstractly) and splits it between B and W."""
    closed = jax.make_jaxpr(
        lambda res, pres, ct: jax.tree.leaves(_rebuild_vjp(layout, res, pres)(ct))
    )(stash, param_res, h)
    shape = jax.eval_shape(lambda: _rebuild_vjp(layout, stash, param_res)(h))
    out_tree = jax.tree.structure(shape)
    n_tr = len(jax.tree.leaves(shape[0]))
    eqns: list = []
    cvals: dict = {}
    ins = [((-1,), v) for v in closed.jaxpr.invars]
    outs = _flatten(closed.jaxpr, list(closed.consts), [], ins, eqns, cvals)
    n_res, n_pres = len(stash), len(param_res)
    res_in, ct_in = set(ins[:n_res]), set(ins[n_res + n_pres :])
    per_mb = res_in | ct_in  # values that differ per microbatch
    for e in eqns:
        if any(a in per_mb for a in e.ins if not isinstance(a, Literal)):
            per_mb.update(e.outs)

    def walk(roots, stop):
        need = {a for a in roots if not isinstance(a, Literal)}
        run, cut = [], set()
        for i in range(len(eqns) - 1, -1, -1):
            e = eqns[i]
            wanted = [o for o in e.outs if o in need]
            if not wanted:
                continue
            if stop(i):
                cut.update(wanted)
                continue
            run.append(i)
            need.update(a for a in e.ins if not isinstance(a, Literal))
        return run[::-1], cut, need

    b, _, _ = walk(outs[n_tr:], lambda i: False)
    in_b = set(b)
    # W stops at the per-microbatch values B computes; it recomputes those of the params.
    w, cut, need = walk(outs[:n_tr], lambda i: i in in_b and eqns[i].outs[0] in per_mb)
    # (W reads no stash entry: the schedule frees it after B, which copies W's part)
    if cut & {a for a in outs[:n_tr] if not isinstance(a, Literal)}:
        # B computes a weight gradient itself (an equation that also feeds the input
        # cotangent, e.g. a scan over layers): keeping it would stash parameter-sized
        # values per microbatch; W re-runs the weight half from the cotangent instead.
        w, cut, need = walk(outs[:n_tr], lambda i: False)
    keep = sorted(cut | (need & (ct_in | res_in)), key=lambda k: (k[0], str(k[1])))
    avals = {}
    for v in closed.jaxpr.invars:
        avals[((-1,), v)] = v.aval
    for e in eqns:
        for o in e.outs:
            avals.setdefault(o, getattr(o[1], "aval", None))

    def aval(k):
        a = avals.get(k)
        while a is None:  # an alias: its source's type
            src = next(e.ins[0] for e in eqns if k in e.outs)
            a, k = (src.aval if isinstance(src, Literal) else avals.get(src)), src
        return a

    slots = _reuse_stash(keep, list(ins[:n_res]), [jax.typeof(x) for x in stash], aval)
    extra = tuple(aval(k) for k, j in zip(keep, slots, strict=True) if j is None)
    return _SplitBackward(
        tuple(eqns), cvals, tuple(ins), tuple(outs), n_res, n_tr, out_tree, tuple(b), tuple(w),
        tuple(keep), tuple(slots), extra, row_major, _swapped_products(eqns, outs),
    )  # fmt: skip


def _row_major_dot(params: dict, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """``dot_general`` (no batch dimensions) with its left operand copied so that it
    contracts over its trailing dimensions. XLA:CPU runs a product whose left operand
    contracts over its leading dimension (a weight gradient ``x^T dy`` contracts the rows)
    outside its fast matmul kernel, at about 2.3 times the time of the same product on a
    row-major operand (128 x 64 x 256, float32); the copy (``optimization_barrier``: XLA
    folds a bare transpose back into the product) costs a few percent of that."""
    (lc, rc), _ = params["dimension_numbers"]
    n, k = lhs.ndim, len(lc)
    if tuple(lc) != tuple(range(n - k, n)):
        free = [d for d in range(n) if d not in lc]
        lhs = lax.optimization_barrier(lax.transpose(lhs, (*free, *lc)))
        params = {**params, "dimension_numbers": ((tuple(range(n - k, n)), tuple(rc)), ((), ()))}
    return lax.dot_general_p.bind(lhs, rhs, **lax.dot_general_p.get_bind_params(params))


def _product(params: dict, lhs: jax.Array, rhs: jax.Array, swapped: bool) -> jax.Array:
    """`_row_major_dot` of a product of the backward; `swapped`: its only reader
    transposes it (``(dy^T x)^T``, the weight gradient of ``y = x @ w``), so it runs as
    the product of the swapped operands, transposed back (the two transposes cancel)."""
    (lc, rc), (lb, _) = params["dimension_numbers"]
    if lb:
        return lax.dot_general_p.bind(lhs, rhs, **lax.dot_general_p.get_bind_params(params))
    if not swapped:
        return _row_major_dot(params, lhs, rhs)
    prec = params.get("precision")
    params = {
        **params,
        "dimension_numbers": ((tuple(rc), tuple(lc)), ((), ())),
        "precision": tuple(reversed(prec)) if isinstance(prec, tuple) else prec,
    }
    out = _row_major_dot(params, rhs, lhs)
    n_b = rhs.ndim - len(rc)
    return lax.transpose(out, (*range(n_b, out.ndim), *range(n_b)))


def _swapped_products(eqns: list, outs: list) -> frozenset:
    """Indices of the products (``dot_general`` without batch dimensions) whose only
    reader is a ``transpose`` that swaps the two operands' free dimensions."""
    readers: dict = {}
    for i, e in enumerate(eqns):
        for a in e.ins:
            if not isinstance(a, Literal):
                readers.setdefault(a, []).append(i)
    results = {a for a in outs if not isinstance(a, Literal)}
    found = set()
    for i, e in enumerate(eqns):
        if (
            e.prim is not lax.dot_general_p
            or e.params["dimension_numbers"][1][0]
            or any(isinstance(a, Literal) for a in e.ins)
        ):
            continue
        (lc, rc), _ = e.params["dimension_numbers"]
        uses = readers.get(e.outs[0], [])
        if len(uses) != 1 or e.outs[0] in results or eqns[uses[0]].prim is not lax.transpose_p:
            continue
        n_a = e.ins[0][1].aval.ndim - len(lc)
        n_b = e.ins[1][1].aval.ndim - len(rc)
        if tuple(eqns[uses[0]].params["permutation"]) == (*range(n_a, n_a + n_b), *range(n_a)):
            found.add(i)
    return frozenset(found)


def _reuse_stash(keep: list, res_keys: list, stash_avals: list, aval: Callable) -> list:
    """Per kept value, the stash array B writes it over: a stashed value W reads stays
    where it is; another goes to a free array of its type that W does not read (the
    stash entry lives until W), else None (the ``kept`` buffer)."""
    kind = lambda a: (tuple(a.shape), a.dtype, _aval_vma(a))  # noqa: E731
    slots = [res_keys.index(k) if k in res_keys else None for k in keep]
    free = [j for j, k in enumerate(res_keys) if k not in keep]
    for i, k in enumerate(keep):
        if slots[i] is None:
            j = next((j for j in free if kind(stash_avals[j]) == kind(aval(k))), None)
            if j is not None:
                free.remove(j)
                slots[i] = j
    return slots


def _run_eqns(sb: _SplitBackward, env: dict, which: tuple) -> None:
    """Evaluates the equations `which` of `sb` into `env` (``{key: value}``); with
    `sb.row_major`, the products on row-major operands (`_product`)."""
    read = lambda a: a.val if isinstance(a, Literal) else env[a]  # noqa: E731
    for i in which:
        e = sb.eqns[i]
        vals = [read(a) for a in e.ins]
        if e.prim is None:
            env[e.outs[0]] = vals[0]
            continue
        if sb.row_major and e.prim is lax.dot_general_p:
            got = _product(e.params, *vals, i in sb.swapped)
        else:
            got = e.prim.bind(*vals, **e.prim.get_bind_params(e.params))
        env.update(zip(e.outs, got if e.prim.multiple_results else [got], strict=True))


def _backward_input(sb: _SplitBackward, res: list, pres: list, ct: Any) -> tuple[Any, list]:
    """B: the input cotangent and the values W needs."""
    env = dict(sb.consts)
    env.update(zip(sb.ins, [*res, *pres, *jax.tree.leaves(ct)], strict=True))
    _run_eqns(sb, env, sb.b)
    read = lambda a: a.val if isinstance(a, Literal) else env[a]  # noqa: E731
    leaves = [jnp.zeros(()) for _ in range(sb.n_tr)] + [read(a) for a in sb.outs[sb.n_tr :]]
    return jax.tree.unflatten(sb.out_tree, leaves)[1], [env[k] for k in sb.keep]


def _backward_whole(sb: _SplitBackward, res: list, pres: list, ct: Any) -> tuple[Params, Any]:
    """The whole backward (B's and W's equations, each once): ``(d_tr, d_h)``; the fused
    backward of the tables without W on a CPU mesh, for its row-major products."""
    env = dict(sb.consts)
    env.update(zip(sb.ins, [*res, *pres, *jax.tree.leaves(ct)], strict=True))
    _run_eqns(sb, env, tuple(sorted({*sb.b, *sb.w})))
    read = lambda a: a.val if isinstance(a, Literal) else env[a]  # noqa: E731
    return jax.tree.unflatten(sb.out_tree, [read(a) for a in sb.outs])


def _backward_weight(sb: _SplitBackward, pres: list, kept: list) -> Params:
    """W: the weight gradient from what B kept (and the residuals of the params)."""
    env = dict(sb.consts)
    env.update(zip(sb.ins[sb.n_res : sb.n_res + len(pres)], pres, strict=True))
    env.update(zip(sb.keep, kept, strict=True))
    _run_eqns(sb, env, sb.w)
    read = lambda a: a.val if isinstance(a, Literal) else env[a]  # noqa: E731
    leaves = [read(a) for a in sb.outs[: sb.n_tr]]
    n_h = len(sb.outs) - sb.n_tr
    return jax.tree.unflatten(sb.out_tree, leaves + [jnp.zeros(())] * n_h)[0]


# -- one time slot ------------------------------------------------------------------------------
# The columns of `Schedule.program()` the runtime reads per action, in this order (one
# int32 array (T, p, lanes, 9) indexed once per slot).
_COLUMNS = (
    "kind", "microbatch", "chunk", "stash", "inbox_f", "inbox_b", "send_f", "send_b", "kept"
)  # fmt: skip
_KIND, _MB, _CHUNK, _STASH, _IN_F, _IN_B, _SEND_F, _SEND_B, _KEPT = range(len(_COLUMNS))


class _Ctx(NamedTuple):
    """What every slot of one device sees: static sizes and the step's invariants."""

    fns: _Fns
    layout: _Layout
    program: jax.Array  # (T, p, lanes, 9) int32: `_COLUMNS` of every action
    lane_kinds: tuple[tuple[int, ...], ...]  # per lane, the kinds it ever runs (IDLE first)
    split: bool  # the table splits the backward into B (input) and W (weights)
    split_bwd: _SplitBackward | None  # what B and W each run (split tables; any on CPU)
    num_stages: int  # p devices
    num_virtual: int  # v * p virtual stages
    virtual: jax.Array  # (v, p) int32: the virtual stage of each chunk of each device
    stage: jax.Array  # this device's index on the stage axis
    n: int  # m D: an unweighted microbatch's loss enters the sums as loss / n
    reduce: Any  # reduce_dtype (None: float32 for 16-bit floats)
    no_terms: _Terms  # zeros of the terms' types (cells without a loss)
    counters: tuple[tuple[int, int, int], ...]  # shared-state leaves `_SharedPlan` counts
    st_sh0: Params  # the shared state at the step's start
    tr: Params  # this device's trainable params, leaves (v, ...): one chunk per row
    tr_sh: Params  # shared trainable params
    param_res: list  # residuals of the params alone, leaves (v, ...)
    h_zero: Any  # zeros of the activation's type
    stage_axis: str
    sends: _Sends  # what each slot transfers (one ppermute per group)


class _Buffers(NamedTuple):
    """Buffers of entries handed out by `Schedule.program()` (an entry is reused once
    its last reader ran): the stash (residuals from a forward to its backward, and the
    shared state ``first_fn`` saw), activations received, cotangents received, and with
    a split backward the cotangents a B keeps for its W."""

    stash: tuple[list, Params]
    inbox_f: Any
    inbox_b: Any
    kept: Any


class _Acc(NamedTuple):
    """What a slot accumulates or threads: gradients (leaves (v, ...); floating leaves
    in the reduction dtype), loss / aux / weight terms, non-trainable state (leaves (v,
    ...)), shared state."""

    g: Params
    g_sh: Params
    terms: _Terms
    st: Params
    st_sh: Params


class _CellIn(NamedTuple):
    """One action's entries, read at the top level before the cell runs: its buffer
    entries, its microbatch, its chunk's params, residuals and state."""

    h_in: Any
    ct_in: Any
    kept: list  # W: what its B kept (`_SplitBackward.keep`)
    stash_in: tuple[list, Params]
    x: Any
    y: Any
    tr: Params
    param_res: list
    st: Params
    st_sh: Params
    is_first: jax.Array  # virtual stage 0
    is_last: jax.Array  # virtual stage v * p - 1
    mb: jax.Array  # the microbatch's index
    g: Params  # this chunk's gradient accumulator
    g_sh: Params  # the shared gradient accumulator


class _CellOut(NamedTuple):
    send: Any  # F: the activation for the next virtual stage; B: the input cotangent
    ct_own: Any  # last virtual stage: the cotangent of its output, for its own backward
    stash_out: tuple[list, Params]  # the stash entry to write (unchanged if no forward)
    kept: list  # B: what W will need (others: the entry they read, unchanged)
    g: Params  # the chunk's gradient accumulator, plus what this action adds
    g_sh: Params
    terms: _Terms
    st: Params  # this chunk's state
    st_sh: Params


def _counted(c: _Ctx, st_sh: Params, mb: jax.Array, after_first: bool) -> Params:
    """`st_sh` with each counter that both ``first_fn`` and ``last_fn`` advance set to
    its value on one device: ``c0 + mb (a + b)`` before ``first_fn`` of microbatch `mb`,
    ``+ a`` before its ``last_fn`` (``a``, ``b``: their fixed advances per call)."""
    if not c.counters:
        return st_sh
    leaves, treedef = jax.tree.flatten(st_sh)
    base = jax.tree.leaves(c.st_sh0)
    for k, a, b in c.counters:
        dt = base[k].dtype
        offset = mb.astype(dt) * jnp.asarray(a + b, dt) + jnp.asarray(a if after_first else 0, dt)
        leaves[k] = _vary(base[k] + offset, tuple(varying_axes(leaves[k])))
    return jax.tree.unflatten(treedef, leaves)


def _forward_cell(c: _Ctx, x: _CellIn) -> _CellOut:
    """Forward of one microbatch: virtual stage 0 runs ``first_fn``, the last runs
    ``last_fn`` and its gradient at once (loss terms, shared gradient, output cotangent;
    the last two zero for a microbatch of weight 0)."""
    st_in = _counted(c, x.st_sh, x.mb, False)
    h_in, st_sh = lax.cond(
        x.is_first,
        lambda: _vary(_first(c.fns, c.tr_sh, st_in, x.x), _axes(c.h_zero)),
        lambda: (x.h_in, st_in),
    )
    h_out, vjp_fn, st = _stage_vjp(c.fns, x.tr, x.st, h_in)
    res = [v for v, s in zip(_residuals(c.layout, vjp_fn), c.layout.stashed, strict=True) if s]

    def last():
        st_last = _counted(c, st_sh, x.mb, True)
        (_, (terms, new_sh)), (d_sh, d_h) = jax.value_and_grad(
            lambda p, h: _last_loss(c.fns, p, st_last, h, x.y, c.n, c.reduce),
            (0, 1),
            has_aux=True,
        )(c.tr_sh, h_out)
        if terms.w is not None:
            # A weight-0 microbatch (all padding) adds nothing: its loss may be NaN (0 / 0),
            # and the `where` in `_last_loss` zeroes its value but not its gradients.
            ok = terms.w > 0
            d_sh, d_h = jax.tree.map(
                lambda g: jnp.where(ok, g, jnp.zeros((), g.dtype)), (d_sh, d_h)
            )
        return terms, new_sh, jax.tree.map(_plus, x.g_sh, d_sh), d_h

    terms, st_sh, g_sh, ct_own = lax.cond(
        x.is_last, last, lambda: (c.no_terms, st_sh, x.g_sh, c.h_zero)
    )
    avals = _stash_avals(c.layout)
    stash = ([_vary(v, _aval_vma(a)) for v, a in zip(res, avals, strict=True)], st_in)
    return _CellOut(h_out, ct_own, stash, x.kept, x.g, g_sh, terms, st, st_sh)


def _first_pullback(c: _Ctx, x: _CellIn, d_h: Any) -> Params:
    """The shared gradient accumulator plus, on virtual stage 0, the shared params'
    gradient through a recomputed ``first_fn`` (with the shared state its forward saw)."""
    _, st_sh_seen = x.stash_in

    def first():
        _, pull = jax.vjp(lambda p: _first(c.fns, p, st_sh_seen, x.x)[0], c.tr_sh)
        return jax.tree.map(_plus, x.g_sh, pull(d_h)[0])

    return lax.cond(x.is_first, first, lambda: x.g_sh)


def _backward_cell(c: _Ctx, x: _CellIn) -> _CellOut:
    """Backward of one microbatch from its stash: the cotangent of the stage input (sent
    to the previous virtual stage) and, unless the table has W actions, the gradient of
    the chunk's params (on a CPU mesh through `_backward_whole`). With a split backward
    it runs B's part of the backward (`_SplitBackward`) and keeps what W needs;
    `_weight_cell` finishes it later."""
    res, st_sh_seen = x.stash_in
    kept, stash = x.kept, x.stash_in
    if c.split:
        d_h, values = _backward_input(c.split_bwd, res, x.param_res, x.ct_in)
        res, kept = list(res), []
        for value, j in zip(values, c.split_bwd.slots, strict=True):
            if j is None:
                kept.append(value)
            else:
                res[j] = value
        stash = (res, st_sh_seen)
        g = x.g
    elif c.split_bwd is not None:  # a CPU mesh: the backward's products row-major
        d_tr, d_h = _backward_whole(c.split_bwd, res, x.param_res, x.ct_in)
        g = jax.tree.map(_plus, x.g, d_tr)
    else:
        d_tr, d_h = _rebuild_vjp(c.layout, res, x.param_res)(x.ct_in)
        g = jax.tree.map(_plus, x.g, d_tr)
    g_sh = _first_pullback(c, x, d_h)
    return _CellOut(d_h, c.h_zero, stash, kept, g, g_sh, c.no_terms, x.st, x.st_sh)


def _weight_cell(c: _Ctx, x: _CellIn) -> _CellOut:
    """The weight half of a split backward: the chunk's gradient from what its B kept
    in the stash entry (and in the ``kept`` entry), no cotangent derived again."""
    res, _ = x.stash_in
    extra = iter(x.kept)
    kept = [next(extra) if j is None else res[j] for j in c.split_bwd.slots]
    d_tr = _backward_weight(c.split_bwd, x.param_res, kept)
    g = jax.tree.map(_plus, x.g, d_tr)
    z = c.h_zero
    return _CellOut(z, z, x.stash_in, x.kept, g, x.g_sh, c.no_terms, x.st, x.st_sh)


def _idle_cell(c: _Ctx, x: _CellIn) -> _CellOut:
    z = c.h_zero
    return _CellOut(z, z, x.stash_in, x.kept, x.g, x.g_sh, c.no_terms, x.st, x.st_sh)


_CELLS = {IDLE: _idle_cell, FORWARD: _forward_cell, BACKWARD: _backward_cell, WEIGHT: _weight_cell}


class _Sends(NamedTuple):
    """What each time slot transfers, from the static program: the sends of a slot
    (F: activation to the next virtual stage's device; B: cotangent to the previous
    one's) are split into as few groups as make each a partial permutation (a device
    sends and receives at most once per group: under 1F1B one group per slot); each
    group is one ``ppermute``. Slots with the same groups share a `pattern`.

    Attributes:
      pattern: ``(T,)`` int32, the pattern each slot runs (a `lax.switch` index, the
        same on every device).
      patterns: per pattern, its groups: ``(perm, lane)``, the ``(src, dst)`` pairs and
        per device the lane whose output it sends (-1: none).
      recv: ``(T, p, G, 2)`` int32: per slot, device and group, what arrives (0 nothing,
        1 an activation, 2 a cotangent) and the inbox entry it goes to.
      groups: ``G``, the most groups of any slot.
    """

    pattern: np.ndarray
    patterns: tuple[tuple[tuple[tuple[tuple[int, int], ...], tuple[int, ...]], ...], ...]
    recv: np.ndarray
    groups: int


def _send_plan(table: np.ndarray, sched: Schedule) -> _Sends:
    """`_Sends` from the program's columns (``table``: ``(T, p, lanes, 9)``)."""
    n_slots, p, lanes, _ = table.shape
    nv = p * sched.virtual_stages
    keys: dict[Any, int] = {}
    pattern = np.zeros(n_slots, np.int32)
    per_slot = []
    for t in range(n_slots):
        groups: list[list[tuple[int, int, int, int, int]]] = []  # (src, dst, lane, dir, entry)
        for s in range(p):
            for lane in range(lanes):
                a = table[t, s, lane]
                vs = sched.virtual_stage(s, int(a[_CHUNK]))
                if a[_KIND] == FORWARD and vs < nv - 1:
                    send = (s, sched.device_of(vs + 1)[0], lane, 1, int(a[_SEND_F]))
                elif a[_KIND] == BACKWARD and vs > 0:
                    send = (s, sched.device_of(vs - 1)[0], lane, 2, int(a[_SEND_B]))
                else:
                    continue
                for g in groups:
                    if all(send[0] != o[0] and send[1] != o[1] for o in g):
                        g.append(send)
                        break
                else:
                    groups.append([send])
        per_slot.append(groups)
        key = tuple(tuple((a, b, lane) for a, b, lane, _, _ in g) for g in groups)
        pattern[t] = keys.setdefault(key, len(keys))
    n_groups = max((len(g) for g in per_slot), default=0)
    recv = np.zeros((n_slots, p, n_groups, 2), np.int32)
    for t, groups in enumerate(per_slot):
        for k, g in enumerate(groups):
            for _, dst, _, direction, entry in g:
                recv[t, dst, k] = (direction, entry)
    patterns = []
    for key in keys:  # in order of first use, as numbered
        groups = []
        for g in key:
            lane = [-1] * p
            for src, _, ln in g:
                lane[src] = ln
            groups.append((tuple((a, b) for a, b, _ in g), tuple(lane)))
        patterns.append(tuple(groups))
    return _Sends(pattern, tuple(patterns), recv, n_groups)


def _slot(c: _Ctx, xs: Any, ys: Any, carry: tuple[_Buffers, _Acc], t: jax.Array):
    """One time slot on one device: run the cell's lanes in turn (each reads its buffer
    entries, runs a forward, a backward, a weight gradient or nothing, writes back), then
    send what they produced (the slot's pattern of `_Sends`: one ``ppermute`` per group
    of sends, none in a slot where no device sends) and file what arrived."""
    bufs, acc = carry
    row = c.program[t, c.stage]  # (lanes, 9)
    sends = []
    for lane, present in enumerate(c.lane_kinds):
        bufs, acc, out, last = _lane(c, xs, ys, bufs, acc, row[lane], present)
        sends.append(out.send)
        if FORWARD in present:  # the last virtual stage files the cotangent of its output
            own = (row[lane, _KIND] == FORWARD) & last
            bufs = bufs._replace(inbox_b=_put(bufs.inbox_b, row[lane, _SEND_B], out.ct_own, own))
    plan = c.sends
    if not plan.groups:
        return (bufs, acc), None

    def transfer(groups):
        def run(sends):
            got = []
            for perm, lanes in groups:
                lane = jnp.asarray(lanes, jnp.int32)[c.stage]
                value = sends[0]
                for k in range(1, len(sends)):
                    value = jax.tree.map(
                        lambda a, b, k=k, lane=lane: jnp.where(lane == k, b, a), value, sends[k]
                    )
                got.append(lax.ppermute(value, c.stage_axis, list(perm)))
            return got + [c.h_zero] * (plan.groups - len(groups))

        return run

    got = lax.switch(jnp.asarray(plan.pattern)[t], [transfer(g) for g in plan.patterns], sends)
    recv = jnp.asarray(plan.recv)[t, c.stage]  # (G, 2)
    for k, value in enumerate(got):
        what, entry = recv[k, 0], recv[k, 1]
        bufs = bufs._replace(
            inbox_f=_put(bufs.inbox_f, entry, value, what == 1),
            inbox_b=_put(bufs.inbox_b, entry, value, what == 2),
        )
    return (bufs, acc), None


def _lane(c: _Ctx, xs: Any, ys: Any, bufs: _Buffers, acc: _Acc, a: jax.Array, present):
    """One action of a slot (`a`: its row of the program): read its entries, run the
    cell (a switch over the kinds this lane runs somewhere in the table, `present`),
    write its stash (and kept-cotangent) entry and its chunk's gradient accumulator (the
    cells that compute a gradient add to it; forward and idle cells pass it through);
    returns the cell's output and whether it ran on the last virtual stage."""
    kind, chunk = a[_KIND], a[_CHUNK]
    vs = c.virtual[chunk, c.stage]
    first, last = vs == 0, vs == c.num_virtual - 1
    x = _CellIn(
        _take(bufs.inbox_f, a[_IN_F]),
        _take(bufs.inbox_b, a[_IN_B]),
        _take(bufs.kept, a[_KEPT]) if c.split else [],
        _take(bufs.stash, a[_STASH]),
        _take(xs, a[_MB]),
        _take(ys, a[_MB]),
        _row(c, c.tr, chunk),
        _row(c, c.param_res, chunk),
        _row(c, acc.st, chunk),
        acc.st_sh,
        first,
        last,
        a[_MB],
        _row(c, acc.g, chunk),
        acc.g_sh,
    )
    branch = np.zeros(len(_CELLS), np.int32)
    branch[list(present)] = np.arange(len(present))
    out = lax.switch(
        jnp.asarray(branch)[kind], [lambda x, f=_CELLS[k]: f(c, x) for k in present], x
    )
    # (an unconditional write: the other cells return the entry they read, which costs
    # less than a select between the old and the new entry)
    bufs = bufs._replace(stash=_put(bufs.stash, a[_STASH], out.stash_out))
    if c.split:  # what B keeps for its W (the other cells write back what they read)
        bufs = bufs._replace(kept=_put(bufs.kept, a[_KEPT], out.kept))
    acc = _Acc(
        _set_row(c, acc.g, chunk, out.g),
        out.g_sh,
        jax.tree.map(_plus, acc.terms, out.terms),
        _set_row(c, acc.st, chunk, out.st),
        out.st_sh,
    )
    return bufs, acc, out, last


# A device's chunks are the rows of its (v, ...) leaves: with one chunk (v == 1) the row
# is static (no dynamic slice, no copy of the params into the switch's operands).
def _row(c: _Ctx, tree: Any, chunk: jax.Array) -> Any:
    if c.num_virtual == c.num_stages:
        return jax.tree.map(lambda x: x[0], tree)
    return _take(tree, chunk)


def _set_row(c: _Ctx, tree: Any, chunk: jax.Array, values: Any) -> Any:
    if c.num_virtual == c.num_stages:
        return jax.tree.map(lambda x, v: v[None].astype(x.dtype), tree, values)
    return _put(tree, chunk, values)


def _plus(acc: jax.Array, value: jax.Array) -> jax.Array:
    """``acc + value`` in ``acc``'s dtype (the accumulators hold the reduction dtype)."""
    return acc + value.astype(acc.dtype)


def _axes(tree: Any) -> tuple[str, ...]:
    """The varying axes of the first leaf of `tree`."""
    return tuple(varying_axes(jax.tree.leaves(tree)[0]))


def _aval_vma(aval: Any) -> tuple[str, ...]:
    """The varying axes of an abstract value (a ``ShapedArray`` from ``jax.make_jaxpr``),
    sorted: ``aval.manual_axis_type.varying``."""
    return tuple(sorted(aval.manual_axis_type.varying))


def _stash_avals(layout: _Layout) -> list:
    return [a for a, s in zip(layout.avals, layout.stashed, strict=True) if s]


# -- one device's whole step -----------------------------------------------------------------
class _Static(NamedTuple):
    """The step's static configuration (from `pipeline_value_and_grad`'s arguments)."""

    fns: _Fns
    schedule: Schedule
    stage_axis: str
    data_axis: str | tuple[str, ...] | None  # one name, or a tuple (e.g. data, context)
    fsdp: tuple[tuple[Path, int], ...] = ()  # stage leaves sharded over data: (path, dim)
    dp: int = 1  # the data axes' size: the shards the loss is the mean over
    reduce: Any = None  # reduce_dtype
    rngs: tuple[Rng, ...] = ()  # folded with the data index
    row_major: bool = False  # a CPU mesh: the backward's products row-major (`_product`)


# -- the shared state first_fn and last_fn change ---------------------------------------------
# What `_affine` knows of a value: ("in", k, c): input leaf k plus the constant c;
# ("c", c): the constant c; None: anything else.
_PASS = frozenset({"pvary", "pcast", "copy", "copy_p", "optimization_barrier"})
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"})


def _affine(jaxpr: Any, env_in: list) -> list:
    """Follows integer additions of constants through `jaxpr` (and the jaxprs it calls):
    for each output, what `_PASS`-through and ``add`` make of the inputs `env_in`."""
    env = dict(zip(jaxpr.invars, env_in, strict=True))

    def read(a):
        if isinstance(a, Literal):
            val = np.asarray(a.val)
            ok = val.ndim == 0 and np.issubdtype(val.dtype, np.integer)
            return ("c", int(val)) if ok else None
        return env.get(a)

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        name = eqn.primitive.name
        outs: list = [None] * len(eqn.outvars)
        if name in _PASS and len(ins) == len(outs):
            outs = ins
        elif name == "convert_element_type" and eqn.params.get("new_dtype") == getattr(
            eqn.invars[0].aval, "dtype", None
        ):
            outs = ins
        elif name == "add" and None not in ins:
            (x, y) = ins
            if x[0] == "c" and y[0] == "c":
                outs = [("c", x[1] + y[1])]
            elif x[0] == "c" or y[0] == "c":
                var, const = (y, x) if x[0] == "c" else (x, y)
                outs = [("in", var[1], var[2] + const[1])]
        elif name in _CALLS and "jaxpr" in eqn.params:
            sub = eqn.params["jaxpr"]
            inner = getattr(sub, "jaxpr", sub)
            if len(inner.invars) == len(ins):
                outs = _affine(inner, ins)
        for v, o in zip(eqn.outvars, outs, strict=True):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


def _state_effects(fn: Callable[[Params], Params], st: Params) -> list:
    """Per leaf of `st`: ``None`` if ``fn`` leaves it unchanged, the constant it adds
    (an int: an `Rng` counter advanced by a fixed number of draws), or ``"changed"``."""
    leaves, treedef = jax.tree.flatten(st)
    closed = jax.make_jaxpr(lambda vals: jax.tree.leaves(fn(jax.tree.unflatten(treedef, vals))))(
        leaves
    )
    outs = _affine(closed.jaxpr, [("in", k, 0) for k in range(len(leaves))])
    effects = []
    for k, out in enumerate(outs):
        if out is not None and out[:2] == ("in", k):
            effects.append(None if out[2] == 0 else out[2])
        else:
            effects.append("changed")
    return effects


_BOTH_CHANGE = (
    "pipeline_value_and_grad: first_fn and last_fn both change the shared non-trainable "
    "parameter '{path}' ({how}). They run on different devices (first_fn on stage 0, "
    "last_fn on stage p - 1), so the pipeline cannot apply one's change on top of the "
    "other's as one device would, and would keep only one of them. Only an Rng counter "
    "that each call advances by a fixed number of draws is merged exactly. Give first_fn "
    "and last_fn their own modules for this state (e.g. two Rngs: bx.Rng(g / 'rng_in') and "
    "bx.Rng(g / 'rng_out'))."
)


class _SharedPlan(NamedTuple):
    """Where each shared-state leaf's final value comes from: ``sources[k]`` is
    ``"keep"`` (neither function changes it), ``"first"`` (stage 0), ``"last"`` (stage
    p - 1) or ``"count"``; `counters` lists the counted leaves ``(k, a, b)``: an `Rng`
    counter ``first_fn`` advances by ``a`` per call and ``last_fn`` by ``b``."""

    sources: tuple[str, ...]
    counters: tuple[tuple[int, int, int], ...]


def _shared_plan(first_effects: list, last_effects: list, st_sh: Params) -> _SharedPlan:
    sources, counters = [], []
    leaves = jax.tree.leaves(st_sh)
    for k, (path, f, lst) in enumerate(zip(st_sh.keys(), first_effects, last_effects, strict=True)):
        if f is None or lst is None:
            sources.append("first" if lst is None else "last")
            if f is None and lst is None:
                sources[-1] = "keep"
            continue
        if f == "changed" or lst == "changed" or not jnp.issubdtype(leaves[k].dtype, jnp.integer):
            how = (
                "each call changes it in a way other than adding a constant"
                if "changed" in (f, lst)
                else f"advanced by {f} per first_fn call and {lst} per last_fn call"
            )
            raise ValueError(_BOTH_CHANGE.format(path=format_path(path), how=how))
        sources.append("count")
        counters.append((k, int(f), int(lst)))
    return _SharedPlan(tuple(sources), tuple(counters))


def _fold_rngs(cfg: _Static, local: Params, shared: Params) -> tuple[Params, Params, tuple, tuple]:
    """Folds the data index into the seeds of the listed `Rng` modules, in the stage params
    (leaves ``(v, ...)``: each chunk's seed) and in the shared params; returns the seeds
    to restore."""
    if not cfg.rngs or cfg.data_axis is None:
        return local, shared, (), ()
    axis = cfg.data_axis
    in_stage = [r for r in cfg.rngs if r.param_path("seed") in local]
    in_shared = [r for r in cfg.rngs if r.param_path("seed") in shared]
    seeds_st = tuple((r, r.get_seed(local)) for r in in_stage)
    seeds_sh = tuple((r, r.get_seed(shared)) for r in in_shared)
    if in_stage:
        local = jax.vmap(lambda t: fold_seeds(t, in_stage, axis)[0])(local)
    if in_shared:
        shared = fold_seeds(shared, in_shared, axis)[0]
    return local, shared, seeds_st, seeds_sh


def _check_fns(cfg: _Static, stage: Params, shared: Params, x: Any, h: Any, y: Any) -> Any:
    """Calls each function once, abstractly, on one microbatch: none may create a
    parameter (`check_no_new_params`), and with a data axis every `Rng` that draws must
    be listed in ``rngs`` (`check_rngs_listed`). Returns the stage output's type."""
    fns, where = cfg.fns, "pipeline_value_and_grad"
    out = []

    def probe():
        calls = [("stage_fn", "h", stage, lambda p: fns.plain_stage(p, h))]
        if fns.first is not None:
            calls.append(("first_fn", "x", shared, lambda p: fns.first(p, x)))
        calls.append(("last_fn", "h, y", shared, lambda p: fns.last(p, h, y)))
        for name, args, before, call in calls:
            result, after = _check_out(call(before), name, name, args)
            if name == "stage_fn":
                out.append(result)
            check_no_new_params(before, after, f"{where}: {name}")
            if cfg.data_axis is not None:
                check_rngs_listed(before, after, cfg.rngs, f"{where}: {name}")
        return out[0]

    return jax.eval_shape(probe)


def _permute_axes(jaxpr: Any) -> set:
    """The axis names of every ``ppermute`` in `jaxpr` and the jaxprs inside it (calls,
    branches, loop bodies, custom derivatives)."""
    out: set = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            out.update(_names(eqn.params["axis_name"]))
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    out |= _permute_axes(inner)
    return out


def _check_no_permutes(cfg: _Static, stage: Params, shared: Params, x: Any, h: Any, y: Any):
    """Raises if a function runs a ``ppermute`` (ring attention's, say): the cells are
    branches of a switch that the stages take differently in a slot, and a ``ppermute``
    is one collective of every device of the mesh, so the devices of the other stages
    would pair it with another cell's collective (wrong numbers) or never join it (a
    hang). All-reduces and all-gathers over an axis inside the stage (TP, FSDP, the
    all-gather variant of context parallelism) join only that axis's devices."""
    fns = cfg.fns
    calls = [("stage_fn", lambda: fns.plain_stage(stage, h))]
    if fns.first is not None:
        calls.append(("first_fn", lambda: fns.first(shared, x)))
    calls.append(("last_fn", lambda: fns.last(shared, h, y)))
    for name, call in calls:
        axes = _permute_axes(jax.make_jaxpr(call)().jaxpr)
        if axes:
            raise ValueError(
                f"pipeline_value_and_grad: {name} runs a ppermute over {sorted(axes)} (e.g. "
                "ring attention, context_variant='ring'). Inside the pipeline each stage "
                "runs its own cell in a slot, and a ppermute needs every device of the mesh "
                "at once, so it would pair with another stage's collective or hang. Build "
                "the attention with context_variant='allgather' (its all-gather joins only "
                "the context axis), or keep the ppermute out of the pipeline's functions."
            )


# -- integer state computed from the batch (DP x PP) --------------------------------------------
def _deps(jaxpr: Any, ins: list[bool]) -> list[bool]:
    """Per output of `jaxpr`: whether it depends on an input flagged in `ins` (data
    flow; through scans and while loops to a fixed point over the carry, conds by
    branch, and the jaxprs of calls; any other primitive: every output of a dependent
    input)."""
    dep = {v for v, d in zip(jaxpr.invars, ins, strict=True) if d}
    for eqn in jaxpr.eqns:
        d_in = [not isinstance(a, Literal) and a in dep for a in eqn.invars]
        if any(d_in):
            outs = _eqn_deps(eqn, d_in)
            dep.update(v for v, d in zip(eqn.outvars, outs, strict=True) if d)
    return [not isinstance(v, Literal) and v in dep for v in jaxpr.outvars]


def _eqn_deps(eqn: Any, d_in: list[bool]) -> list[bool]:
    p, name, n_out = eqn.params, eqn.primitive.name, len(eqn.outvars)
    inner = lambda j: getattr(j, "jaxpr", j)  # noqa: E731
    either = lambda a, b: [x or y for x, y in zip(a, b, strict=True)]  # noqa: E731
    if name == "scan":
        body, nc, nk = inner(p["jaxpr"]), p["num_consts"], p["num_carry"]
        consts, carry, xs = d_in[:nc], d_in[nc : nc + nk], d_in[nc + nk :]
        while True:
            out = _deps(body, consts + carry + xs)
            new = either(carry, out[:nk])
            if new == carry:
                return carry + out[nk:]
            carry = new
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cc, bc, carry = d_in[:cn], d_in[cn : cn + bn], d_in[cn + bn :]
        while True:
            if any(_deps(inner(p["cond_jaxpr"]), cc + carry)):
                return [True] * n_out  # the trip count depends on it
            new = either(carry, _deps(inner(p["body_jaxpr"]), bc + carry))
            if new == carry:
                return carry
            carry = new
    if name == "cond":
        if d_in[0]:
            return [True] * n_out
        outs = [False] * n_out
        for branch in p["branches"]:
            outs = either(outs, _deps(inner(branch), d_in[1:]))
        return outs
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = p.get(key)
        if sub is not None and hasattr(inner(sub), "eqns"):
            j = inner(sub)
            if len(j.invars) == len(d_in) and len(j.outvars) == n_out:
                return _deps(j, d_in)
    return [True] * n_out


_INT_STATE = (
    "pipeline_value_and_grad: the non-trainable parameter '{path}' ({dtype}) differs "
    "between the shards of the data axis {axis!r}: {fn} computes it from the batch (or "
    "from an Rng seed folded per shard), so each data shard's pipeline ends with another "
    "value, and an integer cannot be averaged back into one replicated value (the step "
    "would return one shard's, silently). Keep such a statistic in a floating dtype (it "
    "is then averaged over the shards, like BatchNorm's), or compute it outside the step."
)


def _check_int_state(cfg: _Static, stage: tuple, shared: tuple, x: Any, h: Any, y: Any) -> None:
    """With a data axis: no integer state may be computed from the batch (or from a seed
    that `rngs` folds per shard); it would differ between the data shards."""
    if cfg.data_axis is None:
        return
    fns = cfg.fns
    folded = {r.param_path("seed") for r in cfg.rngs}
    (tr, st), (tr_sh, st_sh) = stage, shared
    calls = [("stage_fn", tr, st, h, lambda p, d: fns.plain_stage(p, d))]
    if fns.first is not None:
        calls.append(("first_fn", tr_sh, st_sh, x, lambda p, d: fns.first(p, d)))
    calls.append(("last_fn", tr_sh, st_sh, (h, y), lambda p, d: fns.last(p, *d)))
    for name, tr_, st_, data, call in calls:
        keys = list(st_.keys())
        leaves, treedef = jax.tree.flatten(st_)
        flat, dtree = jax.tree.flatten(data)

        def f(vals, d, tr_=tr_, call=call, keys=keys, treedef=treedef, dtree=dtree):
            params = tr_.merge(jax.tree.unflatten(treedef, vals))
            new = call(params, jax.tree.unflatten(dtree, d))[1].arrays()
            return [new[k] for k in keys]

        closed = jax.make_jaxpr(f)(leaves, flat)
        ins = [k in folded for k in keys] + [True] * len(flat)
        for key, leaf, d in zip(keys, leaves, _deps(closed.jaxpr, ins), strict=True):
            # (a folded seed itself is restored after the step)
            if d and key not in folded and not jnp.issubdtype(leaf.dtype, jnp.inexact):
                raise ValueError(
                    _INT_STATE.format(
                        path=format_path(key), dtype=leaf.dtype, axis=cfg.data_axis, fn=name
                    )
                )


def _acc_zeros(tree: Any, reduce: Any) -> Any:
    """Zeros of each leaf's shape and varying axes, in its accumulation dtype."""
    return jax.tree.map(
        lambda x: _vary(
            jnp.zeros(jnp.shape(x), reduce_dtype_of(x.dtype, reduce)), tuple(varying_axes(x))
        ),
        tree,
    )


def _names(axis: str | tuple[str, ...] | None) -> tuple[str, ...]:
    """`axis` as a tuple of names (None: none), checked as DP checks its axes."""
    return () if axis is None else _axis_names(axis, "pipeline_value_and_grad")


def _device_axes(cfg: _Static) -> tuple[str, ...]:
    """The axes every value inside the step varies over: the stage and data axes (a
    context axis among them: each device holds its own part of the sequence)."""
    return (cfg.stage_axis, *_names(cfg.data_axis))


class _Local(NamedTuple):
    """One device's share of the step's arguments, typed as varying over the stage and
    data axes: its chunks' trainable params (leaves ``(v, ...)``: row ``c`` is chunk
    ``c``; FSDP leaves marked for `fsdp_call`) and state, the shared ones, its
    microbatches ``(m, b / m, ...)`` and the `Rng` seeds folded with the data index (to
    restore)."""

    tr: Params
    st: Params
    tr_sh: Params
    st_sh: Params
    xs: Any
    ys: Any
    seeds: tuple[tuple, tuple]


def _local(cfg: _Static, stage_params, shared_params, inputs, targets) -> _Local:
    """`_Local` from the shard_map's arguments. Every device computes its own values, so
    everything varies over the stage and data axes (no collective inside a cell;
    gradients are reduced once at the end); the model axis (TP layers inside the stage)
    keeps its types, so autodiff sums over it."""
    sched, axes = cfg.schedule, _device_axes(cfg)
    rows = (lambda x: x) if sched.virtual_stages == 1 else (lambda x: x[:, 0])
    local = _vary(jax.tree.map(rows, stage_params), axes)
    # DP x PP: the listed Rngs draw other keys on each data shard (restored at the end).
    local, shared, seeds_st, seeds_sh = _fold_rngs(cfg, local, _vary(shared_params, axes))
    tr, st = local.split()
    # FSDP inside the stage: gather before use, reduce-scatter the gradient (`fsdp_call`).
    rd = None if cfg.reduce is None else str(cfg.reduce)
    tr = _with_marks(tr, {k: (cfg.data_axis, d, rd) for k, d in cfg.fsdp})
    m = sched.num_microbatches
    xs, ys = (_split_batch(_vary(t, axes), m) for t in (inputs, targets))
    return _Local(tr, st, *shared.split(), xs, ys, (seeds_st, seeds_sh))


class _Probe(NamedTuple):
    """What tracing the three functions once on one microbatch gives (`_probe`)."""

    h_zero: Any  # zeros of the activation's type
    no_terms: _Terms  # zeros of the loss terms' types
    plan: _SharedPlan  # how the shared state both ends change is merged
    layout: _Layout  # the stage VJP's residuals
    last_aval: Any  # (loss, aux) types of last_fn


def _probe(cfg: _Static, d: _Local) -> _Probe:
    """Checks the three functions at trace time (`_check_fns`, `_check_int_state`, the
    activation kept by the stage) and probes the stage's VJP and the shared state."""
    fns, where, n = cfg.fns, "pipeline_value_and_grad", cfg.schedule.num_microbatches * cfg.dp
    x0, y0 = _take(d.xs, jnp.int32(0)), _take(d.ys, jnp.int32(0))
    tr0, st0 = _take(d.tr, jnp.int32(0)), _take(d.st, jnp.int32(0))
    tr_sh, st_sh = d.tr_sh, d.st_sh
    h_aval = jax.eval_shape(lambda: _first(fns, tr_sh, st_sh, x0)[0])
    h_zero = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), h_aval)
    h_zero = _vary(h_zero, _device_axes(cfg))
    out_aval = _check_fns(cfg, tr0.merge(st0), tr_sh.merge(st_sh), x0, h_zero, y0)
    _check_no_permutes(cfg, tr0.merge(st0), tr_sh.merge(st_sh), x0, h_zero, y0)
    _check_int_state(cfg, (tr0, st0), (tr_sh, st_sh), x0, h_zero, y0)
    _check_keeps_activation(where, h_aval, out_aval)
    last = lambda s: _last_loss(fns, tr_sh, s, h_zero, y0, n, cfg.reduce)[1]  # noqa: E731
    last_aval = jax.eval_shape(lambda: _last_out(fns, fns.last(tr_sh.merge(st_sh), h_zero, y0)))
    h_axes = _axes(h_zero)
    no_terms = jax.tree.map(
        lambda a: _vary(jnp.zeros(a.shape, a.dtype), (*varying_axes(a), *h_axes)),
        jax.eval_shape(lambda: last(st_sh)[0]),
    )
    # Shared state: which leaves first_fn and last_fn change (both: Rng counters, counted).
    first_eff = (
        _state_effects(lambda s: _first(fns, tr_sh, s, x0)[1], st_sh)
        if fns.first is not None
        else [None] * len(jax.tree.leaves(st_sh))
    )
    plan = _shared_plan(first_eff, _state_effects(lambda s: last(s)[1], st_sh), st_sh)
    layout = _residual_layout(fns, tr0, st0, h_zero, cfg.data_axis if cfg.fsdp else None)
    return _Probe(h_zero, no_terms, plan, layout, last_aval[:2])


def _context(cfg: _Static, d: _Local, probe: _Probe, table: np.ndarray) -> _Ctx:
    """The `_Ctx` every slot of this device sees: `table` is the program's `_COLUMNS`
    stacked ``(T, p, lanes, 9)``; the residuals of each chunk's params alone are computed
    here, once per step."""
    sched, layout, h_zero = cfg.schedule, probe.layout, probe.h_zero
    p, v = sched.num_stages, sched.virtual_stages
    per_chunk = [
        _param_residuals(layout, cfg.fns, _take(d.tr, k), _take(d.st, k), h_zero) for k in range(v)
    ]
    param_res = [jnp.stack(leaves) for leaves in zip(*per_chunk, strict=True)]
    kinds = table[..., _KIND]
    split = bool((kinds == WEIGHT).any())
    split_bwd = None
    if split or cfg.row_major:
        stash0 = [_vary(jnp.zeros(a.shape, a.dtype), _aval_vma(a)) for a in _stash_avals(layout)]
        pres0 = _take(param_res, jnp.int32(0))
        split_bwd = _split_backward(layout, stash0, pres0, h_zero, cfg.row_major)
    return _Ctx(
        fns=cfg.fns,
        layout=layout,
        program=jnp.asarray(table),
        lane_kinds=tuple(
            tuple(sorted({IDLE, *np.unique(kinds[..., lane]).tolist()}))
            for lane in range(kinds.shape[-1])
        ),
        split=split,
        split_bwd=split_bwd,
        num_stages=p,
        num_virtual=v * p,
        virtual=jnp.asarray(
            [[sched.virtual_stage(s, k) for s in range(p)] for k in range(v)], jnp.int32
        ),
        stage=lax.axis_index(cfg.stage_axis),
        n=sched.num_microbatches * cfg.dp,
        reduce=cfg.reduce,
        no_terms=probe.no_terms,
        counters=probe.plan.counters,
        st_sh0=d.st_sh,
        tr=d.tr,
        tr_sh=d.tr_sh,
        param_res=param_res,
        h_zero=h_zero,
        stage_axis=cfg.stage_axis,
        sends=_send_plan(table, sched),
    )


def _buffers(c: _Ctx, sizes: dict[str, int], st_sh: Params) -> _Buffers:
    """Zeroed buffers of the program's sizes, each entry typed as what it holds."""

    def ring(n, avals):
        return [_vary(jnp.zeros((n, *a.shape), a.dtype), _aval_vma(a)) for a in avals]

    def ring_like(n, tree):
        return jax.tree.map(
            lambda x: _vary(jnp.zeros((n, *x.shape), x.dtype), tuple(varying_axes(x))), tree
        )

    return _Buffers(
        (ring(sizes["stash"], _stash_avals(c.layout)), ring_like(sizes["stash"], st_sh)),
        ring_like(sizes["inbox_f"], c.h_zero),
        ring_like(sizes["inbox_b"], c.h_zero),
        ring(sizes["kept"], c.split_bwd.extra_avals) if c.split else [],
    )


def _pipeline_body(cfg: _Static, stage_params, shared_params, inputs, targets):
    """One device: its chunks' params (leaves ``(1, ...)``, or ``(v, 1, ...)`` with
    virtual stages), the shared params, its data shard. Probes the functions, sets up
    the slots' context and buffers, runs the table's slots in one ``lax.scan`` and
    reduces what they accumulated."""
    sched = cfg.schedule
    d = _local(cfg, stage_params, shared_params, inputs, targets)
    probe = _probe(cfg, d)
    prog = sched.program()
    table = np.stack([np.asarray(getattr(prog, name), np.int32) for name in _COLUMNS], -1)
    c = _context(cfg, d, probe, table)
    bufs = _buffers(c, prog.sizes, d.st_sh)
    acc = _Acc(_acc_zeros(d.tr, cfg.reduce), _acc_zeros(d.tr_sh, cfg.reduce), probe.no_terms,
               d.st, d.st_sh)  # fmt: skip
    (_, acc), _ = lax.scan(
        lambda carry, t: _slot(c, d.xs, d.ys, carry, t), (bufs, acc), jnp.arange(table.shape[0])
    )
    seeds_st, seeds_sh = d.seeds
    acc = acc._replace(st=restore_seeds(acc.st, seeds_st), st_sh=restore_seeds(acc.st_sh, seeds_sh))
    nv = sched.num_stages * sched.virtual_stages
    ends = (c.stage == sched.device_of(0)[0], c.stage == sched.device_of(nv - 1)[0])
    dtypes = (d.tr, d.tr_sh, probe.last_aval)
    return _reduce(cfg, acc, shared_params.split()[1], probe.plan, ends, dtypes)


def _settle_shared(
    cfg: _Static, plan: _SharedPlan, ends: tuple, st_sh_old: Params, st_sh_new: Params
) -> Params:
    """The shared state at the step's end, per leaf as `plan` says: unchanged, from the
    device of the first virtual stage (``first_fn``'s changes; `ends[0]`) or of the last
    (``last_fn``'s; `ends[1]`), or counted (a counter both advance by a fixed amount)."""
    m = cfg.schedule.num_microbatches

    def settle(source, k, old, new):
        if source == "keep":
            return old
        if source == "count":
            ((a, b),) = [(a, b) for j, a, b in plan.counters if j == k]
            return old + jnp.asarray(m * (a + b), old.dtype)
        on = ends[0] if source == "first" else ends[1]
        return lax.psum(jnp.where(on, new, jnp.zeros_like(new)), cfg.stage_axis)

    old_leaves, treedef = jax.tree.flatten(st_sh_old)
    new_leaves = jax.tree.leaves(st_sh_new)
    return jax.tree.unflatten(
        treedef,
        [
            settle(src, k, old, new)
            for k, (src, old, new) in enumerate(
                zip(plan.sources, old_leaves, new_leaves, strict=True)
            )
        ],
    )


def _over_data(x: jax.Array, data: str | tuple[str, ...]) -> jax.Array:
    """State leaf `x` made equal over the data shards: floating state (running
    statistics) averaged; integer state (Rng seed and counter), which advances alike on
    every shard, kept in its dtype (pmax of equal values)."""
    axes = tuple(a for a in _names(data) if a in varying_axes(x))
    if not axes:
        return x
    if jnp.issubdtype(x.dtype, jnp.floating):
        return lax.pmean(x, axes)
    return lax.pmax(x, axes)


def _reduce(
    cfg: _Static,
    acc: _Acc,
    st_sh_old: Params,
    plan: _SharedPlan,
    ends: tuple[jax.Array, jax.Array],
    dtypes: tuple[Params, Params, tuple[Any, Any]],
):
    """Loss, aux and gradients summed over the stages and the data axis (FSDP leaves
    arrive reduce-scattered over it: summed already), in the reduction dtype, then
    divided by the total weight (weighted losses) and cast to the params' (loss's, aux's)
    dtypes; the shared state as `plan` says (`_settle_shared`)."""
    axis, data = cfg.stage_axis, cfg.data_axis
    v = cfg.schedule.virtual_stages
    st_sh = _settle_shared(cfg, plan, ends, st_sh_old, acc.st_sh)
    terms, g_sh = lax.psum((acc.terms, acc.g_sh), axis)
    st = acc.st
    g = _without_marks(acc.g)
    if data is not None:
        # FSDP leaves arrive reduce-scattered over the data axis (the transpose of
        # `fsdp_call`'s gather): summed already; the others are summed by one psum.
        fsdp = dict(cfg.fsdp)
        arrays = g.arrays()  # in the order of g's leaves
        rep = [x for k, x in arrays.items() if k not in fsdp]
        terms, rep, g_sh = lax.psum((terms, rep, g_sh), data)
        it = iter(rep)
        g = jax.tree.unflatten(
            jax.tree.structure(g), [x if k in fsdp else next(it) for k, x in arrays.items()]
        )
        st, st_sh = jax.tree.map(lambda x: _over_data(x, data), (st, st_sh))
    loss, aux, w = terms
    if w is not None:
        denom = jnp.where(w > 0, w, jnp.ones((), w.dtype))
        div = lambda t: jax.tree.map(lambda x: x / denom.astype(x.dtype), t)  # noqa: E731
        loss, g, g_sh = div(loss), div(g), div(g_sh)
        aux = _aux_finish(aux, denom, w)
    tr, tr_sh, (loss_aval, aux_aval) = dtypes
    cast = lambda t, like: jax.tree.map(lambda x, y: x.astype(y.dtype), t, like)  # noqa: E731
    g, g_sh = cast(g, _without_marks(tr)), cast(g_sh, tr_sh)
    loss = loss.astype(loss_aval.dtype)
    if aux is not None:  # floating leaves back to their dtypes (integers were summed)
        aux = jax.tree.map(
            lambda x, y: x.astype(y.dtype) if jnp.issubdtype(y.dtype, jnp.floating) else x,
            aux,
            aux_aval,
        )
    # back to the input layout: (1, ...), or (v, 1, ...) with virtual stages
    lead = lambda t: jax.tree.map(lambda x: x if v == 1 else x[:, None], t)  # noqa: E731
    value = (loss, aux) if cfg.fns.has_aux else loss
    return value, (lead(g), g_sh), (lead(st), st_sh)


def pipeline_value_and_grad(
    stage_fn: Callable[[Params, Any], tuple[Any, Params]],
    last_fn: Callable[[Params, Any, Any], tuple[jax.Array, Params]],
    mesh: Mesh,
    *,
    schedule: str | Schedule = "1f1b",
    num_microbatches: int | None = None,
    first_fn: Callable[[Params, Any], tuple[Any, Params]] | None = None,
    stage_axis: str = "stage",
    data_axis: str | tuple[str, ...] | None = None,
    batch_spec: PartitionSpec | None = None,
    remat: bool = False,
    remat_policy: Callable[..., bool] | None = None,
    stage_specs: Params | None = None,
    virtual_stages: int | None = None,
    has_aux: bool = False,
    rngs: Sequence[Rng] = (),
    reduce_dtype: Any = None,
) -> Callable[..., tuple[Any, tuple[Params, Params], tuple[Params, Params]]]:
    """Builds ``step(stage_params, shared_params, inputs, targets)`` that runs a pipelined
    forward and backward after a GPipe, 1F1B, interleaved 1F1B, ZB-H1 or ZB-V schedule
    (or your `Schedule` table) and returns the mean loss, the gradients and the updated
    non-trainable state.

    The model is ``last_fn(first_fn(inputs) -> stage 0 -> ... -> stage p-1, targets)``:

    * `stage_fn` ``(params, h) -> (h', params)``: one stage, the same code for all
      ``p`` stages (e.g. a transformer block, or a `blox.Sequential` of several); its
      params are `stage_params` stacked along a leading dimension ``p`` (`stack_stages`)
      and sharded over `stage_axis`. ``h'`` must have the shape and dtype of ``h``. It may
      use tensor-parallel layers (`blox.parallel.ParallelTransformerBlock`, ...) over a
      third mesh axis: pass their layout as `stage_specs`.
    * `first_fn` ``(params, inputs_mb) -> (h, params)`` (optional; default identity): runs
      on stage 0 only, e.g. the token embedding.
    * `last_fn` ``(params, h, targets_mb) -> (loss, params)`` (with `has_aux`:
      ``((loss, aux), params)``): runs on stage ``p - 1`` only, e.g. final norm, head and
      the mean loss of one microbatch.

    `first_fn` and `last_fn` take `shared_params` (replicated on every stage; their
    gradients are summed over the stages, so a tied embedding used by both gets both
    contributions). The batch is split into ``m`` equal microbatches; the loss is the
    mean of the microbatch losses (equal to the full-batch loss when `last_fn` returns a
    mean) and the gradients are of that loss. With `data_axis`, the batch is first split
    over that axis (DP x PP): loss and gradients are averaged over it, once per step.

    Weighting (as `blox.parallel.dp_value_and_grad`): when `aux` is a dict with
    ``aux['weight']`` (the real examples or tokens the microbatch's loss averages over,
    e.g. ``jnp.sum(mask)``), the loss, the gradients and the floating aux leaves are
    ``sum_i w_i x_i / sum_i w_i`` over all microbatches of all data shards: the masked
    mean of the global batch, as DP and FSDP give it. A microbatch of weight 0 adds 0 to
    the loss and the gradients even when its loss is NaN (its stages' activations must
    be finite); integer aux leaves are summed, ``aux['weight']`` is the total.

    Shared state: `first_fn` (stage 0) and `last_fn` (stage ``p - 1``) each thread the
    shared non-trainable state through their microbatches; each leaf comes back with the
    changes of the function that changes it. A leaf both change must be an `Rng` counter
    (a fixed number of draws per call): it is counted as on one device (`first_fn` of
    microbatch ``i`` sees ``c0 + i (a + b)``, `last_fn` ``c0 + i (a + b) + a``: the
    one-device keys; ``c0 + m (a + b)`` returned); any other raises naming the leaf.

    Cost and memory: a time slot costs the same at any ``m`` (no buffer that grows with
    ``m`` enters a conditional). Kept from a microbatch's forward to its backward: the
    stage's residuals that depend on its input or state (``remat=True``: the input and
    what `remat_policy` saves); residuals of the params alone (casts, transposes) are
    computed once per step; the last stage differentiates `last_fn` in its forward slot
    and keeps only its output's cotangent; stage 0 recomputes `first_fn` in its backward.

    Shape legend: ``p`` stages, ``m`` microbatches, ``B`` global batch, ``D`` data-axis size.

    Args:
      stage_fn: as above. Non-trainable params it changes (RNG counters, BatchNorm
        statistics) are threaded through the forwards of its stage in microbatch order;
        with `data_axis`, floating ones are then averaged over it (integer ones computed
        from the batch raise).
      last_fn: as above; returns a floating scalar.
      mesh: a mesh with `stage_axis` (length ``p``), if given `data_axis`, and any axes
        `stage_specs` names (e.g. ``'model'`` for tensor parallelism).
      schedule: ``'gpipe'``, ``'1f1b'``, ``'1f1b-2f'`` (1F1B whose slots hold one
        backward or two forwards: less idle time, since a backward costs about two
        forwards, for up to ``2 (p - s)`` stashed microbatches on stage ``s``),
        ``'interleaved'`` (with `virtual_stages` ``v >= 2``: each device runs ``v``
        chunks, model stages ``s, p + s, ...``; bubble ``(p - 1) / (v m + p - 1)``, up to
        ``1 + (p - 1) / (v p)`` times 1F1B's stash), ``'zb'`` / ``'zb-h1'`` (zero bubble:
        the backward split into the input cotangent and the weight gradient, which fills
        the idle slots; 1F1B's stash), ``'zbv'`` / ``'zb-v'`` (ZB-V: two chunks per device
        in a V, device ``s`` running model stages ``s`` and ``2 p - 1 - s``, the backward
        split; stack the params in `Schedule.stacking_order`) or a `Schedule` for ``p``
        stages and ``m`` microbatches.
      num_microbatches: ``m``; required unless `schedule` is a `Schedule`.
      first_fn: as above; ``None`` passes the inputs to stage 0 unchanged.
      stage_axis: the pipeline mesh axis.
      data_axis: an optional data-parallel mesh axis, or a tuple of axes the loss and
        the gradients are reduced over: ``('data', 'context')`` with
        ``batch_spec=cp_batch_spec('data', 'context')`` splits the rows over ``data`` and
        the sequence over ``context`` (context parallelism inside the stages, whose
        attention is built with ``context_axis='context'``); every shard must then hold
        the same number of tokens (or give ``aux['weight']``), as in `make_dp_train_step`.
        The listed `rngs` are folded over every one of these axes.
      batch_spec: the ``PartitionSpec`` of every input and target leaf (default
        ``P(data_axis)``: the rows over the data axes). FSDP stage specs (below) take one
        data axis.
      remat: recompute the stage's activations in the backward
        (``jax.checkpoint``): only what `remat_policy` saves is stashed.
      remat_policy: a ``jax.checkpoint_policies`` policy; default (``None``) saves
        nothing but the stage input.
      stage_specs: the ``PartitionSpec`` of every parameter of *one* stage (a `Params` of
        specs with one stage's paths, e.g. ``bp.param_specs(stage0_params,
        bp.transformer_tp_rules())``); the stage axis is prepended. Default: each stage's
        params whole on its device. FSDP inside the stages: specs that also shard
        trainable leaves over `data_axis` (``bp.fsdp_specs(stage0_params, mesh,
        base=tp_specs)``) hand `stage_fn` local shards marked for `blox.parallel.fsdp_call`,
        which `stage_fn` must call per layer (gather before use, reduce-scatter of the
        gradient); those gradients are divided by ``D`` instead of averaged again.
        With virtual stages the leaves are sharded ``P(None, stage_axis, *spec)``.
      has_aux: `last_fn` returns ``((loss, aux), params)``; ``aux['weight']`` weights
        the mean (above); the step then returns ``(loss, aux)`` in place of ``loss``.
      rngs: the `Rng` modules whose seeds are folded with the `data_axis` index inside
        the step (`fold_seeds`) and restored after, as in `make_dp_train_step`: dropout
        masks differ between data shards (shard ``k`` runs as one device would with each
        listed seed replaced by ``fold_in(seed, k)``). In `stage_params` (each stage's
        seed) or `shared_params`. With `data_axis`, an `Rng` that draws in a function but
        is not listed raises. Without `data_axis` they are left as they are.
      reduce_dtype: the dtype of the gradient accumulation over microbatches, of the
        loss and aux sums and of the pipeline's collectives (the stage ``psum`` of the
        shared gradients, the data-axis ``psum``, FSDP stage leaves' reduce-scatter).
        Default ``None``: float32 for bf16 / fp16 leaves, each leaf's dtype otherwise
        (torchtitan's ``MixedPrecisionPolicy(reduce_dtype=float32)``). Gradients are
        returned in their params' dtypes, the loss in its own.
      virtual_stages: ``v``, the stage chunks per device (``'interleaved'`` needs
        ``v >= 2``); ``None``: 1, or the `Schedule`'s own. With ``v > 1`` the model has
        ``v p`` stages and `stage_params` leaves are ``(v, p, ...)``
        (``stack_stages(stages, virtual_stages=v)``, in the schedule's `stacking_order`);
        `first_fn` runs before model stage 0 (chunk 0 of device 0), `last_fn` after model
        stage ``v p - 1`` (chunk ``v - 1`` of device ``p - 1``; ZB-V: chunk 1 of device 0).

    Returns:
      ``step(stage_params, shared_params, inputs, targets) -> (loss, (stage_grads,
      shared_grads), (stage_params, shared_params))`` (``(loss, aux)`` first with
      `has_aux`), to call under ``jax.jit``:
      `stage_params` leaves ``(p, ...)`` (``(v, p, ...)`` with virtual stages), `inputs` /
      `targets` pytrees of ``(B, ...)``;
      ``loss`` a scalar; ``stage_grads`` / ``shared_grads`` the trainable parts of the
      params (``params.split()[0]`` structure) for ``optax``; the returned params are the
      inputs with their non-trainable state updated. Computation follows the dtypes of
      the params and activations; sums run in `reduce_dtype`.

    Multi-process runs: when the mesh spans several processes, `inputs` and `targets`
    must be global arrays on the mesh (`blox.distributed.global_batch`); a
    host (NumPy) array or a process-local ``jax.Array`` raises `make_dp_train_step`'s
    ``ValueError`` (each process's rows would be taken for the whole batch).

    Raises:
      ValueError: `stage_axis` / `data_axis` not in the mesh; the schedule's stage count
        is not the axis length; ``m < p`` under 1F1B; ``'interleaved'`` without
        `virtual_stages` ``>= 2``, or `virtual_stages` other than the `Schedule`'s; a
        stage-params leaf whose leading dimension is not ``p`` (dimensions not ``(v,
        p)``); a batch that ``m`` (times ``D``) does not divide; a stage
        that changes the activation's shape or dtype; `stage_specs` whose paths differ
        from the stage params', or that shard a non-trainable leaf over `data_axis`; a
        function that creates a parameter (initialize the model and lock its params
        first); with `data_axis`, an `Rng` that draws and is not in `rngs`, or integer
        state a function computes from the batch; an `Rng` in `rngs` that neither
        params hold; a shared non-trainable leaf that `first_fn` and
        `last_fn` both change, other than an `Rng` counter; a process-local batch on a
        multi-process mesh; a `reduce_dtype` that is not floating; a function that runs
        a ``ppermute`` (ring attention: use ``context_variant='allgather'`` in stages);
        the stage axis among the data axes; FSDP stage specs with several data axes; a
        `batch_spec` without `data_axis`, or a batch dimension its axes do not divide.
      TypeError: a function that does not return ``(outputs, params)``; `rngs` that are
        not `Rng` modules.

    Example:
      >>> import jax, jax.numpy as jnp, blox as bx
      >>> from blox.parallel import pipeline_value_and_grad, stack_stages
      >>> mesh = jax.make_mesh((4,), ('stage',), devices=jax.devices()[:4])
      >>> g = bx.Graph('block'); rng = bx.Rng(g / 'rng'); lin = bx.Linear(g / 'fc', 8, rng)
      >>> def init(seed):
      ...     p = rng.seed(bx.Params(), seed=seed)
      ...     return lin(p, jnp.zeros((1, 8)))[1].locked()
      >>> stages = stack_stages([init(s) for s in range(4)])
      >>> def stage_fn(params, h):
      ...     y, params = lin(params, h)
      ...     return jnp.tanh(y), params
      >>> def last_fn(params, h, y):
      ...     return jnp.mean((h - y) ** 2), params
      >>> step = jax.jit(pipeline_value_and_grad(
      ...     stage_fn, last_fn, mesh, schedule='1f1b', num_microbatches=4))
      >>> x = jnp.ones((8, 8)); y = jnp.zeros((8, 8))
      >>> loss, (g_stage, g_shared), _ = step(stages, bx.Params().locked(), x, y)
      >>> g_stage['block', 'fc', 'kernel'].value.shape
      (4, 8, 8)
    """
    where = "pipeline_value_and_grad"
    sched, p, dp = _resolve_schedule(
        where, mesh, schedule, num_microbatches, virtual_stages, stage_axis, data_axis
    )
    m, v = sched.num_microbatches, sched.virtual_stages
    rngs = _check_rngs(rngs, where)
    reduce = check_reduce_dtype(reduce_dtype, where)

    def call_stage(params: Params, h: Any) -> tuple[Any, Params]:
        return _check_out(stage_fn(params, h), "stage_fn", "stage_fn", "h")

    plain_stage = call_stage
    if remat:
        call_stage = jax.checkpoint(call_stage, policy=remat_policy)  # noqa: F811
    fns = _Fns(call_stage, first_fn, last_fn, bool(has_aux), plain_stage)
    cpu = all(d.platform == "cpu" for d in mesh.devices.flat)
    cfg = _Static(fns, sched, stage_axis, data_axis, dp=dp, reduce=reduce, rngs=rngs, row_major=cpu)
    batch = PartitionSpec(data_axis) if batch_spec is None else batch_spec
    if batch_spec is not None and data_axis is None:
        raise ValueError(f"{where}: batch_spec={batch_spec} needs data_axis= (the axes it splits).")

    def step(stage_params: Params, shared_params: Params, inputs: Any, targets: Any):
        _check_step_args(
            where, stage_params, shared_params, inputs, targets, (p, v), stage_axis, m,
            None if data_axis is not None else 1,
        )  # fmt: skip
        if data_axis is not None:  # rows over the data axes x m, other dims their axes
            _check_batch_rows((inputs, targets), mesh, batch, m, data_axis, where)
        # A multi-process mesh takes global arrays only (DP's check and message).
        _check_global_batch((inputs, targets), mesh, data_axis, where)
        _check_rngs_seeded(where, rngs, stage_params, shared_params)
        specs = _stage_partition_specs(where, stage_params, stage_specs, stage_axis, v)
        fsdp = _stage_fsdp_dims(where, stage_params, stage_specs, data_axis)
        rep = jax.tree.map(lambda _: PartitionSpec(), shared_params)
        out_specs = (
            (PartitionSpec(), PartitionSpec()) if has_aux else PartitionSpec(),
            (specs.split()[0], rep.split()[0]),
            (specs.split()[1], rep.split()[1]),
        )
        f = jax.shard_map(
            lambda *a: _pipeline_body(cfg._replace(fsdp=fsdp), *a),
            mesh=mesh,
            in_specs=(specs, rep, batch, batch),
            out_specs=out_specs,
        )
        put = lambda tree, spec: jax.tree.map(lambda x, s: constrain(x, mesh, s), tree, spec)  # noqa: E731
        value, grads, (st, st_sh) = f(
            put(stage_params, specs),
            put(shared_params, rep),
            jax.tree.map(lambda x: constrain(x, mesh, batch), inputs),
            jax.tree.map(lambda x: constrain(x, mesh, batch), targets),
        )
        return value, grads, (stage_params.merge(st), shared_params.merge(st_sh))

    return step


def _check_rngs_seeded(where: str, rngs: tuple, stage_params: Params, shared: Params) -> None:
    """Every listed `Rng` has its seed in the stage or the shared params."""
    for r in rngs:
        if r.param_path("seed") not in stage_params and r.param_path("seed") not in shared:
            raise ValueError(
                f"{where}: rngs lists the Rng '{r.path_str}', whose seed is in neither "
                "stage_params nor shared_params; list the Rngs the model's functions "
                "draw from, seeded in the params you pass (rng.seed(params, seed=...))."
            )


def _stage_partition_specs(
    where: str, stage_params: Params, stage_specs: Params | None, stage_axis: str, v: int
) -> Params:
    """Per stage-params leaf: ``P(stage_axis, *spec of one stage)`` (``P(None,
    stage_axis, ...)`` with ``v > 1`` virtual stages)."""
    lead = (stage_axis,) if v == 1 else (None, stage_axis)
    if stage_specs is None:
        return jax.tree.map(lambda _: PartitionSpec(*lead), stage_params)
    if not isinstance(stage_specs, Params):
        raise TypeError(
            f"{where}: stage_specs must be Params of PartitionSpec (e.g. "
            f"bp.param_specs(one_stage_params, rules)), got {type(stage_specs).__name__}."
        )
    mine, theirs = set(stage_params.keys()), set(stage_specs.keys())
    if mine != theirs:
        diff = sorted(format_path(k) for k in mine ^ theirs)
        raise ValueError(
            f"{where}: stage_specs and stage_params have different paths, e.g. {diff[:3]}; "
            "build the specs from one stage's params (bp.param_specs(stage0, rules))."
        )
    by_name = {format_path(k): stage_specs[k].value for k in theirs}
    return jax.tree_util.tree_map_with_path(
        lambda kp, _: PartitionSpec(*lead, *(by_name[kp[0].key] or ())), stage_params
    )


def _stage_fsdp_dims(
    where: str, stage_params: Params, stage_specs: Params | None, data_axis: Any
) -> tuple[tuple[Path, int], ...]:
    """``((path, dim), ...)`` of the stage leaves whose spec shards ``dim`` (of one stage)
    over `data_axis` (FSDP inside the stages); checks they are trainable."""
    if stage_specs is None or data_axis is None:
        return ()
    names = _names(data_axis)
    if len(names) > 1:
        over = sorted({format_path(k) for a in names for k in _sharded_dims(stage_specs, a, where)})
        if over:
            raise ValueError(
                f"{where}: stage_specs shard {over[:3]} over the data axes {names}; FSDP "
                "inside the stages takes one data axis: shard them over that one only, or "
                "pass data_axis= one axis."
            )
        return ()
    dims = _sharded_dims(stage_specs, data_axis, where)
    trainable = set(stage_params.split()[0].keys())
    for key in dims:
        if key not in trainable:
            raise ValueError(
                f"{where}: stage_specs shard the non-trainable '{format_path(key)}' over the "
                f"data axis {data_axis!r}; only trainable leaves can be FSDP-sharded (build "
                "the specs with bp.fsdp_specs, which leaves state as its base spec has it)."
            )
    return tuple((key, dims[key]) for key in stage_params.keys() if key in dims)


def _resolve_schedule(
    where: str,
    mesh: Mesh,
    schedule: str | Schedule,
    num_microbatches: int | None,
    virtual_stages: int | None,
    stage_axis: str,
    data_axis: str | tuple[str, ...] | None,
) -> tuple[Schedule, int, int]:
    """Checks the mesh axes and the schedule; returns ``(schedule, p, data-axes size)``."""
    names = tuple(mesh.axis_names)
    for label, ax in (("stage_axis", stage_axis), *(("data_axis", a) for a in _names(data_axis))):
        if ax is not None and ax not in names:
            raise ValueError(
                f"{where}: {label}={ax!r} is not an axis of the mesh {names}; build the mesh "
                f"with that axis, or pass {label}= one of {names}."
            )
    p = int(mesh.shape[stage_axis])
    if virtual_stages is not None:
        _check_virtual(where, virtual_stages)
    if isinstance(schedule, Schedule):
        if schedule.num_stages != p:
            raise ValueError(
                f"{where}: the schedule has num_stages={schedule.num_stages} but mesh axis "
                f"{stage_axis!r} has {p} devices; build the schedule for {p} stages or a mesh "
                f"with {schedule.num_stages} devices on {stage_axis!r}."
            )
        if num_microbatches is not None and num_microbatches != schedule.num_microbatches:
            raise ValueError(
                f"{where}: num_microbatches={num_microbatches} but the schedule has "
                f"{schedule.num_microbatches}; leave num_microbatches out."
            )
        if virtual_stages is not None and virtual_stages != schedule.virtual_stages:
            raise ValueError(
                f"{where}: virtual_stages={virtual_stages} but the schedule "
                f"{schedule.name!r} has virtual_stages={schedule.virtual_stages}; leave "
                "virtual_stages out, or build the schedule with it."
            )
        sched = schedule
    else:
        if num_microbatches is None:
            raise ValueError(
                f"{where}: pass num_microbatches= with schedule={schedule!r} (or a Schedule)."
            )
        sched = schedule_from(schedule, p, num_microbatches, virtual_stages=virtual_stages)
    dp = math.prod(int(mesh.shape[a]) for a in _names(data_axis))
    if stage_axis in _names(data_axis):
        raise ValueError(
            f"{where}: data_axis={data_axis!r} names the stage axis {stage_axis!r}; the "
            "data axes split the batch, the stage axis the model."
        )
    return sched, p, dp


def _check_step_args(
    where: str,
    stage_params: Any,
    shared_params: Any,
    inputs: Any,
    targets: Any,
    pv: tuple[int, int],
    stage_axis: str,
    m: int,
    dp: int | None,
) -> None:
    """The checks `step` runs before tracing: Params types, the stage dimensions ``(p,)``
    (``(v, p)`` with virtual stages), batch."""
    for label, tree in (("stage_params", stage_params), ("shared_params", shared_params)):
        if not isinstance(tree, Params):
            raise TypeError(f"{where}: {label} must be Params, got {type(tree).__name__}.")
    p, v = pv
    for path in stage_params.keys():
        shape = jnp.shape(stage_params[path].value)
        if v > 1 and tuple(shape[:2]) != (v, p):
            raise ValueError(
                f"{where}: stage parameter '{format_path(path)}' has shape {shape}, whose "
                f"leading dimensions should be (virtual_stages, stages) = ({v}, {p}) for the "
                f"{v} chunks per device of mesh axis {stage_axis!r}; stack the {v * p} "
                f"stages with stack_stages(stages, virtual_stages={v})."
            )
        if v == 1 and (not shape or shape[0] != p):
            raise ValueError(
                f"{where}: stage parameter '{format_path(path)}' has shape {shape}, whose "
                f"leading (stage) dimension should be the {p} devices of mesh axis "
                f"{stage_axis!r}; stack one Params per stage with stack_stages (got "
                f"{shape[0] if shape else 'a scalar'} stages)."
            )
    for what, tree in (("inputs", inputs), ("targets", targets)) if dp is not None else ():
        for kp, x in jax.tree_util.tree_leaves_with_path(tree):
            b = jnp.shape(x)[0] if jnp.ndim(x) else None
            if b is None or b % (m * dp):
                raise ValueError(
                    f"{where}: {what}{jax.tree_util.keystr(kp)} has batch size {b}, which "
                    f"num_microbatches={m} x data-parallel {dp} does not divide; use a "
                    f"batch that is a multiple of {m * dp}."
                )


def _check_keeps_activation(where: str, h_aval: Any, out_aval: Any) -> None:
    shapes = lambda t: jax.tree.map(lambda a: (a.shape, a.dtype), t)  # noqa: E731
    if shapes(out_aval) != shapes(h_aval):
        raise ValueError(
            f"{where}: stage_fn maps an activation {_fmt(h_aval)} to {_fmt(out_aval)}; "
            "every stage must keep the activation's shape and dtype (the stages pass it "
            "on through fixed buffers). Move shape changes into first_fn / last_fn."
        )


def _fmt(aval: Any) -> str:
    return str(jax.tree.map(lambda a: f"{a.dtype}{list(a.shape)}", aval))
