"""Physics-informed pieces: autodiff time derivatives vs analytic ones, the MSD residual."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx
from blox.ts import PINN, msd_residual, physics_loss, time_derivatives


def test_time_derivatives_equal_the_analytic_ones():
    t = jnp.linspace(0.0, 3.0, 11)

    def fn(s):
        return jnp.stack([jnp.sin(2 * s) * jnp.exp(-0.3 * s), s**3], axis=-1)

    x, dx, ddx, d3 = time_derivatives(fn, t, order=3)
    tn = np.asarray(t, np.float64)
    e, s2, c2 = np.exp(-0.3 * tn), np.sin(2 * tn), np.cos(2 * tn)
    np.testing.assert_allclose(x[:, 0], s2 * e, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(dx[:, 0], (2 * c2 - 0.3 * s2) * e, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ddx[:, 0], (-4 * s2 - 1.2 * c2 + 0.09 * s2) * e, atol=1e-5)
    np.testing.assert_allclose(dx[:, 1], 3 * tn**2, rtol=1e-5)
    np.testing.assert_allclose(ddx[:, 1], 6 * tn, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(d3[:, 1], 6.0, rtol=1e-6)


def test_msd_residual_vanishes_on_exact_solutions():
    m, zeta, w = 2.0, 0.1, 3.0
    c, k = 2 * zeta * w * m, w * w * m
    wd = w * np.sqrt(1 - zeta**2)
    t = jnp.linspace(0.0, 4.0, 50)
    # Free response and a forced one, x = sin(t) with F = -m sin t + c cos t + k sin t.
    free = time_derivatives(lambda s: jnp.exp(-zeta * w * s) * jnp.cos(wd * s), t)
    r = msd_residual(*free, 0.0, mass=m, damping=c, stiffness=k)
    np.testing.assert_allclose(r, 0.0, atol=5e-5)
    forced = time_derivatives(jnp.sin, t)
    f = -m * jnp.sin(t) + c * jnp.cos(t) + k * jnp.sin(t)
    np.testing.assert_allclose(
        msd_residual(*forced, f, mass=m, damping=c, stiffness=k), 0.0, atol=5e-5
    )


def test_pinn_derivatives_and_physics_loss_against_the_closed_form():
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    net = PINN(g / "pinn", ([2.0], [4.0]), ([0.5], [3.0]), rng, hidden_sizes=(8,))
    t = jnp.linspace(0.0, 4.0, 9)
    _, params = net(rng.seed(bx.Params(), seed=0), t)

    def p(*k):
        return np.asarray(params[("m", "pinn", *k)].value, np.float64)

    # x = 3 (W2 tanh(W1 (t - 2) / 4 + b1) + b2) + 0.5
    w1, b1 = p("mlp", "linear_0", "kernel"), p("mlp", "linear_0", "bias")
    w2, b2 = p("mlp", "linear_1", "kernel"), p("mlp", "linear_1", "bias")
    tn = np.asarray(t, np.float64)[:, None]
    a = np.tanh(((tn - 2.0) / 4.0) @ w1 + b1)
    x = 3 * (a @ w2 + b2) + 0.5
    dx = 3 * (((1 - a**2) * (w1 / 4.0)) @ w2)
    ddx = 3 * (((-2 * a * (1 - a**2)) * (w1 / 4.0) ** 2) @ w2)
    got = net.derivatives(params, t)
    for mine, ref in zip(got, (x, dx, ddx), strict=True):
        np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-5)
    force = jnp.cos(t)
    loss = jax.jit(lambda q: physics_loss(net, q, t, force, mass=1.0, damping=0.2, stiffness=4.0))
    r = ddx + 0.2 * dx + 4.0 * x - np.cos(tn)
    np.testing.assert_allclose(loss(params), np.mean((r / (4.0 * 3.0)) ** 2), rtol=1e-4)


def test_physics_errors():
    with pytest.raises(ValueError, match="order must be an int >= 0"):
        time_derivatives(jnp.sin, jnp.zeros(3), order=-1)
    with pytest.raises(ValueError, match=r"t must be a floating \[N\] array"):
        time_derivatives(jnp.sin, jnp.zeros((3, 2)))
    with pytest.raises(ValueError, match="need mass > 0"):
        msd_residual(0.0, 0.0, 0.0, 0.0, mass=0.0, damping=0.1, stiffness=1.0)
    g = bx.Graph("m")
    with pytest.raises(ValueError, match="t_stats must describe one channel"):
        PINN(g / "p", ([0.0, 1.0], [1.0, 1.0]), ([0.0], [1.0]), None)
