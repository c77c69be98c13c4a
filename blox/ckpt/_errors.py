"""`CheckpointError`: a checkpoint that cannot be read or written, explained."""

from __future__ import annotations

import re
from typing import Any

import jax

__all__ = ["CheckpointError"]


class CheckpointError(ValueError):
    """A checkpoint step that cannot be read (damaged, missing or corrupted files,
    unreadable metadata) or written (disk full, no permission), explained.

    The message names the directory, the step, the leaves concerned (when known) and the
    fix; the original error is chained (``raise ... from``) and summarized without
    TensorStore's spec dump.

    Attributes:
      directory: the checkpoint root directory (str).
      step: the step concerned.
      leaves: the state leaves concerned (``'params/net/fc/kernel'``), possibly empty.
    """

    def __init__(self, message: str, *, directory: str, step: int | None, leaves=()):
        self.directory, self.step, self.leaves = directory, step, list(leaves)
        super().__init__(message)


def summary(error: BaseException, limit: int = 300) -> str:
    """The error and its causes in one short line (TensorStore's spec dumps cut off)."""
    parts = []
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        text = str(e).split(" [tensorstore_spec", 1)[0]
        text = text.split(" See full TensorStore details", 1)[0].strip()
        text = " ".join(text.split())
        if len(text) > limit:
            text = text[:limit] + " ..."
        parts.append(f"{type(e).__name__}: {text}" if text else type(e).__name__)
        e = e.__cause__ or e.__context__
    return " <- ".join(parts[:3])


def _all_text(error: BaseException) -> str:
    texts, seen = [], set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        texts.append(str(e))
        e = e.__cause__ or e.__context__
    return "\n".join(texts)


def _key(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_names(tree: Any) -> dict[str, str]:
    """``{name: orbax_name}`` for every leaf: the name as `describe` writes it (keys joined
    with ``/``), and as Orbax stores it (keys joined with ``.``; a `Params` key is the
    parameter path, so ``'params.net/fc/kernel'``)."""
    out = {}
    for kp, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [_key(k) for k in kp]
        out["/".join(keys) or "<root>"] = ".".join(keys)
    return out


def leaves_named_in(error: BaseException, names: dict[str, str]) -> list[str]:
    """The leaves (of `leaf_names`) that an Orbax/TensorStore error mentions."""
    text = _all_text(error)
    return sorted(
        name
        for name, stored in names.items()
        if stored and re.search(re.escape(stored) + r"(/|\"|'|$|\s)", text)
    )
