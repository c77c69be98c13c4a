"""`verify`: check every leaf of a checkpoint against its checksum, without a model.

Each step's leaves are read as NumPy arrays (Python numbers as themselves) from Orbax's
own metadata, a group of leaves at a time (`GROUP_BYTES`), summed on the host and compared
with the step's ``checksums.json``. Nothing needs the model, the mesh or the devices, so
``python -m blox.ckpt verify DIR`` checks a copied or downloaded checkpoint before a run
relies on it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp

from blox.ckpt._checksum import PY_DTYPES, host_checksum
from blox.ckpt._errors import summary
from blox.ckpt._item import CHECKSUMS
from blox.ckpt._manager import DESCRIPTION, STATE, needs_checksum, read_description

__all__ = ["StepCheck", "verify"]

# Leaves read per Orbax call: bounds the host memory a check needs.
GROUP_BYTES = 256 * 2**20


class StepCheck(NamedTuple):
    """The check of one step (a row of `verify`'s table).

    Attributes:
      step: the step.
      leaves: the number of leaves in the step.
      bytes: their total size in bytes (as saved).
      status: ``'ok'`` (every leaf matches its checksum), ``'corrupted'`` (some leaves
        differ from those saved), ``'damaged'`` (files that cannot be read),
        ``'unverified'`` (no checksums: a step written by Orbax alone, or one whose
        ``checksums.json`` or a leaf's checksum is missing).
      detail: the leaves concerned or the reason, ``''`` when ok.
    """

    step: int
    leaves: int
    bytes: int
    status: str
    detail: str

    @property
    def ok(self) -> bool:
        """Whether every leaf was read and matches its checksum."""
        return self.status == "ok"


class _Damaged(Exception):
    pass


def _nbytes(entry: Mapping[str, Any]) -> int:
    kind = entry.get("kind")
    if kind in PY_DTYPES:
        return np.dtype(PY_DTYPES[kind]).itemsize
    try:
        itemsize = np.dtype(jax.numpy.dtype(entry["dtype"])).itemsize
    except TypeError:
        return 0
    return int(np.prod(entry["shape"], dtype=np.int64)) * itemsize


def _read_args(leaf: Any) -> Any:
    if type(leaf).__name__ == "ScalarMetadata":
        return ocp.RestoreArgs()  # a Python number, as saved
    return ocp.RestoreArgs(restore_type=np.ndarray)


def _names(tree: Any) -> list[str]:
    return [
        jax.tree_util.keystr(kp, simple=True, separator="/") or "<root>"
        for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
    ]


def _read(path: Any, tree: Any, names: set[str]) -> dict[str, Any]:
    """The leaves `names` of the state item at `path`, as NumPy arrays / numbers."""

    def pick(kp, leaf, value):
        name = jax.tree_util.keystr(kp, simple=True, separator="/") or "<root>"
        return value if name in names else ocp.PLACEHOLDER

    item = jax.tree_util.tree_map_with_path(lambda kp, x: pick(kp, x, x), tree)
    args = jax.tree_util.tree_map_with_path(lambda kp, x: pick(kp, x, _read_args(x)), tree)
    with ocp.PyTreeCheckpointer() as checkpointer:
        out = checkpointer.restore(path, args=ocp.args.PyTreeRestore(item, restore_args=args))
    return {
        jax.tree_util.keystr(kp, simple=True, separator="/") or "<root>": v
        for kp, v in jax.tree_util.tree_flatten_with_path(out)[0]
        if v is not ocp.PLACEHOLDER
    }


def _check_step(directory: Any, step: int) -> StepCheck:
    step_dir = directory / str(step)
    item = STATE if (step_dir / STATE).exists() else "default"
    try:
        metadata = ocp.PyTreeCheckpointHandler().metadata(step_dir / item)
        tree = getattr(metadata, "tree", metadata)
        if tree is None:
            raise ValueError("Orbax's metadata is empty")
    except Exception as e:
        return StepCheck(step, 0, 0, "damaged", f"Orbax's metadata: {summary(e, 120)}")
    names = _names(tree)
    if not (step_dir / DESCRIPTION).exists():
        return StepCheck(step, len(names), 0, "unverified", "written by Orbax alone: no checksums")

    def damaged(what, error=None):
        return _Damaged(what + (f" ({summary(error, 120)})" if error is not None else ""))

    try:
        desc, has_sums = read_description(step_dir / DESCRIPTION, damaged)
    except _Damaged as e:
        return StepCheck(step, len(names), 0, "damaged", str(e))
    entries = desc["leaves"]
    size = sum(_nbytes(entries[n]) for n in names if n in entries)
    if not has_sums:
        return StepCheck(step, len(names), size, "unverified", f"no {DESCRIPTION}/{CHECKSUMS}")
    todo = [n for n in names if "checksum" in entries.get(n, {})]
    unsummed = sorted(
        n for n in names if n not in todo and needs_checksum(desc, entries.get(n, {}))
    )
    bad: list[str] = []
    group: list[str] = []
    group_bytes = 0
    groups = []
    for name in todo:
        group.append(name)
        group_bytes += _nbytes(entries[name])
        if group_bytes >= GROUP_BYTES:
            groups.append(group)
            group, group_bytes = [], 0
    if group:
        groups.append(group)
    for group in groups:
        try:
            values = _read(step_dir / item, tree, set(group))
        except Exception as e:
            return StepCheck(step, len(names), size, "damaged", summary(e, 200))
        for name in group:
            value, entry = values[name], entries[name]
            if entry.get("kind") in PY_DTYPES:
                value = np.asarray(value, PY_DTYPES[entry["kind"]])
            if host_checksum(np.asarray(value)) != entry["checksum"]:
                bad.append(name)
    if bad:
        return StepCheck(step, len(names), size, "corrupted", ", ".join(sorted(bad)))
    if unsummed:
        detail = "no checksum: " + ", ".join(unsummed)
        return StepCheck(step, len(names), size, "unverified", detail)
    return StepCheck(step, len(names), size, "ok", "")


def format_table(rows: list[StepCheck]) -> str:
    """The rows as a text table: step, leaves, bytes, status, detail."""
    head = ("step", "leaves", "bytes", "status", "detail")
    cells = [head] + [(str(r.step), str(r.leaves), str(r.bytes), r.status, r.detail) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = []
    for c in cells:
        left = [c[0].rjust(widths[0]), c[1].rjust(widths[1]), c[2].rjust(widths[2])]
        lines.append("  ".join([*left, c[3].ljust(widths[3]), c[4]]).rstrip())
    return "\n".join(lines)


def verify(
    directory: str | PathLike,
    step: int | None = None,
    *,
    quiet: bool = False,
) -> list[StepCheck]:
    """Checks every leaf of a checkpoint against its checksum, without a model.

    Reads each leaf of each committed step (or only `step`) as NumPy on the host (a
    group of up to 256 MiB of leaves at a time), sums it as `CheckpointManager.save`
    did and compares with the step's ``checksums.json``; prints a table with one row per
    step (step, leaves, bytes, status, detail). The same check runs from a shell:
    ``python -m blox.ckpt verify DIR [--step N]`` (exit status 1 unless every step is
    ok).

    Args:
      directory: the checkpoint root directory (that of `CheckpointManager`).
      step: the step to check (default: every committed step).
      quiet: print nothing (the rows are returned either way).

    Returns:
      One `StepCheck` per step, ascending; ``all(r.ok for r in rows)`` when intact.

    Raises:
      ValueError: `directory` holds no committed step, or not `step`.

    >>> import tempfile, jax.numpy as jnp
    >>> from blox import ckpt
    >>> d = tempfile.mkdtemp()
    >>> with ckpt.CheckpointManager(d) as m:
    ...     _ = m.save(1, {'w': jnp.ones((2, 3)), 'step': 1})
    >>> rows = ckpt.verify(d)
    step  leaves  bytes  status  detail
       1       2     32  ok
    >>> rows[0].ok
    True
    """
    path = Path(directory)
    if not path.is_dir():
        raise ValueError(f"verify: {str(directory)!r} is not a directory.")
    steps = sorted(ocp.utils.checkpoint_steps(path))  # finalized (committed) steps only
    if not steps:
        raise ValueError(
            f"verify: {str(directory)!r} holds no committed checkpoint step (a step is a "
            "directory named by its number, as CheckpointManager writes them)."
        )
    if step is not None:
        if step not in steps:
            raise ValueError(
                f"verify: step {step} is not in {str(directory)!r}; the committed steps are "
                f"{steps}."
            )
        steps = [step]
    rows = [_check_step(path, s) for s in steps]
    if not quiet:
        print(format_table(rows), file=sys.stdout)
    return rows
