"""The PyTorch reference helpers shared by the ``tests/nn/test_*torch*.py`` files and the
other tests that compare a layer with PyTorch: dtypes, the float64 context, tensor <->
array conversions, weight loading into `Params`, gradients, and comparisons.

Tolerances: ``tests/tolerances.py`` ``tol(dtype)``. float64 runs inside
``jax.enable_x64(True)`` (a context manager, so x64 never leaks into other tests).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import torch

import blox as bx
from tests.nn.layer_table import filled_params
from tests.tolerances import tol

DTYPES = ["float32", "float64"]
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64}

# PyTorch's LSTM gate order is (i, f, g, o); blox's is (i, g, f, o).
TORCH_TO_BLOX_GATES = (0, 2, 1, 3)


def dtype_context(dtype: str):
    """x64 for float64 tests only, scoped to the test body."""
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


def to_np(t: torch.Tensor) -> np.ndarray:
    """A tensor (detached, on the CPU) as a NumPy array."""
    return t.detach().cpu().numpy()


def to_last(a: np.ndarray) -> np.ndarray:
    """NC... -> N...C."""
    return np.moveaxis(a, 1, -1)


def assert_close(actual, expected, dtype: str, what: str, tolerance: dict | None = None) -> None:
    """`actual` has `dtype` and `expected`'s shape, and is close to it (``tol(dtype)``
    unless `tolerance` is given)."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.dtype == np.dtype(dtype), f"{what}: dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} vs {expected.shape}"
    np.testing.assert_allclose(actual, expected, **(tolerance or tol(dtype)), err_msg=what)


def load_weights(
    params: bx.Params, weights: dict[tuple[str, ...], np.ndarray], *, cast: bool = False
) -> bx.Params:
    """Copies `weights` into `params` and locks. The paths and shapes must already exist;
    so must the dtypes, unless `cast` (then each value takes the stored dtype)."""
    assert set(weights) <= set(params.keys()), sorted(set(weights) - set(params.keys()))
    out = params.unlocked()
    for path, value in weights.items():
        old = params[path]
        assert old.value.shape == value.shape, (path, old.value.shape, value.shape)
        if cast:
            value = np.asarray(value, old.value.dtype)
        assert old.value.dtype == value.dtype, (path, old.value.dtype, value.dtype)
        out[path] = bx.Param(jnp.asarray(value), old.trainable, old.metadata)
    return out.locked()


def jit_grads(loss_fn, params: bx.Params, *args):
    """Gradients of ``loss_fn(params, *args)`` w.r.t. the trainable params and `args`
    (under ``jax.jit``; the forward checks run eagerly)."""
    train, rest = params.split()

    def f(train, *args):
        return loss_fn(train.merge(rest), *args)

    return jax.jit(jax.grad(f, argnums=tuple(range(1 + len(args)))))(train, *args)


def lstm_kernel_from_torch(w_ih: np.ndarray, w_hh: np.ndarray) -> np.ndarray:
    """(4H, F) and (4H, H) in gate order i, f, g, o -> (F + H, 4H) in order i, g, f, o."""
    ih = np.split(w_ih, 4, axis=0)
    hh = np.split(w_hh, 4, axis=0)
    top = np.concatenate([ih[j].T for j in TORCH_TO_BLOX_GATES], axis=1)
    bottom = np.concatenate([hh[j].T for j in TORCH_TO_BLOX_GATES], axis=1)
    return np.concatenate([top, bottom], axis=0)


def lstm_bias_from_torch(b: np.ndarray) -> np.ndarray:
    """(4H,) in gate order i, f, g, o -> (4H,) in order i, g, f, o."""
    parts = np.split(b, 4)
    return np.concatenate([parts[j] for j in TORCH_TO_BLOX_GATES])


def layout(init, params: bx.Params, *args) -> bx.Params:
    """`filled_params` with every new floating array NaN, so a weight that
    `load_weights` does not overwrite shows in the outputs; new integer arrays are zero."""

    def nan(path, s):
        fill = np.nan if np.issubdtype(np.dtype(s.dtype), np.floating) else 0
        return np.full(s.shape, fill, s.dtype)

    return filled_params(init, params, *args, fill=nan)
