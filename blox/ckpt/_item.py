"""The ``blox`` item of a step: the description and the checksums, committed with the step.

Orbax writes every item of a step into one temporary directory and renames it (or writes
its commit marker) only once every item's commit futures are done. The ``blox`` item is
written by `BloxItemHandler`, an Orbax ``AsyncCheckpointHandler`` whose commit future
writes ``metadata`` (the description, `describe`) and ``checksums.json`` (one checksum per
leaf) into that temporary directory. So a committed step always holds its checksums, and
a process killed at any moment leaves either a step with checksums or no step at all.

The checksums are started once Orbax has copied the arrays to host memory (so the copy
does not wait behind them), without blocking the caller (`Checksummer`). They reach the
handler through a `ChecksumSlot` that `CheckpointManager` fills once Orbax's ``save``
returns; the commit future (in Orbax's background thread) waits for them.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from typing import Any

import jax
import orbax.checkpoint as ocp

__all__: list[str] = []

DESCRIPTION_FILE = "metadata"  # the name Orbax's JsonCheckpointHandler gave it
CHECKSUMS = "checksums.json"

# How long the commit waits for the slot to be filled (it is filled right after Orbax's
# save returns; this only guards against a thread that died in between).
_SLOT_TIMEOUT_S = 600.0


class ChecksumSlot:
    """The checksums of a step being saved, handed to the commit future once started."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._pending: Any = None

    @property
    def filled(self) -> bool:
        return self._event.is_set()

    def fill(self, pending: Any) -> None:
        """Hands over a `PendingChecksums` (``None``: the save was abandoned)."""
        self._pending = pending
        self._event.set()

    def result(self) -> dict[str, str]:
        if not self._event.wait(_SLOT_TIMEOUT_S):
            raise TimeoutError(
                "blox.ckpt: the checksums of the step being saved were never started; the "
                "step is not committed."
            )
        if self._pending is None:
            raise RuntimeError("blox.ckpt: the save was abandoned; the step is not committed.")
        return self._pending.result()


def _write(directory: Any, description: Any, sums: dict[str, str]) -> None:
    if jax.process_index() != 0:  # the primary process writes the item (as Orbax's JSON)
        return
    (directory / DESCRIPTION_FILE).write_text(json.dumps(description))
    (directory / CHECKSUMS).write_text(json.dumps(sums, indent=1, sort_keys=True))


class BloxItemHandler(ocp.AsyncCheckpointHandler):
    """Writes the description and the checksums inside Orbax's atomic commit."""

    async def async_save(self, directory: Any, args: BloxItemSave) -> list[Any]:
        async def commit() -> None:
            # Runs in Orbax's background thread, after the temporary directory exists
            # and before the step is committed.
            _write(directory, args.description, args.checksums.result())

        return [ocp.future.CommitFutureAwaitingContractedSignals(commit(), name="blox_item")]

    def save(self, directory: Any, args: BloxItemSave) -> None:
        _write(directory, args.description, args.checksums.result())

    def restore(self, directory: Any, args: Any = None) -> dict[str, Any]:
        return {
            "description": json.loads((directory / DESCRIPTION_FILE).read_text()),
            "checksums": json.loads((directory / CHECKSUMS).read_text()),
        }


@ocp.args.register_with_handler(BloxItemHandler, for_save=True)
@dataclasses.dataclass
class BloxItemSave(ocp.args.CheckpointArgs):
    """The description (JSON-able) and the slot its checksums arrive through."""

    description: Any
    checksums: ChecksumSlot


@ocp.args.register_with_handler(BloxItemHandler, for_restore=True)
@dataclasses.dataclass
class BloxItemRestore(ocp.args.CheckpointArgs):
    """Reads ``{'description', 'checksums'}``."""
