"""Exponential moving average of weights, stored as non-trainable params."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from blox.core import Param, Params
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


def ema_init(params: Params, *, prefix: str | tuple[str, ...] = DEFAULT_PREFIX) -> Params:
    """Adds an EMA copy of every trainable param, as a *non-trainable* param.

    The copy of ``('net', 'fc', 'kernel')`` lives at ``('ema', 'net', 'fc', 'kernel')``
    (``prefix + path``), starts equal to the weight, and is stored with
    ``metadata={'tag': 'ema'}`` plus the weight's own metadata (so sharding carries over).
    Being non-trainable, it gets no gradient and no optimizer state, and it is saved,
    sharded and restored with the rest of the params. Call it after initialization and
    before ``tx.init``. The lock flag is kept.

    >>> import blox as bx, jax.numpy as jnp
    >>> p = bx.Params(); p[('net', 'w')] = bx.Param(jnp.ones(2))
    >>> sorted(ema_init(p).keys())
    [('ema', 'net', 'w'), ('net', 'w')]
    """
    pre = _prefix(prefix)
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
        out[pre + path] = Param(jnp.array(p.value, copy=True), trainable=False, metadata=meta)
    return out.locked() if params.is_locked else out


def _pairs(params: Params, pre: tuple[str, ...], where: str) -> tuple[Params, Params, list[Path]]:
    ema, rest = params.split(_is_ema(pre))
    if not len(ema):
        raise KeyError(
            f"{where}: no EMA params under '{format_path(pre)}'. Create them once after "
            "initialization: params = bx.ema_init(params)."
        )
    n = len(pre)
    sources = [k[n:] for k in ema.keys()]
    missing = [format_path(s) for s in sources if s not in rest]
    if missing:
        raise KeyError(
            f"{where}: EMA copies without a source weight: {missing[:3]}; the model's params "
            "changed after ema_init. Re-run ema_init on the new params."
        )
    return ema, rest, sources


def ema_update(
    params: Params, decay: float | jax.Array, *, prefix: str | tuple[str, ...] = DEFAULT_PREFIX
) -> Params:
    """``ema = decay * ema + (1 - decay) * weight`` for every EMA copy; returns new params.

    Call it after each optimizer step (inside the jitted step). `decay` may be a traced
    scalar (e.g. a warm-up ``min(0.999, (1 + t) / (10 + t))``). The arithmetic runs in each
    copy's dtype.

    >>> import blox as bx, jax.numpy as jnp
    >>> p = bx.Params(); p[('w',)] = bx.Param(jnp.zeros(()))
    >>> p = ema_init(p); p[('w',)] = bx.Param(jnp.ones(()))
    >>> float(ema_update(p, 0.9)[('ema', 'w')].value)
    0.1...
    """
    pre = _prefix(prefix)
    ema, rest, sources = _pairs(params, pre, "ema_update")
    leaves, treedef = jax.tree.flatten(ema)
    new = []
    for old, src in zip(leaves, sources, strict=True):
        w = rest[src].value
        d = jnp.asarray(decay).astype(old.dtype)
        one = jnp.ones((), old.dtype)
        new.append(d * old + (one - d) * w.astype(old.dtype))
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
