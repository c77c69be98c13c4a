"""`ARX`: the linear baseline, fitted by least squares in NumPy."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from jax.typing import ArrayLike

__all__ = ["ARX", "fit_arx"]


def _as_2d(where: str, name: str, x: ArrayLike) -> np.ndarray:
    a = np.asarray(x, np.float64)
    if a.ndim == 1:
        a = a[:, None]
    if a.ndim != 2:
        raise ValueError(f"{where}: {name} must be [T] or [T, C], got shape {a.shape}.")
    return a


@dataclass(frozen=True)
class ARX:
    """A fitted multi-input multi-output ARX model (see `fit_arx`)::

        y[t] = sum_{i=1..na} y[t-i] @ A_i + sum_{j=0..nb-1} u[t-nk-j] @ B_j + c

    Attributes:
      na, nb, nk: output lags, input lags, input delay.
      theta: ``(na * Cy + nb * Cu + 1, Cy)`` coefficients, rows ordered
        ``[y[t-1], ..., y[t-na], u[t-nk], ..., u[t-nk-nb+1], 1]``.
    """

    na: int
    nb: int
    nk: int
    theta: np.ndarray

    @property
    def lag(self) -> int:
        """The number of past samples a prediction needs: ``max(na, nk + nb - 1)``."""
        return max(self.na, self.nk + self.nb - 1)

    def _split(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        cy = self.theta.shape[1]
        ay = self.theta[: self.na * cy].reshape(self.na, cy, cy)
        bu = self.theta[self.na * cy : -1].reshape(self.nb, -1, cy)
        return ay, bu, self.theta[-1]

    def predict(self, u: ArrayLike, y: ArrayLike) -> np.ndarray:
        """One-step-ahead predictions from measured ``u`` ``[T, Cu]`` and ``y``
        ``[T, Cy]``: ``[T, Cy]``, the first `lag` rows copied from ``y``."""
        u2, y2 = _as_2d("ARX.predict", "u", u), _as_2d("ARX.predict", "y", y)
        reg = _regressors(u2, y2, self.na, self.nb, self.nk)
        out = y2.copy()
        out[self.lag :] = reg @ self.theta
        return out

    def simulate(self, u: ArrayLike, y_init: ArrayLike | None = None) -> np.ndarray:
        """Free-run simulation: the model's own outputs fed back.

        Args:
          u: ``[T]`` or ``[T, Cu]`` input.
          y_init: ``[lag, Cy]`` (or ``[lag]``) measured outputs that start the
            recursion (the first `lag` samples); zeros when ``None``.

        Returns:
          ``[T, Cy]``: the first `lag` rows are `y_init`, the rest simulated.
        """
        u2 = _as_2d("ARX.simulate", "u", u)
        ay, bu, c = self._split()
        cy, lag = ay.shape[-1], self.lag
        out = np.zeros((u2.shape[0], cy))
        if y_init is not None:
            y0 = _as_2d("ARX.simulate", "y_init", y_init)
            if y0.shape != (lag, cy):
                raise ValueError(
                    f"ARX.simulate: y_init must be [lag, Cy] = ({lag}, {cy}) (lag = "
                    f"max(na, nk + nb - 1)), got {y0.shape}; pass y[:{lag}]."
                )
            out[:lag] = y0
        for t in range(lag, u2.shape[0]):
            acc = c.copy()
            for i in range(self.na):
                acc += out[t - 1 - i] @ ay[i]
            for j in range(self.nb):
                acc += u2[t - self.nk - j] @ bu[j]
            out[t] = acc
        return out


def _regressors(u: np.ndarray, y: np.ndarray, na: int, nb: int, nk: int) -> np.ndarray:
    """``[T - lag, na * Cy + nb * Cu + 1]`` regressor rows for t = lag .. T - 1."""
    t_len = y.shape[0]
    lag = max(na, nk + nb - 1)
    cols = [y[lag - i : t_len - i] for i in range(1, na + 1)]
    cols += [u[lag - nk - j : t_len - nk - j] for j in range(nb)]
    cols.append(np.ones((t_len - lag, 1)))
    return np.concatenate(cols, axis=1)


def fit_arx(
    u: ArrayLike | Sequence[ArrayLike],
    y: ArrayLike | Sequence[ArrayLike],
    *,
    na: int,
    nb: int,
    nk: int = 1,
) -> ARX:
    """Fits an `ARX` model by linear least squares (``np.linalg.lstsq``) on one or more
    recordings (the regressors of every recording stacked; none spans two recordings).

    Args:
      u: ``[T, Cu]`` (or ``[T]``) input, or a list of them.
      y: the matching ``[T, Cy]`` outputs.
      na: number of past outputs (>= 0).
      nb: number of inputs (>= 1).
      nk: input delay in samples (>= 0; 1: ``y[t]`` depends on ``u[t-1]`` and older).

    Returns:
      The fitted `ARX`.

    >>> import numpy as np
    >>> u = np.random.default_rng(0).normal(size=200)
    >>> y = np.zeros(200)
    >>> for t in range(1, 200):
    ...     y[t] = 0.5 * y[t - 1] + 2.0 * u[t - 1]
    >>> np.round(fit_arx(u, y, na=1, nb=1).theta[:, 0], 6)
    array([0.5, 2. , 0. ])
    """
    where = "fit_arx"
    for name, v, low in (("na", na, 0), ("nb", nb, 1), ("nk", nk, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{where}: {name} must be an int >= {low}, got {v!r}.")
    us = list(u) if isinstance(u, list | tuple) else [u]
    ys = list(y) if isinstance(y, list | tuple) else [y]
    if len(us) != len(ys):
        raise ValueError(f"{where}: got {len(us)} input and {len(ys)} output recordings.")
    lag = max(na, nk + nb - 1)
    rows, targets = [], []
    for k, (ui, yi) in enumerate(zip(us, ys, strict=True)):
        u2, y2 = _as_2d(where, f"u[{k}]", ui), _as_2d(where, f"y[{k}]", yi)
        if u2.shape[0] != y2.shape[0]:
            raise ValueError(
                f"{where}: recording {k} has {u2.shape[0]} input and {y2.shape[0]} output "
                "samples; u and y must be sampled together."
            )
        if u2.shape[0] <= lag:
            raise ValueError(
                f"{where}: recording {k} has {u2.shape[0]} samples, not more than the lag "
                f"max(na, nk + nb - 1) = {lag}; use longer recordings or fewer lags."
            )
        rows.append(_regressors(u2, y2, na, nb, nk))
        targets.append(y2[lag:])
    theta, *_ = np.linalg.lstsq(np.concatenate(rows), np.concatenate(targets), rcond=None)
    return ARX(na=na, nb=nb, nk=nk, theta=theta)
