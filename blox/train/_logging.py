"""`History` (the metrics `fit` returns), loggers (stdout, CSV, TensorBoard) and a plot.

Optional dependencies (``pip install 'blox[train]'``) are imported inside the functions
that need them: tensorboardX for `TensorBoardLogger`, matplotlib for `plot_history`.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import sys
from collections.abc import Sequence
from typing import Any, Protocol, TextIO

from blox.core._errors import BloxKeyError

__all__ = ["CSVLogger", "History", "Logger", "StdoutLogger", "TensorBoardLogger", "plot_history"]

_EXTRA = "pip install 'blox[train]'"


def _require(module: str, what: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"{what} needs the optional dependency '{module.split('.')[0]}', which is not "
            f"installed. Install the training extras: {_EXTRA}"
        ) from e


@dataclasses.dataclass
class History:
    """The metrics `fit` logged, as data: one row (a ``dict[str, float]``) per epoch.

    Every row has ``'epoch'`` (1-based) and ``'step'`` (optimizer steps done), plus
    ``'train/<name>'`` (the epoch mean of each metric the step returned), ``'eval/<name>'``
    (epochs that evaluated), ``'time/...'`` and ``'memory/...'`` entries.

    >>> h = History([{'epoch': 1, 'train/loss': 2.0}, {'epoch': 2, 'train/loss': 1.0}])
    >>> h['train/loss'], h.series('train/loss')
    ([2.0, 1.0], ([1, 2], [2.0, 1.0]))
    """

    rows: list[dict[str, float]] = dataclasses.field(default_factory=list)

    def keys(self) -> list[str]:
        """Every metric name logged, in first-logged order."""
        seen: dict[str, None] = {}
        for row in self.rows:
            seen.update(dict.fromkeys(row))
        return list(seen)

    def __getitem__(self, key: str) -> list[float]:
        """The values of `key`, over the rows that logged it."""
        if key not in self.keys():
            raise BloxKeyError(f"History has no metric {key!r}; logged: {self.keys()}.")
        return [row[key] for row in self.rows if key in row]

    def series(self, key: str, x: str = "epoch") -> tuple[list[float], list[float]]:
        """``(xs, ys)`` of `key` against `x` (``'epoch'`` or ``'step'``)."""
        self[key]  # raises a clear KeyError when missing
        rows = [row for row in self.rows if key in row]
        return [row[x] for row in rows], [row[key] for row in rows]

    def __len__(self) -> int:
        return len(self.rows)


class Logger(Protocol):
    """What `fit` calls: ``log(step, metrics)`` once per epoch row, ``close()`` at the end."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _fmt(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if 100 <= abs(v) < 1e9:
        return f"{v:.1f}"
    if v == 0 or 1e-3 <= abs(v) < 100:
        return f"{v:.4f}"
    return f"{v:.4g}"


class StdoutLogger:
    """Prints one line per row: ``epoch 3 step 24 | train/loss 0.1234 | eval/loss ...``.

    Args:
      stream: where to write (default ``sys.stdout``, looked up at each write).
      keys: only these metrics (default: all).
    """

    def __init__(self, stream: TextIO | None = None, keys: Sequence[str] | None = None):
        self.stream = stream
        self.keys = None if keys is None else list(keys)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Writes one line."""
        parts = [f"epoch {metrics.get('epoch', '?')} step {step}"]
        for k, v in metrics.items():
            if k in ("epoch", "step") or (self.keys is not None and k not in self.keys):
                continue
            parts.append(f"{k} {_fmt(v)}")
        print(" | ".join(parts), file=self.stream or sys.stdout, flush=True)

    def close(self) -> None:
        """Nothing to release."""


class CSVLogger:
    """Writes all rows to a CSV file, one column per metric (union of all rows' keys).

    The file is rewritten at each row (rows are per epoch, so this is cheap; it goes to a
    temporary file first, so the CSV is complete after every row), so columns that appear
    later (e.g. the first evaluation) get a header and earlier rows an empty cell.

    A run resumed by `blox.ckpt.CheckpointCallback` continues its CSV with
    ``append=True``: the rows already in the file are kept and the new rows follow.
    The file's rows from the first logged epoch on (by ``'epoch'``, else by ``'step'``)
    are dropped, since the resumed run logs those epochs again (a checkpoint older than
    the last row). The first new row must fit the file's header: its columns a subset of
    the header (an epoch without evaluation) or a superset (the first evaluation after
    resuming, a new column); a row and a header that each have a column the other lacks
    mean another run's file, and raise. Without the file, ``append=True`` starts it.

    Args:
      path: the ``.csv`` file (its folder is created).
      append: keep the rows of an existing file at `path` (default False: the file is
        overwritten by this run's rows).

    Example::

        logger = bx.CSVLogger('runs/a/metrics.csv', append=True)  # same line on resume
        bx.fit(step, params, opt_state, batches, epochs=10, loggers=[logger],
               callbacks=[bx.ckpt.CheckpointCallback(mngr)])
    """

    def __init__(self, path: str | os.PathLike, *, append: bool = False):
        if not isinstance(append, bool):
            raise TypeError(f"CSVLogger: append must be a bool, got {append!r}.")
        self.path = os.fspath(path)
        self.append = append
        self.rows: list[dict[str, Any]] = []
        # The existing file's header: the column order kept, and checked by the first row.
        self._header: list[str] = []
        self._check_first = False
        if append and os.path.isfile(self.path):
            self._header, self.rows = self._read()
            self._check_first = bool(self._header)

    def _read(self) -> tuple[list[str], list[dict[str, Any]]]:
        with open(self.path, newline="") as f:
            reader = csv.DictReader(f)
            header = reader.fieldnames
            rows = list(reader)
        if header is None:  # an empty file
            return [], []
        for i, row in enumerate(rows):
            if None in row or None in row.values():
                raise ValueError(
                    f"CSVLogger: '{self.path}' line {i + 2} does not have the "
                    f"{len(header)} cells of its header {list(header)}, so it is not a CSV "
                    "this logger wrote. Pass another path, or append=False to overwrite it."
                )
        return list(header), rows

    def _continue(self, row: dict[str, Any]) -> None:
        """Checks the first new row against the file's header; drops the rows it redoes."""
        self._check_first = False
        new, old = set(row), set(self._header)
        if not (new <= old or old <= new):
            raise ValueError(
                f"CSVLogger: '{self.path}' has the columns {self._header}, but this run logs "
                f"{list(row)}: {sorted(new - old)} are not in the file and "
                f"{sorted(old - new)} are only in the file, so it holds another run's "
                "metrics. append=True continues the CSV of the same run (resumed); write "
                "this run to another path, or pass append=False to overwrite the file."
            )
        key = "epoch" if "epoch" in new and "epoch" in old else "step"

        def before(r: dict[str, Any]) -> bool:
            try:
                return float(r[key]) < float(row[key])
            except (TypeError, ValueError):
                return True  # an empty or non-numeric cell: kept

        self.rows = [r for r in self.rows if before(r)]

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Adds a row and rewrites the file."""
        row = {"step": step, **metrics}
        if self._check_first:
            self._continue(row)
        self.rows.append(row)
        keys: dict[str, None] = dict.fromkeys(self._header)
        for r in self.rows:
            keys.update(dict.fromkeys(r))
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(keys))
            w.writeheader()
            w.writerows(self.rows)
        os.replace(tmp, self.path)

    def close(self) -> None:
        """Nothing to release (the file is complete after every row)."""


class TensorBoardLogger:
    """Writes every metric as a TensorBoard scalar (``tensorboardX.SummaryWriter``), with
    the optimizer step as the x axis and the metric name (``'train/loss'``) as the tag.

    Needs ``tensorboardX`` (``pip install 'blox[train]'``).

    Args:
      logdir: the run's folder (``tensorboard --logdir`` its parent).
    """

    def __init__(self, logdir: str | os.PathLike):
        tbx = _require("tensorboardX", "TensorBoardLogger")
        self.logdir = os.fspath(logdir)
        self.writer = tbx.SummaryWriter(self.logdir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Adds one scalar per metric at `step` and flushes."""
        for k, v in metrics.items():
            if k in ("epoch", "step") or math.isnan(float(v)):
                continue
            self.writer.add_scalar(k, float(v), step)
        self.writer.flush()

    def close(self) -> None:
        """Closes the event file."""
        self.writer.close()


def plot_history(
    history: History,
    keys: Sequence[str] | None = None,
    *,
    path: str | os.PathLike | None = None,
    x: str = "epoch",
    logy: bool = False,
) -> Any:
    """Plots metrics of a `History` against epochs (or steps), one panel per metric name.

    ``'train/loss'`` and ``'eval/loss'`` share the ``loss`` panel. Uses matplotlib's Agg
    canvas directly (no ``pyplot``, no global backend change, no window), so it runs
    headless. Needs matplotlib (``pip install 'blox[train]'``).

    Args:
      history: what `fit` returned (``result.history``).
      keys: the metrics to plot (default: every ``train/`` and ``eval/`` metric).
      path: save the figure there (PNG by extension); the folder is created.
      x: ``'epoch'`` or ``'step'``.
      logy: logarithmic y axis.

    Returns:
      The ``matplotlib.figure.Figure``.
    """
    figure = _require("matplotlib.figure", "plot_history")
    backend_agg = _require("matplotlib.backends.backend_agg", "plot_history")
    if keys is None:
        keys = [k for k in history.keys() if k.startswith(("train/", "eval/"))]
    keys = list(keys)
    if not keys:
        raise ValueError(
            f"plot_history: nothing to plot; the history logged {history.keys()}. Pass keys=."
        )
    panels: dict[str, list[str]] = {}
    for k in keys:
        history[k]  # clear KeyError for a missing metric
        panels.setdefault(k.split("/", 1)[-1], []).append(k)
    n = len(panels)
    fig = figure.Figure(figsize=(4.5 * n, 3.2), layout="constrained")
    backend_agg.FigureCanvasAgg(fig)
    axes = fig.subplots(1, n, squeeze=False)[0]
    for ax, (name, ks) in zip(axes, panels.items(), strict=True):
        for k in ks:
            xs, ys = history.series(k, x)
            ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=k)
        ax.set_title(name)
        ax.set_xlabel(x)
        if logy:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend()
    if path is not None:
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=100)
    return fig
