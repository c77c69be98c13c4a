"""`CheckpointManager`: a thin layer over ``orbax.checkpoint.CheckpointManager``.

One step directory holds three Orbax items:

* ``state``: the user's train state (any pytree of `Params`, Optax state, arrays and
  Python numbers), written by Orbax's ``PyTreeSave`` (OCDBT/TensorStore, one file set
  per process, asynchronous by default);
* ``blox``: the description (`describe`) as JSON: versions, mesh, and each leaf's path,
  shape, dtype, spec, trainable flag and metadata; and `checksums.json`: one checksum per
  leaf (`restore` verifies them), written by `BloxItemHandler` inside the commit;
* ``data`` (optional): the data-iterator position, through Grain's Orbax handler.

Orbax writes each step into a temporary directory and renames it when every item is
complete (plus a ``commit_success.txt`` marker on file systems without atomic rename), so a
process killed mid-save leaves the previous steps intact and no partial step is ever seen.
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from os import PathLike
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh
from orbax.checkpoint import checkpoint_managers as ocm

from blox.ckpt._checksum import PY_DTYPES, Checksummer, checksums
from blox.ckpt._describe import compare, describe, describe_saved_tree, empty_nodes
from blox.ckpt._errors import CheckpointError, leaf_names, leaves_named_in, summary
from blox.ckpt._item import (
    CHECKSUMS,
    DESCRIPTION_FILE,
    BloxItemHandler,
    BloxItemSave,
    ChecksumSlot,
)
from blox.ckpt._iterator import (
    IteratorRestorer,
    IteratorSnapshot,
    check_iterator,
    position_iterator,
)
from blox.ckpt._targets import _build, check_mesh

__all__ = ["CheckpointManager"]

_log = logging.getLogger(__name__)

STATE, DESCRIPTION, DATA = "state", "blox", "data"
_PY_ZERO = {"int": 0, "float": 0.0, "bool": False}


# Orbax writes a replicated array cooperatively ("replica-parallel"): each replica slices
# out its part on device, one small XLA program per array shape, compiled during the
# first save (1.6 s of a 1.7 s first save in examples/dp_classifier.py). Below this size
# per replica one replica writes the whole array, which costs no compilation; larger
# replicated arrays are still written in parallel.
MIN_REPLICA_SLICE_BYTES = 16 * 2**20


def _type_handlers() -> Any:
    """Orbax's standard type handlers, with replica-parallel writes for large slices only."""
    th = ocp.type_handlers
    pairs = [(ty, th.get_type_handler(ty)) for ty in th.supported_types() if ty is not jax.Array]
    array = th.ArrayHandler(min_slice_bytes_for_replica_parallel=MIN_REPLICA_SLICE_BYTES)
    return th.create_type_handler_registry(*pairs, (jax.Array, array))


def _grain_handler() -> Any:
    try:
        from grain.checkpoint import CheckpointHandler
    except ImportError:  # pragma: no cover - grain is a dependency
        return None
    return CheckpointHandler()


def _grain_args():
    try:
        from grain.checkpoint import CheckpointRestore, CheckpointSave
    except ImportError as e:  # pragma: no cover - grain and orbax are dependencies
        raise ImportError(
            "Saving a data iterator needs grain's Orbax handler: pip install grain"
        ) from e
    return CheckpointSave, CheckpointRestore


def _as_step(step: Any, where: str) -> int:
    """`step` as a Python int: an int, or an integer scalar array (NumPy or jax, e.g. the
    ``step`` that `restore` returns for an abstract target)."""
    if isinstance(step, (bool, np.bool_)):
        raise TypeError(f"{where}: step must be an int >= 0, got the bool {step!r}.")
    if isinstance(step, (int, np.integer)):
        value = int(step)
    elif getattr(step, "shape", None) is not None and getattr(step, "dtype", None) is not None:
        if tuple(step.shape) != ():
            raise ValueError(
                f"{where}: step must be a scalar, got an array of shape {tuple(step.shape)}. "
                "Pass the step number, e.g. int(state['step'])."
            )
        if not np.issubdtype(np.dtype(step.dtype), np.integer):
            raise TypeError(
                f"{where}: step must be an integer, got a {np.dtype(step.dtype).name} scalar "
                f"({step!r}). Keep the step as an int (or an int32 array)."
            )
        value = int(step)
    else:
        raise TypeError(
            f"{where}: step must be an int >= 0 (or an integer scalar array), got "
            f"{type(step).__name__}."
        )
    if value < 0:
        raise ValueError(f"{where}: step must be an int >= 0, got {value}.")
    return value


def _named_leaves(tree: Any) -> dict[str, Any]:
    """``{name: leaf}`` with the names of `describe` (key paths joined with ``/``)."""
    return {
        jax.tree_util.keystr(kp, simple=True, separator="/") or "<root>": leaf
        for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _restore_args(leaf: Any) -> Any:
    if leaf is ocp.PLACEHOLDER:
        return leaf
    return ocp.checkpoint_utils.construct_restore_args(leaf)


def _has_deleted(state: Any) -> bool:
    for leaf in jax.tree.leaves(state):
        is_deleted = getattr(leaf, "is_deleted", None)
        if callable(is_deleted) and is_deleted():
            return True
    return False


def read_description(path: Any, damaged: Callable[..., Exception]) -> tuple[dict, bool]:
    """The description in the ``blox`` item directory `path`, with each leaf's checksum
    merged in, and whether the checksum file exists. `damaged(what, error)` builds the
    error to raise for an unreadable file."""
    meta = path / DESCRIPTION_FILE
    try:
        desc = json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        raise damaged(f"its description {str(meta)!r} cannot be read", e) from e
    if not isinstance(desc, Mapping) or not isinstance(desc.get("leaves"), Mapping):
        raise damaged(f"its description {str(meta)!r} is not a blox description")
    desc = dict(desc)
    sums_path = path / CHECKSUMS
    if not sums_path.exists():
        return desc, False
    try:
        sums = json.loads(sums_path.read_text())
        if not isinstance(sums, Mapping):
            raise ValueError(f"a {type(sums).__name__}, not a mapping")
    except (OSError, ValueError) as e:
        raise damaged(f"{str(sums_path)!r} cannot be read", e) from e
    for name, value in sums.items():
        if name in desc["leaves"]:
            desc["leaves"][name]["checksum"] = value
    return desc, True


def needs_checksum(desc: Mapping[str, Any], entry: Mapping[str, Any]) -> bool:
    """Whether a leaf must have a checksum: every leaf from format ``blox.ckpt/2`` on;
    arrays only in ``blox.ckpt/1`` (which did not sum Python numbers)."""
    return desc.get("format") != "blox.ckpt/1" or entry.get("kind") not in _PY_ZERO


def _raw_leaf(abstract: Any, entry: Mapping[str, Any]) -> Any:
    """What to read a leaf as, in its saved dtype, laid out as `abstract` says."""
    if entry["kind"] in _PY_ZERO:
        return _PY_ZERO[entry["kind"]]
    dtype = jnp.dtype(entry["dtype"])
    if isinstance(abstract, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(abstract.shape, dtype, sharding=abstract.sharding)
    return np.zeros(tuple(entry["shape"]), dtype)


def _cast(values: Mapping[str, Any], targets: Mapping[str, Any]) -> dict[str, Any]:
    """The raw values of `targets`' leaves cast to their dtypes (and types), on their
    shardings: device arrays by one jitted ``astype``."""
    out: dict[str, Any] = {}
    on_device = [n for n, a in targets.items() if isinstance(a, jax.ShapeDtypeStruct)]
    arrays = [n for n in on_device if isinstance(values[n], jax.Array)]
    if arrays:
        dtypes = [targets[n].dtype for n in arrays]
        cast = jax.jit(
            lambda xs: [x.astype(d) for x, d in zip(xs, dtypes, strict=True)],
            out_shardings=[targets[n].sharding for n in arrays],
        )
        out.update(zip(arrays, cast([values[n] for n in arrays]), strict=True))
    for name, a in targets.items():
        if name in out:
            continue
        value = np.asarray(values[name])
        if isinstance(a, jax.ShapeDtypeStruct):
            out[name] = jax.device_put(value.astype(a.dtype), a.sharding)
        elif isinstance(a, np.ndarray):
            out[name] = value.astype(a.dtype)
        elif isinstance(a, np.generic):
            out[name] = a.dtype.type(value)
        else:  # a Python number
            out[name] = type(a)(value.item())
    return out


def _as_saved(value: Any, entry: Mapping[str, Any]) -> Any:
    """A restored value as it was summed: Python numbers as `PY_DTYPES`."""
    if entry.get("kind") in PY_DTYPES:
        return np.asarray(value, PY_DTYPES[entry["kind"]])
    return value


def _check_options(save_every: Any, max_to_keep: Any, best_metric: Any, best_mode: Any) -> None:
    """Checks `CheckpointManager`'s options, naming the bad one and what it accepts."""
    if isinstance(save_every, bool) or not isinstance(save_every, int) or save_every < 1:
        raise ValueError(f"CheckpointManager: save_every must be an int >= 1, got {save_every!r}.")
    if max_to_keep is not None and (
        isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1
    ):
        raise ValueError(
            f"CheckpointManager: max_to_keep must be None (keep all) or an int >= 1, got "
            f"{max_to_keep!r}."
        )
    if best_mode not in ("min", "max"):
        raise ValueError(f"CheckpointManager: best_mode must be 'min' or 'max', got {best_mode!r}.")
    if best_metric is not None and not (isinstance(best_metric, str) or callable(best_metric)):
        raise TypeError(
            "CheckpointManager: best_metric must be a metric name (e.g. 'eval/loss') or a "
            f"function metrics -> float, got {type(best_metric).__name__}."
        )


def _preservation_policy(
    best_fn: Callable[[Any], float] | None, best_mode: str, max_to_keep: int | None
) -> Any:
    """Which steps Orbax keeps: the `max_to_keep` newest, or with a metric the
    `max_to_keep` best plus always the latest (which a resume needs)."""
    if best_fn is None:
        return ocm.LatestN(n=max_to_keep)
    return ocm.AnyPreservationPolicy(
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


def _item_handlers() -> dict[str, Any]:
    """Orbax's handler for each item of a step: the state, the blox description and
    (when Grain is installed) the data-iterator position."""
    handlers: dict[str, Any] = {
        STATE: ocp.PyTreeCheckpointHandler(type_handler_registry=_type_handlers()),
        DESCRIPTION: BloxItemHandler(),
    }
    grain_handler = _grain_handler()
    if grain_handler is not None:
        handlers[DATA] = grain_handler
    return handlers


def _check_restore_args(mesh: Mesh | None, data_iterator: Any, data_from_step: Any) -> None:
    """Checks `restore`'s arguments that need no checkpoint: the mesh, and that
    `data_from_step` comes with an iterator and is ``True`` or a function."""
    check_mesh(mesh, "CheckpointManager.restore")
    if data_from_step is False:
        return
    if data_iterator is None:
        raise ValueError(
            "CheckpointManager.restore: data_from_step positions data_iterator; pass "
            "data_iterator=... too."
        )
    if not (data_from_step is True or callable(data_from_step)):
        raise TypeError(
            "CheckpointManager.restore: data_from_step must be True (batch = step) or "
            f"a function step -> batches drawn, got {data_from_step!r}."
        )


def _read_plan(
    abstract: Any, saved: Mapping[str, Any], wanted: Mapping[str, Any], saved_tree: Any
) -> tuple[Any, dict[str, Any]]:
    """Orbax's restore arguments for the state item, and the leaves to cast after the read.

    Each leaf of `abstract` is read laid out as it says; a leaf restored into another
    dtype is read in its saved dtype (so that its checksum can be checked), then cast.
    Checkpoint leaves the target lacks (`partial`) are not read (``PLACEHOLDER``)."""
    by_name = _named_leaves(abstract)
    cast = {
        name: leaf
        for name, leaf in by_name.items()
        if "checksum" in saved["leaves"][name]
        and saved["leaves"][name]["dtype"] != wanted["leaves"][name]["dtype"]
    }
    read = {**by_name, **{n: _raw_leaf(a, saved["leaves"][n]) for n, a in cast.items()}}
    restore_item = jax.tree_util.tree_map_with_path(
        lambda kp, _: read.get(
            jax.tree_util.keystr(kp, simple=True, separator="/") or "<root>",
            ocp.PLACEHOLDER,
        ),
        saved_tree,
    )
    restore_args = jax.tree.map(_restore_args, restore_item)
    return ocp.args.PyTreeRestore(restore_item, restore_args=restore_args), cast


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
        _check_options(save_every, max_to_keep, best_metric, best_mode)
        self.save_every = save_every
        self.max_to_keep = max_to_keep
        self.best_metric = best_metric
        self.best_mode = best_mode
        self.async_save = async_save
        self.save_on_exit = save_on_exit
        best_fn = None
        if best_metric is not None:
            best_fn = self._metric_fn(best_metric)
        options = ocp.CheckpointManagerOptions(
            save_decision_policy=ocm.AnySavePolicy(
                [ocm.FixedIntervalPolicy(save_every), ocm.PreemptionCheckpointingPolicy()]
            ),
            preservation_policy=_preservation_policy(best_fn, best_mode, max_to_keep),
            best_fn=best_fn,
            best_mode=best_mode,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
            create=True,
        )
        # The item handlers are created here, with the manager, so that the first save
        # does not build them (and Orbax's thread pools) inside the training loop.
        handlers = _item_handlers()
        self._mngr = ocp.CheckpointManager(directory, options=options, item_handlers=handlers)
        self._pending: tuple[int, Any, IteratorSnapshot | None] | None = None
        self._closed = False
        self._known: set[int] = set()  # steps this manager saved or restored
        self._writing: int | None = None  # the step of the last started write
        # Starts each save's checksums; keeps the programs compiled for them.
        self._checksums = Checksummer()

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
        """The description (`describe`) saved with `step` (default: the latest), each
        leaf with its ``checksum`` (none when the step has no ``checksums.json``).

        Raises:
          ValueError: no such step, or a step written without a description (by plain
            Orbax: `restore` reads it with the checks Orbax's metadata allows).
          CheckpointError: the description or checksum file is damaged (not JSON).
        """
        step = self._resolve_step(step, "description")
        return self._read_description(step)[0]

    def _read_description(self, step: int) -> tuple[dict[str, Any], bool]:
        """The description with the checksums merged in, and whether the step has its
        checksum file."""
        path = self.directory / str(step) / DESCRIPTION
        if not path.exists():
            raise ValueError(
                f"CheckpointManager.description: step {step} of {str(self.directory)!r} has no "
                f"blox description ({str(path)!r}): it was written by Orbax directly. "
                "restore() still reads it, comparing names, shapes and dtypes with Orbax's "
                "metadata."
            )
        return read_description(path, lambda what, e=None: self._damaged(step, what, e))

    def _damaged(
        self, step: int, what: str, error: BaseException | None = None, leaves=()
    ) -> CheckpointError:
        others = [s for s in self.all_steps() if s != step]
        cause = f" ({summary(error)})" if error is not None else ""
        named = f" Leaves concerned: {', '.join(leaves)}." if leaves else ""
        return CheckpointError(
            f"The checkpoint {str(self.directory)!r} step {step} is damaged: {what}{cause}."
            f"{named} Nothing was restored. Restore another step with "
            f"restore(..., step=s) (the other committed steps are {others}), or delete the "
            f"directory {str(self.directory / str(step))!r} if the step is lost.",
            directory=str(self.directory),
            step=step,
            leaves=leaves,
        )

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

        Steps must increase: a `step` at or before the directory's latest step raises (a
        fresh run saving into an old run's directory would mix the two), except the step
        this manager itself just saved or restored (nothing to do, returns ``False``).
        ``force=True`` overwrites: the steps from `step` on are deleted first.

        Args:
          step: the step number (the directory name): an int, or an integer scalar array
            (e.g. the ``step`` that `restore` returned for an abstract target).
          state: the train state, e.g. ``{'params': params, 'opt_state': opt_state,
            'step': step}``. Leaves: jax / NumPy arrays and Python numbers.
          data_iterator: an iterator with ``get_state``/``set_state`` (Grain); its
            position is captured now and saved with the step.
          metrics: scalar metrics saved with the step (``best_metric`` ranks by them).
          force: save even if ``step % save_every != 0``, and over existing steps
            ``>= step`` (deleted first).

        Returns:
          ``True`` if a save was started (with `async_save` it may still be writing:
          `wait` blocks until it is committed).

        Raises:
          ValueError: `step` is at or before the latest saved step (without `force`); a
            negative or non-scalar step; bad metrics.
          TypeError: a float or non-numeric step; an iterator without get/set_state.
          CheckpointError: the previous asynchronous write failed (e.g. disk full); the
            message names the step that was not committed.
        """
        if self._closed:
            raise ValueError(
                f"CheckpointManager({str(self.directory)!r}) is closed; create a new one to "
                "save again."
            )
        step = _as_step(step, "CheckpointManager.save")
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
        latest = self._mngr.latest_step()
        if latest is not None and step <= latest:
            if step == latest and step in self._known:
                return False  # already saved (or restored) by this manager
            if not force:
                raise ValueError(
                    f"CheckpointManager.save: {str(self.directory)!r} already holds steps up "
                    f"to {latest}, so saving step {step} would mix this run with an earlier "
                    "one (steps must increase). Resume instead (state = mngr.restore(state) "
                    "when mngr.latest_step() is not None, then continue from that step), "
                    "use a new directory, or pass force=True to delete the steps "
                    f">= {step} and save over them."
                )
        snapshot = data_iterator
        if data_iterator is not None and not isinstance(data_iterator, IteratorSnapshot):
            snapshot = IteratorSnapshot(data_iterator)  # the position now, not at write time
        self._pending = (step, state, snapshot)
        if not force and not self._mngr.should_save(step):
            return False
        return self._write(step, state, snapshot, metrics)

    def _write(self, step, state, snapshot, metrics) -> bool:
        self._check_writes()
        latest = self._mngr.latest_step()
        if latest is not None and step <= latest:
            self._mngr.wait_until_finished()
            doomed = [s for s in self._mngr.all_steps() if s >= step]
            _log.warning(
                "blox.ckpt: force=True: deleting steps %s of %s to save step %d over them.",
                sorted(doomed),
                self.directory,
                step,
            )
            for s in sorted(doomed, reverse=True):
                self._mngr.delete(s)
                self._known.discard(s)
        description = describe(state)
        slot = ChecksumSlot()
        if not self.async_save:  # Orbax's synchronous save waits for them
            slot.fill(self._checksums.start(_named_leaves(state)))
        items = {
            STATE: ocp.args.PyTreeSave(state),
            DESCRIPTION: BloxItemSave(description, slot),
        }
        if snapshot is not None:
            save_cls, _ = _grain_args()
            items[DATA] = save_cls(snapshot)
        self._writing = step
        started = False
        try:
            saved = self._mngr.save(
                step, args=ocp.args.Composite(**items), metrics=metrics, force=True
            )
            started = True
        except Exception as e:
            raise self._write_failed(step, e, state) from e
        finally:
            if not slot.filled:
                # Started once Orbax has copied the arrays to host memory, so that its
                # copy does not wait behind them; starting them neither copies nor
                # compiles here (see `Checksummer`). The commit (in Orbax's background
                # thread) waits for the sums and writes them into the step before it is
                # committed. The slot is always filled (None: abandoned), so the commit
                # never waits for sums that never come.
                pending = None
                try:
                    if started:
                        pending = self._checksums.start(_named_leaves(state))
                finally:
                    slot.fill(pending)
        if saved:
            self._known.add(step)
            if self._pending is not None and self._pending[0] == step:
                self._pending = None
        return saved

    def _write_failed(self, step: int, error: BaseException, state: Any = None) -> CheckpointError:
        try:
            committed = self._mngr.latest_step()
        except Exception:
            committed = None
        leaves = leaves_named_in(error, leaf_names(state)) if state is not None else []
        named = f" Leaves concerned: {', '.join(leaves)}." if leaves else ""
        return CheckpointError(
            f"CheckpointManager: writing step {step} to {str(self.directory)!r} failed "
            f"({summary(error)}).{named} The step was not committed; the latest committed "
            f"step is {committed}. Check free disk space, quota and permissions of the "
            "directory (e.g. `df -h`); the next save writes a new step, and a restart "
            f"resumes from step {committed}.",
            directory=str(self.directory),
            step=step,
            leaves=leaves,
        )

    def _check_writes(self) -> None:
        """Waits for the previous asynchronous write (Orbax's save would wait for it too)
        and raises its error (e.g. disk full), explained, naming that step."""
        if self._writing is not None:
            self._finish_writes()

    def _finish_writes(self) -> None:
        """Waits for Orbax's writes and raises a failed one's error explained (naming the
        step being written)."""
        try:
            self._mngr.wait_until_finished()
            self._mngr.check_for_errors()
        except Exception as e:
            raise self._write_failed(self._writing, e) from e

    def wait(self) -> None:
        """Blocks until every started save is committed (and old steps deleted).

        Raises:
          CheckpointError: an asynchronous write failed (e.g. disk full).
        """
        self._finish_writes()

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
        data_from_step: bool | Callable[[int], int] = False,
        allow_dtype_cast: bool = False,
        allow_unverified: bool = False,
        rules: Sequence[tuple[str, Any]] | None = None,
        partial: bool = False,
    ) -> Any:
        """Restores a step into the structure of `target`, with the shardings of *now*.

        The saved description is compared with `target` first: any missing, unexpected or
        shape/dtype-mismatched leaf (or a changed trainable flag) raises a
        `RestoreMismatchError` listing them all, and nothing is restored. Leaves are
        matched by name (their key path), then every restored leaf is checked against
        the checksum saved with it, so a corrupted file raises instead of restoring wrong
        values. A leaf restored into another dtype (`allow_dtype_cast`) is read in its
        saved dtype, checked, then cast (``astype``).

        A step written by Orbax directly (``StandardSave``/``PyTreeSave``, one item or a
        ``state`` item, no blox description) is restored too, compared by name, shape and
        dtype with Orbax's metadata (no flags, no checksums).

        Args:
          target: the state to fill, concrete (e.g. freshly initialized) or abstract
            (``jax.eval_shape``). Its tree structure (including `Params` paths, trainable
            flags and metadata) is what you get back.
          step: the step to restore (default: the latest).
          mesh: the mesh of this run: every array is laid out on it (see
            `abstract_target`): a leaf's own sharding on `mesh`, else its parameter's
            spec from `rules` or from ``metadata['sharding']``, else replicated. A leaf
            that was saved sharded and that nothing lays out here raises instead of being
            replicated silently: pass `rules`.
          data_iterator: the iterator whose position to restore (set in place). Its
            saved position is one per process: restoring it with another process count
            raises (pass `data_from_step`).
          data_from_step: position `data_iterator` from the step instead of its saved
            position: ``True`` sets it to batch ``step`` (one batch drawn per step, from
            step 0), a function ``step -> batches drawn`` to that batch (e.g.
            ``lambda s: 4 * s`` with 4 accumulated batches per step). For a Grain
            iterator that can skip to an index without reading (`blox.data.pipeline`
            without workers, ``iter(grain.MapDataset...)``): its batches depend only on
            the index, so this works with any process count and without a saved
            position.
          allow_dtype_cast: restore into other dtypes on purpose (e.g. f32 -> bf16).
          allow_unverified: restore a blox step that has no checksums (e.g. its
            ``checksums.json`` is missing, or 64-bit leaves of a step written before
            they were summed), with a warning naming the step and leaves; without it,
            such a step raises `CheckpointError`.
          rules: ``(pattern, spec)`` sharding rules for the `Params` leaves
            (`blox.parallel.param_specs`; e.g. ``bp.transformer_tp_rules('model') +
            [('.*', None)]``); needs `mesh`.
          partial: restore only what `target` holds (e.g. ``{'params': params}`` to
            fine-tune from a full train state): checkpoint leaves the target lacks are
            not read, and the optimizer state's structure may differ where it holds no
            leaf (adam -> adamw adds an empty state). Every target leaf must still be in
            the checkpoint.

        Returns:
          The restored state, in the structure of `target`; arrays have the target's
          shardings (never the saved ones), Python numbers come back as Python numbers.

        Raises:
          RestoreMismatchError: the leaves differ (see above).
          ValueError: no checkpoint / no such step; a data iterator was asked for but the
            step has none, or was saved by another process count; the structures differ
            where no leaf is (use `partial`); a sharded leaf that `mesh` would replicate
            (pass `rules`).
          TypeError: `data_from_step` with an iterator that cannot skip to an index.
          CheckpointError: damaged, missing or corrupted files (checksum mismatch), or a
            blox step without checksums (see `allow_unverified`), naming the directory,
            step and leaves.
        """
        _check_restore_args(mesh, data_iterator, data_from_step)
        if self._writing is not None:
            self.wait()  # a step of this manager may still be in flight
        if step is not None:
            step = _as_step(step, "CheckpointManager.restore")
        step = self._resolve_step(step, "restore")
        where = f"{str(self.directory)!r} step {step}"
        step_dir = self.directory / str(step)
        item, saved, has_sums = self._find_state_item(step, step_dir)
        blox_described = saved is not None
        saved_tree = self._saved_tree(step, step_dir / item)
        saved, wanted = self._compare_with_target(
            saved, saved_tree, target, where, allow_dtype_cast=allow_dtype_cast, partial=partial
        )
        if blox_described:
            self._check_verifiable(step, saved, has_sums, allow_unverified)
        read_data = data_iterator is not None and data_from_step is False
        if read_data:
            self._check_data(step, step_dir, item, data_iterator)
        abstract, defaulted = _build(target, mesh, rules)
        self._check_replicated(saved, defaulted, mesh, where)
        state_args, cast = _read_plan(abstract, saved, wanted, saved_tree)
        restored_tree = self._read_state(
            step, item, state_args, data_iterator if read_data else None, target
        )
        restored = self._verified_values(step, saved, restored_tree, target, cast)
        if data_from_step is not False:
            batches = step if data_from_step is True else data_from_step(step)
            position_iterator(data_iterator, batches, step, "CheckpointManager.restore")
        self._known.add(step)
        return restored

    def _find_state_item(self, step: int, step_dir: Any) -> tuple[str, dict | None, bool]:
        """Which item of the step holds the state (``state``, or ``default`` for a step
        Orbax wrote alone), its blox description (``None`` if Orbax wrote it directly), and
        whether the step has its checksum file."""
        if (step_dir / DESCRIPTION).exists():
            saved, has_sums = self._read_description(step)
            return STATE, saved, has_sums
        if (step_dir / STATE).exists():
            return STATE, None, False
        if (step_dir / "default").exists():
            return "default", None, False
        have = sorted(p.name for p in step_dir.iterdir()) if step_dir.exists() else []
        raise self._damaged(step, f"it holds no state item (it has {have})")

    def _compare_with_target(
        self,
        saved: dict | None,
        saved_tree: Any,
        target: Any,
        where: str,
        *,
        allow_dtype_cast: bool,
        partial: bool,
    ) -> tuple[dict, dict]:
        """The saved description (built from Orbax's metadata when there is no blox one;
        only the target's leaves when `partial`) and the target's, after checking that
        they match: names, shapes, dtypes, flags and (unless `partial`) the structure."""
        if saved is None:
            saved = describe_saved_tree(saved_tree)
        wanted = describe(target)
        if partial:
            saved = dict(saved)
            saved["leaves"] = {k: v for k, v in saved["leaves"].items() if k in wanted["leaves"]}
        error = compare(saved, wanted, allow_dtype_cast=allow_dtype_cast, where=where)
        if error is not None:
            raise error
        if not partial:
            self._check_structure(saved_tree, target, where)
        return saved, wanted

    def _read_state(
        self, step: int, item: str, state_args: Any, data_iterator: Any, target: Any
    ) -> Any:
        """Reads the state item (and, given `data_iterator`, sets its saved position);
        a failed read raises `CheckpointError` naming the leaves concerned."""
        step_dir = self.directory / str(step)
        try:
            if item == "default":
                if data_iterator is not None:
                    raise ValueError(
                        f"CheckpointManager.restore: {str(self.directory)!r} step {step} was "
                        "written by Orbax without a data-iterator item. Restore without "
                        "data_iterator, or pass data_from_step=True."
                    )
                with ocp.PyTreeCheckpointer() as checkpointer:
                    return checkpointer.restore(step_dir / item, args=state_args)
            items: dict[str, Any] = {STATE: state_args}
            if data_iterator is not None:
                _, restore_cls = _grain_args()
                items[DATA] = restore_cls(IteratorRestorer(data_iterator))
            return self._mngr.restore(step, args=ocp.args.Composite(**items))[STATE]
        except (ValueError, TypeError) as e:
            if "CheckpointManager.restore" in str(e) or isinstance(e, CheckpointError):
                raise
            raise self._read_failed(step, e, target) from e
        except Exception as e:
            raise self._read_failed(step, e, target) from e

    def _verified_values(
        self,
        step: int,
        saved: Mapping[str, Any],
        restored_tree: Any,
        target: Any,
        cast: Mapping[str, Any],
    ) -> Any:
        """The values read, checked against their checksums, cast where `cast` says, in
        the structure of `target`."""
        values = _named_leaves(restored_tree)
        flat, treedef = jax.tree_util.tree_flatten_with_path(target)
        names = [jax.tree_util.keystr(kp, simple=True, separator="/") or "<root>" for kp, _ in flat]
        self._verify(step, saved, {n: values[n] for n in names})
        if cast:
            values.update(_cast(values, cast))
        return jax.tree_util.tree_unflatten(treedef, [values[n] for n in names])

    def _check_verifiable(
        self, step: int, saved: Mapping[str, Any], has_sums: bool, allow_unverified: bool
    ) -> None:
        """A blox step restores only verified: raises (or warns, `allow_unverified`) when
        its checksum file or a leaf's checksum is missing."""
        sums_path = self.directory / str(step) / DESCRIPTION / CHECKSUMS
        if not has_sums:
            what = (
                f"it has no checksums ({str(sums_path)!r} is missing: it was written by a "
                "blox version that wrote them after Orbax's commit, and the process ended "
                "in between)"
            )
            leaves: list[str] = []
        else:
            leaves = sorted(
                n
                for n, e in saved["leaves"].items()
                if "checksum" not in e and needs_checksum(saved, e)
            )
            if not leaves:
                return
            what = (
                f"{len(leaves)} leaves have no checksum in {str(sums_path)!r}: "
                f"{', '.join(leaves[:10])} (e.g. 64-bit leaves, which blox versions "
                "before the format blox.ckpt/2 did not sum)"
            )
        if allow_unverified:
            warnings.warn(
                f"CheckpointManager.restore: {str(self.directory)!r} step {step}: {what}; "
                "restored unverified (allow_unverified=True).",
                UserWarning,
                stacklevel=3,
            )
            return
        others = [s for s in self.all_steps() if s != step]
        raise CheckpointError(
            f"The checkpoint {str(self.directory)!r} step {step} cannot be verified: {what}. "
            "Nothing was restored. Its values may still be right: pass "
            "allow_unverified=True to restore it with a warning (or check its files "
            f"first), or restore another step with restore(..., step=s) (the other "
            f"committed steps are {others}).",
            directory=str(self.directory),
            step=step,
            leaves=leaves,
        )

    def _check_data(self, step: int, step_dir: Any, item: str, data_iterator: Any) -> None:
        """The step has a data-iterator position for each process of this run."""
        check_iterator(data_iterator, "CheckpointManager.restore")
        where = f"{str(self.directory)!r} step {step}"
        data_dir = step_dir / DATA
        if item == "default":
            return  # explained with the read
        if not data_dir.exists():
            raise ValueError(
                f"CheckpointManager.restore: {where} has no data-iterator state "
                "(it was saved without data_iterator=...). Restore without "
                "data_iterator and position the iterator yourself, or pass "
                "data_from_step=True (the iterator at batch `step`)."
            )
        counts = {
            int(m.group(1))
            for p in data_dir.iterdir()
            if (m := re.fullmatch(r"process_\d+-of-(\d+)\.json", p.name))
        }
        here = jax.process_count()
        if counts and here not in counts:
            saved_by = max(counts)
            raise ValueError(
                f"CheckpointManager.restore: {where} was saved by {saved_by} processes and is "
                f"restored by {here}: its data-iterator position is one file per process "
                f"({str(data_dir)!r}: process_<i>-of-{saved_by}.json), so no position "
                f"matches process {jax.process_index()} of {here}. The checkpoint is intact "
                "(restore the state without data_iterator). A blox.data.pipeline is "
                "deterministic given the batch index: pass data_from_step=True to position "
                "the iterator at batch `step` (or a function step -> batches drawn)."
            )

    def _saved_tree(self, step: int, path: Any) -> Any:
        """Orbax's metadata tree of the state item (names, shapes, dtypes)."""
        try:
            metadata = ocp.PyTreeCheckpointHandler().metadata(path)
        except Exception as e:
            raise self._damaged(
                step, f"Orbax's metadata {str(path / '_METADATA')!r} cannot be read", e
            ) from e
        tree = getattr(metadata, "tree", metadata)
        if tree is None:
            raise self._damaged(step, f"Orbax's metadata in {str(path)!r} is empty")
        return tree

    def _check_structure(self, saved_tree: Any, target: Any, where: str) -> None:
        saved, wanted = empty_nodes(saved_tree), empty_nodes(target)
        if saved == wanted:
            return
        only_saved, only_target = sorted(saved - wanted), sorted(wanted - saved)
        raise ValueError(
            f"The checkpoint {where} has the same leaves as the target but another "
            f"structure where no leaf is: empty entries (e.g. optax.EmptyState) only in the "
            f"checkpoint: {only_saved}; only in the target: {only_target} (e.g. adam -> "
            "adamw adds an empty weight-decay state). The leaves themselves match by name; "
            "pass partial=True to restore them into the target's structure."
        )

    def _check_replicated(
        self, saved: Mapping[str, Any], defaulted: Mapping[str, Any], mesh: Mesh | None, where
    ) -> None:
        if mesh is None:
            return
        bad = []
        for name in sorted(defaulted):
            spec = (saved["leaves"].get(name) or {}).get("spec")
            if spec and any(entry is not None for entry in spec):
                bad.append(f"    {name}: saved as P{tuple(spec)}")
        if bad:
            saved_mesh = saved.get("mesh") or {}
            axes = dict(
                zip(
                    saved_mesh.get("axis_names", []), saved_mesh.get("axis_sizes", []), strict=False
                )
            )
            raise ValueError(
                f"CheckpointManager.restore: {len(bad)} leaves of {where} were saved sharded "
                f"(mesh {axes}) but the target gives them no layout on the mesh "
                f"{dict(mesh.shape)} (no sharding, no rule, no metadata['sharding']), so "
                "they would be replicated:\n" + "\n".join(bad[:10]) + "\n"
                "Pass rules=... (e.g. blox.parallel.transformer_tp_rules('model') + "
                "[('.*', None)]; [('.*', None)] replicates everything on purpose), or a "
                "target whose leaves carry shardings (jax.eval_shape of a jax.jit with "
                "out_shardings)."
            )

    def _read_failed(self, step: int, error: BaseException, target: Any) -> CheckpointError:
        leaves = leaves_named_in(error, leaf_names(target))
        return self._damaged(step, "a data file cannot be read", error, leaves)

    def _verify(self, step: int, saved: Mapping[str, Any], restored: Mapping[str, Any]) -> None:
        """Compares the restored values (in their saved dtypes) with the checksums saved
        with them."""
        entries = saved["leaves"]
        todo = {
            name: _as_saved(value, entries[name])
            for name, value in restored.items()
            if "checksum" in entries.get(name, {})
        }
        if not todo:
            return
        sums = checksums(todo)
        bad = sorted(n for n, v in sums.items() if v != entries[n]["checksum"])
        if bad:
            raise CheckpointError(
                f"The checkpoint {str(self.directory)!r} step {step} is corrupted: the values "
                f"read for {len(bad)} leaves differ from those saved (checksum mismatch): "
                f"{', '.join(bad[:10])}. A data file under "
                f"{str(self.directory / str(step) / STATE)!r} was changed after the save "
                "(disk or copy error). Nothing was returned. Restore another step with "
                f"restore(..., step=s) (committed steps: {self.all_steps()}); "
                f"`python -m blox.ckpt verify {str(self.directory)}` checks every step.",
                directory=str(self.directory),
                step=step,
                leaves=bad,
            )

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
                        self._write(step, state, snapshot, None)
            self.wait()
        finally:
            self._pending = None
            self._closed = True
            self._mngr.close()
            self._checksums.wait()  # no compilation outlives the manager

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
