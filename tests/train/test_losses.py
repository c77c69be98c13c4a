"""Losses against independent references: NumPy (closed forms), PyTorch and optax.losses.

Tolerances: ``tests/tolerances.py`` ``tol(dtype)`` (float32 ``rtol=1e-5, atol=1e-6``,
float64 ``rtol=1e-10, atol=1e-12``); float64 runs inside ``jax.enable_x64(True)``.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import blox as bx
from tests.tolerances import tol

DTYPES = ["float32", "float64"]


def _x64(dtype: str):
    return jax.enable_x64(True) if dtype == "float64" else contextlib.nullcontext()


def _close(actual, expected, dtype: str) -> None:
    actual = np.asarray(actual)
    assert actual.dtype == np.dtype(dtype), (actual.dtype, dtype)
    np.testing.assert_allclose(actual, expected, **tol(dtype))


def _rand(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_regression_losses_match_numpy(dtype, reduction):
    p, t = _rand(0, 4, 3, 2), _rand(1, 4, 3, 2)
    red = {"mean": np.mean, "sum": np.sum, "none": lambda v: v}[reduction]
    with _x64(dtype):
        pj, tj = jnp.asarray(p, dtype), jnp.asarray(t, dtype)
        _close(bx.mse(pj, tj, reduction=reduction), red((p - t) ** 2), dtype)
        _close(bx.mae(pj, tj, reduction=reduction), red(np.abs(p - t)), dtype)
        if reduction == "mean":
            _close(bx.rmse(pj, tj), np.sqrt(np.mean((p - t) ** 2)), dtype)


def test_regression_losses_match_torch_and_optax():
    p, t = _rand(2, 8, 5).astype(np.float32), _rand(3, 8, 5).astype(np.float32)
    tp, tt = torch.from_numpy(p), torch.from_numpy(t)
    _close(bx.mse(p, t), torch.nn.functional.mse_loss(tp, tt).numpy(), "float32")
    _close(bx.mae(p, t), torch.nn.functional.l1_loss(tp, tt).numpy(), "float32")
    _close(bx.mse(p, t), 2 * jnp.mean(optax.losses.l2_loss(p, t)), "float32")


def test_low_precision_inputs_give_float32_loss():
    p = jnp.asarray(_rand(4, 16), jnp.bfloat16)
    t = jnp.asarray(_rand(5, 16), jnp.float32)
    out = bx.mse(p, t)
    assert out.dtype == jnp.float32
    ref = np.mean((np.asarray(p, np.float64) - np.asarray(t, np.float64)) ** 2)
    np.testing.assert_allclose(out, ref, **tol("float32"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_skip", [0, 3])
def test_normalized_losses_match_numpy(dtype, n_skip):
    p, t = _rand(6, 2, 7, 3), _rand(7, 2, 7, 3)
    std = np.array([0.5, 2.0, 10.0])
    err = (p - t)[:, n_skip:, :] / std
    with _x64(dtype):
        args = (jnp.asarray(p, dtype), jnp.asarray(t, dtype), jnp.asarray(std, dtype))
        _close(bx.normalized_mse(*args, n_skip=n_skip), np.mean(err**2), dtype)
        _close(bx.normalized_mae(*args, n_skip=n_skip), np.mean(np.abs(err)), dtype)


def test_normalized_mse_balances_channel_scales():
    # Channel 1 is 100x larger in physical units; normalized errors are equal.
    t = np.zeros((1, 4, 2), np.float32)
    p = np.stack([np.full((1, 4), 0.1), np.full((1, 4), 10.0)], -1).astype(np.float32)
    _close(bx.normalized_mse(p, t, np.array([1.0, 100.0], np.float32)), 0.01, "float32")


def _np_log_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_softmax_cross_entropy_integer_labels_matches_torch(dtype, smoothing):
    logits, labels = _rand(8, 6, 5), np.random.default_rng(9).integers(0, 5, size=6)
    ref = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits), torch.from_numpy(labels), label_smoothing=smoothing
    )
    ref_none = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits),
        torch.from_numpy(labels),
        label_smoothing=smoothing,
        reduction="none",
    )
    with _x64(dtype):
        z = jnp.asarray(logits, dtype)
        y = jnp.asarray(labels, jnp.int32)
        _close(bx.softmax_cross_entropy(z, y, label_smoothing=smoothing), ref.numpy(), dtype)
        _close(
            bx.softmax_cross_entropy(z, y, label_smoothing=smoothing, reduction="none"),
            ref_none.numpy(),
            dtype,
        )


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_softmax_cross_entropy_ignore_index_matches_torch(smoothing):
    logits = _rand(10, 3, 4, 6).astype(np.float32)  # [B, T, C]
    labels = np.random.default_rng(11).integers(0, 6, size=(3, 4))
    labels[0, :2] = -100
    labels[2, 3] = -100
    ref = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits).permute(0, 2, 1),  # torch wants [B, C, T]
        torch.from_numpy(labels),
        ignore_index=-100,
        label_smoothing=smoothing,
    )
    out = bx.softmax_cross_entropy(
        logits, jnp.asarray(labels, jnp.int32), ignore_index=-100, label_smoothing=smoothing
    )
    _close(out, ref.numpy(), "float32")
    per = bx.softmax_cross_entropy(
        logits, jnp.asarray(labels, jnp.int32), ignore_index=-100, reduction="none"
    )
    assert np.all(np.asarray(per)[labels == -100] == 0.0)
    # Every label ignored: 0 (documented), not NaN.
    all_ignored = jnp.full((3, 4), -100, jnp.int32)
    assert float(bx.softmax_cross_entropy(logits, all_ignored, ignore_index=-100)) == 0.0


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_softmax_cross_entropy_one_hot_matches_numpy_and_optax(smoothing):
    logits = _rand(12, 7, 4).astype(np.float32)
    labels = np.random.default_rng(13).integers(0, 4, size=7)
    onehot = np.eye(4, dtype=np.float32)[labels]
    q = (1 - smoothing) * onehot + smoothing / 4
    ref = np.mean(-(q * _np_log_softmax(logits.astype(np.float64))).sum(-1))
    _close(bx.softmax_cross_entropy(logits, onehot, label_smoothing=smoothing), ref, "float32")
    smoothed = optax.smooth_labels(jnp.asarray(onehot), smoothing)
    ref_optax = jnp.mean(optax.losses.softmax_cross_entropy(jnp.asarray(logits), smoothed))
    _close(
        bx.softmax_cross_entropy(logits, onehot, label_smoothing=smoothing), ref_optax, "float32"
    )
    # Integer and one-hot labels agree.
    _close(
        bx.softmax_cross_entropy(logits, labels, label_smoothing=smoothing),
        ref,
        "float32",
    )


def _masked_problem(seed: int, batch: int = 6, classes: int = 7):
    """Logits with some classes masked to -inf per row (never the label's class)."""
    r = np.random.default_rng(seed)
    logits = r.standard_normal((batch, classes))
    labels = r.integers(0, classes, size=batch)
    masked = r.uniform(size=(batch, classes)) < 0.4
    masked[np.arange(batch), labels] = False
    masked[0] = False  # one row without a mask
    masked[1, :] = True  # one row with every class but the label masked
    masked[1, labels[1]] = False
    logits[masked] = -np.inf
    return logits, labels, masked


def _torch_on_remaining_classes(logits, labels, masked, smoothing, onehot=None):
    """The reference: per row, torch's cross-entropy over the classes NOT masked (a
    masked class is absent from the vocabulary); loss per row and d loss_row / d logits
    scattered back (0 on masked classes)."""
    losses, grads = [], np.zeros_like(logits)
    for i in range(logits.shape[0]):
        keep = np.flatnonzero(~masked[i])
        z = torch.tensor(logits[i, keep][None], dtype=torch.float64, requires_grad=True)
        if onehot is None:
            target = torch.tensor([int(np.flatnonzero(keep == labels[i])[0])])
        else:
            target = torch.tensor(onehot[i, keep][None], dtype=torch.float64)
        loss = torch.nn.functional.cross_entropy(z, target, label_smoothing=smoothing)
        loss.backward()
        losses.append(loss.item())
        grads[i, keep] = z.grad.numpy()[0]
    return np.asarray(losses), grads


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_softmax_cross_entropy_masked_classes_match_torch_on_the_remaining_classes(
    dtype, smoothing
):
    logits, labels, masked = _masked_problem(20)
    ref, ref_grad = _torch_on_remaining_classes(logits, labels, masked, smoothing)
    b = logits.shape[0]

    @jax.jit
    def mean_loss(z, y):
        return bx.softmax_cross_entropy(z, y, label_smoothing=smoothing)

    @jax.jit
    def per_row(z, y):
        return bx.softmax_cross_entropy(z, y, label_smoothing=smoothing, reduction="none")

    grad_fn = jax.jit(jax.grad(mean_loss))
    with _x64(dtype):
        z, y = jnp.asarray(logits, dtype), jnp.asarray(labels, jnp.int32)
        _close(per_row(z, y), ref, dtype)
        _close(mean_loss(z, y), ref.mean(), dtype)
        grad = np.asarray(grad_fn(z, y))
        assert np.all(np.isfinite(grad)) and np.all(grad[masked] == 0.0)
        _close(grad, ref_grad / b, dtype)
    if smoothing == 0.0:  # torch and optax on the full logits, -inf included, agree
        tz = torch.tensor(logits, requires_grad=True)
        full = torch.nn.functional.cross_entropy(tz, torch.from_numpy(labels))
        full.backward()
        np.testing.assert_allclose(full.item(), ref.mean(), rtol=1e-12)
        np.testing.assert_allclose(tz.grad.numpy(), ref_grad / b, rtol=1e-12, atol=1e-15)
        ref_optax = optax.losses.softmax_cross_entropy_with_integer_labels(
            jnp.asarray(logits, jnp.float32), jnp.asarray(labels, jnp.int32)
        )
        _close(per_row(jnp.asarray(logits, jnp.float32), labels), ref_optax, "float32")


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_softmax_cross_entropy_masked_classes_one_hot_and_bf16(smoothing):
    logits, labels, masked = _masked_problem(21)
    r = np.random.default_rng(22)
    soft = r.uniform(size=logits.shape) * ~masked  # probability targets on kept classes
    soft /= soft.sum(-1, keepdims=True)
    ref, ref_grad = _torch_on_remaining_classes(logits, labels, masked, smoothing, soft)
    z = jnp.asarray(logits, jnp.float32)
    out = bx.softmax_cross_entropy(z, jnp.asarray(soft, jnp.float32), label_smoothing=smoothing)
    _close(out, ref.mean(), "float32")
    grad = jax.grad(bx.softmax_cross_entropy)(
        z, jnp.asarray(soft, jnp.float32), label_smoothing=smoothing
    )
    assert np.all(np.isfinite(grad))
    _close(grad, ref_grad / logits.shape[0], "float32")

    # bf16 logits: the loss is computed in float32 from the bf16 values, the gradient
    # comes back in bf16.
    z16 = jnp.asarray(logits, jnp.bfloat16)
    exact = np.asarray(z16.astype(jnp.float32), np.float64)
    ref16, ref16_grad = _torch_on_remaining_classes(exact, labels, masked, smoothing)
    y = jnp.asarray(labels, jnp.int32)
    _close(bx.softmax_cross_entropy(z16, y, label_smoothing=smoothing), ref16.mean(), "float32")
    g16 = jax.grad(bx.softmax_cross_entropy)(z16, y, label_smoothing=smoothing)
    assert g16.dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(g16, np.float32)))
    np.testing.assert_allclose(
        np.asarray(g16, np.float32), ref16_grad / logits.shape[0], **tol("bfloat16")
    )


def test_softmax_cross_entropy_masked_edge_cases():
    inf = np.inf
    logits = jnp.array([[0.0, -inf, 1.0], [-inf, -inf, -inf], [-inf, -inf, -inf]])
    labels = jnp.array([1, 0, -1], jnp.int32)  # label on a masked class; all masked twice
    per = bx.softmax_cross_entropy(logits, labels, ignore_index=-1, reduction="none")
    assert float(per[0]) == inf  # the target has probability 0
    assert np.isnan(per[1])  # every class masked: no distribution
    assert float(per[2]) == 0.0  # ... but an ignored row is simply ignored

    # An ignored fully-masked row (padding) leaves the loss and gradient of the others
    # untouched: compare with the kept row alone.
    z = jnp.array([[0.5, -inf, 1.0], [-inf, -inf, -inf]])
    y = jnp.array([2, -1], jnp.int32)
    for smoothing in (0.0, 0.3):
        loss_fn = functools.partial(
            bx.softmax_cross_entropy, ignore_index=-1, label_smoothing=smoothing
        )
        loss, grad = jax.jit(jax.value_and_grad(loss_fn))(z, y)
        ref, ref_grad = _torch_on_remaining_classes(
            np.array([[0.5, -inf, 1.0]]),
            np.array([2]),
            np.array([[False, True, False]]),
            smoothing,
        )
        _close(loss, ref[0], "float32")
        _close(grad, np.concatenate([ref_grad, np.zeros((1, 3))]), "float32")
    # One-hot mass on a masked class: +inf.
    onehot = jnp.array([[0.0, 1.0, 0.0]])
    assert float(bx.softmax_cross_entropy(jnp.array([[0.0, -inf, 1.0]]), onehot)) == inf


def test_softmax_cross_entropy_out_of_range_label_is_nan_under_jit():
    logits = jnp.zeros((2, 3))
    out = jax.jit(lambda y: bx.softmax_cross_entropy(logits, y, reduction="none"))(
        jnp.array([1, 3], jnp.int32)
    )
    assert np.isfinite(out[0]) and np.isnan(out[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_sigmoid_binary_cross_entropy_matches_torch(dtype):
    logits = 5 * _rand(14, 4, 3)  # large logits exercise the stable form
    labels = np.random.default_rng(15).uniform(size=(4, 3))
    ref = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.from_numpy(logits), torch.from_numpy(labels)
    )
    with _x64(dtype):
        out = bx.sigmoid_binary_cross_entropy(
            jnp.asarray(logits, dtype), jnp.asarray(labels, dtype)
        )
        _close(out, ref.numpy(), dtype)
    ref_optax = optax.losses.sigmoid_binary_cross_entropy(
        jnp.asarray(logits, jnp.float32), jnp.asarray(labels, jnp.float32)
    )
    _close(
        bx.sigmoid_binary_cross_entropy(
            jnp.asarray(logits, jnp.float32), jnp.asarray(labels, jnp.float32), reduction="none"
        ),
        ref_optax,
        "float32",
    )


# Logits from 0 (exactly) to far beyond float32's exp range, both signs.
_BCE_LOGITS = [0.0, 1e-3, 0.5, 1.0, 5.0, 20.0, 40.0, 100.0, 1e4]
_BCE_LOGITS = np.array(sorted({s * v for v in _BCE_LOGITS for s in (-1.0, 1.0)}))


def _torch_bce(logits: np.ndarray, labels: np.ndarray):
    """torch's BCEWithLogitsLoss in float64: the summed loss and its gradient."""
    tx = torch.tensor(logits, dtype=torch.float64, requires_grad=True)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        tx, torch.tensor(labels, dtype=torch.float64), reduction="sum"
    )
    loss.backward()
    return loss.item(), tx.grad.numpy()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sigmoid_binary_cross_entropy_value_and_grad_match_torch_at_zero_and_far(dtype):
    x = np.repeat(_BCE_LOGITS, 3)
    z = np.tile([0.0, 0.3, 1.0], len(_BCE_LOGITS))
    xj = jnp.asarray(x, dtype)
    exact = np.asarray(xj.astype(jnp.float32), np.float64)  # the values bf16 holds
    ref, ref_grad = _torch_bce(exact, z)
    zj = jnp.asarray(z, jnp.float32)
    loss, grad = jax.value_and_grad(bx.sigmoid_binary_cross_entropy)(xj, zj, reduction="sum")
    _close(loss, ref, "float32")  # the loss is float32 for both input dtypes
    _close(bx.sigmoid_binary_cross_entropy(xj, zj), ref / len(x), "float32")
    assert grad.dtype == jnp.dtype(dtype)
    # d loss / dx = sigmoid(x) - z, of magnitude <= 1 with the sum reduction.
    np.testing.assert_allclose(np.asarray(grad, np.float64), ref_grad, **tol(dtype))
    # At a logit of exactly 0 (a zero-initialized head) the gradient is 0.5 - z.
    at_zero = exact == 0.0
    assert at_zero.sum() == 3
    np.testing.assert_allclose(
        np.asarray(grad, np.float64)[at_zero], 0.5 - z[at_zero], rtol=tol(dtype)["rtol"], atol=0
    )


def test_losses_are_differentiable_and_jittable():
    p, t = jnp.asarray(_rand(16, 4, 2), jnp.float32), jnp.asarray(_rand(17, 4, 2), jnp.float32)
    g = jax.jit(jax.grad(bx.mse))(p, t)
    np.testing.assert_allclose(g, 2 * (np.asarray(p) - np.asarray(t)) / p.size, **tol("float32"))


# -- errors ------------------------------------------------------------------------


@pytest.mark.parametrize("loss", [bx.mse, bx.mae, bx.rmse, bx.sigmoid_binary_cross_entropy])
def test_mismatched_shapes_raise(loss):
    with pytest.raises(ValueError, match=r"shape \(4, 1\) .* shape \(4,\).*never broadcast"):
        loss(jnp.zeros((4, 1)), jnp.zeros((4,)))


def test_cross_entropy_errors():
    logits = jnp.zeros((2, 3))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 3\).*got \[3\]"):
        bx.softmax_cross_entropy(logits, jnp.array([0, 3], jnp.int32))
    with pytest.raises(ValueError, match=r"labels must be in \[0, 3\).*ignore_index=-1"):
        bx.softmax_cross_entropy(logits, jnp.array([-2, 1], jnp.int32), ignore_index=-1)
    with pytest.raises(ValueError, match=r"integer labels must have shape \(2,\).*got \(2, 1\)"):
        bx.softmax_cross_entropy(logits, jnp.zeros((2, 1), jnp.int32))
    with pytest.raises(ValueError, match=r"logits has shape \(2, 3\) but labels.*\(2, 4\)"):
        bx.softmax_cross_entropy(logits, jnp.zeros((2, 4)))
    with pytest.raises(ValueError, match="ignore_index applies to integer labels only"):
        bx.softmax_cross_entropy(logits, jnp.zeros((2, 3)), ignore_index=0)
    with pytest.raises(ValueError, match=r"label_smoothing must be in \[0, 1\)"):
        bx.softmax_cross_entropy(logits, jnp.zeros((2,), jnp.int32), label_smoothing=1.0)
    with pytest.raises(ValueError, match="reduction must be"):
        bx.mse(jnp.zeros(2), jnp.zeros(2), reduction="avg")


def test_normalized_loss_errors():
    p = jnp.zeros((2, 5, 3))
    with pytest.raises(ValueError, match=r"n_skip=5 skips every one of the 5 time steps"):
        bx.normalized_mse(p, p, jnp.ones(3), n_skip=5)
    with pytest.raises(ValueError, match=r"std must have shape \(3,\).*got shape \(2,\)"):
        bx.normalized_mae(p, p, jnp.ones(2))
    with pytest.raises(ValueError, match=r"\[\.\.\., T, C\]"):
        bx.normalized_mse(jnp.zeros(3), jnp.zeros(3), jnp.ones(3))
    with pytest.raises(ValueError, match="n_skip must be a non-negative int"):
        bx.normalized_mse(p, p, jnp.ones(3), n_skip=-1)
