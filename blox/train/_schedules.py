"""Learning-rate schedules as Optax schedules (``step -> value``).

Both are written with explicit casts (the step count is cast to float32), so they also
run under ``jax_numpy_dtype_promotion='strict'``, where Optax's own schedules fail on
the int32 step count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

__all__ = ["flat_cosine_schedule", "warmup_cosine_schedule"]


def _check_steps(where: str, total_steps: int) -> int:
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
        raise ValueError(f"{where}: total_steps must be a positive int, got {total_steps!r}.")
    return total_steps


def flat_cosine_schedule(
    peak_value: float, total_steps: int, *, pct_start: float = 0.75, div_final: float = 1e5
) -> optax.Schedule:
    """Flat, then cosine annealing: fastai's ``fit_flat_cos`` (seed 000) as an Optax schedule.

    ``value(t) = peak_value`` for ``t < flat = round(pct_start * total_steps)``; then, with
    ``p = (t - flat) / (total_steps - flat)``, ``value = end + (peak - end) * (1 + cos(pi p))
    / 2`` down to ``end = peak_value / div_final`` at ``t = total_steps`` (and after).

    Args:
      peak_value: the flat learning rate.
      total_steps: the length of training in optimizer steps.
      pct_start: the fraction of steps at the flat value, in ``[0, 1]``.
      div_final: ``peak_value / end_value`` (>= 1).

    >>> sched = flat_cosine_schedule(1.0, 100, pct_start=0.5, div_final=1e5)
    >>> [round(float(sched(t)), 6) for t in (0, 50, 75, 100)]
    [1.0, 1.0, 0.500005, 1e-05]
    """
    total_steps = _check_steps("flat_cosine_schedule", total_steps)
    if not 0.0 <= pct_start <= 1.0:
        raise ValueError(f"flat_cosine_schedule: pct_start must be in [0, 1], got {pct_start}.")
    if not div_final >= 1.0:
        raise ValueError(f"flat_cosine_schedule: div_final must be >= 1, got {div_final}.")
    flat = int(round(pct_start * total_steps))
    decay = max(total_steps - flat, 1)
    peak, end = float(peak_value), float(peak_value) / float(div_final)

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        t = jnp.asarray(count).astype(jnp.float32)
        p = jnp.clip((t - flat) / decay, 0.0, 1.0)
        return end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))

    return schedule


def warmup_cosine_schedule(
    peak_value: float,
    total_steps: int,
    *,
    warmup_steps: int,
    init_value: float = 0.0,
    end_value: float = 0.0,
) -> optax.Schedule:
    """Linear warm-up from `init_value` to `peak_value` over `warmup_steps`, then cosine
    decay to `end_value` at `total_steps` (the values of
    ``optax.warmup_cosine_decay_schedule(init_value, peak_value, warmup_steps,
    decay_steps=total_steps, end_value)``; `total_steps` counts the warm-up).

    >>> sched = warmup_cosine_schedule(1.0, 110, warmup_steps=10)
    >>> float(sched(5)), float(sched(10)), round(float(sched(60)), 4), float(sched(110))
    (0.5, 1.0, 0.5, 0.0)
    """
    total_steps = _check_steps("warmup_cosine_schedule", total_steps)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int):
        raise ValueError(
            f"warmup_cosine_schedule: warmup_steps must be an int, got {warmup_steps!r}."
        )
    if not 0 <= warmup_steps < total_steps:
        raise ValueError(
            f"warmup_cosine_schedule: warmup_steps={warmup_steps} must be in [0, total_steps="
            f"{total_steps}); total_steps counts the warm-up."
        )
    init, peak, end = float(init_value), float(peak_value), float(end_value)
    warm, decay = warmup_steps, total_steps - warmup_steps

    def schedule(count: jax.typing.ArrayLike) -> jax.Array:
        t = jnp.asarray(count).astype(jnp.float32)
        rise = init + (peak - init) * t / max(warm, 1)
        p = jnp.clip((t - warm) / decay, 0.0, 1.0)
        fall = end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))
        return jnp.where(t < warm, rise, fall)

    return schedule
