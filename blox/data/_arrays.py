"""`ArraySource`: in-memory arrays (e.g. images ``{'x', 'y'}``) as a Grain source."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, SupportsIndex

import numpy as np

__all__ = ["ArraySource"]


# Elements per block of the finiteness check (bounds its temporary mask).
_FINITE_BLOCK = 1 << 24


def _check_finite(name: str, v: np.ndarray) -> None:
    """Raises naming the first NaN or inf of float or complex array `v` (checked in
    blocks of examples, so the temporary mask stays small)."""
    if v.dtype.kind not in "fc" or v.size == 0:
        return
    step = max(1, _FINITE_BLOCK // max(1, v.size // v.shape[0]))
    for a in range(0, v.shape[0], step):
        ok = np.isfinite(v[a : a + step])
        if ok.all():
            continue
        first = np.unravel_index(int(np.argmin(ok)), ok.shape)
        first = (first[0] + a, *first[1:])
        raise ValueError(
            f"ArraySource: array {name!r} holds {v[first]} at example {first[0]} (element "
            f"{[int(i) for i in first]}), its first non-finite value in example order. "
            "Statistics and losses over it would be nan. Clean or drop those examples, "
            "or pass check_finite=False to keep them on purpose (e.g. NaN marking missing "
            "values that the loss masks)."
        )


class ArraySource:
    """Arrays that share their leading axis, as a Grain random-access source.

    ``source[i]`` is ``{name: array[i]}``; `pipeline` reads whole batches with one
    fancy index per array (``get_batch``). For images: ``ArraySource({'x': images
    [N, H, W, C], 'y': labels [N]})`` and ``pipeline(src, batch_size=..., shuffle=True,
    seed=...)`` give shuffled, batched, resumable ``{'x': [B, H, W, C], 'y': [B]}``.
    The arrays are kept as NumPy arrays (no copy when they already are); worker
    processes (``num_workers > 0``) each receive a pickled copy, so prefer
    ``num_workers=0`` for data that already sits in memory.

    **Finite values**: the arrays are in memory, so checking them is one cheap pass: a
    float or complex array holding NaN or inf is refused here, naming the array, the
    first bad example and its element (a ``np.memmap`` is not read for this;
    `channel_stats` checks what it reads). ``check_finite=False`` keeps them (e.g. NaN
    marking missing values that the loss masks; `channel_stats` then needs
    ``check_finite=False`` too, and gives NaN statistics for those channels).

    Args:
      arrays: ``{name: array [N, ...]}`` with the same N for every array.
      check_finite: refuse NaN and inf in float and complex arrays (default).

    Raises ``ValueError`` when the arrays disagree on N, one is a scalar, or (with
    ``check_finite``) one holds NaN or inf, and ``TypeError`` when `arrays` is not a
    mapping.

    >>> import numpy as np
    >>> src = ArraySource({'x': np.zeros((5, 8, 8, 1)), 'y': np.arange(5)})
    >>> len(src), src[3]['y'], src.get_batch([4, 0])['x'].shape
    (5, np.int64(3), (2, 8, 8, 1))
    """

    def __init__(self, arrays: Mapping[str, Any], *, check_finite: bool = True):
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
        if check_finite:
            for k, v in arrays.items():
                if not isinstance(v, np.memmap):  # a file's map: not read here
                    _check_finite(str(k), self.arrays[str(k)])

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

    def describe_sample(self, name: str, row: int, channel: int) -> str:
        """Where value ``[row, channel]`` of array `name`'s `blocks` stream comes from, in
        words (``"array 'x', example 5, element [5, 2, 3, 0]"``; for error messages)."""
        v = self.arrays[name]
        per = int(np.prod(v.shape[1:-1])) if v.ndim >= 2 else 1
        example, within = divmod(int(row), per)
        inner = np.unravel_index(within, v.shape[1:-1]) if v.ndim >= 2 else ()
        element = [example, *(int(i) for i in inner)] + ([int(channel)] if v.ndim >= 2 else [])
        return f"array {name!r}, example {example}, element {element}"

    def __repr__(self) -> str:
        shapes = ", ".join(f"{k!r}: {v.shape} {v.dtype}" for k, v in self.arrays.items())
        return f"ArraySource({{{shapes}}})"
