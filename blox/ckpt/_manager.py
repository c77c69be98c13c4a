"""`CheckpointManager`: a thin layer over ``orbax.checkpoint.CheckpointManager``.

One step directory holds three Orbax items:

* ``state``: the user's train state (any pytree of `Params`, Optax state, arrays and
  Python numbers), written by Orbax's ``StandardSave`` (OCDBT/TensorStore, one file set
  per process, asynchronous by default);
* ``blox``: the description (`describe`) as JSON: versions, mesh, and each leaf's path,
  shape, dtype, spec, trainable flag and metadata;
* ``data`` (optional): the data-iterator position, through Grain's Orbax handler.

Orbax writes each step into a temporary directory and renames it when every item is
complete (plus a ``commit_success.txt`` marker on file systems without atomic rename), so a
process killed mid-save leaves the previous steps intact and no partial step is ever seen.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from os import PathLike
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from orbax.checkpoint import checkpoint_managers as ocm

from blox.ckpt._describe import compare, describe
from blox.ckpt._iterator import IteratorRestorer, IteratorSnapshot, check_iterator
from blox.ckpt._targets import abstract_target

__all__ = ["CheckpointManager"]

_log = logging.getLogger(__name__)

STATE, DESCRIPTION, DATA = "state", "blox", "data"


def _grain_args():
    try:
        from grain.checkpoint import CheckpointRestore, CheckpointSave
    except ImportError as e:  # pragma: no cover - grain and orbax are dependencies
        raise ImportError(
            "Saving a data iterator needs grain's Orbax handler: pip install grain"
        ) from e
    return CheckpointSave, CheckpointRestore


def _has_deleted(state: Any) -> bool:
    for leaf in jax.tree.leaves(state):
        is_deleted = getattr(leaf, "is_deleted", None)
        if callable(is_deleted) and is_deleted():
            return True
    return False


class CheckpointManager:
    """Saves and restores a whole train state with Orbax: asynchronous, atomic, exact.

    ::

        with bx.ckpt.CheckpointManager(ckpt_dir, save_every=100, max_to_keep=3) as mngr:
            state = {'params': params, 'opt_state': opt_state, 'step': 0}
            if mngr.latest_step() is not None:                    # resume
                state = mngr.restore(state, data_iterator=it)
            for step in range(state['step'], total_steps):
                params, opt_state, metrics = train_step(params, opt_state, next(it))
                state = {'params': params, 'opt_state': opt_state, 'step': step + 1}
                mngr.save(step + 1, state, data_iterator=it)    # every 100 steps
        # leaving the block (also on Ctrl-C) saves the last step and waits for the writes

    `save` is called every step; it writes only when `should_save` says so (every
    `save_every` steps) and returns at once when `async_save` (the device arrays are copied
    to host memory, then written by a background thread). The state you pass is also
    remembered, so that `close` (and leaving the ``with`` block normally or by Ctrl-C)
    writes the last step if it was not saved yet, then waits for every write. Another
    exception skips that final save (the state may be the cause) but still waits.

    Args:
      directory: the root directory; one sub-directory per saved step (``<dir>/<step>``).
      save_every: save when ``step % save_every == 0`` (``force=True`` saves any step).
      max_to_keep: keep at most this many steps (the newest; with `best_metric`, the best
        ones plus always the latest, which a resume needs). ``None`` keeps all.
      best_metric: a key of the ``metrics`` dict given to `save` (e.g.
        ``'eval/loss'``), or a function ``metrics -> float``, ranking the steps to keep.
      best_mode: ``'min'`` or ``'max'``: whether a smaller or larger metric is better.
      async_save: write in the background (default). ``False`` blocks until written.
      save_on_exit: the final save of `close` (see above).

    Restore is into the structure you have: see `restore`.
    """

    def __init__(
        self,
        directory: str | PathLike,
        *,
        save_every: int = 1,
        max_to_keep: int | None = None,
        best_metric: str | Callable[[Any], float] | None = None,
        best_mode: str = "min",
        async_save: bool = True,
        save_on_exit: bool = True,
    ):
        if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
            raise ValueError(
                f"CheckpointManager: save_every must be an int >= 1, got {save_every!r}."
            )
        if max_to_keep is not None and (
            isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
        ):
            raise ValueError(
                f"CheckpointManager: max_to_keep must be None (keep all) or an int >= 1, got "
                f"{max_to_keep!r}."
            )
        if best_mode not in ("min", "max"):
            raise ValueError(
                f"CheckpointManager: best_mode must be 'min' or 'max', got {best_mode!r}."
            )
        if best_metric is not None and not (isinstance(best_metric, str) or callable(best_metric)):
            raise TypeError(
                "CheckpointManager: best_metric must be a metric name (e.g. 'eval/loss') or a "
                f"function metrics -> float, got {type(best_metric).__name__}."
            )
        self.save_every = save_every
        self.max_to_keep = max_to_keep
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = async_save
        self.save_on_exit = save_on_exit
        best_fn = None
        if best_metric is not None:
            best_fn = self._metric_fn(best_metric)
        if best_fn is not None:
            keep: Any = ocm.AnyPreservationPolicy(
                [
                    ocm.BestN(
                        get_metric_fn=best_fn,
                        reverse=best_mode == "min",
                        n=max_to_keep,
                        keep_checkpoints_without_metrics=False,
                    ),
                    ocm.LatestN(n=1),
                ]
            )
        else:
            keep = ocm.LatestN(n=max_to_keep)
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocm.AnySavePolicy(
                [ocm.FixedIntervalPolicy(save_every), ocm.PreemptionCheckpointingPolicy()]
            ),
            preservation_policy=keep,
            best_fn=best_fn,
            best_mode=best_mode,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        self._mngr = ocp.CheckpointManager(directory, options=options)
        self._pending: tuple[int, Any, IteratorSnapshot | None] | None = None
        self._closed = False

    @staticmethod
    def _metric_fn(best_metric: str | Callable[[Any], float]) -> Callable[[Any], float]:
        if callable(best_metric):
            return best_metric
        name = best_metric

        def fn(metrics: Any) -> float:
            if not isinstance(metrics, Mapping) or name not in metrics:
                have = sorted(metrics) if isinstance(metrics, Mapping) else type(metrics).__name__
                raise ValueError(
                    f"CheckpointManager(best_metric={name!r}): the metrics saved with a step "
                    f"have no {name!r}; they have {have}. Pass metrics={{{name!r}: value}} to "
                    "save()."
                )
            return float(metrics[name])

        return fn

    # -- queries ---------------------------------------------------------------------

    @property
    def directory(self) -> Any:
        """The root directory (an ``epath.Path``)."""
        return self._mngr.directory

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` when there is none."""
        return self._mngr.latest_step()

    def all_steps(self) -> list[int]:
        """Every committed step, ascending."""
        return sorted(self._mngr.all_steps())

    def best_step(self) -> int | None:
        """The best step by `best_metric` (the latest step without a `best_metric`)."""
        return self._mngr.best_step()

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with `step`, or ``None``."""
        return self._mngr.metrics(step)

    def should_save(self, step: int) -> bool:
        """Whether `save` at `step` would write (every `save_every` steps, after the latest)."""
        return self._mngr.should_save(step)

    def description(self, step: int | None = None) -> dict[str, Any]:
        """The description (`describe`) saved with `step` (default: the latest)."""
        step = self._resolve_step(step, "description")
        restored = self._mngr.restore(
            step, args=ocp.args.Composite(**{DESCRIPTION: ocp.args.JsonRestore()})
        )
        return restored[DESCRIPTION]

    # -- save --------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: Any,
        *,
        data_iterator: Any = None,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Saves `state` at `step` when `should_save` (or `force`); returns whether it did.

        Call it every step: it costs nothing on the steps it does not save, and it
        remembers the state for the final save of `close`.

        Args:
          step: the step number (the directory name). Steps must increase.
          state: the train state, e.g. ``{'params': params, 'opt_state': opt_state,
            'step': step}``. Leaves: jax / NumPy arrays and Python numbers.
          data_iterator: an iterator with ``get_state``/``set_state`` (Grain); its
            position is captured now and saved with the step.
          metrics: scalar metrics saved with the step (``best_metric`` ranks by them).
          force: save even if ``step % save_every != 0``.

        Returns:
          ``True`` if a save was started (with `async_save` it may still be writing:
          `wait` blocks until it is committed).
        """
        if self._closed:
            raise ValueError(
                f"CheckpointManager({str(self.directory)!r}) is closed; create a new one to "
                "save again."
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"CheckpointManager.save: step must be an int >= 0, got {step!r}.")
        if data_iterator is not None and not isinstance(data_iterator, IteratorSnapshot):
            check_iterator(data_iterator, "CheckpointManager.save")
        if metrics is not None:
            if not isinstance(metrics, Mapping):
                raise TypeError(
                    "CheckpointManager.save: metrics must be a dict of scalars, got "
                    f"{type(metrics).__name__}."
                )
            if isinstance(self.best_metric, str) and self.best_metric not in metrics:
                raise ValueError(
                    f"CheckpointManager.save: metrics has no {self.best_metric!r} (the "
                    f"best_metric); it has {sorted(metrics)}. Pass it, e.g. "
                    f"metrics={{{self.best_metric!r}: float(eval_loss)}}."
                )
            metrics = {k: float(v) for k, v in metrics.items()}
        snapshot = data_iterator
        if data_iterator is not None and not isinstance(data_iterator, IteratorSnapshot):
            snapshot = IteratorSnapshot(data_iterator)  # the position now, not at write time
        self._pending = (step, state, snapshot)
        if not force and not self._mngr.should_save(step):
            return False
        return self._write(step, state, snapshot, metrics, force=True)

    def _write(self, step, state, snapshot, metrics, *, force: bool) -> bool:
        latest = self._mngr.latest_step()
        if latest is not None and step <= latest:
            if step == latest:
                return False  # already saved (e.g. the final save after a periodic one)
            raise ValueError(
                f"CheckpointManager.save: step {step} is before the latest saved step "
                f"{latest} in {str(self.directory)!r}. Steps must increase; to start over, "
                "use a new directory."
            )
        items = {
            STATE: ocp.args.StandardSave(state),
            DESCRIPTION: ocp.args.JsonSave(describe(state)),
        }
        if snapshot is not None:
            save_cls, _ = _grain_args()
            items[DATA] = save_cls(snapshot)
        saved = self._mngr.save(
            step,
            args=ocp.args.Composite(**items),
            metrics=metrics,
            force=force,
        )
        if saved and self._pending is not None and self._pending[0] == step:
            self._pending = None
        return saved

    def wait(self) -> None:
        """Blocks until every started save is committed (and old steps deleted)."""
        self._mngr.wait_until_finished()

    # -- restore -----------------------------------------------------------------------

    def _resolve_step(self, step: int | None, where: str) -> int:
        if step is None:
            step = self._mngr.latest_step()
            if step is None:
                raise ValueError(
                    f"CheckpointManager.{where}: no checkpoint in {str(self.directory)!r}. "
                    "Check `mngr.latest_step() is not None` before restoring (a fresh run "
                    "starts from its initial state)."
                )
            return step
        if step not in self._mngr.all_steps():
            raise ValueError(
                f"CheckpointManager.{where}: step {step} is not in {str(self.directory)!r}; "
                f"the committed steps are {self.all_steps()}."
            )
        return step

    def restore(
        self,
        target: Any,
        *,
        step: int | None = None,
        mesh: Mesh | None = None,
        data_iterator: Any = None,
        allow_dtype_cast: bool = False,
    ) -> Any:
        """Restores a step into the structure of `target`, with the shardings of *now*.

        The saved description is compared with `target` first: any missing, unexpected or
        shape/dtype-mismatched leaf (or a changed trainable flag) raises a
        `RestoreMismatchError` listing them all, and nothing is restored.

        Args:
          target: the state to fill, concrete (e.g. freshly initialized) or abstract
            (``jax.eval_shape``). Its tree structure (including `Params` paths, trainable
            flags and metadata) is what you get back.
          step: the step to restore (default: the latest).
          mesh: the current mesh, for abstract leaves without a sharding (see
            `abstract_target`: `Params` leaves get their ``metadata['sharding']``).
          data_iterator: the iterator whose position to restore (set in place).
          allow_dtype_cast: restore into other dtypes on purpose (e.g. f32 -> bf16).

        Returns:
          The restored state, in the structure of `target`; arrays have the target's
          shardings (never the saved ones), Python numbers come back as Python numbers.

        Raises:
          RestoreMismatchError: the structures differ (see above).
          ValueError: no checkpoint / no such step; a data iterator was asked for but the
            step has none.
        """
        if mesh is not None and not isinstance(mesh, Mesh):
            raise TypeError(
                f"CheckpointManager.restore: mesh must be a jax.sharding.Mesh, got "
                f"{type(mesh).__name__}. Build one with jax.make_mesh((n,), ('data',))."
            )
        step = self._resolve_step(step, "restore")
        where = f"'{self.directory}' step {step}"
        saved = self.description(step)
        error = compare(saved, describe(target), allow_dtype_cast=allow_dtype_cast, where=where)
        if error is not None:
            raise error
        items: dict[str, Any] = {
            STATE: ocp.args.StandardRestore(abstract_target(target, mesh=mesh))
        }
        if data_iterator is not None:
            check_iterator(data_iterator, "CheckpointManager.restore")
            if not (self.directory / str(step) / DATA).exists():
                raise ValueError(
                    f"CheckpointManager.restore: {where} has no data-iterator state (it was "
                    "saved without data_iterator=...). Restore without data_iterator and "
                    "position the iterator yourself."
                )
            _, restore_cls = _grain_args()
            items[DATA] = restore_cls(IteratorRestorer(data_iterator))
        restored = self._mngr.restore(step, args=ocp.args.Composite(**items))
        return restored[STATE]

    # -- closing -------------------------------------------------------------------------

    def close(self, *, final_save: bool = True) -> None:
        """Writes the last state given to `save` if not saved yet (when `save_on_exit` and
        `final_save`), waits for every write, and releases Orbax's resources."""
        if self._closed:
            return
        try:
            if final_save and self.save_on_exit and self._pending is not None:
                step, state, snapshot = self._pending
                latest = self._mngr.latest_step()
                if latest is None or step > latest:
                    if _has_deleted(state):
                        _log.warning(
                            "blox.ckpt: not saving step %d on exit: its arrays were donated "
                            "to a later step call that did not finish. The latest committed "
                            "step is %s.",
                            step,
                            latest,
                        )
                    else:
                        self._write(step, state, snapshot, None, force=True)
            self._mngr.wait_until_finished()
        finally:
            self._pending = None
            self._closed = True
            self._mngr.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        clean = exc_type is None or issubclass(exc_type, KeyboardInterrupt)
        self.close(final_save=clean)

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({str(self.directory)!r}, save_every={self.save_every}, "
            f"max_to_keep={self.max_to_keep}, best_metric={self.best_metric!r}, "
            f"async_save={self.async_save}, latest_step={self.latest_step()})"
        )
