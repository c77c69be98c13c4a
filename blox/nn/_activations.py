"""Activations missing from `jax.nn`, a learnable `PReLU`, and `get_activation` (by
PyTorch name, with PyTorch's semantics)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from blox.core import Graph, Module, Params, Rng
from blox.nn._dtype import compute_dtype

__all__ = ["PReLU", "get_activation", "hard_shrink", "soft_shrink", "tanh_shrink"]


def hard_shrink(x: jax.typing.ArrayLike, lambd: float = 0.5) -> jax.Array:
    """``x`` where ``|x| > lambd``, else 0 (PyTorch ``hardshrink``).

    Shapes: any ``x`` -> the same shape and dtype.

    >>> import blox as bx, jax.numpy as jnp
    >>> bx.hard_shrink(jnp.array([-1.0, 0.2, 0.7]))
    Array([-1. ,  0. ,  0.7], dtype=float32)
    """
    x = jnp.asarray(x)
    return jnp.where(jnp.abs(x) > lambd, x, jnp.zeros((), x.dtype))


def soft_shrink(x: jax.typing.ArrayLike, lambd: float = 0.5) -> jax.Array:
    """``sign(x) * max(|x| - lambd, 0)`` (PyTorch ``softshrink``).

    Shapes: any ``x`` -> the same shape and dtype.

    >>> import blox as bx, jax.numpy as jnp
    >>> bx.soft_shrink(jnp.array([-1.0, 0.2, 0.75]))
    Array([-0.5 ,  0.  ,  0.25], dtype=float32)
    """
    x = jnp.asarray(x)
    lam = jnp.asarray(lambd, x.dtype)
    return jnp.where(x > lam, x - lam, jnp.where(x < -lam, x + lam, jnp.zeros((), x.dtype)))


def tanh_shrink(x: jax.typing.ArrayLike) -> jax.Array:
    """``x - tanh(x)`` (PyTorch ``tanhshrink``).

    Shapes: any ``x`` -> the same shape and dtype.
    """
    x = jnp.asarray(x)
    return x - jnp.tanh(x)


_TORCH_NAMES: dict[str, Callable[..., jax.Array]] = {
    "identity": lambda x: x,
    "relu": jax.nn.relu,
    "relu6": jax.nn.relu6,
    "sigmoid": jax.nn.sigmoid,
    "tanh": jnp.tanh,
    "silu": jax.nn.silu,
    "swish": jax.nn.silu,
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "hardswish": jax.nn.hard_swish,
    "hardsigmoid": jax.nn.hard_sigmoid,
    "hardtanh": jax.nn.hard_tanh,
    "mish": jax.nn.mish,
    "elu": jax.nn.elu,
    "selu": jax.nn.selu,
    "celu": jax.nn.celu,
    "softplus": jax.nn.softplus,
    "softsign": jax.nn.soft_sign,
    "logsigmoid": jax.nn.log_sigmoid,
    "leaky_relu": functools.partial(jax.nn.leaky_relu, negative_slope=0.01),
    "hardshrink": hard_shrink,
    "softshrink": soft_shrink,
    "tanhshrink": tanh_shrink,
}


def get_activation(name: str | Callable[[jax.Array], jax.Array]) -> Callable[..., jax.Array]:
    """The activation PyTorch calls `name` (``torch.nn.functional.<name>`` with its
    default arguments), as a JAX function; a callable is returned unchanged.

    Shapes: the returned function is elementwise: any ``x`` -> the same shape and dtype.

    Names: ``identity, relu, relu6, sigmoid, tanh, silu`` (= ``swish``), ``gelu`` (the
    exact erf form, PyTorch's default; note ``jax.nn.gelu`` defaults to the tanh
    approximation, here ``gelu_tanh``), ``hardswish, hardsigmoid, hardtanh, mish, elu,
    selu, celu, softplus, softsign, logsigmoid, leaky_relu`` (slope 0.01),
    ``hardshrink, softshrink, tanhshrink``. Underscores and case are ignored
    (``'hard_swish'``, ``'SiLU'``).

    >>> import blox as bx, jax.numpy as jnp
    >>> bx.get_activation('SiLU')(jnp.array([0.0, 1.0]))
    Array([0.       , 0.7310586], dtype=float32)
    """
    if callable(name):
        return name
    if not isinstance(name, str):
        raise TypeError(f"get_activation: expected a name or a callable, got {name!r}.")
    key = name.lower()
    if key not in _TORCH_NAMES:
        key = key.replace("_", "")
        key = {"leakyrelu": "leaky_relu", "gelutanh": "gelu_tanh"}.get(key, key)
    if key not in _TORCH_NAMES:
        raise ValueError(
            f"get_activation: unknown activation {name!r}; known names: "
            f"{', '.join(sorted(_TORCH_NAMES))}. Or pass a function x -> y."
        )
    return _TORCH_NAMES[key]


def _prelu_init(value: float) -> Callable[..., jax.Array]:
    def init(key: Any, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        del key
        return jnp.full(shape, value, dtype)

    return init


class PReLU(Module):
    """Parametric ReLU: ``max(x, 0) + negative_slope * min(x, 0)`` with a learned slope,
    one for all channels or one per channel (PyTorch ``nn.PReLU``).

    Shapes: any ``x`` -> same shape. With ``num_parameters = C > 1`` the slope is per
    channel along the last axis (``(..., C)``), or along axis 1 with
    ``channels_first=True`` (``(B, C, ...)``, PyTorch's layout).

    ``graph, num_parameters, rng`` may be positional; every argument after ``rng`` is
    keyword-only, so PyTorch's positional ``PReLU(3, 0.1)`` is written
    ``PReLU(graph, 3, init=0.1)``.

    Args:
      graph: this module's node.
      num_parameters: 1 (a shared slope) or the number of channels.
      rng: unused by the default initializer; kept for a uniform layer signature.
      init: the initial slope (PyTorch's default 0.25).
      channels_first: the channel axis is 1 instead of -1.
      dtype: the compute dtype; default: the promotion of input and parameter dtypes.
      param_dtype: the dtype the slope is created in (default float32).

    Parameters: ``<path>/negative_slope`` ``(num_parameters,)`` trainable (PyTorch
    ``weight``).

    >>> import blox as bx, jax.numpy as jnp
    >>> act = bx.PReLU(bx.Graph('net') / 'act')
    >>> y, params = act(bx.Params(), jnp.array([-2.0, 3.0]))
    >>> y
    Array([-0.5,  3. ], dtype=float32)
    """

    def __init__(
        self,
        graph: Graph,
        num_parameters: int = 1,
        rng: Rng | None = None,
        *,
        init: float = 0.25,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        if rng is not None and not isinstance(rng, Rng):
            raise TypeError(
                f"PReLU '{self.path_str}': rng must be a blox Rng or None, got "
                f"{type(rng).__name__} {rng!r}. The signature is PReLU(graph, "
                "num_parameters=1, rng=None, *, init=0.25, ...): pass the initial slope as "
                "init=..."
            )
        if not isinstance(num_parameters, int) or num_parameters < 1:
            raise ValueError(
                f"PReLU '{self.path_str}': num_parameters must be a positive int (1 or the "
                f"number of channels), got {num_parameters!r}."
            )
        self.num_parameters = num_parameters
        self.init = float(init)
        self.rng = rng
        self.channels_first = channels_first
        self.dtype = dtype
        self.param_dtype = param_dtype

    def __call__(self, params: Params, x: jax.Array) -> tuple[jax.Array, Params]:
        """Applies the activation; returns ``(y, params)``."""
        x = jnp.asarray(x)
        k = self.num_parameters
        ax = 1 if self.channels_first else x.ndim - 1
        if k > 1 and (x.ndim <= ax or ax < 0 or x.shape[ax] != k):
            where = "axis 1" if self.channels_first else "the last axis"
            raise ValueError(
                f"PReLU '{self.path_str}': num_parameters={k} needs {k} channels on {where}, "
                f"got input shape {tuple(x.shape)}. Fix the input or num_parameters "
                "(1 shares one slope over all channels)."
            )
        slope, params = self.get_param(
            params,
            "negative_slope",
            (k,),
            _prelu_init(self.init),
            dtype=self.param_dtype,
            rng=self.rng,
        )
        cd = compute_dtype(x, slope.dtype, self.dtype)
        xc = x.astype(cd)
        if k == 1:
            a = slope.astype(cd).reshape(())
        else:
            shape = [1] * x.ndim
            shape[ax] = k
            a = slope.astype(cd).reshape(shape)
        zero = jnp.zeros((), cd)
        return jnp.maximum(xc, zero) + a * jnp.minimum(xc, zero), params
