"""Losses: regression (MSE, MAE, RMSE, normalized), classification (softmax and sigmoid
cross-entropy).

Conventions shared by every loss here:

* Shapes are checked, never broadcast: ``predictions`` and ``targets`` must have the same
  shape (a ``(B, 1)`` prediction against a ``(B,)`` target is the classic silent bug of
  broadcasting losses; here it is an error naming both shapes).
* Arithmetic runs in the wider of the input dtypes and float32, with explicit casts, so a
  bf16/fp16 model output gets an fp32 loss and everything runs under
  ``jax_numpy_dtype_promotion='strict'``. float64 inputs give a float64 loss.
* ``reduction``: ``'mean'`` (default, a scalar), ``'sum'`` (a scalar) or ``'none'`` (the
  unreduced per-element / per-example values).
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

__all__ = [
    "mae",
    "mse",
    "normalized_mae",
    "normalized_mse",
    "rmse",
    "sigmoid_binary_cross_entropy",
    "softmax_cross_entropy",
]

Reduction = Literal["mean", "sum", "none"]


def _loss_dtype(*xs: jax.Array) -> Any:
    with jax.numpy_dtype_promotion("standard"):
        dt = jnp.float32
        for x in xs:
            if jnp.issubdtype(x.dtype, jnp.floating):
                dt = jnp.promote_types(dt, x.dtype)
    return dt


def _same_shape(name: str, a: jax.Array, b: jax.Array, an: str, bn: str) -> None:
    if a.shape != b.shape:
        raise ValueError(
            f"{name}: {an} has shape {tuple(a.shape)} but {bn} has shape {tuple(b.shape)}; "
            "they must be equal (losses never broadcast). Reshape one of them, e.g. "
            f"{bn}.reshape({an}.shape) or {an}[..., 0]."
        )


def _reduce(name: str, values: jax.Array, reduction: str) -> jax.Array:
    if reduction == "mean":
        return jnp.mean(values)
    if reduction == "sum":
        return jnp.sum(values)
    if reduction == "none":
        return values
    raise ValueError(f"{name}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}.")


def _regression_inputs(name: str, predictions: ArrayLike, targets: ArrayLike):
    p, t = jnp.asarray(predictions), jnp.asarray(targets)
    _same_shape(name, p, t, "predictions", "targets")
    dt = _loss_dtype(p, t)
    return p.astype(dt), t.astype(dt)


def mse(predictions: ArrayLike, targets: ArrayLike, *, reduction: Reduction = "mean") -> jax.Array:
    """Mean squared error: ``mean((predictions - targets) ** 2)``.

    Shapes: ``predictions [...]``, ``targets [...]`` (the same shape, never broadcast) ->
    a scalar (``'mean'``, ``'sum'``) or ``[...]`` (``reduction='none'``).

    Args:
      predictions: any shape ``[...]``.
      targets: the same shape as `predictions`.
      reduction: ``'mean'`` (scalar), ``'sum'`` (scalar) or ``'none'`` (``[...]``).

    Returns:
      The loss in the wider of the input dtypes and float32.

    >>> import jax.numpy as jnp
    >>> float(mse(jnp.array([1.0, 2.0]), jnp.array([0.0, 0.0])))
    2.5
    """
    p, t = _regression_inputs("mse", predictions, targets)
    return _reduce("mse", jnp.square(p - t), reduction)


def mae(predictions: ArrayLike, targets: ArrayLike, *, reduction: Reduction = "mean") -> jax.Array:
    """Mean absolute error: ``mean(|predictions - targets|)``. Dtypes as `mse`.

    Shapes: ``predictions [...]``, ``targets [...]`` (the same shape) -> a scalar, or
    ``[...]`` with ``reduction='none'``.

    >>> import jax.numpy as jnp
    >>> float(mae(jnp.array([1.0, -3.0]), jnp.array([0.0, 0.0])))
    2.0
    """
    p, t = _regression_inputs("mae", predictions, targets)
    return _reduce("mae", jnp.abs(p - t), reduction)


def rmse(predictions: ArrayLike, targets: ArrayLike) -> jax.Array:
    """Root mean squared error: ``sqrt(mse(predictions, targets))`` (a scalar).

    Shapes: ``predictions [...]``, ``targets [...]`` (the same shape) -> a scalar.

    The gradient at a perfect fit is NaN (``d sqrt(x) / dx`` at 0); train on `mse` and
    report `rmse` as a metric.

    >>> import jax.numpy as jnp
    >>> float(rmse(jnp.array([3.0, 4.0]), jnp.array([0.0, 0.0])))  # sqrt(12.5)
    3.5355...
    """
    p, t = _regression_inputs("rmse", predictions, targets)
    return jnp.sqrt(jnp.mean(jnp.square(p - t)))


def _normalized(
    name: str, predictions: ArrayLike, targets: ArrayLike, std: ArrayLike, n_skip: int
) -> jax.Array:
    p, t = _regression_inputs(name, predictions, targets)
    s = jnp.asarray(std)
    if p.ndim < 2:
        raise ValueError(
            f"{name}: predictions must be [..., T, C] (time on axis -2, channels last), got "
            f"shape {tuple(p.shape)}. For a single time step use x[..., None, :]."
        )
    c = p.shape[-1]
    if s.shape not in ((c,), ()):
        raise ValueError(
            f"{name}: std must have shape ({c},) (one value per channel of predictions "
            f"{tuple(p.shape)}) or be a scalar, got shape {tuple(s.shape)}."
        )
    if not isinstance(n_skip, int) or isinstance(n_skip, bool) or n_skip < 0:
        raise ValueError(f"{name}: n_skip must be a non-negative int, got {n_skip!r}.")
    steps = p.shape[-2]
    if n_skip >= steps:
        raise ValueError(
            f"{name}: n_skip={n_skip} skips every one of the {steps} time steps (axis -2 of "
            f"{tuple(p.shape)}); use n_skip < {steps} or longer sequences."
        )
    if n_skip:
        p, t = p[..., n_skip:, :], t[..., n_skip:, :]
    s = jnp.broadcast_to(s.astype(p.dtype).reshape((1,) * (p.ndim - 1) + (-1,)), p.shape)
    return (p - t) / s


def normalized_mse(
    predictions: ArrayLike, targets: ArrayLike, std: ArrayLike, *, n_skip: int = 0
) -> jax.Array:
    """MSE in per-channel normalized space: ``mean(((predictions - targets) / std) ** 2)``.

    Balances channels of different physical scales (seed 000's loss for system
    identification): each output channel's error is divided by that channel's standard
    deviation (typically the training-set std stored in the model).

    Shapes: ``predictions [..., T, C]``, ``targets [..., T, C]``, ``std (C,)`` -> a scalar.

    Args:
      predictions: ``[..., T, C]`` (time on axis -2, channels last).
      targets: the same shape.
      std: ``(C,)`` per-channel standard deviations (or a scalar).
      n_skip: leading time steps excluded from the loss (an RNN's warm-up).

    Returns:
      A scalar in the wider of the input dtypes and float32.

    >>> import jax.numpy as jnp
    >>> p = jnp.zeros((1, 3, 2)); t = jnp.ones((1, 3, 2)).at[..., 1].set(10.0)
    >>> float(normalized_mse(p, t, jnp.array([1.0, 10.0]), n_skip=1))
    1.0
    """
    return jnp.mean(jnp.square(_normalized("normalized_mse", predictions, targets, std, n_skip)))


def normalized_mae(
    predictions: ArrayLike, targets: ArrayLike, std: ArrayLike, *, n_skip: int = 0
) -> jax.Array:
    """MAE in per-channel normalized space: ``mean(|predictions - targets| / std)``.

    Shapes: ``predictions [..., T, C]``, ``targets [..., T, C]``, ``std (C,)`` -> a
    scalar; `std` and `n_skip` as in `normalized_mse`.

    >>> import jax.numpy as jnp
    >>> p = jnp.zeros((1, 2, 2)); t = jnp.array([[[2.0, 10.0], [2.0, 10.0]]])
    >>> float(normalized_mae(p, t, jnp.array([2.0, 5.0])))
    1.5
    """
    return jnp.mean(jnp.abs(_normalized("normalized_mae", predictions, targets, std, n_skip)))


def _is_concrete(x: jax.Array) -> bool:
    return not isinstance(x, jax.core.Tracer)


def softmax_cross_entropy(
    logits: ArrayLike,
    labels: ArrayLike,
    *,
    label_smoothing: float = 0.0,
    ignore_index: int | None = None,
    reduction: Reduction = "mean",
) -> jax.Array:
    """Softmax cross-entropy with integer or one-hot (probability) labels.

    Shapes: ``logits [..., C]`` with integer ``labels [...]`` or probability
    ``labels [..., C]`` -> a scalar, or ``[...]`` with ``reduction='none'``.

    ``loss_i = -sum_c q_ic * log_softmax(logits_i)_c`` with the target distribution
    ``q = (1 - label_smoothing) * onehot + label_smoothing * valid / n_valid``, where
    ``valid`` marks the classes whose logit is not ``-inf`` and ``n_valid`` counts them.
    Without masked classes this is the PyTorch ``CrossEntropyLoss`` definition
    (``label_smoothing / C`` on every class).

    Masked classes (a logit of ``-inf``: a masked vocabulary, illegal actions) are treated
    as absent from the vocabulary: the loss equals the loss over the remaining classes
    alone, with the smoothing mass spread over those classes only; a masked class gets
    no smoothing mass, contributes nothing to the loss and gets a zero gradient. A label
    that points at a masked class gives a loss of ``+inf`` (the target has probability
    0). A row whose every logit is ``-inf`` has no distribution: its loss is NaN, unless
    the row is ignored with `ignore_index` (then 0, with a zero gradient). Mask with
    ``-inf``, e.g. ``jnp.where(mask, logits, -jnp.inf)``: a large finite negative value
    such as ``-1e9`` is an ordinary (if very unlikely) class and gets its share of the
    smoothing.

    Args:
      logits: ``[..., C]``.
      labels: integer class indices ``[...]`` (the shape of `logits` without its last
        axis), or floating one-hot/probability targets of the same shape as `logits`.
      label_smoothing: in ``[0, 1)``.
      ignore_index: integer labels equal to it are excluded (masked out): they add 0 to
        ``'sum'``, are 0 in ``'none'``, and ``'mean'`` divides by the number of kept
        labels (0 when none is kept; PyTorch returns NaN there).
      reduction: ``'mean'``, ``'sum'`` or ``'none'`` (``[...]``).

    Returns:
      A scalar, or ``[...]`` with ``reduction='none'``; in the wider of the logits' dtype
      and float32.

    Integer labels outside ``[0, C)`` (other than `ignore_index`) raise a `ValueError`
    when the labels are concrete; under ``jax.jit`` they cannot be checked, so the loss of
    such an example is NaN rather than a silently wrong number.

    >>> import jax.numpy as jnp
    >>> logits = jnp.array([[0.0, 0.0], [0.0, 0.0]])
    >>> float(softmax_cross_entropy(logits, jnp.array([0, 1])))  # log(2)
    0.6931...
    >>> masked = jnp.array([[0.0, 0.0, -jnp.inf]])  # class 2 masked: as if C were 2
    >>> float(softmax_cross_entropy(masked, jnp.array([0]), label_smoothing=0.1))
    0.6931...
    """
    name = "softmax_cross_entropy"
    z = jnp.asarray(logits)
    y = jnp.asarray(labels)
    if z.ndim == 0:
        raise ValueError(f"{name}: logits must be [..., C], got a scalar.")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"{name}: label_smoothing must be in [0, 1), got {label_smoothing}.")
    num_classes = z.shape[-1]
    dt = _loss_dtype(z)
    z = z.astype(dt)
    zero = jnp.zeros((), dt)
    valid = z != -jnp.inf  # masked classes (-inf) are left out of the distribution
    any_valid = jnp.any(valid, axis=-1)
    # A row with every class masked would make log_softmax NaN, and the NaN would leak
    # into the gradient of the whole batch even when the row is ignored: compute such
    # rows on zeros and set their loss afterwards.
    z = jnp.where(any_valid[..., None], z, zero)
    logp = jax.nn.log_softmax(z, axis=-1)
    logp_valid = jnp.where(valid, logp, zero)  # 0 * -inf never happens below
    n_valid = jnp.sum(valid.astype(dt), axis=-1)
    eps = jnp.asarray(label_smoothing, dt)
    nan = jnp.asarray(jnp.nan, dt)
    if jnp.issubdtype(y.dtype, jnp.integer):
        if y.shape != z.shape[:-1]:
            raise ValueError(
                f"{name}: integer labels must have shape {tuple(z.shape[:-1])} (logits "
                f"{tuple(z.shape)} without the class axis), got {tuple(y.shape)}. For one-hot "
                "labels pass a float array of the logits' shape."
            )
        keep = jnp.ones(y.shape, bool) if ignore_index is None else y != ignore_index
        in_range = (y >= 0) & (y < num_classes)
        if _is_concrete(y):
            bad = keep & ~in_range
            if bool(jnp.any(bad)):
                vals = sorted({int(v) for v in y[bad].ravel()[:5]})
                extra = "" if ignore_index is None else f" or ignore_index={ignore_index}"
                raise ValueError(
                    f"{name}: labels must be in [0, {num_classes}) for logits with "
                    f"{num_classes} classes{extra}; got {vals}. Fix the labels, or pass "
                    "ignore_index= for padding labels."
                )
        safe = jnp.where(keep & in_range, y, 0)
        nll = -jnp.take_along_axis(logp, safe[..., None], axis=-1)[..., 0]
        per = (jnp.asarray(1.0, dt) - eps) * nll
        if label_smoothing:
            smooth = -jnp.sum(logp_valid, axis=-1) / jnp.maximum(n_valid, jnp.ones((), dt))
            per = per + eps * smooth
        per = jnp.where(keep & ~(in_range & any_valid), nan, per)
        per = jnp.where(keep, per, zero)
        if reduction == "mean":
            count = jnp.sum(keep.astype(dt))
            return jnp.sum(per) / jnp.maximum(count, jnp.ones((), dt))
        return _reduce(name, per, reduction)
    if ignore_index is not None:
        raise ValueError(
            f"{name}: ignore_index applies to integer labels only, got {y.dtype} labels of "
            f"shape {tuple(y.shape)}. Zero the rows you want ignored and use reduction='none', "
            "or pass integer labels."
        )
    _same_shape(name, z, y, "logits", "labels")
    q = y.astype(dt)
    if label_smoothing:
        spread = valid.astype(dt) / jnp.maximum(n_valid, jnp.ones((), dt))[..., None]
        q = (jnp.asarray(1.0, dt) - eps) * q + eps * spread
    # Masked classes add nothing (no 0 * -inf, in the value or in a gradient with respect
    # to the labels); a target with mass on a masked class gives +inf.
    per = -jnp.sum(q * logp_valid, axis=-1)
    on_masked = jnp.any(~valid & (q != zero), axis=-1)
    per = jnp.where(on_masked, jnp.asarray(jnp.inf, dt), per)
    per = jnp.where(any_valid, per, nan)
    return _reduce(name, per, reduction)


def sigmoid_binary_cross_entropy(
    logits: ArrayLike, labels: ArrayLike, *, reduction: Reduction = "mean"
) -> jax.Array:
    """Binary cross-entropy on logits (sigmoid inside), PyTorch's ``BCEWithLogitsLoss``.

    Shapes: ``logits [...]``, ``labels [...]`` (the same shape) -> a scalar, or ``[...]``
    with ``reduction='none'``.

    ``loss = softplus(x) - x * z = max(x, 0) - x * z + log(1 + exp(-|x|))``, computed as
    ``jax.nn.softplus(x) - x * z`` so that the gradient is ``sigmoid(x) - z`` at every
    logit, exactly 0 included (the ``max``/``abs`` form splits the derivative at 0 and
    gives ``-z`` there: a zero-initialized head would get a wrong first step), and finite
    and saturating for logits of any magnitude.

    Args:
      logits: any shape ``[...]``.
      labels: targets in ``[0, 1]`` of the same shape (cast to the loss dtype).
      reduction: ``'mean'``, ``'sum'`` or ``'none'``.

    Returns:
      A scalar, or ``[...]`` with ``reduction='none'``; in the wider of the inputs'
      dtypes and float32 (a bf16 logit gets a float32 loss, its gradient comes back in
      bf16).

    >>> import jax, jax.numpy as jnp
    >>> float(sigmoid_binary_cross_entropy(jnp.array([0.0]), jnp.array([1.0])))  # log(2)
    0.6931...
    >>> float(jax.grad(sigmoid_binary_cross_entropy)(jnp.array([0.0]), jnp.array([1.0]))[0])
    -0.5
    """
    name = "sigmoid_binary_cross_entropy"
    x, z = jnp.asarray(logits), jnp.asarray(labels)
    _same_shape(name, x, z, "logits", "labels")
    dt = _loss_dtype(x, z)
    x, z = x.astype(dt), z.astype(dt)
    return _reduce(name, jax.nn.softplus(x) - x * z, reduction)
