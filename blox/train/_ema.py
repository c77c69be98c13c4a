"""Exponential moving average of weights, stored as non-trainable params.

Precision: the average is computed in float32 (float64 for float64 weights) and, by
default, stored in float32 even for bf16/fp16 weights. In bf16, ``0.999`` rounds to
``1.0`` and a per-step change of ``0.001 * (w - ema)`` is far below the spacing of bf16
numbers, so an EMA computed or stored in bf16 would not move.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from blox.core import Param, Params
from blox.core._errors import BloxKeyError
from blox.core._params import Path, format_path

__all__ = ["ema_init", "ema_params", "ema_update"]

DEFAULT_PREFIX = "ema"


def _prefix(prefix: str | tuple[str, ...]) -> tuple[str, ...]:
    p = (prefix,) if isinstance(prefix, str) else tuple(prefix)
    if not p:
        raise ValueError("EMA prefix must not be empty; use e.g. prefix='ema'.")
    return p


def _is_ema(prefix: tuple[str, ...]):
    n = len(prefix)
    return lambda path, _: path[:n] == prefix


def _storage_dtype(dtype: Any, weight_dtype: Any) -> Any:
    if dtype is not None:
        return dtype
    if jnp.issubdtype(weight_dtype, jnp.floating) and jnp.finfo(weight_dtype).bits < 32:
        return jnp.dtype(jnp.float32)
    return weight_dtype


def _check_storage(dtype: DTypeLike | None) -> Any:
    if dtype is None:
        return None
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or not jnp.issubdtype(dt, jnp.floating):
        raise ValueError(
            f"ema_init: dtype={dtype!r} is not a floating dtype; use dtype=None (float32 "
            "copies of bf16/fp16 weights, the weight's dtype otherwise) or e.g. "
            "dtype='float32'."
        )
    return dt


def ema_init(
    params: Params,
    *,
    prefix: str | tuple[str, ...] = DEFAULT_PREFIX,
    dtype: DTypeLike | None = None,
) -> Params:
    """Adds an EMA copy of every trainable param, as a *non-trainable* param.

    The copy of ``('net', 'fc', 'kernel')`` lives at ``('ema', 'net', 'fc', 'kernel')``
    (``prefix + path``), starts equal to the weight, and is stored with
    ``metadata={'tag': 'ema'}`` plus the weight's own metadata (so sharding carries over).
    Being non-trainable, it gets no gradient and no optimizer state, and it is saved,
    sharded and restored with the rest of the params. Call it after initialization and
    before ``tx.init``. The lock flag is kept.

    Dtype policy: by default (``dtype=None``) the copies of bf16/fp16 weights are stored
    in float32 (twice the weights' memory, and an average that moves: see `ema_update`),
    and float32/float64 weights keep their dtype. An explicit `dtype` stores every copy
    in that dtype (``dtype='bfloat16'`` saves memory, but each update is then rounded to
    bf16, and updates smaller than half a bf16 step are lost).

    Args:
      params: the model's params (locked or not).
      prefix: a name (or tuple of names) the copies are stored under.
      dtype: storage dtype of the copies (see above).

    Returns:
      The params with the copies added.

    >>> import blox as bx, jax.numpy as jnp
    >>> p = bx.Params(); p[('net', 'w')] = bx.Param(jnp.ones(2, jnp.bfloat16))
    >>> p = ema_init(p)
    >>> sorted(p.keys()), p[('ema', 'net', 'w')].value.dtype
    ([('ema', 'net', 'w'), ('net', 'w')], dtype('float32'))
    """
    pre = _prefix(prefix)
    storage = _check_storage(dtype)
    existing = [k for k in params.keys() if k[: len(pre)] == pre]
    if existing:
        raise ValueError(
            f"ema_init: params already hold paths under '{format_path(pre)}' (e.g. "
            f"'{format_path(existing[0])}'); EMA copies exist already, or the model uses that "
            "name. Pass another prefix=..."
        )
    trainable = params.split()[0]
    if not len(trainable):
        raise ValueError("ema_init: params hold no trainable parameter to average.")
    out = params.unlocked()
    for path, p in trainable.items():
        meta = dict(p.metadata)
        meta["tag"] = "ema"
        value = jnp.array(p.value, dtype=_storage_dtype(storage, p.value.dtype), copy=True)
        out[pre + path] = Param(value, trainable=False, metadata=meta)
    return out.locked() if params.is_locked else out


def _compute_dtype(dtype: Any) -> Any:
    """float32, or float64 for float64 copies: where the average is computed."""
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits > 32:
        return dtype
    return jnp.dtype(jnp.float32)


def _pairs(params: Params, pre: tuple[str, ...], where: str) -> tuple[Params, Params, list[Path]]:
    ema, rest = params.split(_is_ema(pre))
    if not len(ema):
        raise BloxKeyError(
            f"{where}: no EMA params under '{format_path(pre)}'. Create them once after "
            "initialization: params = bx.ema_init(params)."
        )
    n = len(pre)
    sources = [k[n:] for k in ema.keys()]
    missing = [format_path(s) for s in sources if s not in rest]
    if missing:
        raise BloxKeyError(
            f"{where}: EMA copies without a source weight: {missing[:3]}; the model's params "
            "changed after ema_init. Re-run ema_init on the new params."
        )
    return ema, rest, sources


def ema_update(
    params: Params, decay: float | jax.Array, *, prefix: str | tuple[str, ...] = DEFAULT_PREFIX
) -> Params:
    """``ema = decay * ema + (1 - decay) * weight`` for every EMA copy; returns new params.

    Call it after each optimizer step (inside the jitted step). `decay` may be a traced
    scalar (e.g. a warm-up ``min(0.999, (1 + t) / (10 + t))``); a Python or NumPy number
    must be in ``[0, 1]``.

    Dtype policy: the arithmetic, `decay` included, runs in float32 (float64 for float64
    copies), whatever the weight's and the copy's dtypes; the result is stored in the
    copy's dtype (float32 by default, see `ema_init`). In bf16 the decay ``0.999`` would
    round to ``1.0`` and the average would never move.

    >>> import blox as bx, jax.numpy as jnp
    >>> p = bx.Params(); p[('w',)] = bx.Param(jnp.zeros(()))
    >>> p = ema_init(p); p[('w',)] = bx.Param(jnp.ones(()))
    >>> float(ema_update(p, 0.9)[('ema', 'w')].value)
    0.1...
    """
    pre = _prefix(prefix)
    if jnp.ndim(decay) != 0:
        raise ValueError(
            f"ema_update: decay must be a scalar, got shape {tuple(jnp.shape(decay))}."
        )
    if isinstance(decay, (int, float, np.number)) and not 0.0 <= float(decay) <= 1.0:
        raise ValueError(
            f"ema_update: decay must be in [0, 1], got {decay}. Typical values are 0.99 to "
            "0.9999 (ema = decay * ema + (1 - decay) * weight)."
        )
    ema, rest, sources = _pairs(params, pre, "ema_update")
    leaves, treedef = jax.tree.flatten(ema)
    new = []
    for old, src in zip(leaves, sources, strict=True):
        dt = _compute_dtype(old.dtype)
        w = rest[src].value.astype(dt)
        d = jnp.asarray(decay).astype(dt)
        avg = d * old.astype(dt) + (jnp.ones((), dt) - d) * w
        new.append(avg.astype(old.dtype))
    return rest.merge(jax.tree.unflatten(treedef, new))


def ema_params(params: Params, *, prefix: str | tuple[str, ...] = DEFAULT_PREFIX) -> Params:
    """Params for evaluation: every averaged weight replaced by its EMA value (cast to the
    weight's dtype), the EMA copies dropped. Pass the result to the model as usual.

    >>> import blox as bx, jax.numpy as jnp
    >>> p = bx.Params(); p[('w',)] = bx.Param(jnp.zeros(()))
    >>> p = ema_init(p); p[('w',)] = bx.Param(jnp.ones(()))
    >>> float(ema_params(p)[('w',)].value), len(ema_params(p))
    (0.0, 1)
    """
    pre = _prefix(prefix)
    ema, rest, sources = _pairs(params, pre, "ema_params")
    wanted = set(sources)
    src_params, others = rest.split(lambda path, _: path in wanted)
    values = dict(zip(sources, jax.tree.leaves(ema), strict=True))
    leaves, treedef = jax.tree.flatten(src_params)
    replaced = [values[k].astype(v.dtype) for k, v in zip(src_params.keys(), leaves, strict=True)]
    return others.merge(jax.tree.unflatten(treedef, replaced))
