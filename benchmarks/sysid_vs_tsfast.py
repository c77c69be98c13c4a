"""System identification side by side with TSFast: the same simulated data, model sizes,
budget and CPU threads; each library with its own documented recipe.

Run (the full budget takes about 5 core-hours; finished runs are cached, so it can be
stopped and restarted)::

    .venv/bin/python benchmarks/sysid_vs_tsfast.py --threads 1 --keep-going
    .venv/bin/python benchmarks/sysid_vs_tsfast.py --threads 1 --render-only \
        --out docs/benchmarks.md --sysid-doc docs/sysid.md
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
- blox: `fit_sysid` by epochs given no recipe argument (its defaults,
  `blox.ts.SYSID_RECIPE`: optimizer, schedule, clipping, loss, input noise, free-run
  validation at each epoch's end, the params it returns) on
  ``RNNModel(..., linear_skip=True, n_skip=50)`` and ``pipeline(shuffle=True)`` batches
  (`blox_recipe` below).

Cache: each finished run is appended as one JSON line to ``--cache`` (default
``benchmarks/results/sysid_vs_tsfast.jsonl``, kept in git so that the hours of runs
add up across sessions and machines), keyed by library, system, model, seed, epochs,
batches per epoch, data size, threads and the hash of the recipe's settings
(`run_key`); a rerun skips the cached runs, and the report is rendered from every cached
run of the current recipes (each cell with its number of seeds). ``--render-only`` runs
nothing. A changed default changes the hash of ``blox:base``, so it re-runs; a variant
whose settings equal the new default's is the same run and is not repeated.

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

``--ablate`` runs blox's recipe with one change at a time (`VARIANTS`: clipping at
1.0, the schedule flat for 75 % or not at all, no input noise, no linear skip, windows
drawn with replacement, the final params, MSE instead of L1, Adam at 2e-2, 5e-3 or 3e-3
instead of 1e-2, the head drawn at 1x, 3x or 5x instead of 10x, PyTorch's init instead
of blox.nn's, and the earlier recipes) at the same budget and seeds: the evidence behind
docs/sysid.md's "How the defaults were chosen". The GRU gap's diagnostics are variants
too: TSFast's recipe run by blox (``tsfast_recipe``), with outputs in physical units
(``tsfast_recipe_raw_y``), with the head's learning rate (``*_head_x*``) or initial size
(``*head_init``) at 1 / std(y).
``--variants a,b`` runs the named ones in that order. Every blox run also records the
test RMSE of its other params (the final ones for the best, and the reverse).
``--no-tsfast`` runs the blox side only, ``--no-base`` leaves out blox's recipe.

Several invocations may share one cache, each pinned to its own CPUs (``taskset -c 0
... & taskset -c 1 ...``): each claims a run before it starts it (`claim_run`), so no
run is trained twice, and each renders every cached run. Long queues share the
machine; ``--timing FILE`` (default ``benchmarks/results/sysid_vs_tsfast_timing.jsonl``)
adds the step and free-run times of short runs made one at a time on a quiet machine
(``--seeds 1 --epochs 1 --batches-per-epoch 50 --timed-steps 100 --cache FILE``, one
queue on one CPU), kept apart from the main cache.
"""

from __future__ import annotations

import argparse
import hashlib
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

from blox.ts import SYSID_RECIPE, RNNModel

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SYSTEMS = {"wh": "wiener_hammerstein", "silverbox": "silverbox"}
SYSTEM_NAMES = {"wh": "Wiener-Hammerstein-like", "silverbox": "Silverbox-like"}
MODELS = {"lstm": ("lstm", 1), "gru": ("gru", 2)}  # cell, layers; hidden 40
MODEL_NAMES = {"lstm": "LSTM 1x40", "gru": "GRU 2x40"}
HIDDEN, WINDOW, BATCH, N_SKIP, LR = 40, 200, 64, 50, 3e-3

# blox's documented recipe (docs/sysid.md) and the single changes --ablate tries, most
# promising first (the order the ablation runs in).
# The training settings are blox's defaults (`blox.ts.SYSID_RECIPE`, what `fit_sysid`
# picks when given none); the model and data settings are the benchmark's.
FIT_KEYS = ("loss", "clip", "noise", "select", "lr", "pct_start")
# RNNModel's default head_scale with its default init (the benchmark's key: head_init)
HEAD_SCALE = RNNModel.DEFAULT_HEAD_SCALE
RECIPE = dict(linear_skip=True, init="joint", sampling="shuffle", head_init=HEAD_SCALE,
              **{k: SYSID_RECIPE[k] for k in FIT_KEYS})  # fmt: skip
# TSFast's recipe on blox (PyTorch's init, Adam at 3e-3, no noise, no clipping, no skip,
# the final params, windows with replacement): equal to TSFast's own runs unless the
# libraries differ beyond their recipes.
TSFAST_ON_BLOX = dict(init="torch", lr=3e-3, noise=0.0, clip=0.0, linear_skip=False,
                      select="final", sampling="replacement", head_init=1.0)  # fmt: skip
VARIANTS = {
    "base": {},
    # Recipe 3 (docs/sysid.md, "How the defaults were chosen") and the steps from it to
    # the defaults.
    "clip_1": {"clip": 1.0},
    "pct_0.75": {"pct_start": 0.75},
    "head_x5": {"head_init": 5.0},
    "head_x5_pct_0.75": {"head_init": 5.0, "pct_start": 0.75},
    "head_x5_pct_0.75_clip_1": {"head_init": 5.0, "pct_start": 0.75, "clip": 1.0},
    "pct_0.75_lr_5e-3": {"pct_start": 0.75, "lr": 5e-3},
    "pct_0.75_torch_init": {"pct_start": 0.75, "init": "torch"},
    "head_x3_pct_0.75": {"head_init": 3.0, "pct_start": 0.75},
    "head_x5_pct_0.75_lr_2e-2": {"head_init": 5.0, "pct_start": 0.75, "lr": 2e-2},
    # Single changes from the defaults (the runs of the earlier recipes stay in the
    # cache, and docs/sysid.md quotes them).
    "no_flat": {"pct_start": 0.0},
    "no_noise": {"noise": 0.0},
    "no_skip": {"linear_skip": False},
    "replacement": {"sampling": "replacement"},
    "final": {"select": "final"},
    "mse": {"loss": "mse"},
    "lr_2e-2": {"lr": 2e-2},
    "head_x1": {"head_init": 1.0},
    "lr_2e-2_head_x1": {"lr": 2e-2, "head_init": 1.0},
    "lr_5e-3": {"lr": 5e-3},
    # fastai's Adam defaults (b2 0.99, eps 1e-5, decoupled weight decay 0.01 x lr; TSFast
    # 0.5.0 itself uses torch.optim.Adam's): a key the recipe leaves out, so the base
    # runs keep their hash.
    "fastai_adam": {"adam": "fastai"},
    "fastai_adam_lr_1e-2": {"adam": "fastai", "lr": 1e-2, "head_init": 1.0},
    "no_noise_head_x1": {"noise": 0.0, "head_init": 1.0},
    "tsfast_recipe": TSFAST_ON_BLOX,
    # Outputs and loss in physical units (no output normalization), as TSFast's: a head
    # weight step of lr then moves the output by lr, not lr x the output's std.
    "tsfast_recipe_raw_y": {**TSFAST_ON_BLOX, "y_units": "raw"},
    "raw_y_lr_5e-3": {"y_units": "raw", "lr": 5e-3},
    "tsfast_recipe_head_x8.7": {**TSFAST_ON_BLOX, "head_lr": 8.7},
    "tsfast_recipe_head_init": {**TSFAST_ON_BLOX, "head_init": "1/std"},
    "head_init": {"init": "torch", "head_init": "1/std"},
    # The head drawn at another fixed factor than the recipe's 10x (unit-free: outputs
    # are normalized; TSFast's raw-unit head is 8.7x on the Silverbox-like data).
    "head_x3": {"head_init": 3.0},
    "lr_3e-3": {"lr": 3e-3},
    "lr_5e-3_no_noise": {"lr": 5e-3, "noise": 0.0},
    "lr_5e-3_torch_init": {"lr": 5e-3, "init": "torch"},
    "tsfast_recipe_head_x5": {**TSFAST_ON_BLOX, "head_init": 5.0},
    "lr_3e-3_head_x8": {"lr": 3e-3, "head_lr": 8.0, "head_init": 1.0},
    "lr_5e-3_head_x5": {"lr": 5e-3, "head_lr": 5.0, "head_init": 1.0},
    "torch_init": {"init": "torch"},
    # Input kernels LeCun over their fan-in F alone ("blox": blox.nn's earlier GRU default,
    # before it drew over F + H; an LSTM's kernel spans [x, h], so for it this is the
    # recipe's own init),
    # and the runs that chose L1 at 2e-2 with it.
    "lecun_f_init": {"init": "blox"},
    "lecun_f_mse": {"init": "blox", "loss": "mse"},
    "lecun_f_lr_1e-2": {"init": "blox", "lr": 1e-2},
    "lecun_f_mse_lr_1e-2": {"init": "blox", "loss": "mse", "lr": 1e-2},
    "lecun_f_mse_lr_1e-2_no_clip": {"init": "blox", "loss": "mse", "lr": 1e-2, "clip": 0.0},
    "lecun_f_mse_lr_1e-2_no_flat": {"init": "blox", "loss": "mse", "lr": 1e-2, "pct_start": 0.0},
    "lecun_f_mse_lr_3e-3": {"init": "blox", "loss": "mse", "lr": 3e-3},
}
VARIANT_TEXT = {
    "base": "the documented recipe (L1, Adam at 1e-2 flat for 50 %, no clipping, head x10)",
    "clip_1": "gradient clipping at global norm 1.0",
    "pct_0.75": "the schedule flat for 75 % (cosine over the last quarter)",
    "head_x5": "the head drawn at 5x",
    "head_x5_pct_0.75": "the head at 5x, flat for 75 % (recipe 3 without clipping)",
    "head_x5_pct_0.75_clip_1": "the head at 5x, flat for 75 %, clipping at 1.0 (recipe 3)",
    "pct_0.75_lr_5e-3": "flat for 75 %, Adam at 5e-3",
    "pct_0.75_torch_init": "flat for 75 %, PyTorch's init (the head at 10x)",
    "head_x3_pct_0.75": "the head at 3x, flat for 75 %",
    "head_x5_pct_0.75_lr_2e-2": "the head at 5x, flat for 75 %, Adam at 2e-2",
    "lr_2e-2": "Adam at 2e-2",
    "head_x1": "the head at LeCun's size (head_scale 1)",
    "lr_2e-2_head_x1": "Adam at 2e-2, the head at LeCun's size (recipe 2)",
    "no_flat": "cosine decay from the first step (no flat part)",
    "no_noise": "no input noise",
    "no_skip": "no linear skip",
    "replacement": "windows drawn with replacement (as torch's RandomSampler)",
    "final": "the final params instead of the best validation's",
    "mse": "MSE loss (normalized units) instead of L1",
    "lr_5e-3": "Adam at 5e-3",
    "fastai_adam": "fastai's Adam (b2 0.99, eps 1e-5, decoupled weight decay 0.01)",
    "fastai_adam_lr_1e-2": "fastai's Adam at 1e-2, the head at 1x",
    "no_noise_head_x1": "no input noise, the head at 1x",
    "tsfast_recipe": "TSFast's recipe run by blox (torch init, 3e-3, no noise/clip/skip)",
    "tsfast_recipe_raw_y": "TSFast's recipe run by blox, outputs in physical units",
    "raw_y_lr_5e-3": "outputs in physical units, Adam at 5e-3",
    "tsfast_recipe_head_x8.7": "TSFast's recipe by blox, the head at 8.7x (1 / std(y), Silverbox)",
    "tsfast_recipe_head_init": "TSFast's recipe by blox, the head drawn at raw-unit size",
    "head_init": "torch init, the head drawn at raw-unit size (x 1 / std(y))",
    "head_x3": "the head drawn at 3x",
    "lr_3e-3": "Adam at 3e-3",
    "lr_5e-3_no_noise": "Adam at 5e-3, no input noise",
    "lr_5e-3_torch_init": "Adam at 5e-3, PyTorch's init (the head at 10x)",
    "tsfast_recipe_head_x5": "TSFast's recipe by blox, the head drawn 5x larger",
    "lr_3e-3_head_x8": "Adam at 3e-3, the head at 1x, its and the skip's rate at 8x",
    "lr_5e-3_head_x5": "Adam at 5e-3, the head at 1x, its and the skip's rate at 5x",
    "torch_init": "PyTorch's default init (every weight and bias U(+-1/sqrt(H)))",
    "lecun_f_init": "input kernels LeCun over F alone (blox.nn's earlier GRU draw)",
    "lecun_f_mse": "LeCun over F, MSE",
    "lecun_f_lr_1e-2": "LeCun over F, Adam at 1e-2",
    "lecun_f_mse_lr_1e-2": "LeCun over F, MSE at 1e-2 (the recipe before L1 at 2e-2)",
    "lecun_f_mse_lr_1e-2_no_clip": "LeCun over F, MSE at 1e-2, no clipping",
    "lecun_f_mse_lr_1e-2_no_flat": "LeCun over F, MSE at 1e-2, cosine from the first step",
    "lecun_f_mse_lr_3e-3": "LeCun over F, MSE at 3e-3 (recipe 1; TSFast's rate)",
}
# TSFast's side: its documented recipe (benchmarks/_tsfast_driver.py), keyed by these.
TSFAST_RECIPE = dict(recipe="tsfast-0.5.0-documented", lr=LR, window=WINDOW, batch=BATCH,
                     hidden=HIDDEN, n_skip=N_SKIP)  # fmt: skip
CACHE_VERSION = 1


# -- the blox side (a worker process) -------------------------------------------------


def _head_at_raw_units(params: Any, y_stats: Any) -> Any:
    """The output head's kernel and bias times 1 / std(y), so that a head drawn as
    PyTorch draws it for raw-unit outputs keeps its raw-unit size in normalized units,
    as TSFast's does (``head_init='1/std'``; a number is `RNNModel`'s ``head_scale``)."""
    import blox as bx

    std = np.asarray(y_stats[1] if isinstance(y_stats, tuple | list) else y_stats.std)
    factor = (1.0 / std).astype(np.float32)
    out = params.unlocked()
    for path, p in params.split()[0].items():
        if "head" in path:
            out[path] = bx.Param(p.value * factor, trainable=True)
    return out.locked()


def _lecun_over_f(params: Any) -> Any:
    """The GRU/RNN input kernels as blox.nn used to draw them (LeCun normal over the
    fan-in F alone): today's draw (over F + H) scaled by ``sqrt((F + H) / F)``, the
    same truncated normal at the other scale. LSTM kernels (over ``[x, h]``) stay."""
    import blox as bx

    out = params.unlocked()
    for path, p in params.split()[0].items():
        if "rnn" in path and path[-1] == "kernel" and path[:-1] + ("recurrent_kernel",) in params:
            f = np.shape(p.value)[0]
            out[path] = bx.Param(p.value * np.float32(np.sqrt((f + HIDDEN) / f)), trainable=True)
    return out.locked()


def _scale_output_layers(factor: float) -> Any:
    """An Optax transformation multiplying the updates of the output layers (the paths
    through ``head`` or ``skip``) by `factor`: their learning rate x factor. With outputs
    in normalized units, TSFast's raw-unit head moves 1 / std(y) times faster than
    blox's at the same learning rate (8.7x on the Silverbox-like data, 1.8x on the
    Wiener-Hammerstein-like)."""
    import jax
    import optax

    def out_layer(path: Any) -> bool:
        names = str(getattr(path[0], "key", path[0])).split("/")
        return "head" in names or "skip" in names

    def update(updates, state, params=None):
        del params
        return jax.tree_util.tree_map_with_path(
            lambda path, u: u * factor if out_layer(path) else u, updates
        ), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def _optimizer(cfg: dict, total_steps: int) -> Any:
    """The recipe's optimizer written out: (clipping, then) Adam on the flat-cosine
    schedule; ``adam='fastai'``: fastai's Adam defaults (b2 0.99, eps 1e-5, decoupled
    weight decay 0.01 times the learning rate)."""
    import optax

    import blox as bx

    sched = bx.flat_cosine_schedule(cfg["lr"], total_steps, pct_start=cfg["pct_start"])
    if cfg.get("adam", "optax") == "fastai":
        adam = optax.adamw(sched, b1=0.9, b2=0.99, eps=1e-5, weight_decay=0.01)
    else:
        adam = optax.adam(sched)
    if cfg.get("head_lr", 1.0) != 1.0:  # the output layers' steps x head_lr
        adam = optax.chain(adam, _scale_output_layers(float(cfg["head_lr"])))
    return adam if not cfg["clip"] else optax.chain(optax.clip_by_global_norm(cfg["clip"]), adam)


def _with_replacement(source: Any, batch: int, seed: int):
    gen = np.random.default_rng(seed)
    while True:
        yield source.get_batch(gen.integers(0, len(source), batch))


def blox_recipe(files: dict, model_key: str, seed: int, epochs: int, per_epoch: int,
                timed_steps: int, pred_path: str, **changes: Any) -> dict:  # fmt: skip
    """Trains and evaluates one blox run; returns its times and saves the simulation."""
    import jax

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
    init = "torch" if cfg["init"] == "torch" else "lecun"  # 'blox': rescaled below
    # 'raw': the model's outputs (and the loss) in physical units, as TSFast's are
    y_stats = stats["y"] if cfg.get("y_units", "normalized") == "normalized" else ([0.0], [1.0])
    # head_init: the model's head_scale, or '1/std' (drawn at 1, then scaled below)
    head = cfg.get("head_init", 1.0)
    model = RNNModel(graph / cell, stats["u"], y_stats, rng, hidden_size=HIDDEN,
                     num_layers=layers, cell=cell, linear_skip=cfg["linear_skip"],
                     n_skip=N_SKIP, init=init,
                     head_scale=1.0 if head == "1/std" else head)  # fmt: skip
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
    if cfg["init"] == "blox":
        params = _lecun_over_f(params)
    if head == "1/std":
        params = _head_at_raw_units(params, y_stats)
    # blox's recipe is fit_sysid's defaults: only a variant's changes are passed.
    changed = {k: cfg[k] for k in FIT_KEYS if cfg[k] != SYSID_RECIPE[k]}
    if cfg.get("adam", "optax") == "fastai" or cfg.get("head_lr", 1.0) != 1.0:  # written out
        changed = {k: v for k, v in changed.items() if k not in ("lr", "clip", "pct_start")}
        changed["tx"] = _optimizer(cfg, epochs * per_epoch)
    t0 = time.perf_counter()
    fit = fit_sysid(model, params, batches, epochs=epochs, batches_per_epoch=per_epoch,
                    valid=valid, seed=seed, **changed)  # fmt: skip
    fit_s = time.perf_counter() - t0
    chosen = fit.params  # as `select` says
    other = fit.best_params if cfg["select"] == "final" else fit.final_params

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
    # The other selection's simulation too (best <-> final): the ablation of the model
    # choice comes with every run.
    np.save(pred_path + ".other.npy", np.asarray(sim(other, u)[0], np.float32))

    # The training step alone on one batch (as the loop runs it), waited for: the
    # recipe's optimizer written out (the same transformations fit_sysid chains).
    tx = _optimizer(cfg, epochs * per_epoch)
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
        "valid_history": [h["score"] for h in fit.history],
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
        # absolute: the runs start from the repository root, not this working directory
        folder = os.path.join(os.path.abspath(args.data), f"{SYSTEMS[key]}_{args.size}")
        files = make_dataset(SYSTEMS[key], folder, seed=0, size=args.size)
        spec = {"train": files.train, "valid": files.valid, "test": files.test}
        path = os.path.join(folder, "files.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        out[key] = {"spec": spec, "json": path}
    return out


def _jobs(args: argparse.Namespace) -> list[tuple[str, str, str, int]]:
    """(side, system, model, seed) in run order: per system and model, TSFast and blox's
    recipe alternate seed by seed, then each ablation variant (in `VARIANTS` order, or
    ``--variants`` order) runs its seeds."""
    jobs = []
    for system in args.systems:
        for model in args.models:
            for seed in range(args.seeds):
                if not args.no_tsfast:
                    jobs.append(("tsfast", system, model, seed))
                if not args.no_base:
                    jobs.append(("blox:base", system, model, seed))
            for v in args.variants:
                jobs += [(f"blox:{v}", system, model, seed) for seed in range(args.seeds)]
    return jobs


# -- the result cache (one JSON line per finished run) ---------------------------------


def recipe_settings(side: str) -> dict:
    """The settings a run of `side` (``'tsfast'`` or ``'blox:<variant>'``) trains with."""
    if side == "tsfast":
        return dict(TSFAST_RECIPE)
    variant = side.split(":", 1)[1]
    if variant not in VARIANTS:
        raise ValueError(f"sysid_vs_tsfast: unknown variant {variant!r}; known: {list(VARIANTS)}")
    return dict(RECIPE, **VARIANTS[variant])


def recipe_hash(settings: dict) -> str:
    """12 hex digits of the SHA-256 of `settings` as sorted JSON (``clip`` None or 0:
    no clipping, hashed as 0.0)."""
    if "clip" in settings and not settings["clip"]:  # None (older records) and 0: no clipping
        settings = dict(settings, clip=0.0)
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def run_key(side: str, system: str, model: str, seed: int, *, epochs: int,
            batches_per_epoch: int, size: str, threads: int,
            settings: dict | None = None) -> str:  # fmt: skip
    """The cache key of one run: every field that changes its result, with the recipe as
    the hash of its settings (`settings`, default ``recipe_settings(side)``), and the
    side as its library only (``'tsfast'`` or ``'blox'``): a blox variant whose settings
    equal another's (e.g. once a default changes) is the same run."""
    settings = recipe_settings(side) if settings is None else settings
    if settings.get("head_init", 1.0) == 1.0:  # the head as drawn: the runs before the key
        settings = {k: v for k, v in settings.items() if k != "head_init"}
    if model == "lstm" and settings.get("init") == "joint":  # the LSTM's kernel spans [x, h]:
        settings = dict(settings, init="blox")  # both draw the same kernel (the same run)
    fields = dict(v=CACHE_VERSION, lib=side.split(":", 1)[0], system=system, model=model,
                  seed=int(seed), epochs=int(epochs), batches_per_epoch=int(batches_per_epoch),
                  size=size, threads=int(threads), recipe=recipe_hash(settings))  # fmt: skip
    return json.dumps(fields, sort_keys=True, separators=(",", ":"))


def _key_for(job: tuple, args: argparse.Namespace) -> str:
    side, system, model, seed = job
    return run_key(side, system, model, seed, epochs=args.epochs,
                   batches_per_epoch=args.batches_per_epoch, size=args.size,
                   threads=args.threads)  # fmt: skip


def record_key(rec: dict) -> str | None:
    """The key of a cached record, from the fields it holds (None: a record that lacks
    them), so that the key follows `run_key`, not what an older version stored."""
    try:
        return run_key(rec["side"], rec["system"], rec["model"], rec["seed"],
                       epochs=rec["epochs"], batches_per_epoch=rec["batches_per_epoch"],
                       size=rec["size"], threads=rec["threads"],
                       settings=rec["recipe_settings"])  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return None


def pending_jobs(jobs: list[tuple], cache: dict[str, dict], args: argparse.Namespace) -> list:
    """The `jobs` whose key (this budget, size, threads and recipe) is not in `cache`."""
    return [job for job in jobs if _key_for(job, args) not in cache]


def load_cache(path: str | None) -> dict[str, dict]:
    """``{key: record}`` from the JSON-lines file at `path` (none yet: empty), each key
    `record_key`'s. A line that does not parse (a run killed while writing) or lacks a
    key's fields is left out; a later record of the same key wins."""
    cache: dict[str, dict] = {}
    if not path or not os.path.exists(path):
        return cache
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            key = record_key(rec) if isinstance(rec, dict) else None
            if key is not None:
                cache[key] = rec
    return cache


def append_cache(path: str, record: dict) -> None:
    """Appends `record` as one JSON line, flushed to disk."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def claim_run(cache_path: str, key: str) -> str | None:
    """Claims the run `key` for this process, so that several invocations sharing one
    cache (e.g. one pinned to each CPU: ``taskset -c 0 ...`` and ``taskset -c 1 ...``)
    never train the same run: returns the claim file to remove when the run ends, or
    None when a live process holds it. A claim whose process has died is taken over."""
    folder = os.path.abspath(cache_path) + ".claims"
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, hashlib.sha256(key.encode()).hexdigest()[:16])
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(path) as f:
                    pid = int(f.read().strip() or 0)
                os.kill(pid, 0)  # raises if the process is gone
                return None
            except (ProcessLookupError, ValueError, FileNotFoundError):
                try:
                    os.remove(path)  # a dead holder's claim
                except FileNotFoundError:
                    pass
                continue
            except PermissionError:  # alive, another user's
                return None
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return path
    return None


def cached_results(cache: dict[str, dict], args: argparse.Namespace) -> list[dict]:
    """The cached runs of this budget, size and threads, for the requested systems and
    models, TSFast's recipe and each of `VARIANTS` as they are now (a record is listed
    under every variant whose settings it trained with), every seed the cache holds (not
    only ``--seeds``)."""
    seeds = sorted({rec["seed"] for rec in cache.values()})
    out = []
    for system in args.systems:
        for model in args.models:
            for side in ["tsfast", *(f"blox:{v}" for v in VARIANTS)]:
                for seed in seeds:
                    rec = cache.get(_key_for((side, system, model, seed), args))
                    if rec is not None:
                        out.append(dict(rec, side=side))
    return out


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


def timing_rows(records: list[dict], args: argparse.Namespace) -> list[list[str]]:
    """The quiet-machine timing table: per system and model, the median step and free-run
    time of TSFast's and blox's recipe over `records` (runs of any budget at this size and
    thread count whose settings are the recipes' now), and blox / TSFast."""
    want = {side: recipe_hash(recipe_settings(side)) for side in ("tsfast", "blox:base")}
    rows = []
    for system in args.systems:
        for model in args.models:
            by_side = {
                side: [r for r in records if r.get("side") == side and r.get("system") == system
                       and r.get("model") == model and r.get("size") == args.size
                       and r.get("threads") == args.threads
                       and recipe_hash(r.get("recipe_settings") or {}) == h]
                for side, h in want.items()
            }  # fmt: skip
            t, b = by_side["tsfast"], by_side["blox:base"]
            if not (t and b):
                continue
            loads = [r["load"][0] for r in t + b if r.get("load")]
            rows.append([SYSTEM_NAMES[system], MODEL_NAMES[model], f"{len(t)}, {len(b)}",
                         f"{1e3 * _med(t, 'step_s'):.1f}", f"{1e3 * _med(b, 'step_s'):.1f}",
                         f"**{_med(b, 'step_s') / _med(t, 'step_s'):.2f}**",
                         f"{_med(t, 'free_run_s'):.3f}", f"{_med(b, 'free_run_s'):.3f}",
                         f"**{_med(b, 'free_run_s') / _med(t, 'free_run_s'):.2f}**",
                         f"{max(loads):.1f}" if loads else ""])  # fmt: skip
    return rows


def render(results: list[dict], args: argparse.Namespace, env: dict, started, command,
           total_s: float) -> tuple[str, str]:  # fmt: skip
    """The docs/benchmarks.md section and the docs/sysid.md table."""
    from importlib import metadata

    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["system"], r["model"], r["side"]), []).append(r)
    tsfast_version = next((r["tsfast"] for r in results if r["side"] == "tsfast"), "not run")
    budget = (f"{args.epochs} epochs x {args.batches_per_epoch} batches of {BATCH} windows "
              f"of {WINDOW} (stride 1), data size '{args.size}'")  # fmt: skip
    main_groups = [g for (_, _, side), g in groups.items() if side in ("tsfast", "blox:base")]
    fewest = min((len(g) for g in main_groups), default=0)
    small = args.quick or args.epochs * args.batches_per_epoch < 3000 or fewest < 5
    loads = [r["load"][0] for r in results if r.get("load")]
    finished = sorted(r["finished"] for r in results if r.get("finished"))
    when = f" Runs finished {finished[0]} .. {finished[-1]}." if finished else ""
    load_text = (f" Load average (1 min) at each run's end: median {statistics.median(loads):.1f},"
                 f" max {max(loads):.1f}." if loads else "")  # fmt: skip
    run_s = sum(r.get("wall_s", 0.0) for r in results)
    lines = [
        "## System identification side by side with TSFast",
        "",
        *_timing.run_header(env, started, command),
        f"- TSFast {tsfast_version} (torch, CPU) in `{os.path.relpath(args.tsfast_python)}`; "
        f"blox with jax {metadata.version('jax')}. Each run a fresh process pinned to the same "
        f"{args.threads} CPU(s); the sides alternate.",
        f"- Budget: {budget}; seeds 0, 1, ... as the table's seed counts say. The runs took "
        f"{run_s:.0f} s of processes (this invocation {total_s:.0f} s).{when}{load_text}"
        + (" SMALL BUDGET (or fewer than 5 seeds): not a result." if small else ""),
        "- RMSE: free run of the whole test recording after 50 warm-up samples, computed by "
        "this script from both sides' simulations; median [min, max] over seeds. Step: "
        "one training step on one batch, waited for (median); loop: steps/s of the whole "
        "training loop with data and (blox) validation; free run: median of 3 after a "
        "first call (blox's first call compiles).",
        "",
    ]
    header = ["system", "model", "seeds TSFast, blox", "TSFast RMSE", "blox RMSE",
              "blox / TSFast", "step ms TSFast",
              "step ms blox", "ratio", "free run s TSFast", "free run s blox", "ratio",
              "loop steps/s TSFast", "loop steps/s blox", "process s TSFast (all seeds)",
              "process s blox (all seeds)"]  # fmt: skip
    rows, seed_rows = [], []
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
                rows.append([*name, f"{len(t)}, {len(b)}", _spread(t_rmse), _spread(b_rmse),
                             f"**{ratio:.3f}**",
                             f"{1e3 * _med(t, 'step_s'):.1f}", f"{1e3 * _med(b, 'step_s'):.1f}",
                             f"{step_ratio:.2f}", f"{_med(t, 'free_run_s'):.3f}",
                             f"{_med(b, 'free_run_s'):.3f}", f"{free_ratio:.2f}",
                             f"{_med(t, 'loop_steps_per_s'):.1f}",
                             f"{_med(b, 'loop_steps_per_s'):.1f}",
                             f"{sum(r['wall_s'] for r in t):.0f}",
                             f"{sum(r['wall_s'] for r in b):.0f}"])  # fmt: skip
            else:
                rows.append([*name, f"0, {len(b)}", "not run", _spread(b_rmse), "", "",
                             f"{1e3 * _med(b, 'step_s'):.1f}", "", "",
                             f"{_med(b, 'free_run_s'):.3f}", "", "",
                             f"{_med(b, 'loop_steps_per_s'):.1f}", "",
                             f"{sum(r['wall_s'] for r in b):.0f}"])  # fmt: skip
            for side, group in (("TSFast", t), ("blox", b)):
                if group:
                    seeds = ", ".join(f"{r['seed']}: {r['rmse']:.3e}" for r in sorted(group,
                                      key=lambda r: r["seed"]))  # fmt: skip
                    seed_rows.append([*name, side, seeds])
    lines += [_timing.format_table(header, rows), ""]
    timing = timing_rows(getattr(args, "timing_records", []), args)
    if timing:
        lines += ["### Step and free-run time on a quiet machine", "",
                  "The table's times come from the long runs, which shared the machine with "
                  "other work. These come from short runs of the same recipes (`--timing`: "
                  "the same model, batch, window and threads; each run alone, the sides "
                  "alternating), median over runs; the load average is at each run's end.",
                  "", _timing.format_table(["system", "model", "runs TSFast, blox",
                                            "step ms TSFast", "step ms blox", "ratio",
                                            "free run s TSFast", "free run s blox", "ratio",
                                            "load (1 min) max"], timing),
                  ""]  # fmt: skip
    if seed_rows:
        lines += ["Each seed's RMSE (seed: RMSE):", "",
                  _timing.format_table(["system", "model", "side", "RMSE per seed"], seed_rows),
                  ""]  # fmt: skip
    if any(side != "tsfast" for (_, _, side) in groups):
        lines += ["### Ablation of blox's recipe (one change at a time)", ""]
        abl = []
        for system in args.systems:
            for model in args.models:
                base = groups.get((system, model, "blox:base"), [])
                if not base:
                    continue
                ref = statistics.median(r["rmse"] for r in base)
                name = [SYSTEM_NAMES[system], MODEL_NAMES[model]]
                listed = set()  # a variant that trains the same run as one above (an
                for v in VARIANTS:  # LSTM's lecun_f_* are its own recipe's runs): once
                    same = _key_for((f"blox:{v}", system, model, 0), args)
                    g = [] if same in listed else groups.get((system, model, f"blox:{v}"), [])
                    listed.add(same)
                    if g:
                        med = statistics.median(r["rmse"] for r in g)
                        best_step = statistics.median(r.get("best_step", 0) for r in g)
                        abl.append([*name, v, VARIANT_TEXT[v], len(g),
                                    _spread([r["rmse"] for r in g]), f"{med / ref:.3f}",
                                    f"{best_step:.0f}"])  # fmt: skip
                    other = [r["rmse_other"] for r in g if r.get("rmse_other") is not None]
                    if v == "base" and other:  # the same runs' final params
                        abl.append([*name, "base, final params", "the final params of the "
                                    "base runs (the same runs)", len(other), _spread(other),
                                    f"{statistics.median(other) / ref:.3f}", ""])  # fmt: skip
        header_abl = ["system", "model", "variant", "change", "seeds", "RMSE", "/ base",
                      "best step (median)"]  # fmt: skip
        lines += [_timing.format_table(header_abl, abl), ""]
    # docs/sysid.md gets the same body (machine, load, budget, seeds, tables) under its
    # own heading.
    sysid = [
        f"Measured by `benchmarks/sysid_vs_tsfast.py` (rendered {started:%Y-%m-%d}; "
        f"{args.threads} CPU thread(s) each; TSFast {tsfast_version})."
        + (" SMALL BUDGET (or fewer than 5 seeds): not a result yet." if small else ""),
        "Free-run test RMSE, median [min, max] over seeds; step and free-run times: "
        "blox / TSFast below 1 means blox is faster.",
        "",
        *lines[2:],
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
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated ablation variants to run, in this order "
        f"(default with --ablate: all of {list(VARIANTS)[1:]})",
    )
    parser.add_argument(
        "--no-base", action="store_true", help="leave out blox's recipe itself (with --variants)"
    )
    parser.add_argument(
        "--cache",
        default=os.path.join(HERE, "results", "sysid_vs_tsfast.jsonl"),
        help="JSON-lines file of finished runs: cached runs are skipped and "
        "the report is rendered from all cached runs ('' for none)",
    )
    parser.add_argument(
        "--render-only", action="store_true", help="run nothing: render the report from the cache"
    )
    parser.add_argument("--keep-going", action="store_true",
                        help="log a failed run and go on with the next")  # fmt: skip
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: tiny data, 1 epoch x 3 batches, 1 seed")  # fmt: skip
    parser.add_argument("--out", default=None, help="docs/benchmarks.md: write its section")
    parser.add_argument("--sysid-doc", default=None, help="docs/sysid.md: write its table")
    parser.add_argument("--json", default=None, help="write every run's results here")
    parser.add_argument(
        "--timing",
        default=os.path.join(HERE, "results", "sysid_vs_tsfast_timing.jsonl"),
        help="JSON-lines cache of short timing runs (made with --cache on a quiet "
        "machine): the report adds their step and free-run times (default: the file "
        "in git, benchmarks/results/sysid_vs_tsfast_timing.jsonl)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.size, args.epochs, args.batches_per_epoch, args.seeds = "tiny", 1, 3, 1
        args.timed_steps = 2
        if args.cache == parser.get_default("cache"):
            args.cache = ""  # a smoke test never mixes into the real cache
    if args.variants is not None:
        args.variants = [v for v in args.variants.split(",") if v]
    else:
        args.variants = list(VARIANTS)[1:] if args.ablate else []
    unknown = [v for v in args.variants if v not in VARIANTS or v == "base"]
    if unknown:
        parser.error(f"unknown variants {unknown}: known {list(VARIANTS)[1:]}")
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
    cache = load_cache(args.cache)
    jobs = [] if args.render_only else _jobs(args)
    todo = pending_jobs(jobs, cache, args)
    _timing.log(f"{len(jobs)} runs asked, {len(jobs) - len(todo)} cached in {args.cache}, "
                f"{len(todo)} to run")  # fmt: skip
    fresh = []
    with tempfile.TemporaryDirectory() as tmp:
        for k, job in enumerate(todo, 1):
            side, system, model, seed = job
            pred = os.path.join(tmp, f"pred_{k}.npy")
            claim = None
            if args.cache:  # another invocation may have run it, or be running it
                if _key_for(job, args) in load_cache(args.cache):
                    continue
                claim = claim_run(args.cache, _key_for(job, args))
                if claim is None:
                    _timing.log(f"[{k}/{len(todo)}] {side} {system} {model} seed {seed}: "
                                "running in another process")  # fmt: skip
                    continue
            try:
                res, wall = _run_child(_command(job, data, args, pred), cpus, args.threads)
            except RuntimeError as e:  # one failed run must not end a long queue
                if claim:
                    os.remove(claim)
                if not args.keep_going:
                    raise
                _timing.log(f"[{k}/{len(todo)}] {side} {system} {model} seed {seed} FAILED: {e}")
                continue
            res.update(side=side, system=system, model=model, seed=seed, wall_s=wall,
                       rmse=_test_rmse(pred, data[system]["spec"]["test"][0]),
                       rmse_other=(_test_rmse(pred + ".other.npy", data[system]["spec"]["test"][0])
                                   if os.path.exists(pred + ".other.npy") else None),
                       epochs=args.epochs, batches_per_epoch=args.batches_per_epoch,
                       size=args.size, recipe_settings=recipe_settings(side),
                       finished=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       load=os.getloadavg())  # fmt: skip
            res["threads"] = args.threads
            if args.cache:
                append_cache(args.cache, res)
                os.remove(claim)
            cache[_key_for(job, args)] = res
            fresh.append(res)
            _timing.log(f"[{k}/{len(todo)}] {side} {system} {model} seed {seed}: RMSE "
                        f"{res['rmse']:.4e}, step {1e3 * res['step_s']:.1f} ms, free run "
                        f"{res['free_run_s']:.3f} s, loop {res['loop_steps_per_s']:.1f} "
                        f"steps/s, process {wall:.1f} s")  # fmt: skip
    total = time.perf_counter() - t_all
    if args.cache:  # with the runs other invocations added meanwhile
        cache = {**cache, **load_cache(args.cache)}
    results = cached_results(cache, args) if args.cache else fresh
    args.timing_records = list(load_cache(args.timing).values()) if args.timing else []
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
