"""`fit`: an optional training loop *function* (no trainer object owns anything).

Epochs are numbered from 1 everywhere: `FitState.epoch`, the ``epoch`` of each `History`
row (so the CSV and TensorBoard logs), the progress bar, the stop message,
`EarlyStopping`'s ``best_epoch`` / ``stopped_epoch``, and the argument of a
``train_data(epoch)`` function.

Resuming: a callback may set ``state.step`` (with the params and optimizer state) in
``on_train_begin`` (``blox.ckpt.CheckpointCallback`` restores a checkpoint there); `fit`
then continues from that step: it skips the epochs already done and the done part of the
current one, and brings the data to the same position as an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blox.core import Params
from blox.core._guards import check_no_new_params, check_placement
from blox.train._logging import History, Logger, _require

__all__ = ["Callback", "EarlyStopping", "FitResult", "FitState", "fit"]


@dataclasses.dataclass
class FitState:
    """What callbacks see (and may change) during `fit`.

    Attributes:
      params, opt_state: the latest state (a callback may replace them).
      step: optimizer steps done so far. A callback that restores a checkpoint in
        ``on_train_begin`` sets it (with `params` and `opt_state`), and `fit` resumes
        from there (see `fit`).
      epoch: the current epoch, numbered from 1 like every epoch in `fit` (the history
        rows, the logs, the messages); 0 before the first epoch starts (in
        ``on_train_begin``). In ``on_epoch_end`` it is the number of epochs completed.
      history: the `History` so far (of this `fit` call).
      metrics: the last step's metrics (device arrays; converting them syncs).
      has_eval: whether `fit` was given an ``eval_fn``.
      stop_training: set it to ``True`` to stop after the current step.
      stop_reason: a short text saved in `FitResult.stopped`.
      stream: with ``steps_per_epoch``, the one iterator every batch is drawn from
        (``None`` otherwise); a callback may save and restore its position.
      stream_restored: set it to ``True`` in ``on_train_begin`` after restoring
        `stream`'s position along with ``step``; otherwise a resumed `fit` replays the
        stream, drawing and discarding the batches of the ``step`` steps already done.
      last_in_epoch: in ``on_step_end``, whether this step is the last of its epoch
        (known from ``steps_per_epoch`` or the length of the epoch's data; for data
        without a length, `fit` draws the next batch before the hooks run to find out).
    """

    params: Any
    opt_state: Any
    step: int = 0
    epoch: int = 0
    history: History = dataclasses.field(default_factory=History)
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    has_eval: bool = False
    stop_training: bool = False
    stop_reason: str | None = None
    stream: Iterator[Any] | None = None
    stream_restored: bool = False
    last_in_epoch: bool = False


class Callback:
    """Base class of `fit` hooks; override any of the methods (each gets the `FitState`).

    A plain function given in ``callbacks=`` is called as ``fn(state)`` at each epoch end.
    """

    def on_train_begin(self, state: FitState) -> None:
        """Before the first step; may restore a checkpoint (set ``params``,
        ``opt_state`` and ``step``) for `fit` to resume from."""

    def on_step_end(self, state: FitState) -> None:
        """After every step (keep it cheap: no device sync unless needed)."""

    def on_epoch_end(self, state: FitState) -> None:
        """After the epoch's row (train means, eval, timing) is in ``state.history``."""

    def on_train_end(self, state: FitState) -> None:
        """After the loop, also when stopped early or interrupted."""


class EarlyStopping(Callback):
    """Stops `fit` when `monitor` has not improved for `patience` evaluations.

    An improvement is ``value < best - min_delta`` (``mode='min'``) or ``value > best +
    min_delta`` (``mode='max'``). Training stops at the end of the epoch where the count
    of evaluations without improvement reaches `patience`. If the first row that could
    hold `monitor` does not (e.g. a typo, or ``'eval/...'`` without an ``eval_fn``),
    `fit` raises a `ValueError` listing the logged names.

    Args:
      monitor: a metric name as logged, e.g. ``'eval/loss'`` or ``'train/loss'``.
      patience: evaluations without improvement before stopping (>= 1).
      mode: ``'min'`` or ``'max'``.
      min_delta: the smallest change that counts as an improvement.
      restore_best: at the end, return the params of the best epoch (a copy is kept on
        device at each improvement).

    Attributes:
      best, best_epoch, stopped_epoch: filled during `fit` (epochs numbered from 1, as
        in the history rows and `FitState.epoch`).
    """

    def __init__(
        self,
        monitor: str = "eval/loss",
        patience: int = 5,
        *,
        mode: str = "min",
        min_delta: float = 0.0,
        restore_best: bool = False,
    ):
        if mode not in ("min", "max"):
            raise ValueError(f"EarlyStopping: mode must be 'min' or 'max', got {mode!r}.")
        if not isinstance(patience, int) or patience < 1:
            raise ValueError(f"EarlyStopping: patience must be an int >= 1, got {patience!r}.")
        self.monitor, self.patience, self.mode = monitor, patience, mode
        self.min_delta, self.restore_best = float(min_delta), restore_best
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.stopped_epoch: int | None = None
        self._wait = 0
        self._best_params: Any = None

    def on_train_begin(self, state: FitState) -> None:
        """Resets the counters; checks an ``eval/`` monitor has an ``eval_fn``."""
        self.best = self.best_epoch = self.stopped_epoch = None
        self._wait, self._best_params = 0, None
        if self.monitor.startswith("eval/") and not state.has_eval:
            raise ValueError(
                f"EarlyStopping(monitor={self.monitor!r}): fit has no eval_fn, so no 'eval/' "
                "metric is ever logged. Pass eval_fn=... to fit, or monitor a train metric "
                "such as 'train/loss'."
            )

    def on_epoch_end(self, state: FitState) -> None:
        """Compares the monitored value with the best so far."""
        row = state.history.rows[-1]
        if self.monitor not in row:
            could = any(k.startswith("eval/") for k in row) or not self.monitor.startswith("eval/")
            if could and self.best is None:
                names = [k for k in row if k not in ("epoch", "step")]
                raise ValueError(
                    f"EarlyStopping: monitor {self.monitor!r} is never logged by fit; the "
                    f"logged metrics are {names}. Use one of those names (train metrics are "
                    "'train/<key of the step's metrics>', eval metrics 'eval/<key of "
                    "eval_fn's dict>')."
                )
            return
        value = float(row[self.monitor])
        better = (
            self.best is None
            or (self.mode == "min" and value < self.best - self.min_delta)
            or (self.mode == "max" and value > self.best + self.min_delta)
        )
        if better:
            self.best, self.best_epoch, self._wait = value, int(row["epoch"]), 0
            if self.restore_best:
                self._best_params = jax.tree.map(lambda x: jnp.array(x, copy=True), state.params)
            return
        self._wait += 1
        if self._wait >= self.patience:
            self.stopped_epoch = int(row["epoch"])
            state.stop_training = True
            state.stop_reason = (
                f"early stopping: {self.monitor} did not improve for {self.patience} "
                f"evaluation(s) (best {self.best:.6g} at epoch {self.best_epoch})"
            )

    def on_train_end(self, state: FitState) -> None:
        """Restores the best params when asked."""
        if self.restore_best and self._best_params is not None:
            state.params = self._best_params


@dataclasses.dataclass
class FitResult:
    """What `fit` returns.

    Attributes:
      params, opt_state: the state after the last completed step (or the best params with
        ``EarlyStopping(restore_best=True)``).
      history: the `History` (one row per epoch).
      stopped: ``'completed'``, ``'interrupted'`` (Ctrl-C), ``'data exhausted'``, or the
        reason a callback gave (e.g. early stopping).
      steps: optimizer steps done.
    """

    params: Any
    opt_state: Any
    history: History
    stopped: str
    steps: int


def _memory() -> dict[str, float]:
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # some backends raise instead of returning None
        return {}
    if not stats:
        return {}
    out = {}
    for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
        if k in stats:
            out[f"memory/{k}"] = float(stats[k])
    return out


def _examples(batch: Any) -> int | None:
    leaves = jax.tree.leaves(batch)
    if not leaves or not np.shape(leaves[0]):
        return None
    return int(np.shape(leaves[0])[0])


def _to_row(prefix: str, metrics: dict[str, Any], where: str) -> dict[str, float]:
    if not isinstance(metrics, dict):
        raise TypeError(
            f"fit: {where} must return a dict of scalar metrics, got {type(metrics).__name__}. "
            "Return e.g. {'loss': loss}."
        )
    return {f"{prefix}/{k}": float(np.mean(np.asarray(v))) for k, v in metrics.items()}


def _mean_rows(step_metrics: list[dict[str, Any]]) -> dict[str, float]:
    if not step_metrics:
        return {}
    host = jax.device_get(step_metrics)
    keys = host[0].keys()
    return {
        f"train/{k}": float(np.mean([np.mean(np.asarray(m[k], np.float64)) for m in host]))
        for k in keys
    }


def fit(
    step: Callable[..., Any],
    params: Any,
    opt_state: Any,
    train_data: Iterable[Any] | Callable[[int], Iterable[Any]],
    *,
    epochs: int = 1,
    steps_per_epoch: int | None = None,
    eval_fn: Callable[[Any], dict[str, Any]] | None = None,
    eval_every: int = 1,
    callbacks: Sequence[Callback | Callable[[FitState], None]] = (),
    loggers: Sequence[Logger] = (),
    progress: bool = True,
    log_every: int = 50,
    examples_per_step: int | None = None,
) -> FitResult:
    """Runs ``params, opt_state, metrics = step(params, opt_state, *batch)`` over the data.

    A loop function for those who want one; it owns nothing and returns everything.
    `step` is typically ``jax.jit(bx.make_train_step(...), donate_argnums=(0, 1))``; a
    tuple batch is unpacked into its positional arguments, any other batch (a dict, an
    array) is passed as one argument. For a step with more state (a loss scale), wrap it
    so that ``opt_state`` is a tuple. A `steps_per_dispatch` step works too: each call
    counts as one step in ``state.step`` and ``time/steps_per_s`` (pass
    ``examples_per_step=k * B``), and its stacked metrics are averaged.

    Epochs are numbered from 1 everywhere (`FitState.epoch`, the rows' ``'epoch'``, the
    logs and messages, ``train_data(epoch)``). Per epoch: the steps (with a tqdm progress
    bar showing the loss every `log_every` steps), then one history row with the epoch
    means of the step's metrics (``train/<name>``), ``eval_fn(params)`` every
    `eval_every` epochs (``eval/<name>``), timing and device memory, then the loggers and
    the callbacks' ``on_epoch_end``.

    Timing: ``time/compile_s`` (first epoch only) is the wall time of the first step
    call, waited for: trace, compile and one step; it is excluded from the step timing.
    ``time/epoch_s`` is the time of the epoch's (other) steps up to the params being
    ready, without evaluation; ``time/steps_per_s`` and ``time/examples_per_s`` follow
    from it (examples per step: `examples_per_step`, else the leading axis of the batch's
    first leaf). ``memory/bytes_in_use`` and ``memory/peak_bytes_in_use`` come from
    ``device.memory_stats()`` where the backend reports them (not on CPU).

    Resuming: if a callback's ``on_train_begin`` sets ``state.step`` to ``s > 0`` (with
    the params and optimizer state of step ``s``; ``blox.ckpt.CheckpointCallback``
    restores the latest checkpoint so), `fit` continues at step ``s + 1`` as if it had run
    the first ``s`` steps: the epochs already done are skipped (``train_data(epoch)`` is
    still called for each, so a stateful reshuffle stays in step), the epoch of step ``s``
    restarts after its first batches, which are drawn and discarded, and with
    `steps_per_epoch` the stream is replayed by drawing ``s`` batches unless the callback
    restored its position (``state.stream_restored``). `epochs` stays the total number of
    epochs of the run. The history holds the rows of this call only; the first one is
    the resumed epoch, with the means of its remaining steps.

    Ctrl-C (``KeyboardInterrupt``, also when raised by a callback) stops cleanly: the
    result holds the params of the last completed step, the history so far, and
    ``stopped == 'interrupted'``; callbacks' ``on_train_end`` runs and loggers are
    closed. (If the interrupt lands while a step with donated buffers is being
    dispatched, the previous params may already be donated; interrupting during data
    loading, the common case, is safe.)

    Args:
      step: the train step (see above).
      params, opt_state: the initial state.
      train_data: an iterable of batches that can be iterated once per epoch (a list, a
        data loader), or a function ``epoch -> iterable`` (e.g. to reshuffle), called
        with ``epoch = 1, 2, ...``. With `steps_per_epoch`, batches are drawn from one
        iterator kept across epochs (for endless streams; a function is called once,
        with 1).
      epochs: the number of epochs.
      steps_per_epoch: steps per epoch (default: one pass over the data).
      eval_fn: ``params -> dict`` of scalar metrics (close over the eval data).
      eval_every: evaluate every this many epochs (and after the last one).
      callbacks: `Callback` objects, or functions called at each epoch end.
      loggers: e.g. `StdoutLogger`, `CSVLogger`, `TensorBoardLogger`.
      progress: show a tqdm progress bar (needs ``pip install 'blox[train]'``).
      log_every: update the bar's loss every this many steps (each update syncs).
      examples_per_step: examples per step for ``time/examples_per_s``.

    Returns:
      A `FitResult`.

    Raises:
      ValueError: `step` returns params with a path the params given to it lack (a
        layer first created in the loss: initialize the model and ``params.locked()``
        first; `make_train_step` raises this itself at trace time), or `params` /
        `opt_state` hold an array moved off a mesh with ``jax.device_put(x, device)``
        (move it with `blox.parallel.place`).
    """
    _check_fit_args(train_data, epochs, steps_per_epoch, eval_every, log_every)
    check_placement((params, opt_state), "fit")
    tqdm = _require("tqdm", "fit(progress=True)").tqdm if progress else None
    hooks = [cb if isinstance(cb, Callback) else _FunctionCallback(cb) for cb in callbacks]
    state = FitState(params, opt_state, has_eval=eval_fn is not None)
    run = _Run(
        step,
        state,
        train_data,
        hooks,
        num_epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        eval_fn=eval_fn,
        eval_every=eval_every,
        loggers=loggers,
        tqdm=tqdm,
        log_every=log_every,
        examples_per_step=examples_per_step,
    )
    try:
        for h in hooks:
            h.on_train_begin(state)
        stopped = run.epochs()
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        for lg in loggers:
            lg.close()
    for h in hooks:
        h.on_train_end(state)
    return FitResult(state.params, state.opt_state, state.history, stopped, state.step)


# ---------------------------------------------------------------------------
# The parts of `fit`, in the order they run: check the arguments, resume, then per
# epoch: its data, its steps, its history row.
# ---------------------------------------------------------------------------


def _check_fit_args(
    train_data: Any, epochs: int, steps_per_epoch: int | None, eval_every: int, log_every: int
) -> None:
    for name, v in (("epochs", epochs), ("eval_every", eval_every), ("log_every", log_every)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"fit: {name} must be a positive int, got {v!r}.")
    if steps_per_epoch is not None and (
        not isinstance(steps_per_epoch, int) or steps_per_epoch < 1
    ):
        raise ValueError(f"fit: steps_per_epoch must be a positive int, got {steps_per_epoch!r}.")
    if (
        steps_per_epoch is None
        and epochs > 1
        and not callable(train_data)
        and iter(train_data) is train_data
    ):
        raise ValueError(
            "fit: train_data is an iterator, which is exhausted after the first epoch, and "
            f"epochs={epochs}. Pass a list or another re-iterable, a function epoch -> "
            "iterable, or steps_per_epoch=N to draw N batches per epoch from one stream."
        )


@dataclasses.dataclass
class _Timing:
    """The timed steps of one epoch (all but the first step of the run)."""

    steps: int = 0
    examples: int = 0
    start: float | None = None
    elapsed: float | None = None

    def row(self) -> dict[str, float]:
        if self.elapsed is None or self.elapsed <= 0:
            return {}
        row = {"time/epoch_s": self.elapsed, "time/steps_per_s": self.steps / self.elapsed}
        if self.examples:
            row["time/examples_per_s"] = self.examples / self.elapsed
        return row


class _Run:
    """One `fit` call: its configuration (`fit`'s arguments) and what carries over
    between epochs."""

    def __init__(
        self,
        step: Callable[..., Any],
        state: FitState,
        train_data: Any,
        hooks: list[Callback],
        *,
        num_epochs: int,
        steps_per_epoch: int | None,
        eval_fn: Callable[[Any], dict[str, Any]] | None,
        eval_every: int,
        loggers: Sequence[Logger],
        tqdm: Any,
        log_every: int,
        examples_per_step: int | None,
    ):
        self.step, self.state, self.train_data, self.hooks = step, state, train_data, hooks
        self.num_epochs, self.steps_per_epoch = num_epochs, steps_per_epoch
        self.eval_fn, self.eval_every, self.loggers = eval_fn, eval_every, loggers
        self.tqdm, self.log_every, self.examples_per_step = tqdm, log_every, examples_per_step
        self.stream: Iterator[Any] | None = None
        if steps_per_epoch is not None:  # before on_train_begin: a callback may restore it
            self.stream = iter(train_data(1) if callable(train_data) else train_data)
            state.stream = self.stream
        self.compile_s: float | None = None  # the first step call of this fit, waited for
        self.compile_logged = False
        self.first_epoch = 1  # resuming: the epochs before it are done ...
        self.skip = 0  # ... and this many steps of the next one(s)

    # -- the loop --------------------------------------------------------------

    def epochs(self) -> str:
        """Runs the epochs; returns why they ended (`FitResult.stopped`)."""
        state = self.state
        self._resume()
        stopped = "completed"
        for epoch in range(1, self.num_epochs + 1):  # numbered from 1 everywhere
            data = self._epoch_data(epoch)
            if data is None:
                continue
            state.epoch = epoch
            step_metrics, timing = self._steps(epoch, *data)
            if not step_metrics:
                stopped = "data exhausted"
                break
            self._end_epoch(self._row(epoch, step_metrics, timing))
            if state.stop_training:
                break
        if state.stop_training:
            stopped = state.stop_reason or "stopped by a callback"
        return stopped

    def _resume(self) -> None:
        """Takes the step the callbacks set; with a stream, finds its epoch and replays
        the stream up to it unless a callback restored the stream's position."""
        state = self.state
        state.step = self.skip = _start_step(state.step)
        if self.stream is None or not self.skip:
            return
        self.first_epoch, self.skip = divmod(self.skip, self.steps_per_epoch)
        self.first_epoch += 1
        if not state.stream_restored and self.first_epoch <= self.num_epochs:
            for _ in _take(self.stream, state.step):
                pass

    def _epoch_data(self, epoch: int) -> tuple[Iterable[Any], int, int | None] | None:
        """``(batches, done, total)`` for `epoch`: the batches still to run, the steps
        of it already done, its length (if known); ``None`` for an epoch done in full."""
        if self.stream is not None:
            if epoch < self.first_epoch:
                return None
            done = self.skip if epoch == self.first_epoch else 0
            return _take(self.stream, self.steps_per_epoch - done), done, self.steps_per_epoch
        data = self.train_data
        batches = data(epoch) if callable(data) else data
        total = len(batches) if hasattr(batches, "__len__") else None
        if not self.skip:
            return batches, 0, total
        rest, drawn = _skip(batches, self.skip, total)  # resuming: skip the done steps
        if rest is None:  # the whole epoch was done
            self.skip -= drawn
            return None
        done, self.skip = self.skip, 0
        return rest, done, total

    # -- one epoch ---------------------------------------------------------------

    def _steps(
        self, epoch: int, batches: Iterable[Any], done: int, total: int | None
    ) -> tuple[list[dict[str, Any]], _Timing]:
        """Runs the epoch's steps; returns their metrics and timing."""
        state, timing = self.state, _Timing()
        bar = self._bar(epoch, done, total)
        step_metrics: list[dict[str, Any]] = []
        try:
            for batch, last_in_epoch in _mark_last(batches, done, total):
                self._timed_step(batch, timing)
                state.step += 1
                state.last_in_epoch = last_in_epoch
                step_metrics.append(state.metrics)
                self._step_end(bar)
                if state.stop_training:
                    break
        finally:
            state.last_in_epoch = False
            if bar is not None:
                bar.close()
        jax.block_until_ready(state.params)
        if timing.start is not None:
            timing.elapsed = time.perf_counter() - timing.start
        return step_metrics, timing

    def _bar(self, epoch: int, done: int, total: int | None) -> Any:
        if self.tqdm is None:
            return None
        return self.tqdm(
            total=total,
            initial=done,
            desc=f"epoch {epoch}/{self.num_epochs}",
            leave=False,
            unit="step",
        )

    def _timed_step(self, batch: Any, timing: _Timing) -> None:
        """One step. The first of the run is waited for and timed as the compile time;
        the others count towards the epoch's timing."""
        if self.compile_s is None:
            t0 = time.perf_counter()
            self._call_step(batch)
            jax.block_until_ready((self.state.params, self.state.metrics))
            self.compile_s = time.perf_counter() - t0
            return
        if timing.start is None:
            timing.start = time.perf_counter()
        self._call_step(batch)
        timing.steps += 1
        timing.examples += self.examples_per_step or _examples(batch) or 0

    def _call_step(self, batch: Any) -> None:
        state = self.state
        args = batch if isinstance(batch, tuple) else (batch,)
        out = self.step(state.params, state.opt_state, *args)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError(
                "fit: step must return (params, opt_state, metrics), got "
                f"{type(out).__name__}"
                + (f" of length {len(out)}" if isinstance(out, tuple) else "")
                + ". For a step with more state, fold it into opt_state."
            )
        before = state.params
        state.params, state.opt_state, state.metrics = out
        if isinstance(before, Params) and isinstance(out[0], Params):
            if out[0].keys() != before.keys():  # equal paths: one tuple comparison
                check_no_new_params(before, out[0], "fit")

    def _step_end(self, bar: Any) -> None:
        state = self.state
        if bar is not None:
            bar.update(1)
            if state.step % self.log_every == 0 and "loss" in state.metrics:
                bar.set_postfix(loss=f"{float(state.metrics['loss']):.4g}")
        for h in self.hooks:
            h.on_step_end(state)

    def _row(self, epoch: int, step_metrics: list[dict[str, Any]], timing: _Timing) -> dict:
        """The epoch's history row: train means, eval, timing, memory."""
        state = self.state
        row: dict[str, float] = {"epoch": epoch, "step": state.step}
        row.update(_mean_rows(step_metrics))
        last = epoch == self.num_epochs
        if self.eval_fn is not None and (epoch % self.eval_every == 0 or last):
            row.update(_to_row("eval", self.eval_fn(state.params), "eval_fn"))
        if not self.compile_logged and self.compile_s is not None:  # the call's first row
            row["time/compile_s"] = self.compile_s
            self.compile_logged = True
        row.update(timing.row())
        row.update(_memory())
        return row

    def _end_epoch(self, row: dict[str, float]) -> None:
        state = self.state
        state.history.rows.append(row)
        for lg in self.loggers:
            lg.log(state.step, row)
        for h in self.hooks:
            h.on_epoch_end(state)


def _take(it, n):
    for _ in range(n):
        try:
            yield next(it)
        except StopIteration:
            return


def _start_step(step: Any) -> int:
    """The step `fit` starts from, as set by the callbacks' ``on_train_begin``."""
    if isinstance(step, bool) or not isinstance(step, int | np.integer):
        raise TypeError(
            f"fit: state.step must be an int after on_train_begin, got {type(step).__name__} "
            f"{step!r}. A callback that restores a checkpoint must set a Python int (e.g. "
            "int(restored['step']))."
        )
    if step < 0:
        raise ValueError(f"fit: state.step must be >= 0 after on_train_begin, got {step}.")
    return int(step)


def _skip(batches: Iterable[Any], n: int, total: int | None) -> tuple[Iterator[Any] | None, int]:
    """Skips the first `n` batches of an epoch: ``(the rest, n)``, or ``(None, drawn)``
    when the epoch has at most `n` batches (it was done in full)."""
    if total is not None and n >= total:
        return None, total  # known length: the epoch is not even iterated
    it = iter(batches)
    for drawn in range(n):
        try:
            next(it)
        except StopIteration:
            return None, drawn
    if total is not None:
        return it, n
    try:  # unknown length: an epoch of exactly n batches was done in full
        first = next(it)
    except StopIteration:
        return None, n
    return itertools.chain([first], it), n


def _mark_last(batches: Iterable[Any], done: int, total: int | None) -> Iterator[tuple[Any, bool]]:
    """``(batch, last_in_epoch)``: from the position for a known length (no batch drawn
    early, so a stream's position matches the steps), else by looking one batch ahead."""
    if total is not None:
        for i, batch in enumerate(batches, done):
            yield batch, i == total - 1
        return
    it = iter(batches)
    try:
        prev = next(it)
    except StopIteration:
        return
    for batch in it:
        yield prev, False
        prev = batch
    yield prev, True


class _FunctionCallback(Callback):
    def __init__(self, fn: Callable[[FitState], None]):
        if not callable(fn):
            raise TypeError(
                f"fit: callbacks must be Callback objects or functions, got {type(fn).__name__}."
            )
        self.fn = fn

    def on_epoch_end(self, state: FitState) -> None:
        self.fn(state)
