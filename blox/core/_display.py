"""Readable text tables of `Params` and module trees; Treescope when installed."""

from __future__ import annotations

import sys
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from blox.core._graph import Graph
from blox.core._module import Module
from blox.core._params import Params, _thaw, format_path

__all__ = ["display", "params_table", "graph_tree"]


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _describe(value: Any) -> tuple[str, str, int, int]:
    """(shape, dtype, size, bytes) of a leaf; non-arrays show their type."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return type(value).__name__, "-", 0, 0
    size = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    itemsize = getattr(dtype, "itemsize", 0) or 0
    return str(tuple(int(d) for d in shape)), str(dtype), size, size * int(itemsize)


def _fmt_entry(entry: Any) -> str:
    if entry is None:
        return "None"
    if isinstance(entry, tuple):
        return "(" + ", ".join(str(a) for a in entry) + ")"
    return str(entry)


def _fmt_entries(entries: Any) -> str:
    return "(" + ", ".join(_fmt_entry(e) for e in entries) + ")"


def _axes(entries: Any, ndim: int) -> tuple:
    """Per-dimension tuples of axis names, padded to `ndim` (for comparing specs)."""
    out = [() if e is None else (tuple(e) if isinstance(e, tuple) else (e,)) for e in entries]
    return tuple(out + [()] * (ndim - len(out)))


def _placed_spec(value: Any) -> tuple | None:
    """The spec of a concrete `jax.Array` placed with a `NamedSharding`, padded to its
    rank; None for abstract values, tracers and single-device arrays."""
    if not isinstance(value, jax.Array) or isinstance(value, jax.core.Tracer):
        return None
    sharding = value.sharding
    if not isinstance(sharding, NamedSharding):
        return None
    spec = tuple(sharding.spec)
    return spec + (None,) * (value.ndim - len(spec))


def _fmt_sharding(meta: dict, value: Any = None) -> str:
    """The sharding cell: the placed spec of a concrete mesh-placed array (``replicated``
    when no dimension is split), marked ``!= metadata (...)`` where it differs from a
    declared ``metadata['sharding']``; otherwise the metadata (``-`` when absent)."""
    declared = meta.get("sharding")
    placed = _placed_spec(value)
    if placed is None:
        return _fmt_entries(declared) if declared else "-"
    text = _fmt_entries(placed) if any(e is not None for e in placed) else "replicated"
    ndim = len(placed)
    if declared and _axes(declared, ndim) != _axes(placed, ndim):
        text += f" != metadata {_fmt_entries(declared)}"
    return text


def params_table(params: Params) -> str:
    """A text table of every parameter with totals (what ``repr(params)`` shows).

    Columns: path, shape, dtype, trainable, sharding, bytes. The sharding column shows
    the sharding an array actually has when it is a concrete ``jax.Array`` placed with a
    ``NamedSharding`` (its spec, e.g. ``(model, None)``, or ``replicated``), and marks it
    ``!= metadata (...)`` where it differs from the parameter's ``metadata['sharding']``;
    for abstract values, tracers and single-device arrays it shows the metadata (``-``
    when there is none).
    """
    s = params._struct
    rows = [("path", "shape", "dtype", "trainable", "sharding", "bytes")]
    total = trainable_total = nbytes = 0
    for path, value, (trainable, meta) in zip(s.keys, params._values, s.infos, strict=True):
        shape, dtype, size, b = _describe(value)
        total += size
        nbytes += b
        if trainable:
            trainable_total += size
        rows.append(
            (
                format_path(path),
                shape,
                dtype,
                "yes" if trainable else "no",
                _fmt_sharding(_thaw(meta), value),
                f"{b:,}",
            )
        )
    state = "locked" if s.locked else "unlocked"
    head = f"Params ({state}, {len(s.keys)} arrays)"
    if len(rows) == 1:
        return head
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = [head]
    for r in rows:
        cells = [
            c.ljust(w) if i < 5 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.append(
        f"total: {total:,} values ({trainable_total:,} trainable, "
        f"{total - trainable_total:,} other), {nbytes:,} bytes ({_fmt_bytes(nbytes)})"
    )
    return "\n".join(lines)


def graph_tree(graph: Graph) -> str:
    """A text tree of the modules below `graph` with their constructor arguments."""
    lines = [format_path(graph.path)]

    def rec(node: Graph, depth: int) -> None:
        for child in node._children.values():
            mod = child._module
            desc = repr(mod).split(" at '")[0] if mod is not None else ""
            lines.append("  " * depth + f"{child.name}: {desc}".rstrip(": "))
            rec(child, depth + 1)

    rec(graph, 1)
    return "\n".join(lines)


def _in_notebook() -> bool:
    shell = sys.modules.get("IPython")
    if shell is None:
        return False
    try:
        ip = shell.get_ipython()  # type: ignore[attr-defined]
    except Exception:
        return False
    return ip is not None and "IPKernelApp" in getattr(ip, "config", {})


def display(obj: Any, params: Params | None = None, *, treescope: bool | None = None) -> None:
    """Shows a model and/or its params: module tree, then the parameter table.

    Args:
      obj: a `Graph`, a tuple of graphs, a `Module`, or `Params`.
      params: params to list below the module tree.
      treescope: ``True`` renders with Treescope (the ``display`` extra:
        ``pip install 'blox[display]'``), ``False`` prints plain text; the default uses
        Treescope when running in a notebook with treescope installed.

    Raises:
      ImportError: ``treescope=True`` and treescope is not installed.
    """
    asked = treescope
    if treescope is None:
        treescope = _in_notebook()
    if treescope:
        try:
            import treescope as ts
        except ImportError as e:
            if asked:
                raise ImportError(
                    "display(..., treescope=True) needs treescope, which is not installed: "
                    "pip install 'blox[display]' (or pass treescope=False for plain text)."
                ) from e
            treescope = False
        else:
            ts.display(obj if params is None else (obj, params))
            return
    parts = []
    graphs = obj if isinstance(obj, tuple) else (obj,)
    for g in graphs:
        if isinstance(g, Graph):
            parts.append(graph_tree(g))
        elif isinstance(g, Module):
            parts.append(repr(g) + "\n" + graph_tree(g.graph))
        elif isinstance(g, Params):
            parts.append(params_table(g))
        else:
            raise TypeError(
                f"display expects a Graph, Module, Params or a tuple of them, got "
                f"{type(g).__name__}."
            )
    if params is not None:
        parts.append(params_table(params))
    print("\n\n".join(parts))


def params_treescope_repr(params: Params, path: str | None, subtree_renderer: Any) -> Any:
    from treescope import repr_lib

    s = params._struct
    fields = {format_path(k): v for k, v in zip(s.keys, params._values, strict=True)}
    return repr_lib.render_dictionary_wrapper(
        object_type=type(params),
        wrapped_dict=fields,
        path=path,
        subtree_renderer=subtree_renderer,
        roundtrippable=False,
    )


def module_treescope_repr(module: Module, path: str | None, subtree_renderer: Any) -> Any:
    from treescope import repr_lib

    return repr_lib.render_object_constructor(
        object_type=type(module),
        attributes={"path": format_path(module.graph.path), **module._init_args},
        path=path,
        subtree_renderer=subtree_renderer,
        roundtrippable=False,
    )
