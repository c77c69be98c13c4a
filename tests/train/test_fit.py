"""`fit`: early stopping, history, loggers (stdout, CSV, TensorBoard read back), Ctrl-C,
plots, errors. References: the same steps run by hand in a Python loop, NumPy means,
and TensorBoard's own event reader."""

from __future__ import annotations

import csv
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from tests.tolerances import tol

STEPS_PER_EPOCH = 4


def copy(tree):
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def problem():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    model = bx.Linear(g / "fc", 1, rng)
    r = np.random.default_rng(0)
    w_true = r.standard_normal((3, 1)).astype(np.float32)
    batches = []
    for _ in range(STEPS_PER_EPOCH):
        x = r.standard_normal((8, 3)).astype(np.float32)
        batches.append((x, x @ w_true))
    params = model(rng.seed(bx.Params(), seed=0), batches[0][0])[1].locked()

    def loss_fn(params, x, y):
        y_hat, params = model(params, x)
        return bx.mse(y_hat, y), params

    tx = optax.sgd(0.05)
    step = jax.jit(bx.make_train_step(loss_fn, tx), donate_argnums=(0, 1))
    plain_step = jax.jit(bx.make_train_step(loss_fn, tx))
    opt_state = tx.init(params.split()[0])
    return params, opt_state, batches, step, plain_step


def manual(plain_step, params, opt_state, batches, n_steps):
    """The reference: the same step in a plain Python loop."""
    losses = []
    for i in range(n_steps):
        params, opt_state, m = plain_step(params, opt_state, *batches[i % len(batches)])
        losses.append(float(m["loss"]))
    return params, losses


def scripted_eval(values):
    calls = []

    def eval_fn(params):
        calls.append(1)
        return {"score": values[len(calls) - 1]}

    return eval_fn


def test_fit_history_matches_a_manual_loop():
    params, opt, batches, step, plain = problem()
    ref_params, losses = manual(plain, params, opt, batches, 3 * STEPS_PER_EPOCH)
    res = bx.fit(step, copy(params), copy(opt), batches, epochs=3, progress=False)
    assert res.stopped == "completed" and res.steps == 12 and len(res.history) == 3
    per_epoch = np.asarray(losses).reshape(3, STEPS_PER_EPOCH).mean(1)
    np.testing.assert_allclose(res.history["train/loss"], per_epoch, **tol("float32"))
    assert [r["step"] for r in res.history.rows] == [4, 8, 12]
    for k in params.keys():
        np.testing.assert_allclose(res.params[k].value, ref_params[k].value, **tol("float32"))
    first = res.history.rows[0]
    assert first["time/compile_s"] > 0 and first["time/steps_per_s"] > 0
    assert first["time/examples_per_s"] == pytest.approx(8 * first["time/steps_per_s"])
    assert "time/compile_s" not in res.history.rows[1]
    stats = jax.local_devices()[0].memory_stats()
    assert ("memory/bytes_in_use" in first) == bool(stats and "bytes_in_use" in stats)


def test_early_stopping_triggers_at_the_right_epoch_and_restores_best():
    params, opt, batches, step, plain = problem()
    # best at epoch 2, then two evaluations without improvement -> stop after epoch 4.
    scores = [1.0, 0.8, 0.9, 0.85, 0.5, 0.4]
    stopper = bx.EarlyStopping("eval/score", patience=2, restore_best=True)
    res = bx.fit(
        step,
        copy(params),
        copy(opt),
        batches,
        epochs=6,
        eval_fn=scripted_eval(scores),
        callbacks=[stopper],
        progress=True,
    )
    assert len(res.history) == 4 and stopper.stopped_epoch == 4
    assert (stopper.best, stopper.best_epoch) == (0.8, 2)
    assert res.stopped.startswith("early stopping: eval/score did not improve for 2")
    assert res.history["eval/score"] == scores[:4]
    best_params, _ = manual(plain, params, opt, batches, 2 * STEPS_PER_EPOCH)
    for k in params.keys():
        np.testing.assert_allclose(res.params[k].value, best_params[k].value, **tol("float32"))


def test_early_stopping_min_delta_mode_max_and_eval_every():
    params, opt, batches, step, _ = problem()
    stopper = bx.EarlyStopping("eval/score", patience=1, mode="max", min_delta=0.1)
    # evaluated at epochs 2, 4, 6: 0.5 -> 0.55 is not an improvement of > 0.1.
    res = bx.fit(
        step,
        params,
        opt,
        batches,
        epochs=6,
        eval_every=2,
        eval_fn=scripted_eval([0.5, 0.55, 0.9]),
        callbacks=[stopper],
        progress=False,
    )
    assert stopper.stopped_epoch == 4 and len(res.history) == 4
    assert "eval/score" not in res.history.rows[0] and "eval/score" in res.history.rows[1]


def test_tensorboard_csv_and_stdout_loggers(tmp_path, capsys):
    from tensorboard.backend.event_processing import event_accumulator

    params, opt, batches, step, _ = problem()
    tb_dir, csv_path = tmp_path / "tb", tmp_path / "log" / "metrics.csv"
    res = bx.fit(
        step,
        params,
        opt,
        batches,
        epochs=3,
        eval_fn=lambda p: {"w_norm": jnp.sum(p[("net", "fc", "kernel")].value ** 2)},
        loggers=[bx.TensorBoardLogger(tb_dir), bx.CSVLogger(csv_path), bx.StdoutLogger()],
        progress=False,
    )
    acc = event_accumulator.EventAccumulator(str(tb_dir))
    acc.Reload()
    assert {"train/loss", "eval/w_norm", "time/steps_per_s"} <= set(acc.Tags()["scalars"])
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [4, 8, 12]
    np.testing.assert_allclose([e.value for e in events], res.history["train/loss"], rtol=1e-6)
    np.testing.assert_allclose(
        [e.value for e in acc.Scalars("eval/w_norm")], res.history["eval/w_norm"], rtol=1e-6
    )

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 3 and "time/compile_s" in rows[0] and rows[1]["time/compile_s"] == ""
    np.testing.assert_allclose(
        [float(r["train/loss"]) for r in rows], res.history["train/loss"], rtol=1e-12
    )

    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("epoch")]
    assert len(lines) == 3 and lines[2].startswith("epoch 3 step 12 | train/loss ")


def test_ctrl_c_stops_cleanly_keeping_the_last_params(tmp_path):
    params, opt, batches, step, plain = problem()

    class Interrupt(bx.Callback):
        def on_step_end(self, state):
            if state.step == 6:
                raise KeyboardInterrupt

    ended = []

    class End(bx.Callback):
        def on_train_end(self, state):
            ended.append(state.step)

    res = bx.fit(
        step,
        copy(params),
        copy(opt),
        batches,
        epochs=5,
        callbacks=[Interrupt(), End()],
        loggers=[bx.CSVLogger(tmp_path / "m.csv")],
        progress=True,
    )
    assert res.stopped == "interrupted" and res.steps == 6 and ended == [6]
    assert len(res.history) == 1  # epoch 1 completed, epoch 2 interrupted
    ref, _ = manual(plain, params, opt, batches, 6)
    for k in params.keys():
        np.testing.assert_allclose(res.params[k].value, ref[k].value, **tol("float32"))


def test_steps_per_epoch_draws_from_one_stream_until_exhausted():
    params, opt, batches, step, _ = problem()
    stream = iter(batches * 2)  # 8 batches
    res = bx.fit(step, params, opt, stream, epochs=5, steps_per_epoch=3, progress=False)
    assert res.steps == 8 and len(res.history) == 3 and res.stopped == "data exhausted"


def test_function_callbacks_and_callable_data():
    params, opt, batches, step, _ = problem()
    seen = []
    res = bx.fit(
        step,
        params,
        opt,
        lambda epoch: batches[:epoch],  # epochs are numbered from 1
        epochs=3,
        callbacks=[lambda state: seen.append((state.epoch, state.step))],
        progress=False,
    )
    assert seen == [(1, 1), (2, 3), (3, 6)] and res.steps == 6


def test_epochs_are_numbered_from_1_everywhere(tmp_path, capsys):
    # One convention: FitState.epoch, train_data(epoch), the history rows, the CSV, the
    # stdout line, EarlyStopping's epochs and its stop message all say 1, 2, 3, ...
    params, opt, batches, step, _ = problem()
    seen: dict[str, list] = {"begin": [], "step": [], "end": [], "data": []}

    class Record(bx.Callback):
        def on_train_begin(self, state):
            seen["begin"].append(state.epoch)

        def on_step_end(self, state):
            seen["step"].append(state.epoch)

        def on_epoch_end(self, state):
            seen["end"].append((state.epoch, state.history.rows[-1]["epoch"]))

    def data(epoch):
        seen["data"].append(epoch)
        return batches[:2]

    stopper = bx.EarlyStopping("eval/score", patience=1)
    csv_path = tmp_path / "m.csv"
    res = bx.fit(
        step,
        params,
        opt,
        data,
        epochs=5,
        eval_fn=scripted_eval([3.0, 1.0, 2.0, 0.5, 0.1]),  # best at epoch 2, stop after 3
        callbacks=[Record(), stopper],
        loggers=[bx.CSVLogger(csv_path), bx.StdoutLogger()],
        progress=False,
    )
    assert seen["begin"] == [0]  # before the first epoch
    assert seen["data"] == [1, 2, 3]
    assert seen["step"] == [1, 1, 2, 2, 3, 3]
    assert seen["end"] == [(1, 1), (2, 2), (3, 3)]
    assert [r["epoch"] for r in res.history.rows] == [1, 2, 3]
    with open(csv_path) as f:
        assert [int(r["epoch"]) for r in csv.DictReader(f)] == [1, 2, 3]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("epoch")]
    assert [ln.split()[1] for ln in lines] == ["1", "2", "3"]
    assert (stopper.best_epoch, stopper.stopped_epoch) == (2, 3)
    assert res.stopped.endswith("(best 1 at epoch 2)")

    # A stream: the data function is called once, with 1.
    calls = []
    bx.fit(
        step,
        *problem()[:2],
        lambda epoch: calls.append(epoch) or iter(batches * 3),
        epochs=2,
        steps_per_epoch=2,
        progress=False,
    )
    assert calls == [1]


def test_plot_history_writes_a_png(tmp_path):
    h = bx.History(
        [
            {"epoch": 1, "step": 4, "train/loss": 2.0, "eval/loss": 2.5, "eval/acc": 0.1},
            {"epoch": 2, "step": 8, "train/loss": 1.0, "eval/loss": 1.5, "eval/acc": 0.5},
        ]
    )
    fig = bx.plot_history(h, path=tmp_path / "out" / "curve.png", logy=True)
    assert [ax.get_title() for ax in fig.axes] == ["loss", "acc"]
    assert len(fig.axes[0].lines) == 2
    assert (tmp_path / "out" / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match=r"no metric 'eval/f1'; logged: \['epoch'"):
        bx.plot_history(h, ["eval/f1"])


# -- errors ------------------------------------------------------------------------


def test_early_stopping_on_a_metric_never_logged():
    params, opt, batches, step, _ = problem()
    with pytest.raises(
        ValueError, match=r"'eval/los' is never logged.*\['train/loss', 'eval/loss'"
    ):
        bx.fit(
            step,
            params,
            opt,
            batches,
            epochs=3,
            eval_fn=lambda p: {"loss": jnp.zeros(())},
            callbacks=[bx.EarlyStopping("eval/los")],
            progress=False,
        )
    params, opt, batches, step, _ = problem()
    with pytest.raises(ValueError, match="fit has no eval_fn.*monitor a train metric"):
        bx.fit(step, params, opt, batches, callbacks=[bx.EarlyStopping()], progress=False)


def test_fit_argument_errors():
    params, opt, batches, step, _ = problem()
    with pytest.raises(ValueError, match="iterator, which is exhausted after the first epoch"):
        bx.fit(step, params, opt, iter(batches), epochs=2, progress=False)
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        bx.fit(step, params, opt, batches, epochs=0)
    with pytest.raises(TypeError, match=r"step must return \(params, opt_state, metrics\)"):
        bx.fit(lambda p, o, x, y: (p, o), params, opt, batches, progress=False)
    with pytest.raises(TypeError, match="eval_fn must return a dict"):
        bx.fit(step, params, opt, batches, eval_fn=lambda p: 1.0, progress=False)
    with pytest.raises(ValueError, match="mode must be 'min' or 'max'"):
        bx.EarlyStopping(mode="lowest")


@pytest.mark.parametrize(
    "module, call",
    [
        ("tqdm", lambda p, o, b, s: bx.fit(s, p, o, b, progress=True)),
        ("tensorboardX", lambda p, o, b, s: bx.TensorBoardLogger("unused")),
        ("matplotlib.figure", lambda p, o, b, s: bx.plot_history(bx.History([{"x/a": 1.0}]))),
    ],
)
def test_missing_optional_dependency_says_how_to_install(monkeypatch, module, call):
    params, opt, batches, step, _ = problem()
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    with pytest.raises(ImportError, match=r"pip install 'blox\[train\]'"):
        call(params, opt, batches, step)


def test_fit_runs_a_steps_per_dispatch_step():
    params, opt, batches, _, plain = problem()
    _, losses = manual(plain, params, opt, batches, STEPS_PER_EPOCH)
    g = bx.Graph("net")  # same model and loss as problem(), rebuilt to get the raw step
    rng = bx.Rng(g / "rng")
    model = bx.Linear(g / "fc", 1, rng)

    def loss_fn(params, x, y):
        y_hat, params = model(params, x)
        return bx.mse(y_hat, y), params

    multi = jax.jit(bx.steps_per_dispatch(bx.make_train_step(loss_fn, optax.sgd(0.05)), 2))
    stacked = [bx.stack_batches(batches[:2]), bx.stack_batches(batches[2:])]
    res = bx.fit(multi, params, opt, stacked, examples_per_step=16, progress=False)
    assert res.steps == 2
    np.testing.assert_allclose(res.history["train/loss"], [np.mean(losses)], **tol("float32"))


# -- resuming (a callback sets the step in on_train_begin) ---------------------------


class Resume(bx.Callback):
    """Restores the state of step `at` computed by the hand-written loop (no checkpoint
    library: this is fit's side of resuming)."""

    def __init__(self, params, opt_state, at, restored_stream=False):
        self.state, self.at, self.restored_stream = (params, opt_state), at, restored_stream
        self.seen = []

    def on_train_begin(self, state):
        state.params, state.opt_state = copy(self.state)
        state.step = self.at
        state.stream_restored = self.restored_stream

    def on_step_end(self, state):
        self.seen.append((state.step, state.epoch, state.last_in_epoch))


def test_fit_resumes_from_the_step_a_callback_restores():
    params, opt, batches, step, plain = problem()
    ref_params, losses = manual(plain, params, opt, batches, 3 * STEPS_PER_EPOCH)
    p, o = params, opt
    for i in range(6):
        p, o, _ = plain(p, o, *batches[i % STEPS_PER_EPOCH])
    mid_params, mid_opt = p, o
    resume = Resume(mid_params, mid_opt, 6)
    res = bx.fit(
        step, copy(params), copy(opt), batches, epochs=3, callbacks=[resume], progress=False
    )
    assert res.steps == 12 and [r["epoch"] for r in res.history.rows] == [2, 3]
    assert [s for s, _, _ in resume.seen] == list(range(7, 13))
    assert [e for _, e, _ in resume.seen] == [2, 2, 3, 3, 3, 3]
    assert [s for s, _, last in resume.seen if last] == [8, 12]
    np.testing.assert_allclose(
        res.history["train/loss"], [np.mean(losses[6:8]), np.mean(losses[8:])], **tol("float32")
    )
    for k in params.keys():
        np.testing.assert_allclose(res.params[k].value, ref_params[k].value, **tol("float32"))


def test_resume_with_variable_epochs_streams_and_generators():
    params, opt, batches, step, _ = problem()
    # Epoch e has e batches (1, 2, 3): step 4 is the first step of epoch 3 (skipped: 1 + 2).
    calls, resume = [], Resume(params, opt, 4)
    res = bx.fit(
        step,
        copy(params),
        copy(opt),
        lambda e: calls.append(e) or (b for b in batches[:e]),  # no len()
        epochs=3,
        callbacks=[resume],
        progress=False,
    )
    assert calls == [1, 2, 3] and res.steps == 6
    assert resume.seen == [(5, 3, False), (6, 3, True)]

    # A stream: replayed (4 batches drawn before step 5) unless its position was restored.
    for restored, first in ((False, 4), (True, 0)):
        drawn = []
        stream = (drawn.append(i) or batches[i % 4] for i in range(100))
        resume = Resume(params, opt, 4, restored_stream=restored)
        res = bx.fit(
            step,
            copy(params),
            copy(opt),
            stream,
            epochs=3,
            steps_per_epoch=3,
            callbacks=[resume],
            progress=False,
        )
        assert res.steps == 9 and [r["epoch"] for r in res.history.rows] == [2, 3]
        assert drawn[: 5 - first] == list(range(5 - first)) and len(drawn) == first + 5
        assert [s for s, _, last in resume.seen if last] == [6, 9]

    # Resuming past the end runs nothing.
    res = bx.fit(
        step,
        copy(params),
        copy(opt),
        batches,
        epochs=2,
        callbacks=[Resume(params, opt, 8)],
        progress=False,
    )
    assert res.steps == 8 and len(res.history) == 0 and res.stopped == "completed"


def test_resume_step_errors():
    params, opt, batches, step, _ = problem()

    class Bad(bx.Callback):
        def __init__(self, value):
            self.value = value

        def on_train_begin(self, state):
            state.step = self.value

    with pytest.raises(TypeError, match="state.step must be an int after on_train_begin"):
        bx.fit(step, params, opt, batches, callbacks=[Bad(jnp.asarray(3))], progress=False)
    with pytest.raises(ValueError, match="state.step must be >= 0"):
        bx.fit(step, params, opt, batches, callbacks=[Bad(-1)], progress=False)
