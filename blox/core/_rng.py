"""`Rng`: counter-based random keys whose state lives in `Params`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from blox.core._errors import BloxKeyError
from blox.core._graph import Graph
from blox.core._module import Module
from blox.core._params import Params, _make_info, _thaw

__all__ = ["Rng"]

_UNSEEDED = (
    "Rng '{path}' not initialized: its seed is not in params. Seed it before the first "
    "forward pass:\n"
    "    params = bx.Params()             # wrong: model(params, x) needs random keys\n"
    "    params = rng.seed(bx.Params(), seed=0)   # right"
)


class Rng(Module):
    """Random keys from a seed and a counter stored in `Params` (non-trainable).

    ``key, params = rng(params)`` returns ``fold_in(seed, counter)`` and params with
    the counter advanced, so randomness is explicit state like any other parameter.

    Parameters created (under this module's path):
      ``seed``: the key's raw data (``jax.random.key_data``: ``uint32[2]`` for the
        default threefry key), metadata ``{'tag': 'rng_seed', 'impl': <PRNG impl>}``.
        `get_seed` and ``rng(params)`` wrap it back into a typed key. Raw ``uint32``
        costs less per ``jax.jit`` call than a typed key leaf and saves as a plain
        array in any checkpoint format.
      ``counter``: ``uint32`` scalar, metadata ``{'tag': 'rng_counter'}``.

    Under ``jax.vmap``/``shard_map`` every lane sees the same seed and counter, so
    every lane draws the same key. For per-lane randomness, fold an index into the
    seed (``jax.lax.axis_index(name)`` or an explicit index), and restore the seed
    before returning params that should stay replicated.

    >>> import blox as bx
    >>> g = bx.Graph('net')
    >>> rng = bx.Rng(g.child('rng'))
    >>> params = rng.seed(bx.Params(), seed=0)
    >>> key, params = rng(params)
    >>> int(rng.get_counter(params))
    1
    """

    def __init__(self, graph: Graph):
        super().__init__(graph)

    def seed(
        self, params: Params, *, seed: int | jax.Array | None = None, counter: Any = None
    ) -> Params:
        """Creates (first call) or updates the seed and/or counter.

        Args:
          params: the current params.
          seed: an int, an integer array, or a typed PRNG key (e.g. a folded seed).
          counter: the counter value (default 0 on creation).

        Returns:
          New params.
        """
        seed_path = self.param_path("seed")
        exists = seed_path in params
        if not exists and seed is None:
            raise ValueError(
                f"Rng '{self.path_str}' not initialized. Seed is required: "
                "params = rng.seed(params, seed=0)."
            )
        if seed is None and counter is None:
            raise ValueError(
                f"Rng '{self.path_str}': At least one of seed= or counter= must be provided."
            )
        if seed is not None:
            key = _as_key(seed, self.path_str)
            meta = {"tag": "rng_seed", "impl": str(jax.random.key_impl(key))}
            params = params._set(seed_path, jax.random.key_data(key), _make_info(False, meta, ""))
        counter_path = self.param_path("counter")
        if counter is not None or counter_path not in params:
            value = jnp.asarray(0 if counter is None else counter, dtype=jnp.uint32)
            if value.shape != ():
                raise ValueError(
                    f"Rng '{self.path_str}': counter must be a scalar, got shape {value.shape}."
                )
            if counter_path in params:
                params = params._set(counter_path, value)
            else:
                params = params._set(
                    counter_path, value, _make_info(False, {"tag": "rng_counter"}, "")
                )
        return params

    def get_seed(self, params: Params) -> jax.Array:
        """The stored seed, as a typed PRNG key."""
        return self._key(params, self.param_path("seed"))

    def _key(self, params: Params, seed_path: tuple[str, ...]) -> jax.Array:
        value = params._get_value(seed_path)
        if value is None:
            raise BloxKeyError(_UNSEEDED.format(path=self.path_str))
        meta = params._info(seed_path)[1]
        impl = dict(_thaw(meta)).get("impl")
        return jax.random.wrap_key_data(value, impl=impl)

    def get_counter(self, params: Params) -> jax.Array:
        """The stored counter (``uint32`` scalar)."""
        value = params._get_value(self.param_path("counter"))
        if value is None:
            raise BloxKeyError(_UNSEEDED.format(path=self.path_str))
        return value

    def __call__(self, params: Params) -> tuple[jax.Array, Params]:  # type: ignore[override]
        """Returns ``(fold_in(seed, counter), params with counter + 1)``."""
        seed_path = self.param_path("seed")
        counter_path = self.param_path("counter")
        counter = params._get_value(counter_path)
        if counter is None:
            raise BloxKeyError(_UNSEEDED.format(path=self.path_str))
        key = jax.random.fold_in(self._key(params, seed_path), counter)
        return key, params._set(counter_path, counter + jnp.uint32(1))


def _as_key(seed: Any, where: str) -> jax.Array:
    dtype = getattr(seed, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return seed
    if dtype is not None and getattr(seed, "shape", ()) == (2,) and dtype == jnp.uint32:
        return jax.random.wrap_key_data(seed)
    if isinstance(seed, bool) or (dtype is not None and not jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(
            f"Rng '{where}': seed must be an int, an integer scalar array or a typed key "
            f"(jax.random.key), got {type(seed).__name__} "
            f"{'' if dtype is None else dtype}."
        )
    try:
        return jax.random.key(seed)
    except TypeError as e:
        raise TypeError(
            f"Rng '{where}': cannot make a key from seed {seed!r} ({e}). Pass an int or "
            "a typed key."
        ) from e
