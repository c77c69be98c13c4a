"""Tolerances per dtype, in one place (used by every numerical comparison)."""

import jax.numpy as jnp

_TOLERANCES = {
    "float64": dict(rtol=1e-10, atol=1e-12),
    "float32": dict(rtol=1e-5, atol=1e-6),
    "float16": dict(rtol=2e-3, atol=2e-3),
    "bfloat16": dict(rtol=2e-2, atol=2e-2),
}


def tol(dtype) -> dict:
    """``dict(rtol=..., atol=...)`` for comparing arrays of `dtype` to a reference."""
    return _TOLERANCES[jnp.dtype(dtype).name]
