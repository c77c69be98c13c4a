"""`ArraySource`: in-memory arrays (e.g. images ``{'x', 'y'}``) as a Grain source."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, SupportsIndex

import numpy as np

__all__ = ["ArraySource"]


class ArraySource:
    """Arrays that share their leading axis, as a Grain random-access source.

    ``source[i]`` is ``{name: array[i]}``; `pipeline` reads whole batches with one
    fancy index per array (``get_batch``). For images: ``ArraySource({'x': images
    [N, H, W, C], 'y': labels [N]})`` and ``pipeline(src, batch_size=..., shuffle=True,
    seed=...)`` give shuffled, batched, resumable ``{'x': [B, H, W, C], 'y': [B]}``.
    The arrays are kept as NumPy arrays (no copy when they already are); worker
    processes (``num_workers > 0``) each receive a pickled copy, so prefer
    ``num_workers=0`` for data that already sits in memory.

    Args:
      arrays: ``{name: array [N, ...]}`` with the same N for every array.

    Raises ``ValueError`` when the arrays disagree on N or one is a scalar, and
    ``TypeError`` when `arrays` is not a mapping.

    >>> import numpy as np
    >>> src = ArraySource({'x': np.zeros((5, 8, 8, 1)), 'y': np.arange(5)})
    >>> len(src), src[3]['y'], src.get_batch([4, 0])['x'].shape
    (5, np.int64(3), (2, 8, 8, 1))
    """

    def __init__(self, arrays: Mapping[str, Any]):
        if not isinstance(arrays, Mapping) or not arrays:
            raise TypeError(
                f"ArraySource: arrays must be a non-empty dict of arrays, got "
                f"{type(arrays).__name__}. Write e.g. ArraySource({{'x': images, 'y': labels}})."
            )
        self.arrays: dict[str, np.ndarray] = {str(k): np.asarray(v) for k, v in arrays.items()}
        sizes = {}
        for k, v in self.arrays.items():
            if v.ndim == 0:
                raise ValueError(f"ArraySource: array {k!r} is a scalar; give it a leading axis.")
            sizes[k] = v.shape[0]
        if len(set(sizes.values())) > 1:
            shapes = {k: v.shape for k, v in self.arrays.items()}
            raise ValueError(
                f"ArraySource: the arrays disagree on their leading (example) axis: {shapes}. "
                "Every array needs one row per example, e.g. x [N, H, W, C] and y [N]."
            )
        self._n = next(iter(sizes.values()))

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: SupportsIndex) -> dict[str, np.ndarray]:
        i = int(index)
        return {k: v[i] for k, v in self.arrays.items()}

    def get_batch(
        self,
        indices: Sequence[int] | np.ndarray,
        *,
        start: int | None = None,
        stop: int | None = None,
    ) -> dict[str, np.ndarray]:
        """Rows `indices` of every array (axis 1 sliced to ``[start, stop)`` if given)."""
        ids = np.asarray(indices, dtype=np.int64)
        if start is None and stop is None:
            return {k: v[ids] for k, v in self.arrays.items()}
        return {k: v[ids, start:stop] for k, v in self.arrays.items()}

    @property
    def channels(self) -> dict[str, int]:
        """Channels of each array: its last axis (rank >= 2), or 1."""
        return {k: (v.shape[-1] if v.ndim >= 2 else 1) for k, v in self.arrays.items()}

    @property
    def item_length(self) -> int | None:
        """The common length of axis 1 (time, for ``[N, T, C]`` sequences), or None."""
        lengths = {v.shape[1] if v.ndim >= 2 else None for v in self.arrays.values()}
        return lengths.pop() if len(lengths) == 1 else None

    def blocks(
        self, block_rows: int = 1 << 16, *, dtype: Any = np.float64
    ) -> Iterator[dict[str, np.ndarray]]:
        """Every value once, in blocks ``{name: [n, C]}`` of at most `block_rows` examples."""
        for a in range(0, self._n, block_rows):
            yield {
                k: v[a : a + block_rows].reshape(-1, self.channels[k]).astype(dtype)
                for k, v in self.arrays.items()
            }

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k!r}: {v.shape} {v.dtype}" for k, v in self.arrays.items())
        return f"ArraySource({{{shapes}}})"
