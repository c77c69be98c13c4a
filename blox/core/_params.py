"""`Param` and `Params`: the explicit state container of blox.

Design note (speed): a param-threading library pays for its container at every
`jax.jit` call, because JAX flattens the arguments and unflattens the results in
Python. blox therefore stores a `Params` as ONE pytree node: its children are a tuple
of arrays and its auxiliary data is a single immutable `_Structure` object (the sorted
paths, the per-leaf `(trainable, metadata)` info and the lock flag) whose hash is
computed once. `Param` objects exist in the API (``params[path]``) but are built on
demand, never stored per leaf. Flattening returns two attributes; unflattening sets
two slots. All checks (locking, errors) stay off that path.
"""

from __future__ import annotations

import bisect
import difflib
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import Any

import jax

from blox.core._errors import BloxKeyError

Path = tuple[str, ...]

#: The metadata key that marks a leaf as one device's FSDP shard inside an FSDP step
#: (``blox.parallel.fsdp_value_and_grad``); such a leaf is read only through
#: ``blox.parallel.fsdp_call``, which gathers it.
FSDP_MARK = "fsdp"

__all__ = ["Param", "Params", "Path", "format_path"]


def format_path(path: Path) -> str:
    """Returns the path as the Graph prints it: names joined by ``/``."""
    return "/".join(str(p) for p in path)


# ---------------------------------------------------------------------------
# Metadata is stored frozen (hashable) so that it can live in pytree aux data.
# ---------------------------------------------------------------------------


class _FrozenDict(tuple):
    """A dict frozen as a sorted tuple of (key, value) pairs; marks dicts for thawing.

    Equal only to another `_FrozenDict`, so ``{'a': 1}`` and ``(('a', 1),)`` differ.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return type(other) is _FrozenDict and tuple.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((_FrozenDict, tuple.__hash__(self)))


class _Typed:
    """A frozen metadata scalar that compares equal only to the same type and value.

    Python has ``True == 1 == 1.0``; metadata is static pytree data, so treating those
    as equal would let ``jax.jit`` reuse a trace made for other metadata.
    """

    __slots__ = ("value",)

    def __init__(self, value: Hashable):
        self.value = value

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is _Typed
            and type(other.value) is type(self.value)
            and other.value == self.value
        )

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    def __hash__(self) -> int:
        return hash((type(self.value), self.value))

    def __repr__(self) -> str:
        return repr(self.value)


def _freeze(value: Any, where: str) -> Hashable:
    if isinstance(value, Mapping):
        items = []
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError(
                    f"Metadata keys must be strings; got {k!r} ({type(k).__name__}) at {where}. "
                    "Use string keys, e.g. metadata={'sharding': (None, 'model')}."
                )
            items.append((k, _freeze(v, f"{where}[{k!r}]")))
        items.sort(key=lambda kv: kv[0])
        return _FrozenDict(items)
    if isinstance(value, (list, tuple)) and not isinstance(value, _FrozenDict):
        return tuple(_freeze(v, where) for v in value)
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"Metadata values must be hashable (they are static pytree data); got "
            f"{type(value).__name__} at {where}. Store plain data (str, int, float, bool, None, "
            "tuples, dicts of those), not arrays."
        ) from None
    if value is None or type(value) is str:
        return value
    return _Typed(value)


def _thaw(value: Any) -> Any:
    if isinstance(value, _FrozenDict):
        return {k: _thaw(v) for k, v in value}
    if isinstance(value, tuple):
        return tuple(_thaw(v) for v in value)
    if type(value) is _Typed:
        return value.value
    return value


_EMPTY_META = _FrozenDict(())
_DEFAULT_INFOS: dict[bool, tuple[bool, _FrozenDict]] = {
    True: (True, _EMPTY_META),
    False: (False, _EMPTY_META),
}


def _make_info(trainable: bool, metadata: Mapping[str, Any] | None, where: str) -> tuple:
    if not metadata:
        return _DEFAULT_INFOS[trainable]
    return (trainable, _freeze(metadata, where))


_FSDP_READ = (
    "Parameter '{path}' is this device's FSDP shard {shape} of a weight sharded over "
    "{axis!r} along dimension {dim}, and it was read outside bp.fsdp_call: the layer would "
    "compute on its local piece of the weight (wrong numbers, or a shape error that does "
    "not say why). In the FSDP loss function, call the layer through fsdp_call, which "
    "gathers its weights:\n"
    "    y, params = bp.fsdp_call(layer, params, x)\n"
    "A weight used by two layers (tied embeddings) needs under= covering its path, e.g. "
    "bp.fsdp_call(fn, params, x, under={prefix!r})."
)


def fsdp_read_error(path: Path, info: tuple, value: Any) -> ValueError | None:
    """The error for reading a leaf marked as an FSDP shard (`FSDP_MARK`) outside
    ``fsdp_call``, or None for any other leaf. Cheap: a look at its metadata."""
    meta = info[1]
    if not meta:
        return None
    for k, v in meta:
        if k == FSDP_MARK:
            axis, dim, *_ = _thaw(v)
            shape = tuple(getattr(value, "shape", ()))
            return ValueError(
                _FSDP_READ.format(
                    path=format_path(path),
                    shape=shape,
                    axis=axis,
                    dim=dim,
                    prefix=format_path(path[:-1]),
                )
            )
    return None


# ---------------------------------------------------------------------------
# Param
# ---------------------------------------------------------------------------


class Param:
    """One parameter: a value plus its `trainable` flag and free-form metadata.

    Args:
      value: the array (or any pytree leaf, e.g. a `jax.ShapeDtypeStruct`).
      trainable: whether gradients are taken for it (`Params.split` default).
      metadata: a dict of plain data. ``metadata['sharding']`` is a tuple with one
        entry per dimension: a mesh-axis name, a tuple of names, or ``None``.

    ``Param`` is what ``params[path]`` returns; `Params` does not store ``Param``
    objects (see the module note), so mutating a returned ``Param`` changes nothing.

    >>> import jax.numpy as jnp
    >>> p = Param(jnp.zeros((2, 3)), metadata={'sharding': (None, 'model')})
    >>> p.sharding
    (None, 'model')
    """

    __slots__ = ("value", "trainable", "metadata")

    def __init__(self, value: Any, trainable: bool = True, metadata: dict | None = None):
        if not isinstance(trainable, bool):
            raise TypeError(
                f"trainable must be a bool, got {type(trainable).__name__}. "
                "Pass trainable=True or trainable=False."
            )
        if metadata is None:
            metadata = {}
        elif not isinstance(metadata, dict):
            raise TypeError(
                f"metadata must be a dict or None, got {type(metadata).__name__}. "
                "Pass e.g. metadata={'sharding': (None, 'model')}."
            )
        self.value = value
        self.trainable = trainable
        self.metadata = metadata

    @property
    def sharding(self) -> tuple:
        """``metadata['sharding']``, or ``()`` (replicated) when absent."""
        return tuple(self.metadata.get("sharding", ()) or ())

    def replace(self, **updates: Any) -> Param:
        """Returns a new `Param` with the given fields (value, trainable, metadata) replaced."""
        unknown = set(updates) - {"value", "trainable", "metadata"}
        if unknown:
            raise TypeError(
                f"Param.replace got unknown field(s) {sorted(unknown)}; "
                "the fields are value, trainable, metadata."
            )
        fields = {"value": self.value, "trainable": self.trainable, "metadata": self.metadata}
        fields.update(updates)
        return Param(**fields)

    def __repr__(self) -> str:
        v = self.value
        desc = (
            f"{v.dtype}{list(v.shape)}"
            if hasattr(v, "shape") and hasattr(v, "dtype")
            else type(v).__name__
        )
        meta = f", metadata={self.metadata}" if self.metadata else ""
        return f"Param({desc}, trainable={self.trainable}{meta})"


def _param_flatten(p: Param):
    return (p.value,), (p.trainable, _freeze(p.metadata, "Param.metadata"))


def _param_unflatten(aux, children):
    p = object.__new__(Param)
    p.value = children[0]
    p.trainable = aux[0]
    p.metadata = _thaw(aux[1])
    return p


jax.tree_util.register_pytree_node(Param, _param_flatten, _param_unflatten)


# ---------------------------------------------------------------------------
# Structure: the static half of a Params (pytree aux data)
# ---------------------------------------------------------------------------


class _Structure:
    """Paths (sorted), per-leaf info and lock flag. Immutable; hash computed once.

    Equal structures that are distinct objects are unified on the first successful
    comparison (they then share their tuples), so later comparisons in JAX's jit cache
    are identity checks.
    """

    __slots__ = ("keys", "infos", "locked", "_hash", "_index")

    def __init__(self, keys: tuple[Path, ...], infos: tuple, locked: bool):
        self.keys = keys
        self.infos = infos
        self.locked = locked
        self._hash: int | None = None
        self._index: dict[Path, int] | None = None

    @property
    def index(self) -> dict[Path, int]:
        idx = self._index
        if idx is None:
            idx = self._index = {k: i for i, k in enumerate(self.keys)}
        return idx

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = self._hash = hash((self.keys, self.infos, self.locked))
        return h

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not _Structure:
            return NotImplemented
        if self.locked != other.locked:
            return False
        if self.keys is not other.keys:
            if hash(self) != hash(other) or self.keys != other.keys:
                return False
            other.keys = self.keys
        if self.infos is not other.infos:
            if self.infos != other.infos:
                return False
            other.infos = self.infos
        return True

    def with_locked(self, locked: bool) -> _Structure:
        if locked == self.locked:
            return self
        s = _Structure(self.keys, self.infos, locked)
        s._index = self._index
        return s

    def __repr__(self) -> str:
        return f"Structure({len(self.keys)} paths, locked={self.locked})"


_EMPTY = {False: _Structure((), (), False), True: _Structure((), (), True)}


def _check_path(path: Any) -> Path:
    if type(path) is tuple:
        return path
    if isinstance(path, tuple):
        return tuple(path)
    if isinstance(path, str):
        raise BloxKeyError(
            f"Params are keyed by path tuples, got the string {path!r}. "
            f"Use a tuple such as {tuple(path.split('/'))!r}."
        )
    raise BloxKeyError(
        f"Params are keyed by path tuples, got {type(path).__name__} {path!r}. "
        "Use a tuple of names such as ('mlp', 'linear_0', 'kernel')."
    )


def _missing_path_error(path: Path, keys: tuple[Path, ...]) -> BloxKeyError:
    names = {format_path(k): k for k in keys}
    close = difflib.get_close_matches(format_path(path), list(names), n=3)
    hint = f" Did you mean {', '.join(repr(names[c]) for c in close)}?" if close else ""
    return BloxKeyError(
        f"Path '{format_path(path)}' not found in Params ({len(keys)} paths).{hint}"
    )


_LOCKED_SET_MSG = (
    "Cannot set '{path}': these Params are locked. Item assignment is meant for loading "
    "weights into unlocked params:\n"
    "    params = params.unlocked()\n"
    "    params[path] = Param(value)\n"
    "    params = params.locked()\n"
    "or use module.set_param(params, name, value), which returns new params."
)


class Params:
    """A flat, immutable container of all model state, keyed by path tuples.

    ``Params`` is a JAX pytree whose leaves are the arrays; ``jax.tree.map`` over it
    keeps the paths, the trainable flags, the metadata and the lock flag, and
    ``jax.tree_util.tree_flatten_with_path`` names each leaf by its path (a
    ``DictKey`` holding the path joined with ``/``). Paths are kept sorted, so two
    ``Params`` with the same paths always have the same tree structure.

    Every change returns a new ``Params``, except item assignment
    (``params[path] = Param(...)``) on *unlocked* params, which is kept for loading
    weights and mutates in place.

    >>> import jax.numpy as jnp
    >>> params = Params()
    >>> params[('net', 'w')] = Param(jnp.ones((2,)))
    >>> params[('net', 'step')] = Param(jnp.zeros((), jnp.int32), trainable=False)
    >>> trainable, rest = params.split()
    >>> list(trainable.keys()), list(rest.keys())
    ([('net', 'w')], [('net', 'step')])
    >>> len(trainable.merge(rest))
    2
    """

    __slots__ = ("_struct", "_values")

    def __init__(self) -> None:
        self._struct: _Structure = _EMPTY[False]
        self._values: tuple = ()

    # -- construction helpers (internal) ------------------------------------

    @classmethod
    def _make(cls, struct: _Structure, values: tuple) -> Params:
        p = object.__new__(cls)
        p._struct = struct
        p._values = values
        return p

    @classmethod
    def _from_items(cls, items: list[tuple[Path, Any, tuple]], locked: bool) -> Params:
        """Builds Params from (path, value, info) triples; paths must be unique."""
        items = sorted(items, key=lambda it: it[0])
        keys = tuple(it[0] for it in items)
        return cls._make(
            _Structure(keys, tuple(it[2] for it in items), locked),
            tuple(it[1] for it in items),
        )

    def _set(self, path: Path, value: Any, info: tuple | None = None) -> Params:
        """Returns new Params with `path` set (created if missing). No lock check."""
        s = self._struct
        i = s.index.get(path)
        if i is not None:
            values = self._values[:i] + (value,) + self._values[i + 1 :]
            if info is None or info == s.infos[i]:
                return Params._make(s, values)
            infos = s.infos[:i] + (info,) + s.infos[i + 1 :]
            return Params._make(_Structure(s.keys, infos, s.locked), values)
        if info is None:
            info = _DEFAULT_INFOS[True]
        j = bisect.bisect(s.keys, path)
        keys = s.keys[:j] + (path,) + s.keys[j:]
        infos = s.infos[:j] + (info,) + s.infos[j:]
        values = self._values[:j] + (value,) + self._values[j:]
        return Params._make(_Structure(keys, infos, s.locked), values)

    def _get_value(self, path: Path, default: Any = None) -> Any:
        i = self._struct.index.get(path)
        return default if i is None else self._values[i]

    def _info(self, path: Path) -> tuple:
        return self._struct.infos[self._struct.index[path]]

    # -- read access -----------------------------------------------------------

    def __getitem__(self, path: Path) -> Param:
        path = _check_path(path)
        s = self._struct
        i = s.index.get(path)
        if i is None:
            raise _missing_path_error(path, s.keys)
        trainable, meta = s.infos[i]
        return Param(self._values[i], trainable, _thaw(meta))

    def get(self, path: Path, default: Any = None) -> Param | Any:
        """``params[path]`` if present, else `default`."""
        path = _check_path(path)
        if path in self._struct.index:
            return self[path]
        return default

    def value(self, path: Path, default: Any = None) -> Any:
        """The stored array at `path` (``params[path].value``), or `default` if absent.

        Reads only: nothing is created, and locked params work the same. No `Param` is
        built, so layers use it to look at a parameter before `Module.get_param` (e.g. to
        check a stored shape or take the compute dtype). Under ``jax.jit`` it returns
        the traced array.

        >>> import jax.numpy as jnp
        >>> params = Params()
        >>> params[('net', 'w')] = Param(jnp.ones((2, 3)))
        >>> params.locked().value(('net', 'w')).shape
        (2, 3)
        >>> params.value(('net', 'b')) is None, params.value(('net', 'b'), 0.0)
        (True, 0.0)

        Raises:
          ValueError: the leaf is one device's FSDP shard inside an FSDP step (read it
            through ``blox.parallel.fsdp_call``, which gathers it); the message names it.
        """
        path = _check_path(path)
        i = self._struct.index.get(path)
        if i is None:
            return default
        err = fsdp_read_error(path, self._struct.infos[i], self._values[i])
        if err is not None:
            raise err
        return self._values[i]

    def __contains__(self, path: object) -> bool:
        return isinstance(path, tuple) and path in self._struct.index

    def __len__(self) -> int:
        return len(self._values)

    def __iter__(self) -> Iterator[Path]:
        return iter(self._struct.keys)

    def keys(self):
        """The paths, sorted."""
        return self._struct.keys

    def values(self) -> list[Param]:
        """A `Param` per path, in `keys()` order."""
        return [self[k] for k in self._struct.keys]

    def items(self) -> list[tuple[Path, Param]]:
        """``(path, Param)`` pairs in `keys()` order."""
        return [(k, self[k]) for k in self._struct.keys]

    def arrays(self) -> dict[Path, Any]:
        """A plain ``{path: value}`` dict (no `Param` wrappers)."""
        return dict(zip(self._struct.keys, self._values, strict=True))

    # -- leaves, metadata and rebuilding (for code built on Params) ---------------

    def leaves(self) -> tuple:
        """The stored values, one per path in `keys()` order.

        The same list as ``jax.tree.leaves(params)`` for array values (a ``None`` value
        is kept here, where JAX drops it). Pair it with `with_leaves` to transform all
        values at once, e.g. across several trees of the same paths:

        >>> import jax.numpy as jnp
        >>> params = Params()
        >>> params[('net', 'b')] = Param(jnp.zeros((2,)))
        >>> params[('net', 'w')] = Param(jnp.ones((2, 3)), metadata={'sharding': (None, 'model')})
        >>> [v.shape for v in params.leaves()]
        [(2,), (2, 3)]
        """
        return self._values

    def with_leaves(self, leaves: Iterable[Any]) -> Params:
        """These params with new values: the same paths, trainable flags, metadata and
        lock flag, holding `leaves` (one per path, in `keys()` order).

        The inverse of `leaves`, and ``jax.tree.unflatten(jax.tree.structure(params),
        leaves)`` without the flatten. Values are not checked (any pytree leaf, even
        ``None``, may be stored); use it to rebuild params from per-leaf results.

        >>> import jax.numpy as jnp
        >>> params = Params()
        >>> params[('net', 'w')] = Param(jnp.ones((2,)), metadata={'sharding': ('model',)})
        >>> doubled = params.with_leaves([2 * v for v in params.leaves()])
        >>> doubled[('net', 'w')]
        Param(float32[2], trainable=True, metadata={'sharding': ('model',)})

        Raises:
          ValueError: the number of leaves differs from the number of paths.
        """
        values = tuple(leaves)
        if len(values) != len(self._values):
            raise ValueError(
                f"Params.with_leaves got {len(values)} leaves for {len(self._values)} paths. "
                "Pass one value per path, in keys() order (as leaves() returns them)."
            )
        return Params._make(self._struct, values)

    @classmethod
    def from_items(cls, items: Iterable[tuple[Path, Param]], *, locked: bool = False) -> Params:
        """New params from ``(path, Param)`` pairs, in any order (paths are sorted).

        Builds the container in one step (item assignment re-sorts on every insertion),
        e.g. from `items` of other params, filtered or with new values.

        Args:
          items: ``(path tuple, Param)`` pairs; each path once.
          locked: the lock flag of the result.

        >>> import jax.numpy as jnp
        >>> p = Params.from_items([(('net', 'w'), Param(jnp.ones((2,)))),
        ...                        (('net', 'b'), Param(jnp.zeros(()), trainable=False))])
        >>> list(p.keys())
        [('net', 'b'), ('net', 'w')]

        Raises:
          TypeError: an item is not a ``(path, Param)`` pair.
          ValueError: a path appears twice; the message names it.
        """
        triples = {}
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Param)):
                raise TypeError(
                    f"Params.from_items expects (path, Param) pairs, got {item!r}. Wrap values: "
                    "(path, bx.Param(value))."
                )
            path, param = _check_path(item[0]), item[1]
            if path in triples:
                raise ValueError(
                    f"Params.from_items got the path '{format_path(path)}' twice; each path "
                    "may appear once."
                )
            where = f"'{format_path(path)}'"
            triples[path] = (param.value, _make_info(param.trainable, param.metadata, where))
        keys = tuple(sorted(triples))
        return cls._make(
            _Structure(keys, tuple(triples[k][1] for k in keys), bool(locked)),
            tuple(triples[k][0] for k in keys),
        )

    def metadata_entries(self, key: str) -> dict[Path, Any]:
        """``{path: metadata[key]}`` for every path whose metadata has `key`, in `keys()`
        order; cheaper than scanning `items` (only those entries are unfrozen).

        >>> import jax.numpy as jnp
        >>> params = Params()
        >>> params[('net', 'b')] = Param(jnp.zeros((2,)))
        >>> params[('net', 'w')] = Param(jnp.ones((2, 3)), metadata={'sharding': (None, 'model')})
        >>> params.metadata_entries('sharding')
        {('net', 'w'): (None, 'model')}
        """
        out = {}
        for path, (_, meta) in zip(self._struct.keys, self._struct.infos, strict=True):
            for k, v in meta:
                if k == key:
                    out[path] = _thaw(v)
                    break
        return out

    def with_metadata(self, updates: Mapping[Path, Mapping[str, Any]]) -> Params:
        """These params with the whole metadata of the paths in `updates` replaced by the
        given dicts (values, trainable flags and the lock flag unchanged).

        Read the current metadata with ``params[path].metadata`` (a fresh dict) and pass
        it back changed; an empty dict clears it.

        >>> import jax.numpy as jnp
        >>> params = Params()
        >>> params[('net', 'w')] = Param(jnp.ones((2, 3)))
        >>> tagged = params.with_metadata({('net', 'w'): {'sharding': (None, 'model')}})
        >>> tagged[('net', 'w')].sharding, params[('net', 'w')].sharding
        ((None, 'model'), ())

        Raises:
          KeyError: (`BloxKeyError`) a path of `updates` that these params lack.
          TypeError: metadata that is not a dict of hashable plain data.
        """
        s = self._struct
        if not updates:
            return self
        infos = list(s.infos)
        for path, meta in updates.items():
            path = _check_path(path)
            i = s.index.get(path)
            if i is None:
                raise _missing_path_error(path, s.keys)
            if not isinstance(meta, Mapping):
                raise TypeError(
                    f"Params.with_metadata: the metadata of '{format_path(path)}' must be a "
                    f"dict, got {type(meta).__name__}."
                )
            infos[i] = _make_info(infos[i][0], meta, f"'{format_path(path)}'")
        return Params._make(_Structure(s.keys, tuple(infos), s.locked), self._values)

    # -- locking -----------------------------------------------------------------

    @property
    def is_locked(self) -> bool:
        """Whether creating new parameters (and item assignment) is refused."""
        return self._struct.locked

    def locked(self) -> Params:
        """A copy that refuses to create parameters. Call after initialization."""
        return Params._make(self._struct.with_locked(True), self._values)

    def unlocked(self) -> Params:
        """A copy that allows creating parameters and item assignment."""
        return Params._make(self._struct.with_locked(False), self._values)

    # -- item assignment (loading weights) -----------------------------------------

    def __setitem__(self, path: Path, param: Param) -> None:
        path = _check_path(path)
        if self._struct.locked:
            raise RuntimeError(_LOCKED_SET_MSG.format(path=format_path(path)))
        if not isinstance(param, Param):
            raise TypeError(
                f"Expected Param for '{format_path(path)}', got {type(param).__name__}. "
                f"Wrap the value: params[path] = Param(value, trainable=True)."
            )
        info = _make_info(param.trainable, param.metadata, f"'{format_path(path)}'")
        new = self._set(path, param.value, info)
        self._struct = new._struct
        self._values = new._values

    # -- split / merge -------------------------------------------------------------

    def split(
        self, predicate: Callable[[Path, Param], bool] | None = None
    ) -> tuple[Params, Params]:
        """Splits into ``(matching, rest)``; both keep the lock flag.

        Args:
          predicate: ``(path, Param) -> bool``. Default: ``param.trainable``.

        Returns:
          ``(matching, rest)``; ``matching.merge(rest)`` gives back these params.
        """
        s = self._struct
        m_k, m_i, m_v, r_k, r_i, r_v = [], [], [], [], [], []
        for k, info, v in zip(s.keys, s.infos, self._values, strict=True):
            if predicate is None:
                hit = info[0]
            else:
                hit = predicate(k, Param(v, info[0], _thaw(info[1])))
                if not isinstance(hit, bool):
                    hit = bool(hit)
            if hit:
                m_k.append(k), m_i.append(info), m_v.append(v)
            else:
                r_k.append(k), r_i.append(info), r_v.append(v)
        return (
            Params._make(_Structure(tuple(m_k), tuple(m_i), s.locked), tuple(m_v)),
            Params._make(_Structure(tuple(r_k), tuple(r_i), s.locked), tuple(r_v)),
        )

    def merge(self, other: Params) -> Params:
        """Returns the union of both; on shared paths the value of `other` wins.

        Raises:
          ValueError: one side is locked and the other is not.
        """
        if not isinstance(other, Params):
            raise TypeError(
                f"Params.merge expects Params, got {type(other).__name__}. "
                "Convert nested dicts with blox.from_dict first."
            )
        a, b = self._struct, other._struct
        if a.locked != b.locked:
            side = "self" if a.locked else "other"
            unl = "other" if a.locked else "self"
            raise ValueError(
                f"Cannot merge Params: {side} is locked but {unl} is unlocked. Make them match, "
                f"e.g. `{unl}.locked()` (or `.unlocked()` on {side}) before merging."
            )
        if not b.keys:
            return self
        if not a.keys:
            return other
        merged = dict(zip(a.keys, zip(self._values, a.infos, strict=True), strict=True))
        merged.update(zip(b.keys, zip(other._values, b.infos, strict=True), strict=True))
        keys = tuple(sorted(merged))
        vals = tuple(merged[k][0] for k in keys)
        infos = tuple(merged[k][1] for k in keys)
        return Params._make(_Structure(keys, infos, a.locked), vals)

    # -- display -------------------------------------------------------------------

    def __repr__(self) -> str:
        from blox.core._display import params_table

        return params_table(self)

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from blox.core._display import params_treescope_repr

        return params_treescope_repr(self, path, subtree_renderer)


# ---------------------------------------------------------------------------
# Pytree registration: one node per Params.
# ---------------------------------------------------------------------------


def _flatten(p: Params):
    return p._values, p._struct


def _unflatten(struct: _Structure, values) -> Params:
    p = object.__new__(Params)
    p._struct = struct
    p._values = values if type(values) is tuple else tuple(values)
    return p


def _flatten_with_keys(p: Params):
    DictKey = jax.tree_util.DictKey
    return (
        tuple((DictKey(format_path(k)), v) for k, v in zip(p._struct.keys, p._values, strict=True)),
        p._struct,
    )


jax.tree_util.register_pytree_with_keys(
    Params, _flatten_with_keys, _unflatten, flatten_func=_flatten
)
