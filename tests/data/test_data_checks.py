"""blox.data checks: dtypes refused at build time, bounded open files, the
in-memory cache, one notice per file, build-time reads and a quiet exit with workers."""

import logging
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time

import h5py
import numpy as np
import pytest

from blox.data import HDF5Index, WindowedSource, pipeline
from tests.data.helpers import recordings, reference_windows, write_h5

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_python(code: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


# -- variable-length strings crashed Python (memory-mapped as objects) ---------


@pytest.mark.slow
def test_variable_length_strings_raise_instead_of_crashing(tmp_path):
    path = str(tmp_path / "vlen.h5")
    code = f"""
        import h5py, numpy as np
        with h5py.File({path!r}, 'w') as f:
            f['u'] = np.zeros(9)
            f['y'] = np.array(['a'] * 9, dtype=h5py.string_dtype())
        from blox.data import WindowedSource
        try:
            WindowedSource([{path!r}], ['u', 'y'], window=4)[0]
        except ValueError as e:
            print('ValueError:', e)
        """
    done = _run_python(code)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -11: segfault
    assert "ValueError:" in done.stdout and path in done.stdout
    assert "dataset 'y' holds variable-length strings" in done.stdout


# -- non-numeric datasets, refused when the index is built ---------------------


@pytest.mark.parametrize(
    "data,words",
    [
        (np.array([b"1.5"] * 9), r"fixed-length strings \(dtype \|S3\)"),  # digits: no parse
        (np.array([b"abc"] * 9), r"fixed-length strings"),
        (np.zeros(9, [("a", "f4"), ("b", "i4")]), r"a compound type with fields \['a', 'b'\]"),
        (np.array(["x"] * 9, dtype=h5py.string_dtype()), "variable-length strings"),
    ],
    ids=["digit-bytes", "bytes", "compound", "vlen-str"],
)
@pytest.mark.parametrize("chunked", [False, True], ids=["contiguous", "chunked"])
def test_non_numeric_datasets_refused_at_build_naming_file_and_dataset(
    tmp_path, data, words, chunked
):
    path = write_h5(tmp_path / "bad.h5", {"u": np.zeros(9), "y": data}, chunked=chunked)
    for dtype in (np.float32, None):
        with pytest.raises(ValueError, match=rf"bad\.h5', dataset 'y' holds {words}.*integer"):
            WindowedSource([path], ["u", "y"], window=4, dtype=dtype)
    with pytest.raises(ValueError, match=rf"dataset 'y' holds {words}"):
        HDF5Index([path], ["y"])
    assert HDF5Index([path], ["u"]).read(0, "u", 0, 2).tolist() == [0.0, 0.0]  # others fine


def test_bool_and_integer_datasets_are_numbers(tmp_path):
    flags = np.arange(9) % 3 == 0
    codes = (np.arange(9) * 7).astype(np.uint16)
    path = write_h5(tmp_path / "ok.h5", {"f": flags, "c": codes})
    src = WindowedSource([path], ["f", "c"], window=4, dtype=None)
    np.testing.assert_array_equal(src[2]["f"][:, 0], flags[2:6])
    np.testing.assert_array_equal(src[2]["c"][:, 0], codes[2:6])
    assert src.dtypes == {"f": np.dtype(bool), "c": np.dtype(np.uint16)}


# -- complex data was cast to real (a ComplexWarning only) ---------------------


@pytest.mark.parametrize("chunked", [False, True], ids=["memmap", "h5py"])
def test_complex_refused_for_a_real_dtype_and_kept_when_asked(tmp_path, chunked):
    z = (np.arange(12.0) + 1j * np.arange(12.0)[::-1]).reshape(6, 2)
    path = write_h5(tmp_path / "z.h5", {"u": np.arange(6.0), "z": z}, chunked=chunked)
    with pytest.raises(ValueError, match=r"z\.h5', dataset 'z' \(signal 'y'\) is complex.*"):
        WindowedSource([path], {"u": "u", "y": "z"}, window=3)
    with pytest.raises(ValueError, match=r"dtype=None .*complex64.*\['z_re', 'z_im'\]"):
        WindowedSource([path], {"u": "u", "y": "z"}, window=3, dtype=np.float64)
    kept = WindowedSource([path], {"u": "u", "y": "z"}, window=3, dtype=None)
    np.testing.assert_array_equal(kept[1]["y"], z[1:4])
    assert kept[1]["y"].dtype == np.complex128 and kept[1]["u"].dtype == np.float64
    c64 = WindowedSource([path], {"u": "u", "y": "z"}, window=3, dtype=np.complex64)
    np.testing.assert_array_equal(c64[2]["y"], z[2:5].astype(np.complex64))
    with pytest.raises(ValueError, match=r"dataset 'z' .* is complex.*dtype=float64"):
        kept.read(0, 0, 3, dtype=np.float64)  # e.g. channel_stats' float64 blocks


# -- open files bounded (an LRU of maps and handles) ---------------------------


@pytest.mark.slow
def test_two_hundred_files_under_a_limit_of_64_open_files(tmp_path):
    folder = str(tmp_path)
    code = f"""
        import logging, os, resource
        import h5py, numpy as np
        from blox.data import WindowedSource
        logging.getLogger('blox.data').setLevel(logging.ERROR)  # 200 h5py notices
        folder = {folder!r}
        paths, data = [], []
        for i in range(200):
            u = np.arange(12.0) + 100 * i
            p = os.path.join(folder, f'r{{i}}.h5')
            with h5py.File(p, 'w') as f:
                f.create_dataset('u', data=u)                                    # memory map
                f.create_dataset('y', data=-u, chunks=(4,), compression='gzip')  # h5py
            paths.append(p)
            data.append(u)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        src = WindowedSource(paths, ['u', 'y'], window=5, stride=7)
        assert len(src) == 400
        gen = np.random.default_rng(0)
        for i in list(range(400)) + gen.integers(0, 400, 600).tolist():
            f, start = divmod(i, 2)
            w = src[i]
            want = data[f][start * 7 : start * 7 + 5]
            assert np.array_equal(w['u'][:, 0], want) and np.array_equal(w['y'][:, 0], -want), i
        print('ok', len(os.listdir('/proc/self/fd')), src.index.open_files)
        """
    done = _run_python(code)
    assert done.returncode == 0, done.stderr[-3000:]  # was: Too many open files
    assert done.stdout.startswith("ok ")
    assert int(done.stdout.split()[1]) < 64 and done.stdout.split()[2] == "32"


def test_open_files_lru_and_close(tmp_path):
    paths, arrays = recordings(tmp_path, [12] * 5)
    chunked, karrays = recordings(tmp_path, [12] * 3, chunked=True, tag="k", seed=2)
    src = WindowedSource(paths + chunked, {"y": "y"}, window=4, stride=8, max_open_files=3)
    ref = reference_windows(arrays + karrays, {"y": ["y"]}, 4, 8)
    for rep in range(2):
        for i in range(len(src)):
            np.testing.assert_array_equal(src[i]["y"], ref[i]["y"])
            assert src.index.open_files == (min(i // 2 + 1, 3) if rep == 0 else 3)
    src.index.close()
    assert src.index.open_files == 0
    np.testing.assert_array_equal(src[0]["y"], ref[0]["y"])  # reopens
    with pytest.raises(ValueError, match=r"max_open_files must be an int >= 1, got 0"):
        HDF5Index(paths, ["y"], max_open_files=0)
    with pytest.raises(ValueError, match=r"cache_bytes must be an int >= 0, got -1"):
        WindowedSource(paths, ["y"], window=4, cache_bytes=-1)


# -- an in-memory cache for small compressed recordings ------------------------


def test_cache_keeps_compressed_recordings_in_memory(tmp_path):
    paths, arrays = recordings(tmp_path, [20, 16], chunked=True)
    signals = {"u": ["u0", "u2"], "y": "y"}
    ref = reference_windows(arrays, {"u": ["u0", "u2"], "y": ["y"]}, 5, 3)
    per_file = 20 * 3 * 4 + 20 * 3 * 4  # u0 [20], u2 [20, 2], y [20, 3] float32
    src = WindowedSource(paths, signals, window=5, stride=3, cache_bytes=2 * per_file,
                         max_open_files=1)  # fmt: skip
    small = WindowedSource(paths, signals, window=5, stride=3, cache_bytes=20 * 4 * 2,
                           max_open_files=1)  # fmt: skip
    for s in (src, small):
        for i in range(len(ref)):
            for k in ref[i]:
                np.testing.assert_array_equal(s[i][k], ref[i][k])
    # file 0 was read whole into memory: with its handle closed (max_open_files=1) and
    # the file gone, its windows still read; without room in the cache they cannot.
    os.rename(paths[0], paths[0] + ".moved")
    for i in range(5):
        for k in ref[i]:
            np.testing.assert_array_equal(src[i][k], ref[i][k])
    with pytest.raises((OSError, FileNotFoundError)):
        small[0]  # u2 [20, 2] (160 bytes) does not fit: read from the (moved) file
    os.rename(paths[0] + ".moved", paths[0])


def test_cache_is_bounded_least_recently_used_first(tmp_path):
    paths, arrays = recordings(tmp_path, [10, 10, 10], chunked=True)
    src = WindowedSource(paths, {"y": "y"}, window=10, cache_bytes=2 * 10 * 3 * 4,
                         max_open_files=1)  # fmt: skip
    for f in (0, 1, 2):  # the cache holds two files' y: file 0 is dropped at file 2
        np.testing.assert_array_equal(src[f]["y"], arrays[f]["y"])
    for f in (1, 2, 0):
        os.rename(paths[f], paths[f] + ".moved")
    np.testing.assert_array_equal(src[1]["y"], arrays[1]["y"])
    np.testing.assert_array_equal(src[2]["y"], arrays[2]["y"])
    with pytest.raises((OSError, FileNotFoundError)):
        src[0]


# -- one notice per file (and process), however many indexes read it ----------


def test_one_notice_per_file_across_indexes(tmp_path, caplog):
    p1, _ = recordings(tmp_path, [10], chunked=True, tag="k")
    p2, _ = recordings(tmp_path, [10], chunked=True, tag="z")
    with caplog.at_level(logging.WARNING, logger="blox.data"):
        WindowedSource(p1, {"u": "u0"}, window=3)
        WindowedSource(p1, {"u": "u0"}, window=5)  # same file, same dataset: no new notice
        HDF5Index(p1 + p2, ["u0", "y"])  # 'y' of file 1 is new, and all of file 2
    notices = [r.getMessage() for r in caplog.records if r.name == "blox.data"]
    assert len(notices) == 3
    assert p1[0] in notices[0] and "'u0' read through h5py" in notices[0]
    assert p1[0] in notices[1] and "'y' read through h5py" in notices[1]
    assert p2[0] in notices[2] and "'u0', 'y' read through h5py" in notices[2]


# -- bad data found at build time; no noise at exit after close() -------------


class _Broken:
    """A source whose items cannot be read (e.g. a file deleted after indexing)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        raise OSError(f"item {i}: unable to open file 'gone.h5'")


class _NotDicts:
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.zeros(3)


def test_unreadable_source_fails_when_the_pipeline_is_built():
    with pytest.raises(OSError, match=r"reading item 0 .* failed at build time.*gone\.h5"):
        pipeline(_Broken(), batch_size=2)
    with pytest.raises(TypeError, match=r"items of type ndarray; items must be dicts"):
        pipeline(_NotDicts(), batch_size=2)


@pytest.mark.slow
def test_no_exception_ignored_at_exit_after_close():
    code = """
        import numpy as np
        from blox.data import ArraySource, pipeline
        if __name__ == '__main__':
            src = ArraySource({'x': np.arange(40.0)})
            ds = pipeline(src, batch_size=4, shuffle=True, seed=0, num_epochs=None,
                          drop_remainder=True, num_workers=1)
            it = iter(ds)                      # a module-level name, alive at exit
            batches = [next(it)['x'] for _ in range(3)]
            it.close()
            print(len(set(np.concatenate(batches).tolist())))
        """
    done = _run_python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "12"
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]


# -- files changed after indexing ------------------------------------------------------


def _rewrite(path, how, u, y):
    """Rewrites `path` with the same dataset names and a new layout or content."""
    time.sleep(0.02)  # a later rewrite, also on file systems with coarse timestamps
    if how == "swapped":  # same size and inode: y stored first, so the offsets swap
        with h5py.File(path, "w") as f:
            f.create_dataset("y", data=y)
            f.create_dataset("u", data=u)
    elif how == "replaced":  # written elsewhere and moved over it: a new inode
        write_h5(path + ".new", {"y": y, "u": u})
        os.replace(path + ".new", path)
    else:  # "longer": appended rows, a new size
        u, y = np.concatenate([u, u]), np.concatenate([y, y])
        write_h5(path, {"u": u, "y": y})
    return u, y


@pytest.mark.parametrize("how", ["swapped", "replaced", "longer"])
def test_a_file_changed_after_indexing_raises_at_open(tmp_path, how):
    u, y = np.arange(12.0), -100.0 - np.arange(12.0)
    path = write_h5(tmp_path / "run.h5", {"u": u, "y": y})
    src = WindowedSource([path], ["u", "y"], window=4, stride=4)
    shipped = pickle.dumps(src)  # what Grain sends a worker process, before any read
    np.testing.assert_array_equal(src[1]["u"][:, 0], u[4:8])
    src.index.close()
    u2, y2 = _rewrite(path, how, u + 1000.0, y - 1000.0)
    changed = {"swapped": "modified at", "replaced": "inode", "longer": "size 2[0-9]+ -> "}
    match = rf"HDF5 file '{re.escape(path)}' changed after it was indexed \(.*{changed[how]}"
    # a stale index used to read the old offsets: y's bytes (or the new u) as u, silently
    with pytest.raises(ValueError, match=match + r".*source\.reindex\(\)"):
        src[1]
    worker = pickle.loads(shipped)  # a worker's first open checks the pickled index
    with pytest.raises(ValueError, match=match + r".*pickled copy of the old index"):
        worker[0]
    fresh = src.reindex()
    assert fresh.lengths == (len(u2),) and len(fresh) == len(u2) // 4
    np.testing.assert_array_equal(fresh[1]["u"][:, 0], u2[4:8])
    np.testing.assert_array_equal(fresh[1]["y"][:, 0], y2[4:8])
    index = HDF5Index([path], ["y"], max_open_files=1).reindex()
    np.testing.assert_array_equal(index.read(0, "y", 2, 5), y2[2:5])
    fresh.index.close()
    os.replace(path, path + ".moved")
    with pytest.raises(FileNotFoundError, match=rf"'{re.escape(path)}' was indexed but is gone"):
        fresh[0]


def test_a_changed_file_raises_through_the_cache(tmp_path):
    u, y = np.arange(20.0), np.arange(20.0) * 3
    path = write_h5(tmp_path / "z.h5", {"u": u, "y": y}, chunked=True)
    src = WindowedSource([path], ["u", "y"], window=5, stride=5, cache_bytes=1 << 20)
    ds = pipeline(src, batch_size=2)  # reads item 0 at build: file 0 opened and cached
    # replaced (a rewrite in place by another process reads the same; HDF5 refuses it
    # from this one, which holds the file open)
    u2, _ = _rewrite(path, "replaced", u[::-1].copy(), y[::-1].copy())
    # the cache already holds the indexed content (read before the change): still right
    first = next(iter(ds))
    np.testing.assert_array_equal(first["u"][:, :, 0], [u[0:5], u[5:10]])
    # a new process's cache (a pickled source) fills from the file: checked at that open
    with pytest.raises(ValueError, match=r"z\.h5' changed after it was indexed \(.*inode"):
        pickle.loads(pickle.dumps(src))[0]
    src.index.close()  # this process reopens it at the next read, and checks it
    with pytest.raises(ValueError, match=r"changed after it was indexed"):
        src[0]
    np.testing.assert_array_equal(src.reindex()[3]["u"][:, 0], u2[15:20])


@pytest.mark.slow
def test_a_grain_worker_checks_a_changed_file(tmp_path):
    u, y = np.arange(20.0), np.arange(20.0) * 3
    path = write_h5(tmp_path / "w.h5", {"u": u, "y": y})
    src = WindowedSource([path], ["u", "y"], window=5, stride=5)
    workers = pipeline(src, batch_size=2, num_workers=1)  # reads item 0 here, at build
    _rewrite(path, "swapped", u, y)  # the same bytes, y first: u's offset now holds y
    it = iter(workers)
    try:  # the spawned worker's first open of the file raises there; Grain passes it on
        with pytest.raises(ValueError, match=r"w\.h5' changed after it was indexed"):
            next(it)
    finally:
        it.close()
