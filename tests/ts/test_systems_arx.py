"""Simulated systems (vs closed forms and SciPy), HDF5 files, and the ARX baseline."""

import math

import numpy as np
import pytest
import scipy.integrate
import scipy.signal

from blox.data import HDF5Index
from blox.ts import (
    SILVERBOX_FS,
    band_limited_noise,
    fit_arx,
    make_dataset,
    odd_multisine,
    read_recordings,
    simulate_discrete,
    simulate_duffing,
    simulate_wiener_hammerstein,
)


def _step_response(t, f0, zeta):
    w = 2 * math.pi * f0
    wd = w * math.sqrt(1 - zeta**2)
    return 1 - np.exp(-zeta * w * t) * (np.cos(wd * t) + zeta * w / wd * np.sin(wd * t))


def test_rk4_matches_the_closed_form_of_the_linear_oscillator():
    # kappa = 0 and a unit step: y(t) = 1 - e^{-zeta w t} (cos wd t + zeta w / wd sin wd t).
    n, f0, zeta = 300, 68.58, 0.0468
    t = np.arange(n) / SILVERBOX_FS
    exact = _step_response(t, f0, zeta)
    errs = {}
    for s in (1, 4):
        y = simulate_duffing(np.ones(n), kappa=0.0, substeps=s)
        errs[s] = np.max(np.abs(y - exact))
    assert errs[4] < 2e-4, errs
    # Fourth order: four times finer steps shrink the error by about 4^4 = 256.
    assert errs[1] / errs[4] > 50, errs


def test_duffing_matches_scipy_on_the_nonlinear_case():
    gen = np.random.default_rng(0)
    u = odd_multisine(gen, 128, fs=SILVERBOX_FS, f_max=150.0, rms=0.3)
    y = simulate_duffing(u, substeps=8)
    w, zeta = 2 * math.pi * 68.58, 0.0468
    state, ref = np.zeros(2), []
    dt = 1 / SILVERBOX_FS
    for uk in u:
        ref.append(state[0])
        sol = scipy.integrate.solve_ivp(
            lambda _, s, uk=uk: [s[1], w * w * (uk - s[0] - s[0] ** 3) - 2 * zeta * w * s[1]],
            (0, dt),
            state,
            rtol=1e-10,
            atol=1e-12,
        )
        state = sol.y[:, -1]
    ref = np.asarray(ref)
    assert np.max(np.abs(y - ref)) < 1e-4 * max(1.0, np.max(np.abs(ref)))
    # ... and the cubic term matters at this amplitude (the linear model is far off).
    assert np.max(np.abs(simulate_duffing(u, kappa=0.0, substeps=8) - ref)) > 1e-2


def test_multisine_and_noise_spectra():
    gen = np.random.default_rng(1)
    x = odd_multisine(gen, 256, fs=256.0, f_max=40.0, rms=0.5, periods=2)
    assert x.shape == (512,) and np.isclose(np.sqrt(np.mean(x**2)), 0.5)
    np.testing.assert_allclose(x[:256], x[256:])
    mag = np.abs(np.fft.rfft(x[:256]))
    lines = np.flatnonzero(mag > 1e-6 * mag.max())
    np.testing.assert_array_equal(lines, np.arange(1, 41, 2))  # odd lines up to 40 Hz
    freqs = np.fft.rfftfreq(1000, 1 / 100.0)
    unit = band_limited_noise(gen, 1000, fs=100.0, f_max=10.0, rms=1.0)
    assert np.isclose(np.sqrt(np.mean(unit**2)), 1.0)
    spec = np.abs(np.fft.rfft(unit))
    assert np.all(spec[freqs > 10.0] < 1e-9 * spec.max())  # nothing above f_max
    env = np.linspace(0, 2, 1000)
    ramp = band_limited_noise(np.random.default_rng(1), 1000, fs=100.0, f_max=10.0, rms=env)
    unit1 = band_limited_noise(np.random.default_rng(1), 1000, fs=100.0, f_max=10.0, rms=1.0)
    np.testing.assert_allclose(ramp, unit1 * env)  # the envelope multiplies


def test_wiener_hammerstein_static_gain_is_the_nonlinearity():
    # Unit-DC-gain filters: a constant input c settles at f(c) = tanh(1.5 c) / 1.5 + 0.1 c^2.
    for c in (-1.0, 0.3, 2.0):
        y = simulate_wiener_hammerstein(np.full(600, c))
        assert abs(y[-1] - (math.tanh(1.5 * c) / 1.5 + 0.1 * c * c)) < 1e-3


def test_discrete_system_first_steps_by_hand():
    u = np.array([0.5, -0.2, 0.1, 0.0])
    y = simulate_discrete(u)
    y2 = 0.5 * 0.0 * (0.5 + 2.5) / (1 + 0.25) + (-0.2)
    y3 = y2 * 0.5 * (y2 + 2.5) / (1 + y2**2 + 0.25) + 0.1
    np.testing.assert_allclose(y, [0.0, 0.5, y2, y3])
    np.testing.assert_allclose(simulate_discrete(np.stack([u, u])), np.stack([y, y]))


def test_make_dataset_is_deterministic_contiguous_and_noise_only_in_training(tmp_path):
    a = make_dataset("discrete", tmp_path / "a", seed=3, size="tiny")
    b = make_dataset("discrete", tmp_path / "b", seed=3, size="tiny")
    c = make_dataset("discrete", tmp_path / "c", seed=4, size="tiny")
    ra, rb, rc = (read_recordings(f.train + f.test) for f in (a, b, c))
    for x, y in zip(ra, rb, strict=True):
        np.testing.assert_array_equal(x["u"], y["u"])
        np.testing.assert_array_equal(x["y"], y["y"])
    assert not np.array_equal(ra[0]["u"], rc[0]["u"])
    index = HDF5Index(a.train + a.valid + a.test, ["u", "y"])
    assert {index.info(i, n).layout for i in range(4) for n in ("u", "y")} == {"contiguous"}
    test = ra[-1]
    clean = simulate_discrete(test["u"][:, 0].astype(np.float64))
    # clean test target (the file stores float32 u, so the re-simulation differs slightly)
    np.testing.assert_allclose(test["y"][:, 0], clean, atol=1e-4)
    train = ra[0]
    resid = train["y"][:, 0] - simulate_discrete(train["u"][:, 0].astype(np.float64))
    assert 0.005 < np.std(resid) < 0.02  # noise 0.01
    again = make_dataset("discrete", tmp_path / "a", seed=3, size="tiny")  # reused
    assert again.train == a.train


def test_make_dataset_errors(tmp_path):
    with pytest.raises(ValueError, match="system must be one of"):
        make_dataset("silverbx", tmp_path)
    with pytest.raises(ValueError, match="size must be one of"):
        make_dataset("discrete", tmp_path, size="huge")
    with pytest.raises(ValueError, match="f_max=400"):
        odd_multisine(np.random.default_rng(0), 64, fs=600.0, f_max=400.0, rms=1.0)
    with pytest.raises(ValueError, match="u must be"):
        simulate_duffing(np.zeros((2, 3, 4)))
    with pytest.raises(ValueError, match="substeps must be a positive int"):
        simulate_duffing(np.zeros(3), substeps=0)


def test_arx_recovers_a_linear_arx_system_exactly():
    gen = np.random.default_rng(0)
    u = gen.normal(size=(400, 2))
    a, b = [1.5, -0.7], [0.0, 0.5, 0.2]  # y = 1.5 y1 - 0.7 y2 + 0.5 u0[t-1] + 0.2 u0[t-2]
    y0 = scipy.signal.lfilter(b, [1.0, -a[0], -a[1]], u[:, 0])
    y = y0 + scipy.signal.lfilter([0.0, -0.3], [1.0, -a[0], -a[1]], u[:, 1]) + 0.0
    model = fit_arx([u[:200], u[200:]], [y[:200], y[200:]], na=2, nb=2, nk=1)
    theta = model.theta[:, 0]
    # rows: y[t-1], y[t-2], u0[t-1], u1[t-1], u0[t-2], u1[t-2], 1
    np.testing.assert_allclose(theta, [1.5, -0.7, 0.5, -0.3, 0.2, 0.0, 0.0], atol=1e-9)
    sim = model.simulate(u, y[: model.lag])
    np.testing.assert_allclose(sim[:, 0], y, atol=1e-8)
    np.testing.assert_allclose(model.predict(u, y)[:, 0], y, atol=1e-9)


def test_arx_errors():
    with pytest.raises(ValueError, match="nb must be an int >= 1"):
        fit_arx(np.zeros(10), np.zeros(10), na=1, nb=0)
    with pytest.raises(ValueError, match="sampled together"):
        fit_arx(np.zeros(10), np.zeros(11), na=1, nb=1)
    with pytest.raises(ValueError, match="not more than the lag"):
        fit_arx(np.zeros(3), np.zeros(3), na=3, nb=1)
    m = fit_arx(np.arange(20.0), np.arange(20.0), na=2, nb=1)
    with pytest.raises(ValueError, match=r"y_init must be \[lag, Cy\] = \(2, 1\)"):
        m.simulate(np.zeros(10), np.zeros(3))
