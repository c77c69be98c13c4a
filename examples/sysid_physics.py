"""Physics-informed identification of a mass-spring-damper from 10 % of the samples.

    python examples/sysid_physics.py                 # default size (a minute or two)
    python examples/sysid_physics.py --size tiny     # seconds (the smoke test)

``m x'' + c x' + k x = F(t)`` (m = 1, c = 0.3, k = 4) is simulated on a dense grid (RK4);
the measurements are 10 % of the grid's samples, picked at random, with noise. Two
networks of continuous time ``t -> x(t)`` (`blox.ts.PINN`) start from the same params:

- data only: the mean squared error on the measurements;
- physics-informed: the same, plus the mean squared ODE residual on the whole grid, with
  ``x'`` and ``x''`` from ``jax.jvp`` (`blox.ts.time_derivatives`), not finite
  differences. The residual needs no measurement, so it covers the 90 % left out.

Both are scored by their RMSE against the true trajectory on the dense grid. One line per
training step of the physics-informed model: ``step=<n> loss=<loss>``.
"""

from __future__ import annotations

import argparse
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import blox as bx
from blox.ts import PINN, physics_loss, plot_simulation

M, C, K = 1.0, 0.3, 4.0
SIZES = {
    # grid points, horizon (s), hidden sizes, steps
    "tiny": dict(points=200, horizon=6.0, hidden=(16, 16), steps=30),
    "default": dict(points=1200, horizon=12.0, hidden=(64, 64, 64), steps=4000),
}


def force(t):
    return np.sin(1.1 * t) + 0.6 * np.sin(2.7 * t + 0.5)


def simulate(t: np.ndarray, x0: float = 0.5, v0: float = 0.0, sub: int = 10) -> np.ndarray:
    """RK4 on the grid `t` with `sub` substeps (the force evaluated at each stage)."""

    def deriv(s, x, v):
        return v, (force(s) - C * v - K * x) / M

    x, v, out = x0, v0, [x0]
    for a, b in zip(t[:-1], t[1:], strict=True):
        h = (b - a) / sub
        for i in range(sub):
            s = a + i * h
            k1 = deriv(s, x, v)
            k2 = deriv(s + h / 2, x + h / 2 * k1[0], v + h / 2 * k1[1])
            k3 = deriv(s + h / 2, x + h / 2 * k2[0], v + h / 2 * k2[1])
            k4 = deriv(s + h, x + h * k3[0], v + h * k3[1])
            x = x + h / 6 * (k1[0] + 2 * k2[0] + 2 * k3[0] + k4[0])
            v = v + h / 6 * (k1[1] + 2 * k2[1] + 2 * k3[1] + k4[1])
        out.append(x)
    return np.asarray(out)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fraction", type=float, default=0.1, help="share of samples measured")
    parser.add_argument("--out", default=None, help="folder of the plot")
    args = parser.parse_args(argv)
    cfg = SIZES[args.size]
    steps = args.steps if args.steps is not None else cfg["steps"]
    out = args.out or os.path.join("runs", f"sysid_physics_{args.size}")
    os.makedirs(out, exist_ok=True)

    gen = np.random.default_rng(args.seed)
    t = np.linspace(0.0, cfg["horizon"], cfg["points"])
    x_true = simulate(t)
    n_meas = max(4, int(round(args.fraction * len(t))))
    idx = np.sort(gen.choice(len(t), n_meas, replace=False))
    t_meas = t[idx].astype(np.float32)
    x_meas = (x_true[idx] + 0.02 * gen.standard_normal(n_meas)).astype(np.float32)[:, None]
    t_grid = jnp.asarray(t, jnp.float32)
    f_grid = jnp.asarray(force(t), jnp.float32)
    print(f"blox {bx.__version__} | jax {jax.__version__} | {jax.devices()[0].platform}")
    print(f"mass-spring-damper m={M} c={C} k={K}: {n_meas} of {len(t)} samples measured "
          f"({100 * n_meas / len(t):.0f} %), noise std 0.02")  # fmt: skip

    graph = bx.Graph("net")
    rng = bx.Rng(graph / "rng")
    t_stats = ([float(t.mean())], [float(t.std())])
    x_stats = ([float(x_meas.mean())], [float(x_meas.std())])
    net = PINN(graph / "pinn", t_stats, x_stats, rng, hidden_sizes=cfg["hidden"])
    params = rng.seed(bx.Params(), seed=args.seed)
    _, params = net(params, t_grid)
    params = params.locked()

    def loss_fn(params, weight):
        x, params = net(params, jnp.asarray(t_meas))
        data = bx.normalized_mse(x, jnp.asarray(x_meas), net.y_norm.std(params))
        phys = physics_loss(net, params, t_grid, f_grid, mass=M, damping=C, stiffness=K)
        return data + weight * phys, params

    results, fits = {}, {}
    for name, weight in (("physics-informed", 1.0), ("data only", 0.0)):
        tx = optax.adam(bx.flat_cosine_schedule(3e-3, steps, pct_start=0.5))
        step = jax.jit(bx.make_train_step(lambda p, w=weight: loss_fn(p, w), tx))
        p, opt = params, tx.init(params.split()[0])
        for n in range(1, steps + 1):
            p, opt, metrics = step(p, opt)
            if weight:
                print(f"step={n} loss={float(metrics['loss'])!r}")
        x_hat = np.asarray(net(p, t_grid)[0][:, 0], np.float64)
        results[name] = float(np.sqrt(np.mean((x_hat - x_true) ** 2)))
        fits[name] = x_hat
    for name, r in results.items():
        print(f"{name:17s} RMSE vs the true trajectory {r:.4e}")
    ratio = results["physics-informed"] / results["data only"]
    print(f"physics-informed / data only = {ratio:.3f}")
    path = plot_simulation(os.path.join(out, "physics.png"), x_true, fits["physics-informed"],
                           fs=len(t) / cfg["horizon"], others={"data only": fits["data only"]},
                           title="mass-spring-damper: physics-informed vs data only")  # fmt: skip
    print(f"plot: {path}")
    return results


if __name__ == "__main__":
    main()
