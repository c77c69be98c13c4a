"""Checks shared by the train steps of `blox.train` and `blox.parallel`.

* `check_no_new_params`: no parameter is created inside the loss (a layer first called
  there would be re-initialized at every step and dropped).
* `check_rngs_listed`: every `Rng` that draws keys inside a data-parallel step is listed
  in its ``rngs=`` (else every shard draws the same keys).

Both run at trace time (they compare structure and array identity, never values), so
they work inside ``jax.jit`` and ``jax.shard_map`` and cost nothing at run time; the
steps call them on the params a loss function received and the params it returned.

* `check_placement`: a concrete array moved off a mesh with ``jax.device_put(x,
  device)`` keeps the mesh in its type (JAX 0.10) and fails the next ``jax.jit`` with
  unhelpful advice; the steps (called outside ``jax.jit``) and `fit` name it and
  ``blox.parallel.place``.
* `reduce_dtype_of` / `to_reduce_dtype`: the dtype gradient sums run in (float32 for
  bf16/fp16 values by default).
* `optimizer_update`: ``tx.update`` and ``optax.apply_updates`` under standard dtype
  promotion, so that a step traced under strict promotion still runs Optax.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from blox.core._params import FSDP_MARK, Params, Path, _thaw, format_path

__all__ = [
    "FSDP_MARK",
    "optimizer_update",
    "check_no_new_params",
    "check_placement",
    "check_reduce_dtype",
    "check_rngs_listed",
    "counter_paths",
    "reduce_dtype_of",
    "to_reduce_dtype",
]

_NEW_PARAMS = (
    "{where}: the loss created {n} parameter(s) that the params passed to the step do not "
    "hold: {paths}. A parameter first created inside the loss is drawn anew (randomly) at "
    "every step and dropped from the returned params, so it never trains. Initialize the "
    "model once and lock the params before building the step:\n"
    "    _, params = model(params, example_inputs)   # creates every parameter\n"
    "    params = params.locked()                    # creating one later raises"
)

_UNLISTED_RNG = (
    "{where}: the Rng '{rng}' drew keys inside the step (its counter '{counter}' "
    "advanced) but is not in rngs=, so every data shard draws the same keys (the same "
    "dropout masks on every shard), silently. List it, e.g. rngs=[{name}] (its seed is "
    "then folded with the data index inside the step and restored after). An Rng counts "
    "as drawing when the loss returns another array for its counter than the one it "
    "received: code that rebuilds every leaf (a jax.checkpoint or a jax.lax.scan carrying "
    "all the params) makes an unused Rng look drawn; listing it is harmless."
)


def check_no_new_params(before: Params, after: Params, where: str) -> None:
    """Raises when `after` holds a path that `before` does not (a layer first created
    inside the loss of a train step).

    Structure only, so it works on traced params.

    Args:
      before: the params the loss function received.
      after: the params it returned.
      where: the caller named in the message, e.g. ``'make_dp_train_step'``.

    Raises:
      ValueError: naming each new path, `where`, and the fix (initialize the model, then
        ``params.locked()``).

    >>> import jax.numpy as jnp, blox as bx
    >>> before = bx.Params()
    >>> after = bx.Params()
    >>> after[('net', 'fc', 'kernel')] = bx.Param(jnp.ones((2, 2)))
    >>> check_no_new_params(before, after, 'step')
    Traceback (most recent call last):
    ...
    ValueError: step: the loss created 1 parameter(s) ... 'net/fc/kernel'. ...
    """
    if not isinstance(before, Params) or not isinstance(after, Params):
        return
    known = before._struct.index
    new = [k for k in after._struct.keys if k not in known]
    if new:
        paths = ", ".join(repr(format_path(k)) for k in new[:10])
        if len(new) > 10:
            paths += f" and {len(new) - 10} more"
        raise ValueError(_NEW_PARAMS.format(where=where, n=len(new), paths=paths))


def counter_paths(params: Params) -> tuple[Path, ...]:
    """The paths of the `Rng` counters in `params` (metadata ``tag == 'rng_counter'``)."""
    out = []
    for key, info in zip(params._struct.keys, params._struct.infos, strict=True):
        meta = info[1]
        if meta and dict(_thaw(meta)).get("tag") == "rng_counter":
            out.append(key)
    return tuple(out)


def _same(a: Any, b: Any) -> bool:
    """Whether counter value `b` is `a` unchanged: the same object (a traced passthrough
    returns the very tracer it got), or equal concrete values outside any trace."""
    if a is b:
        return True
    if isinstance(a, jax.core.Tracer) or isinstance(b, jax.core.Tracer):
        return False
    try:
        return bool((a == b).all()) if hasattr(a == b, "all") else bool(a == b)
    except Exception:
        return False


def check_rngs_listed(before: Params, after: Params, rngs: Sequence[Any], where: str) -> None:
    """Raises when an `Rng` counter advanced between `before` and `after` (the Rng drew
    keys inside the step) while that `Rng` is not in `rngs`.

    The rule (trace time, no values): a counter advanced when `after` holds another array
    object for it than `before`. A loss that only passes the params through returns the
    very same (traced) array, and `blox.dynamic_scan` carries only the leaves a step
    replaces, so an Rng that draws nothing is not flagged. Outside any trace, equal
    concrete values also count as unchanged. Code that rebuilds every leaf (a
    ``jax.checkpoint`` or a ``jax.lax.scan`` over the whole params) makes every counter
    look advanced; the message says that listing such an Rng is harmless.

    Args:
      before: the params the loss function received.
      after: the params it returned.
      rngs: the `Rng` modules listed in the step's ``rngs=``.
      where: the caller named in the message, e.g. ``'make_dp_train_step'``.

    Raises:
      ValueError: naming the Rng's path, its counter and ``rngs=``.

    >>> import jax.numpy as jnp, blox as bx
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> params = rng.seed(bx.Params(), seed=0)
    >>> _, drawn = rng(params)
    >>> check_rngs_listed(params, drawn, [rng], 'step')   # listed: fine
    >>> check_rngs_listed(params, params, [], 'step')     # passed through: fine
    >>> check_rngs_listed(params, drawn, [], 'step')
    Traceback (most recent call last):
    ...
    ValueError: step: the Rng 'net/rng' drew keys inside the step ... not in rngs=, ...
    """
    if not isinstance(before, Params) or not isinstance(after, Params):
        return
    listed = {tuple(r.graph.path) for r in rngs}
    for key in counter_paths(after):
        owner = key[:-1]
        if owner in listed:
            continue
        i = before._struct.index.get(key)
        if i is None:
            continue  # created in the loss: check_no_new_params reports it
        if _same(before._values[i], after._values[after._struct.index[key]]):
            continue
        name = owner[-1] if owner else "rng"
        raise ValueError(
            _UNLISTED_RNG.format(
                where=where, rng=format_path(owner), counter=format_path(key), name=name
            )
        )


_STALE_MESH = (
    "{where}: {name} is on {n_dev} device(s) {devices} but its type still carries the "
    "mesh {mesh} ({size} devices): it was moved off the mesh with jax.device_put(x, "
    "device), which in JAX 0.10 keeps an Explicit mesh in the array's type. The next "
    "jax.jit fails with advice to call jax.set_mesh, which does not help. Move arrays off "
    "(or between) meshes with blox.parallel.place:\n"
    "    params = bp.place(params, device)      # or a Sharding, or a Mesh (replicated)"
)


def stale_mesh(x: Any) -> tuple[list[int], str, int] | None:
    """``(device ids, mesh shape, mesh size)`` when the concrete array `x` lives on other
    devices than the mesh its type carries (it cannot enter a ``jax.jit``; see
    `check_placement`), else None. Tracers and non-arrays: None."""
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    try:
        mesh = x.aval.sharding.mesh
        devices = x.sharding.device_set
    except Exception:  # a deleted or donated array: JAX reports that itself
        return None
    if getattr(mesh, "empty", True) or mesh.size == len(devices):
        return None
    shape = ", ".join(f"{k}: {v}" for k, v in dict(mesh.shape).items())
    return sorted(d.id for d in devices), f"({shape})", mesh.size


def check_placement(tree: Any, where: str) -> None:
    """Raises when a concrete array of `tree` lives on other devices than the mesh its
    type carries (``jax.device_put(x, device)`` of an array on an Explicit mesh), naming
    the leaf and `blox.parallel.place`. Tracers are skipped (nothing to see at trace
    time); cheap: reads each leaf's type and sharding."""
    for kp, x in jax.tree_util.tree_leaves_with_path(tree):
        found = stale_mesh(x)
        if found is not None:
            ids, mesh, size = found
            raise ValueError(
                _STALE_MESH.format(
                    where=where,
                    name=f"leaf {jax.tree_util.keystr(kp) or '<root>'}",
                    n_dev=len(ids),
                    devices=ids,
                    mesh=mesh,
                    size=size,
                )
            )


# ---------------------------------------------------------------------------
# The dtype of gradient sums (accumulation over microbatches, collectives)
# ---------------------------------------------------------------------------


def check_reduce_dtype(reduce_dtype: Any, where: str) -> Any:
    """`reduce_dtype` as a NumPy dtype (or None, the default rule), checked floating."""
    if reduce_dtype is None:
        return None
    try:
        dt = jnp.dtype(reduce_dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"{where}: reduce_dtype must be a floating dtype (e.g. jnp.float32) or None (float32 "
            f"for bf16/fp16 gradients, else their own dtype), got {reduce_dtype!r}."
        )
    return dt


def reduce_dtype_of(dtype: Any, reduce_dtype: Any) -> Any:
    """The dtype a floating value of `dtype` is summed in: `reduce_dtype` when given
    (checked by `check_reduce_dtype`), else float32 for a floating dtype narrower than
    32 bits (bf16, fp16) and `dtype` itself otherwise. Non-floating dtypes are kept."""
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return dtype
    if reduce_dtype is not None:
        return jnp.dtype(reduce_dtype)
    return jnp.dtype(jnp.float32) if dtype.itemsize < 4 else dtype


def to_reduce_dtype(tree: Any, reduce_dtype: Any) -> Any:
    """Every floating leaf of `tree` cast to `reduce_dtype_of` its dtype."""

    def one(x):
        d = reduce_dtype_of(x.dtype, reduce_dtype)
        return x if d == x.dtype else x.astype(d)

    return jax.tree.map(one, tree)


def optimizer_update(tx: Any, grads: Any, opt_state: Any, trainable: Any) -> tuple[Any, Any]:
    """``(new trainable, new opt_state)``: ``tx.update`` then ``optax.apply_updates``.

    Optax is not strict-promotion clean (Adam's ``b1 ** count`` mixes a Python float with
    an int32 counter), so both run under ``jax.numpy_dtype_promotion('standard')``,
    whatever mode the caller traces the step in; the loss function keeps the caller's
    mode. Every train step (one device, DP, FSDP) updates through this."""
    with jax.numpy_dtype_promotion("standard"):
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state
