"""Pipeline parallelism: p stages over a mesh axis, m microbatches, run slot by slot
after a static `Schedule` (GPipe or 1F1B) with ``jax.shard_map`` + ``lax.ppermute``.

The runtime is one ``lax.scan`` over the schedule's time slots. In each slot every
stage looks up its cell of the table and runs one of three branches (``lax.switch``):

* forward of microbatch ``i``: take the activation from the forward inbox (stage 0: run
  `first_fn` on the inputs), run the stage under ``jax.vjp``, stash the VJP residuals in
  slot ``i % S`` of a fixed-size ring buffer, send the output to stage ``s + 1``
  (the last stage runs `last_fn` and accumulates the loss instead);
* backward of microbatch ``i``: rebuild the VJP from the stashed residuals and the
  current params, pull back the cotangent from the backward inbox, accumulate the
  parameter gradients, send the input cotangent to stage ``s - 1``;
* idle.

Then two ``ppermute``\\ s move the activation forward and the cotangent backward one
stage. The stash has ``S = schedule.buffer_sizes()['stash']`` slots: ``m`` for GPipe,
``p`` for 1F1B, which is what bounds 1F1B's live activations (check it with
``jax.jit(step).lower(...).compile().memory_analysis().temp_size_in_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec

from blox.core import Params
from blox.core._params import format_path
from blox.parallel._mesh import constrain
from blox.parallel._schedules import Schedule, schedule_from

__all__ = ["pipeline_value_and_grad", "stack_stages", "unstack_stages"]

_BAD_RETURN = (
    "{where} must return (outputs, params), the params being those the module returned; "
    "got {got}. Write it as:\n    def {name}(params, {args}):\n"
    "        out, params = block(params, ...)\n        return out, params"
)


def stack_stages(stages: list[Params]) -> Params:
    """Stacks ``p`` per-stage `Params` of the same structure into one whose every leaf has
    a leading stage dimension ``p`` (to shard over the pipeline axis with
    ``PartitionSpec(axis)``).

    Args:
      stages: ``p`` Params with identical paths, shapes and dtypes (e.g. one transformer
        block initialized ``p`` times with different seeds).

    Returns:
      Params with leaves ``(p, *shape)``.

    Raises:
      ValueError: the list is empty or the structures differ (names the path).
    """
    if not stages:
        raise ValueError("stack_stages: got no stages; pass a list of p >= 1 Params.")
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
    return jax.tree.map(lambda *xs: jnp.stack(xs), *stages)


def unstack_stages(stacked: Params) -> list[Params]:
    """The inverse of `stack_stages`: ``p`` Params, one per stage (concrete arrays are
    gathered to the host first, so stage-sharded arrays of any mesh can be split)."""
    leaves = jax.tree.leaves(stacked)
    if not leaves:
        return []
    p = leaves[0].shape[0]

    def full(x):
        return x if isinstance(x, jax.core.Tracer) else jnp.asarray(jax.device_get(x))

    stacked = jax.tree.map(full, stacked)
    return [jax.tree.map(lambda x, k=k: x[k], stacked) for k in range(p)]


def _check_out(out: Any, where: str, name: str, args: str) -> tuple[Any, Params]:
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Params)):
        raise TypeError(
            _BAD_RETURN.format(where=where, got=type(out).__name__, name=name, args=args)
        )
    return out


def _split_batch(tree: Any, m: int, what: str) -> Any:
    def one(kp, x):
        shape = jnp.shape(x)
        if not shape or shape[0] % m:
            raise ValueError(
                f"pipeline: {what}{jax.tree_util.keystr(kp)} has batch size "
                f"{shape[0] if shape else '(scalar)'} (local to one data shard), which "
                f"num_microbatches={m} does not divide; use a batch that is a multiple of "
                f"{m} (times the data-parallel size), or another num_microbatches."
            )
        return jnp.reshape(x, (m, shape[0] // m, *shape[1:]))

    return jax.tree_util.tree_map_with_path(one, tree)


def _take(tree: Any, i: jax.Array) -> Any:
    return jax.tree.map(lambda b: lax.dynamic_index_in_dim(b, i, keepdims=False), tree)


def _put(tree: Any, i: jax.Array, values: Any, ok: jax.Array | bool = True) -> Any:
    def one(b, v):
        old = lax.dynamic_index_in_dim(b, i, keepdims=False)
        return lax.dynamic_update_index_in_dim(b, jnp.where(ok, v.astype(b.dtype), old), i, 0)

    return jax.tree.map(one, tree, values)


def _zeros(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x)), tree)


def pipeline_value_and_grad(
    stage_fn: Callable[[Params, Any], tuple[Any, Params]],
    last_fn: Callable[[Params, Any, Any], tuple[jax.Array, Params]],
    mesh: Mesh,
    *,
    schedule: str | Schedule = "1f1b",
    num_microbatches: int | None = None,
    first_fn: Callable[[Params, Any], tuple[Any, Params]] | None = None,
    stage_axis: str = "stage",
    data_axis: str | None = None,
    remat: bool = False,
    remat_policy: Callable[..., bool] | None = None,
) -> Callable[..., tuple[jax.Array, tuple[Params, Params], tuple[Params, Params]]]:
    """Builds ``step(stage_params, shared_params, inputs, targets)`` that runs a pipelined
    forward and backward after a GPipe or 1F1B schedule and returns the mean loss, the
    gradients and the updated non-trainable state.

    The model is ``last_fn(first_fn(inputs) -> stage 0 -> ... -> stage p-1, targets)``:

    * `stage_fn` ``(params, h) -> (h', params)``: one stage, the same code for all
      ``p`` stages (e.g. a transformer block, or a `blox.Sequential` of several); its
      params are `stage_params` stacked along a leading dimension ``p`` (`stack_stages`)
      and sharded over `stage_axis`. ``h'`` must have the shape and dtype of ``h``.
    * `first_fn` ``(params, inputs_mb) -> (h, params)`` (optional; default identity): runs
      on stage 0 only, e.g. the token embedding.
    * `last_fn` ``(params, h, targets_mb) -> (loss, params)``: runs on stage ``p - 1``
      only, e.g. final norm, head and the mean loss of one microbatch.

    `first_fn` and `last_fn` take `shared_params` (replicated on every stage; their
    gradients are summed over the stages, so a tied embedding used by both gets both
    contributions). The batch is split into ``m`` equal microbatches; the loss is the
    mean of the microbatch losses (equal to the full-batch loss when `last_fn` returns a
    mean) and the gradients are of that loss. With `data_axis`, the batch is first split
    over that axis (DP x PP on a 2-D mesh): loss and gradients are averaged over it.

    Shape legend: ``p`` stages, ``m`` microbatches, ``B`` global batch, ``D`` data-axis size.

    Args:
      stage_fn: as above. Non-trainable params it changes (RNG counters, BatchNorm
        statistics) are threaded through the forwards of its stage in microbatch order.
      last_fn: as above; returns a floating scalar.
      mesh: a mesh with `stage_axis` (length ``p``) and, if given, `data_axis`.
      schedule: ``'gpipe'``, ``'1f1b'`` or a `Schedule` for ``p`` stages and ``m``
        microbatches.
      num_microbatches: ``m``; required unless `schedule` is a `Schedule`.
      first_fn: as above; ``None`` passes the inputs to stage 0 unchanged.
      stage_axis: the pipeline mesh axis.
      data_axis: an optional data-parallel mesh axis.
      remat: recompute the stage's activations in the backward
        (``jax.checkpoint``): only what `remat_policy` saves is stashed.
      remat_policy: a ``jax.checkpoint_policies`` policy; default (``None``) saves
        nothing but the stage input.

    Returns:
      ``step(stage_params, shared_params, inputs, targets) -> (loss, (stage_grads,
      shared_grads), (stage_params, shared_params))``, to call under ``jax.jit``:
      `stage_params` leaves ``(p, ...)``, `inputs` / `targets` pytrees of ``(B, ...)``;
      ``loss`` a scalar; ``stage_grads`` / ``shared_grads`` the trainable parts of the
      params (``params.split()[0]`` structure) for ``optax``; the returned params are the
      inputs with their non-trainable state updated. Computation follows the dtypes of
      the params and activations; gradients are accumulated in the params' dtypes.

    Raises:
      ValueError: `stage_axis` / `data_axis` not in the mesh; the schedule's stage count
        is not the axis length; ``m < p`` under 1F1B; a stage-params leaf whose leading
        dimension is not ``p``; a batch that ``m`` (times ``D``) does not divide; a stage
        that changes the activation's shape or dtype.
      TypeError: a function that does not return ``(outputs, params)``.

    Example:
      >>> import jax, jax.numpy as jnp, blox as bx
      >>> from blox.parallel._pipeline import pipeline_value_and_grad, stack_stages
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
    sched, p, dp = _resolve_schedule(where, mesh, schedule, num_microbatches, stage_axis, data_axis)
    m = sched.num_microbatches
    sizes = sched.buffer_sizes()
    kinds_np, mbs_np = sched.as_arrays()
    fwd_perm = [(s, s + 1) for s in range(p - 1)]
    bwd_perm = [(s + 1, s) for s in range(p - 1)]

    def call_stage(params: Params, h: Any) -> tuple[Any, Params]:
        return _check_out(stage_fn(params, h), "stage_fn", "stage_fn", "h")

    if remat:
        call_stage = jax.checkpoint(call_stage, policy=remat_policy)  # noqa: F811

    def stage_compute(tr, tr_sh, h_recv, x_mb, y_mb, st, st_sh, is_first, is_last):
        # One forward of this stage on one microbatch; differentiable in (tr, tr_sh, h_recv).
        def run_first():
            if first_fn is None:
                return x_mb, st_sh
            h, new = _check_out(first_fn(tr_sh.merge(st_sh), x_mb), "first_fn", "first_fn", "x")
            return h, new.split()[1]

        h_in, st_sh1 = lax.cond(is_first, run_first, lambda: (h_recv, st_sh))
        h_out, new = call_stage(tr.merge(st), h_in)
        st1 = new.split()[1]

        def run_last():
            loss, new_sh = _check_out(
                last_fn(tr_sh.merge(st_sh1), h_out, y_mb), "last_fn", "last_fn", "h, y"
            )
            loss = jnp.asarray(loss)
            if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
                raise ValueError(
                    f"{where}: last_fn must return a floating scalar loss, got {loss.dtype} of "
                    f"shape {loss.shape}; reduce it, e.g. jnp.mean(...)."
                )
            return loss, new_sh.split()[1]

        loss_shape = jax.eval_shape(run_last)[0]
        zero = jnp.zeros((), loss_shape.dtype)
        loss, st_sh2 = lax.cond(is_last, run_last, lambda: (zero, st_sh1))
        return (h_out, loss), (st1, st_sh2)

    def body(stage_params, shared_params, inputs, targets):
        idx = lax.axis_index(stage_axis)
        is_first, is_last = idx == 0, idx == p - 1
        local = jax.tree.map(lambda x: x[0], stage_params)
        tr, st = local.split()
        tr_sh, st_sh = shared_params.split()
        xs = _split_batch(inputs, m, "inputs")
        ys = _split_batch(targets, m, "targets")
        x0, y0 = _take(xs, jnp.int32(0)), _take(ys, jnp.int32(0))
        if first_fn is None:
            h_aval = jax.eval_shape(lambda: x0)
        else:
            h_aval = jax.eval_shape(lambda: first_fn(shared_params, x0)[0])
        h_zero = _zeros(h_aval)
        out_aval = jax.eval_shape(lambda: call_stage(tr.merge(st), h_zero)[0])
        _check_keeps_activation(where, h_aval, out_aval)

        # Probe the VJP once (abstractly) to learn its residuals: which are the params
        # themselves (not stashed), which are static, which go into the stash.
        layout: dict[str, Any] = {}

        def vjp_of(tr, tr_sh, h_recv, x_mb, y_mb, st, st_sh):
            def f(a, b, c):
                return stage_compute(a, b, c, x_mb, y_mb, st, st_sh, is_first, is_last)

            return jax.vjp(f, tr, tr_sh, h_recv, has_aux=True)

        def probe(tr, tr_sh, h_recv, x_mb, y_mb, st, st_sh):
            _, vjp_fn, _ = vjp_of(tr, tr_sh, h_recv, x_mb, y_mb, st, st_sh)
            layout["treedef"], layout["kinds"], stash = _split_residuals(vjp_fn, (tr, tr_sh))
            return stash

        res_aval = jax.eval_shape(probe, tr, tr_sh, h_zero, x0, y0, st, st_sh)
        n_stash, n_in_f, n_in_b = sizes["stash"], sizes["fwd_inbox"], sizes["bwd_inbox"]
        stash0 = [jnp.zeros((n_stash, *a.shape), a.dtype) for a in res_aval]
        inbox_f0 = jax.tree.map(lambda a: jnp.zeros((n_in_f, *a.shape), a.dtype), h_aval)
        inbox_b0 = jax.tree.map(lambda a: jnp.zeros((n_in_b, *a.shape), a.dtype), h_aval)
        loss_dtype = jax.eval_shape(
            lambda: stage_compute(tr, tr_sh, h_zero, x0, y0, st, st_sh, True, True)[0][1]
        ).dtype
        inv_m = jnp.asarray(1.0 / m, loss_dtype)
        kinds_a, mbs_a = jnp.asarray(kinds_np), jnp.asarray(mbs_np)

        def idle(c, mb):
            return c, (h_zero, False), (h_zero, False)

        def forward(c, mb):
            st, st_sh, g, g_sh, loss_acc, stash, inbox_f, inbox_b = c
            h_recv = _take(inbox_f, mb % n_in_f)
            (h_out, loss), vjp_fn, (st_new, st_sh_new) = vjp_of(
                tr, tr_sh, h_recv, _take(xs, mb), _take(ys, mb), st, st_sh
            )
            _, kinds, res = _split_residuals(vjp_fn, (tr, tr_sh))
            if [k for k, _ in kinds] != [k for k, _ in layout["kinds"]]:
                raise RuntimeError(f"{where}: the VJP residuals changed between two traces.")
            stash = [_put(b, mb % n_stash, r) for b, r in zip(stash, res, strict=True)]
            c = (st_new, st_sh_new, g, g_sh, loss_acc + loss * inv_m, stash, inbox_f, inbox_b)
            return c, (h_out, ~is_last), (h_zero, False)

        def backward(c, mb):
            st, st_sh, g, g_sh, loss_acc, stash, inbox_f, inbox_b = c
            vjp_fn = _rebuild_vjp(
                layout["treedef"], layout["kinds"], (tr, tr_sh), stash, mb % n_stash
            )
            ct_h = jax.tree.map(
                lambda v: jnp.where(is_last, jnp.zeros_like(v), v),
                _take(inbox_b, mb % n_in_b),
            )
            d_tr, d_sh, d_h = vjp_fn((ct_h, inv_m))
            g = jax.tree.map(jnp.add, g, d_tr)
            g_sh = jax.tree.map(jnp.add, g_sh, d_sh)
            c = (st, st_sh, g, g_sh, loss_acc, stash, inbox_f, inbox_b)
            return c, (h_zero, False), (d_h, ~is_first)

        def slot(c, t):
            kind, mb = kinds_a[t, idx], mbs_a[t, idx]
            c, (hf, okf), (hb, okb) = lax.switch(
                kind,
                [lambda c: idle(c, mb), lambda c: forward(c, mb), lambda c: backward(c, mb)],
                c,
            )
            okf, okb = jnp.asarray(okf), jnp.asarray(okb)
            mbf, mbb = jnp.where(okf, mb, 0), jnp.where(okb, mb, 0)
            hf, okf, mbf = lax.ppermute((hf, okf, mbf), stage_axis, fwd_perm)
            hb, okb, mbb = lax.ppermute((hb, okb, mbb), stage_axis, bwd_perm)
            st, st_sh, g, g_sh, loss_acc, stash, inbox_f, inbox_b = c
            inbox_f = _put(inbox_f, mbf % n_in_f, hf, okf)
            inbox_b = _put(inbox_b, mbb % n_in_b, hb, okb)
            return (st, st_sh, g, g_sh, loss_acc, stash, inbox_f, inbox_b), None

        c0 = (
            st, st_sh, _zeros(tr), _zeros(tr_sh), jnp.zeros((), loss_dtype),
            stash0, inbox_f0, inbox_b0,
        )  # fmt: skip
        c, _ = lax.scan(slot, c0, jnp.arange(sched.num_slots))
        st, st_sh_new, g, g_sh, loss, *_ = c

        # Shared state: stage 0 owns first_fn's changes, stage p-1 those of last_fn.
        def settle(old, new):
            v0 = lax.psum(jnp.where(is_first, new, jnp.zeros_like(new)), stage_axis)
            vl = lax.psum(jnp.where(is_last, new, jnp.zeros_like(new)), stage_axis)
            return jnp.where(v0 != old, v0, vl)

        st_sh_out = jax.tree.map(settle, st_sh, st_sh_new)
        loss = lax.psum(loss, stage_axis)
        g_sh = lax.psum(g_sh, stage_axis)
        if data_axis is not None:
            loss, g, g_sh = lax.pmean((loss, g, g_sh), data_axis)
            # Floating state (e.g. running statistics) is averaged over the data shards;
            # integer state (Rng seed and counter) advances identically on every shard and
            # keeps its dtype (a pmean would turn uint32 into float32).
            st, st_sh_out = jax.tree.map(
                lambda v: lax.pmean(v, data_axis) if jnp.issubdtype(v.dtype, jnp.floating) else v,
                (st, st_sh_out),
            )
        g = jax.tree.map(lambda x: x[None], g)
        st = jax.tree.map(lambda x: x[None], st)
        return loss, (g, g_sh), (st, st_sh_out)

    def step(stage_params: Params, shared_params: Params, inputs: Any, targets: Any):
        _check_step_args(where, stage_params, shared_params, inputs, targets, p, stage_axis, m, dp)
        spec_s = jax.tree.map(lambda _: PartitionSpec(stage_axis), stage_params)
        spec_sh = jax.tree.map(lambda _: PartitionSpec(), shared_params)
        spec_b = PartitionSpec(data_axis)
        tr_s, _ = stage_params.split()
        tr_sh, _ = shared_params.split()
        out_specs = (
            PartitionSpec(),
            (jax.tree.map(lambda _: PartitionSpec(stage_axis), tr_s),
             jax.tree.map(lambda _: PartitionSpec(), tr_sh)),
            (jax.tree.map(lambda _: PartitionSpec(stage_axis), stage_params.split()[1]),
             jax.tree.map(lambda _: PartitionSpec(), shared_params.split()[1])),
        )  # fmt: skip
        f = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec_s, spec_sh, spec_b, spec_b),
            out_specs=out_specs,
            check_vma=False,
        )
        put = lambda tree, spec: jax.tree.map(lambda x: constrain(x, mesh, spec), tree)  # noqa: E731
        loss, grads, (st, st_sh) = f(
            put(stage_params, PartitionSpec(stage_axis)),
            put(shared_params, PartitionSpec()),
            put(inputs, spec_b),
            put(targets, spec_b),
        )
        return loss, grads, (stage_params.merge(st), shared_params.merge(st_sh))

    return step


def _resolve_schedule(
    where: str,
    mesh: Mesh,
    schedule: str | Schedule,
    num_microbatches: int | None,
    stage_axis: str,
    data_axis: str | None,
) -> tuple[Schedule, int, int]:
    """Checks the mesh axes and the schedule; returns ``(schedule, p, data-axis size)``."""
    names = tuple(mesh.axis_names)
    for label, ax in (("stage_axis", stage_axis), ("data_axis", data_axis)):
        if ax is not None and ax not in names:
            raise ValueError(
                f"{where}: {label}={ax!r} is not an axis of the mesh {names}; build the mesh "
                f"with that axis, or pass {label}= one of {names}."
            )
    p = int(mesh.shape[stage_axis])
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
        sched = schedule
    else:
        if num_microbatches is None:
            raise ValueError(
                f"{where}: pass num_microbatches= with schedule={schedule!r} (or a Schedule)."
            )
        sched = schedule_from(schedule, p, num_microbatches)
    dp = int(mesh.shape[data_axis]) if data_axis is not None else 1
    return sched, p, dp


def _check_step_args(
    where: str,
    stage_params: Any,
    shared_params: Any,
    inputs: Any,
    targets: Any,
    p: int,
    stage_axis: str,
    m: int,
    dp: int,
) -> None:
    """The checks `step` runs before tracing: Params types, the stage dimension, batch."""
    for label, tree in (("stage_params", stage_params), ("shared_params", shared_params)):
        if not isinstance(tree, Params):
            raise TypeError(f"{where}: {label} must be Params, got {type(tree).__name__}.")
    for path in stage_params.keys():
        shape = jnp.shape(stage_params[path].value)
        if not shape or shape[0] != p:
            raise ValueError(
                f"{where}: stage parameter '{format_path(path)}' has shape {shape}, whose "
                f"leading (stage) dimension should be the {p} devices of mesh axis "
                f"{stage_axis!r}; stack one Params per stage with stack_stages (got "
                f"{shape[0] if shape else 'a scalar'} stages)."
            )
    for what, tree in (("inputs", inputs), ("targets", targets)):
        for kp, x in jax.tree_util.tree_leaves_with_path(tree):
            b = jnp.shape(x)[0] if jnp.ndim(x) else None
            if b is None or b % (m * dp):
                raise ValueError(
                    f"{where}: {what}{jax.tree_util.keystr(kp)} has batch size {b}, which "
                    f"num_microbatches={m} x data-parallel {dp} does not divide; use a "
                    f"batch that is a multiple of {m * dp}."
                )


def _split_residuals(vjp_fn: Any, params: Any) -> tuple[Any, list, list]:
    """The VJP closure's leaves sorted into the params themselves (not stashed: the
    backward has them), arrays to stash, and static values."""
    leaves, treedef = jax.tree.flatten(vjp_fn)
    pid = {id(v): k for k, v in enumerate(jax.tree.leaves(params))}
    kinds, stash = [], []
    for v in leaves:
        if id(v) in pid:
            kinds.append(("param", pid[id(v)]))
        elif isinstance(v, (jax.Array, jax.core.Tracer)):
            kinds.append(("stash", len(stash)))
            stash.append(v)
        else:
            kinds.append(("static", v))
    return treedef, kinds, stash


def _rebuild_vjp(treedef: Any, kinds: list, params: Any, stash: list, slot: jax.Array) -> Any:
    """The VJP closure back from `_split_residuals`' parts, its stash read at `slot`."""
    params_leaves = jax.tree.leaves(params)
    leaves = []
    for kind, k in kinds:
        if kind == "param":
            leaves.append(params_leaves[k])
        elif kind == "stash":
            leaves.append(_take(stash[k], slot))
        else:
            leaves.append(k)
    return jax.tree.unflatten(treedef, leaves)


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
