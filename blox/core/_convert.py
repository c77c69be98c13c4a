"""Conversion between `Params` and plain nested dicts (Orbax, weight porting)."""

from __future__ import annotations

import difflib
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


def _flat_split(tree: Mapping, sep: str | None) -> bool:
    """Whether `tree` is the flat form ``{'a/b/c': array}``: no nested dicts, no `Param`
    leaves (those come from ``to_dict(with_info=True)``, which nests), and some key holds
    `sep`."""
    if not sep or not tree:
        return False
    if any(isinstance(v, (Mapping, Param)) for v in tree.values()):
        return False
    return any(isinstance(k, str) and sep in k for k in tree)


def _resolve(leaves: list, like: Params) -> list:
    """Maps each leaf's key path onto a path of `like`: exactly, or else by its printed
    form (``'net/fc/kernel'``), which is how a flat dict names it."""
    printed: dict[str, list[Path]] = {}
    for key in like.keys():
        printed.setdefault(format_path(key), []).append(key)
    out, source = [], {}
    for raw, leaf in leaves:
        path = raw
        if path not in like:
            hits = printed.get(format_path(path), [])
            if len(hits) > 1:
                raise ValueError(
                    f"from_dict: the key '{format_path(path)}' could be any of the paths "
                    f"{sorted(hits)} of `like` (their names contain '/'). Save with "
                    "bx.to_dict(params), which nests by path, to keep them apart."
                )
            if hits:
                path = hits[0]
        if path in source:
            raise ValueError(
                f"from_dict: '{format_path(path)}' is given twice, under the keys "
                f"{list(source[path])} and {list(raw)}. Keep one."
            )
        source[path] = raw
        out.append((path, leaf))
    return out


def from_dict(
    tree: Mapping[str, Any],
    *,
    like: Params | None = None,
    trainable: bool = True,
    sep: str | None = "/",
) -> Params:
    """Builds `Params` from a nested or flat dict (the inverse of `to_dict`).

    Two forms are read:

    - nested, as `to_dict` writes it: ``{'net': {'fc': {'kernel': array}}}``;
    - flat, keyed by the printed path: ``{'net/fc/kernel': array}``. This is what an
      Orbax restore *without a target* returns for saved `Params` (blox names each
      pytree leaf by its path joined with ``/``).

    With `like`, every key is matched to a path of `like`: exactly, or else by its
    printed form, so both forms (and names that contain ``/``) come back exactly.
    Without `like`, a flat dict of arrays (no nested dicts, no `Param` leaves) whose keys
    contain `sep` is split at `sep`; pass ``sep=None`` to keep such keys as single names
    (a path of one name that contains ``/`` cannot be told apart otherwise).

    Args:
      tree: nested or flat dicts of arrays or `Param` leaves.
      like: optional reference params (e.g. the model's params, or
        ``jax.eval_shape(init)``). When given, `tree` must hold exactly its paths with
        the same shapes; array leaves take trainable flags and metadata from `like`
        (so an `Rng` seed stays non-trainable), and the result has its lock flag.
      trainable: flag for array leaves when `like` is not given (`Param` leaves keep
        their own).
      sep: the separator of flat keys when `like` is not given.

    Returns:
      The params, unlocked unless `like` is locked.

    Raises:
      ValueError: with `like`, missing or unexpected paths (each listed once, on one
        side, with a close match where there is one) or a shape mismatch (path and
        both shapes); a path given twice.
      TypeError: `tree` is not a dict, or a key is not a string.

    >>> import jax.numpy as jnp
    >>> ref = Params()
    >>> ref[('net', 'fc', 'kernel')] = Param(jnp.zeros((2, 3)))
    >>> ref[('net', 'rng', 'counter')] = Param(jnp.zeros((), jnp.uint32), trainable=False)
    >>> flat = {'net/fc/kernel': jnp.ones((2, 3)), 'net/rng/counter': jnp.ones((), jnp.uint32)}
    >>> p = from_dict(flat, like=ref)
    >>> list(p.keys()), p[('net', 'rng', 'counter')].trainable
    ([('net', 'fc', 'kernel'), ('net', 'rng', 'counter')], False)
    """
    if not isinstance(tree, Mapping):
        raise TypeError(f"from_dict expects a nested dict, got {type(tree).__name__}.")
    leaves = list(_walk(tree, ()))
    if like is not None:
        if not isinstance(like, Params):
            raise TypeError(
                f"from_dict: like must be Params (e.g. the model's params or "
                f"jax.eval_shape(init)), got {type(like).__name__}."
            )
        leaves = _resolve(leaves, like)
    elif _flat_split(tree, sep):
        leaves = [(tuple(path[0].split(sep)), leaf) for path, leaf in leaves]
    items = []
    for path, leaf in leaves:
        where = f"'{format_path(path)}'"
        if isinstance(leaf, Param):
            items.append((path, leaf.value, _make_info(leaf.trainable, leaf.metadata, where)))
        elif like is not None and path in like:
            items.append((path, leaf, like._info(path)))
        else:
            items.append((path, leaf, _make_info(trainable, None, where)))
    locked = False
    if like is not None:
        _check_like(items, like)
        locked = like.is_locked
    return Params._from_items(items, locked)


def _check_like(items: list, like: Params) -> None:
    have = {it[0] for it in items}
    want = set(like.keys())
    missing = sorted(want - have)
    extra = sorted(have - want)
    if missing or extra:
        names = [format_path(p) for p in missing]
        unexpected = []
        for p in extra:
            close = difflib.get_close_matches(format_path(p), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            unexpected.append(f"'{format_path(p)}'{hint}")
        raise ValueError(
            f"from_dict: the tree does not match `like` ({len(want)} paths). "
            + (f"Missing: {names}. " if missing else "")
            + (f"Unexpected: [{', '.join(unexpected)}]. " if extra else "")
            + "Rename the tree's keys to the model's paths; list(like.keys()) lists them."
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
