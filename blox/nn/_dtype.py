"""The compute-dtype rule every layer follows (`Linear`, `Conv`, `Embed`, the recurrent
cells, `PReLU`, the tensor-parallel layers)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["compute_dtype"]


def compute_dtype(x: jax.Array, param_dtype: Any, dtype: Any | None) -> Any:
    """The dtype a layer computes in: `dtype` if given, else the standard JAX promotion
    of the input dtype and the (stored) parameter dtype, so f32 params with bf16 inputs
    compute in f32 and bf16 params with bf16 inputs in bf16. The casts are explicit, so
    layers also run under ``jax_numpy_dtype_promotion='strict'``.

    >>> import jax.numpy as jnp
    >>> x = jnp.ones((2,), jnp.bfloat16)
    >>> compute_dtype(x, jnp.float32, None), compute_dtype(x, jnp.bfloat16, None)
    (dtype('float32'), dtype(bfloat16))
    >>> compute_dtype(x, jnp.float32, 'bfloat16')
    dtype(bfloat16)
    """
    if dtype is not None:
        return jnp.dtype(dtype)
    with jax.numpy_dtype_promotion("standard"):
        return jnp.promote_types(x.dtype, param_dtype)
