"""The data-iterator slot: any iterator with ``get_state()`` / ``set_state(state)`` (Grain's
``DatasetIterator`` and ``DataLoaderIterator``, or your own), saved through Grain's Orbax
handler (``grain.checkpoint.CheckpointSave`` / ``CheckpointRestore``), which writes one
JSON file per process (``process_<i>-of-<n>.json``) so each host keeps its own position.

The state is captured when `CheckpointManager.save` is called (a snapshot), not when the
asynchronous write runs, so the saved position is the one that matches the saved step even
if the loop has already drawn the next batch.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

__all__: list[str] = []


def check_iterator(it: Any, where: str) -> None:
    if not (callable(getattr(it, "get_state", None)) and callable(getattr(it, "set_state", None))):
        raise TypeError(
            f"{where}: data_iterator must have get_state() and set_state(state) (a Grain "
            f"iterator: iter(grain.MapDataset...) or iter(grain.DataLoader(...))); got "
            f"{type(it).__name__}. Plain Python iterators cannot be checkpointed: keep the "
            "position yourself (e.g. the step) in the state instead."
        )


def _is_loader_iterator(it: Any) -> bool:
    import grain  # public since grain 0.2.x: grain.DataLoaderIterator

    loader_iterator = getattr(grain, "DataLoaderIterator", None)
    return loader_iterator is not None and isinstance(it, loader_iterator)


class IteratorSnapshot:
    """The state of an iterator at one moment, in the form Grain's handler writes.

    Grain's handler calls ``get_state().decode()`` on anything that is not a
    ``DatasetIterator``; a snapshot therefore returns the state as UTF-8 JSON bytes
    (a ``DataLoaderIterator`` state already is), which Grain writes as text.
    """

    def __init__(self, it: Any):
        state = it.get_state()
        if isinstance(state, bytes):
            self._bytes = state
        else:
            try:
                self._bytes = json.dumps(state, indent=4).encode()
            except TypeError as e:
                raise TypeError(
                    f"data_iterator.get_state() returned a {type(state).__name__} that is not "
                    f"JSON-serializable ({e}); return a dict of plain data or bytes."
                ) from None

    def get_state(self) -> bytes:
        return self._bytes


class IteratorRestorer:
    """Receives the saved state from Grain's handler and sets it on the user's iterator."""

    def __init__(self, it: Any):
        self.it = it

    def set_state(self, state: bytes) -> None:
        if _is_loader_iterator(self.it):
            self.it.set_state(state)
        else:
            self.it.set_state(json.loads(state.decode() if isinstance(state, bytes) else state))

    def start_prefetch(self) -> None:
        start = getattr(self.it, "start_prefetch", None)
        if callable(start):
            start()


def position_iterator(it: Any, batches: Any, step: int, where: str) -> None:
    """Sets a Grain iterator to batch index `batches` without reading anything
    (``grain.experimental.set_next_index``): the restore's ``data_from_step``."""
    if isinstance(batches, bool) or not isinstance(batches, (int, np.integer)) or batches < 0:
        raise ValueError(
            f"{where}: data_from_step(step={step}) must return the number of batches drawn "
            f"(an int >= 0), got {batches!r}."
        )
    import grain

    try:
        grain.experimental.set_next_index(it, int(batches))
    except (AttributeError, NotImplementedError, TypeError, ValueError) as e:
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise TypeError(
            f"{where}: data_from_step cannot position a {type(it).__name__} at batch "
            f"{int(batches)} ({why}). It needs a Grain dataset iterator that "
            "skips to an index without reading (grain.experimental.set_next_index): "
            "iter(blox.data.pipeline(..., num_workers=0)) or iter(grain.MapDataset...). "
            "Otherwise restore without data_from_step and position the iterator yourself."
        ) from None
