"""A run interrupted at step k and resumed gives, for the following steps,
losses whose float bits equal those of the uninterrupted run. Model: the single-device demo
(`examples/mlp_regression.py`, an MLP with dropout, so the RNG counter must resume too),
Adam, data order from a shuffled Grain iterator whose position is checkpointed."""

from __future__ import annotations

import importlib.util

import grain
import jax
import numpy as np
import optax
import pytest

import blox as bx
from blox import ckpt
from tests.scripts import ROOT

TOTAL, K, BATCH, HIDDEN = 8, 3, 16, 16


def _demo():
    spec = importlib.util.spec_from_file_location("mlp_demo", ROOT / "examples/mlp_regression.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DEMO = _demo()
X, Y = DEMO.make_data(128, seed=0)


_, RNG, MODEL = DEMO.build(HIDDEN)
TX = optax.adam(optax.cosine_decay_schedule(3e-3, TOTAL))


def _loss_fn(params, x, y):
    pred, params = MODEL(params, x, is_training=True)
    return bx.mse(pred, y), params


# Compiled once for the module (a new process would compile the same program again).
STEP = jax.jit(bx.make_train_step(_loss_fn, TX), donate_argnums=(0, 1))


def _fresh(seed: int):
    """What a process builds from scratch: params, optimizer state, step, data iterator."""
    params = RNG.seed(bx.Params(), seed=seed)
    _, params = MODEL(params, X[:BATCH], is_training=False)
    params = params.locked()
    opt_state = TX.init(params.split()[0])
    data = iter(grain.MapDataset.range(len(X)).shuffle(seed=7).repeat().batch(BATCH))
    return {"params": params, "opt_state": opt_state, "step": 0}, STEP, data


@pytest.fixture(scope="module")
def reference():
    return _run(*_fresh(seed=0), until=TOTAL)


def _run(state, step_fn, data, until, mngr=None):
    losses = []
    while state["step"] < until:
        idx = next(data)
        params, opt_state, metrics = step_fn(state["params"], state["opt_state"], X[idx], Y[idx])
        state = {"params": params, "opt_state": opt_state, "step": state["step"] + 1}
        losses.append(np.asarray(metrics["loss"]))
        if mngr is not None:
            mngr.save(state["step"], state, data_iterator=data)
    return state, losses


def _bits(losses):
    return [np.asarray(v, np.float32).view(np.uint32).item() for v in losses]


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_resumed_losses_are_bit_identical(tmp_path, async_save, reference):
    ref_state, ref_losses = reference

    # Run k steps with checkpoints, then "kill" the process: drop every object.
    with ckpt.CheckpointManager(tmp_path, save_every=K, async_save=async_save) as mngr:
        _run(*_fresh(seed=0), until=K, mngr=mngr)
    del mngr

    # A new process would do exactly this: build from scratch (another seed, so that
    # only the checkpoint can make the numbers right), restore, continue.
    state, step_fn, data = _fresh(seed=123)
    mngr = ckpt.CheckpointManager(tmp_path, save_every=K, async_save=async_save)
    assert mngr.latest_step() == K
    state = mngr.restore(state, data_iterator=data)
    assert state["step"] == K
    state, losses = _run(state, step_fn, data, until=TOTAL, mngr=mngr)
    mngr.close()

    assert len(losses) == TOTAL - K
    assert _bits(losses) == _bits(ref_losses[K:])
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    # Dropout really draws: the RNG counter moved with every step.
    assert int(state["params"][("net", "rng", "counter")].value) > TOTAL
