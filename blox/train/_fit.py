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
    """
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
    tqdm = _require("tqdm", "fit(progress=True)").tqdm if progress else None

    hooks = [cb if isinstance(cb, Callback) else _FunctionCallback(cb) for cb in callbacks]
    state = FitState(params, opt_state, has_eval=eval_fn is not None)
    stopped = "completed"
    stream = None
    if steps_per_epoch is not None:
        stream = iter(train_data(1) if callable(train_data) else train_data)
        state.stream = stream
    compile_s: float | None = None
    compile_logged = False

    def call_step(batch):
        args = batch if isinstance(batch, tuple) else (batch,)
        out = step(state.params, state.opt_state, *args)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise TypeError(
                "fit: step must return (params, opt_state, metrics), got "
                f"{type(out).__name__}"
                + (f" of length {len(out)}" if isinstance(out, tuple) else "")
                + ". For a step with more state, fold it into opt_state."
            )
        state.params, state.opt_state, state.metrics = out

    try:
        for h in hooks:
            h.on_train_begin(state)
        state.step = skip = _start_step(state.step)
        first_epoch = 1  # of a stream: epochs before it are done; `skip` steps of it too
        if stream is not None and skip:
            first_epoch, skip = skip // steps_per_epoch + 1, skip % steps_per_epoch
            if not state.stream_restored and first_epoch <= epochs:
                for _ in _take(stream, state.step):  # replay the stream up to the step
                    pass
        for epoch in range(1, epochs + 1):  # numbered from 1 everywhere
            if stream is not None:
                if epoch < first_epoch:
                    continue
                done = skip if epoch == first_epoch else 0
                batches: Iterable[Any] = _take(stream, steps_per_epoch - done)
                total: int | None = steps_per_epoch
            else:
                batches = train_data(epoch) if callable(train_data) else train_data
                total = len(batches) if hasattr(batches, "__len__") else None
                done = 0
                if skip:  # resuming: skip the steps of this epoch already done
                    rest, drawn = _skip(batches, skip, total)
                    if rest is None:  # the whole epoch was done
                        skip -= drawn
                        continue
                    batches, done, skip = rest, skip, 0
            state.epoch = epoch
            bar = (
                tqdm(
                    total=total,
                    initial=done,
                    desc=f"epoch {epoch}/{epochs}",
                    leave=False,
                    unit="step",
                )
                if tqdm is not None
                else None
            )
            step_metrics: list[dict[str, Any]] = []
            n_timed = examples = 0
            t_start = None
            try:
                for batch, last_in_epoch in _mark_last(batches, done, total):
                    if compile_s is None:
                        t0 = time.perf_counter()
                        call_step(batch)
                        jax.block_until_ready((state.params, state.metrics))
                        compile_s = time.perf_counter() - t0
                    else:
                        if t_start is None:
                            t_start = time.perf_counter()
                        call_step(batch)
                        n_timed += 1
                        examples += examples_per_step or _examples(batch) or 0
                    state.step += 1
                    state.last_in_epoch = last_in_epoch
                    step_metrics.append(state.metrics)
                    if bar is not None:
                        bar.update(1)
                        if state.step % log_every == 0 and "loss" in state.metrics:
                            bar.set_postfix(loss=f"{float(state.metrics['loss']):.4g}")
                    for h in hooks:
                        h.on_step_end(state)
                    if state.stop_training:
                        break
            finally:
                state.last_in_epoch = False
                if bar is not None:
                    bar.close()
            jax.block_until_ready(state.params)
            elapsed = None if t_start is None else time.perf_counter() - t_start
            if not step_metrics:
                stopped = "data exhausted"
                break
            row: dict[str, float] = {"epoch": epoch, "step": state.step}
            row.update(_mean_rows(step_metrics))
            last = epoch == epochs
            if eval_fn is not None and (epoch % eval_every == 0 or last):
                row.update(_to_row("eval", eval_fn(state.params), "eval_fn"))
            if not compile_logged and compile_s is not None:  # the first row of this call
                row["time/compile_s"] = compile_s
                compile_logged = True
            if elapsed is not None and elapsed > 0:
                row["time/epoch_s"] = elapsed
                row["time/steps_per_s"] = n_timed / elapsed
                if examples:
                    row["time/examples_per_s"] = examples / elapsed
            row.update(_memory())
            state.history.rows.append(row)
            for lg in loggers:
                lg.log(state.step, row)
            for h in hooks:
                h.on_epoch_end(state)
            if state.stop_training:
                break
        if state.stop_training:
            stopped = state.stop_reason or "stopped by a callback"
    except KeyboardInterrupt:
        stopped = "interrupted"
    finally:
        for lg in loggers:
            lg.close()
    for h in hooks:
        h.on_train_end(state)
    return FitResult(state.params, state.opt_state, state.history, stopped, state.step)


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
