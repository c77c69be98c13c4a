"""HDF5 index and windowed source: windows equal NumPy slicing; errors name file and fix."""

import logging
import pickle

import h5py
import numpy as np
import pytest

from blox.data import HDF5Index, WindowedSource
from tests.data.helpers import recordings, reference_windows, write_h5

SIGNALS = {"u": ["u0", "u1", "u2"], "y": "y"}
SIGNALS_LISTS = {"u": ["u0", "u1", "u2"], "y": ["y"]}
LENGTHS = [23, 9, 40]


@pytest.mark.parametrize("chunked", [False, True], ids=["memmap", "h5py"])
@pytest.mark.parametrize("window,stride", [(5, 1), (9, 4), (1, 3)])
def test_every_window_equals_numpy_slicing(tmp_path, chunked, window, stride):
    paths, arrays = recordings(tmp_path, LENGTHS, chunked=chunked)
    src = WindowedSource(paths, SIGNALS, window=window, stride=stride)
    assert all(src.index.info(f, "y").memmap is not chunked for f in range(len(paths)))
    ref = reference_windows(arrays, SIGNALS_LISTS, window, stride)
    assert len(src) == len(ref)
    assert src.channels == {"u": 4, "y": 3}
    for i, expected in enumerate(ref):
        got = src[i]
        assert set(got) == {"u", "y"}
        for key in ("u", "y"):
            assert got[key].dtype == np.float32
            np.testing.assert_array_equal(got[key], expected[key], err_msg=f"window {i} {key}")
    # negative indices count from the end, like a list
    np.testing.assert_array_equal(src[-1]["y"], ref[-1]["y"])
    # get_batch stacks the same windows, and slices chunks of them
    ids = np.array([len(ref) - 1, 0, len(ref) // 2])
    batch = src.get_batch(ids)
    for key in ("u", "y"):
        np.testing.assert_array_equal(batch[key], np.stack([ref[i][key] for i in ids]))
    if window > 2:
        part = src.get_batch(ids, start=1, stop=window - 1)
        np.testing.assert_array_equal(part["u"], np.stack([ref[i]["u"][1:-1] for i in ids]))


def test_memmap_and_h5py_files_mixed_and_float64_kept(tmp_path):
    p1, a1 = recordings(tmp_path, [12], chunked=False, dtype=np.float64, tag="c")
    p2, a2 = recordings(tmp_path, [15], chunked=True, dtype=np.float64, tag="k", seed=1)
    src = WindowedSource(p1 + p2, {"y": "y", "u": "u2"}, window=6, stride=2, dtype=None)
    ref = reference_windows(a1 + a2, {"y": ["y"], "u": ["u2"]}, 6, 2)
    assert [src.index.info(f, "y").memmap for f in range(2)] == [True, False]
    assert len(src) == len(ref)
    for i, expected in enumerate(ref):
        assert src[i]["y"].dtype == np.float64
        np.testing.assert_array_equal(src[i]["y"], expected["y"])
        np.testing.assert_array_equal(src[i]["u"], expected["u"])


def test_big_endian_and_nested_dataset_memory_mapped(tmp_path):
    data = np.arange(30, dtype=">f8").reshape(15, 2)
    path = tmp_path / "be.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("grp/sig", data=data)
    src = WindowedSource([path], {"s": "grp/sig"}, window=4, stride=5, dtype=np.float64)
    assert src.index.info(0, "grp/sig").memmap
    assert src.index.info(0, "grp/sig").dtype == np.dtype(">f8")
    for i, start in enumerate(range(0, 12, 5)):
        np.testing.assert_array_equal(src[i]["s"], data[start : start + 4].astype("<f8"))


def test_whole_files_with_window_none(tmp_path):
    paths, arrays = recordings(tmp_path, [7, 11])
    src = WindowedSource(paths, {"y": "y"}, window=None)
    assert len(src) == 2 and src.item_length is None
    np.testing.assert_array_equal(src[1]["y"], arrays[1]["y"])
    with pytest.raises(ValueError, match=r"lengths \[7, 11\].*Set a window length"):
        src.get_batch([0, 1])


def test_lists_of_signal_names_and_location(tmp_path):
    paths, arrays = recordings(tmp_path, [10, 6])
    src = WindowedSource(paths, ["u0", "y"], window=4, stride=2)
    assert src.counts == (4, 2)
    assert [src.location(i) for i in range(len(src))] == [
        (0, 0, 4),
        (0, 2, 6),
        (0, 4, 8),
        (0, 6, 10),
        (1, 0, 4),
        (1, 2, 6),
    ]
    np.testing.assert_array_equal(src[5]["u0"][:, 0], arrays[1]["u0"][2:6])
    with pytest.raises(IndexError, match=r"window 6 out of range \[0, 6\)"):
        src[6]


def test_source_pickles_and_reopens_files(tmp_path):
    p1, a1 = recordings(tmp_path, [20], tag="c")
    p2, a2 = recordings(tmp_path, [20], chunked=True, tag="k", seed=3)
    src = WindowedSource(p1 + p2, SIGNALS, window=5, stride=3)
    before = [src[i] for i in range(len(src))]  # opens maps and handles
    assert src.index.open_files == 2  # one map, one h5py handle
    clone = pickle.loads(pickle.dumps(src))
    assert clone.index.open_files == 0
    for i, item in enumerate(before):
        for key in item:
            np.testing.assert_array_equal(clone[i][key], item[key])
    # the pickle holds paths and offsets, not data
    assert len(pickle.dumps(src)) < 4000


def test_one_notice_per_h5py_file_and_none_for_memmap(tmp_path, caplog):
    p1, _ = recordings(tmp_path, [10], tag="c")
    p2, _ = recordings(tmp_path, [10], chunked=True, tag="k")
    p3, _ = recordings(tmp_path, [10], chunked=True, tag="z")
    with caplog.at_level(logging.WARNING, logger="blox.data"):
        WindowedSource(p1 + p2 + p3, SIGNALS, window=3)
    notices = [r.getMessage() for r in caplog.records if r.name == "blox.data"]
    assert len(notices) == 2
    assert p2[0] in notices[0] and p3[0] in notices[1]
    assert "'u0', 'u1', 'u2', 'y' read through h5py" in notices[0]
    assert "gzip" in notices[0] and "h5repack -l CONTI" in notices[0]


def test_index_reports_layout(tmp_path):
    path = write_h5(tmp_path / "a.h5", {"c": np.ones(8)})
    with h5py.File(path, "a") as f:
        f.create_dataset("k", data=np.ones(8), chunks=(4,), compression="gzip")
        f.create_dataset("e", shape=(8,), dtype="f4")  # never written: no offset
    index = HDF5Index([path], ["c", "k", "e"])
    c, k, e = (index.info(0, n) for n in ("c", "k", "e"))
    assert (c.layout, c.memmap, c.shape) == ("contiguous", True, (8,))
    assert (k.layout, k.chunks, k.compression, k.memmap) == ("chunked", (4,), "gzip", False)
    assert (e.layout, e.memmap) == ("contiguous", False)
    np.testing.assert_array_equal(index.read(0, "e", 0, 3), np.zeros(3, np.float32))
    assert "1/3 memory-mapped" in repr(index)


# -- errors (test 7): each names the file, the dataset and the fix --------------------


def test_error_missing_file(tmp_path):
    paths, _ = recordings(tmp_path, [10])
    missing = str(tmp_path / "nope.h5")
    with pytest.raises(FileNotFoundError, match=r"HDF5 file '.*nope\.h5' does not exist.*path"):
        WindowedSource(paths + [missing], SIGNALS, window=3)


def test_error_missing_dataset(tmp_path):
    paths, _ = recordings(tmp_path, [10])
    with pytest.raises(
        ValueError,
        match=r"HDF5 file '.*rec0\.h5' has no dataset 'u9'; it holds \['u0', 'u1', 'u2', 'y'\]"
        r"\. Fix the signal names",
    ):
        WindowedSource(paths, {"u": ["u0", "u9"], "y": "y"}, window=3)


def test_error_window_longer_than_a_file(tmp_path):
    paths, _ = recordings(tmp_path, [30, 8, 30])
    with pytest.raises(
        ValueError,
        match=r"HDF5 file '.*rec1\.h5' has 8 time steps \(dataset 'u0'\), fewer than "
        r"window=10\. Use a window <= 8, or leave this file out",
    ):
        WindowedSource(paths, SIGNALS, window=10)


def test_error_mismatched_lengths_of_u_and_y(tmp_path):
    path = write_h5(tmp_path / "bad.h5", {"u": np.zeros(50), "y": np.zeros((49, 2))})
    with pytest.raises(
        ValueError,
        match=r"HDF5 file '.*bad\.h5': datasets have different lengths \{'u': 50, 'y': 49\}.*"
        r"Trim them to a common length",
    ):
        WindowedSource([path], {"u": "u", "y": "y"}, window=5)


def test_error_mmap_only_on_a_chunked_file(tmp_path):
    p1, _ = recordings(tmp_path, [10], tag="c")
    p2, _ = recordings(tmp_path, [10], chunked=True, tag="k")
    WindowedSource(p1, SIGNALS, window=3, mmap_only=True)  # contiguous: fine
    with pytest.raises(
        ValueError,
        match=r"HDF5 file '.*k0\.h5', dataset 'u0': chunked \(7,\) with gzip compression, so "
        r"it cannot be memory-mapped \(mmap_only=True\)\. To memory-map it, store it "
        r"contiguous: h5repack -l CONTI .*mmap_only=False",
    ):
        WindowedSource(p1 + p2, SIGNALS, window=3, mmap_only=True)


def test_error_not_an_hdf5_file_and_group_as_dataset(tmp_path):
    text = tmp_path / "notes.h5"
    text.write_text("not hdf5")
    with pytest.raises(ValueError, match=r"'.*notes\.h5' could not be opened as an HDF5 file"):
        HDF5Index([text], ["u"])
    path = tmp_path / "g.h5"
    with h5py.File(path, "w") as f:
        f.create_dataset("grp/u", data=np.ones(4))
    with pytest.raises(ValueError, match=r"'grp' is a group, not a dataset.*e\.g\. 'grp/u'"):
        HDF5Index([path], ["grp"])


def test_error_rank_and_channels(tmp_path):
    path = write_h5(tmp_path / "r3.h5", {"u": np.zeros((10, 2, 2))})
    with pytest.raises(
        ValueError,
        match=r"dataset 'u' \(signal 'u'\) has shape \(10, 2, 2\); "
        r"expected \[T\] or \[T, C\]",
    ):
        WindowedSource([path], ["u"], window=2)
    a = write_h5(tmp_path / "a.h5", {"u": np.zeros((10, 2))})
    b = write_h5(tmp_path / "b.h5", {"u": np.zeros((10, 3))})
    with pytest.raises(ValueError, match=r"'.*b\.h5': signal 'u' has 3 channels but 2 in"):
        WindowedSource([a, b], ["u"], window=2)


def test_error_bad_arguments(tmp_path):
    paths, _ = recordings(tmp_path, [10])
    with pytest.raises(ValueError, match="window must be an int >= 1 or None, got 0"):
        WindowedSource(paths, SIGNALS, window=0)
    with pytest.raises(ValueError, match="stride must be an int >= 1, got 1.5"):
        WindowedSource(paths, SIGNALS, window=2, stride=1.5)
    with pytest.raises(TypeError, match=r"signals must map names to datasets.*signals=\['y'\]"):
        WindowedSource(paths, "y", window=2)
    with pytest.raises(TypeError, match=r"files must be a list of paths.*Wrap it in a list"):
        HDF5Index(paths[0], ["y"])
    with pytest.raises(TypeError, match=r"datasets must be a list of names.*\['y'\]"):
        HDF5Index(paths, "y")
    with pytest.raises(ValueError, match="no files given"):
        HDF5Index([], ["y"])
    with pytest.raises(ValueError, match="signal 'u' lists no datasets"):
        WindowedSource(paths, {"u": []}, window=2)
