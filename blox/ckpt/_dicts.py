"""Plain nested dicts of NumPy arrays: the exchange format for porting weights."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from blox.core._convert import from_dict, to_dict
from blox.core._params import Params, format_path

__all__ = ["export_params", "import_params"]


def export_params(params: Params) -> dict[str, Any]:
    """`Params` as nested dicts of NumPy arrays: ``{'net': {'fc': {'kernel': ndarray}}}``.

    The arrays are copied to host memory (``jax.device_get``); trainable flags and
    metadata are not part of the dict (`import_params` takes them from the model). Use it
    to hand weights to another framework, or with ``np.savez``/``pickle``.

    Args:
      params: concrete params.

    Returns:
      Nested dicts keyed by the names of each path, NumPy arrays at the leaves.

    >>> import blox as bx, jax.numpy as jnp
    >>> p = bx.Params(); p[('net', 'w')] = bx.Param(jnp.ones(2))
    >>> export_params(p)
    {'net': {'w': array([1., 1.], dtype=float32)}}
    """
    if not isinstance(params, Params):
        raise TypeError(
            f"export_params expects bx.Params, got {type(params).__name__}. For a whole train "
            "state, export its params entry: export_params(state['params'])."
        )
    return jax.device_get(to_dict(params))


def _walk(tree: Mapping, prefix: tuple[str, ...]):
    for name, sub in tree.items():
        path = prefix + (name,)
        if isinstance(sub, Mapping):
            yield from _walk(sub, path)
        else:
            yield path, sub


def import_params(tree: Mapping[str, Any], like: Params, *, cast: bool = False) -> Params:
    """Params with the structure of `like` and the values of `tree` (nested dicts of arrays).

    The porting step: build the blox model, initialize it (or ``jax.eval_shape`` it) to get
    `like`, convert the other framework's weights into nested dicts keyed by the blox paths
    (transposing where layouts differ), and import. Paths, shapes and dtypes are checked
    against `like` (all missing and unexpected paths are listed at once); trainable flags,
    metadata and the lock flag come from `like`; each array is placed with the sharding
    of `like`'s leaf when it has one (on the default device otherwise).

    Args:
      tree: nested dicts (``str`` keys) of NumPy / JAX arrays (e.g. from a PyTorch
        ``state_dict`` rearranged, or a Flax ``params`` dict).
      like: the params to match, concrete or abstract.
      cast: convert each array to `like`'s dtype (e.g. float64 NumPy to float32). Without
        it a dtype difference is an error, so nothing is rounded silently.

    Returns:
      New `Params`.

    Raises:
      ValueError: missing or unexpected paths, or a shape mismatch (from `blox.from_dict`),
        or a dtype mismatch without `cast`.

    >>> import blox as bx, jax.numpy as jnp, numpy as np
    >>> like = bx.Params(); like[('fc', 'w')] = bx.Param(jnp.zeros((2,)), trainable=False)
    >>> p = import_params({'fc': {'w': np.array([1.0, 2.0], np.float32)}}, like)
    >>> p[('fc', 'w')]
    Param(float32[2], trainable=False)
    """
    if not isinstance(like, Params):
        raise TypeError(
            f"import_params: like must be bx.Params (e.g. jax.eval_shape(init)), got "
            f"{type(like).__name__}."
        )
    if not isinstance(tree, Mapping):
        raise TypeError(f"import_params expects nested dicts, got {type(tree).__name__}.")
    checked = from_dict(tree, like=like)  # paths and shapes, every problem listed
    values = []
    for path, ref in zip(like.keys(), like.leaves(), strict=True):
        value = checked[path].value
        arr = value if isinstance(value, jax.Array) else np.asarray(value)
        if arr.dtype != ref.dtype:
            if not cast:
                raise ValueError(
                    f"import_params: '{format_path(path)}' has dtype {arr.dtype}, the model "
                    f"expects {np.dtype(ref.dtype).name}. Convert it first, or pass cast=True "
                    "to convert every array to the model's dtype."
                )
            arr = arr.astype(ref.dtype)
        sharding = getattr(ref, "sharding", None)
        values.append(
            jax.device_put(arr, sharding) if sharding is not None else jax.device_put(arr)
        )
    return like.with_leaves(values)
