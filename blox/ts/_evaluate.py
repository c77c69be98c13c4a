"""Free-run evaluation: simulation over whole sequences, metrics per channel, plots."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.typing import ArrayLike

from blox.core import Params

__all__ = [
    "evaluate_free_run",
    "free_run",
    "make_simulator",
    "plot_simulation",
    "sysid_metrics",
]


def make_simulator(model: Any):
    """A jitted free-run simulator ``sim(params, u [B, T, Cu], y [B, T, Cy] | None) ->
    y_hat [B, T, Cy]``: ``model.simulate`` under ``jax.jit`` (its time loop is a
    ``lax.scan``; compiled once per shape). Build it once and reuse it (e.g. for every
    validation of a training run); `free_run` builds a fresh one per call."""
    return jax.jit(lambda params, u, y=None: model.simulate(params, u, y)[0])


def free_run(
    model: Any,
    params: Params,
    u: ArrayLike,
    y: ArrayLike | None = None,
    *,
    simulator: Any = None,
) -> jax.Array:
    """Free-run simulation of a whole sequence (``model.simulate``, jitted).

    Args:
      model: a `SysIdModel` (`RNNModel`, `TCN`, `CRNN`, `ARModel`, `EncoderModel`).
      params: its params.
      u: raw input ``[B, T, Cu]`` (or ``[T, Cu]``: one recording).
      y: measured output, read only where the model may (the `ARModel` warm-up, the
        `EncoderModel` window).
      simulator: a `make_simulator` result to reuse (default: a new one).

    Returns:
      ``y_hat`` with the batch shape of `u` and ``Cy`` channels.
    """
    u = np.asarray(u)
    one = u.ndim == 2
    if one:
        u = u[None]
        y = None if y is None else np.asarray(y)[None]
    sim = simulator if simulator is not None else make_simulator(model)
    y_hat = sim(params, u, y)
    return y_hat[0] if one else y_hat


def sysid_metrics(y_hat: ArrayLike, y: ArrayLike, *, n_skip: int = 0) -> dict[str, np.ndarray]:
    """RMSE, NRMSE and fit % per output channel, in float64 (NumPy).

    Over all batch rows and the time steps from `n_skip` on (``e = y_hat - y``)::

        rmse  = sqrt(mean(e^2))
        nrmse = rmse / std(y)                         # std of the measured output
        fit   = 100 (1 - ||e|| / ||y - mean(y)||)     # = 100 (1 - nrmse)

    Args:
      y_hat: simulated ``[..., T, C]``.
      y: measured ``[..., T, C]`` (same shape).
      n_skip: leading steps left out (warm-up).

    Returns:
      ``{'rmse': (C,), 'nrmse': (C,), 'fit': (C,)}``.

    >>> import numpy as np
    >>> y = np.array([[1.0], [-1.0], [1.0], [-1.0]])
    >>> {k: v.round(3).tolist() for k, v in sysid_metrics(0.5 * y, y).items()}
    {'rmse': [0.5], 'nrmse': [0.5], 'fit': [50.0]}
    """
    p, t = np.asarray(y_hat, np.float64), np.asarray(y, np.float64)
    if p.shape != t.shape or p.ndim < 2:
        raise ValueError(
            f"sysid_metrics: y_hat {p.shape} and y {t.shape} must have one shape [..., T, C]."
        )
    if isinstance(n_skip, bool) or not isinstance(n_skip, int) or not 0 <= n_skip < p.shape[-2]:
        raise ValueError(
            f"sysid_metrics: n_skip must be an int in [0, T) = [0, {p.shape[-2]}), got {n_skip!r}."
        )
    c = p.shape[-1]
    p, t = p[..., n_skip:, :].reshape(-1, c), t[..., n_skip:, :].reshape(-1, c)
    rmse = np.sqrt(np.mean((p - t) ** 2, axis=0))
    std = np.std(t, axis=0)
    nrmse = rmse / np.where(std > 0, std, np.nan)
    return {"rmse": rmse, "nrmse": nrmse, "fit": 100.0 * (1.0 - nrmse)}


def evaluate_free_run(
    model: Any,
    params: Params,
    recordings: Sequence[Mapping[str, ArrayLike]],
    *,
    n_skip: int | None = None,
    simulator: Any = None,
) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Free-run simulation of whole recordings and their metrics.

    Each recording ``{'u': [T, Cu], 'y': [T, Cy]}`` is simulated alone (lengths may
    differ) with `free_run`; the metrics (`sysid_metrics`) pool the errors of all
    recordings after `n_skip` steps of each (default ``model.n_skip``). Pass a
    `make_simulator` result as `simulator` to avoid compiling again.

    Returns:
      ``(metrics, simulations)``: the metrics dict and one ``[T, Cy]`` array per
      recording.

    Raises:
      ValueError: no recordings, or a recording no longer than `n_skip` (none of it
        would be scored), named by its index and length.
    """
    if not recordings:
        raise ValueError("evaluate_free_run: give at least one recording {'u': .., 'y': ..}.")
    n_skip = model.n_skip if n_skip is None else n_skip
    simulator = simulator if simulator is not None else make_simulator(model)
    for i, rec in enumerate(recordings):
        t = len(rec["u"])
        if t <= n_skip:
            raise ValueError(
                f"evaluate_free_run: recording {i} has {t} time steps, no more than "
                f"n_skip={n_skip}, so none of it is scored. Use recordings longer than "
                f"{n_skip} steps, leave it out, or pass a smaller n_skip."
            )
    sims, errs, targets = [], [], []
    for rec in recordings:
        sim = free_run(model, params, rec["u"], rec["y"], simulator=simulator)
        sim = np.asarray(sim, np.float64)
        y = np.asarray(rec["y"], np.float64).reshape(sim.shape)
        sims.append(sim)
        errs.append(sim[n_skip:])
        targets.append(y[n_skip:])
    metrics = sysid_metrics(np.concatenate(errs), np.concatenate(targets))
    return metrics, sims


def plot_simulation(
    path: str | os.PathLike,
    y: ArrayLike,
    y_hat: ArrayLike,
    *,
    fs: float = 1.0,
    n_skip: int = 0,
    title: str = "",
    others: Mapping[str, ArrayLike] | None = None,
) -> str:
    """Saves a PNG of measured vs simulated output (one panel per channel, plus the
    error) and returns the path. Needs matplotlib (the ``train`` extra).

    Args:
      path: the PNG to write.
      y: measured ``[T, C]`` (or ``[T]``).
      y_hat: simulated, the same shape.
      fs: sampling frequency (the time axis is in ``1 / fs`` units).
      n_skip: warm-up steps, shaded.
      title: the figure title.
      others: more simulations to draw in the error panel, e.g. ``{'ARX': y_arx}``.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is in the test extra
        raise ImportError("plot_simulation needs matplotlib: pip install 'blox[train]'.") from e
    yy = np.asarray(y, np.float64).reshape(len(y), -1)
    yh = np.asarray(y_hat, np.float64).reshape(yy.shape)
    t = np.arange(len(yy)) / fs
    c = yy.shape[1]
    fig, axes = plt.subplots(2 * c, 1, figsize=(10, 3.2 * c + 1), sharex=True, squeeze=False)
    for k in range(c):
        ax, ax_e = axes[2 * k, 0], axes[2 * k + 1, 0]
        ax.plot(t, yy[:, k], lw=0.6, label="measured")
        ax.plot(t, yh[:, k], lw=0.6, label="simulated", alpha=0.8)
        ax.set_ylabel(f"y[{k}]")
        ax.legend(loc="upper left", fontsize=8)
        ax_e.plot(t, yh[:, k] - yy[:, k], lw=0.6, label="model error")
        for name, other in (others or {}).items():
            o = np.asarray(other, np.float64).reshape(yy.shape)
            ax_e.plot(t, o[:, k] - yy[:, k], lw=0.6, label=f"{name} error", alpha=0.6)
        ax_e.set_ylabel("error")
        ax_e.legend(loc="upper left", fontsize=8)
        for a in (ax, ax_e):
            if n_skip:
                a.axvspan(t[0], t[min(n_skip, len(t) - 1)], color="0.9")
    axes[-1, 0].set_xlabel("time" if fs == 1.0 else "time [s]")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
