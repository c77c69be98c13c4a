"""`blox.ts.read_recordings` is a thin use of `blox.data`: only the named datasets, dtype
kept unless asked, blox.data's checks."""

import h5py
import numpy as np
import pytest

from blox.ts import read_recordings, write_hdf5


def _write(path, **datasets):
    with h5py.File(path, "w") as f:
        for name, data in datasets.items():
            f.create_dataset(name, data=data)
    return str(path)


def test_reads_the_named_signals_and_keeps_the_dtype(tmp_path):
    u = np.arange(6, dtype=np.float64) / 3
    y = np.arange(6, dtype=np.int16) * 3
    p = _write(tmp_path / "a.h5", u=u, y=y, label=np.array([b"run a"] * 6))  # text ignored
    q = write_hdf5(tmp_path / "b.h5", u=np.ones(4), y=np.zeros(4))
    (a,) = read_recordings([p])
    (b,) = read_recordings([q])
    np.testing.assert_array_equal(a["u"], u[:, None])  # float64 kept, not float32
    np.testing.assert_array_equal(a["y"], y[:, None])
    assert (a["u"].dtype, a["y"].dtype) == (np.float64, np.int16)
    assert set(a) == {"u", "y"} and b["u"].shape == (4, 1) and b["u"].dtype == np.float32
    both = read_recordings([p, q])  # one dtype per signal over the files: int16 -> float32
    assert [r["y"].dtype for r in both] == [np.float32, np.float32]
    np.testing.assert_array_equal(both[0]["y"], y[:, None].astype(np.float32))
    (c,) = read_recordings([p], {"y": ["u", "y"]}, dtype=np.float32)
    np.testing.assert_array_equal(c["y"], np.stack([u, y], 1).astype(np.float32))
    assert c["y"].dtype == np.float32


def test_errors_come_from_blox_data(tmp_path):
    p = _write(tmp_path / "a.h5", u=np.zeros(5), y=np.zeros(4))
    with pytest.raises(ValueError, match=r"a\.h5': datasets have different lengths"):
        read_recordings([p])
    q = _write(tmp_path / "q.h5", u=np.zeros(5), y=np.array([b"1.0"] * 5))
    with pytest.raises(ValueError, match=r"q\.h5', dataset 'y' holds fixed-length strings"):
        read_recordings([q])
    with pytest.raises(ValueError, match=r"q\.h5' has no dataset 'x'"):
        read_recordings([q], ["x"])
    with pytest.raises(TypeError, match=r"list of paths, got the single path"):
        read_recordings(q)
