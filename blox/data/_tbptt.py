"""Truncated-BPTT order: long items cut into consecutive chunks, row i continuing row i."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

__all__ = ["item_length", "tbptt_chunks"]


def item_length(source: Any) -> int | None:
    """The common time length of a source's items, or ``None`` when they differ."""
    length = getattr(source, "item_length", None)
    return None if length is None else int(length)


def tbptt_chunks(source: Any, chunk: int) -> int:
    """The number of chunks of length `chunk` per item; raises on a bad `chunk`."""
    if isinstance(chunk, bool) or int(chunk) != chunk or chunk < 1:
        raise ValueError(f"pipeline: tbptt_chunk must be an int >= 1, got {chunk!r}.")
    length = item_length(source)
    if length is None:
        raise ValueError(
            f"pipeline: tbptt_chunk={chunk} needs items of one fixed length, but {source!r} "
            "has none (e.g. WindowedSource(window=None) over files of different lengths). "
            "Give the source a window length that is a multiple of the chunk."
        )
    if length % chunk:
        k = max(length // chunk, 1)
        raise ValueError(
            f"pipeline: tbptt_chunk={chunk} does not divide the item length {length} of "
            f"{source!r}. Use a window that is a multiple of the chunk (e.g. window="
            f"{k * chunk}) or a chunk that divides {length}."
        )
    return length // chunk


class ChunkSplit(grain.experimental.FlatMapTransform):
    """Index batch -> ``(ids, k)`` for each of its ``max_fan_out`` chunks, in order."""

    def __init__(self, num_chunks: int):
        self.max_fan_out = num_chunks

    def flat_map(self, element: np.ndarray) -> Sequence[tuple[np.ndarray, int]]:
        return [(element, k) for k in range(self.max_fan_out)]
