"""Data parallelism: gradients inside the shard, accumulated over microbatches, with
one explicit all-reduce per step; and a train step built from it.

The gradient trap this module exists for (``jax.shard_map`` with ``check_vma=True``, the
default): params passed with ``P()`` are *invariant* over the data axis, and JAX's
autodiff transposes their implicit broadcast into a ``psum``. So ``jax.grad`` of a
per-shard loss already returns the gradient **summed** over the data shards, and a
hand-written ``pmean(grads, 'data')`` on top (a no-op on invariant values) gives N times
the single-device gradient, silently. Here the trainable params are first cast to
*varying* over the data axis (``jax.lax.pcast(..., to='varying')``), so the gradients of
each microbatch stay local, are summed locally over the microbatches, and are all-reduced
once (``psum``) and divided by the total weight: the large-batch gradient, exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from blox.core import Params, Rng
from blox.core._guards import (
    check_no_new_params,
    check_placement,
    check_reduce_dtype,
    check_rngs_listed,
    optimizer_update,
    reduce_dtype_of,
    to_reduce_dtype,
)
from blox.core._params import Path, format_path
from blox.parallel._collectives import check_axis
from blox.parallel._mesh import check_vma_enabled, constrain, varying_axes
from blox.parallel._rng import fold_seeds, restore_seeds

__all__ = ["dp_value_and_grad", "make_dp_train_step", "split_batch"]

WEIGHT_KEY = "weight"

_BAD_RETURN = (
    "{where}: loss_fn must return (loss, params), or ((loss, aux), params) with "
    "has_aux=True, the params being those the model returned; got {got}. Write it as:\n"
    "    def loss_fn(params, x, y):\n"
    "        y_hat, params = model(params, x)\n"
    "        return loss, params"
)


_HOST_BATCH = (
    "{where}: batch leaf {leaf} is {what}, but the mesh spans {n} processes. "
    "Each process would pass its own rows where the step expects the global batch, and "
    "the step would train on another batch without an error. Assemble the global batch "
    "from every process's rows with blox.distributed.global_batch first:\n"
    "    batch = blox.distributed.global_batch(\n"
    "        local_rows, NamedSharding(mesh, P({axis!r})), global_batch_size)\n"
    "and pass that global array to the step in place of the local rows."
)


def _axis_names(axis: Any, where: str) -> tuple[str, ...]:
    """The data axis `axis` as a tuple of names: one mesh-axis name or a tuple of
    distinct names (TypeError naming `where` otherwise). Shared by DP and FSDP."""
    names = (axis,) if isinstance(axis, str) else axis
    if (
        not isinstance(names, tuple)
        or not names
        or not all(isinstance(n, str) and n for n in names)
        or len(set(names)) != len(names)
    ):
        raise TypeError(
            f"{where}: axis must be a mesh-axis name or a tuple of distinct names (e.g. "
            f"('data', 'context') for data x context parallelism), got {axis!r}."
        )
    return names


def _check_data_axis(mesh: Any, axis: Any, where: str) -> tuple[str, ...]:
    """`mesh` is a ``Mesh`` holding the data axis `axis`, one name or a tuple of
    distinct names (TypeError / ValueError naming `where`); returns the names. Shared
    by the DP and FSDP entry points."""
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"{where}: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}. Build "
            "one with blox.parallel.make_mesh."
        )
    names = _axis_names(axis, where)
    missing = [n for n in names if n not in mesh.axis_names]
    if missing and isinstance(axis, str):
        raise ValueError(
            f"{where}: data axis {axis!r} is not an axis of the mesh {dict(mesh.shape)}. "
            f"Pass axis=<one of {tuple(mesh.axis_names)}>."
        )
    if missing:
        raise ValueError(
            f"{where}: data axis {missing[0]!r} of axis={axis!r} is not an axis of the mesh "
            f"{dict(mesh.shape)}. Pass a tuple of axes among {tuple(mesh.axis_names)}."
        )
    return names


def _process_local(leaf: Any) -> str | None:
    """What makes a batch leaf one process's data rather than a global array (None if
    it is global): a host (NumPy) array, a jax.Array on this process's devices only, or,
    under ``jax.jit``, a value traced from either (its type carries no mesh)."""
    if not isinstance(leaf, jax.Array):
        return f"a host {type(leaf).__name__}, not a global jax.Array"
    if isinstance(leaf, jax.core.Tracer):
        mesh = getattr(jax.typeof(leaf).sharding, "mesh", None)
        if mesh is not None and mesh.empty:
            return (
                "traced from a host (NumPy) array or a process-local jax.Array (it is not "
                "placed on the mesh)"
            )
        return None
    if leaf.is_fully_addressable:
        return "a process-local jax.Array (on this process's devices only)"
    return None


def _check_global_batch(
    batch: Any, mesh: Mesh, axis: Any, where: str = "make_dp_train_step"
) -> None:
    """With a mesh over several processes, refuses batch leaves that hold one process's
    rows (see `_process_local`); the message names `where`, the step's builder."""
    n = len({d.process_index for d in mesh.devices.flat})
    if n < 2:
        return
    for kp, leaf in jax.tree_util.tree_leaves_with_path(batch):
        what = _process_local(leaf)
        if what is not None:
            name = f"batch{jax.tree_util.keystr(kp)}"
            raise ValueError(_HOST_BATCH.format(where=where, leaf=name, what=what, n=n, axis=axis))


def _unpack(out: Any, has_aux: bool, where: str) -> tuple[jax.Array, Any, Params]:
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Params)):
        raise TypeError(_BAD_RETURN.format(where=where, got=type(out).__name__))
    value, params = out
    if has_aux:
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(
                f"{where}: with has_aux=True, loss_fn returns ((loss, aux), params); got a "
                f"first element of type {type(value).__name__}."
            )
        loss, aux = value
    else:
        loss, aux = value, None
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(
            f"{where}: the loss must be a floating scalar, got {loss.dtype} of shape "
            f"{tuple(loss.shape)}. Reduce it, e.g. jnp.mean(...)."
        )
    if isinstance(aux, dict) and WEIGHT_KEY in aux:
        w = jnp.asarray(aux[WEIGHT_KEY])
        if w.shape != () or not (
            jnp.issubdtype(w.dtype, jnp.floating) or jnp.issubdtype(w.dtype, jnp.integer)
        ):
            raise ValueError(
                f"{where}: aux['weight'] must be a number scalar (the real examples or tokens "
                f"the loss averages over), got {w.dtype} of shape {tuple(w.shape)}."
            )
    return loss, aux, params


def split_batch(batch: Any, parts: int, *, where: str = "split_batch") -> Any:
    """Reshapes every leaf ``(B, ...)`` of `batch` to ``(parts, B / parts, ...)``.

    Raises:
      ValueError: a scalar leaf, or ``B`` not divisible by `parts` (names the leaf).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(batch)
    out = []
    for kp, leaf in flat:
        shape = tuple(jnp.shape(leaf))
        if not shape or shape[0] % parts:
            what = "is a scalar" if not shape else f"has {shape[0]} rows"
            raise ValueError(
                f"{where}: batch leaf {jax.tree_util.keystr(kp) or '<root>'} of shape {shape} "
                f"{what}, which cannot be split into {parts} equal microbatches. Use a per-"
                f"shard batch that is a multiple of {parts}."
            )
        out.append(jnp.reshape(leaf, (parts, shape[0] // parts) + shape[1:]))
    return jax.tree_util.tree_unflatten(treedef, out)


def _to_varying(tree: Any, axis: tuple[str, ...]) -> Any:
    def one(x):
        missing = tuple(a for a in axis if a not in varying_axes(x))
        return jax.lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(one, tree)


def _weight(aux: Any, loss: jax.Array) -> jax.Array | None:
    if isinstance(aux, dict) and WEIGHT_KEY in aux:
        return jnp.asarray(aux[WEIGHT_KEY]).astype(loss.dtype)
    return None


def accumulate_microbatches(
    loss_fn: Callable,
    trainable_v: Params,
    rest: Params,
    batch: tuple,
    *,
    k: int,
    size: int,
    names: tuple[str, ...],
    has_aux: bool,
    predicate: Callable | None,
    where: str,
    clean_state: Callable[[Params], Params] = lambda p: p,
    clean_grads: Callable[[Params], Params] = lambda g: g,
    reduced_inside: frozenset = frozenset(),
    rngs: Sequence[Rng] = (),
    reduce_dtype: Any = None,
) -> tuple[Any, Params]:
    """The local (not yet reduced) sums of one shard's `k` microbatches, shared by the DP
    and FSDP gradients: ``((grads, (loss, aux), weight), rest)``, weighted as `_weight`
    says, with the non-trainable state threaded through the microbatches in order.

    `clean_state` / `clean_grads` strip what the caller added to the params for the
    forward (FSDP's shard marks) from the returned state and gradients.
    `reduced_inside`: paths whose gradients the backward already summed over the axis
    (FSDP's per-layer reduce-scatter); of a weight-0 part, only the other, local ones
    lose their non-finite entries.
    Each call of `loss_fn` is checked (at trace time) for parameters it creates
    (`check_no_new_params`) and for `Rng` counters it advances whose `Rng` is not in
    `rngs` (`check_rngs_listed`). The sums (gradients, loss, floating aux, weight) are
    kept in `reduce_dtype` (`reduce_dtype_of`: float32 for bf16/fp16 values by default).
    """

    def one(nt, mb):
        def inner(t):
            given = t.merge(nt)
            loss, aux, new = _unpack(loss_fn(given, *mb), has_aux, where)
            check_no_new_params(given, new, where)
            check_rngs_listed(given, new, rngs, where)
            loss = loss.astype(reduce_dtype_of(loss.dtype, reduce_dtype))
            w = _weight(aux, loss)
            if w is None:
                scaled = loss / jnp.asarray(k * size, loss.dtype)
            else:
                w = jax.lax.stop_gradient(w)
                scaled = jnp.where(w > 0, loss * w, jnp.zeros((), loss.dtype))
            return scaled, (loss, aux, w, clean_state(new.split(predicate)[1]))

        grads, (loss, aux, w, new_nt) = jax.grad(inner, has_aux=True)(trainable_v)
        # Summed over microbatches and shards in reduce_dtype (f32 for bf16 gradients).
        grads = to_reduce_dtype(clean_grads(grads), reduce_dtype)
        if w is not None:
            grads = _drop_nonfinite_of_weight0(grads, w, reduced_inside)
        if w is None:
            terms = (
                loss / jnp.asarray(k * size, loss.dtype),
                _aux_terms(aux, None, k * size, reduce_dtype),
            )
        else:
            terms = (
                jnp.where(w > 0, loss * w, jnp.zeros((), loss.dtype)),
                _aux_terms(aux, w, k * size, reduce_dtype),
            )
        return (grads, terms, w), new_nt

    if k == 1:
        return one(rest, batch)
    return _scan_microbatches(one, rest, split_batch(batch, k, where=where), names)


def _drop_nonfinite_of_weight0(grads: Params, w: jax.Array, reduced_inside: frozenset) -> Params:
    """A weight-0 microbatch (all padding) contributes nothing of its own: the loss's
    ``where`` sends it a zero cotangent, but an unguarded masked mean (0/0) turns that
    into NaN in the backward, so non-finite entries are dropped. Finite ones stay: they
    are zero, except what a collective in the loss (a global term over every shard, e.g.
    an MoE's balancing loss) sends this shard from the others. Paths in
    `reduced_inside` (already summed over the axis in the backward) are kept whole."""

    def zero(g):
        return jnp.where((w > 0) | jnp.isfinite(g), g, jnp.zeros((), g.dtype))

    values = tuple(
        g if key in reduced_inside else zero(g)
        for key, g in zip(grads.keys(), grads.leaves(), strict=True)
    )
    return grads.with_leaves(values)


def _scan_microbatches(one: Callable, rest: Params, micro: Any, names: tuple[str, ...]):
    """``lax.scan`` of ``one(state, microbatch) -> (sums, state)`` over the stacked
    microbatches `micro`, summing the sums and threading the state in order."""
    first = jax.tree.map(lambda x: x[0], micro)
    # Carry types: state that comes out varying over the axis must go in varying.
    for _ in range(3):
        out = jax.eval_shape(one, rest, first)
        promote = jax.tree.map(lambda r, o: bool(varying_axes(o) - varying_axes(r)), rest, out[1])
        if not any(jax.tree.leaves(promote)):
            break
        rest = jax.tree.map(lambda r, p: _to_varying(r, names) if p else r, rest, promote)
    zeros = jax.tree.map(
        lambda s: _to_varying(jnp.zeros(s.shape, s.dtype), tuple(varying_axes(s))),
        out[0],
    )

    def body(carry, mb):
        acc, nt = carry
        new, nt = one(nt, mb)
        return (jax.tree.map(jnp.add, acc, new), nt), None

    (sums, rest), _ = jax.lax.scan(body, (zeros, rest), micro)
    return sums, rest


def dp_value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    axis: str | tuple[str, ...] = "data",
    microbatches: int = 1,
    has_aux: bool = False,
    predicate: Callable[[Path, Any], bool] | None = None,
    rngs: Sequence[Rng] = (),
    reduce_dtype: Any = None,
) -> Callable[..., Any]:
    """Data-parallel gradients, to call **inside** ``jax.shard_map``: local gradients
    over `microbatches` splits of this shard's batch, summed locally, then one
    all-reduce over `axis`.

    ``loss_fn(params, *batch)`` returns ``(loss, params)`` or, with `has_aux`,
    ``((loss, aux), params)``, as `blox.value_and_grad`. The result::

        loss, grads, params = f(params, *batch)            # has_aux=False
        (loss, aux), grads, params = f(params, *batch)     # has_aux=True

    gives the gradient of the loss over the **whole global batch** (all shards, all
    microbatches), identical on every device (invariant over `axis`), for the
    trainable params (``params.split(predicate)[0]``); `params` carries the
    non-trainable state after the last microbatch.

    Weighting: without a weight, every microbatch counts equally (exact when the loss is
    a mean over examples, since all microbatches have the same size). When `aux` is a
    dict with ``aux['weight']`` (the number of real examples or tokens the microbatch's
    loss averages over, e.g. ``jnp.sum(mask)``), the loss, the gradients and the
    floating aux leaves are ``sum_i w_i x_i / sum_i w_i`` over all microbatches of all
    shards: the large-batch masked mean, however unevenly padding falls. A microbatch of
    weight 0 (an all-padding microbatch or shard) contributes 0 to the loss *and* to the
    gradients, even when its loss is NaN (a masked mean over no rows is ``0 / 0``); a
    total weight of 0 gives 0. Integer aux
    leaves are summed; ``aux['weight']`` returns the global total.

    Non-trainable state: leaves that come out varying over `axis` (e.g. `BatchNorm`
    running statistics computed without ``axis_name``) are averaged over `axis` if
    floating, and raise otherwise (an RNG seed folded per shard and not restored; see
    `fold_seeds`). With ``axis_name=axis`` a `BatchNorm` already averages its batch
    statistics over the shards.

    Args:
      loss_fn: ``(params, *batch) -> (loss, params)`` (or ``((loss, aux), params)``).
      axis: the data axis (bound by the enclosing ``shard_map``), or a tuple of axes.
      microbatches: ``k``; splits of the per-shard batch run one after the other in a
        ``jax.lax.scan`` (memory of one microbatch).
      has_aux: see above.
      predicate: ``(path, Param) -> bool`` choosing the differentiated params (default:
        the trainable flag).
      rngs: `Rng` modules whose seeds are folded with the index along `axis` for the
        forward passes (`fold_seeds`: dropout differs per shard) and restored after.
        Every `Rng` that draws keys in `loss_fn` must be listed: an unlisted one would
        draw the same keys on every shard, so it raises (at trace time) naming its path.
        (An Rng draws when `loss_fn` returns another array for its counter than the one
        it received; one that only passes through is not flagged.)
      reduce_dtype: the dtype the gradients, the loss and the floating aux are summed in,
        over the microbatches and in the all-reduce (default ``None``: float32 for
        bf16/fp16 values, else their own dtype; torchtitan's ``reduce_dtype``). The
        gradients are returned in their params' dtypes.

    Returns:
      ``f(params, *batch)`` as above. Works with ``check_vma=True`` (the default) and
      ``False``.

    Raises:
      ValueError: `axis` not bound (called outside ``shard_map``), a per-shard batch not
        divisible by `microbatches`; an `Rng` that draws keys in `loss_fn` but is not in
        `rngs`; a parameter first created in `loss_fn`.
    """
    return _dp_value_and_grad(
        loss_fn,
        axis=axis,
        microbatches=microbatches,
        has_aux=has_aux,
        predicate=predicate,
        rngs=rngs,
        reduce_dtype=reduce_dtype,
        where="dp_value_and_grad",
    )


def _dp_value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    axis: str | tuple[str, ...],
    microbatches: int,
    has_aux: bool,
    predicate: Callable[[Path, Any], bool] | None,
    rngs: Sequence[Rng],
    reduce_dtype: Any,
    where: str,
) -> Callable[..., Any]:
    """`dp_value_and_grad`, naming `where` (the public entry point) in its messages."""
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"{where}: microbatches must be an int >= 1, got {microbatches!r}.")
    rngs = _check_rngs(rngs, where)
    reduce_dtype = check_reduce_dtype(reduce_dtype, where)

    def f(params: Params, *batch: Any):
        names = check_axis(axis, where)
        if not isinstance(params, Params):
            raise TypeError(
                f"{where}: the first argument must be bx.Params, got {type(params).__name__}."
            )
        k = microbatches
        size = 1
        for n in names:
            size *= jax.lax.axis_size(n)
        params, seeds = fold_seeds(params, rngs, names)
        trainable, rest = params.split(predicate)
        # Local gradients: make the params vary over the data axis, so autodiff does not
        # insert a psum per microbatch (check_vma=True) and the one psum below is the sum.
        trainable_v = _to_varying(trainable, names)

        sums, rest = accumulate_microbatches(
            loss_fn,
            trainable_v,
            rest,
            batch,
            k=k,
            size=size,
            names=names,
            has_aux=has_aux,
            predicate=predicate,
            where=where,
            rngs=rngs,
            reduce_dtype=reduce_dtype,
        )
        grads, (loss, aux), w = sums
        # The one all-reduce of the step (gradients, loss, metrics and weight together).
        reduce_axis = names if len(names) > 1 else names[0]
        grads, loss, aux, w = jax.lax.psum((grads, loss, aux, w), reduce_axis)
        if w is not None:
            denom = jnp.where(w > 0, w, jnp.ones((), w.dtype))
            grads = jax.tree.map(lambda g: g / denom.astype(g.dtype), grads)
            loss = loss / denom.astype(loss.dtype)
            aux = _aux_finish(aux, denom, w)
        grads = _like(grads, trainable)
        rest = restore_seeds(rest, seeds)
        rest = _settle_state(rest, names, where)
        out_params = trainable.merge(rest)
        return ((loss, aux) if has_aux else loss), grads, out_params

    return f


def _check_rngs(rngs: Any, where: str) -> tuple[Rng, ...]:
    """`rngs` as a tuple of `Rng` (one Rng alone is accepted)."""
    rngs = (rngs,) if isinstance(rngs, Rng) else tuple(rngs)
    for r in rngs:
        if not isinstance(r, Rng):
            raise TypeError(
                f"{where}: rngs must hold the model's Rng modules (bx.Rng), got "
                f"{type(r).__name__}. Pass e.g. rngs=[rng]."
            )
    return rngs


def _like(grads: Params, trainable: Params) -> Params:
    """The gradients (summed in the reduce dtype) cast back to their params' dtypes, so
    that the optimizer state keeps its dtypes from step to step."""
    values = tuple(
        g if g.dtype == t.dtype else g.astype(t.dtype)
        for g, t in zip(grads.leaves(), trainable.leaves(), strict=True)
    )
    return grads.with_leaves(values)


def _aux_terms(aux: Any, w: jax.Array | None, n: int, reduce_dtype: Any = None) -> Any:
    """Per-microbatch contributions of the aux leaves to their (weighted) mean, floating
    ones in `reduce_dtype` (`reduce_dtype_of`)."""

    def one(kp, x):
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
            return x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
        x = x.astype(reduce_dtype_of(x.dtype, reduce_dtype))
        if w is None:
            return x / jnp.asarray(n, x.dtype)  # a mean over microbatches and shards
        if _is_weight(kp):
            return x
        return jnp.where(w > 0, x * w.astype(x.dtype), jnp.zeros((), x.dtype))

    return jax.tree_util.tree_map_with_path(one, aux) if aux is not None else None


def _is_weight(kp: Any) -> bool:
    return len(kp) == 1 and getattr(kp[0], "key", None) == WEIGHT_KEY


def _aux_finish(aux: Any, denom: jax.Array, w: jax.Array) -> Any:
    def one(kp, x):
        if _is_weight(kp):
            return w.astype(x.dtype)
        if jnp.issubdtype(x.dtype, jnp.floating):
            return x / denom.astype(x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(one, aux) if aux is not None else None


def _settle_state(rest: Params, names: tuple[str, ...], where: str) -> Params:
    """Makes the non-trainable state invariant over the data axis (floating: mean)."""
    if not check_vma_enabled():
        return rest
    values = []
    for key, v in rest.arrays().items():
        axes = tuple(n for n in names if n in varying_axes(v))
        if axes:
            if not jnp.issubdtype(v.dtype, jnp.floating):
                raise ValueError(
                    f"{where}: the non-trainable parameter '{format_path(key)}' ({v.dtype}) "
                    f"differs between the shards of axis {axes} after the forward pass, so it "
                    "cannot be returned replicated. If it is an Rng seed folded with the axis "
                    "index, restore it before returning:\n"
                    "    params, seeds = bp.fold_seeds(params, [rng], 'data')\n"
                    "    ...forward...\n"
                    "    params = bp.restore_seeds(params, seeds)"
                )
            v = jax.lax.pmean(v, axes if len(axes) > 1 else axes[0])
        values.append(v)
    return rest.with_leaves(values)


def make_dp_train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis: str | tuple[str, ...] = "data",
    microbatches: int = 1,
    has_aux: bool = False,
    param_specs: Params | None = None,
    batch_spec: PartitionSpec | None = None,
    rngs: Sequence[Rng] = (),
    predicate: Callable[[Path, Any], bool] | None = None,
    reduce_dtype: Any = None,
) -> Callable[..., Any]:
    """Builds ``step(params, opt_state, *batch) -> (params, opt_state, metrics)`` for a
    data-parallel (or DP x TP) step; the user jits it (``jax.jit(step,
    donate_argnums=(0, 1))``).

    What it does, all written out in plain JAX:

    1. Checks, before compiling, that the global batch divides by the number of
       devices its leading dimension is split over (the axes of ``batch_spec[0]``)
       times ``microbatches``, and any other split dimension by its axes.
    2. ``jax.shard_map`` over `mesh` (``check_vma=True``): the batch split as
       `batch_spec` (default ``P(axis)``: the leading dimension over `axis`), the params
       with `param_specs` (default: replicated). Inside, `fold_seeds` folds each of
       `rngs` with the index along every axis of `axis` (dropout differs per shard),
       `dp_value_and_grad` computes the global-batch gradients with one all-reduce over
       `axis`, `restore_seeds` restores the seeds.
    3. Outside the ``shard_map`` (global view, so ``clip_by_global_norm`` and friends see
       whole arrays): ``tx.update`` and ``optax.apply_updates`` on the trainable params,
       under standard dtype promotion as in `blox.train.make_train_step` (Optax mixes
       Python floats with int32 counts), so the step also runs when traced under strict
       promotion.

    Args:
      loss_fn: ``(params, *batch) -> (loss, params)`` or ``((loss, aux), params)``.
      tx: the Optax transformation (its state from ``tx.init(params.split()[0])``).
      mesh: the device mesh; `axis` must be one of its axes.
      axis: the data axis, or a tuple of axes the loss and the gradients are reduced
        over: ``('data', 'context')`` with ``batch_spec=P('data', 'context')``
        (`cp_batch_spec`) for data x context parallelism, the rows split over
        ``data`` and the sequence over ``context`` (the model's attention built with
        ``context_axis='context'``). Every shard must hold the same number of tokens
        (or give ``aux['weight']``): the unweighted loss is the mean of the shards'.
      microbatches: gradient accumulation steps inside each shard.
      has_aux: `loss_fn` returns aux (a dict ``aux['weight']`` weights the mean; see
        `dp_value_and_grad`).
      param_specs: the params' ``PartitionSpec`` tree (`param_specs` with rules), for
        DP x TP; the params passed in must already have these shardings.
      batch_spec: the spec of every batch leaf (default ``P(axis)``; with a tuple
        `axis` that splits the rows over all of its axes).
      rngs: the `Rng` modules whose seeds are folded with the index along `axis`: every
        `Rng` that draws keys in `loss_fn` (an unlisted one raises, see
        `dp_value_and_grad`).
      predicate: ``(path, Param) -> bool``: which params are trained.
      reduce_dtype: the dtype of the gradient sums and the all-reduce (default: float32
        for bf16/fp16 gradients); see `dp_value_and_grad`.

    Returns:
      ``step``; ``metrics`` is ``{'loss': loss}`` plus the aux dict's entries (or
      ``'aux'`` for a non-dict aux).

    Multi-process runs: when the mesh spans several processes, every batch leaf must be
    a global ``jax.Array`` on the mesh (`blox.distributed.global_batch` assembles it from
    each process's rows). A host (NumPy) array or a process-local ``jax.Array``, passed
    directly or traced by ``jax.jit``, raises a ``ValueError`` naming the leaf and
    `blox.distributed.global_batch`: JAX would take each process's rows for the same
    replicated value and train on another batch, silently.

    Raises:
      ValueError: `axis` not in the mesh; a batch not divisible by data x microbatches
        (or a dimension `batch_spec` splits not divisible by its axes); a batch leaf of
        one process's rows when the mesh spans several processes.
    """
    _check_data_axis(mesh, axis, "make_dp_train_step")
    bspec = PartitionSpec(axis) if batch_spec is None else batch_spec
    grad_fn = _dp_value_and_grad(
        loss_fn,
        axis=axis,
        microbatches=microbatches,
        has_aux=has_aux,
        predicate=predicate,
        rngs=rngs,
        reduce_dtype=reduce_dtype,
        where="make_dp_train_step",
    )

    def step(params: Params, opt_state: Any, *batch: Any):
        specs = param_specs
        if specs is None:
            specs = jax.tree.map(lambda _: PartitionSpec(), params)
        params, opt_state, metrics, _ = sharded_train_step(
            grad_fn,
            tx,
            mesh,
            specs,
            params,
            opt_state,
            batch,
            axis=axis,
            batch_spec=bspec,
            microbatches=microbatches,
            predicate=predicate,
            has_aux=has_aux,
            where="make_dp_train_step",
        )
        return params, opt_state, metrics

    return step


_SCALAR_LEAF = (
    "{where}: batch leaf {leaf} is a scalar (shape {shape}); every batch argument is split "
    "over the data axis {axis!r} along its first dimension, and a scalar has none. Pass a "
    "per-step constant another way: close over it (functools.partial(loss_fn, scale=s), "
    "or a jnp value the loss reads), or store it in params as a non-trainable leaf; give "
    "a per-example value a leading batch dimension."
)

_PARTIAL_BATCH = (
    "{where}: batch leaf {leaf} of shape {shape} has {rows} rows, not divisible by "
    "data-parallel size {dp} x microbatches {k} = {n}. A partial final batch cannot be "
    "split into equal parts over the shards: drop it (drop_remainder=True in "
    "blox.data.pipeline or your loader), or pad it to a multiple of {n} rows and give the "
    "padding weight 0 (a mask in the loss and aux['weight'] = jnp.sum(mask), which makes "
    "the padded rows count for nothing; see dp_value_and_grad)."
)


def _check_batch_rows(
    batch: tuple, mesh: Mesh, spec: PartitionSpec, k: int, axis: Any, where: str
) -> None:
    """Every batch leaf has a first dimension divisible by ``dp * k``, dp the product of
    the sizes of the axes `spec` splits it over (the data axes; names the leaf, and for
    a scalar or a partial batch says what to do), and every other dimension `spec`
    splits (e.g. the sequence over a context axis) divisible by its axes' sizes."""
    sizes = dict(mesh.shape)
    entries = [() if e is None else (e if isinstance(e, tuple) else (e,)) for e in spec]
    parts = [math.prod(sizes.get(n, 1) for n in e) for e in entries]
    dp = parts[0] if parts else 1
    for kp, leaf in jax.tree_util.tree_leaves_with_path(batch):
        shape = tuple(jnp.shape(leaf))
        name = f"batch{jax.tree_util.keystr(kp)}"
        if not shape:
            raise ValueError(_SCALAR_LEAF.format(where=where, leaf=name, shape=shape, axis=axis))
        if shape[0] % (dp * k):
            raise ValueError(
                _PARTIAL_BATCH.format(
                    where=where, leaf=name, shape=shape, rows=shape[0], dp=dp, k=k, n=dp * k
                )
            )
        for d in range(1, min(len(shape), len(parts))):
            if shape[d] % parts[d]:
                raise ValueError(
                    f"{where}: batch leaf {name} of shape {shape}: dimension {d} (length "
                    f"{shape[d]}) is split over {entries[d]} by batch_spec {spec}, "
                    f"{parts[d]} devices, which does not divide it. Pad it (e.g. the "
                    f"sequence, with key_mask False on the padding) to a multiple of "
                    f"{parts[d]}."
                )


def _norm_spec(spec: Any, rank: int, keep: set) -> tuple:
    """A spec as one tuple of axis names per dimension, only the axes in `keep`."""
    entries = list(spec) + [None] * (rank - len(spec))
    out = []
    for e in entries[:rank]:
        names = () if e is None else (tuple(e) if isinstance(e, tuple) else (e,))
        out.append(tuple(n for n in names if n in keep))
    return tuple(out)


def _check_param_layout(params: Params, specs: Params, mesh: Mesh, where: str) -> None:
    """Each param is laid out over the mesh's Explicit axes as `specs` says (its type
    carries the layout, traced or not), else a ValueError naming the leaf, both layouts
    and the one-line fix; JAX's own error ("in_specs ... does not match") names neither
    the path nor the specs. Auto axes are not checked (the compiler reshards them)."""
    explicit = {
        n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True) if t == AxisType.Explicit
    }
    if not explicit or not isinstance(specs, Params):
        return
    want_all = specs.arrays()
    for key, x in params.arrays().items():
        want = want_all.get(key)
        if not isinstance(want, PartitionSpec) or not hasattr(x, "ndim"):
            continue
        try:
            sharding = jax.typeof(x).sharding
        except Exception:
            continue
        have_mesh = getattr(sharding, "mesh", None)
        have = sharding.spec if have_mesh is not None and not have_mesh.empty else ()
        if _norm_spec(have, x.ndim, explicit) == _norm_spec(want, x.ndim, explicit):
            continue
        fsdp = where.startswith("make_fsdp") or where.startswith("fsdp")
        source = "fsdp_specs" if fsdp else "param_specs"
        now = (
            f"laid out as {PartitionSpec(*have)}"
            if have_mesh is not None and not have_mesh.empty
            else "not on the mesh (a single-device or host array)"
        )
        raise ValueError(
            f"{where}: parameter '{format_path(key)}' {x.dtype}{list(x.shape)} is {now}, "
            f"but the step's specs ({source}) have "
            f"{want}. Place the params (and build the optimizer state) with the specs "
            "before the step:\n"
            "    params = bp.place(params, specs, mesh=mesh)\n"
            "    opt_state = bp.place(opt_state, bp.opt_state_specs(opt_state, specs), "
            "mesh=mesh)"
        )


def _onto_mesh(x: Any, mesh: Mesh, spec: PartitionSpec) -> Any:
    """A batch leaf laid out on the mesh: a concrete array on other devices (the step
    called outside ``jax.jit``) is transferred (``jax.device_put``), anything else is
    resharded in the program (`constrain`). Under the user's ``jax.jit`` a committed
    array on other devices cannot be seen here: JAX refuses it before tracing (see
    docs/parallel.md)."""
    if (
        isinstance(x, jax.Array)
        and not isinstance(x, jax.core.Tracer)
        and x.sharding.device_set != set(mesh.devices.flat)
    ):
        return jax.device_put(x, NamedSharding(mesh, spec))
    return constrain(x, mesh, spec)


def sharded_train_step(
    grad_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    specs: Any,
    params: Params,
    opt_state: Any,
    batch: tuple,
    *,
    axis: str | tuple[str, ...],
    batch_spec: PartitionSpec,
    microbatches: int,
    predicate: Callable | None,
    has_aux: bool,
    where: str,
) -> tuple[Params, Any, dict, Params]:
    """One optimizer step around a gradient function that runs inside ``jax.shard_map``
    (`dp_value_and_grad`, `fsdp_value_and_grad`), shared by the DP and FSDP train steps:
    checks the batch (global arrays on a multi-process mesh; rows divisible by data x
    microbatches), runs `grad_fn` with the params laid out by `specs`, applies `tx`.

    Returns ``(params, opt_state, metrics, grads)``.
    """
    if not isinstance(params, Params):
        raise TypeError(f"{where}: params must be bx.Params, got {type(params).__name__}.")
    check_placement((params, opt_state, batch), where)
    _check_global_batch(batch, mesh, axis, where)
    _check_batch_rows(batch, mesh, batch_spec, microbatches, axis, where)
    _check_param_layout(params, specs, mesh, where)
    trainable, _ = params.split(predicate)
    t_specs, _ = specs.split(lambda p, _: p in trainable)
    batch = tuple(jax.tree.map(lambda x: _onto_mesh(x, mesh, batch_spec), b) for b in batch)
    in_specs = (specs, *(jax.tree.map(lambda _: batch_spec, b) for b in batch))
    out_specs = (PartitionSpec(), t_specs, specs)
    value, grads, params = jax.shard_map(
        grad_fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs
    )(params, *batch)
    trainable, rest = params.split(predicate)
    trainable, opt_state = optimizer_update(tx, grads, opt_state, trainable)
    params = trainable.merge(rest)
    if has_aux:
        loss, aux = value
        metrics = {"loss": loss, **aux} if isinstance(aux, dict) else {"loss": loss, "aux": aux}
    else:
        metrics = {"loss": value}
    return params, opt_state, metrics, grads
