"""Per-device random streams: fold mesh-axis indices into `Rng` seeds (the seed-003
pattern), and restore the seeds afterwards."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax

from blox.core import Params, Rng
from blox.parallel._collectives import check_axis

__all__ = ["fold_seeds", "restore_seeds"]


def fold_seeds(
    params: Params, rngs: Rng | Sequence[Rng], axes: str | Sequence[str]
) -> tuple[Params, tuple[tuple[Rng, jax.Array], ...]]:
    """Folds the index along each of `axes` into the seed of each `Rng`, for use inside
    ``jax.shard_map``: keys then differ between the devices along `axes` and are equal
    along every other axis.

    Fold the **data** axis (dropout masks differ per data shard) and not the **model**
    axis (tensor-parallel shards hold parts of the same examples, so they must drop the
    same activations). Restore the seeds with `restore_seeds` before returning params
    that leave the ``shard_map`` replicated (``P()``): this is the seed-003 recipe::

        params, seeds = bp.fold_seeds(params, rng, 'data')  # seed <- fold_in(seed, i)
        y, params = model(params, x)                        # dropout keys differ per shard
        params = bp.restore_seeds(params, seeds)            # seed back: replicated again

    The counter advances identically on every device, so it stays replicated.

    Args:
      params: params holding the seeds.
      rngs: one `Rng` or several.
      axes: a bound axis name or several; their indices are folded in order.

    Returns:
      ``(params, seeds)``: params with folded seeds, and what `restore_seeds` needs.

    Raises:
      ValueError: an axis that is not bound here (outside ``shard_map``).

    >>> import jax, jax.numpy as jnp, blox as bx
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> params = rng.seed(bx.Params(), seed=0)
    >>> def draw(params):
    ...     params, seeds = bp.fold_seeds(params, rng, 'i')
    ...     key, params = rng(params)
    ...     return jax.random.uniform(key), bp.restore_seeds(params, seeds)
    >>> u, _ = jax.vmap(draw, in_axes=None, axis_size=2, axis_name='i')(params)
    >>> bool(u[0] != u[1])
    True
    """
    rngs = (rngs,) if isinstance(rngs, Rng) else tuple(rngs)
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    for r in rngs:
        if not isinstance(r, Rng):
            raise TypeError(f"fold_seeds: expected Rng modules, got {type(r).__name__}.")
    if not rngs:
        return params, ()
    for n in names:
        check_axis(n, "fold_seeds")
    seeds = []
    for r in rngs:
        original = r.get_seed(params)
        key = original
        for n in names:
            key = jax.random.fold_in(key, jax.lax.axis_index(n))
        params = r.seed(params, seed=key)
        seeds.append((r, original))
    return params, tuple(seeds)


def restore_seeds(params: Params, seeds: Sequence[tuple[Rng, Any]]) -> Params:
    """Puts back the seeds `fold_seeds` replaced (the counters keep their advance)."""
    for r, original in seeds:
        params = r.seed(params, seed=original)
    return params
