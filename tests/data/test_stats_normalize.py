"""Normalization statistics (test 6) and the Normalize module (raw-in/raw-out)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx
import blox.data._arrays
from blox.data import ArraySource, Normalize, WindowedSource, channel_stats
from tests.data.helpers import recordings, write_h5
from tests.tolerances import tol


@pytest.mark.parametrize("block_rows", [7, 1 << 16])
def test_stats_equal_numpy_over_the_concatenated_training_data(tmp_path, block_rows):
    p1, a1 = recordings(tmp_path, [50, 31], tag="c")
    p2, a2 = recordings(tmp_path, [44], chunked=True, tag="k", seed=2)
    # a large offset with a small spread: the naive sum-of-squares formula would fail
    rng = np.random.default_rng(5)
    big = [1e4 + 1e-2 * rng.normal(size=(t, 2)) for t in (20, 13)]
    p3 = [
        write_h5(
            tmp_path / f"b{i}.h5",
            {"u0": b[:, 0], "u1": b[:, 0] * 0, "u2": b, "y": np.zeros((len(b), 3))},
        )
        for i, b in enumerate(big)
    ]
    arrays = (
        a1
        + a2
        + [{"u0": b[:, 0], "u1": b[:, 0] * 0, "u2": b, "y": np.zeros((len(b), 3))} for b in big]
    )
    signals = {"u": ["u0", "u2"], "y": "y"}
    # overlapping windows (stride 1 < window) must not count samples twice
    src = WindowedSource(p1 + p2 + p3, signals, window=5, stride=1)
    stats = channel_stats(src, block_rows=block_rows)
    u = np.concatenate([np.column_stack([a["u0"], a["u2"]]) for a in arrays]).astype(np.float64)
    y = np.concatenate([a["y"] for a in arrays]).astype(np.float64)
    assert stats["u"].count == stats["y"].count == sum(src.lengths) == len(u)
    for key, ref in (("u", u), ("y", y)):
        assert stats[key].mean.dtype == np.float64 and stats[key].mean.shape == (ref.shape[1],)
        np.testing.assert_allclose(stats[key].mean, ref.mean(0), rtol=1e-6, atol=1e-12)
        np.testing.assert_allclose(stats[key].std, ref.std(0), rtol=1e-6, atol=1e-12)
    # the big-offset channels alone: the std of a 1e4-offset signal with 1e-2 spread
    sb = channel_stats(WindowedSource(p3, {"u": "u2"}, window=3), block_rows=4)["u"]
    np.testing.assert_allclose(sb.std, np.concatenate(big).std(0), rtol=1e-6)


def test_stats_of_images_per_channel_and_names():
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, size=(9, 5, 4, 3)).astype(np.uint8)
    y = np.arange(9)
    stats = channel_stats(ArraySource({"x": x, "y": y}), names=["x"], block_rows=2)
    assert set(stats) == {"x"}
    ref = x.reshape(-1, 3).astype(np.float64)
    np.testing.assert_allclose(stats["x"].mean, ref.mean(0), rtol=1e-12)
    np.testing.assert_allclose(stats["x"].std, ref.std(0), rtol=1e-12)
    assert stats["x"].count == 9 * 5 * 4


def test_stats_errors():
    src = ArraySource({"x": np.zeros((3, 2))})
    with pytest.raises(ValueError, match=r"no signal \['u'\] .* it has \['x'\]"):
        channel_stats(src, names=["u"])
    with pytest.raises(ValueError, match="block_rows must be an int >= 1, got 0"):
        channel_stats(src, block_rows=0)
    with pytest.raises(TypeError, match=r"list has no blocks\(\) method.*ArraySource"):
        channel_stats([1, 2])


def test_normalize_matches_numpy_and_round_trips():
    mean, std = np.array([1.5, -20.0, 300.0]), np.array([0.5, 4.0, 25.0])
    norm = Normalize(bx.Graph("net") / "u_norm", mean, std)
    x = np.random.default_rng(0).normal(size=(2, 7, 3)) * std + mean
    z, params = norm(bx.Params(), x.astype(np.float32))
    np.testing.assert_allclose(z, (x - mean) / std, **tol(jnp.float32))
    assert z.dtype == jnp.float32
    back, params2 = norm.denormalize(params, z)
    np.testing.assert_allclose(back, x, rtol=1e-5, atol=1e-4)
    assert params2 is params  # nothing created twice
    for name, value in (("mean", mean), ("std", std)):
        p = params[("net", "u_norm", name)]
        assert p.trainable is False and p.value.shape == (3,) and p.value.dtype == jnp.float32
        np.testing.assert_allclose(p.value, value.astype(np.float32))
    np.testing.assert_allclose(norm.std(params), std.astype(np.float32))
    np.testing.assert_allclose(norm.mean(params), mean.astype(np.float32))


def test_normalize_stats_live_in_params_and_get_no_gradient():
    g = bx.Graph("model")
    u_norm = Normalize(g / "u_norm", [2.0], [4.0])
    y_norm = Normalize(g / "y_norm", [10.0, -1.0], [5.0, 0.5])
    rng = bx.Rng(g / "rng")
    lin = bx.Linear(g / "out", 2, rng)

    def model(params, u):  # raw in, raw out
        z, params = u_norm(params, u)
        h, params = lin(params, z)
        return y_norm.denormalize(params, h)

    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, jnp.ones((3, 1)))
    params = params.locked()
    trainable, rest = params.split()
    assert ("model", "u_norm", "mean") in rest and ("model", "y_norm", "std") in rest
    assert not any(k[1] in ("u_norm", "y_norm") for k in trainable.keys())

    def loss(params, u, y):
        pred, params = model(params, u)
        return bx.normalized_mse(pred, y, y_norm.std(params)), params

    u = jnp.array([[0.0], [4.0], [8.0]])
    y = jnp.array([[10.0, -1.0], [12.0, 0.0], [14.0, 1.0]])
    value, grads, _ = jax.jit(bx.value_and_grad(loss))(params, u, y)
    assert np.isfinite(float(value))
    assert not any(k[1] in ("u_norm", "y_norm") for k in grads.keys())
    # params restored from elsewhere (a checkpoint) win over the constructor's statistics
    other = Normalize(bx.Graph("model") / "u_norm", [0.0], [1.0])
    z, _ = other(params, jnp.array([[6.0]]))
    np.testing.assert_allclose(z, [[1.0]])  # (6 - 2) / 4 with the stored statistics


@pytest.mark.parametrize(
    "in_dtype,dtype,out",
    [
        (jnp.bfloat16, None, jnp.float32),
        (jnp.uint8, None, jnp.float32),
        (jnp.float32, jnp.bfloat16, jnp.bfloat16),
        (jnp.float16, jnp.float16, jnp.float16),
    ],
)
def test_normalize_dtype_policy(in_dtype, dtype, out):
    mean, std = np.array([100.0, 50.0]), np.array([20.0, 10.0])
    norm = Normalize(bx.Graph("n") / "x", mean, std, dtype=dtype)
    x = np.array([[120.0, 30.0], [80.0, 70.0], [100.0, 55.0]])
    z, params = norm(bx.Params(), jnp.asarray(x, in_dtype))
    assert z.dtype == out
    np.testing.assert_allclose(np.asarray(z, np.float64), (x - mean) / std, **tol(out))
    raw, _ = norm.denormalize(params, z)
    np.testing.assert_allclose(
        np.asarray(raw, np.float64), x, rtol=tol(out)["rtol"] * 4, atol=tol(out)["atol"] * 200
    )


def test_normalize_errors():
    g = bx.Graph("net")
    with pytest.raises(
        ValueError,
        match=r"Normalize 'net/a': std must be positive, "
        r"but channels \[1\] have std \[0\.0\].*np\.where\(std == 0, 1\.0, std\)",
    ):
        Normalize(g / "a", [0.0, 0.0], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"'net/b': mean has shape \(2,\) and std \(3,\)"):
        Normalize(g / "b", [0.0, 0.0], [1.0, 1.0, 1.0])
    norm = Normalize(g / "c", [0.0, 0.0], [1.0, 1.0])
    with pytest.raises(
        ValueError,
        match=r"'net/c': input has shape \(4, 3\), but the statistics "
        r"have 2 channels; the last axis must be 2",
    ):
        norm(bx.Params(), jnp.zeros((4, 3)))
    with pytest.raises(KeyError, match=r"Parameter 'net/c/std' not found"):
        norm.std(bx.Params())


# -- NaN or inf in training data ----------------------------------------------------


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    "file,dataset,t,col",
    [(1, "u2", 13, 1), (0, "u0", 0, None), (2, "y", 43, 2)],  # file 2 is chunked + gzip
    ids=["2d-mid", "1d-first", "chunked-last"],
)
def test_channel_stats_names_the_first_non_finite_sample(tmp_path, value, file, dataset, t, col):
    p1, a1 = recordings(tmp_path, [50, 31], tag="c")
    p2, a2 = recordings(tmp_path, [44], chunked=True, tag="k", seed=2)
    paths, arrays = p1 + p2, a1 + a2
    arrays[file][dataset][(t,) if col is None else (t, col)] = value
    if (file, t) != (2, 43):
        arrays[2]["u0"][40] = np.nan  # a later bad value: not the first
    for f, data in enumerate(arrays):
        write_h5(paths[f], data, chunked=f == 2)
    signals = {"u": ["u0", "u2"], "y": "y"}
    src = WindowedSource(paths, signals, window=5, stride=2)
    channel = {"u0": 0, "u2": 1 + (col or 0), "y": col}[dataset]
    key = "y" if dataset == "y" else "u"
    column = "" if col is None else f", column {col}"
    where = (
        rf"signal '{key}' holds {re.escape(str(value))} at HDF5 file "
        rf"'{re.escape(paths[file])}', dataset '{dataset}'{column} \(channel {channel} of "
        rf"signal '{key}'\), sample {t} of {len(arrays[file]['u0'])}: the first non-finite"
    )
    for block_rows in (7, 1 << 16):
        with pytest.raises(ValueError, match=where + r".*check_finite=False"):
            channel_stats(src, block_rows=block_rows)
    # the opt-out: NumPy's statistics of the same data, non-finite where the data is
    got = channel_stats(src, check_finite=False, block_rows=7)[key]
    ref = np.concatenate(
        [np.column_stack([a["u0"], a["u2"]]) if key == "u" else a["y"] for a in arrays]
    ).astype(np.float64)
    with np.errstate(invalid="ignore"):
        mean, std = ref.mean(0), ref.std(0)
    np.testing.assert_array_equal(np.isfinite(got.mean), np.isfinite(mean))
    assert not np.isfinite(got.mean[channel]) and not np.isfinite(got.std[channel])
    finite = np.isfinite(mean)
    np.testing.assert_allclose(got.mean[finite], mean[finite], rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(got.std[finite], std[finite], rtol=1e-6, atol=1e-12)
    # Normalize then blames the data, not a constant channel, and suggests no cover-up
    bad = re.escape(str(np.flatnonzero(~finite).tolist()))
    assert channel in np.flatnonzero(~finite)
    with pytest.raises(ValueError, match=rf"std is not finite in channels {bad}.*"
                       r"holds NaN or inf.*channel_stats") as err:  # fmt: skip
        Normalize(bx.Graph("m") / "n", np.where(finite, got.mean, 0.0), got.std)
    assert "constant" not in str(err.value) and "np.where" not in str(err.value)
    with pytest.raises(ValueError, match=r"mean is not finite in channels"):
        Normalize(bx.Graph("m") / "n", got.mean, np.ones_like(got.std))


@pytest.mark.parametrize("block", [1 << 24, 24, 30], ids=["one-block", "1-per-block", "odd"])
def test_array_source_refuses_non_finite_values_unless_told(monkeypatch, tmp_path, block):
    monkeypatch.setattr(blox.data._arrays, "_FINITE_BLOCK", block)  # examples per check
    x = np.random.default_rng(0).normal(size=(6, 4, 3, 2))
    x[4, 1, 2, 0] = np.inf
    x[3, 2, 0, 1] = np.nan  # the first in example order
    first = r"array 'x' holds nan at example 3 \(element \[3, 2, 0, 1\]\), its first non-"
    with pytest.raises(ValueError, match=first + r"finite value.*check_finite=False"):
        ArraySource({"x": x, "y": np.arange(6)})
    with pytest.raises(ValueError, match=r"holds inf at example 4 \(element \[4, 1, 2, 0\]"):
        ArraySource({"x": np.where(np.isnan(x), 0.0, x)})
    # a file's memory map is not read when the source is built; channel_stats checks it
    mm = np.memmap(tmp_path / "x.npy", dtype=np.float64, mode="w+", shape=x.shape)
    mm[:] = x
    with pytest.raises(ValueError, match=r"signal 'x' holds nan at array 'x', example 3"):
        channel_stats(ArraySource({"x": mm}))
    ArraySource({"x": np.zeros(x.shape, np.int64), "y": np.arange(6)})  # ints: always finite
    src = ArraySource({"x": x, "y": np.arange(6)}, check_finite=False)
    with pytest.raises(ValueError, match=r"signal 'x' holds nan at array 'x', example 3, "
                       r"element \[3, 2, 0, 1\]: the first non-finite"):  # fmt: skip
        channel_stats(src, block_rows=2)
    got = channel_stats(src, check_finite=False)["x"]
    assert got.mean[0] == np.inf and np.isnan(got.mean[1])  # inf in channel 0, nan in 1
    y = channel_stats(src, names=["y"])["y"]  # the other array is finite: no error
    np.testing.assert_allclose(y.mean, [2.5])


def test_the_constant_channel_fix_keeps_a_nan_visible():
    # The message's fix for std 0 must not turn a NaN std into 1 (np.where(std > 0, ...)
    # did): applied to [0, nan] it keeps the nan, which Normalize then refuses.
    std = np.array([0.0, np.nan])
    with pytest.raises(ValueError, match=r"std is not finite in channels \[1\]"):
        Normalize(bx.Graph("m") / "n", [0.0, 0.0], std)
    fixed = np.where(std == 0, 1.0, std)
    assert fixed[0] == 1.0 and np.isnan(fixed[1])
    with pytest.raises(ValueError, match=r"std is not finite in channels \[1\]"):
        Normalize(bx.Graph("m") / "n", [0.0, 0.0], fixed)
    with pytest.raises(ValueError, match=r"channels \[0\] have std \[-1.0\]"):
        Normalize(bx.Graph("m") / "n", [0.0], [-1.0])
