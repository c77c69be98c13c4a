"""`Sequential`: chain modules and plain functions."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from blox.core import Graph, Module, Params

__all__ = ["Sequential"]


def _accepted_kwargs(fn: Callable) -> set[str] | None:
    """Names of keyword arguments `fn` accepts; ``None`` means any (``**kwargs``)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return set()
    names = set()
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            return None
        if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.add(p.name)
    return names


class Sequential(Module):
    """Applies layers in order: modules get ``(params, x, **kwargs)``, plain callables ``x``.

    Shapes: ``x`` -> the last layer's output; each layer's output is the next one's
    input.

    Keyword arguments given to the call (e.g. ``is_training``) are passed to each
    module whose ``__call__`` accepts them, so a `Dropout` inside a stack sees
    ``is_training`` while a `Linear` does not.

    Args:
      graph: this module's node (the layers keep their own nodes).
      layers: `Module` instances or plain callables ``x -> x``.

    >>> import blox as bx, jax, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> seq = bx.Sequential(g / 'seq', [bx.Linear(g / 'fc1', 4, rng), jax.nn.relu,
    ...                                 bx.Linear(g / 'fc2', 1, rng)])
    >>> y, params = seq(rng.seed(bx.Params(), seed=0), jnp.ones((2, 3)))
    >>> y.shape
    (2, 1)
    """

    def __init__(self, graph: Graph, layers: Sequence[Module | Callable]):
        super().__init__(graph)
        self.layers = list(layers)
        for i, layer in enumerate(self.layers):
            if not callable(layer):
                raise TypeError(
                    f"Sequential '{self.path_str}': layer {i} ({type(layer).__name__}) is "
                    "not callable; pass Modules or functions x -> x."
                )
        self._kwargs = [
            _accepted_kwargs(layer.__call__) if isinstance(layer, Module) else set()
            for layer in self.layers
        ]

    def __call__(self, params: Params, x: Any, **kwargs: Any) -> tuple[Any, Params]:
        """Runs the layers in order; returns ``(outputs, params)``."""
        for layer, accepted in zip(self.layers, self._kwargs, strict=True):
            if isinstance(layer, Module):
                kw = (
                    kwargs
                    if accepted is None
                    else {k: v for k, v in kwargs.items() if k in accepted}
                )
                x, params = layer(params, x, **kw)
            else:
                x = layer(x)
        return x, params
