"""A training process for the atomicity test (run as a script; not a test module).

    python tests/ckpt/ckpt_worker.py DIR TOTAL

Resumes from the latest committed step in DIR (if any), prints ``restored step=<s>
digest=<sha256 of the state>``, then trains up to step TOTAL, saving every step
asynchronously and printing ``step=<s> digest=<...>`` after each step. At the end it
prints ``final digest=<...>``. The digest covers every array of the state, so two runs
agree on it only if their states are bit-identical. DIR ``-`` trains the same steps with
no checkpointing at all (the reference run).
"""

from __future__ import annotations

import hashlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import blox as bx
from blox import ckpt


def digest(state) -> str:
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(state):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()[:16]


def main(directory: str, total: int) -> None:
    graph = bx.Graph("net")
    rng = bx.Rng(graph.child("rng"))
    model = bx.Sequential(
        graph.child("body"),
        [
            bx.Linear(graph.child("fc1"), 64, rng),
            jax.nn.gelu,
            bx.Dropout(graph.child("drop"), 0.1, rng),
            bx.Linear(graph.child("head"), 4, rng),
        ],
    )
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    y = np.tanh(x[:, :4])
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, x, is_training=False)
    params = params.locked()
    tx = optax.adam(1e-2)

    def loss_fn(params, x, y):
        pred, params = model(params, x, is_training=True)
        return bx.mse(pred, y), params

    step_fn = jax.jit(bx.make_train_step(loss_fn, tx))
    state = {"params": params, "opt_state": tx.init(params.split()[0]), "step": 0}

    def train(save):
        nonlocal state
        while state["step"] < total:
            i = state["step"]
            xb, yb = jnp.roll(x, i, axis=0), jnp.roll(y, i, axis=0)
            p, o, _ = step_fn(state["params"], state["opt_state"], xb, yb)
            state = {"params": p, "opt_state": o, "step": i + 1}
            save(state)
            print(f"step={state['step']} digest={digest(state)}", flush=True)

    if directory == "-":
        train(lambda state: None)
    else:
        with ckpt.CheckpointManager(directory, save_every=1, max_to_keep=3) as mngr:
            if mngr.latest_step() is not None:
                state = mngr.restore(state)
                print(f"restored step={state['step']} digest={digest(state)}", flush=True)
            train(lambda state: mngr.save(state["step"], state))
    print(f"final digest={digest(state)}", flush=True)


if __name__ == "__main__":
    # The settings of the test suite (tests/conftest.py): strict dtype promotion.
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    jax.config.update("jax_numpy_rank_promotion", "raise")
    main(sys.argv[1], int(sys.argv[2]))
