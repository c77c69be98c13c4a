"""Helpers shared by the pipeline tests: a module with non-trainable state, and the
branch computations of the conditionals in a compiled program's HLO text."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp

import blox as bx


class Counter(bx.Module):
    """Non-trainable state: counts calls and keeps a running mean of its input."""

    def __call__(self, params, h):
        n, params = self.get_param(
            params, "calls", (), jax.nn.initializers.zeros, dtype=jnp.int32, trainable=False
        )
        mu, params = self.get_param(
            params, "mean", (h.shape[-1],), jax.nn.initializers.zeros, trainable=False
        )
        params = self.set_param(params, "calls", n + 1)
        params = self.set_param(
            params, "mean", 0.9 * mu + 0.1 * jnp.mean(h, axis=0).astype(mu.dtype)
        )
        return h, params


def conditional_heads(hlo: str) -> list[str]:
    """The parameter lists (header lines) of every branch computation of every
    conditional in `hlo`; fails if a named branch's header is not found."""
    names = set()
    for line in hlo.splitlines():
        if " conditional(" in line:
            found = re.search(r"branch_computations=\{([^}]*)\}", line)
            if found:
                names.update(n.strip().lstrip("%") for n in found.group(1).split(","))
            else:  # true_computation= / false_computation=
                names.update(re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", line))
    heads = [
        line
        for line in hlo.splitlines()
        if any(line.lstrip().lstrip("%").startswith(n + " ") for n in names)
    ]
    assert len(heads) == len(names), (names, heads)
    return heads
