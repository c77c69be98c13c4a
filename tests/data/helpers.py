"""Test data for blox.data: HDF5 recordings written into pytest's tmp_path."""

from __future__ import annotations

import h5py
import numpy as np


def write_h5(path, datasets: dict[str, np.ndarray], *, chunked: bool = False) -> str:
    """Writes `datasets` to `path`: contiguous, or chunked + gzip-compressed."""
    with h5py.File(path, "w") as f:
        for name, data in datasets.items():
            if chunked:
                chunks = (min(7, len(data)),) + data.shape[1:]
                f.create_dataset(name, data=data, chunks=chunks, compression="gzip")
            else:
                f.create_dataset(name, data=data)
    return str(path)


def recordings(tmp_path, lengths, *, chunked=False, seed=0, dtype=np.float32, tag="rec"):
    """Files of the given lengths holding u0, u1 [T], u2 [T, 2] and y [T, 3].

    Returns ``(paths, arrays)`` where ``arrays[f]`` is the dict written to file f.
    """
    rng = np.random.default_rng(seed)
    paths, arrays = [], []
    for f, t in enumerate(lengths):
        data = {
            "u0": rng.normal(size=t).astype(dtype),
            "u1": rng.normal(size=t).astype(dtype) * 10 + 3,
            "u2": rng.normal(size=(t, 2)).astype(dtype),
            "y": rng.normal(size=(t, 3)).astype(dtype) * 0.1 - 1,
        }
        paths.append(write_h5(tmp_path / f"{tag}{f}.h5", data, chunked=chunked))
        arrays.append(data)
    return paths, arrays


def reference_windows(arrays, signals, window, stride):
    """Every window by plain NumPy slicing: a list of ``{signal: [L, C]}`` in file order."""
    out = []
    for data in arrays:
        t = len(next(iter(data.values())))
        for start in range(0, t - window + 1, stride):
            item = {}
            for key, names in signals.items():
                cols = [data[n][start : start + window] for n in names]
                cols = [c[:, None] if c.ndim == 1 else c for c in cols]
                item[key] = np.concatenate(cols, axis=1)
            out.append(item)
    return out


def sklearn_digits() -> dict[str, np.ndarray]:
    """scikit-learn's 8x8 digits as ``{'x': [N, 8, 8], 'y': [N]}`` (run in a child)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return {"x": d.images.astype(np.float32), "y": d.target}
