"""`fit` checkpoints through `CheckpointCallback` and resumes on start.

A run interrupted at step k (Ctrl-C mid-epoch, or fewer epochs) and started again with the
same checkpoint directory gives, for the remaining steps, losses and final params whose
float bits equal those of an uninterrupted run. The reference is a hand-written Python loop
calling the same compiled step over the same batch order (not `fit`), for each kind of
data `fit` takes: a list, a function ``epoch -> generator`` (no length), a Grain stream
(position saved) and a plain stream (replayed). The model is an MLP with dropout (so the
RNG counter must resume too), trained with Adam, in float32 and in bfloat16."""

from __future__ import annotations

import functools
import shutil

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from blox import ckpt
from tests.ckpt._common import batch, init

PER_EPOCH, EPOCHS, BATCH = 4, 3, 8
TOTAL = PER_EPOCH * EPOCHS
BATCHES = [batch(i, BATCH) for i in range(PER_EPOCH)]
X = np.concatenate([b[0] for b in BATCHES])
Y = np.concatenate([b[1] for b in BATCHES])


def _cast(tree, dtype):
    def cast(a):
        return a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a

    return jax.tree.map(cast, tree)


@functools.cache
def _compiled(dtype, hidden):
    """The optimizer and the donated jitted step (built once: each run reuses the
    compiled program, as a restarted process compiles the same one)."""
    _, model = init(0, hidden)
    tx = optax.adam(1e-2)

    def loss_fn(params, x, y):
        pred, params = model(params, x.astype(dtype), is_training=True)
        return bx.mse(pred, y.astype(dtype)), params

    return tx, jax.jit(bx.make_train_step(loss_fn, tx), donate_argnums=(0, 1))


def _problem(dtype, hidden=8):
    """Fresh params (seed 0), optimizer state, and the step."""
    params = _cast(init(0, hidden)[0], dtype)
    tx, step = _compiled(dtype, hidden)
    return params, tx.init(params.split()[0]), step


def _perm(epoch):
    return np.random.default_rng(epoch).permutation(PER_EPOCH)


def _grain_ds():
    """Shuffled index batches, read in the main thread (no prefetch threads: faster here)."""
    ds = grain.MapDataset.range(len(X)).shuffle(seed=3).repeat().batch(BATCH)
    return ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))


def _data(mode):
    """(train_data, fit kwargs, the batch order of an uninterrupted run)."""
    if mode == "list":
        return BATCHES, {}, [BATCHES[i % PER_EPOCH] for i in range(TOTAL)]
    if mode == "generator":  # reshuffled per epoch, no len(): fit looks one batch ahead
        order = [BATCHES[i] for e in range(1, EPOCHS + 1) for i in _perm(e)]
        return (lambda e: (BATCHES[i] for i in _perm(e))), {}, order
    idx = iter(_grain_ds())
    order = [(X[i], Y[i]) for i in (next(idx) for _ in range(TOTAL))]
    ds = _grain_ds().map(lambda i: (X[i], Y[i]))
    if mode == "grain":  # a Grain iterator: its position is saved with each step
        stream = iter(ds)
    else:  # a plain iterator: fit replays it on resume
        stream = (b for b in iter(ds))
    return stream, {"steps_per_epoch": PER_EPOCH}, order


def _bits(values):
    return [np.asarray(v).tobytes() for v in values]


class Record(bx.Callback):
    def __init__(self, stop_at=None):
        self.losses, self.stop_at = [], stop_at

    def on_step_end(self, state):
        self.losses.append(np.asarray(state.metrics["loss"]))
        if state.step == self.stop_at:
            raise KeyboardInterrupt  # Ctrl-C


def _fit(directory, mode, dtype, *, stop_at=None, epochs=EPOCHS, record_first=True):
    params, opt_state, step = _problem(dtype)
    data, kwargs, _ = _data(mode)
    rec = Record(stop_at)
    cb = ckpt.CheckpointCallback(ckpt.CheckpointManager(directory, save_every=5))
    # The interrupt raised before or after the checkpoint callback's own on_step_end.
    callbacks = [rec, cb] if record_first else [cb, rec]
    res = bx.fit(
        step, params, opt_state, data, epochs=epochs, callbacks=callbacks, progress=False, **kwargs
    )
    return res, rec.losses, cb


@pytest.fixture(scope="module")
def references():
    """Per dtype and mode: the hand-written loop's losses and final params."""
    out = {}
    for dtype in ("float32", "bfloat16"):
        for mode in ("list", "generator", "grain", "iterator"):
            params, opt_state, step = _problem(dtype)
            losses = []
            for x, y in _data(mode)[2]:
                params, opt_state, metrics = step(params, opt_state, x, y)
                losses.append(np.asarray(metrics["loss"]))
            out[dtype, mode] = losses, params
    return out


@pytest.mark.parametrize(
    "mode, dtype, stop_at, record_first",
    [
        ("list", "float32", 6, True),
        ("list", "bfloat16", 7, False),
        ("generator", "float32", 6, False),
        ("grain", "float32", 7, True),
        ("grain", "bfloat16", 6, False),
        ("iterator", "float32", 6, True),
    ],
)
def test_interrupted_and_resumed_fit_is_bit_identical(
    tmp_path, references, mode, dtype, stop_at, record_first
):
    ref_losses, ref_params = references[dtype, mode]
    # The reference itself trains: the losses change, dropout draws.
    assert len(set(_bits(ref_losses))) == TOTAL

    first, first_losses, _ = _fit(tmp_path, mode, dtype, stop_at=stop_at, record_first=True)
    assert first.stopped == "interrupted" and first.steps == stop_at
    assert _bits(first_losses) == _bits(ref_losses[:stop_at])
    # Saved: step 5 (save_every=5) and the interrupted step, by the final save.
    assert ckpt.CheckpointManager(tmp_path).all_steps() == [5, stop_at]

    resumed, losses, cb = _fit(tmp_path, mode, dtype, record_first=record_first)
    assert cb.restored_step == stop_at
    assert resumed.stopped == "completed" and resumed.steps == TOTAL
    assert _bits(losses) == _bits(ref_losses[stop_at:])
    leaves, ref_leaves = jax.tree.leaves(resumed.params), jax.tree.leaves(ref_params)
    assert _bits(leaves) == _bits(ref_leaves)
    assert [np.asarray(a).dtype for a in leaves] == [np.asarray(a).dtype for a in ref_leaves]
    # The history of the resumed call: the resumed epoch 2 (its remaining steps), then 3.
    assert [r["epoch"] for r in resumed.history.rows] == [2, 3]
    assert [r["step"] for r in resumed.history.rows] == [8, 12]
    np.testing.assert_allclose(
        resumed.history["train/loss"][0],
        np.mean(np.asarray(losses[: 8 - stop_at], np.float64)),
        rtol=1e-12,
    )
    # At the end: the last step saved, every write committed.
    assert ckpt.CheckpointManager(tmp_path).latest_step() == TOTAL

    # Starting once more with everything done: restores step 12, runs nothing.
    again, none, _ = _fit(tmp_path, mode, dtype)
    assert again.steps == TOTAL and none == [] and len(again.history) == 0
    assert _bits(jax.tree.leaves(again.params)) == _bits(ref_leaves)


def test_resume_at_an_epoch_boundary_after_a_shorter_run(tmp_path, references):
    ref_losses, ref_params = references["float32", "generator"]
    first, first_losses, _ = _fit(tmp_path, "generator", "float32", epochs=1)
    assert first.stopped == "completed" and first.steps == PER_EPOCH
    assert _bits(first_losses) == _bits(ref_losses[:PER_EPOCH])
    resumed, losses, _ = _fit(tmp_path, "generator", "float32")
    assert [r["epoch"] for r in resumed.history.rows] == [2, 3]
    assert _bits(losses) == _bits(ref_losses[PER_EPOCH:])
    assert _bits(jax.tree.leaves(resumed.params)) == _bits(jax.tree.leaves(ref_params))


def test_keep_best_by_an_eval_metric(tmp_path, references):
    ref_losses, _ = references["float32", "list"]
    params, opt_state, step = _problem("float32")
    scores = [0.7, 0.2, 0.5, 0.9, 0.4, 0.6]  # best at epoch 2 (step 8)
    calls = []

    def eval_fn(params):
        calls.append(1)
        return {"score": jnp.asarray(scores[len(calls) - 1])}

    mngr = ckpt.CheckpointManager(
        tmp_path, save_every=100, max_to_keep=1, best_metric="eval/score", best_mode="min"
    )
    res = bx.fit(
        step,
        params,
        opt_state,
        BATCHES,
        epochs=6,
        eval_fn=eval_fn,
        callbacks=[ckpt.CheckpointCallback(mngr)],
        progress=False,
    )
    assert res.steps == 24
    # Kept: the best step, and the latest one (to resume).
    reader = ckpt.CheckpointManager(tmp_path, best_metric="eval/score", best_mode="min")
    assert reader.all_steps() == [8, 24] and reader.best_step() == 8
    saved = reader.metrics(8)
    assert saved["eval/score"] == pytest.approx(0.2)
    assert saved["train/loss"] == pytest.approx(np.mean(np.asarray(ref_losses[4:8], np.float64)))
    # The best step holds the params of step 8 of the hand-written loop.
    params, opt_state, step = _problem("float32")
    for i in range(8):
        params, opt_state, _ = step(params, opt_state, *BATCHES[i % PER_EPOCH])
    fresh, _ = init(5)
    best = reader.restore({"params": fresh, "opt_state": opt_state, "step": 0}, step=8)
    assert best["step"] == 8
    assert _bits(jax.tree.leaves(best["params"])) == _bits(jax.tree.leaves(params))
    reader.close()


# -- errors ------------------------------------------------------------------------


def test_checkpoint_of_another_model_is_a_clear_error(tmp_path):
    _fit(tmp_path, "list", "float32", epochs=1)
    params, opt_state, step = _problem("float32", hidden=16)
    cb = ckpt.CheckpointCallback(ckpt.CheckpointManager(tmp_path))
    with pytest.raises(
        ckpt.RestoreMismatchError,
        match=r"(?s)step 4 does not match.*params/net/fc1/kernel: saved float32\[4, 8\], "
        r"target float32\[4, 16\].*Nothing was restored",
    ):
        bx.fit(step, params, opt_state, BATCHES, callbacks=[cb], progress=False)


def test_checkpoint_without_iterator_state_resumed_with_a_grain_stream(tmp_path):
    _fit(tmp_path, "list", "float32", epochs=1)
    params, opt_state, step = _problem("float32")
    stream, kwargs, _ = _data("grain")
    cb = ckpt.CheckpointCallback(ckpt.CheckpointManager(tmp_path))
    with pytest.raises(ValueError, match="step 4 has no data-iterator state"):
        bx.fit(step, params, opt_state, stream, callbacks=[cb], progress=False, **kwargs)


def test_resume_positions_the_stream_from_the_step(tmp_path, references):
    """data_from_step=True: the Grain stream is set to batch `step` instead of its saved
    position (here removed, as for a step saved by another process count); the resumed
    losses are the uninterrupted run's."""
    ref_losses, ref_params = references["float32", "grain"]
    _fit(tmp_path, "grain", "float32", stop_at=6)
    for s in (5, 6):
        shutil.rmtree(tmp_path / str(s) / "data")
    params, opt_state, step = _problem("float32")
    stream, kwargs, _ = _data("grain")
    rec = Record()
    cb = ckpt.CheckpointCallback(ckpt.CheckpointManager(tmp_path), data_from_step=True)
    res = bx.fit(
        step, params, opt_state, stream, epochs=EPOCHS, callbacks=[rec, cb], progress=False,
        **kwargs,
    )  # fmt: skip
    assert cb.restored_step == 6 and res.steps == TOTAL
    assert _bits(rec.losses) == _bits(ref_losses[6:])
    assert _bits(jax.tree.leaves(res.params)) == _bits(jax.tree.leaves(ref_params))
    with pytest.raises(TypeError, match="data_from_step must be False, True .* got 1"):
        ckpt.CheckpointCallback(ckpt.CheckpointManager(tmp_path), data_from_step=1)


def test_callback_argument_errors(tmp_path):
    with pytest.raises(TypeError, match="manager must be a blox.ckpt.CheckpointManager"):
        ckpt.CheckpointCallback(str(tmp_path))
    mngr = ckpt.CheckpointManager(tmp_path)
    with pytest.raises(TypeError, match="data_iterator must have get_state"):
        ckpt.CheckpointCallback(mngr, data_iterator=iter(BATCHES))
    params, opt_state, step = _problem("float32")
    cb = ckpt.CheckpointCallback(mngr, data_iterator=iter(_grain_ds()))
    with pytest.raises(ValueError, match="fit draws no stream here.*drop data_iterator"):
        bx.fit(step, params, opt_state, BATCHES, callbacks=[cb], progress=False)
    mngr.close()


def test_best_metric_that_fit_never_logs(tmp_path):
    params, opt_state, step = _problem("float32")
    mngr = ckpt.CheckpointManager(tmp_path / "a", best_metric="eval/loss")
    with pytest.raises(ValueError, match="fit has no eval_fn.*best_metric='train/loss'"):
        bx.fit(
            step,
            params,
            opt_state,
            BATCHES,
            callbacks=[ckpt.CheckpointCallback(mngr)],
            progress=False,
        )
    mngr.close()
    params, opt_state, step = _problem("float32")
    mngr = ckpt.CheckpointManager(tmp_path / "b", best_metric="eval/los")
    with pytest.raises(
        ValueError, match=r"'eval/los' is never logged.*\['train/loss', 'eval/loss'"
    ):
        bx.fit(
            step,
            params,
            opt_state,
            BATCHES,
            eval_fn=lambda p: {"loss": jnp.zeros(())},
            callbacks=[ckpt.CheckpointCallback(mngr)],
            progress=False,
        )
    mngr.close()
