"""What a checkpoint holds, described as plain JSON, and the comparison made on restore.

The description is written next to the arrays (item ``blox`` of each step directory): the
blox, JAX and Orbax versions, the mesh the arrays were sharded over, and one entry per leaf
of the saved state: its path, shape, dtype and ``PartitionSpec``; leaves that belong to a
`Params` also carry the parameter path, the trainable flag and the metadata. `restore`
builds the same description of the structure it is asked to fill and compares the two
before reading a single array, so a mismatch is explained, never half-restored.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from importlib import metadata as _metadata
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from blox.core._params import Params, format_path

__all__ = ["RestoreMismatchError", "compare", "describe"]

FORMAT = "blox.ckpt/2"  # 2: every leaf checksummed, inside the commit


@functools.cache
def _version(dist: str) -> str:
    try:
        return _metadata.version(dist)
    except _metadata.PackageNotFoundError:  # pragma: no cover - source tree without install
        return "unknown"


def _json_safe(value: Any) -> Any:
    """Metadata as JSON: tuples become lists, anything exotic becomes its repr."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return repr(value)


def _spec_json(spec: PartitionSpec) -> list:
    out = []
    for entry in spec:
        if entry is None or isinstance(entry, str):
            out.append(entry)
        else:
            out.append(list(entry))
    return out


def _leaf_info(value: Any, where: str) -> dict[str, Any]:
    """Shape, dtype, kind and spec of one leaf (concrete, abstract or a Python number)."""
    if isinstance(value, bool) or isinstance(value, (int, float)):
        kind = "bool" if isinstance(value, bool) else type(value).__name__
        return {"kind": kind, "shape": [], "dtype": kind, "spec": None}
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        raise TypeError(
            f"Checkpoint state leaf '{where}' is a {type(value).__name__}; a checkpoint holds "
            "arrays (jax, NumPy), abstract arrays (jax.ShapeDtypeStruct) and Python numbers. "
            "Keep other objects (config, strings) out of the state, or store them as arrays."
        )
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        raise TypeError(
            f"Checkpoint state leaf '{where}' is a typed PRNG key ({dtype}). Save its raw data "
            "instead: jax.random.key_data(key) (and jax.random.wrap_key_data on restore); "
            "bx.Rng already stores its seed that way."
        )
    if isinstance(value, np.ndarray | np.generic):
        kind = "numpy"
    else:
        kind = "array"
    sharding = getattr(value, "sharding", None)
    spec = _spec_json(sharding.spec) if isinstance(sharding, NamedSharding) else None
    return {
        "kind": kind,
        "shape": [int(d) for d in shape],
        "dtype": np.dtype(dtype).name,
        "spec": spec,
    }


def _mesh_of(tree: Any) -> dict[str, Any] | None:
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding):
            mesh = sharding.mesh
            return {
                "axis_names": [str(a) for a in mesh.axis_names],
                "axis_sizes": [int(s) for s in mesh.axis_sizes],
            }
    return None


def _leaves(state: Any) -> dict[str, dict[str, Any]]:
    """One entry per leaf, keyed by its path in `state` (names joined with ``/``)."""
    out: dict[str, dict[str, Any]] = {}
    nodes, _ = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, Params))
    for key_path, node in nodes:
        prefix = jax.tree_util.keystr(key_path, simple=True, separator="/")
        if isinstance(node, Params):
            for path, param in node.items():
                name = f"{prefix}/{format_path(path)}" if prefix else format_path(path)
                info = _leaf_info(param.value, name)
                info["param"] = {
                    "path": format_path(path),
                    "trainable": bool(param.trainable),
                    "metadata": _json_safe(param.metadata),
                }
                out[name] = info
        else:
            out[prefix or "<root>"] = _leaf_info(node, prefix or "<root>")
    return out


def describe(state: Any) -> dict[str, Any]:
    """A JSON-able description of a train state: versions, mesh and one entry per leaf.

    This is what a checkpoint stores next to its arrays, and what `restore` compares with
    the structure it is asked to fill. It works on concrete states and on abstract ones
    (``jax.eval_shape``), and reads no array values.

    Args:
      state: any pytree of arrays, ``jax.ShapeDtypeStruct`` and Python numbers, possibly
        holding `Params` (e.g. ``{'params': params, 'opt_state': opt_state, 'step': 3}``).

    Returns:
      ``{'format', 'versions': {'blox', 'jax', 'orbax'}, 'process_count', 'mesh':
      {'axis_names', 'axis_sizes'} | None, 'leaves': {name: entry}}`` where each entry has
      ``kind`` (``'array'``, ``'numpy'``, ``'int'``, ``'float'``, ``'bool'``), ``shape``,
      ``dtype``, ``spec`` (the ``PartitionSpec`` of a ``NamedSharding``, else ``None``) and,
      for a `Params` leaf, ``param``: ``{'path', 'trainable', 'metadata'}``. Leaf names are
      the key path joined with ``/``: ``'params/net/fc/kernel'``, ``'opt_state/0/mu/...'``.

    Raises:
      TypeError: a leaf that is not an array or a number, or a typed PRNG key.

    >>> import blox as bx, jax.numpy as jnp
    >>> p = bx.Params(); p[('fc', 'w')] = bx.Param(jnp.zeros((2, 3)))
    >>> d = describe({'params': p, 'step': 3})
    >>> d['leaves']['params/fc/w']['shape'], d['leaves']['params/fc/w']['param']['trainable']
    ([2, 3], True)
    >>> d['leaves']['step']['kind']
    'int'
    """
    return {
        "format": FORMAT,
        "versions": {
            "blox": _version("blox"),
            "jax": jax.__version__,
            "orbax": _version("orbax-checkpoint"),
        },
        "process_count": jax.process_count(),
        "mesh": _mesh_of(state),
        "leaves": _leaves(state),
    }


def _fmt(entry: Mapping[str, Any]) -> str:
    if entry["kind"] in ("int", "float", "bool"):
        return f"Python {entry['kind']}"
    return f"{entry['dtype']}{list(entry['shape'])}"


def _compatible_scalars(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """A Python number and a 0-d array of the same family restore into each other."""
    py = {"int": "i", "float": "f", "bool": "b"}
    if a["kind"] not in py and b["kind"] not in py:
        return False
    if a["shape"] or b["shape"]:
        return False

    def family(e):
        if e["kind"] in py:
            return py[e["kind"]]
        k = np.dtype(e["dtype"]).kind
        return "i" if k == "u" else k

    return family(a) == family(b)


class RestoreMismatchError(ValueError):
    """Raised by `restore` when the checkpoint and the target structure differ.

    Restore never fills a part of the target: it compares first, and raises this error
    (a ``ValueError``) listing every difference at once, with shapes.

    Attributes:
      missing: leaves the target has and the checkpoint lacks, ``[(name, 'float32[3, 4]')]``.
      unexpected: leaves the checkpoint has and the target lacks.
      mismatched: ``[(name, saved, target)]`` for leaves whose shape or dtype differ.
      trainable: ``[(name, saved_flag, target_flag)]`` for parameters whose trainable flag
        differs.
      where: the checkpoint directory and step, for the message.
    """

    def __init__(
        self,
        missing: list[tuple[str, str]],
        unexpected: list[tuple[str, str]],
        mismatched: list[tuple[str, str, str]],
        trainable: list[tuple[str, bool, bool]],
        where: str = "",
    ):
        self.missing, self.unexpected = missing, unexpected
        self.mismatched, self.trainable, self.where = mismatched, trainable, where
        super().__init__(self.message())

    def __str__(self) -> str:
        return self.message()

    def message(self) -> str:
        """The full explanation (also ``str(error)``)."""
        lines = [f"The checkpoint {self.where} does not match the structure to restore into:"]
        if self.missing:
            lines.append(f"  missing from the checkpoint ({len(self.missing)}):")
            lines += [f"    {n}: {s}" for n, s in self.missing]
        if self.unexpected:
            lines.append(
                f"  unexpected (in the checkpoint, not in the target) ({len(self.unexpected)}):"
            )
            lines += [f"    {n}: {s}" for n, s in self.unexpected]
        if self.mismatched:
            lines.append(f"  shape/dtype mismatch ({len(self.mismatched)}):")
            lines += [f"    {n}: saved {a}, target {b}" for n, a, b in self.mismatched]
        if self.trainable:
            lines.append(f"  trainable flag differs ({len(self.trainable)}):")
            lines += [f"    {n}: saved {a}, target {b}" for n, a, b in self.trainable]
        lines.append(
            "Nothing was restored. Build the target from the same model and optimizer as the "
            "saved run (paths are Graph paths; see describe()/CheckpointManager.description), "
            "or convert the weights with export_params/import_params. Pass "
            "allow_dtype_cast=True to restore into other dtypes on purpose."
        )
        if self.unexpected and not (self.missing or self.mismatched or self.trainable):
            lines.append(
                "To restore only what the target holds (e.g. {'params': params} to "
                "fine-tune), pass partial=True."
            )
        return "\n".join(lines)


def compare(
    saved: Mapping[str, Any],
    target: Mapping[str, Any],
    *,
    allow_dtype_cast: bool = False,
    where: str = "",
) -> RestoreMismatchError | None:
    """Compares two descriptions (`describe`); returns the error to raise, or ``None``.

    Args:
      saved: the description stored with the checkpoint.
      target: the description of the structure to restore into.
      allow_dtype_cast: a dtype difference is not a mismatch (Orbax casts on restore).
      where: text naming the checkpoint, used in the message.

    Returns:
      ``None`` when every leaf has the same name, shape and dtype (and the same trainable
      flag for parameters); otherwise a `RestoreMismatchError` listing all differences.
      Shardings are not compared: restoring onto another mesh is allowed.
    """
    s_leaves, t_leaves = saved["leaves"], target["leaves"]
    missing = [(n, _fmt(t_leaves[n])) for n in t_leaves if n not in s_leaves]
    unexpected = [(n, _fmt(s_leaves[n])) for n in s_leaves if n not in t_leaves]
    mismatched, trainable = [], []
    for name, t in t_leaves.items():
        s = s_leaves.get(name)
        if s is None:
            continue
        same_shape = list(s["shape"]) == list(t["shape"])
        same_dtype = s["dtype"] == t["dtype"] or allow_dtype_cast
        if not (same_shape and same_dtype) and not _compatible_scalars(s, t):
            mismatched.append((name, _fmt(s), _fmt(t)))
        sp, tp = s.get("param"), t.get("param")
        if sp is not None and tp is not None and sp["trainable"] != tp["trainable"]:
            trainable.append((name, sp["trainable"], tp["trainable"]))
    if missing or unexpected or mismatched or trainable:
        return RestoreMismatchError(
            sorted(missing), sorted(unexpected), mismatched, trainable, where
        )
    return None


def to_json(description: Mapping[str, Any]) -> str:
    """The description as indented JSON text."""
    return json.dumps(description, indent=1, sort_keys=True)


def _is_empty_node(x: Any) -> bool:
    return x is None or (isinstance(x, (tuple, list, dict)) and len(x) == 0)


def empty_nodes(tree: Any) -> set[str]:
    """The names of the empty nodes of a tree (``None``, ``optax.EmptyState()``, ``()``,
    ``{}``): structure that holds no leaf, which names alone do not show."""
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_empty_node)[0]
    return {
        jax.tree_util.keystr(kp, simple=True, separator="/") or "<root>"
        for kp, x in flat
        if _is_empty_node(x)
    }


def describe_saved_tree(tree: Any) -> dict[str, Any]:
    """A description (`describe`'s ``leaves``) of a checkpoint written without one (plain
    Orbax), from Orbax's metadata tree (``ArrayMetadata`` / ``ScalarMetadata`` leaves):
    names, shapes and dtypes; no spec, no parameter flags, no checksums."""
    leaves: dict[str, dict[str, Any]] = {}
    for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(kp, simple=True, separator="/") or "<root>"
        shape, dtype = getattr(leaf, "shape", None), getattr(leaf, "dtype", None)
        if shape is None or dtype is None:
            leaves[name] = {"kind": type(leaf).__name__, "shape": [], "dtype": "unknown"}
            continue
        if type(leaf).__name__ == "ScalarMetadata":  # a Python number
            kind = {"i": "int", "u": "int", "f": "float", "b": "bool"}.get(np.dtype(dtype).kind)
            if kind is not None:
                leaves[name] = {"kind": kind, "shape": [], "dtype": kind, "spec": None}
                continue
        kind = "array"
        leaves[name] = {
            "kind": kind,
            "shape": [int(d) for d in shape],
            "dtype": np.dtype(dtype).name,
            "spec": None,
        }
    return {"format": "orbax", "mesh": None, "leaves": leaves}
