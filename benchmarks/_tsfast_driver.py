"""TSFast's side of ``benchmarks/sysid_vs_tsfast.py``: one training run of TSFast's own
documented recipe, through its own API, in the peer venv (``.venv-tsfast``, never
``.venv``).

    .venv-tsfast/bin/python benchmarks/_tsfast_driver.py --files files.json --model lstm \
        --seed 0 --epochs 10 --batches-per-epoch 300 --threads 2 --pred pred.npy

The recipe is TSFast 0.5.0's for a simulation benchmark (its README's quick start, its
examples ``02_simulation`` and ``13_identibench``, and ``BENCHMARK_DL_KWARGS`` for the
Silverbox and Wiener-Hammerstein simulation benchmarks): ``create_dls`` on the HDF5
files (windows of 200, stride 1, batch 64, ``n_batches_train`` batches per epoch drawn
with replacement), ``RNNLearner(dls, rnn_type=..., num_layers=..., hidden_size=40,
n_skip=50, metrics=[fun_rmse])`` with its defaults (L1 loss on raw outputs, inputs
standardized, Adam, no clipping), ``fit_flat_cos(n_epoch, lr=3e-3)``; the model after
the last step is the one evaluated, free-run on the whole test recording through
``InferenceWrapper``. Nothing of it is re-implemented here.

Prints one line ``RESULT {json}`` (times in seconds) and saves the test simulation
``[T, Cy]`` to ``--pred``; the caller computes the error, the same way for both sides.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib import metadata

import h5py
import numpy as np
import torch
from tsfast.inference import InferenceWrapper
from tsfast.training import RNNLearner, fun_rmse
from tsfast.tsdata.pipeline import create_dls

MODELS = {"lstm": ("lstm", 1), "gru": ("gru", 2)}  # rnn_type, num_layers (hidden 40)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", required=True, help="JSON {train, valid, test: [paths]}")
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    parser.add_argument("--batches-per-epoch", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--pred", required=True, help=".npy file for the test simulation")
    parser.add_argument("--hidden", type=int, default=40)
    parser.add_argument("--window", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--n-skip", type=int, default=50)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--timed-steps", type=int, default=20)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)
    with open(args.files) as f:
        files = json.load(f)

    t_start = time.perf_counter()
    dls = create_dls(u=["u"], y=["y"], dataset=files, win_sz=args.window, bs=args.batch,
                     n_batches_train=args.batches_per_epoch)  # fmt: skip
    rnn_type, layers = MODELS[args.model]
    lrn = RNNLearner(dls, rnn_type=rnn_type, num_layers=layers, hidden_size=args.hidden,
                     n_skip=args.n_skip, metrics=[fun_rmse], show_bar=False)  # fmt: skip
    t0 = time.perf_counter()
    lrn.fit_flat_cos(n_epoch=args.epochs, lr=args.lr)
    fit_s = time.perf_counter() - t0
    steps = args.epochs * len(dls.train)

    # Free run of the whole test recording (the final model, as TSFast's recipe keeps).
    with h5py.File(files["test"][0], "r") as f:
        u = np.asarray(f["u"], np.float32).reshape(len(f["u"]), -1)
    wrapper = InferenceWrapper(lrn)
    t0 = time.perf_counter()
    pred = wrapper.inference(u)
    free_run_first_s = time.perf_counter() - t0
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        wrapper.inference(u)
        runs.append(time.perf_counter() - t0)
    np.save(args.pred, np.asarray(pred, np.float32).reshape(len(u), -1))

    # The training step alone (forward, L1 loss, backward, Adam), on one batch.
    lrn.model.train()
    xb, yb = lrn.prepare_batch(next(iter(dls.train)), training=True)
    for _ in range(2):
        lrn.training_step(xb, yb)
    times = []
    for _ in range(args.timed_steps):
        t0 = time.perf_counter()
        lrn.training_step(xb, yb)  # returns loss.item(): waited for
        times.append(time.perf_counter() - t0)

    result = {
        "side": "tsfast",
        "steps": steps,
        "fit_s": fit_s,
        "loop_steps_per_s": steps / fit_s,
        "step_s": statistics.median(times),
        "free_run_s": statistics.median(runs),
        "free_run_first_s": free_run_first_s,
        "test_len": len(u),
        "final_train_loss": float(lrn.recorder[-1][0]) if lrn.recorder else float("nan"),
        "process_s": time.perf_counter() - t_start,
        "torch": torch.__version__,
        "tsfast": metadata.version("tsfast"),
        "threads": torch.get_num_threads(),
    }
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
