"""Fully sharded data parallelism (ZeRO-3) as plain functions.

Parameters and optimizer state live sharded over the data axis, one dimension per leaf
(`fsdp_specs`). Inside the user's ``jax.shard_map`` step (`fsdp_value_and_grad`, or the
whole step from `make_fsdp_train_step`), the params the loss function receives hold the
**local shards** of those leaves, each marked with ``metadata['fsdp'] = (axis, dim)``;
the loss function wraps each layer call in `fsdp_call`, which all-gathers that layer's
marked leaves just before the call and drops them after. Its backward (a ``custom_vjp``
that keeps the layer's activations but not the full weights) gathers them again, then
reduce-scatters the weights' gradients (the transpose of the gather): the gradients
leave the step sharded, summed over the data axis, with no full gradient tree and no
all-reduce of parameter-sized buffers.

Small leaves (below ``min_size`` elements) and leaves without a divisible dimension stay
replicated and are handled as in `dp_value_and_grad` (local gradients, one all-reduce).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.extend.core import Literal
from jax.sharding import Mesh, PartitionSpec

from blox.core import Module, Params, Rng
from blox.core._guards import FSDP_MARK, check_reduce_dtype, reduce_dtype_of
from blox.core._params import Path, format_path
from blox.parallel._collectives import check_axis
from blox.parallel._dp import (
    _aux_finish,
    _axis_names,
    _check_data_axis,
    _check_rngs,
    _like,
    _settle_state,
    _to_varying,
    accumulate_microbatches,
    sharded_train_step,
)
from blox.parallel._rng import fold_seeds, restore_seeds

__all__ = [
    "bytes_per_device",
    "fsdp_call",
    "fsdp_specs",
    "fsdp_value_and_grad",
    "make_fsdp_train_step",
]

# The metadata key of a local shard inside the step: (axis, dim, reduce dtype, stored
# dtype). The last two are dtype names or None: the dtype of the reduce-scatter, and the
# dtype the weight is gathered and used in when the step holds the shard in the reduce
# dtype (bf16 weights, f32 gradient sums).
MARK = FSDP_MARK
_GATHER_MODES = ("per_layer", "per_step")
_REMAT_MODES = ("weights", True, False)


# ---------------------------------------------------------------------------
# Specs
# ---------------------------------------------------------------------------


def _entry_names(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def _spec_tuple(spec: Any, rank: int, path: str) -> list:
    entries = list(spec) if isinstance(spec, PartitionSpec) else None
    if entries is None:
        raise TypeError(
            f"fsdp_specs: base spec of '{path}' is {spec!r}, not a PartitionSpec. Pass base="
            "bp.param_specs(params, rules, mesh)."
        )
    if len(entries) > rank:
        raise ValueError(
            f"fsdp_specs: base spec {spec} of '{path}' has {len(entries)} entries for a "
            f"parameter of rank {rank}."
        )
    return entries + [None] * (rank - len(entries))


def fsdp_specs(
    params: Params,
    mesh: Mesh,
    *,
    axis: str | tuple[str, ...] = "data",
    base: Params | None = None,
    rules: Sequence[tuple[str, int | None]] = (),
    min_size: int = 1024,
    predicate: Callable[[Path, Any], bool] | None = None,
) -> Params:
    """The ``PartitionSpec`` of every parameter with the trainable ones sharded over the
    data axis along one dimension each (ZeRO-3 layout).

    Per trainable parameter (``params.split(predicate)[0]``), in this order:

    1. a matching rule ``(pattern, dim)`` (a regular expression matched against the end
       of the path, whole names, as in `param_specs`) shards dimension ``dim``, or with
       ``dim=None`` leaves the parameter as `base` has it;
    2. a parameter with fewer than `min_size` elements keeps its `base` spec (replicated
       over `axis`: biases, norms);
    3. otherwise the dimension with the largest per-device length (after the `base`
       axes) divisible by the size of `axis` is sharded; with none, the parameter keeps
       its `base` spec.

    `axis` is appended to the dimension's `base` entry, so a TP spec ``P(None, 'model')``
    becomes ``P('data', 'model')`` and an entry ``'model'`` becomes ``('model', 'data')``
    (the data axis minor: its all-gather rebuilds the TP shard). Non-trainable
    parameters keep their `base` spec.

    Args:
      params: concrete or abstract params (``jax.eval_shape(init)``).
      mesh: the mesh; `axis` must be one of its axes.
      axis: the data axis the parameters are sharded over, or a tuple of axes (e.g.
        ``('data', 'context')`` under context parallelism: every device of both
        holds a different shard, as torchtitan shards over its dp x cp mesh), appended
        together (``('data', 'context')`` minor to any `base` axes).
      base: specs from `param_specs` (e.g. TP rules) to start from; default replicated.
      rules: ``[(pattern, dim or None)]`` overrides of the default choice.
      min_size: parameters with fewer elements stay replicated over `axis`.
      predicate: ``(path, Param) -> bool``: the trained parameters (default: trainable).

    Returns:
      A `Params` of ``PartitionSpec`` leaves (same paths), for `param_shardings`-style
      use: ``jax.tree.map(lambda s: NamedSharding(mesh, s), specs)``, `opt_state_specs`.

    Raises:
      ValueError: `axis` not in the mesh or already used by `base`; a rule whose ``dim``
        is out of range or not divisible by the size of `axis`; conflicting rules; a
        `base` that lacks a path. Each names the path and the shape.

    >>> import jax, jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> mesh = bp.make_mesh((8,), ('data',))
    >>> params = bx.Params()
    >>> params[('fc', 'kernel')] = bx.Param(jnp.zeros((64, 32)))
    >>> params[('fc', 'bias')] = bx.Param(jnp.zeros((32,)))
    >>> specs = bp.fsdp_specs(params, mesh)
    >>> specs[('fc', 'kernel')].value, specs[('fc', 'bias')].value
    (P('data', None), P())
    """
    if not isinstance(params, Params):
        raise TypeError(f"fsdp_specs: params must be bx.Params, got {type(params).__name__}.")
    axes = _check_data_axis(mesh, axis, "fsdp_specs")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise ValueError(f"fsdp_specs: min_size must be an int >= 0, got {min_size!r}.")
    compiled = _compile_fsdp_rules(rules)
    if base is not None and not isinstance(base, Params):
        raise TypeError(
            f"fsdp_specs: base must be the Params returned by param_specs, got "
            f"{type(base).__name__}."
        )
    base_table = None if base is None else base.arrays()
    trained = set(params.split(predicate)[0].keys())
    sizes = dict(mesh.shape)
    out = [
        _fsdp_leaf_spec(
            key,
            tuple(getattr(value, "shape", ())),
            base_table,
            sizes,
            axes,
            compiled if key in trained else None,
            min_size,
        )
        for key, value in zip(params.keys(), params.leaves(), strict=True)
    ]
    return params.with_leaves(out)


#: A compiled `fsdp_specs` rule: (index, pattern, regex, dim or None).
_FsdpRule = tuple[int, str, re.Pattern, int | None]


def _compile_fsdp_rules(rules: Sequence[tuple[str, int | None]]) -> list[_FsdpRule]:
    """`fsdp_specs`'s ``(pattern, dim)`` rules checked and compiled (a pattern matches
    the end of a path, whole names)."""
    compiled = []
    for i, rule in enumerate(rules):
        ok = isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
        if not ok or not (rule[1] is None or type(rule[1]) is int):
            raise TypeError(
                f"fsdp_specs: rule {i} is {rule!r}; each rule is (pattern, dim) with a string "
                "pattern and an int dimension (or None to keep the base spec), e.g. "
                "('embed/embedding', 1)."
            )
        try:
            regex = re.compile(rf"(?:.*/)?(?:{rule[0]})")
        except re.error as e:
            raise ValueError(f"fsdp_specs: rule {i} pattern {rule[0]!r}: {e}.") from None
        compiled.append((i, rule[0], regex, rule[1]))
    return compiled


def _base_entries(key: Path, shape: tuple, base_table: dict | None, axes: tuple[str, ...]) -> list:
    """The `base` spec of one leaf as one entry per dimension (replicated without a
    `base`), refused when it lacks the leaf or already uses the data axis."""
    path = format_path(key)
    if base_table is None:
        return [None] * len(shape)
    if key not in base_table:
        raise ValueError(
            f"fsdp_specs: base has no spec for '{path}'. Pass the specs of these params "
            "(bp.param_specs(params, rules, mesh))."
        )
    entries = _spec_tuple(base_table[key], len(shape), path)
    used = [n for e in entries for n in _entry_names(e) if n in axes]
    if used:
        axis = used[0]
        raise ValueError(
            f"fsdp_specs: base spec {PartitionSpec(*entries)} of '{path}' {shape} already "
            f"uses the data axis {axis!r}; fsdp_specs adds it. Leave {axis!r} out of the "
            "base rules."
        )
    return entries


def _fsdp_leaf_spec(
    key: Path,
    shape: tuple,
    base_table: dict | None,
    sizes: dict[str, int],
    axes: tuple[str, ...],
    compiled: list[_FsdpRule] | None,
    min_size: int,
) -> PartitionSpec:
    """One leaf's FSDP spec: its `base` spec with `axis` appended to the chosen dimension
    (`_fsdp_dim`); `compiled` is None for a leaf that is not trained (kept as `base`)."""
    entries = _base_entries(key, shape, base_table, axes)
    axis = axes[0] if len(axes) == 1 else axes
    n = math.prod(sizes[a] for a in axes)
    local = [
        shape[d] // math.prod(sizes[a] for a in _entry_names(entries[d])) for d in range(len(shape))
    ]
    dim = None
    if compiled is not None:
        dim = _fsdp_dim(format_path(key), shape, local, compiled, min_size, n, axis)
    if dim is not None:
        names = _entry_names(entries[dim]) + axes
        entries[dim] = names[0] if len(names) == 1 else names
    if all(e is None for e in entries) and (base_table is None or dim is None):
        return base_table[key] if base_table is not None else PartitionSpec()
    return PartitionSpec(*entries)  # one entry per dimension


def _fsdp_dim(
    path: str,
    shape: tuple,
    local: list[int],
    compiled: list[_FsdpRule],
    min_size: int,
    n: int,
    axis: str,
) -> int | None:
    """The dimension of a trained leaf to shard over `axis` (size `n`): a matching rule's
    (checked), else the largest per-device length divisible by `n` when the leaf has at
    least `min_size` elements, else None (replicated over `axis`)."""
    hits = [r for r in compiled if r[2].fullmatch(path)]
    if not hits:
        if math.prod(shape) >= min_size and shape:
            candidates = [d for d in range(len(shape)) if local[d] % n == 0 and local[d] > 0]
            if candidates:
                return max(candidates, key=lambda d: (local[d], -d))
        return None
    dims = {r[3] for r in hits}
    if len(dims) > 1:
        a, b = hits[0], next(r for r in hits if r[3] != hits[0][3])
        raise ValueError(
            f"fsdp_specs: '{path}' {shape} matches rule {a[0]} ({a[1]!r} -> {a[3]}) and "
            f"rule {b[0]} ({b[1]!r} -> {b[3]}). Make the patterns disjoint."
        )
    dim = hits[0][3]
    if dim is None:
        return None
    if not -len(shape) <= dim < len(shape):
        raise ValueError(
            f"fsdp_specs: rule {hits[0][0]} ({hits[0][1]!r} -> {dim}) shards "
            f"dimension {dim} of '{path}', which has shape {shape}."
        )
    dim %= len(shape)
    if local[dim] % n:
        raise ValueError(
            f"fsdp_specs: rule {hits[0][0]} shards dimension {dim} of '{path}' "
            f"{shape} (per-device length {local[dim]}) over {axis!r} of size {n}, "
            f"which does not divide it. Pick a dimension divisible by {n}, or "
            "None to replicate."
        )
    return dim


def _sharded_dims(specs: Params, axis: Any, where: str) -> dict[Path, int]:
    """``{path: dim}`` of the leaves whose spec shards a dimension over `axis` (one
    name, or a tuple of names that must end the entry together, in order)."""
    axes = (axis,) if isinstance(axis, str) else tuple(axis)
    out = {}
    for key, spec in specs.arrays().items():
        if not isinstance(spec, PartitionSpec):
            raise TypeError(
                f"{where}: specs must hold PartitionSpec leaves (from fsdp_specs); "
                f"'{format_path(key)}' holds {type(spec).__name__}."
            )
        for d, entry in enumerate(spec):
            names = _entry_names(entry)
            if not any(a in names for a in axes):
                continue
            if names[-len(axes) :] == axes:
                out[key] = d
                continue
            if len(axes) == 1:
                raise ValueError(
                    f"{where}: the spec {spec} of '{format_path(key)}' puts the data axis "
                    f"{axis!r} before {names[names.index(axis) + 1 :]} in dimension {d}; it "
                    f"must be the last name of the entry (e.g. ('model', {axis!r})), so "
                    "that its all-gather rebuilds the local block. Use fsdp_specs."
                )
            raise ValueError(
                f"{where}: the spec {spec} of '{format_path(key)}' shards dimension {d} "
                f"over {names}, but the step's data axes are {axes}: the FSDP shards must be "
                f"split over all of them, last in the entry, in this order. Build the specs "
                f"with bp.fsdp_specs(params, mesh, axis={axes!r}, base=...)."
            )
    return out


# ---------------------------------------------------------------------------
# Marks: which leaves of the params handed to the loss are local shards
# ---------------------------------------------------------------------------


def _as_mark(value: Any) -> tuple[str, int, str | None, str | None]:
    """A leaf's ``metadata[MARK]`` as ``(axis, dim, reduce dtype, stored dtype)`` (the
    last two None when absent)."""
    axis, dim, *rest = value
    rest = list(rest) + [None] * (2 - len(rest))
    return axis, dim, rest[0], rest[1]


def _with_marks(params: Params, marks: dict[Path, tuple]) -> Params:
    """`params` with ``metadata[MARK] = marks[path]`` added to the paths of `marks` that
    it holds (the other metadata kept)."""
    updates = {}
    for key, mark in marks.items():
        if key in params:
            meta = params[key].metadata
            meta[MARK] = mark
            updates[key] = meta
    return params.with_metadata(updates)


def _without_marks(params: Params, keys: Any = None) -> Params:
    """`params` without the marks (of the paths in `keys`, default all)."""
    updates = {}
    for key in params.metadata_entries(MARK):
        if keys is None or key in keys:
            meta = params[key].metadata
            del meta[MARK]
            updates[key] = meta
    return params.with_metadata(updates)


# ---------------------------------------------------------------------------
# The per-layer gather
# ---------------------------------------------------------------------------


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _prefix(fn: Any, under: Any) -> Path:
    if under is None:
        owner = fn if isinstance(fn, Module) else getattr(fn, "__self__", None)
        if not isinstance(owner, Module):
            raise TypeError(
                f"fsdp_call: cannot tell which parameters {getattr(fn, '__name__', fn)!r} uses. "
                "Pass a blox Module (or one of its methods), or under=<path prefix>, e.g. "
                "bp.fsdp_call(fn, params, x, under=('net', 'block_0'))."
            )
        return owner.graph.path
    if isinstance(under, str):
        return tuple(p for p in under.split("/") if p)
    if isinstance(under, tuple) and all(isinstance(p, str) for p in under):
        return under
    raise TypeError(f"fsdp_call: under must be a path tuple or a 'a/b' string, got {under!r}.")


def fsdp_call(
    fn: Callable[..., tuple[Any, Params]],
    params: Params,
    *args: Any,
    under: Path | str | None = None,
    remat: bool | str = "weights",
    gather_after: Any = None,
    **kwargs: Any,
) -> tuple[Any, Params]:
    """Calls ``fn(params, *args, **kwargs)`` with the weights under `under` all-gathered
    over the data axis just before the call and dropped after (inside the FSDP step).

    The params handed to an FSDP loss function (by `fsdp_value_and_grad`) hold local
    shards of the large trainable leaves, marked ``metadata['fsdp'] = (axis, dim)``.
    ``fsdp_call`` gathers the marked leaves whose path starts with `under` (one
    ``all_gather`` each), runs `fn` on the full weights, and returns `fn`'s output and
    params with the shards back in place. By default (``remat='weights'``) the backward
    keeps the layer's activations but not its full weights: it gathers the weights again
    (one more ``all_gather``), runs the layer's backward and reduce-scatters the weights'
    gradients (the transpose of the gather), so the gradient of each shard arrives summed
    over the data axis, no full weight outlives its layer and no forward runs twice.
    Outside an FSDP step (no marked leaf under `under`) it is exactly ``fn(params, *args,
    **kwargs)``, so one model serves DP, FSDP and one device.

    Args:
      fn: a blox `Module` or one of its methods (then `under` defaults to the module's
        path), or any ``(params, *args) -> (out, params)``.
      params: the params the loss function received.
      *args: passed to `fn`; array leaves are traced, other leaves are static.
      under: the path prefix of the weights `fn` uses (a tuple or ``'a/b'``).
      remat: what the backward keeps. ``'weights'`` (default): the layer's residuals
        (its activations, as under DP) except the full weights and what is computed
        from the params alone (casts, transposes), which the backward gathers again and
        rebuilds; the FLOPs of the layer under DP. ``True``: only the shards and the
        inputs; the backward gathers the weights again and recomputes the layer (one
        more forward per layer, the least activation memory). ``False``: every
        residual, the full weights included (no second gather, but the full weights of
        every layer live at the peak; refused inside a pipeline stage).
      gather_after: prefetch. By default the gather waits for this call's array
        arguments, so it runs just before the layer (XLA cannot hoist every layer's
        gather to the start). Pass arrays available earlier, e.g. the previous layer's
        input, and the gather may overlap the previous layer, at the memory of one more
        layer's full weights.
      **kwargs: passed to `fn` (same rule as `args`).

    Returns:
      ``(out, params)`` as `fn` returns them; the gathered leaves are the local shards
      again, `fn`'s updates to non-trainable state are kept.

    Raises:
      TypeError: `fn` is not a Module method and `under` is not given.
      ValueError: `remat` is not ``'weights'``, ``True`` or ``False``.

    >>> import jax, jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng'); fc = bx.Linear(g / 'fc', 4, rng)
    >>> params = fc(rng.seed(bx.Params(), seed=0), jnp.ones((2, 3)))[1].locked()
    >>> y, _ = bp.fsdp_call(fc, params, jnp.ones((2, 3)))   # no FSDP marks: a plain call
    >>> y.shape
    (2, 4)
    """
    prefix = _prefix(fn, under)
    if not isinstance(params, Params):
        raise TypeError(f"fsdp_call: params must be bx.Params, got {type(params).__name__}.")
    if not (isinstance(remat, bool) or (isinstance(remat, str) and remat == "weights")):
        raise ValueError(
            f"fsdp_call: remat must be one of {_REMAT_MODES}, got {remat!r}. 'weights' keeps "
            "the activations and gathers the weights again in the backward; True also "
            "recomputes the layer; False keeps the full weights."
        )
    marked = _marks_under(params, prefix)
    if not marked:
        return fn(params, *args, **kwargs)
    flat, treedef = jax.tree_util.tree_flatten((args, kwargs))
    traced = [i for i, x in enumerate(flat) if _is_array(x)]
    # The other layers' shards keep their marks.
    call = _LayerCall(fn, _without_marks(params, marked), marked, flat, treedef, traced)
    run = _gather_call_scatter(call, tuple(marked.values()), remat)
    values = params.leaves()
    shards = tuple(values[i] for i in call.positions)
    gathered = set(call.positions)
    others = tuple(None if i in gathered else v for i, v in enumerate(values))
    after = [
        a
        for a in jax.tree.leaves(gather_after)
        if _is_array(a) and jnp.issubdtype(jnp.result_type(a), jnp.inexact)
    ]
    out, new = run(shards, others, [flat[i] for i in traced], after)
    return out, _put_back(params, new, marked, shards, call.untouched)


def _marks_under(params: Params, prefix: Path) -> dict[Path, tuple]:
    """``{path: mark}`` of the marked leaves (local shards) whose path starts with
    `prefix`, in path order; each mark's axis must be bound here."""
    n = len(prefix)
    marked = {
        key: _as_mark(value)
        for key, value in params.metadata_entries(MARK).items()
        if key[:n] == prefix
    }
    for key, (axis, *_) in marked.items():
        check_axis(axis, f"fsdp_call (gathering '{format_path(key)}')")
    return marked


class _LayerCall:
    """``call(full, values, dyn)``: the function `fsdp_call` differentiates. It runs `fn`
    on params holding the gathered weights `full` (at `positions`, the marked paths) and
    the other values `values`, with the traced call arguments `dyn` put back among the
    static ones, and returns `fn`'s output and params without the full weights (``None``
    where each was; `_put_back` puts the shards there).

    `untouched` (set when first traced): the paths `fn` returns untouched (the very
    array it got); they leave as the caller's arrays, not as outputs of the
    ``custom_vjp``, so a state leaf that only passes through (an Rng counter) stays the
    same object.
    """

    def __init__(self, fn, plain: Params, marked: dict, flat: list, treedef, traced: list):
        self.fn, self.plain, self.marked = fn, plain, marked
        self.flat, self.treedef, self.traced = flat, treedef, traced
        self.index = {key: i for i, key in enumerate(plain.keys())}
        self.positions = [self.index[key] for key in marked]
        self.untouched: frozenset | None = None

    def __call__(self, full: tuple, values: tuple, dyn: list) -> tuple[Any, Params]:
        leaves = list(self.flat)
        for i, x in zip(self.traced, dyn, strict=True):
            leaves[i] = x
        a, kw = jax.tree_util.tree_unflatten(self.treedef, leaves)
        vals = list(values)
        for i, x in zip(self.positions, full, strict=True):
            vals[i] = x
        out, new = self.fn(self.plain.with_leaves(vals), *a, **kw)
        if not isinstance(new, Params):
            raise TypeError(
                f"fsdp_call: {getattr(self.fn, '__name__', self.fn)!r} must return (out, "
                f"params); got a second element of type {type(new).__name__}."
            )
        returned = new.leaves()
        where = {key: j for j, key in enumerate(new.keys())}
        new_vals = list(returned)
        for key in self.marked:
            j = where.get(key)
            if j is not None:
                new_vals[j] = None  # the shard goes back in below
        if self.untouched is None:
            self.untouched = frozenset(
                key
                for key, j in where.items()
                if (i := self.index.get(key)) is not None
                and vals[i] is not None
                and returned[j] is vals[i]
            )
        return out, new.with_leaves(new_vals)


def _gather(shards: tuple, marks: tuple, after: Any) -> tuple:
    """The full weights: each shard all-gathered over its mark's axis, after `after`.

    A zero-valued dependency on `after` (the layer's inputs in the forward, the incoming
    cotangent in the backward) makes the gather run when the step reaches this layer:
    XLA can neither hoist it (all layers' full weights alive at once) nor merge the
    backward's gather with the forward's (the CPU pipeline drops optimization barriers
    before common-subexpression elimination). A shard held in the reduce dtype is
    gathered (and used) in its stored dtype.
    """
    leaves = [c for c in jax.tree.leaves(after) if jnp.issubdtype(c.dtype, jnp.inexact)]
    if leaves:
        first = jnp.real(leaves[0].ravel()[0]).astype(jnp.float32)
        dep = jnp.minimum(jnp.abs(first), jnp.zeros((), jnp.float32))  # 0 (NaN stays)
        shards = tuple(x + dep.astype(x.dtype) for x in shards)
    return tuple(
        jax.lax.all_gather(x if use is None else x.astype(use), axis, axis=dim, tiled=True)
        for x, (axis, dim, _, use) in zip(shards, marks, strict=True)
    )


def _scatter(grads: tuple, shards: tuple, marks: tuple) -> tuple:
    """The full weights' gradients reduce-scattered back to shards (the transpose of
    `_gather`).

    The sum over the data axis runs in the step's reduce dtype (f32 for bf16
    gradients); the cotangent of a shard has the shard's dtype: the reduce dtype when
    the step holds the shard in it (then no rounding), else the stored one.
    """
    out = []
    for g, x, (axis, dim, rd, _) in zip(grads, shards, marks, strict=True):
        r = reduce_dtype_of(g.dtype, rd)
        y = jax.lax.psum_scatter(g.astype(r), axis, scatter_dimension=dim, tiled=True)
        out.append(y.astype(x.dtype))
    return tuple(out)


def _gather_call_scatter(call: _LayerCall, marks: tuple, remat: bool | str) -> Callable:
    """``run(shards, values, dyn, after)``: `call` on the gathered shards, a
    ``custom_vjp`` whose backward reduce-scatters the weights' gradients. What it keeps
    for the backward (`remat`): ``'weights'``, the layer's residuals except those of the
    full weights alone (`_WeightResiduals`), which the backward gathers again and
    rebuilds; ``True``, the shards and the inputs only (the backward gathers again and
    recomputes the layer); ``False``, the layer's own residuals, full weights included."""
    plan: list[_WeightResiduals] = []  # set by the forward, read by the backward

    @jax.custom_vjp
    def run(shards, values, dyn, after):
        return call(_gather(shards, marks, after or dyn), values, dyn)

    def run_fwd(shards, values, dyn, after):
        full = _gather(shards, marks, after or dyn)
        if remat == "weights":
            plan[:] = [_WeightResiduals(call, full, values, dyn)]
            out, kept = plan[0].forward(full, values, dyn)
            return out, (kept, shards, values, after)
        if remat:  # residuals: the shards and the inputs only; the full weights die here
            return call(full, values, dyn), (shards, values, dyn, after)
        out, vjp = jax.vjp(call, full, values, dyn)  # the layer's own residuals
        return out, (vjp, shards, after)

    def run_bwd(res, ct):
        if remat == "weights":
            kept, shards, values, after = res
            vjp = plan[0].vjp(kept, _gather(shards, marks, ct[0]), values)
        elif remat:
            shards, values, dyn, after = res
            _, vjp = jax.vjp(call, _gather(shards, marks, ct[0]), values, dyn)
        else:
            vjp, shards, after = res
        g_full, g_values, g_dyn = vjp(ct)
        zeros = [jnp.zeros_like(a) for a in after]
        return _scatter(g_full, shards, marks), g_values, g_dyn, zeros

    run.defvjp(run_fwd, run_bwd)
    return run


class _WeightResiduals:
    """The layer's VJP split for ``remat='weights'``.

    Traced once (``jax.make_jaxpr`` of ``jax.vjp(call, full, values, dyn)``, with the
    jitted calls inside inlined, `_Flat`), each residual is kept for the backward unless
    it is computed from the params alone: it reads a full weight and none of the call's
    traced arguments `dyn` (the full weight itself, its casts and transposes, also
    inside a jitted function that reads the inputs too). The backward rebuilds those
    from the weights it gathers again (`vjp`), running the equations of the trace that
    compute them and no other (no product with the inputs: no forward runs twice).
    """

    def __init__(self, call: _LayerCall, full: tuple, values: tuple, dyn: list):
        closed, shape = jax.make_jaxpr(lambda f, v, d: jax.vjp(call, f, v, d), return_shape=True)(
            full, values, dyn
        )
        self.flat = _Flat(closed)
        self.treedef = jax.tree.structure(shape[1])
        self.out_tree = jax.tree.structure(shape[0])
        n_full, n_values = len(jax.tree.leaves(full)), len(jax.tree.leaves(values))
        ins = self.flat.ins
        on_full, on_dyn = set(ins[:n_full]), set(ins[n_full + n_values :])
        for _, reads, writes in self.flat.eqns:  # an equation's outputs read all its inputs
            reads = [k for k in reads if not isinstance(k, Literal)]
            if any(k in on_dyn for k in reads):
                on_dyn.update(writes)
            elif any(k in on_full for k in reads):
                on_full.update(writes)
        res = self.flat.outs[self.out_tree.num_leaves :]
        self.dropped = tuple(
            not isinstance(k, Literal) and k in on_full and k not in on_dyn for k in res
        )
        self.rebuild = self.flat.needed([k for k, d in zip(res, self.dropped, strict=True) if d])
        if any(k in on_dyn for k in self.flat.reads(self.rebuild)):
            raise AssertionError("fsdp_call: a rebuilt residual reads the layer's inputs.")

    def forward(self, full: tuple, values: tuple, dyn: list) -> tuple[Any, list]:
        """The layer's output and the residuals the backward keeps."""
        got = self.flat.run(jax.tree.leaves((full, values, dyn)), range(len(self.flat.eqns)))
        n = self.out_tree.num_leaves
        res = [r for r, d in zip(got[n:], self.dropped, strict=True) if not d]
        return jax.tree.unflatten(self.out_tree, got[:n]), res

    def vjp(self, kept: list, full: tuple, values: tuple) -> Callable:
        """The layer's VJP from the kept residuals and the weights gathered again."""
        env = self.flat.run(jax.tree.leaves((full, values)), self.rebuild, outputs=False)
        n = self.out_tree.num_leaves
        res = self.flat.outs[n:]
        it = iter(kept)
        leaves = [
            self.flat.read(env, k) if d else next(it)
            for k, d in zip(res, self.dropped, strict=True)
        ]
        return jax.tree.unflatten(self.treedef, leaves)


# Call primitives whose jaxpr `_Flat` inlines (their outputs then depend on what each
# reads, not on all their inputs).
_CALLS = frozenset({"pjit", "jit", "closed_call", "core_call"})


class _Flat:
    """A closed jaxpr's equations with its jitted calls inlined, each value keyed
    ``(scope, var)`` (a jaxpr inlined twice gets two scopes); `Literal`\\ s stay
    themselves.

    Attributes:
      eqns: ``(eqn, read keys, written keys)`` in order.
      consts: ``{key: value}`` of the jaxprs' constants.
      ins, outs: the keys (or literals) of the top jaxpr's inputs and outputs.
    """

    def __init__(self, closed: Any):
        self.eqns: list = []
        self.consts: dict = {}
        self._scopes = 0
        jaxpr = closed.jaxpr
        self.ins = [(0, v) for v in jaxpr.invars]
        self.outs = self._inline(jaxpr, list(closed.consts), self.ins)

    def _inline(self, jaxpr: Any, consts: list, ins: list) -> list:
        me = self._scopes
        self._scopes += 1
        alias = dict(zip(jaxpr.invars, ins, strict=True))

        def key(v):
            return v if isinstance(v, Literal) else alias.get(v, (me, v))

        for cv, val in zip(jaxpr.constvars, consts, strict=True):
            self.consts[key(cv)] = val
        for eqn in jaxpr.eqns:
            sub = eqn.params.get("jaxpr") if eqn.primitive.name in _CALLS else None
            inner = getattr(sub, "jaxpr", None)
            if inner is not None and len(inner.invars) == len(eqn.invars):
                got = self._inline(inner, list(sub.consts), [key(a) for a in eqn.invars])
                alias.update(zip(eqn.outvars, got, strict=True))
                continue
            self.eqns.append((eqn, [key(a) for a in eqn.invars], [key(o) for o in eqn.outvars]))
        return [key(v) for v in jaxpr.outvars]

    def needed(self, outs: list) -> list[int]:
        """The indices of the equations that compute `outs`, in order."""
        need = {k for k in outs if not isinstance(k, Literal)}
        which = []
        for i in range(len(self.eqns) - 1, -1, -1):
            _, reads, writes = self.eqns[i]
            if any(k in need for k in writes):
                which.append(i)
                need.update(k for k in reads if not isinstance(k, Literal))
        return which[::-1]

    def reads(self, which: list[int]) -> set:
        """The keys the equations `which` read that none of them writes."""
        written = {k for i in which for k in self.eqns[i][2]}
        return {
            k
            for i in which
            for k in self.eqns[i][1]
            if not isinstance(k, Literal) and k not in written
        }

    @staticmethod
    def read(env: dict, k: Any) -> Any:
        return k.val if isinstance(k, Literal) else env[k]

    def run(self, args: list, which: Any, outputs: bool = True) -> Any:
        """Binds the equations `which` on the inputs `args` (a prefix of the inputs);
        returns the outputs' values, or with ``outputs=False`` the values by key."""
        env = dict(self.consts)
        env.update(zip(self.ins[: len(args)], args, strict=True))
        for i in which:
            eqn, reads, writes = self.eqns[i]
            with eqn.ctx.manager:
                got = eqn.primitive.bind(
                    *(self.read(env, k) for k in reads), **eqn.primitive.get_bind_params(eqn.params)
                )
            env.update(zip(writes, got if eqn.primitive.multiple_results else [got], strict=True))
        return [self.read(env, k) for k in self.outs] if outputs else env


def _put_back(
    params: Params, new: Params, marked: dict, shards: tuple, untouched: frozenset | None
) -> Params:
    """The params `fsdp_call` returns: `new` (from `_LayerCall`) with the shards back at
    the marked paths, marked again, and the untouched paths holding the caller's arrays."""
    where = {key: j for j, key in enumerate(new.keys())}
    new_vals = list(new.leaves())
    for key, x in zip(marked, shards, strict=True):
        j = where.get(key)
        if j is not None:
            new_vals[j] = x
    old = params.arrays()
    for key in untouched or ():
        new_vals[where[key]] = old[key]
    new = new.with_leaves(new_vals)
    return _with_marks(new, {k: marked[k] for k in new.keys() if k in marked})


# ---------------------------------------------------------------------------
# Gradients inside the shard_map
# ---------------------------------------------------------------------------


def fsdp_value_and_grad(
    loss_fn: Callable[..., Any],
    specs: Params,
    *,
    axis: str | tuple[str, ...] = "data",
    microbatches: int = 1,
    gather: str = "per_layer",
    has_aux: bool = False,
    predicate: Callable[[Path, Any], bool] | None = None,
    rngs: Sequence[Rng] = (),
    reduce_dtype: Any = None,
) -> Callable[..., Any]:
    """FSDP gradients, to call **inside** ``jax.shard_map`` with the params sharded by
    `specs` (`fsdp_specs`): the gradients leave sharded like the params, summed over the
    data axis, as the global-batch gradient of `dp_value_and_grad`.

    ``loss_fn(params, *batch)`` returns ``(loss, params)`` (or ``((loss, aux), params)``
    with `has_aux`) and calls each layer through `fsdp_call`::

        def loss_fn(params, x, y):
            for block in blocks:
                x, params = bp.fsdp_call(block, params, x)   # gather, call, drop
            return jnp.mean((x - y) ** 2), params

    The result ``f(params, *batch)`` gives ``loss, grads, params`` (``(loss, aux), grads,
    params`` with `has_aux`) with the loss and aux averaged (weighted by
    ``aux['weight']``) over all shards and microbatches, as `dp_value_and_grad`.

    Gathers (`gather`):

    * ``'per_layer'`` (ZeRO-3): `loss_fn` receives local shards, marked; each `fsdp_call`
      gathers one layer forward and again backward, and autodiff reduce-scatters its
      gradient, once per microbatch. Memory: the shards plus about one layer's full
      weights.
    * ``'per_step'``: every sharded leaf is gathered once at the start, the microbatch
      gradients are accumulated locally in full, and each is reduce-scattered once per
      step (`fsdp_call` is then a plain call). Fewer collectives with many microbatches,
      at the memory of full weights and a full gradient accumulator during the step.

    Replicated leaves (small, or without a divisible dimension) get local gradients and
    one all-reduce per step, with the loss and the metrics.

    Padding: a shard or microbatch of weight 0 contributes nothing, as in
    `dp_value_and_grad`. With ``'per_step'`` (and for replicated leaves) even an
    unguarded masked mean (``0 / 0``) is safe. With ``'per_layer'`` the sharded leaves'
    gradients are reduce-scattered inside the backward, before the weight is known, so a
    NaN from ``0 / 0`` would reach every device: divide by ``jnp.maximum(count, 1)``.

    Args:
      loss_fn: as above.
      specs: the params' ``PartitionSpec`` tree (`fsdp_specs`); leaves sharded over
        `axis` are the FSDP shards.
      axis: the data axis (bound by the enclosing ``shard_map``), or a tuple of axes
        (the FSDP shards split over all of them, see `fsdp_specs`).
      microbatches: gradient accumulation steps, run in a ``jax.lax.scan``.
      gather: ``'per_layer'`` or ``'per_step'`` (see above).
      has_aux: `loss_fn` returns aux.
      predicate: ``(path, Param) -> bool``: the trained params (default: trainable).
      rngs: `Rng` modules whose seeds are folded with the data index (`fold_seeds`):
        every `Rng` that draws keys in `loss_fn` (an unlisted one raises, as in
        `dp_value_and_grad`).
      reduce_dtype: the dtype of the gradient sums, of the reduce-scatters and of the
        all-reduce (default ``None``: float32 for bf16/fp16 gradients, else their own
        dtype). With ``'per_layer'`` the step holds each shard in it while the loss runs
        (`fsdp_call` gathers and uses the weight in its stored dtype, e.g. bf16), so the
        reduce-scatter in `fsdp_call`'s backward runs in it and its result is
        accumulated over the microbatches without rounding; with ``'per_step'`` every
        sum runs in it. The gradients are returned in their params' dtypes (rounded
        once, at the end).

    Returns:
      ``f(params, *batch)``; ``grads`` holds local shards of the sharded leaves (leave the
      ``shard_map`` with `specs` as out_specs) and the replicated gradients of the rest.

    Raises:
      ValueError: `axis` not bound, an unknown `gather`, a batch not divisible by
        `microbatches`, a data axis that is not the last name of its spec entry.
    """
    return _fsdp_value_and_grad(
        loss_fn,
        specs,
        axis=axis,
        microbatches=microbatches,
        gather=gather,
        has_aux=has_aux,
        predicate=predicate,
        rngs=rngs,
        reduce_dtype=reduce_dtype,
        where="fsdp_value_and_grad",
    )


def _fsdp_value_and_grad(
    loss_fn: Callable[..., Any],
    specs: Params,
    *,
    axis: str | tuple[str, ...],
    microbatches: int,
    gather: str,
    has_aux: bool,
    predicate: Callable[[Path, Any], bool] | None,
    rngs: Sequence[Rng],
    reduce_dtype: Any,
    where: str,
) -> Callable[..., Any]:
    """`fsdp_value_and_grad`, naming `where` (the public entry point) in its messages."""
    _check_fsdp_options(microbatches, gather, specs, axis, where)
    dims_all = _sharded_dims(specs, axis, where)
    rngs = _check_rngs(rngs, where)
    reduce_dtype = check_reduce_dtype(reduce_dtype, where)

    def f(params: Params, *batch: Any):
        names = check_axis(axis, where)
        name = names if len(names) > 1 else names[0]  # the collectives' axis
        _check_step_params(params, specs, where)
        params, seeds = fold_seeds(params, rngs, names)
        trainable, rest = params.split(predicate)
        dims = {key: d for key, d in dims_all.items() if key in trainable}
        sums, rest = accumulate_microbatches(
            loss_fn,
            _step_trainable(trainable, dims, names, gather, reduce_dtype),
            rest,
            batch,
            k=microbatches,
            size=math.prod(jax.lax.axis_size(n) for n in names),
            names=names,
            has_aux=has_aux,
            predicate=predicate,
            where=where,
            clean_state=_without_marks,
            clean_grads=lambda g: trainable.with_leaves(g.leaves()),
            reduced_inside=frozenset(dims) if gather == "per_layer" else frozenset(),
            rngs=rngs,
            reduce_dtype=reduce_dtype,
        )
        grads, loss, aux = _sum_over_shards(sums, dims, name, gather)
        grads = _like(grads, trainable)
        rest = restore_seeds(rest, seeds)
        rest = _settle_state(rest, names, where)
        return ((loss, aux) if has_aux else loss), grads, trainable.merge(rest)

    return f


def _check_fsdp_options(microbatches: Any, gather: Any, specs: Any, axis: Any, where: str) -> None:
    """Refuses a bad `microbatches`, `gather`, `specs` or `axis`, naming `where`."""
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"{where}: microbatches must be an int >= 1, got {microbatches!r}.")
    if gather not in _GATHER_MODES:
        raise ValueError(
            f"{where}: gather must be one of {_GATHER_MODES}, got {gather!r}. 'per_layer' "
            "gathers each layer in fsdp_call (ZeRO-3 memory); 'per_step' gathers everything "
            "once and reduce-scatters once per step."
        )
    if not isinstance(specs, Params):
        raise TypeError(
            f"{where}: specs must be the Params of PartitionSpec from fsdp_specs, got "
            f"{type(specs).__name__}."
        )
    _axis_names(axis, where)


def _check_step_params(params: Any, specs: Params, where: str) -> None:
    """The step's params must be `Params` with a spec for every path."""
    if not isinstance(params, Params):
        raise TypeError(
            f"{where}: the first argument must be bx.Params, got {type(params).__name__}."
        )
    missing = [format_path(k) for k in params.keys() if k not in specs]
    if missing:
        raise ValueError(
            f"{where}: specs have no entry for {missing[:5]}. Build them from these "
            "params: bp.fsdp_specs(jax.eval_shape(init), mesh)."
        )


def _step_trainable(
    trainable: Params,
    dims: dict[Path, int],
    names: tuple[str, ...],
    gather: str,
    reduce_dtype: Any,
) -> Params:
    """The trainable params the loss function receives, varying over the data axis.

    ``'per_step'``: every sharded leaf (`dims`: path -> sharded dimension) all-gathered
    once. ``'per_layer'``: the local shards, marked for `fsdp_call`, each held in the
    reduce dtype (f32 for bf16 weights) while the loss runs: `fsdp_call` gathers and
    uses it in its stored dtype, and the cotangent of the f32 shard carries the f32
    reduce-scatter without rounding it.
    """
    name = names if len(names) > 1 else names[0]
    keys, values = trainable.keys(), trainable.leaves()
    if gather == "per_step":
        values = tuple(
            jax.lax.all_gather(v, name, axis=dims[key], tiled=True) if key in dims else v
            for key, v in zip(keys, values, strict=True)
        )
        return _to_varying(trainable.with_leaves(values), names)
    arrays = trainable.arrays()
    stored = {key: arrays[key].dtype for key in dims}
    held = {key: reduce_dtype_of(dt, reduce_dtype) for key, dt in stored.items()}
    values = tuple(
        v.astype(held[key]) if key in dims and held[key] != v.dtype else v
        for key, v in zip(keys, values, strict=True)
    )
    rd_name = None if reduce_dtype is None else str(reduce_dtype)
    return _with_marks(
        _to_varying(trainable.with_leaves(values), names),
        {
            key: (name, d, rd_name, None if held[key] == stored[key] else str(stored[key]))
            for key, d in dims.items()
        },
    )


def _sum_over_shards(
    sums: tuple, dims: dict[Path, int], name: str | tuple[str, ...], gather: str
) -> tuple[Params, Any, Any]:
    """``(grads, loss, aux)`` summed over the data axis `name` from this device's
    microbatch sums ``(grads, (loss, aux), weight)``, divided by the total weight when
    there is one (else the sums are already means).

    One all-reduce carries the replicated leaves' gradients, the loss, the metrics and
    the weight. A sharded leaf (`dims`) is reduce-scattered once here with
    ``'per_step'``; with ``'per_layer'`` the transpose of `fsdp_call`'s gather already
    did it.
    """
    grads, (loss, aux), w = sums
    keys = grads.keys()
    reduced = [g for key, g in zip(keys, grads.leaves(), strict=True) if key not in dims]
    reduced, loss, aux, w = jax.lax.psum((reduced, loss, aux, w), name)
    it = iter(reduced)
    values = []
    for key, g in zip(keys, grads.leaves(), strict=True):
        if key not in dims:
            values.append(next(it))
        elif gather == "per_step":  # the one reduce-scatter of this leaf per step
            values.append(jax.lax.psum_scatter(g, name, scatter_dimension=dims[key], tiled=True))
        else:  # already reduce-scattered by the transpose of fsdp_call's gather
            values.append(g)
    grads = grads.with_leaves(values)
    if w is not None:
        denom = jnp.where(w > 0, w, jnp.ones((), w.dtype))
        grads = jax.tree.map(lambda g: g / denom.astype(g.dtype), grads)
        loss = loss / denom.astype(loss.dtype)
        aux = _aux_finish(aux, denom, w)
    return grads, loss, aux


# ---------------------------------------------------------------------------
# The train step
# ---------------------------------------------------------------------------


def make_fsdp_train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    specs: Params,
    *,
    axis: str | tuple[str, ...] = "data",
    microbatches: int = 1,
    gather: str = "per_layer",
    has_aux: bool = False,
    batch_spec: PartitionSpec | None = None,
    rngs: Sequence[Rng] = (),
    predicate: Callable[[Path, Any], bool] | None = None,
    grad_norm: bool = False,
    reduce_dtype: Any = None,
) -> Callable[..., Any]:
    """Builds ``step(params, opt_state, *batch) -> (params, opt_state, metrics)`` for a
    fully sharded data-parallel step (FSDP, or FSDP x TP with TP axes in `specs`); the
    user jits it (``jax.jit(step, donate_argnums=(0, 1))``).

    What it does, in plain JAX (as `make_dp_train_step`):

    1. Checks that the global batch divides by ``mesh.shape[axis] * microbatches``.
    2. ``jax.shard_map`` over `mesh`: batch over `axis`, params with `specs`;
       `fsdp_value_and_grad` gives gradients sharded as the params.
    3. Outside the ``shard_map``, ``tx.update`` and ``optax.apply_updates`` on the
       sharded arrays: each device updates its shards (Adam's moments are sharded by
       `opt_state_shardings` with the same specs), and what needs a global value, such as
       ``optax.clip_by_global_norm``, reduces over the shards (a scalar all-reduce), so
       it equals the unsharded transformation. Optax runs under standard dtype
       promotion (as in `make_dp_train_step`), also in a step traced under strict.

    Args:
      loss_fn: ``(params, *batch) -> (loss, params)`` calling layers via `fsdp_call`.
      tx: the Optax transformation; its state built with `opt_state_shardings(...,
        specs, mesh)`.
      mesh: the device mesh; `axis` must be one of its axes.
      specs: from `fsdp_specs`; the params passed in must have these shardings.
      axis: the data axis, or a tuple: ``('data', 'context')`` with
        ``batch_spec=P('data', 'context')`` (`cp_batch_spec`) for data x context
        parallelism, the loss and gradients reduced over both and the parameters
        sharded over both (`specs` from ``fsdp_specs(..., axis=('data', 'context'))``).
      microbatches: gradient accumulation steps inside each shard.
      gather: ``'per_layer'`` or ``'per_step'`` (see `fsdp_value_and_grad`).
      has_aux: `loss_fn` returns aux (``aux['weight']`` weights the mean).
      batch_spec: the spec of every batch leaf (default ``P(axis)``).
      rngs: `Rng` modules whose seeds are folded with the data-axis index: every `Rng`
        that draws keys in `loss_fn` (an unlisted one raises naming it).
      predicate: ``(path, Param) -> bool``: which params are trained.
      grad_norm: add ``metrics['grad_norm']``, the global norm of the gradient (over all
        shards; equal to ``optax.tree.norm`` of the unsharded gradient).
      reduce_dtype: the dtype of the gradient sums and collectives (default: float32
        for bf16/fp16 gradients); see `fsdp_value_and_grad`.

    Returns:
      ``step``; ``metrics`` holds ``'loss'``, the aux dict's entries and ``'grad_norm'``.

    Raises:
      ValueError: `axis` not in the mesh; a batch not divisible by data x microbatches;
        a batch leaf of one process's rows when the mesh spans several processes (as
        `make_dp_train_step`: assemble it with `blox.distributed.global_batch`).
    """
    where = "make_fsdp_train_step"
    _check_data_axis(mesh, axis, where)
    bspec = PartitionSpec(axis) if batch_spec is None else batch_spec
    grad_fn = _fsdp_value_and_grad(
        loss_fn,
        specs,
        axis=axis,
        microbatches=microbatches,
        gather=gather,
        has_aux=has_aux,
        predicate=predicate,
        rngs=rngs,
        reduce_dtype=reduce_dtype,
        where=where,
    )

    def step(params: Params, opt_state: Any, *batch: Any):
        params, opt_state, metrics, grads = sharded_train_step(
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
            where=where,
        )
        if grad_norm:
            metrics["grad_norm"] = optax.tree.norm(grads)
        return params, opt_state, metrics

    return step


def bytes_per_device(tree: Any) -> int:
    """The bytes one device holds of the arrays in `tree`, read from their shardings:
    the sum over leaves of the shard shape's size times the item size (the largest such
    sum over devices; shards of a ``NamedSharding`` have one shape).

    Args:
      tree: a pytree of ``jax.Array`` (params, optimizer state) or of
        ``jax.ShapeDtypeStruct`` with shardings.

    Returns:
      The byte count (int).

    >>> import jax, jax.numpy as jnp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from blox import parallel as bp
    >>> mesh = bp.make_mesh((8,), ('data',))
    >>> x = jax.device_put(jnp.zeros((64, 4)), NamedSharding(mesh, P('data')))
    >>> bp.bytes_per_device({'x': x, 'y': jnp.zeros(3)})
    140
    """
    total = 0
    for kp, x in jax.tree_util.tree_leaves_with_path(tree):
        sharding = getattr(x, "sharding", None)
        shape = tuple(getattr(x, "shape", ()))
        dtype = getattr(x, "dtype", None)
        if dtype is None:
            raise TypeError(
                f"bytes_per_device: leaf {jax.tree_util.keystr(kp)} is a {type(x).__name__}, "
                "not an array."
            )
        local = sharding.shard_shape(shape) if sharding is not None else shape
        total += math.prod(local) * jnp.dtype(dtype).itemsize
    return total
