"""Sharding rules: an ordered list of (parameter-path pattern -> per-dimension axes).

They give the ``PartitionSpec`` / ``NamedSharding`` trees of `Params` (for
``jax.jit(init, out_shardings=...)``) and of the Optax state built from them, and a
printable table. Rules need no change to any layer: they are matched against paths.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from blox.core import Params
from blox.core._params import format_path

__all__ = [
    "cp_batch_spec",
    "opt_state_shardings",
    "opt_state_specs",
    "param_shardings",
    "param_specs",
    "sharding_table",
]

Rule = tuple[str, Any]

_UNMATCHED = (
    "{n} parameter(s) match no sharding rule and have no metadata['sharding']:\n"
    "{paths}\n"
    "The rules (patterns are regular expressions matched against the end of the path, "
    "whole names):\n{rules}\n"
    "Add a rule for each, e.g. ('{example}', None) to replicate it, or pass "
    "replicate_rest=True to replicate every unmatched parameter."
)


def _fmt_spec(spec: PartitionSpec) -> str:
    if len(spec) == 0:
        return "P()"
    return "P(" + ", ".join(repr(e) for e in spec) + ")"


def _normalize_spec(spec: Any, where: str) -> tuple | None:
    """A rule's spec as a tuple of entries, or None (replicated at any rank)."""
    if spec is None:
        return None
    if isinstance(spec, PartitionSpec):
        spec = tuple(spec)
    if not isinstance(spec, (tuple, list)):
        raise TypeError(
            f"{where}: the spec must be None (replicated), a PartitionSpec or a tuple with one "
            f"entry per dimension, got {type(spec).__name__} {spec!r}. Write e.g. "
            "(None, 'model')."
        )
    out = []
    for e in spec:
        if isinstance(e, list):
            e = tuple(e)
        ok = (
            e is None
            or isinstance(e, str)
            or (isinstance(e, tuple) and e and all(isinstance(n, str) for n in e))
        )
        if not ok:
            raise TypeError(
                f"{where}: spec entry {e!r} is not None, a mesh-axis name or a tuple of names."
            )
        out.append(e)
    if not out:
        return None
    return tuple(out)


@dataclass(frozen=True)
class _Rule:
    index: int
    pattern: str
    regex: re.Pattern
    spec: tuple | None

    def label(self) -> str:
        spec = "None" if self.spec is None else repr(self.spec)
        return f"rule {self.index} ({self.pattern!r} -> {spec})"


def _compile_rules(rules: Sequence[Rule]) -> list[_Rule]:
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(
            f"rules must be a list of (pattern, spec) pairs, got {type(rules).__name__}. "
            "Write e.g. [('attn/query/kernel', (None, 'model')), ('norm1/scale', None)]."
        )
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise TypeError(
                f"rule {i} is {rule!r}; each rule is a (pattern, spec) pair with a string "
                "pattern, e.g. ('mlp/linear_0/kernel', (None, 'model'))."
            )
        pattern, spec = rule
        try:
            regex = re.compile(rf"(?:.*/)?(?:{pattern})")
        except re.error as e:
            raise ValueError(
                f"rule {i}: pattern {pattern!r} is not a regular expression: {e}."
            ) from None
        out.append(_Rule(i, pattern, regex, _normalize_spec(spec, f"rule {i} ({pattern!r})")))
    return out


def _rules_text(rules: list[_Rule]) -> str:
    if not rules:
        return "    (no rules)"
    return "\n".join("    " + r.label() for r in rules)


@dataclass(frozen=True)
class _Row:
    path: str
    shape: tuple[int, ...]
    spec: PartitionSpec
    source: str


def _check_spec(
    spec: tuple, path: str, shape: tuple, mesh: Mesh | None, source: str
) -> PartitionSpec:
    where = f"Parameter '{path}' of shape {shape}"
    if len(spec) != len(shape):
        raise ValueError(
            f"{where} has {len(shape)} dimension(s), but {source} gives {len(spec)} entries "
            f"{spec}. Give one entry (an axis name, a tuple of names, or None) per dimension, "
            "or None for the whole spec to replicate."
        )
    seen: dict[str, int] = {}
    sizes = None if mesh is None else dict(mesh.shape)
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        total = 1
        for name in names:
            if name in seen:
                raise ValueError(
                    f"{where}: {source} uses mesh axis {name!r} for dimensions {seen[name]} and "
                    f"{dim}; an axis can shard one dimension only."
                )
            seen[name] = dim
            if sizes is not None:
                if name not in sizes:
                    raise ValueError(
                        f"{where}: {source} shards dimension {dim} over mesh axis {name!r}, "
                        f"but the mesh has axes {tuple(sizes)}. Use one of those names or add "
                        "the axis to the mesh."
                    )
                total *= sizes[name]
        if sizes is not None and shape[dim] % total:
            raise ValueError(
                f"{where}: {source} shards dimension {dim} (size {shape[dim]}) over {entry!r} "
                f"of size {total}, which does not divide it (mesh {sizes}). Choose a size "
                f"divisible by {total}, shard another dimension, or replicate it."
            )
    return PartitionSpec(*spec)


def _closest(pattern: str, paths: list[str], n: int = 5) -> list[str]:
    """Up to `n` paths whose end looks most like `pattern` (a misspelling's target), or
    the first `n` paths when none is close."""
    depth = pattern.count("/") + 1
    scored = []
    for p in paths:
        end = "/".join(p.split("/")[-depth:])
        ratio = difflib.SequenceMatcher(None, pattern, end).ratio()
        if ratio >= 0.6:
            scored.append((-ratio, p))
    return [p for _, p in sorted(scored)[:n]] or paths[:n]


def _unused_error(
    unused: list[_Rule],
    compiled: list[_Rule],
    taken: dict[int, list[tuple[str, int]]],
    paths: list[str],
) -> str:
    """The message for rules that place no parameter: never matched, or shadowed."""
    lines = []
    for r in unused:
        hits = taken.get(r.index, [])
        if not hits:
            some = _closest(r.pattern, paths)
            lines.append(
                f"    {r.label()} matches no parameter; some paths: "
                + (", ".join(f"'{p}'" for p in some) or "(no parameters)")
            )
        else:
            by = sorted({i for _, i in hits})
            lines.append(
                f"    {r.label()} is shadowed: every parameter it matches is taken by an "
                f"earlier rule ({', '.join(compiled[i].label() for i in by)}), e.g. "
                f"'{hits[0][0]}'"
            )
    return (
        f"{len(unused)} sharding rule(s) place no parameter (the first matching rule "
        "places each parameter):\n"
        + "\n".join(lines)
        + "\nFix the pattern (patterns are regular expressions matched against the end of "
        "the path, whole names), move a shadowed rule before the rule that takes its "
        "parameters, or delete it; pass allow_unused=True when one rule list serves "
        "several models."
    )


def _resolve(
    params: Params,
    rules: Sequence[Rule],
    mesh: Mesh | None,
    replicate_rest: bool,
    allow_unused: bool = False,
) -> list[_Row]:
    if not isinstance(params, Params):
        raise TypeError(
            f"expected bx.Params (concrete, or abstract from jax.eval_shape(init)), got "
            f"{type(params).__name__}."
        )
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}.")
    compiled = _compile_rules(rules)
    rows: list[_Row] = []
    unmatched: list[str] = []
    won: set[int] = set()
    taken: dict[int, list[tuple[str, int]]] = {}  # rule -> (path, winning rule) it lost
    paths = []
    for key, param in params.items():
        value = param.value
        path = format_path(key)
        paths.append(path)
        shape = tuple(getattr(value, "shape", ()))
        hits = [r for r in compiled if r.regex.fullmatch(path)]
        meta = param.sharding
        if hits:
            first = hits[0]  # first match wins: later matching rules are not consulted
            won.add(first.index)
            for other in hits[1:]:
                taken.setdefault(other.index, []).append((path, first.index))
            source = f"rule {first.index}"
            if first.spec is None:
                spec = PartitionSpec()
                _check_spec((), path, (), mesh, first.label())
            else:
                spec = _check_spec(first.spec, path, shape, mesh, first.label())
            same = tuple(spec) == meta or (len(spec) == 0 and all(m is None for m in meta))
            if meta and not same:
                source += f" (overrides metadata {meta})"
        elif meta:
            spec = _check_spec(meta, path, shape, mesh, f"metadata['sharding'] {meta}")
            source = "metadata"
        elif replicate_rest:
            spec, source = PartitionSpec(), "replicate_rest"
        else:
            unmatched.append(f"    '{path}' {shape}")
            continue
        rows.append(_Row(path, shape, spec, source))
    if unmatched:
        first = unmatched[0].split("'")[1].split("/")[-1]
        raise ValueError(
            _UNMATCHED.format(
                n=len(unmatched),
                paths="\n".join(unmatched),
                rules=_rules_text(compiled),
                example=re.escape(first),
            )
        )
    unused = [r for r in compiled if r.index not in won]
    if unused and not allow_unused:
        raise ValueError(_unused_error(unused, compiled, taken, paths))
    return rows


def param_specs(
    params: Params,
    rules: Sequence[Rule],
    mesh: Mesh | None = None,
    *,
    replicate_rest: bool = False,
    allow_unused: bool = False,
) -> Params:
    """The ``PartitionSpec`` of every parameter, as a `Params` with the same paths.

    Each rule is ``(pattern, spec)``: `pattern` is a regular expression matched against
    the end of the parameter's path (whole names; ``'attn/query/kernel'`` matches
    ``'lm/block_0/attn/query/kernel'``), `spec` is ``None`` (replicated, any rank) or one
    entry per dimension (``None``, a mesh-axis name, or a tuple of names), or a
    ``PartitionSpec``. Rules cover every layer, since they need only the path.

    Resolution, per parameter:

    1. **The first matching rule wins** (as in t5x/EasyLM rule lists): later rules that
       also match are not consulted, so specific rules go first and a catch-all such as
       ``('.*', None)`` last.
    2. A matching rule **wins over** ``metadata['sharding']`` (the layer author's default):
       rules are the deployment decision for this mesh. `sharding_table` marks each such
       override.
    3. Without a matching rule, a non-empty ``metadata['sharding']`` is used.
    4. Otherwise the parameter is unmatched: an error listing every unmatched path next
       to the rules, unless ``replicate_rest=True`` (then it is replicated).

    Every rule must place at least one parameter: a rule that matches none (often a
    misspelled pattern, which ``replicate_rest=True`` would otherwise hide) or whose
    every match is taken by an earlier rule (shadowed) is an error naming it, unless
    ``allow_unused=True``.

    Args:
      params: concrete or abstract params (``jax.eval_shape(init)``); non-trainable
        ones (RNG seeds, running statistics) need a rule too.
      rules: the ordered ``(pattern, spec)`` list.
      mesh: when given, axis names and divisibility are checked against it.
      replicate_rest: replicate unmatched parameters instead of raising.
      allow_unused: accept rules that place no parameter (e.g. one rule list shared by
        several models) instead of raising.

    Returns:
      A `Params` of ``PartitionSpec`` leaves (same paths, flags and metadata).

    Raises:
      ValueError: unmatched parameters, a rule that places no parameter (unless
        `allow_unused`), a spec whose length differs from the rank, an axis the mesh
        lacks, an axis used twice, or a dimension not divisible by its axes; each names
        the path and the shape, or the rule.
      TypeError: malformed rules.

    >>> import jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> params = bx.Params()
    >>> params[('net', 'fc', 'kernel')] = bx.Param(jnp.zeros((4, 8)))
    >>> params[('net', 'fc', 'bias')] = bx.Param(jnp.zeros((8,)))
    >>> specs = bp.param_specs(params, [('fc/kernel', (None, 'model')), ('fc/bias', ('model',))])
    >>> specs[('net', 'fc', 'kernel')].value
    P(None, 'model')
    >>> specs = bp.param_specs(params, [('fc/kernel', (None, 'model')), ('.*', None)])
    >>> specs[('net', 'fc', 'bias')].value  # the catch-all: first match wins
    P()
    """
    rows = _resolve(params, rules, mesh, replicate_rest, allow_unused)
    return params.with_leaves([r.spec for r in rows])


def param_shardings(
    params: Params,
    rules: Sequence[Rule],
    mesh: Mesh,
    *,
    replicate_rest: bool = False,
    allow_unused: bool = False,
) -> Params:
    """The ``NamedSharding`` of every parameter (see `param_specs` for the rules: first
    match wins, every rule must place a parameter unless ``allow_unused=True``), for
    ``jax.jit(init, out_shardings=...)`` and ``jax.device_put``.

    Args:
      params: concrete or abstract params.
      rules: the ordered ``(pattern, spec)`` list.
      mesh: the mesh the shardings live on.
      replicate_rest: replicate unmatched parameters instead of raising.
      allow_unused: accept rules that place no parameter.

    Returns:
      A `Params` of ``NamedSharding`` leaves (same paths, flags and metadata).

    >>> import jax, jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> mesh = bp.make_mesh((1,), ('model',), devices=jax.devices()[:1])
    >>> params = bx.Params()
    >>> params[('net', 'fc', 'kernel')] = bx.Param(jnp.zeros((4, 8)))
    >>> sh = bp.param_shardings(params, [('kernel', (None, 'model'))], mesh)
    >>> sh[('net', 'fc', 'kernel')].value.spec
    P(None, 'model')
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"param_shardings needs a jax.sharding.Mesh, got {type(mesh).__name__}. Build one "
            "with blox.parallel.make_mesh."
        )
    specs = param_specs(
        params, rules, mesh, replicate_rest=replicate_rest, allow_unused=allow_unused
    )
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=_is_spec)


def _is_spec(x: Any) -> bool:
    return isinstance(x, PartitionSpec)


def _fits(spec: PartitionSpec, shape: tuple[int, ...], sizes: dict[str, int] | None) -> bool:
    """Whether a parameter's `spec` can lay out an optimizer-state leaf of `shape`: one
    entry per dimension, and every sharded dimension divisible by its axes (without a
    mesh: larger than 1, since a size-1 dimension is sharded over size-1 axes only)."""
    if len(spec) == 0:
        return True
    if len(spec) != len(shape):
        return False
    for entry, size in zip(spec, shape, strict=True):
        if entry is None:
            continue
        names = entry if isinstance(entry, tuple) else (entry,)
        if sizes is None:
            if size <= 1:
                return False
            continue
        total = 1
        for name in names:
            total *= sizes.get(name, 1)
        if size % total:
            return False
    return True


def opt_state_specs(opt_state: Any, specs: Params, mesh: Mesh | None = None) -> Any:
    """The ``PartitionSpec`` tree of an Optax state built from params with `specs`.

    Every `Params` inside the state (Adam's ``mu`` and ``nu``, momentum, EMA, Adafactor's
    ``v``, ``v_row``, ``v_col`` ...) is laid out path by path: a leaf takes its
    parameter's spec when that spec fits it (one entry per dimension, each sharded
    dimension divisible by its mesh axes), which a leaf of the parameter's shape always
    does; any other leaf is replicated. So Adafactor's factored row/column statistics
    (one dimension fewer than the parameter) and its ``(1,)`` placeholders are
    replicated, and ``jax.jit(tx.init, out_shardings=...)`` accepts the tree. Every
    other leaf must be a scalar (step counts) and is replicated.

    Args:
      opt_state: the state (or ``jax.eval_shape(tx.init, trainable)``).
      specs: from `param_specs` (all params, or the trainable half).
      mesh: the mesh the specs are for; when given, divisibility is checked against its
        axis sizes (`opt_state_shardings` passes it). Without it, a sharded dimension of
        size 1 does not fit (the only divisible case shards over size-1 axes).

    Returns:
      A tree with the structure of `opt_state` and ``PartitionSpec`` leaves.

    Raises:
      ValueError: a non-scalar leaf outside a `Params`, or a `Params` with a path that
        `specs` lacks; the message names the leaf.

    >>> import jax, jax.numpy as jnp, optax, blox as bx
    >>> from blox import parallel as bp
    >>> params = bx.Params()
    >>> params[('fc', 'kernel')] = bx.Param(jnp.zeros((4, 8)))
    >>> specs = bp.param_specs(params, [('kernel', (None, 'model'))])
    >>> state = jax.eval_shape(optax.adafactor(1e-3, min_dim_size_to_factor=2).init, params)
    >>> tree = bp.opt_state_specs(state, specs)
    >>> tree[0].v_row[('fc', 'kernel')].value, tree[0].v_col[('fc', 'kernel')].value
    (P(), P())
    """
    if not isinstance(specs, Params):
        raise TypeError(
            f"opt_state_specs: specs must be the Params returned by param_specs, got "
            f"{type(specs).__name__}."
        )
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(
            f"opt_state_specs: mesh must be a jax.sharding.Mesh or None, got {type(mesh).__name__}."
        )
    sizes = None if mesh is None else dict(mesh.shape)
    table = specs.arrays()

    def leaf(kp, x):
        if isinstance(x, Params):
            missing = [format_path(k) for k in x.keys() if k not in table]
            if missing:
                raise ValueError(
                    f"opt_state_specs: the optimizer state at {jax.tree_util.keystr(kp)} holds "
                    f"parameters without a spec: {missing[:5]}. Pass the specs of the params "
                    "the state was built from."
                )
            out = []
            for k, v in zip(x.keys(), x.leaves(), strict=True):
                spec = table[k]
                shape = tuple(getattr(v, "shape", ()))
                out.append(spec if _fits(spec, shape, sizes) else PartitionSpec())
            return x.with_leaves(out)
        shape = tuple(getattr(x, "shape", ()))
        if shape:
            raise ValueError(
                f"opt_state_specs: leaf {jax.tree_util.keystr(kp)} of shape {shape} is not inside "
                "a Params, so no rule says how to shard it. Build the optimizer state from "
                "bx.Params (tx.init(params.split()[0])), or shard this leaf by hand."
            )
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(
        leaf, opt_state, is_leaf=lambda x: isinstance(x, Params)
    )


def opt_state_shardings(opt_state: Any, specs: Params, mesh: Mesh) -> Any:
    """The ``NamedSharding`` tree of an Optax state (see `opt_state_specs`: leaves of
    their parameter's shape follow it, others such as Adafactor's factored statistics
    are replicated), for ``jax.jit(tx.init, out_shardings=...)``.

    Args:
      opt_state: the state (or ``jax.eval_shape(tx.init, trainable)``).
      specs: from `param_specs`.
      mesh: the mesh of the shardings.

    Returns:
      A tree with the structure of `opt_state` and ``NamedSharding`` leaves.

    >>> import jax, jax.numpy as jnp, optax, blox as bx
    >>> from blox import parallel as bp
    >>> mesh = bp.make_mesh((1,), ('model',), devices=jax.devices()[:1])
    >>> params = bx.Params()
    >>> params[('fc', 'kernel')] = bx.Param(jnp.zeros((4, 8)))
    >>> specs = bp.param_specs(params, [('kernel', (None, 'model'))], mesh)
    >>> tx = optax.adam(1e-3)
    >>> sh = bp.opt_state_shardings(jax.eval_shape(tx.init, params), specs, mesh)
    >>> sh[0].mu[('fc', 'kernel')].value.spec, sh[0].count.spec
    (P(None, 'model'), P())
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(
            f"opt_state_shardings needs a jax.sharding.Mesh, got {type(mesh).__name__}. Build "
            "one with blox.parallel.make_mesh."
        )
    tree = opt_state_specs(opt_state, specs, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), tree, is_leaf=_is_spec)


def sharding_table(
    params: Params,
    rules: Sequence[Rule],
    mesh: Mesh,
    *,
    replicate_rest: bool = False,
    allow_unused: bool = False,
) -> str:
    """A printable table: path, global shape, ``PartitionSpec``, per-device shape, and
    where the spec came from (which rule, metadata, or ``replicate_rest``).

    The last line gives the mesh and the bytes per device (float leaves at their dtype).
    Rules resolve as in `param_specs` (first match wins; `allow_unused` likewise).
    """
    rows = _resolve(params, rules, mesh, replicate_rest, allow_unused)
    sizes = dict(mesh.shape)
    values = params.arrays()
    lines = []
    per_device_bytes = 0
    for r, key in zip(rows, params.keys(), strict=True):
        local = list(r.shape)
        for dim, entry in enumerate(r.spec):
            if entry is None:
                continue
            for name in entry if isinstance(entry, tuple) else (entry,):
                local[dim] //= sizes[name]
        v = values[key]
        itemsize = getattr(getattr(v, "dtype", None), "itemsize", 0)
        n = 1
        for d in local:
            n *= d
        per_device_bytes += n * itemsize
        lines.append((r.path, str(r.shape), _fmt_spec(r.spec), str(tuple(local)), r.source))
    header = ("path", "shape", "spec", "per device", "source")
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*header).rstrip(), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line).rstrip() for line in lines]
    axes = " x ".join(f"{n}={s}" for n, s in sizes.items())
    out.append(f"mesh {axes}; {per_device_bytes:,} bytes per device")
    return "\n".join(out)


def cp_batch_spec(
    data_axis: str | tuple[str, ...] | None = "data",
    context_axis: str = "context",
    mesh: Mesh | None = None,
) -> PartitionSpec:
    """The ``PartitionSpec`` of a ``(B, T, ...)`` batch leaf under context parallelism:
    the rows over `data_axis` (one axis, several, or None for none), the sequence over
    `context_axis`: ``P(data_axis, context_axis)``.

    Pass it as ``batch_spec`` to `make_dp_train_step` / `make_fsdp_train_step` with
    ``axis=(data axes..., context_axis)`` (the loss and the gradients are then reduced
    over all of them), or as the ``in_specs`` of the batch in your own ``jax.shard_map``.

    Args:
      data_axis: the axis (or axes) the batch rows are split over, or None.
      context_axis: the axis the sequence is split over.
      mesh: if given, every axis must be one of its axes.

    Raises:
      ValueError: an axis twice, the context axis among the data axes, or an axis the
        mesh lacks.

    >>> from jax.sharding import PartitionSpec as P
    >>> from blox import parallel as bp
    >>> bp.cp_batch_spec('data', 'context') == P('data', 'context')
    True
    """
    data = () if data_axis is None else (data_axis,) if isinstance(data_axis, str) else data_axis
    names = (*tuple(data), context_axis)
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            f"cp_batch_spec: axes must be mesh-axis names, got data_axis={data_axis!r}, "
            f"context_axis={context_axis!r}."
        )
    if len(set(names)) != len(names):
        raise ValueError(
            f"cp_batch_spec: data_axis={data_axis!r} and context_axis={context_axis!r} name an "
            "axis twice; the rows and the sequence must be split over different axes."
        )
    if mesh is not None:
        missing = [n for n in names if n not in mesh.axis_names]
        if missing:
            raise ValueError(
                f"cp_batch_spec: {missing} not axes of the mesh {dict(mesh.shape)}; pass axes "
                f"among {tuple(mesh.axis_names)}."
            )
    first = None if not data else (data[0] if len(data) == 1 else tuple(data))
    return PartitionSpec(first, context_axis)
