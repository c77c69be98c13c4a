"""`channel_stats`: per-channel mean and std of a source, streamed block by block."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["ChannelStats", "channel_stats"]


@dataclasses.dataclass(frozen=True)
class ChannelStats:
    """Per-channel statistics of one signal.

    Attributes:
      mean: ``(C,)`` float64 means.
      std: ``(C,)`` float64 population standard deviations (``ddof=0``, as ``np.std``).
      count: the number of samples (time steps or examples) per channel.
    """

    mean: np.ndarray
    std: np.ndarray
    count: int


def channel_stats(
    source: Any,
    *,
    names: Sequence[str] | None = None,
    block_rows: int = 1 << 16,
    check_finite: bool = True,
) -> dict[str, ChannelStats]:
    """Per-channel mean and standard deviation of every signal, streamed over a source.

    Every sample of the source's data counts once: a `WindowedSource` is read file by
    file in blocks of ``block_rows`` rows (overlapping windows do not count twice), an
    `ArraySource` in blocks of examples (images: over batch, height and width). Blocks
    are combined in float64 with the pairwise update of Chan, Golub and LeVeque, so the
    memory used is one block and the result matches NumPy on the concatenated data
    (``np.mean(x, 0)``, ``np.std(x, 0)``) to about 1e-12 relative. Compute them on the
    training split only and give them to `Normalize`.

    **Finite values**: every block is checked for NaN and inf (one more pass over a block
    already in memory). The first one found, in file order, raises a ``ValueError``
    naming the signal and the value's origin: for a `WindowedSource` the file, the
    dataset and its column, the channel and the sample (time step); for an
    `ArraySource` the array, the example and the element. ``check_finite=False`` skips
    the check: the statistics are then what NumPy gives (NaN or inf for such channels,
    which `Normalize` refuses).

    Args:
      source: a `WindowedSource`, an `ArraySource`, or any object with
        ``blocks(block_rows, dtype=np.float64)`` yielding ``{name: [n, C]}``.
      names: the signals to describe (default: all).
      block_rows: rows per block (memory vs number of reads).
      check_finite: raise on NaN or inf in the data (default); ``False`` skips the check.

    Returns:
      ``{name: ChannelStats}`` with ``(C,)`` float64 ``mean`` and ``std``.

    >>> import numpy as np
    >>> from blox.data import ArraySource
    >>> x = np.array([[1.0, 10.0], [3.0, 30.0], [5.0, 20.0]])
    >>> s = channel_stats(ArraySource({'x': x}), block_rows=2)['x']
    >>> s.mean, s.count
    (array([ 3., 20.]), 3)
    >>> bool(np.allclose(s.std, x.std(0)))
    True
    """
    if isinstance(block_rows, bool) or not isinstance(block_rows, int) or block_rows < 1:
        raise ValueError(f"channel_stats: block_rows must be an int >= 1, got {block_rows!r}.")
    blocks = getattr(source, "blocks", None)
    if blocks is None:
        raise TypeError(
            f"channel_stats: {type(source).__name__} has no blocks() method. Pass a "
            "WindowedSource or an ArraySource (e.g. ArraySource({'x': x}))."
        )
    acc: dict[str, tuple[int, np.ndarray, np.ndarray]] = {}
    rows: dict[str, int] = {}  # rows of each signal seen before this block
    # Without the check, NaN and inf propagate as in NumPy, quietly: the caller asked.
    quiet = np.errstate(invalid="ignore", over="ignore") if not check_finite else None
    with quiet or contextlib.nullcontext():
        for block in blocks(block_rows, dtype=np.float64):
            if names is not None:
                missing = [n for n in names if n not in block]
                if missing:
                    raise ValueError(
                        f"channel_stats: no signal {missing} in {source!r}; it has "
                        f"{sorted(block)}. Pick names from those."
                    )
                block = {n: block[n] for n in names}
            if check_finite:
                _check_finite(source, block, rows)
            for key, x in block.items():
                rows[key] = rows.get(key, 0) + x.shape[0]
                _merge(acc, key, x)
        return {
            key: ChannelStats(mean=mean, std=np.sqrt(m2 / n), count=int(n))
            for key, (n, mean, m2) in acc.items()
        }


def _merge(acc: dict[str, tuple[int, np.ndarray, np.ndarray]], key: str, x: np.ndarray) -> None:
    """Chan, Golub and LeVeque's pairwise update of ``acc[key]`` with block `x`."""
    n_b = x.shape[0]
    if n_b == 0:
        return
    mean_b = x.mean(axis=0)
    m2_b = np.square(x - mean_b).sum(axis=0)
    if key not in acc:
        acc[key] = (n_b, mean_b, m2_b)
        return
    n_a, mean_a, m2_a = acc[key]
    n = n_a + n_b
    delta = mean_b - mean_a
    acc[key] = (n, mean_a + delta * (n_b / n), m2_a + m2_b + delta**2 * (n_a * n_b / n))


def _check_finite(source: Any, block: dict[str, np.ndarray], rows: dict[str, int]) -> None:
    """Raises naming the first non-finite value of `block` (the earliest row, then the
    first signal), where `source` says it comes from."""
    first = None
    for key, x in block.items():
        ok = np.isfinite(x)
        if ok.all():
            continue
        r, c = (int(i) for i in np.argwhere(~ok)[0])
        if first is None or r < first[1]:
            first = (key, r, c, x[r, c], int(ok.size - ok.sum()))
    if first is None:
        return
    key, r, c, value, count = first
    row = rows.get(key, 0) + r
    describe = getattr(source, "describe_sample", None)
    where = describe(key, row, c) if describe is not None else f"row {row}, channel {c}"
    raise ValueError(
        f"channel_stats: signal {key!r} holds {value} at {where}: the first non-finite "
        f"value ({count} in this block of {block[key].shape[0]} rows). Its statistics would "
        "be nan or inf, and a model normalized with them computes nan. Fix the data (e.g. "
        "fill or cut the gap in that recording), leave that file or example out of the "
        "training split, or pass check_finite=False to compute the statistics anyway."
    )
