"""Conversion between `Params` and plain nested dicts (Orbax, weight porting)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from blox.core._params import Param, Params, Path, _make_info, _thaw, format_path

__all__ = ["to_dict", "from_dict"]


def to_dict(params: Params, *, with_info: bool = False) -> dict[str, Any]:
    """Converts params to a nested dict ``{'net': {'linear': {'kernel': array}}}``.

    Args:
      params: the params.
      with_info: if ``True`` the leaves are `Param` objects (value, trainable flag,
        metadata), so `from_dict` rebuilds the params exactly; otherwise plain arrays
        (what Orbax or a weight-porting script wants).

    Raises:
      ValueError: a path is a prefix of another (``('a',)`` and ``('a', 'b')``), which a
        nested dict cannot hold.

    >>> import jax.numpy as jnp
    >>> p = Params()
    >>> p[('net', 'w')] = Param(jnp.zeros(2))
    >>> to_dict(p)
    {'net': {'w': Array([0., 0.], dtype=float32)}}
    """
    if not isinstance(params, Params):
        raise TypeError(f"to_dict expects Params, got {type(params).__name__}.")
    out: dict[str, Any] = {}
    s = params._struct
    for path, value, (trainable, meta) in zip(s.keys, params._values, s.infos, strict=True):
        node = out
        for i, name in enumerate(path[:-1]):
            nxt = node.setdefault(name, {})
            if not isinstance(nxt, dict):
                raise ValueError(
                    f"Cannot nest '{format_path(path)}': '{format_path(path[: i + 1])}' is "
                    "both a parameter and a prefix of another path."
                )
            node = nxt
        if path[-1] in node:
            raise ValueError(
                f"Cannot nest '{format_path(path)}': it is both a parameter and a prefix of "
                "another path."
            )
        node[path[-1]] = Param(value, trainable, _thaw(meta)) if with_info else value
    return out


def _walk(tree: Mapping, prefix: Path):
    for name, sub in tree.items():
        if not isinstance(name, str):
            raise TypeError(
                f"from_dict: keys must be strings, got {name!r} under "
                f"'{format_path(prefix) or '<root>'}'."
            )
        path = prefix + (name,)
        if isinstance(sub, Mapping):
            if not sub:
                raise ValueError(f"from_dict: empty dict at '{format_path(path)}'.")
            yield from _walk(sub, path)
        else:
            yield path, sub


def from_dict(
    tree: Mapping[str, Any],
    *,
    like: Params | None = None,
    trainable: bool = True,
) -> Params:
    """Builds `Params` from a nested dict (the inverse of `to_dict`).

    Args:
      tree: nested dicts of arrays or `Param` leaves.
      like: optional reference params (e.g. from ``jax.eval_shape(init)``). When
        given, `tree` must hold exactly its paths with the same shapes; array leaves
        take trainable flags and metadata from `like`, and the result has its lock flag.
      trainable: flag for array leaves when `like` is not given (`Param` leaves keep
        their own).

    Raises:
      ValueError: with `like`, missing or extra paths (all listed) or a shape mismatch.
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"from_dict expects a nested dict, got {type(tree).__name__}.")
    items = []
    for path, leaf in _walk(tree, ()):
        where = f"'{format_path(path)}'"
        if isinstance(leaf, Param):
            items.append((path, leaf.value, _make_info(leaf.trainable, leaf.metadata, where)))
        elif like is not None and path in like:
            items.append((path, leaf, like._info(path)))
        else:
            items.append((path, leaf, _make_info(trainable, None, where)))
    locked = False
    if like is not None:
        have = {it[0] for it in items}
        want = set(like.keys())
        missing = sorted(want - have)
        extra = sorted(have - want)
        if missing or extra:
            raise ValueError(
                "from_dict: the tree does not match `like`. "
                + (f"Missing: {[format_path(p) for p in missing]}. " if missing else "")
                + (f"Unexpected: {[format_path(p) for p in extra]}. " if extra else "")
                + "Rename the checkpoint's keys to the model's paths (see to_dict(like))."
            )
        for path, value, _ in items:
            ref = like._get_value(path)
            rs, vs = getattr(ref, "shape", None), getattr(value, "shape", None)
            if rs is not None and vs is not None and tuple(rs) != tuple(vs):
                raise ValueError(
                    f"from_dict: '{format_path(path)}' has shape {tuple(vs)}, the model "
                    f"expects {tuple(rs)}. (Porting from PyTorch? Linear weights are "
                    "(out, in) there and (in, out) here: transpose them.)"
                )
        locked = like.is_locked
    return Params._from_items(items, locked)
