"""`CheckpointCallback`: checkpointing for `blox.fit` through `CheckpointManager`.

It lives in `blox.ckpt` (not `blox.train`) so that `fit` itself never imports Orbax.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from blox.ckpt._iterator import IteratorSnapshot, check_iterator
from blox.ckpt._manager import CheckpointManager, _has_deleted
from blox.train._fit import Callback, FitState

__all__ = ["CheckpointCallback"]

_log = logging.getLogger(__name__)


def _state(state: FitState) -> dict[str, Any]:
    return {"params": state.params, "opt_state": state.opt_state, "step": state.step}


class CheckpointCallback(Callback):
    """Checkpoints a `blox.fit` run with a `CheckpointManager` and resumes it on start.

    * ``on_train_begin``: if the manager's directory holds a checkpoint, restores
      ``{'params', 'opt_state', 'step'}`` of its latest step into the `FitState` (into the
      structure, dtypes and shardings of the params and optimizer state given to `fit`;
      any difference raises `RestoreMismatchError` listing the paths), and the data
      iterator's position; `fit` then continues from that step. Without a checkpoint the
      run starts from the state given to `fit`.
    * ``on_step_end``: ``manager.save(step, {'params', 'opt_state', 'step'},
      data_iterator=...)`` after every step, before the next (donating) step call; the
      manager writes every ``save_every`` steps, asynchronously by default.
    * ``on_epoch_end``: the epoch's last step is saved here instead, with the epoch's
      ``train/*`` and ``eval/*`` metrics, so that the manager's ``best_metric`` (e.g.
      ``'eval/loss'``) can rank it; with a ``best_metric``, every epoch whose row holds it
      is saved (a candidate for the best), whatever ``save_every``.
    * ``on_train_end`` (after the last step, early stopping or Ctrl-C): saves the last
      step if not saved yet (unless the manager has ``save_on_exit=False``), waits for
      every write and closes the manager.

    With a `steps_per_epoch` stream that has ``get_state``/``set_state`` (a Grain
    iterator) its position is saved and restored automatically; a stream without them is
    replayed from its start by `fit` on resume. Per-epoch data (a list, a function
    ``epoch -> iterable``) needs nothing: `fit` skips what was done.

    Saved per step: the params (with the `Rng` counters, norm statistics, EMA weights),
    the optimizer state (and whatever a wrapped step folds into it, e.g. a loss-scale
    state), the step, the iterator position. Not saved: the history and the state of
    other callbacks (`EarlyStopping` restarts its patience count on resume).

    Args:
      manager: the `CheckpointManager` (its ``save_every``, ``max_to_keep``,
        ``best_metric``, ``async_save`` apply). The callback closes it at the end; a new
        `CheckpointManager` on the same directory reads it afterwards.
      data_iterator: the iterator whose position to save and restore, when it is not
        `fit`'s stream itself (e.g. a Grain iterator that a generator maps over);
        default: the stream when it has ``get_state``/``set_state``.
      data_from_step: on resume, position that iterator from the step instead of its
        saved position (`CheckpointManager.restore`'s ``data_from_step``: ``True`` for
        batch ``step``, or a function ``step -> batches drawn``), e.g. for a
        `blox.data.pipeline` saved by another number of processes.

    Example::

        mngr = bx.ckpt.CheckpointManager('runs/a', save_every=100, best_metric='eval/loss')
        result = bx.fit(step, params, opt_state, batches, epochs=10, eval_fn=evaluate,
                        callbacks=[bx.ckpt.CheckpointCallback(mngr)])
        # Run the same script again after a crash or Ctrl-C: it resumes from the latest
        # step and its remaining losses equal those of an uninterrupted run, bit for bit.

    >>> import tempfile, jax, jax.numpy as jnp, optax, blox as bx
    >>> graph = bx.Graph('net'); rng = bx.Rng(graph / 'rng')
    >>> lin = bx.Linear(graph / 'fc', 1, rng)
    >>> params = lin(rng.seed(bx.Params(), seed=0), jnp.ones((2, 3)))[1].locked()
    >>> def loss_fn(p, x, y):
    ...     y_hat, p = lin(p, x)
    ...     return bx.mse(y_hat, y), p
    >>> tx = optax.sgd(0.1)
    >>> step = jax.jit(bx.make_train_step(loss_fn, tx))
    >>> data = [(jnp.ones((2, 3)), jnp.zeros((2, 1)))] * 4
    >>> directory = tempfile.mkdtemp()
    >>> def run(epochs):
    ...     mngr = bx.ckpt.CheckpointManager(directory, save_every=2)
    ...     return bx.fit(step, params, tx.init(params.split()[0]), data, epochs=epochs,
    ...                   callbacks=[bx.ckpt.CheckpointCallback(mngr)], progress=False)
    >>> run(epochs=1).steps                      # 4 steps, saved at steps 2 and 4
    4
    >>> resumed = run(epochs=3)                  # resumes at step 4: epochs 2 and 3
    >>> resumed.steps, [row['epoch'] for row in resumed.history.rows]
    (12, [2, 3])
    """

    def __init__(
        self,
        manager: CheckpointManager,
        *,
        data_iterator: Any = None,
        data_from_step: bool | Callable[[int], int] = False,
    ):
        if not isinstance(manager, CheckpointManager):
            raise TypeError(
                "CheckpointCallback: manager must be a blox.ckpt.CheckpointManager, got "
                f"{type(manager).__name__}. Build one with "
                "bx.ckpt.CheckpointManager(directory, save_every=...)."
            )
        if data_iterator is not None:
            check_iterator(data_iterator, "CheckpointCallback")
        if not (data_from_step is False or data_from_step is True or callable(data_from_step)):
            raise TypeError(
                "CheckpointCallback: data_from_step must be False, True (batch = step) or a "
                f"function step -> batches drawn, got {data_from_step!r}."
            )
        self.manager = manager
        self.data_iterator = data_iterator
        self.data_from_step = data_from_step
        self.restored_step: int | None = None
        self._it: Any = None
        self._last: tuple[int, dict[str, Any], IteratorSnapshot | None] | None = None

    def _snapshot(self) -> IteratorSnapshot | None:
        return IteratorSnapshot(self._it) if self._it is not None else None

    def on_train_begin(self, state: FitState) -> None:
        """Restores the latest checkpoint, if any, into ``state``."""
        mngr = self.manager
        self._last, self.restored_step = None, None
        if self.data_iterator is not None:
            if state.stream is None:
                raise ValueError(
                    "CheckpointCallback(data_iterator=...): fit draws no stream here (no "
                    "steps_per_epoch), so the iterator's position would not be where the "
                    "batches come from. With per-epoch data (a list, a function epoch -> "
                    "iterable) fit repositions the data itself on resume: drop "
                    "data_iterator; or pass the iterator as train_data with "
                    "steps_per_epoch=N."
                )
            self._it = self.data_iterator
        else:
            stream = state.stream
            ok = callable(getattr(stream, "get_state", None)) and callable(
                getattr(stream, "set_state", None)
            )
            self._it = stream if ok else None
        if isinstance(mngr.best_metric, str) and mngr.best_metric.startswith("eval/"):
            if not state.has_eval:
                raise ValueError(
                    f"CheckpointCallback: the manager keeps the best steps by "
                    f"{mngr.best_metric!r}, but fit has no eval_fn, so no 'eval/' metric is "
                    "ever logged. Pass eval_fn=... to fit, or rank by a train metric such as "
                    "best_metric='train/loss'."
                )
        latest = mngr.latest_step()
        if latest is None:
            return
        restored = mngr.restore(
            _state(state),
            data_iterator=self._it,
            data_from_step=self.data_from_step if self._it is not None else False,
        )
        state.params, state.opt_state = restored["params"], restored["opt_state"]
        state.step = int(restored["step"])
        state.stream_restored = self._it is not None
        self.restored_step = state.step
        _log.info("blox.ckpt: resumed from step %d of %s", state.step, mngr.directory)

    def on_step_end(self, state: FitState) -> None:
        """Saves the step (the manager writes every ``save_every`` steps)."""
        current = _state(state)
        self._last = (state.step, current, self._snapshot())
        if state.last_in_epoch:
            return  # saved in on_epoch_end, with the epoch's metrics
        self.manager.save(state.step, current, data_iterator=self._last[2])

    def on_epoch_end(self, state: FitState) -> None:
        """Saves the epoch's last step with the epoch's metrics."""
        if self._last is None or self._last[0] != state.step:
            return
        step, current, snapshot = self._last
        row = state.history.rows[-1]
        metrics = {k: v for k, v in row.items() if k.startswith(("train/", "eval/"))}
        best = self.manager.best_metric
        if best is None:
            self.manager.save(step, current, data_iterator=snapshot, metrics=metrics)
            return
        if callable(best):
            candidate = any(k.startswith("eval/") for k in row) or not state.has_eval
        elif best in metrics:
            candidate = True
        else:
            could = any(k.startswith("eval/") for k in row) or not best.startswith("eval/")
            if could:
                names = [k for k in row if k.startswith(("train/", "eval/"))]
                raise ValueError(
                    f"CheckpointCallback: the manager's best_metric {best!r} is never logged "
                    f"by fit; the logged metrics are {names}. Use one of those names in "
                    "CheckpointManager(best_metric=...) (train metrics are 'train/<key of "
                    "the step's metrics>', eval metrics 'eval/<key of eval_fn's dict>')."
                )
            candidate = False  # not evaluated this epoch (eval_every)
        self.manager.save(
            step,
            current,
            data_iterator=snapshot,
            metrics=metrics if candidate else None,
            force=candidate,
        )

    def on_train_end(self, state: FitState) -> None:
        """Saves the last step if not saved yet, waits for the writes, closes the manager."""
        mngr = self.manager
        try:
            if self._last is not None and self._last[0] == state.step:
                step, current, snapshot = self._last
            else:  # an interrupt skipped this hook's on_step_end: fit's state is the latest
                step, current, snapshot = state.step, _state(state), self._snapshot()
            latest = mngr.latest_step()
            fresh = latest is None or step > latest
            if mngr.save_on_exit and fresh and step > (self.restored_step or 0):
                if _has_deleted(current):
                    _log.warning(
                        "blox.ckpt: not saving step %d at the end of fit: its arrays were "
                        "donated to a step call that did not finish. The latest committed "
                        "step is %s.",
                        step,
                        latest,
                    )
                else:
                    mngr.save(step, current, data_iterator=snapshot, force=True)
        finally:
            mngr.close(final_save=False)
