"""Training recipes: the sequence loss (n_skip, TBPTT resets), noise and bias injection,
the TBPTT train step, and a training loop with early stopping on free-run validation."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from blox.core import Params, format_path
from blox.train import flat_cosine_schedule, make_train_step
from blox.train._logging import _require
from blox.ts._evaluate import evaluate_free_run, make_simulator

__all__ = ["SYSID_RECIPE", "SysIdFit", "fit_sysid", "inject_noise", "make_sysid_step",
           "sysid_loss"]  # fmt: skip

_LOSSES = ("mse", "mae")
_SELECT = ("best", "final")


class _Recipe(Mapping):
    """blox's system-identification recipe: the settings `fit_sysid` uses for those the
    caller leaves out, as a read-only mapping (see `SYSID_RECIPE`)."""

    def __init__(self, values: Mapping[str, Any]) -> None:
        self._settings = MappingProxyType(dict(values))

    def __getitem__(self, key: str) -> Any:
        return self._settings[key]

    def __iter__(self):
        return iter(self._settings)

    def __len__(self) -> int:
        return len(self._settings)

    def __repr__(self) -> str:
        return f"SYSID_RECIPE({dict(self._settings)!r})"


SYSID_RECIPE: Mapping[str, Any] = _Recipe(
    {"lr": 1e-2, "pct_start": 0.5, "clip": 0.0, "loss": "mae", "noise": 0.02, "select": "best"}
)
"""blox's system-identification recipe: what `fit_sysid` uses for each setting the
caller leaves out (a read-only mapping).

``lr``: Adam's peak learning rate; ``pct_start``: the flat fraction of
`blox.train.flat_cosine_schedule` over the whole budget; ``clip``: the global gradient
norm (0: none); ``loss``: `sysid_loss`'s ``'mse'`` or ``'mae'`` in normalized units;
``noise``: the input noise level of `inject_noise`; ``select``: ``'best'`` (the best
free-run validation's params) or ``'final'``. docs/sysid.md gives the ablation behind
each value.

Example::

    >>> from blox.ts import SYSID_RECIPE
    >>> SYSID_RECIPE["lr"], SYSID_RECIPE["loss"]
    (0.01, 'mae')
"""


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
      params: the params `fit_sysid`'s ``select`` chose: by default those with the best
        validation score (the last ones without validation).
      best_step: the step of those params (the number of steps taken before them).
      best_score: their validation score (mean NRMSE over output channels), or nan.
      steps: the steps taken (fewer than asked when early stopping fired).
      history: one dict per validation: ``step``, ``score``, ``rmse``, ``nrmse``, ``fit``
        (and ``epoch``, numbered from 1, when trained by epochs).
      losses: the training loss of every step.
      final_params: the params after the last step taken (whatever their validation
        score): the model a fixed-budget recipe without model selection would keep.
      best_params: the params with the best validation score (the last ones without
        validation), whatever ``select`` chose.
      compile_s: wall time of the first step, waited for (trace, compile, one step).
      train_s: wall time of the other steps (batches drawn, steps run, params ready),
        validation excluded.
      eval_s: wall time of the validations.
      steps_per_s: ``(steps - 1) / train_s`` (nan with a single step).
    """

    params: Params
    best_step: int
    best_score: float
    steps: int
    history: list[dict] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    final_params: Params | None = None
    best_params: Params | None = None
    compile_s: float = float("nan")
    train_s: float = 0.0
    eval_s: float = 0.0
    steps_per_s: float = float("nan")


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
        raise ValueError(f"fit_sysid: {name} must be a positive int, got {value!r}.")
    return int(value)


def _budget(
    steps: int | None, epochs: int | None, batches_per_epoch: int | None
) -> tuple[int, int | None]:
    """``(total steps, batches per epoch or None)`` from either budget form."""
    if steps is not None:
        if epochs is not None or batches_per_epoch is not None:
            raise ValueError(
                f"fit_sysid: give either steps={steps!r} or epochs= with batches_per_epoch=, "
                f"not both (got epochs={epochs!r}, batches_per_epoch={batches_per_epoch!r})."
            )
        return _positive_int("steps", steps), None
    if epochs is None or batches_per_epoch is None:
        raise ValueError(
            "fit_sysid: give the budget as steps=N, or as epochs=E with batches_per_epoch=B "
            f"(E * B steps); got epochs={epochs!r}, batches_per_epoch={batches_per_epoch!r}."
        )
    e = _positive_int("epochs", epochs)
    b = _positive_int("batches_per_epoch", batches_per_epoch)
    return e * b, b


class _Clock:
    """Wall time of the training steps, validation and the first (compiling) step apart."""

    def __init__(self) -> None:
        self.compile_s = float("nan")
        self.train_s = self.eval_s = 0.0
        self.start: float | None = None

    def stop(self, params: Params) -> None:
        """Ends a segment of training steps once their params are ready."""
        if self.start is not None:
            jax.block_until_ready(params)
            self.train_s += time.perf_counter() - self.start
            self.start = None


def _recipe_tx(
    total: int, lr: float | None, clip: float | None, pct_start: float | None
) -> optax.GradientTransformation:
    """The recipe's optimizer: Adam on `flat_cosine_schedule`, after global-norm clipping."""
    lr = SYSID_RECIPE["lr"] if lr is None else lr
    clip = SYSID_RECIPE["clip"] if clip is None else clip
    pct_start = SYSID_RECIPE["pct_start"] if pct_start is None else pct_start
    for name, value in (("lr", lr), ("clip", clip), ("pct_start", pct_start)):
        if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
            raise TypeError(f"fit_sysid: {name} must be a number, got {value!r}.")
    if not lr > 0:
        raise ValueError(f"fit_sysid: lr must be > 0, got {lr!r}.")
    if not clip >= 0:
        raise ValueError(f"fit_sysid: clip must be >= 0 (0: no clipping), got {clip!r}.")
    if not 0.0 <= pct_start <= 1.0:
        raise ValueError(f"fit_sysid: pct_start must be in [0, 1], got {pct_start!r}.")
    adam = optax.adam(flat_cosine_schedule(float(lr), total, pct_start=float(pct_start)))
    return adam if clip == 0 else optax.chain(optax.clip_by_global_norm(float(clip)), adam)


def _check_batches_arg(batches: Any) -> None:
    """Refuses an Optax transformation where `fit_sysid` takes its batches (the old
    positional ``tx``)."""
    if isinstance(batches, optax.GradientTransformation):
        raise TypeError(
            "fit_sysid(model, params, batches, *, tx=None, ...): the third argument is the "
            "batch iterable and got an Optax transformation; pass the optimizer as tx=... "
            "(or leave it out for the recipe's)."
        )


def _recipe_choices(loss: str | None, noise: float | None, select: str | None):
    """``(loss, noise, select)``: the given ones, the recipe's for those left out."""
    loss = SYSID_RECIPE["loss"] if loss is None else loss
    noise = SYSID_RECIPE["noise"] if noise is None else noise
    select = SYSID_RECIPE["select"] if select is None else select
    if loss not in _LOSSES:
        raise ValueError(f"fit_sysid: loss must be one of {_LOSSES}, got {loss!r}.")
    if select not in _SELECT:
        raise ValueError(f"fit_sysid: select must be one of {_SELECT}, got {select!r}.")
    return loss, noise, select


def _fit_schedule(steps, epochs, batches_per_epoch, tx, lr, clip, pct_start, eval_every,
                  log_every, patience):  # fmt: skip
    """``(total steps, steps per epoch or None, optimizer, eval_every, log_every,
    patience)``, checked; the recipe's optimizer when `tx` is None."""
    if tx is not None and (lr, clip, pct_start) != (None, None, None):
        raise ValueError(
            f"fit_sysid: tx= replaces the recipe's optimizer; lr={lr!r}, clip={clip!r}, "
            f"pct_start={pct_start!r} shape only the recipe's: give tx or those, not both."
        )
    total, per_epoch = _budget(steps, epochs, batches_per_epoch)
    if tx is None:
        tx = _recipe_tx(total, lr, clip, pct_start)
    if eval_every is None:
        eval_every = per_epoch if per_epoch is not None else 100
    eval_every = _positive_int("eval_every", eval_every)
    log_every = _positive_int("log_every", log_every)
    if patience is not None:
        patience = _positive_int("patience", patience)
    return total, per_epoch, tx, eval_every, log_every, patience


def _check_valid(model: Any, valid: Sequence[Mapping[str, ArrayLike]]) -> None:
    """Refuses validation recordings that cannot be scored, before any training: one no
    longer than the warm-up, NaN or inf in ``u`` or ``y``, a constant output channel."""
    n_skip = int(model.n_skip)
    scored = []
    for i, rec in enumerate(valid):
        if not isinstance(rec, Mapping) or "u" not in rec or "y" not in rec:
            got = sorted(rec) if isinstance(rec, Mapping) else type(rec).__name__
            raise ValueError(
                f"fit_sysid: validation recording {i} must be a dict {{'u': [T, Cu], 'y': "
                f"[T, Cy]}}, got {got} (e.g. blox.ts.read_recordings(files))."
            )
        u, y = np.asarray(rec["u"]), np.asarray(rec["y"])
        t = u.shape[0] if u.ndim else 0
        if t <= n_skip:
            raise ValueError(
                f"fit_sysid: validation recording {i} has {t} time steps, no more than the "
                f"model's n_skip={n_skip} warm-up steps, so none of it is scored. Use "
                f"recordings longer than {n_skip} steps, leave this one out, or build the "
                "model with a smaller n_skip."
            )
        for name, x in (("u", u), ("y", y)):
            if x.dtype.kind not in "fc":
                continue
            ok = np.isfinite(x)
            if not ok.all():
                where = np.unravel_index(int(np.argmin(ok)), x.shape)
                chan = f", channel {int(where[1])}" if x.ndim > 1 else ""
                raise ValueError(
                    f"fit_sysid: validation recording {i}: {name!r} holds {x[where]} at time "
                    f"step {int(where[0])}{chan} (the first of {int(ok.size - ok.sum())} "
                    "non-finite values), so every free-run score would be nan. Fix or cut "
                    "that part of the recording, or leave it out of valid=."
                )
        scored.append(np.asarray(y, np.float64).reshape(t, -1)[n_skip:])
    if scored:
        std = np.concatenate(scored).std(axis=0)
        flat = np.flatnonzero(std == 0)
        if flat.size:
            raise ValueError(
                f"fit_sysid: output channels {flat.tolist()} are constant over the scored "
                f"steps (after n_skip={n_skip}) of every validation recording, so their "
                "NRMSE (the error over the output's std) is undefined (nan) and the score "
                "cannot rank params. Validate on recordings where every output moves."
            )


def _not_finite(params: Params) -> str | None:
    """The path of the first trainable param holding NaN or inf, or None."""
    for path, value in params.split()[0].arrays().items():
        if not bool(jnp.all(jnp.isfinite(value))):
            return format_path(path)
    return None


def _diverged(n: int, score: float, params: Params, sims: Sequence[np.ndarray],
              best_step: int, best: float) -> ValueError:  # fmt: skip
    """The error for a validation score that is not finite: why, and what to do."""
    before = (
        f"The best validation before it was at step {best_step} (score {best:.4g})."
        if np.isfinite(best)
        else "No validation before it scored."
    )
    path = _not_finite(params)
    if path is not None:
        why = (
            f"training diverged: the params after step {n} hold NaN or inf (the first: "
            f"'{path}'). Lower lr (or the peak of your tx), clip the gradients (clip=1.0), "
            "and check the training data (blox.data.channel_stats names NaN or inf)."
        )
    else:
        i, rec = next(
            ((i, x) for i, x in enumerate(sims) if not np.isfinite(x).all()), (0, sims[0])
        )
        t = int(np.argmin(np.isfinite(rec).all(axis=-1))) if rec.ndim > 1 else 0
        why = (
            f"the params are finite, but the free run of validation recording {i} turns "
            f"NaN or inf at time step {t}: the model's simulation blows up (e.g. an input "
            "far outside the training range, or an autoregressive model feeding back "
            "growing predictions). Check that recording's input, lower lr, or clip=1.0."
        )
    return ValueError(
        f"fit_sysid: the free-run validation after step {n} scored {score} (not a finite "
        f"number), so it cannot choose params: {why} {before} fit_sysid raises rather than "
        "return params chosen without a valid score."
    )


def _read_losses(pending: list[jax.Array]) -> list[float]:
    """The step losses held on the device, read back in one transfer."""
    if not pending:
        return []
    return [float(v) for v in np.asarray(jax.device_get(pending)).reshape(-1)]


def fit_sysid(
    model: Any,
    params: Params,
    batches: Iterable[Mapping[str, ArrayLike]],
    *,
    steps: int | None = None,
    epochs: int | None = None,
    batches_per_epoch: int | None = None,
    valid: Sequence[Mapping[str, ArrayLike]] | None = None,
    tx: optax.GradientTransformation | None = None,
    lr: float | None = None,
    clip: float | None = None,
    pct_start: float | None = None,
    loss: str | None = None,
    noise: float | None = None,
    bias: float = 0.0,
    select: str | None = None,
    eval_every: int | None = None,
    patience: int | None = None,
    seed: int = 0,
    on_step: Callable[[int, float], None] | None = None,
    on_eval: Callable[[dict], None] | None = None,
    progress: bool = False,
    log_every: int = 50,
) -> SysIdFit:
    """The system-identification recipe in one call: trains with `make_sysid_step`,
    validating by free-run simulation, and returns the chosen params.

    Every recipe setting left out (``None``) is blox's default, `SYSID_RECIPE`
    (docs/sysid.md says which ablation chose each): Adam at ``lr`` on
    `blox.train.flat_cosine_schedule` (flat for ``pct_start`` of the steps, then cosine
    decay) over the whole budget, after ``optax.clip_by_global_norm(clip)`` when
    ``clip > 0`` (the recipe does not clip); the
    ``loss`` (`sysid_loss`, normalized units), input ``noise`` (`inject_noise`), and
    which params `SysIdFit.params` holds (``select``: the best validation's, or the
    final ones). ``tx=`` replaces the whole optimizer (then `lr`, `clip` and `pct_start`
    must be left out).

    The budget is `steps`, or `epochs` of `batches_per_epoch` batches each (``epochs *
    batches_per_epoch`` steps drawn from the one iterator `batches`, e.g. a pipeline
    with ``num_epochs=None``: TSFast's "10 epochs of 300 batches" is ``epochs=10,
    batches_per_epoch=300``). Every `eval_every` steps (default: each epoch's end when
    trained by epochs, else 100) and after the last step the whole validation
    recordings are simulated free-run (`evaluate_free_run`); the score is the mean NRMSE
    over output channels, the params of the best score are kept, and training stops
    after `patience` validations without improvement. A validation whose score is not
    finite (NaN or inf) raises a ``ValueError`` at once, naming the step and why
    (params that diverged, with the first non-finite param's path, or a free run that
    blows up, with the recording and time step) and the best validation before it:
    no params are chosen by such a score. The validation recordings are checked
    before training: each must be longer than ``model.n_skip`` and hold finite ``u``
    and ``y``, and no output channel may be constant over the scored steps (its NRMSE
    would be undefined). Batches with ``'is_first'``
    (TBPTT order) carry the state from one batch to the next; other batches start fresh.

    Timing (as `blox.train.fit`): the first step is waited for and timed alone
    (``compile_s``); ``train_s`` is the wall time of the other steps including drawing
    their batches, up to the params being ready, without validation; ``steps_per_s``
    follows from it. The loop syncs with the device only to validate, for `on_step`,
    and for the progress bar's loss (every `log_every` steps).

    Args:
      model: a `SysIdModel`.
      params: initialized (locked) params.
      batches: an iterable of ``{'u', 'y'[, 'is_first']}`` batches (at least as many as
        the budget's steps).
      steps: the number of training steps (or give `epochs` and `batches_per_epoch`).
      epochs: the number of epochs (with `batches_per_epoch`).
      batches_per_epoch: steps per epoch.
      valid: validation recordings ``[{'u': [T, Cu], 'y': [T, Cy]}, ...]``.
      tx: an Optax transformation replacing the recipe's optimizer.
      lr: Adam's peak learning rate (default ``SYSID_RECIPE['lr']``).
      clip: the global gradient norm clipped to (``0``: no clipping; default
        ``SYSID_RECIPE['clip']``).
      pct_start: the schedule's flat fraction, in ``[0, 1]`` (default
        ``SYSID_RECIPE['pct_start']``).
      loss: ``'mse'`` or ``'mae'`` (see `sysid_loss`; default ``SYSID_RECIPE['loss']``).
      noise: input noise level (see `inject_noise`; default ``SYSID_RECIPE['noise']``).
      bias: per-sequence input offset level (see `inject_noise`).
      select: ``'best'`` (the best validation's params; the final ones without
        validation) or ``'final'`` (the params after the last step), for
        `SysIdFit.params` (default ``SYSID_RECIPE['select']``).
      eval_every: steps between validations.
      patience: validations without improvement before stopping (``None``: never).
      seed: seeds the noise-injection keys.
      on_step: called as ``on_step(step, loss)`` after every step (step from 1), e.g.
        to print ``step=<n> loss=<repr(loss)>``.
      on_eval: called with each history entry.
      progress: show a tqdm progress bar on stderr (needs ``pip install 'blox[train]'``).
      log_every: steps between the bar's loss updates and the reads of the step losses
        back from the device (each one syncs; at most `log_every` losses wait there).

    Returns:
      A `SysIdFit`: ``params`` (the `select`-ed ones), ``best_params``,
      ``final_params``, the validation history, every step's loss and the timing.

    Raises:
      TypeError: an Optax transformation given where the batches go (the optimizer is
        the keyword ``tx=``), or a non-numeric `lr`, `clip` or `pct_start`.
      ValueError: a bad budget, `tx` with `lr`/`clip`/`pct_start`, an unknown `loss`
        or `select`, out-of-range settings, batches that run out, a validation
        recording no longer than ``model.n_skip``, with NaN or inf, or with a constant
        output channel (before training), or a validation score that is not finite.

    Example::

        fit = fit_sysid(model, params, iter(ds), epochs=10, batches_per_epoch=300,
                        valid=valid, progress=True)      # blox's recipe, nothing else
        print(fit.best_score, fit.steps_per_s)
        best, last = fit.params, fit.final_params
    """
    _check_batches_arg(batches)
    loss, noise, select = _recipe_choices(loss, noise, select)
    total, per_epoch, tx, eval_every, log_every, patience = _fit_schedule(
        steps, epochs, batches_per_epoch, tx, lr, clip, pct_start, eval_every, log_every, patience
    )
    if valid:
        _check_valid(model, valid)
    bar = _progress_bar(total) if progress else None
    step_fn = jax.jit(make_sysid_step(model, tx, noise=noise, bias=bias, loss=loss))
    result = SysIdFit(params=params, best_step=0, best_score=float("nan"), steps=0)
    clock = _Clock()
    log = _StepLog(result, log_every, on_step, bar)
    selection = None
    if valid:
        selection = _Selection(
            model,
            valid,
            result,
            clock,
            bar,
            per_epoch=per_epoch,
            patience=patience,
            on_eval=on_eval,
        )
    opt_state = tx.init(params.split()[0])
    base_key = jax.random.key(seed)
    state = None
    it = iter(batches)
    try:
        for n in range(1, total + 1):
            if n > 1 and clock.start is None:  # a segment of timed steps, batches included
                clock.start = time.perf_counter()
            if bar is not None and per_epoch is not None and (n - 1) % per_epoch == 0:
                bar.set_description(f"epoch {(n - 1) // per_epoch + 1}/{total // per_epoch}")
            batch = _next_batch(it, n, total)
            state = _carried_state(model, params, batch, state)
            t0 = time.perf_counter()
            params, opt_state, state, metrics = step_fn(
                params, opt_state, state, dict(batch), jax.random.fold_in(base_key, n)
            )
            if n == 1:
                jax.block_until_ready(params)
                clock.compile_s = time.perf_counter() - t0
            result.steps = n
            log.add(n, metrics["loss"])
            if selection is None or (n % eval_every and n != total):
                continue
            if selection.validate(n, params, metrics["loss"]):
                break  # patience ran out
    finally:
        if bar is not None:
            bar.close()
    clock.stop(params)
    log.flush()
    return _finish(result, params, clock, chosen_by_valid=bool(valid), select=select)


def _progress_bar(total: int) -> Any:
    """A tqdm bar over the `total` steps (tqdm comes with ``blox[train]``)."""
    return _require("tqdm", "fit_sysid(progress=True)").tqdm(
        total=total, desc="fit_sysid", unit="step", leave=False
    )


def _next_batch(it: Any, n: int, total: int) -> Mapping[str, ArrayLike]:
    """The batch of step `n`; batches that run out raise, naming the step."""
    try:
        return next(it)
    except StopIteration:
        raise ValueError(
            f"fit_sysid: the batches ran out after {n - 1} of {total} steps; repeat "
            "the pipeline (num_epochs=None) or ask for fewer steps."
        ) from None


def _carried_state(model: Any, params: Params, batch: Mapping[str, ArrayLike], state: Any) -> Any:
    """The recurrent state a step starts from: carried over in TBPTT order (batches with
    ``'is_first'``; a fresh one before the first), ``None`` (start fresh) otherwise."""
    if "is_first" not in batch:
        return None
    if state is None:
        state, _ = model.initial_state(params, jnp.asarray(batch["u"])[:, 0])
    return state


class _StepLog:
    """Each step's loss: kept on the device and read back into ``result.losses``
    `log_every` at a time (O(log_every) losses wait there, not O(steps)); passed to
    `on_step` and shown on the progress bar."""

    def __init__(self, result: SysIdFit, log_every: int, on_step, bar) -> None:
        self.result, self.log_every, self.on_step, self.bar = result, log_every, on_step, bar
        self.pending: list[jax.Array] = []  # losses not yet read back from the device

    def add(self, n: int, loss: jax.Array) -> None:
        """Records the loss of step `n`."""
        self.pending.append(loss)
        if len(self.pending) >= self.log_every:
            self.flush()
        if self.on_step is not None:
            self.on_step(n, float(loss))
        if self.bar is not None:
            self.bar.update(1)
            if n % self.log_every == 0:
                self.bar.set_postfix(loss=f"{float(loss):.4g}")

    def flush(self) -> None:
        """Reads the pending losses back, in one transfer."""
        self.result.losses.extend(_read_losses(self.pending))
        self.pending = []


class _Selection:
    """Model selection by free-run validation: scores the params, records each
    validation in ``result.history``, keeps the best params in `result`, and counts the
    validations without improvement against `patience`."""

    def __init__(
        self, model, valid, result: SysIdFit, clock: _Clock, bar, *, per_epoch, patience, on_eval
    ) -> None:
        self.model, self.valid, self.result, self.clock, self.bar = model, valid, result, clock, bar
        self.per_epoch, self.patience, self.on_eval = per_epoch, patience, on_eval
        self.simulator = make_simulator(model)
        self.best = np.inf
        self.waited = 0

    def validate(self, n: int, params: Params, loss: jax.Array) -> bool:
        """Validates the params after step `n`; returns whether to stop (patience ran
        out). A score that is not finite raises (see `_diverged`)."""
        result, clock = self.result, self.clock
        clock.stop(params)
        t0 = time.perf_counter()
        scores, sims = evaluate_free_run(self.model, params, self.valid, simulator=self.simulator)
        clock.eval_s += time.perf_counter() - t0
        score = float(np.mean(scores["nrmse"]))
        if not np.isfinite(score):
            raise _diverged(n, score, params, sims, result.best_step, self.best)
        entry = {"step": n, "score": score, **{k: v.tolist() for k, v in scores.items()}}
        if self.per_epoch is not None:
            entry["epoch"] = (n - 1) // self.per_epoch + 1
        result.history.append(entry)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{float(loss):.4g}", valid=f"{score:.4g}")
        if self.on_eval is not None:
            self.on_eval(entry)
        if score < self.best:
            self.best, self.waited = score, 0
            result.params, result.best_step, result.best_score = copy.copy(params), n, score
            return False
        self.waited += 1
        return self.patience is not None and self.waited >= self.patience


def _finish(
    result: SysIdFit, params: Params, clock: _Clock, *, chosen_by_valid: bool, select: str
) -> SysIdFit:
    """Fills in the final params, the timing, and the params `select` chose."""
    result.final_params = params
    result.compile_s, result.train_s, result.eval_s = clock.compile_s, clock.train_s, clock.eval_s
    if result.steps > 1 and clock.train_s > 0:
        result.steps_per_s = (result.steps - 1) / clock.train_s
    if not chosen_by_valid:
        result.params, result.best_step = params, result.steps
    result.best_params = result.params
    if select == "final":
        result.params = params
    return result
