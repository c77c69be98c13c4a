"""`Module`: the base class of every blox layer."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from blox.core._errors import BloxKeyError
from blox.core._graph import Graph
from blox.core._params import Params, Path, _make_info, _thaw, format_path, fsdp_read_error

if TYPE_CHECKING:
    from blox.core._rng import Rng

__all__ = ["Module", "Initializer"]

Initializer = Callable[..., Any]

_NOT_INITIALIZED = (
    "Module '{cls}' failed to initialize. Did you forget to call super().__init__(graph) "
    "in {cls}.__init__?"
)

_CREATE_LOCKED = (
    "Parameter '{path}' is missing and the params are locked, so it cannot be created.\n"
    "Locked params come from a finished initialization; a missing parameter usually means the "
    "model changed after init or another model's params were passed. To create it anyway:\n"
    "    params = params.unlocked()\n"
    "    _, params = model(params, inputs)\n"
    "    params = params.locked()"
)


def _dtype_kind(dtype: Any) -> str:
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "PRNG key"
    if jnp.issubdtype(dtype, jnp.bool_):
        return "bool"
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex"
    if jnp.issubdtype(dtype, jnp.floating):
        return "floating"
    if jnp.issubdtype(dtype, jnp.integer):
        return "integer"
    return str(dtype)


def _dtype_name(dtype: Any) -> str:
    try:
        return str(np.dtype(dtype))
    except TypeError:
        return str(dtype)


def _manual_axis_sizes() -> tuple[int, ...]:
    """The sizes of the manual mesh axes in scope (inside ``jax.shard_map``), else ()."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = getattr(mesh, "manual_axes", ())
    if not manual:
        return ()
    sizes = dict(mesh.shape)
    return tuple(sizes[name] for name in manual)


def is_local_shard(stored: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Whether `stored` is a per-device shard of a parameter of shape `expected` inside
    ``jax.shard_map``: `expected` divided along some dimensions by the sizes of distinct
    manual mesh axes in scope (a kernel ``(8, 16)`` split ``P(None, 'model')`` over 4
    devices is ``(8, 4)`` there). Hand-written tensor parallelism reads such shards.
    Always False outside ``shard_map`` and for shapes of another rank.
    """
    stored, expected = tuple(stored), tuple(expected)
    if len(stored) != len(expected) or stored == expected:
        return False
    ratios = []
    for s, e in zip(stored, expected, strict=True):
        if s <= 0 or e % s:
            return False
        if e != s:
            ratios.append(e // s)
    sizes = [n for n in _manual_axis_sizes() if n > 1]
    if not sizes:
        return False

    def place(i: int, free: tuple[int, ...]) -> bool:
        # Dimension i's ratio must be the product of some of the axes still free.
        if i == len(ratios):
            return True
        return any(place(i + 1, rest) for rest in _divide(ratios[i], free))

    return place(0, tuple(sizes))


def _divide(ratio: int, free: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every way to write `ratio` as a product of a subset of `free`: the axes left."""
    if ratio == 1:
        return [free]
    out = []
    for j, n in enumerate(free):
        if ratio % n == 0:
            out += _divide(ratio // n, free[:j] + free[j + 1 :])
    return out


def torch_weight_hint(path: Path) -> str:
    """The `stored_shape_error` hint for a weight ported from PyTorch, which stores a
    matrix as ``(out, in)`` where blox stores ``(in, out)``."""
    return (
        "PyTorch stores weights as (out, in) and blox as (in, out), so store the "
        f"transpose, e.g. params[{path!r}] = bx.Param(weight.T)."
    )


def stored_shape_error(
    module: Module,
    path: Path,
    stored: tuple[int, ...],
    expected: tuple[int, ...],
    why: str = "",
    hint: str | None = None,
) -> str:
    """The message for a stored parameter whose shape does not fit `module`.

    It blames the stored value (named by path, with both shapes), says when it is the
    expected shape transposed, and only then mentions the other cause: inputs of
    another size than at initialization.

    Args:
      module: the module that reads the parameter (named in the message).
      path: the parameter's path.
      stored, expected: the stored shape and the one `module` needs.
      why: appended to the expected shape, e.g. ``" = (D_in, D_out) for ..."``.
      hint: what to do when `stored` is `expected` reversed, in the layout terms of the
        caller (e.g. `torch_weight_hint` for a ``(in, out)`` kernel, or what the rows of
        an embedding table are); default: store the transpose.
    """
    owner = f"{type(module).__name__} '{module.path_str}'"
    msg = (
        f"Parameter '{format_path(path)}' is stored with shape {stored}, but {owner} "
        f"expects {expected}{why}. "
    )
    if len(stored) >= 2 and stored == expected[::-1] and stored != expected:
        if hint is None:
            hint = (
                "store its transpose (every axis reversed), e.g. "
                f"params[{path!r}] = bx.Param(value.T)."
            )
        msg += f"The stored value is transposed: {hint} "
    else:
        msg += (
            "Replace the stored value with one of the expected shape (weights copied from "
            "another library may need a transpose or reshape), or, if it came from "
            "initialization, re-initialize: the layer's configuration or its input size "
            "changed since. "
        )
    return msg.rstrip()


class Module:
    """Base class of blox modules: static configuration bound to one `Graph` node.

    A module holds configuration only; every array lives in `Params`. Subclasses call
    ``super().__init__(graph)`` and implement ``__call__(params, ...) -> (outputs,
    params)``. Constructor arguments are recorded (for ``repr`` and `display`).

    Parameters are read (or lazily created on the first call) with `get_param` and
    replaced with `set_param`; both return new params and never mutate.

    Args:
      graph: a child node (not a root) that no other module is bound to.
    """

    graph: Graph
    _init_args: dict[str, Any]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is None:
            return
        sig = inspect.signature(init)

        @functools.wraps(init)
        def wrapped(self: Module, *args: Any, **kw: Any) -> None:
            outermost = "_init_args" not in self.__dict__
            if outermost:
                try:
                    bound = sig.bind(self, *args, **kw)
                    # Only arguments that differ from their defaults (for a short repr).
                    recorded = {
                        k: v
                        for k, v in list(bound.arguments.items())[1:]
                        if not _is_default(v, sig.parameters[k].default)
                    }
                except TypeError:
                    recorded = {}
                recorded.pop("graph", None)
                self.__dict__["_init_args"] = recorded
                self.__dict__["_init_type"] = type(self)
            init(self, *args, **kw)
            if outermost and "graph" not in self.__dict__:
                raise RuntimeError(_NOT_INITIALIZED.format(cls=type(self).__name__))

        cls.__init__ = wrapped  # type: ignore[method-assign]

    def __init__(self, graph: Graph):
        if not isinstance(graph, Graph):
            raise TypeError(
                f"{type(self).__name__} needs a Graph node as its first argument, got "
                f"{type(graph).__name__}. Use e.g. {type(self).__name__}(graph.child('name'), ...)."
            )
        graph._bind(self)
        self.graph = graph
        if "_init_args" not in self.__dict__:
            self.__dict__["_init_args"] = {}

    # -- parameters ------------------------------------------------------------

    def param_path(self, name: str) -> Path:
        """The full path of this module's parameter `name`."""
        return self.graph.path + (name,)

    def peek_param(self, params: Params, name: str, default: Any = None) -> Any:
        """The stored value of this module's parameter `name`, or `default` if absent.

        Unlike `get_param` it never creates, checks or changes anything and returns no
        params: ``params.value(self.param_path(name), default)``. Use it to look at a
        parameter before creating it, e.g. to read the dtype of a stored kernel.

        >>> import blox as bx, jax.numpy as jnp
        >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
        >>> fc = bx.Linear(g / 'fc', 4, rng)
        >>> params = rng.seed(bx.Params(), seed=0)
        >>> fc.peek_param(params, 'kernel') is None
        True
        >>> _, params = fc(params, jnp.ones((2, 3)))
        >>> fc.peek_param(params.locked(), 'kernel').shape
        (3, 4)
        """
        return params.value(self.param_path(name), default)

    @property
    def path_str(self) -> str:
        """This module's path as printed in messages, e.g. ``'net/encoder/lstm'``."""
        return format_path(self.graph.path)

    def get_param(
        self,
        params: Params,
        name: str,
        shape: tuple[int, ...] | None = None,
        init: Initializer | None = None,
        *,
        dtype: Any = jnp.float32,
        trainable: bool = True,
        metadata: dict | None = None,
        rng: Rng | None = None,
    ) -> tuple[jax.Array, Params]:
        """Returns the value of parameter `name`, creating it if it is missing.

        When the parameter exists, its stored shape must equal `shape` (or, inside
        ``jax.shard_map``, be its per-device shard: `shape` divided along dimensions by
        the sizes of distinct manual mesh axes in scope, as hand-written tensor
        parallelism passes it; a leaf marked as an FSDP shard inside an FSDP step is
        refused with a `ValueError` naming it and ``blox.parallel.fsdp_call``, which
        gathers it) and its dtype must be of the same
        kind as `dtype` (floating, integer, bool, complex or PRNG
        key; a floating parameter cast to another width, e.g. bf16, is accepted).
        When it is missing and the params are unlocked, ``init(key, shape, dtype)``
        creates it; `key` comes from `rng` (``fold_in(seed, counter)``, counter
        advanced for every created parameter) or is ``None`` without an `rng`.

        Args:
          params: the current params.
          name: the parameter's name under this module's path.
          shape: the requested shape (needed to create; checked when present).
          init: ``init(key, shape, dtype) -> array`` (needed to create).
          dtype: the dtype to create with.
          trainable: stored flag (used by `Params.split`).
          metadata: stored metadata, e.g. ``{'sharding': (None, 'model')}``.
          rng: the `Rng` that provides initialization keys.

        Returns:
          ``(value, params)``: params is the input params when nothing was created.
        """
        path = self.graph.path + (name,)
        idx = params._struct.index.get(path)
        if idx is not None:
            value = params._values[idx]
            err = fsdp_read_error(path, params._struct.infos[idx], value)
            if err is not None:
                raise err
            if shape is not None:
                self._check_existing(path, value, tuple(shape), dtype)
            return value, params
        if shape is None or init is None:
            raise BloxKeyError(
                f"Parameter '{format_path(path)}' not found. To create a new parameter, "
                "provide shape and init: get_param(params, name, shape, init)."
            )
        if params.is_locked:
            raise BloxKeyError(_CREATE_LOCKED.format(path=format_path(path)))
        shape = tuple(int(d) for d in shape)
        if rng is not None:
            key, params = rng(params)
            value = init(key, shape, dtype)
        else:
            try:
                value = init(None, shape, dtype)
            except Exception as e:
                raise TypeError(
                    f"Initializer for parameter '{format_path(path)}' failed without a "
                    f"key ({type(e).__name__}: {e}). Random initializers need an Rng: pass "
                    "rng=... to get_param (layers take it as a constructor argument)."
                ) from e
        value = jnp.asarray(value)
        if value.shape != shape:
            raise ValueError(
                f"Initializer for '{format_path(path)}' returned shape {value.shape}, "
                f"expected {shape}. Initializers are called as init(key, shape, dtype)."
            )
        info = _make_info(trainable, metadata, f"'{format_path(path)}'")
        return value, params._set(path, value, info)

    def _check_existing(self, path: Path, value: Any, shape: tuple[int, ...], dtype: Any) -> None:
        vshape = getattr(value, "shape", None)
        if vshape is None:
            return
        if tuple(vshape) != shape and not is_local_shard(tuple(vshape), shape):
            raise ValueError(stored_shape_error(self, path, tuple(vshape), shape))
        vdtype = getattr(value, "dtype", None)
        if vdtype is None or dtype is None:
            return
        if _dtype_kind(vdtype) != _dtype_kind(dtype):
            raise ValueError(
                f"Parameter '{format_path(path)}' is stored as {vdtype} "
                f"({_dtype_kind(vdtype)}), but {_dtype_name(dtype)} ({_dtype_kind(dtype)}) "
                "was requested. Cast it back, or re-initialize."
            )

    def set_param(
        self,
        params: Params,
        name: str,
        value: Any = None,
        trainable: bool | None = None,
        metadata: dict | None = None,
    ) -> Params:
        """Returns new params with parameter `name` updated (allowed on locked params).

        Args:
          params: the current params; the parameter must exist.
          name: the parameter's name under this module's path.
          value: the new value (a ``jax.Array``), or ``None`` to keep it.
          trainable: the new flag, or ``None`` to keep it.
          metadata: entries merged into the stored metadata, or ``None``.
        """
        path = self.graph.path + (name,)
        idx = params._struct.index.get(path)
        if idx is None:
            raise BloxKeyError(
                f"Path '{format_path(path)}' not found. set_param updates existing "
                "parameters; create it first with get_param(params, name, shape, init)."
            )
        if value is None and trainable is None and metadata is None:
            raise ValueError(
                f"set_param('{format_path(path)}') got nothing to change: At least one of "
                "value, trainable or metadata must be provided (pass value=, trainable= or "
                "metadata=)."
            )
        if value is not None and not isinstance(value, jax.Array):
            raise TypeError(
                f"value must be a jax.Array, got {type(value).__name__} for "
                f"'{format_path(path)}'. Convert it with jnp.asarray(value)."
            )
        info = None
        if trainable is not None or metadata is not None:
            old_t, old_m = params._struct.infos[idx]
            meta = _thaw(old_m)
            meta.update(metadata or {})
            info = _make_info(old_t if trainable is None else trainable, meta, format_path(path))
        if value is None:
            value = params._values[idx]
        return params._set(path, value, info)

    # -- calling -------------------------------------------------------------

    def __call__(self, params: Params, *args: Any, **kwargs: Any) -> tuple[Any, Params]:
        raise NotImplementedError(
            f"{type(self).__name__} does not implement __call__(params, ...) -> (outputs, params)."
        )

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={_short(v)}" for k, v in self._init_args.items())
        return f"{type(self).__name__}({args}) at '{self.path_str}'"

    def __treescope_repr__(self, path: str | None, subtree_renderer: Any) -> Any:
        from blox.core._display import module_treescope_repr

        return module_treescope_repr(self, path, subtree_renderer)


def _is_default(value: Any, default: Any) -> bool:
    if value is default:
        return True
    if default is inspect.Parameter.empty:
        return False
    try:
        return type(value) is type(default) and bool(value == default)
    except Exception:
        return False


def _short(v: Any) -> str:
    if isinstance(v, Module):
        return f"<{type(v).__name__} '{v.path_str}'>"
    if callable(v) and hasattr(v, "__name__"):
        return v.__name__
    if isinstance(v, (list, tuple)) and any(isinstance(e, Module) or callable(e) for e in v):
        inner = ", ".join(_short(e) for e in v)
        r = f"[{inner}]" if isinstance(v, list) else f"({inner})"
        return r if len(r) <= 80 else f"[{len(v)} items]"
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."
