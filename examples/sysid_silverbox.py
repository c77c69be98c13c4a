"""System identification of a Silverbox-like Duffing oscillator: GRU, LSTM, TCN and CRNN
against a least-squares ARX baseline, all evaluated by free-run simulation.

    python examples/sysid_silverbox.py                  # default size (minutes on 2 CPUs)
    python examples/sysid_silverbox.py --size tiny      # seconds (the smoke test)

The data is simulated here (no downloads) and written to contiguous HDF5 files under
``--data`` (default ``runs/sysid_silverbox_<size>``; reused when present):
``y'' + 2 zeta omega y' + omega^2 (y + y^3) = omega^2 u`` at f = 68.58 Hz, zeta = 0.0468,
sampled at 10^7 / 2^14 Hz (RK4 with substeps); odd random-phase multisines for training
(noisy output), a ramped-amplitude band-limited noise for the test (clean output).

Each model is raw-in/raw-out (training statistics stored as non-trainable params) and
trained on windows with its first ``n_skip`` steps as warm-up; the GRU uses truncated
BPTT (windows cut into chunks, state carried, reset by ``is_first``), input noise
injection and the flat-then-cosine schedule; every model keeps the params of its best
free-run validation error (early stopping). One line per GRU training step:
``step=<n> loss=<loss>``; then a table of free-run test errors and PNG plots.
"""

from __future__ import annotations

import argparse
import os
import time

import jax

import blox as bx
from blox.data import WindowedSource, channel_stats, pipeline
from blox.ts import (
    CRNN,
    TCN,
    RNNModel,
    evaluate_free_run,
    fit_arx,
    fit_sysid,
    make_dataset,
    plot_simulation,
    read_recordings,
    sysid_metrics,
)

# size -> settings: window, TBPTT chunk (GRU), stride, batch, hidden, channels, steps,
# n_skip, ARX lags.
SIZES = {
    "tiny": dict(
        window=128,
        chunk=64,
        stride=32,
        batch=8,
        hidden=16,
        channels=8,
        steps=12,
        n_skip=16,
        na=4,
        nb=4,
        models=("gru",),
    ),  # fmt: skip
    "default": dict(
        window=1000,
        chunk=250,
        stride=50,
        batch=32,
        hidden=64,
        channels=32,
        steps=3000,
        n_skip=50,
        na=8,
        nb=8,
        models=("gru", "lstm", "tcn", "crnn"),
    ),  # fmt: skip
}


def build(name: str, graph: bx.Graph, stats: dict, rng: bx.Rng, cfg: dict):
    common = dict(n_skip=cfg["n_skip"])
    if name in ("gru", "lstm"):
        return RNNModel(graph / name, stats["u"], stats["y"], rng, hidden_size=cfg["hidden"],
                        cell=name, linear_skip=True, **common)  # fmt: skip
    if name == "tcn":
        # n_skip covers the receptive field: earlier outputs see zero-padded history.
        model = TCN(graph / name, stats["u"], stats["y"], rng, channels=cfg["channels"],
                    dilations=(1, 2, 4, 8, 16), n_skip=cfg["n_skip"])  # fmt: skip
        model.n_skip = max(cfg["n_skip"], model.receptive_field - 1)
        return model
    return CRNN(graph / name, stats["u"], stats["y"], rng, channels=cfg["channels"],
                hidden_size=cfg["hidden"], **common)  # fmt: skip


def run(
    system: str, argv: list[str] | None = None, sizes: dict = SIZES, description: str = __doc__
) -> dict[str, float]:
    """The whole recipe for one simulated `system` (see `blox.ts.make_dataset`); the
    command line's ``--size`` picks one of `sizes`, `description`'s first line is its help."""
    parser = argparse.ArgumentParser(description=description.splitlines()[0])
    parser.add_argument("--size", choices=sorted(sizes), default="default")
    parser.add_argument("--steps", type=int, default=None, help="training steps per model")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data", default=None, help="folder of the HDF5 files")
    parser.add_argument("--out", default=None, help="folder of the plots")
    parser.add_argument("--models", default=None, help="comma-separated subset")
    parser.add_argument("--epochs", type=int, default=None, help="train by epochs (not --steps)")
    parser.add_argument("--batches-per-epoch", type=int, default=None,
                        help="with --epochs (default: one pass over the windows)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.epochs is not None and args.steps is not None:
        parser.error("give --steps or --epochs, not both")
    if args.batches_per_epoch is not None and args.epochs is None:
        parser.error("--batches-per-epoch needs --epochs")
    cfg = dict(sizes[args.size])
    steps = args.steps if args.steps is not None else cfg["steps"]
    names = args.models.split(",") if args.models else list(cfg["models"])
    data = args.data or os.path.join("runs", f"sysid_{system}_{args.size}")
    out = args.out or data
    os.makedirs(out, exist_ok=True)

    files = make_dataset(system, data, seed=args.seed, size=args.size)
    train = WindowedSource(files.train, {"u": "u", "y": "y"}, window=cfg["window"],
                           stride=cfg["stride"])  # fmt: skip
    stats = channel_stats(train)
    valid = read_recordings(files.valid)
    test = read_recordings(files.test)
    print(f"blox {bx.__version__} | jax {jax.__version__} | {jax.devices()[0].platform}")
    print(f"{system}: {len(files.train)} training files, {len(train)} windows of "
          f"{cfg['window']}, test {len(test[0]['u'])} samples, data in {data}")  # fmt: skip
    budget = dict(steps=steps, eval_every=max(steps // 5, 1))
    if args.epochs is not None:  # validated at each epoch's end
        per_epoch = args.batches_per_epoch or max(len(train) // cfg["batch"], 1)
        steps = args.epochs * per_epoch
        budget = dict(epochs=args.epochs, batches_per_epoch=per_epoch)

    # ARX baseline: least squares on the training files, free-run on the test input.
    t0 = time.perf_counter()
    rec = read_recordings(files.train)
    arx = fit_arx([r["u"] for r in rec], [r["y"] for r in rec], na=cfg["na"], nb=cfg["nb"])
    y_arx = arx.simulate(test[0]["u"], test[0]["y"][: arx.lag])
    n_skip = max(cfg["n_skip"], arx.lag)
    results = {"arx": sysid_metrics(y_arx, test[0]["y"], n_skip=n_skip)}
    print(f"ARX(na={cfg['na']}, nb={cfg['nb']}) fitted in {time.perf_counter() - t0:.2f} s")

    sims = {}
    for k, name in enumerate(names):
        graph = bx.Graph("net")
        rng = bx.Rng(graph / "rng")
        model = build(name, graph, stats, rng, cfg)
        chunk = cfg["chunk"] if name == "gru" else None  # TBPTT for the GRU
        ds = pipeline(train, batch_size=cfg["batch"], shuffle=True, seed=args.seed + 1000 * k,
                      num_epochs=None, drop_remainder=True, tbptt_chunk=chunk)  # fmt: skip
        batches = iter(ds)
        first = next(iter(ds))
        params = rng.seed(bx.Params(), seed=args.seed)
        _, params = model(params, first["u"])
        params = params.locked()
        log = (lambda n, v: print(f"step={n} loss={v!r}")) if name == "gru" else None
        t0 = time.perf_counter()
        # blox's recipe (blox.ts.SYSID_RECIPE: Adam, schedule, clipping, loss, noise, the
        # best validation's params); only the GRU trains with input noise here.
        fit = fit_sysid(model, params, batches, valid=valid, seed=args.seed,
                        noise=None if name == "gru" else 0.0, on_step=log, **budget)  # fmt: skip
        secs = time.perf_counter() - t0
        metrics, (sim,) = evaluate_free_run(model, fit.params, test, n_skip=n_skip)
        results[name], sims[name] = metrics, sim
        print(f"{name}: {fit.steps} steps in {secs:.1f} s ({fit.steps_per_s:.1f} steps/s), "
              f"best validation NRMSE {fit.best_score:.4f} at step {fit.best_step}")  # fmt: skip

    base = float(results["arx"]["rmse"][0])
    print(f"free-run test errors (first {n_skip} samples skipped):")
    print(f"{'model':8s} {'RMSE':>10s} {'NRMSE':>8s} {'fit %':>7s} {'/ ARX':>6s}")
    ratios = {}
    for name, m in results.items():
        r = float(m["rmse"][0])
        ratios[name] = r / base
        print(f"{name:8s} {r:10.3e} {float(m['nrmse'][0]):8.4f} {float(m['fit'][0]):7.2f} "
              f"{r / base:6.3f}")  # fmt: skip
    for name, sim in sims.items():
        path = plot_simulation(os.path.join(out, f"{system}_{name}.png"), test[0]["y"], sim,
                               fs=files.fs, n_skip=n_skip, others={"ARX": y_arx},
                               title=f"{system}: {name} free run vs measured")  # fmt: skip
        print(f"plot: {path}")
    return ratios


def main(argv: list[str] | None = None) -> dict[str, float]:
    return run("silverbox", argv)


if __name__ == "__main__":
    main()
