"""Training recipes: the sequence loss (n_skip, TBPTT resets), noise and bias injection,
the TBPTT train step, and a training loop with early stopping on free-run validation."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from blox.core import Params
from blox.train import make_train_step
from blox.ts._evaluate import evaluate_free_run, make_simulator

__all__ = ["SysIdFit", "fit_sysid", "inject_noise", "make_sysid_step", "sysid_loss"]

_LOSSES = ("mse", "mae")


def inject_noise(
    key: jax.Array,
    u: ArrayLike,
    std: ArrayLike,
    *,
    noise: float = 0.0,
    bias: float = 0.0,
) -> jax.Array:
    """Input augmentation of seed 000 (TSFast's noise and bias injection) on raw inputs.

    ``u + std * (noise * n + bias * b)`` with ``n`` ``[B, T, C]`` white and ``b``
    ``[B, 1, C]`` one offset per sequence, both standard normal; `std` is the
    per-channel scale (the model's ``u_norm.std(params)``), so `noise` and `bias` are in
    units of the training standard deviation.

    Args:
      key: a PRNG key.
      u: raw input ``[B, T, C]``.
      std: ``(C,)`` scale.
      noise: white-noise level (>= 0).
      bias: per-sequence offset level (>= 0).

    Returns:
      ``[B, T, C]`` in the dtype of `u`.
    """
    u = jnp.asarray(u)
    if u.ndim != 3:
        raise ValueError(f"inject_noise: u must be [B, T, C], got shape {tuple(u.shape)}.")
    if noise < 0 or bias < 0:
        raise ValueError(f"inject_noise: noise and bias must be >= 0, got {noise}, {bias}.")
    s = jnp.asarray(std).astype(u.dtype).reshape(1, 1, -1)
    kn, kb = jax.random.split(key)
    b, t, c = u.shape
    n = jax.random.normal(kn, (b, t, c), u.dtype)
    o = jax.random.normal(kb, (b, 1, c), u.dtype)
    return u + s * (noise * n + bias * jnp.broadcast_to(o, u.shape))


def _loss_mask(n_skip: int, is_first: jax.Array | None, b: int, t: int) -> jax.Array:
    """``[B, T]``: False for warm-up steps (the first n_skip steps of a window)."""
    warm = jnp.arange(t)[None, :] < n_skip
    if is_first is None:
        return jnp.broadcast_to(~warm, (b, t))
    return ~(warm & jnp.asarray(is_first, bool)[:, None])


def sysid_loss(
    model: Any,
    params: Params,
    batch: Mapping[str, ArrayLike],
    state: Any = None,
    *,
    key: jax.Array | None = None,
    noise: float = 0.0,
    bias: float = 0.0,
    loss: str = "mse",
) -> tuple[tuple[jax.Array, Any], Params]:
    """The system-identification loss of one batch, in per-channel normalized units.

    ``mean(mask * ((y_hat - y) / std_y) ** 2)`` (``'mse'``; ``'mae'``: absolute values),
    over the steps the mask keeps: a window's first ``model.n_skip`` steps are warm-up
    and left out. With truncated BPTT (a batch with ``'is_first'`` ``[B]`` from
    ``blox.data.pipeline(..., tbptt_chunk=...)``) only the *first* chunk of each window
    skips them, and rows with ``is_first`` restart from the initial state (``is_reset``
    at their first step); the other rows continue from `state`.

    Args:
      model: a `SysIdModel`.
      params: the params.
      batch: ``{'u': [B, T, Cu], 'y': [B, T, Cy]}`` raw, optionally ``'is_first'``.
      state: the carried state (``None``: the initial state).
      key: PRNG key for `inject_noise` (required when `noise` or `bias` > 0).
      noise, bias: input augmentation levels (see `inject_noise`).
      loss: ``'mse'`` or ``'mae'``.

    Returns:
      ``((loss, state), params)``: ``state`` is the final state, gradients stopped (to
      carry into the next chunk).
    """
    if loss not in _LOSSES:
        raise ValueError(f"sysid_loss: loss must be one of {_LOSSES}, got {loss!r}.")
    for name in ("u", "y"):
        if name not in batch:
            raise ValueError(
                f"sysid_loss: the batch needs '{name}' ([B, T, C] raw values), got keys "
                f"{sorted(batch)}."
            )
    u, y = jnp.asarray(batch["u"]), jnp.asarray(batch["y"])
    if noise or bias:
        if key is None:
            raise ValueError(
                f"sysid_loss: noise={noise}, bias={bias} need a PRNG key: pass key=..."
            )
        u = inject_noise(key, u, model.u_norm.std(params), noise=noise, bias=bias)
    is_first = batch.get("is_first")
    b, t = u.shape[0], u.shape[1]
    is_reset = None
    if is_first is not None:
        is_first = jnp.asarray(is_first, bool)
        is_reset = jnp.zeros((b, t), bool).at[:, 0].set(is_first)
    elif model.n_skip >= t:
        raise ValueError(
            f"sysid_loss: n_skip={model.n_skip} of {type(model).__name__} skips all {t} "
            "steps of the window; use longer windows or a smaller n_skip."
        )
    (y_hat, state), params = model.forward(params, u, y, state, is_reset)
    std = model.y_norm.std(params).astype(y_hat.dtype)
    err = (y_hat - y.astype(y_hat.dtype)) / std.reshape(1, 1, -1)
    per = jnp.square(err) if loss == "mse" else jnp.abs(err)
    mask = _loss_mask(model.n_skip, is_first, b, t).astype(per.dtype)
    total = jnp.sum(per * mask[..., None])
    count = jnp.maximum(jnp.sum(mask) * per.shape[-1], 1.0)
    return (total / count, jax.lax.stop_gradient(state)), params


def make_sysid_step(
    model: Any,
    tx: optax.GradientTransformation,
    *,
    noise: float = 0.0,
    bias: float = 0.0,
    loss: str = "mse",
) -> Callable[..., Any]:
    """The truncated-BPTT train step:
    ``step(params, opt_state, state, batch, key=None) -> (params, opt_state, state,
    metrics)``.

    `sysid_loss` through `blox.train.make_train_step` (gradients on the trainable
    params only; the normalization statistics stay fixed). ``state`` is the model's
    carried state: pass ``None`` for independent windows (every batch starts fresh), or
    ``model.initial_state(params, batch['u'][:, 0])[0]`` once and then the returned
    state for TBPTT batches (``'is_first'`` resets rows). Not jitted: wrap it in
    ``jax.jit``.
    """

    def loss_fn(params, state, batch, key):
        (value, state), params = sysid_loss(
            model, params, batch, state, key=key, noise=noise, bias=bias, loss=loss
        )
        return (value, {"state": state}), params

    inner = make_train_step(loss_fn, tx, has_aux=True)

    def step(params, opt_state, state, batch, key=None):
        params, opt_state, metrics = inner(params, opt_state, state, batch, key)
        state = metrics.pop("state")
        return params, opt_state, state, metrics

    return step


@dataclass
class SysIdFit:
    """What `fit_sysid` returns.

    Attributes:
      params: the params with the best validation score (the last ones without
        validation).
      best_step: the step of those params (the number of steps taken before them).
      best_score: their validation score (mean NRMSE over output channels), or nan.
      steps: the steps taken (fewer than asked when early stopping fired).
      history: one dict per validation: ``step``, ``score``, ``rmse``, ``nrmse``, ``fit``.
      losses: the training loss of every step.
    """

    params: Params
    best_step: int
    best_score: float
    steps: int
    history: list[dict] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def fit_sysid(
    model: Any,
    params: Params,
    tx: optax.GradientTransformation,
    batches: Iterable[Mapping[str, ArrayLike]],
    *,
    steps: int,
    valid: Sequence[Mapping[str, ArrayLike]] | None = None,
    eval_every: int = 100,
    patience: int | None = None,
    seed: int = 0,
    noise: float = 0.0,
    bias: float = 0.0,
    loss: str = "mse",
    on_step: Callable[[int, float], None] | None = None,
    on_eval: Callable[[dict], None] | None = None,
) -> SysIdFit:
    """Trains with `make_sysid_step`, validating by free-run simulation; stops early.

    Every `eval_every` steps (and after the last) the whole validation recordings are
    simulated free-run (`evaluate_free_run`); the score is the mean NRMSE over output
    channels, the params of the best score are kept, and training stops after `patience`
    validations without improvement. Batches with ``'is_first'`` (TBPTT order) carry the
    state from one batch to the next; other batches start fresh.

    Args:
      model: a `SysIdModel`.
      params: initialized (locked) params.
      tx: the Optax transformation (e.g. Adam on `blox.train.flat_cosine_schedule`).
      batches: an iterable of ``{'u', 'y'[, 'is_first']}`` batches (at least `steps`).
      steps: the number of training steps.
      valid: validation recordings ``[{'u': [T, Cu], 'y': [T, Cy]}, ...]``.
      eval_every: steps between validations.
      patience: validations without improvement before stopping (``None``: never).
      seed: seeds the noise-injection keys.
      noise, bias, loss: see `sysid_loss`.
      on_step: called as ``on_step(step, loss)`` after every step (step from 1), e.g.
        to print ``step=<n> loss=<repr(loss)>``.
      on_eval: called with each history entry.

    Returns:
      A `SysIdFit`.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"fit_sysid: steps must be a positive int, got {steps!r}.")
    if isinstance(eval_every, bool) or not isinstance(eval_every, int) or eval_every < 1:
        raise ValueError(f"fit_sysid: eval_every must be a positive int, got {eval_every!r}.")
    step_fn = jax.jit(make_sysid_step(model, tx, noise=noise, bias=bias, loss=loss))
    simulator = make_simulator(model) if valid else None
    opt_state = tx.init(params.split()[0])
    base_key = jax.random.key(seed)
    result = SysIdFit(params=params, best_step=0, best_score=float("nan"), steps=0)
    best = np.inf
    waited = 0
    state = None
    it = iter(batches)
    for n in range(1, steps + 1):
        try:
            batch = next(it)
        except StopIteration:
            raise ValueError(
                f"fit_sysid: the batches ran out after {n - 1} of {steps} steps; repeat "
                "the pipeline (num_epochs=None) or ask for fewer steps."
            ) from None
        if "is_first" in batch:
            if state is None:
                state, _ = model.initial_state(params, jnp.asarray(batch["u"])[:, 0])
        else:
            state = None
        params, opt_state, state, metrics = step_fn(
            params, opt_state, state, dict(batch), jax.random.fold_in(base_key, n)
        )
        value = float(metrics["loss"])
        result.losses.append(value)
        result.steps = n
        if on_step is not None:
            on_step(n, value)
        if not valid or (n % eval_every and n != steps):
            continue
        scores, _ = evaluate_free_run(model, params, valid, simulator=simulator)
        score = float(np.mean(scores["nrmse"]))
        entry = {"step": n, "score": score, **{k: v.tolist() for k, v in scores.items()}}
        result.history.append(entry)
        if on_eval is not None:
            on_eval(entry)
        if score < best:
            best, waited = score, 0
            result.params, result.best_step, result.best_score = copy.copy(params), n, score
        else:
            waited += 1
            if patience is not None and waited >= patience:
                break
    if not valid:
        result.params, result.best_step = params, result.steps
    return result
