"""System identification side by side with TSFast (issue 26): the same simulated data,
model sizes, budget and CPU threads; each library with its own documented recipe.

Run (the full budget takes hours on 2 cores)::

    .venv/bin/python benchmarks/sysid_vs_tsfast.py --out docs/benchmarks.md \
        --sysid-doc docs/sysid.md
    .venv/bin/python benchmarks/sysid_vs_tsfast.py --epochs 1 --batches-per-epoch 20 \
        --seeds 1 --models lstm --systems wh          # a minute: does it all run?
    .venv/bin/python benchmarks/sysid_vs_tsfast.py --ablate --systems wh --models lstm

Data: blox's simulated Wiener-Hammerstein-like and Silverbox-like systems
(`blox.ts.make_dataset`, ``--size default``: noisy training and validation files, a
clean test recording of 20,000 / 40,000 samples), written once to contiguous HDF5 under
``--data``; both sides read the same files.

Models: LSTM 1x40 and GRU 2x40. Budget: TSFast's (``--epochs`` 10 x
``--batches-per-epoch`` 300 batches of 64 windows of 200, stride 1), ``--seeds`` seeds
(0, 1, ...) per side, system and model.

- TSFast: ``benchmarks/_tsfast_driver.py`` run by ``--tsfast-python`` (the peer venv
  ``.venv-tsfast``), TSFast's documented recipe through its own API (see the driver):
  L1 loss on raw outputs, Adam at 3e-3 on ``fit_flat_cos``, no clipping, windows drawn
  with replacement, the final model.
- blox: the recipe of docs/sysid.md at the same budget (`blox_recipe` below):
  ``RNNModel(..., linear_skip=True, n_skip=50)``, ``pipeline(shuffle=True)`` batches,
  ``clip_by_global_norm(1.0)`` and Adam at 3e-3 on ``flat_cosine_schedule(pct_start=0.75)``,
  the loss in normalized units (MSE), input noise 0.02, `fit_sysid` by epochs with the
  free-run validation at each epoch's end and the best validation's params.

Every run is a fresh process pinned to the same ``--threads`` CPUs
(``os.sched_setaffinity``; ``torch.set_num_threads``; XLA sizes its pool from the
affinity; ``OMP/MKL/OPENBLAS_NUM_THREADS``); the sides alternate run by run. Reported:
the free-run test RMSE after the 50 warm-up samples, computed here from both sides'
simulations the same way (median, min-max and each seed); the training step alone on
one batch (median of ``--timed-steps`` calls, waited for); the training loop's steps/s;
the free run of the whole test recording (median of 3 after a first call, which for
blox includes compilation); each side's process wall time.

Run it on an otherwise idle machine. Under load, torch's OpenMP threads wait by
spinning: on the shared 2-core machine at load average 12, one LSTM 1x40 step (batch
64, window 200) took 1,416 ms with 2 torch threads and 188 ms with 1, while the XLA
step was hardly affected; ``--threads 1`` is the fallback when the machine is shared.

``--ablate`` runs blox's recipe with one change at a time (`VARIANTS`: L1 loss, no
clipping, no linear skip, no input noise, torch-like initialization, windows drawn with
replacement, the final instead of the best params) at the same budget and seeds, for
the recipe decisions of issue 26. ``--no-tsfast`` runs the blox side only.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import _timing
import h5py
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SYSTEMS = {"wh": "wiener_hammerstein", "silverbox": "silverbox"}
SYSTEM_NAMES = {"wh": "Wiener-Hammerstein-like", "silverbox": "Silverbox-like"}
MODELS = {"lstm": ("lstm", 1), "gru": ("gru", 2)}  # cell, layers; hidden 40
MODEL_NAMES = {"lstm": "LSTM 1x40", "gru": "GRU 2x40"}
HIDDEN, WINDOW, BATCH, N_SKIP, LR = 40, 200, 64, 50, 3e-3
SYSID_HEADER = ["system", "model", "TSFast RMSE", "blox RMSE", "blox / TSFast", "step time",
                "free run"]  # fmt: skip

# blox's documented recipe (docs/sysid.md) and the single changes --ablate tries.
RECIPE = dict(loss="mse", clip=1.0, linear_skip=True, noise=0.02, init="blox",
              sampling="shuffle", select="best")  # fmt: skip
VARIANTS = {
    "base": {},
    "l1": {"loss": "mae"},
    "no_clip": {"clip": None},
    "no_skip": {"linear_skip": False},
    "no_noise": {"noise": 0.0},
    "torch_init": {"init": "torch"},
    "replacement": {"sampling": "replacement"},
    "final": {"select": "final"},
}
VARIANT_TEXT = {
    "base": "the documented recipe",
    "l1": "L1 loss (normalized units; for one output channel, raw L1 / std)",
    "no_clip": "no gradient clipping",
    "no_skip": "no linear skip",
    "no_noise": "no input noise",
    "torch_init": "PyTorch's default initialization (uniform, two bias vectors)",
    "replacement": "windows drawn with replacement (as torch's RandomSampler)",
    "final": "the final params instead of the best validation's",
}


# -- the blox side (a worker process) -------------------------------------------------


def _torch_like_init(params: Any, seed: int) -> Any:
    """PyTorch's default initialization of an ``nn.LSTM``/``nn.GRU`` and ``nn.Linear``:
    every weight ``U(-1/sqrt(fan), 1/sqrt(fan))`` (fan: the hidden size for the cells,
    the input size for a linear map), and the cell bias the sum of two such vectors
    (torch's ``bias_ih + bias_hh``)."""
    import blox as bx

    gen = np.random.default_rng(seed)
    out = params.unlocked()
    for path, p in params.split()[0].items():
        shape = np.shape(p.value)
        if "rnn" in path:
            k = 1.0 / np.sqrt(HIDDEN)
        else:  # head (H, Cy) / skip (Cu, Cy): fan_in of the kernel; its bias alike
            kernel = params.value(path[:-1] + ("kernel",))
            k = 1.0 / np.sqrt(np.shape(kernel)[0])
        value = gen.uniform(-k, k, shape)
        if "rnn" in path and path[-1] == "bias":
            value = value + gen.uniform(-k, k, shape)
        out[path] = bx.Param(np.asarray(value, np.float32), trainable=True)
    return out.locked()


def _with_replacement(source: Any, batch: int, seed: int):
    gen = np.random.default_rng(seed)
    while True:
        yield source.get_batch(gen.integers(0, len(source), batch))


def blox_recipe(files: dict, model_key: str, seed: int, epochs: int, per_epoch: int,
                timed_steps: int, pred_path: str, **changes: Any) -> dict:  # fmt: skip
    """Trains and evaluates one blox run; returns its times and saves the simulation."""
    import jax
    import optax

    import blox as bx
    from blox.data import WindowedSource, channel_stats, pipeline
    from blox.ts import RNNModel, fit_sysid, make_simulator, make_sysid_step, read_recordings

    cfg = dict(RECIPE, **changes)
    t_start = time.perf_counter()
    train = WindowedSource(files["train"], {"u": "u", "y": "y"}, window=WINDOW, stride=1)
    stats = channel_stats(train)
    valid = read_recordings(files["valid"])
    test = read_recordings(files["test"])
    cell, layers = MODELS[model_key]
    graph = bx.Graph("net")
    rng = bx.Rng(graph / "rng")
    model = RNNModel(graph / cell, stats["u"], stats["y"], rng, hidden_size=HIDDEN,
                     num_layers=layers, cell=cell, linear_skip=cfg["linear_skip"],
                     n_skip=N_SKIP)  # fmt: skip
    if cfg["sampling"] == "replacement":
        batches = _with_replacement(train, BATCH, seed)
    else:
        ds = pipeline(train, batch_size=BATCH, shuffle=True, seed=seed, num_epochs=None,
                      drop_remainder=True)  # fmt: skip
        batches = iter(ds)
    first = train.get_batch(np.arange(BATCH))
    params = rng.seed(bx.Params(), seed=seed)
    _, params = model(params, first["u"])
    params = params.locked()
    if cfg["init"] == "torch":
        params = _torch_like_init(params, seed)
    steps = epochs * per_epoch
    adam = optax.adam(bx.flat_cosine_schedule(LR, steps, pct_start=0.75))
    tx = adam if cfg["clip"] is None else optax.chain(optax.clip_by_global_norm(cfg["clip"]), adam)
    t0 = time.perf_counter()
    fit = fit_sysid(model, params, tx, batches, epochs=epochs, batches_per_epoch=per_epoch,
                    valid=valid, seed=seed, noise=cfg["noise"], loss=cfg["loss"])  # fmt: skip
    fit_s = time.perf_counter() - t0
    chosen = fit.params if cfg["select"] == "best" else fit.final_params

    # Free run of the whole test recording: a first call (compiles), then 3 timed.
    sim = make_simulator(model)
    u = np.asarray(test[0]["u"])[None]
    t0 = time.perf_counter()
    pred = jax.block_until_ready(sim(chosen, u))
    free_run_first_s = time.perf_counter() - t0
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(sim(chosen, u))
        runs.append(time.perf_counter() - t0)
    np.save(pred_path, np.asarray(pred[0], np.float32))

    # The training step alone on one batch (as the loop runs it), waited for.
    step = jax.jit(make_sysid_step(model, tx, noise=cfg["noise"], loss=cfg["loss"]))
    p, opt_state, key = fit.final_params, tx.init(fit.final_params.split()[0]), jax.random.key(0)
    batch = train.get_batch(np.random.default_rng(seed).integers(0, len(train), BATCH))
    for _ in range(2):
        p, opt_state, _, m = step(p, opt_state, None, batch, key)
        jax.block_until_ready(m["loss"])
    times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        p, opt_state, _, m = step(p, opt_state, None, batch, key)
        jax.block_until_ready(m["loss"])
        times.append(time.perf_counter() - t0)
    return {
        "side": "blox",
        "steps": fit.steps,
        "fit_s": fit_s,
        "compile_s": fit.compile_s,
        "train_s": fit.train_s,
        "eval_s": fit.eval_s,
        "loop_steps_per_s": fit.steps_per_s,
        "step_s": statistics.median(times),
        "free_run_s": statistics.median(runs),
        "free_run_first_s": free_run_first_s,
        "test_len": int(u.shape[1]),
        "best_step": fit.best_step,
        "best_score": fit.best_score,
        "final_train_loss": float(np.mean(fit.losses[-per_epoch:])),
        "process_s": time.perf_counter() - t_start,
        "jax": jax.__version__,
        "threads": len(os.sched_getaffinity(0)),
    }


def _worker(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    for name in ("--files", "--model", "--pred", "--changes"):
        parser.add_argument(name, required=True)
    for name in ("--seed", "--epochs", "--batches-per-epoch", "--timed-steps"):
        parser.add_argument(name, type=int, required=True)
    a = parser.parse_args(argv)
    with open(a.files) as f:
        files = json.load(f)
    result = blox_recipe(files, a.model, a.seed, a.epochs, a.batches_per_epoch, a.timed_steps,
                         a.pred, **json.loads(a.changes))  # fmt: skip
    print("RESULT " + json.dumps(result), flush=True)


# -- the orchestrator -------------------------------------------------------------------


def _child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    # No simulated devices (the test suite's flag) in the timed processes.
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "force_host_platform" not in f]
    env["XLA_FLAGS"] = " ".join(flags)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _run_child(cmd: list[str], cpus: set[int], threads: int) -> tuple[dict, float]:
    """Runs `cmd` pinned to `cpus`; returns its ``RESULT`` JSON and its wall time."""
    # Pinned by a trampoline that sets its affinity and execs `cmd` (a preexec_fn would
    # fork this process, which has JAX's threads running).
    pin = "import os, sys; os.sched_setaffinity(0, %r); os.execv(sys.argv[1], sys.argv[1:])"
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", pin % sorted(cpus), *cmd], capture_output=True,
                          text=True, cwd=ROOT, env=_child_env(threads))  # fmt: skip
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"sysid_vs_tsfast: {' '.join(cmd)} failed (exit {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len("RESULT ") :]), wall


def _test_rmse(pred_path: str, test_file: str) -> float:
    """Free-run RMSE after the N_SKIP warm-up samples (NumPy, float64)."""
    with h5py.File(test_file, "r") as f:
        y = np.asarray(f["y"], np.float64).reshape(len(f["y"]), -1)
    pred = np.load(pred_path).astype(np.float64).reshape(y.shape)
    return float(np.sqrt(np.mean((pred[N_SKIP:] - y[N_SKIP:]) ** 2)))


def _datasets(args: argparse.Namespace) -> dict[str, dict]:
    from blox.ts import make_dataset

    out = {}
    for key in args.systems:
        folder = os.path.join(args.data, f"{SYSTEMS[key]}_{args.size}")
        files = make_dataset(SYSTEMS[key], folder, seed=0, size=args.size)
        spec = {"train": files.train, "valid": files.valid, "test": files.test}
        path = os.path.join(folder, "files.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        out[key] = {"spec": spec, "json": path}
    return out


def _jobs(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    """(side, system, model, seed) in run order: the sides alternate."""
    sides = ["blox"] if args.no_tsfast else ["tsfast", "blox"]
    variants = list(VARIANTS) if args.ablate else ["base"]
    jobs = []
    for system in args.systems:
        for model in args.models:
            for seed in range(args.seeds):
                for side in sides:
                    for v in variants if side == "blox" else ["base"]:
                        jobs.append((side if side == "tsfast" else f"blox:{v}", system, model,
                                     seed))  # fmt: skip
    return jobs


def _command(job: tuple, data: dict, args: argparse.Namespace, pred: str) -> list[str]:
    side, system, model, seed = job
    common = ["--files", data[system]["json"], "--model", model, "--seed", str(seed),
              "--epochs", str(args.epochs), "--batches-per-epoch", str(args.batches_per_epoch),
              "--timed-steps", str(args.timed_steps), "--pred", pred]  # fmt: skip
    if side == "tsfast":
        driver = os.path.join(HERE, "_tsfast_driver.py")
        return [args.tsfast_python, driver, *common, "--threads", str(args.threads)]
    changes = json.dumps(VARIANTS[side.split(":", 1)[1]])
    return [sys.executable, os.path.abspath(__file__), "--worker", *common, "--changes", changes]


def _spread(values: list[float], fmt: str = "{:.3e}") -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return fmt.format(med)
    return f"{fmt.format(med)} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def _med(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def render(results: list[dict], args: argparse.Namespace, env: dict, started, command,
           total_s: float) -> tuple[str, str]:  # fmt: skip
    """The docs/benchmarks.md section and the docs/sysid.md table."""
    from importlib import metadata

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["system"], r["model"], r["side"]), []).append(r)
    tsfast_version = next((r["tsfast"] for r in results if r["side"] == "tsfast"), "not run")
    budget = (f"{args.epochs} epochs x {args.batches_per_epoch} batches of {BATCH} windows "
              f"of {WINDOW} (stride 1), {args.seeds} seed(s) per side, system and model, "
              f"data size '{args.size}'")  # fmt: skip
    small = args.quick or args.epochs * args.batches_per_epoch < 3000 or args.seeds < 5
    lines = [
        "## System identification side by side with TSFast",
        "",
        *_timing.run_header(env, started, command),
        f"- TSFast {tsfast_version} (torch, CPU) in `{os.path.relpath(args.tsfast_python)}`; "
        f"blox with jax {metadata.version('jax')}. Each run a fresh process pinned to the same "
        f"{args.threads} CPU(s); the sides alternate.",
        f"- Budget: {budget}. Whole run {total_s:.0f} s."
        + (" SMALL BUDGET: a check that the harness runs, not a result." if small else ""),
        "- RMSE: free run of the whole test recording after 50 warm-up samples, computed by "
        "this script from both sides' simulations; median [min, max] over seeds. Step: "
        "one training step on one batch, waited for (median); loop: steps/s of the whole "
        "training loop with data and (blox) validation; free run: median of 3 after a "
        "first call (blox's first call compiles).",
        "",
    ]
    header = ["system", "model", "TSFast RMSE", "blox RMSE", "blox / TSFast", "step ms TSFast",
              "step ms blox", "ratio", "free run s TSFast", "free run s blox", "ratio",
              "loop steps/s TSFast", "loop steps/s blox", "process s TSFast",
              "process s blox"]  # fmt: skip
    rows, seed_rows, sysid_rows = [], [], []
    for system in args.systems:
        for model in args.models:
            b = groups.get((system, model, "blox:base"), [])
            t = groups.get((system, model, "tsfast"), [])
            if not b:
                continue
            b_rmse = [r["rmse"] for r in b]
            t_rmse = [r["rmse"] for r in t]
            name = (SYSTEM_NAMES[system], MODEL_NAMES[model])
            if t:
                ratio = statistics.median(b_rmse) / statistics.median(t_rmse)
                step_ratio = _med(b, "step_s") / _med(t, "step_s")
                free_ratio = _med(b, "free_run_s") / _med(t, "free_run_s")
                rows.append([*name, _spread(t_rmse), _spread(b_rmse), f"**{ratio:.3f}**",
                             f"{1e3 * _med(t, 'step_s'):.1f}", f"{1e3 * _med(b, 'step_s'):.1f}",
                             f"{step_ratio:.2f}", f"{_med(t, 'free_run_s'):.3f}",
                             f"{_med(b, 'free_run_s'):.3f}", f"{free_ratio:.2f}",
                             f"{_med(t, 'loop_steps_per_s'):.1f}",
                             f"{_med(b, 'loop_steps_per_s'):.1f}",
                             f"{sum(r['wall_s'] for r in t):.0f}",
                             f"{sum(r['wall_s'] for r in b):.0f}"])  # fmt: skip
                sysid_rows.append([*name, _spread(t_rmse), _spread(b_rmse), f"{ratio:.3f}",
                                   f"{step_ratio:.2f}", f"{free_ratio:.2f}"])  # fmt: skip
            else:
                rows.append([*name, "not run", _spread(b_rmse), "", "",
                             f"{1e3 * _med(b, 'step_s'):.1f}", "", "",
                             f"{_med(b, 'free_run_s'):.3f}", "", "",
                             f"{_med(b, 'loop_steps_per_s'):.1f}", "",
                             f"{sum(r['wall_s'] for r in b):.0f}"])  # fmt: skip
            for side, group in (("TSFast", t), ("blox", b)):
                if group:
                    seeds = ", ".join(f"{r['rmse']:.3e}" for r in sorted(group,
                                      key=lambda r: r["seed"]))  # fmt: skip
                    seed_rows.append([*name, side, seeds])
    lines += [_timing.format_table(header, rows), ""]
    if seed_rows:
        lines += ["Each seed's RMSE (seeds 0, 1, ...):", "",
                  _timing.format_table(["system", "model", "side", "RMSE per seed"], seed_rows),
                  ""]  # fmt: skip
    if args.ablate:
        lines += ["### Ablation of blox's recipe (one change at a time)", ""]
        abl = []
        for system in args.systems:
            for model in args.models:
                base = groups.get((system, model, "blox:base"), [])
                if not base:
                    continue
                ref = statistics.median(r["rmse"] for r in base)
                for v in VARIANTS:
                    g = groups.get((system, model, f"blox:{v}"), [])
                    if g:
                        med = statistics.median(r["rmse"] for r in g)
                        rmse = _spread([r["rmse"] for r in g])
                        name = [SYSTEM_NAMES[system], MODEL_NAMES[model]]
                        abl.append([*name, v, VARIANT_TEXT[v], rmse, f"{med / ref:.3f}"])
        header_abl = ["system", "model", "variant", "change", "RMSE", "/ base"]
        lines += [_timing.format_table(header_abl, abl), ""]
    sysid = [
        f"Measured by `benchmarks/sysid_vs_tsfast.py` ({started:%Y-%m-%d}; {budget}; "
        f"{args.threads} CPU thread(s) each; TSFast {tsfast_version})."
        + (" SMALL BUDGET: not a result." if small else ""),
        "Free-run test RMSE, median [min, max] over seeds; step and free-run times as "
        "blox / TSFast (below 1: blox faster). Details in docs/benchmarks.md.",
        "",
        _timing.format_table(SYSID_HEADER, sysid_rows) if sysid_rows else "(TSFast was not run.)",
    ]
    return "\n".join(lines), "\n".join(sysid)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batches-per-epoch", type=int, default=300)
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0 .. N-1 per side")
    parser.add_argument("--systems", default="wh,silverbox", help="comma-separated: wh, silverbox")
    parser.add_argument("--models", default="lstm,gru", help="comma-separated: lstm, gru")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPUs each run is pinned to (default: all available)")  # fmt: skip
    parser.add_argument("--size", choices=["tiny", "default"], default="default",
                        help="make_dataset size (tiny: the smoke test)")  # fmt: skip
    parser.add_argument("--data", default=os.path.join(ROOT, "runs", "sysid_vs_tsfast"))
    parser.add_argument("--tsfast-python",
                        default=os.path.join(ROOT, ".venv-tsfast", "bin", "python"))  # fmt: skip
    parser.add_argument("--no-tsfast", action="store_true", help="run the blox side only")
    parser.add_argument("--ablate", action="store_true", help="also blox's single changes")
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny data, 1 epoch x 3 batches, 1 seed")  # fmt: skip
    parser.add_argument("--out", default=None, help="docs/benchmarks.md: write its section")
    parser.add_argument("--sysid-doc", default=None, help="docs/sysid.md: write its table")
    parser.add_argument("--json", default=None, help="write every run's results here")
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.epochs, args.batches_per_epoch, args.seeds = "tiny", 1, 3, 1
        args.timed_steps = 2
    args.systems = [s for s in args.systems.split(",") if s]
    args.models = [m for m in args.models.split(",") if m]
    bad = [s for s in args.systems if s not in SYSTEMS]
    bad += [m for m in args.models if m not in MODELS]
    if bad:
        parser.error(f"unknown system/model {bad}: systems {sorted(SYSTEMS)}, models "
                     f"{sorted(MODELS)}")  # fmt: skip
    for name in ("epochs", "batches_per_epoch", "seeds", "timed_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not args.no_tsfast and not os.path.exists(args.tsfast_python):
        parser.error(
            f"no TSFast interpreter at {args.tsfast_python}: create the peer venv "
            "(.venv-tsfast with tsfast==0.5.0), or pass --tsfast-python or --no-tsfast"
        )
    available = sorted(os.sched_getaffinity(0))
    args.threads = args.threads or len(available)
    if not 1 <= args.threads <= len(available):
        parser.error(f"--threads must be in [1, {len(available)}] (the CPUs available)")
    cpus = set(available[: args.threads])

    started, env, command = _timing.start_run("sysid_vs_tsfast")
    t_all = time.perf_counter()
    data = _datasets(args)
    results = []
    jobs = _jobs(args)
    with tempfile.TemporaryDirectory() as tmp:
        for k, job in enumerate(jobs, 1):
            side, system, model, seed = job
            pred = os.path.join(tmp, f"pred_{k}.npy")
            res, wall = _run_child(_command(job, data, args, pred), cpus, args.threads)
            res.update(side=side, system=system, model=model, seed=seed, wall_s=wall,
                       rmse=_test_rmse(pred, data[system]["spec"]["test"][0]))  # fmt: skip
            results.append(res)
            _timing.log(f"[{k}/{len(jobs)}] {side} {system} {model} seed {seed}: RMSE "
                        f"{res['rmse']:.4e}, step {1e3 * res['step_s']:.1f} ms, free run "
                        f"{res['free_run_s']:.3f} s, loop {res['loop_steps_per_s']:.1f} "
                        f"steps/s, process {wall:.1f} s")  # fmt: skip
    total = time.perf_counter() - t_all
    report, sysid = render(results, args, env, started, command, total)
    _timing.publish(report, args.out, "sysid_vs_tsfast")
    _timing.log("\n" + sysid)
    if args.sysid_doc:
        _timing.write_section(args.sysid_doc, "sysid_vs_tsfast", sysid, "System identification")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
