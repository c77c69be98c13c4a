"""Simulated benchmark systems, their excitation signals, and the HDF5 files they go to.

Three systems, each deterministic by seed (NumPy's ``default_rng(seed)``):

- `simulate_duffing`: a Silverbox-like Duffing oscillator,
  ``y'' + 2 zeta omega y' + omega^2 (y + kappa y^3) = omega^2 u``, integrated with RK4
  (``substeps`` per sample, the input held constant over a sample);
- `simulate_wiener_hammerstein`: linear filter, static saturation, linear filter;
- `simulate_discrete`: a cheap discrete nonlinear system for tests (Narendra-Parthasarathy).

`make_dataset` writes training / validation / test recordings of one of them to contiguous
HDF5 files (``u`` and ``y`` datasets of shape ``[T]``) that `blox.data.WindowedSource` reads
through memory maps: noisy outputs for training and validation, clean test targets.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import h5py
import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from blox.data import WindowedSource

__all__ = [
    "SILVERBOX_FS",
    "DatasetFiles",
    "band_limited_noise",
    "make_dataset",
    "odd_multisine",
    "read_recordings",
    "simulate_discrete",
    "simulate_duffing",
    "simulate_wiener_hammerstein",
    "write_hdf5",
]

SILVERBOX_FS = 1e7 / 2**14
"""The Silverbox sampling frequency, ``10^7 / 2^14`` Hz (about 610.35 Hz)."""


# -- excitation signals --------------------------------------------------------------------


def _check_positive_int(where: str, name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value <= 0:
        raise ValueError(f"{where}: {name} must be a positive int, got {value!r}.")
    return int(value)


def _check_band(where: str, fs: float, f_max: float) -> None:
    if not 0 < f_max <= fs / 2:
        raise ValueError(
            f"{where}: f_max={f_max} Hz must be in (0, fs / 2] = (0, {fs / 2}] (the Nyquist "
            "frequency); lower f_max or raise fs."
        )


def odd_multisine(
    rng: np.random.Generator,
    period: int,
    *,
    fs: float,
    f_max: float,
    rms: float,
    periods: int = 1,
) -> np.ndarray:
    """An odd random-phase multisine: equal amplitudes on the odd harmonics of
    ``fs / period`` up to `f_max`, phases uniform in ``[0, 2 pi)``, scaled to `rms`.

    Returns ``[period * periods]`` float64 (the period repeated; steady state after the
    first). Raises ``ValueError`` when `f_max` is above Nyquist or below the first line.
    """
    where = "odd_multisine"
    period = _check_positive_int(where, "period", period)
    periods = _check_positive_int(where, "periods", periods)
    _check_band(where, fs, f_max)
    lines = np.arange(1, period // 2, 2)
    lines = lines[lines * fs / period <= f_max]
    if lines.size == 0:
        raise ValueError(
            f"{where}: no odd harmonic of fs / period = {fs / period:.4g} Hz lies below "
            f"f_max={f_max} Hz; use a longer period or a higher f_max."
        )
    spectrum = np.zeros(period // 2 + 1, complex)
    spectrum[lines] = np.exp(2j * np.pi * rng.uniform(size=lines.size))
    x = np.fft.irfft(spectrum, n=period)
    x *= rms / np.sqrt(np.mean(x**2))
    return np.tile(x, periods)


def band_limited_noise(
    rng: np.random.Generator,
    length: int,
    *,
    fs: float,
    f_max: float,
    rms: float | np.ndarray,
) -> np.ndarray:
    """Gaussian noise with its spectrum cut above `f_max` (an ideal low-pass by FFT).

    `rms` is a scalar or a ``[length]`` envelope (e.g. ``np.linspace(0, a, length)`` for
    Silverbox's ramped-amplitude "arrow head" test input): the unit-RMS filtered noise is
    multiplied by it. Returns ``[length]`` float64.
    """
    where = "band_limited_noise"
    length = _check_positive_int(where, "length", length)
    _check_band(where, fs, f_max)
    spectrum = np.fft.rfft(rng.standard_normal(length))
    freqs = np.fft.rfftfreq(length, 1 / fs)
    spectrum[freqs > f_max] = 0
    spectrum[0] = 0
    x = np.fft.irfft(spectrum, n=length)
    return x / np.sqrt(np.mean(x**2)) * rms


# -- systems ---------------------------------------------------------------------------------


def _as_batch(where: str, u: ArrayLike) -> tuple[np.ndarray, bool]:
    x = np.asarray(u, np.float64)
    if x.ndim not in (1, 2) or x.shape[-1] == 0:
        raise ValueError(
            f"{where}: u must be [T] or [B, T] (one input channel), got shape {x.shape}."
        )
    return (x[None] if x.ndim == 1 else x), x.ndim == 1


def simulate_duffing(
    u: ArrayLike,
    *,
    fs: float = SILVERBOX_FS,
    f0: float = 68.58,
    zeta: float = 0.0468,
    kappa: float = 1.0,
    substeps: int = 4,
) -> np.ndarray:
    """Simulates the Silverbox-like Duffing oscillator from rest.

    ``y'' + 2 zeta omega y' + omega^2 (y + kappa y^3) = omega^2 u`` with
    ``omega = 2 pi f0``; the input is held over each sample (zero-order hold) and the state
    ``(y, y')`` advanced by `substeps` classic RK4 steps of ``1 / (fs * substeps)``
    (a ``lax.scan`` in float32, so 10^5 samples take well under a second).

    Args:
      u: ``[T]`` or ``[B, T]`` input in volts.
      fs: sampling frequency in Hz (Silverbox: ``10^7 / 2^14``).
      f0: undamped natural frequency in Hz.
      zeta: damping ratio.
      kappa: cubic stiffness coefficient in V^-2 (0 gives the linear oscillator).
      substeps: RK4 steps per sample.

    Returns:
      ``y`` with the shape of `u` (float64 array of the float32 result); ``y[t]`` is the
      output at sample time ``t / fs``, before the input ``u[t]`` acts.
    """
    where = "simulate_duffing"
    x, squeeze = _as_batch(where, u)
    substeps = _check_positive_int(where, "substeps", substeps)
    if not (fs > 0 and f0 > 0 and zeta >= 0):
        raise ValueError(f"{where}: need fs > 0, f0 > 0 and zeta >= 0; got {fs}, {f0}, {zeta}.")
    w = 2 * math.pi * f0
    h = 1.0 / (fs * substeps)

    def deriv(y, v, ut):
        return v, w * w * (ut - y - kappa * y * y * y) - 2 * zeta * w * v

    def rk4(carry, ut):
        y, v = carry
        for _ in range(substeps):
            k1y, k1v = deriv(y, v, ut)
            k2y, k2v = deriv(y + 0.5 * h * k1y, v + 0.5 * h * k1v, ut)
            k3y, k3v = deriv(y + 0.5 * h * k2y, v + 0.5 * h * k2v, ut)
            k4y, k4v = deriv(y + h * k3y, v + h * k3v, ut)
            y = y + h / 6 * (k1y + 2 * k2y + 2 * k3y + k4y)
            v = v + h / 6 * (k1v + 2 * k2v + 2 * k3v + k4v)
        return (y, v), carry[0]

    @jax.jit
    def run(us):
        zero = jnp.zeros(us.shape[0], jnp.float32)
        _, ys = jax.lax.scan(rk4, (zero, zero), us.T)
        return ys.T

    y = np.asarray(run(jnp.asarray(x, jnp.float32)), np.float64)
    return y[0] if squeeze else y


def _resonator(length: int, freq: float, damping: float, fs: float) -> np.ndarray:
    """Impulse response ``[length]`` of a unit-DC-gain second-order low-pass
    (a discretized resonance at `freq` Hz with damping ratio `damping`)."""
    r = math.exp(-damping * 2 * math.pi * freq / fs)
    theta = 2 * math.pi * freq / fs * math.sqrt(max(1 - damping**2, 1e-12))
    a1, a2 = 2 * r * math.cos(theta), -(r**2)
    h = np.zeros(length)
    prev1 = prev2 = 0.0
    for n in range(length):
        cur = (1.0 if n == 0 else 0.0) + a1 * prev1 + a2 * prev2
        h[n], prev2, prev1 = cur, prev1, cur
    return h / h.sum()


WH_FS = 1.0
"""Normalized sampling frequency of the Wiener-Hammerstein-like system (cycles/sample)."""


def simulate_wiener_hammerstein(u: ArrayLike, *, taps: int = 128) -> np.ndarray:
    """Simulates the Wiener-Hammerstein-like system: ``G2(f(G1(u)))``.

    ``G1``: a resonant low-pass (resonance at 0.05 cycles/sample, damping 0.3);
    ``f(x) = tanh(1.5 x) / 1.5 + 0.1 x^2`` (saturating, slightly asymmetric);
    ``G2``: a resonant low-pass at 0.12 cycles/sample, damping 0.2. Both filters are FIR
    truncations (`taps` samples) of their impulse responses, unit DC gain, starting from
    rest.

    Args:
      u: ``[T]`` or ``[B, T]`` input.
      taps: length of each FIR impulse response.

    Returns:
      ``y`` with the shape of `u`, float64.
    """
    x, squeeze = _as_batch("simulate_wiener_hammerstein", u)
    g1 = _resonator(taps, 0.05, 0.3, WH_FS)
    g2 = _resonator(taps, 0.12, 0.2, WH_FS)
    t = x.shape[1]
    out = np.empty_like(x)
    for b in range(x.shape[0]):
        v = np.convolve(x[b], g1)[:t]
        w = np.tanh(1.5 * v) / 1.5 + 0.1 * v**2
        out[b] = np.convolve(w, g2)[:t]
    return out[0] if squeeze else out


def simulate_discrete(u: ArrayLike) -> np.ndarray:
    """The Narendra-Parthasarathy discrete nonlinear system (cheap, for tests):

    ``y[t] = y[t-1] y[t-2] (y[t-1] + 2.5) / (1 + y[t-1]^2 + y[t-2]^2) + u[t-1]``,
    from ``y[-1] = y[-2] = 0``, ``u[-1] = 0``. Stable for ``|u| <= 1``.

    Args:
      u: ``[T]`` or ``[B, T]`` input.

    Returns:
      ``y`` with the shape of `u`, float64.
    """
    x, squeeze = _as_batch("simulate_discrete", u)
    y = np.zeros_like(x)
    y1 = y2 = np.zeros(x.shape[0])
    u1 = np.zeros(x.shape[0])
    for t in range(x.shape[1]):
        cur = y1 * y2 * (y1 + 2.5) / (1 + y1**2 + y2**2) + u1
        y[:, t] = cur
        y1, y2, u1 = cur, y1, x[:, t]
    return y[0] if squeeze else y


# -- files -----------------------------------------------------------------------------------


def write_hdf5(path: str | os.PathLike, **signals: ArrayLike) -> str:
    """Writes each signal as a contiguous float32 dataset (no chunks, no compression), so
    `blox.data.HDF5Index` reads it through a memory map. Returns the path as a string.

    >>> import os, tempfile, numpy as np
    >>> from blox.ts import write_hdf5
    >>> from blox.data import HDF5Index
    >>> p = write_hdf5(os.path.join(tempfile.mkdtemp(), 'r.h5'), u=np.zeros(5), y=np.ones(5))
    >>> HDF5Index([p], ['u', 'y']).info(0, 'y').layout
    'contiguous'
    """
    if not signals:
        raise ValueError("write_hdf5: give at least one signal, e.g. write_hdf5(path, u=u, y=y).")
    path = os.fspath(path)
    tmp = path + ".partial"
    with h5py.File(tmp, "w") as f:
        for name, data in signals.items():
            f.create_dataset(name, data=np.asarray(data, np.float32))
    os.replace(tmp, path)  # a crash never leaves a half-written file under the real name
    return path


@dataclass(frozen=True)
class DatasetFiles:
    """The HDF5 files of one simulated dataset (each holds ``u`` and ``y``, ``[T]``).

    Attributes:
      train: training recordings (noisy ``y``).
      valid: validation recordings (noisy ``y``), for early stopping.
      test: test recordings (clean ``y``).
      fs: sampling frequency in Hz.
      config: the settings the files were generated with.
    """

    train: list[str]
    valid: list[str]
    test: list[str]
    fs: float
    config: dict


_SYSTEMS = ("silverbox", "wiener_hammerstein", "discrete")

# system -> size -> settings. Lengths in samples.
_CONFIGS = {
    "silverbox": {
        "tiny": dict(period=512, periods=2, train=2, valid=1, test_len=1024),
        "default": dict(period=8192, periods=2, train=8, valid=1, test_len=40000),
    },
    "wiener_hammerstein": {
        "tiny": dict(length=1200, train=2, valid=1, test_len=1200),
        "default": dict(length=20000, train=5, valid=1, test_len=20000),
    },
    "discrete": {
        "tiny": dict(length=600, train=2, valid=1, test_len=600),
        "default": dict(length=5000, train=4, valid=1, test_len=5000),
    },
}

# Excitation and noise: Silverbox u RMS 0.05 V (train), test ramped up to 0.0625 V RMS
# (25 % above training: the extrapolation region); output noise std in units of y.
_SILVERBOX = dict(f_max=200.0, rms=0.05, test_rms_end=0.0625, noise=0.001)
_WH = dict(f_max=0.15, rms=0.8, noise=0.01)
_DISCRETE = dict(noise=0.01)


def _recording(system: str, gen: np.random.Generator, cfg: dict, test: bool) -> np.ndarray:
    if system == "silverbox":
        s = _SILVERBOX
        if test:
            env = np.linspace(0.0, s["test_rms_end"], cfg["test_len"])
            return band_limited_noise(
                gen, cfg["test_len"], fs=SILVERBOX_FS, f_max=s["f_max"], rms=env
            )
        return odd_multisine(
            gen,
            cfg["period"],
            fs=SILVERBOX_FS,
            f_max=s["f_max"],
            rms=s["rms"],
            periods=cfg["periods"],
        )
    if system == "wiener_hammerstein":
        n = cfg["test_len"] if test else cfg["length"]
        return band_limited_noise(gen, n, fs=WH_FS, f_max=_WH["f_max"], rms=_WH["rms"])
    n = cfg["test_len"] if test else cfg["length"]
    return gen.uniform(-1.0, 1.0, n)


def _simulate(system: str, u: np.ndarray) -> np.ndarray:
    if system == "silverbox":
        return simulate_duffing(u)
    if system == "wiener_hammerstein":
        return simulate_wiener_hammerstein(u)
    return simulate_discrete(u)


def _noise_std(system: str) -> float:
    return {"silverbox": _SILVERBOX, "wiener_hammerstein": _WH, "discrete": _DISCRETE}[system][
        "noise"
    ]


def make_dataset(
    system: str, folder: str | os.PathLike, *, seed: int = 0, size: str = "default"
) -> DatasetFiles:
    """Simulates `system` and writes its recordings to contiguous HDF5 files in `folder`.

    Files: ``folder/train_<i>.h5``, ``valid_<i>.h5``, ``test.h5``, each with ``u`` and
    ``y`` ``[T]`` float32, plus ``config.json``. Training and validation outputs carry
    white measurement noise; the test output is clean. Inputs:

    - ``'silverbox'``: odd random-phase multisines (0.05 V RMS up to 200 Hz, one
      realization per file, ``periods`` periods each) for training and validation; the
      test input is band-limited noise whose RMS ramps from 0 to 0.0625 V (the last fifth
      extrapolates beyond the training amplitude, like Silverbox's arrow head).
    - ``'wiener_hammerstein'``: band-limited Gaussian noise (up to 0.15 cycles/sample).
    - ``'discrete'``: uniform noise in ``[-1, 1]`` (`simulate_discrete`).

    Deterministic by `seed`; when ``config.json`` in `folder` matches the request the
    existing files are reused (not regenerated).

    Args:
      system: ``'silverbox'``, ``'wiener_hammerstein'`` or ``'discrete'``.
      folder: where the files go (created if missing).
      seed: the NumPy seed of inputs and noise.
      size: ``'tiny'`` (seconds; the tests) or ``'default'``.

    Returns:
      A `DatasetFiles` with the paths.
    """
    if system not in _SYSTEMS:
        raise ValueError(f"make_dataset: system must be one of {_SYSTEMS}, got {system!r}.")
    if size not in _CONFIGS[system]:
        raise ValueError(
            f"make_dataset: size must be one of {sorted(_CONFIGS[system])}, got {size!r}."
        )
    cfg = dict(_CONFIGS[system][size])
    fs = SILVERBOX_FS if system == "silverbox" else 1.0
    config = dict(system=system, size=size, seed=int(seed), noise=_noise_std(system), **cfg)
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    names = {
        "train": [os.path.join(folder, f"train_{i}.h5") for i in range(cfg["train"])],
        "valid": [os.path.join(folder, f"valid_{i}.h5") for i in range(cfg["valid"])],
        "test": [os.path.join(folder, "test.h5")],
    }
    manifest = os.path.join(folder, "config.json")
    every = [p for ps in names.values() for p in ps]
    if os.path.exists(manifest) and all(os.path.exists(p) for p in every):
        with open(manifest) as f:
            if json.load(f) == config:
                return DatasetFiles(**names, fs=fs, config=config)
    gen = np.random.default_rng(seed)
    noise = _noise_std(system)
    for split in ("train", "valid", "test"):
        for path in names[split]:
            u = _recording(system, gen, cfg, test=split == "test")
            y = _simulate(system, u)
            if split != "test":
                y = y + noise * gen.standard_normal(y.shape)
            write_hdf5(path, u=u, y=y)
    with open(manifest, "w") as f:
        json.dump(config, f, indent=1)
    return DatasetFiles(**names, fs=fs, config=config)


def read_recordings(
    paths: Sequence[str | os.PathLike],
    signals: Mapping[str, str | Sequence[str]] | Sequence[str] = ("u", "y"),
    *,
    dtype: DTypeLike | None = None,
) -> list[dict[str, np.ndarray]]:
    """Reads whole recordings through `blox.data`: ``[{'u': [T, Cu], 'y': [T, Cy]}, ...]``.

    A thin use of ``blox.data.WindowedSource(paths, signals, window=None, dtype=dtype)``
    (one item per file): the same checks (missing datasets, non-numeric or complex data,
    ``u`` and ``y`` of different lengths, all named with file and dataset), memory maps
    for contiguous datasets and the h5py fallback for the others. Only the datasets
    named in `signals` are read, and their dtype is kept unless `dtype` is given.

    Args:
      paths: HDF5 file paths.
      signals: ``{name: dataset or [datasets]}`` or a list of dataset names (default
        ``('u', 'y')``), as for `blox.data.WindowedSource`.
      dtype: the output dtype; ``None`` keeps the files' dtype (float32 for files
        written by `write_hdf5`; a signal whose files differ gets their promotion).

    Returns:
      One dict per file, in order: ``{signal: [T_f, C]}``.

    >>> import os, tempfile, numpy as np
    >>> p = write_hdf5(os.path.join(tempfile.mkdtemp(), 'r.h5'), u=np.arange(4.0), y=np.ones(4))
    >>> rec = read_recordings([p])
    >>> rec[0]['u'][:, 0], rec[0]['y'].shape, rec[0]['y'].dtype
    (array([0., 1., 2., 3.], dtype=float32), (4, 1), dtype('float32'))
    >>> read_recordings([p], {'y': 'y'}, dtype=np.float64)[0]['y'].dtype
    dtype('float64')
    """
    if isinstance(paths, str | os.PathLike):
        raise TypeError(
            f"read_recordings: paths must be a list of paths, got the single path {paths!r}. "
            f"Wrap it in a list: [{os.fspath(paths)!r}]."
        )
    src = WindowedSource(paths, signals, window=None, dtype=dtype)
    return [src.read(f, 0, length) for f, length in enumerate(src.lengths)]
