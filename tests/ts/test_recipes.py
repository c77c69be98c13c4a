"""blox.ts recipes and evaluation: TBPTT with carried state vs one long unroll, the loss over
TBPTT chunks vs whole windows, noise/bias injection, training, early stopping, metrics."""

import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from blox.data import WindowedSource, channel_stats, pipeline
from blox.ts import (
    ARModel,
    RNNModel,
    evaluate_free_run,
    fit_sysid,
    free_run,
    inject_noise,
    make_dataset,
    make_sysid_step,
    plot_simulation,
    read_recordings,
    sysid_loss,
    sysid_metrics,
)

U_STATS = ([0.0], [1.0])
Y_STATS = ([0.0], [1.0])


def _model(kind, n_skip=0):
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    if kind == "ar":
        model = ARModel(g / kind, U_STATS, Y_STATS, rng, hidden_size=6, n_skip=n_skip)
    else:
        model = RNNModel(g / kind, U_STATS, Y_STATS, rng, hidden_size=6, num_layers=2,
                         cell=kind, n_skip=n_skip)  # fmt: skip
    return model, rng


@pytest.mark.parametrize("kind", ["lstm", "ar"])
def test_tbptt_with_carried_state_equals_one_long_unroll(kind):
    model, rng = _model(kind)
    gen = np.random.default_rng(0)
    u = gen.normal(size=(2, 24, 1)).astype(np.float32)
    y = gen.normal(size=(2, 24, 1)).astype(np.float32)
    params = rng.seed(bx.Params(), seed=0)
    (whole, _), params = model.forward(params, u, y)
    params = params.locked()
    (whole, _), _ = model.forward(params, u, y)
    state, parts = None, []
    for k in range(3):
        sl = slice(8 * k, 8 * (k + 1))
        (out, state), _ = model.forward(params, u[:, sl], y[:, sl], state)
        parts.append(out)
    np.testing.assert_allclose(np.concatenate(parts, 1), whole, rtol=1e-5, atol=1e-6)
    # A reset at a chunk start equals starting afresh there.
    reset = np.zeros((2, 8), bool)
    reset[:, 0] = True
    (again, _), _ = model.forward(params, u[:, 8:16], y[:, 8:16], state, reset)
    (fresh, _), _ = model.forward(params, u[:, 8:16], y[:, 8:16])
    np.testing.assert_allclose(again, fresh, rtol=1e-6, atol=1e-6)


def test_tbptt_pipeline_loss_equals_the_whole_window_loss(tmp_path):
    files = make_dataset("discrete", tmp_path, seed=0, size="tiny")
    src = WindowedSource(files.train, {"u": "u", "y": "y"}, window=24, stride=24)
    model, rng = _model("gru", n_skip=5)
    whole = next(iter(pipeline(src, batch_size=4, drop_remainder=True)))
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, whole["u"])
    params = params.locked()
    (ref, _), _ = sysid_loss(model, params, whole)
    it = iter(pipeline(src, batch_size=4, tbptt_chunk=8, drop_remainder=True))
    state, _ = model.initial_state(params, whole["u"][:, 0])
    total = count = 0.0
    for k in range(3):
        chunk = next(it)
        assert chunk["is_first"].tolist() == [k == 0] * 4
        np.testing.assert_array_equal(chunk["u"], whole["u"][:, 8 * k : 8 * (k + 1)])
        (loss, state), _ = sysid_loss(model, params, chunk, state)
        steps = 8 - (5 if k == 0 else 0)  # n_skip only in the first chunk
        total, count = total + float(loss) * steps, count + steps
    np.testing.assert_allclose(total / count, float(ref), rtol=1e-5)


def test_inject_noise_levels_and_shapes():
    u = jnp.zeros((64, 200, 2))
    std = jnp.array([1.0, 10.0])
    key = jax.random.key(0)
    noisy = inject_noise(key, u, std, noise=0.5)
    z = np.asarray(noisy) / np.asarray(std)
    np.testing.assert_allclose(z.std(axis=(0, 1)), [0.5, 0.5], rtol=0.02)
    biased = np.asarray(inject_noise(key, u, std, bias=0.3)) / np.asarray(std)
    np.testing.assert_allclose(biased, np.broadcast_to(biased[:, :1], biased.shape))
    np.testing.assert_allclose(biased[:, 0].std(axis=0), [0.3, 0.3], rtol=0.25)
    np.testing.assert_array_equal(inject_noise(key, u, std, noise=0.5), noisy)  # by key
    with pytest.raises(ValueError, match=r"u must be \[B, T, C\]"):
        inject_noise(key, u[0], std, noise=0.1)
    with pytest.raises(ValueError, match="must be >= 0"):
        inject_noise(key, u, std, noise=-1.0)


def test_loss_errors():
    model, rng = _model("gru", n_skip=5)
    u = jnp.zeros((1, 4, 1))
    params = rng.seed(bx.Params(), seed=0)
    with pytest.raises(ValueError, match="need a PRNG key"):
        sysid_loss(model, params, {"u": u, "y": u}, noise=0.1)
    with pytest.raises(ValueError, match="loss must be one of"):
        sysid_loss(model, params, {"u": u, "y": u}, loss="huber")
    with pytest.raises(ValueError, match="n_skip=5 .* skips all 4 steps"):
        sysid_loss(model, params, {"u": u, "y": u})
    with pytest.raises(ValueError, match="the batch needs 'y'"):
        sysid_loss(model, params, {"u": u})


def test_fit_learns_then_early_stopping_keeps_the_best(tmp_path):
    files = make_dataset("discrete", tmp_path, seed=0, size="tiny")
    src = WindowedSource(files.train, {"u": "u", "y": "y"}, window=40, stride=10)
    stats = channel_stats(src)
    valid = read_recordings(files.valid)
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = RNNModel(g / "gru", stats["u"], stats["y"], rng, hidden_size=16, n_skip=5)
    ds = pipeline(src, batch_size=8, shuffle=True, seed=0, num_epochs=None, drop_remainder=True)
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, next(iter(ds))["u"])
    params = params.locked()
    seen = []
    tx = optax.adam(1e-2)
    fit = fit_sysid(model, params, iter(ds), tx=tx, steps=30, valid=valid, eval_every=15,
                    noise=0.05, loss="mse", on_step=lambda n, v: seen.append((n, v)))  # fmt: skip
    assert [n for n, _ in seen] == list(range(1, 31)) and fit.steps == 30
    assert np.mean(fit.losses[-5:]) < 0.75 * np.mean(fit.losses[:5])
    assert len(fit.history) == 2 and [h["step"] for h in fit.history] == [15, 30]
    # Gradient *ascent* makes validation worse after the first check: with patience 2
    # training stops at the third check and keeps the params of the first.
    worse = fit_sysid(model, fit.params, iter(ds), tx=optax.sgd(-0.5), steps=100, valid=valid,
                      eval_every=5, patience=2)  # fmt: skip
    assert worse.steps == 15 and worse.best_step == 5
    scores = [h["score"] for h in worse.history]
    assert scores[0] == min(scores) and worse.best_score == scores[0]
    again, _ = evaluate_free_run(model, worse.params, valid)
    np.testing.assert_allclose(np.mean(again["nrmse"]), worse.best_score, rtol=1e-6)


def test_make_sysid_step_returns_the_carried_state():
    model, rng = _model("gru")
    u = jnp.ones((2, 6, 1))
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, u)
    params = params.locked()
    tx = optax.sgd(0.0)
    state0, _ = model.initial_state(params, u[:, 0])
    batch = {"u": u, "y": u, "is_first": np.array([True, False])}
    _, _, state, metrics = jax.jit(make_sysid_step(model, tx))(
        params, tx.init(params.split()[0]), state0, batch
    )
    (_, ref), _ = model(params, u, state0, jnp.zeros((2, 6), bool).at[:, 0].set(True))
    np.testing.assert_allclose(state[1].hidden, ref[1].hidden, rtol=1e-5, atol=1e-6)
    assert sorted(metrics) == ["loss"]


def test_metrics_against_numpy_and_free_run_plot(tmp_path):
    gen = np.random.default_rng(0)
    y = gen.normal(size=(2, 50, 2)) * [1.0, 5.0] + [0.0, 3.0]
    y_hat = y + gen.normal(size=y.shape) * 0.1
    m = sysid_metrics(y_hat, y, n_skip=10)
    e, t = (y_hat - y)[:, 10:].reshape(-1, 2), y[:, 10:].reshape(-1, 2)
    rmse = np.sqrt((e**2).mean(0))
    np.testing.assert_allclose(m["rmse"], rmse)
    np.testing.assert_allclose(m["nrmse"], rmse / t.std(0))
    fit = 100 * (1 - np.linalg.norm(e, axis=0) / np.linalg.norm(t - t.mean(0), axis=0))
    np.testing.assert_allclose(m["fit"], fit)
    with pytest.raises(ValueError, match="must have one shape"):
        sysid_metrics(y_hat[:, :5], y)
    with pytest.raises(ValueError, match=r"n_skip must be an int in \[0, T\)"):
        sysid_metrics(y_hat, y, n_skip=50)
    model, rng = _model("gru")
    u = gen.normal(size=(30, 1)).astype(np.float32)
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, u[None])
    sim = free_run(model, params.locked(), u)  # one recording [T, C]
    (ref, _), _ = model(params, u[None])
    assert sim.shape == (30, 1)
    np.testing.assert_allclose(sim, ref[0], rtol=1e-5, atol=1e-6)
    path = plot_simulation(tmp_path / "sim.png", ref[0], sim, n_skip=5, title="t",
                           others={"ARX": np.zeros((30, 1))})  # fmt: skip
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def _fit_setup(tmp_path, n_batches):
    """A small GRU on the tiny discrete system, its locked params, validation recordings
    and a fixed list of `n_batches` training batches."""
    files = make_dataset("discrete", tmp_path, seed=0, size="tiny")
    src = WindowedSource(files.train, {"u": "u", "y": "y"}, window=40, stride=10)
    stats = channel_stats(src)
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = RNNModel(g / "gru", stats["u"], stats["y"], rng, hidden_size=8, n_skip=5)
    ds = pipeline(src, batch_size=8, shuffle=True, seed=0, num_epochs=None, drop_remainder=True)
    data = list(itertools.islice(iter(ds), n_batches))
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, data[0]["u"])
    return model, params.locked(), read_recordings(files.valid), data


def _assert_same_params(a, b):
    for k in a.split()[0]:
        np.testing.assert_allclose(np.asarray(a[k].value), np.asarray(b[k].value), rtol=1e-6)


def test_fit_by_epochs_runs_epochs_times_batches_and_returns_the_final_params(tmp_path):
    model, params, valid, data = _fit_setup(tmp_path, 6)
    tx = optax.adam(1e-2)
    fit = fit_sysid(model, params, iter(data), tx=tx, epochs=3, batches_per_epoch=2, valid=valid,
                    noise=0.0)  # fmt: skip
    assert fit.steps == 6 and len(fit.losses) == 6
    # Validated at each epoch's end (eval_every defaults to batches_per_epoch).
    assert [(h["epoch"], h["step"]) for h in fit.history] == [(1, 2), (2, 4), (3, 6)]
    # Reference: the plain step with the recipe's loss (L1), jitted, over the same six
    # batches by hand.
    step = jax.jit(make_sysid_step(model, tx, loss="mae"))
    p, opt_state, losses = params, tx.init(params.split()[0]), []
    for n, batch in enumerate(data, 1):
        p, opt_state, _, metrics = step(p, opt_state, None, batch, jax.random.key(n))
        losses.append(float(metrics["loss"]))
    _assert_same_params(fit.final_params, p)
    np.testing.assert_allclose(fit.losses, losses, rtol=1e-6)
    # The same budget given as steps trains the same.
    again = fit_sysid(model, params, iter(data), tx=tx, steps=6, valid=valid, eval_every=2,
                      noise=0.0)  # fmt: skip
    _assert_same_params(again.final_params, p)
    assert [h["step"] for h in again.history] == [2, 4, 6] and "epoch" not in again.history[0]
    # The final params score what the last validation says; the best ones the best.
    last, _ = evaluate_free_run(model, fit.final_params, valid)
    np.testing.assert_allclose(np.mean(last["nrmse"]), fit.history[-1]["score"], rtol=1e-6)
    assert fit.best_score == min(h["score"] for h in fit.history)


def test_fit_final_params_differ_from_the_best_after_early_stopping(tmp_path):
    model, params, valid, data = _fit_setup(tmp_path, 15)
    # Gradient ascent: validation gets worse after the first check.
    fit = fit_sysid(model, params, iter(data), tx=optax.sgd(-0.5), steps=15, valid=valid,
                    eval_every=5, patience=2)  # fmt: skip
    assert fit.steps == 15 and fit.best_step == 5
    best, _ = evaluate_free_run(model, fit.params, valid)
    last, _ = evaluate_free_run(model, fit.final_params, valid)
    np.testing.assert_allclose(np.mean(best["nrmse"]), fit.best_score, rtol=1e-6)
    np.testing.assert_allclose(np.mean(last["nrmse"]), fit.history[-1]["score"], rtol=1e-6)
    assert np.mean(last["nrmse"]) > np.mean(best["nrmse"])


def test_fit_reports_timing_and_shows_a_progress_bar(tmp_path, capsys):
    model, params, valid, data = _fit_setup(tmp_path, 8)
    t0 = time.perf_counter()
    fit = fit_sysid(model, params, iter(data), tx=optax.adam(1e-2), epochs=2, batches_per_epoch=4,
                    valid=valid, progress=True, log_every=2)  # fmt: skip
    wall = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert "epoch 2/2" in err and "8/8" in err, err
    assert fit.compile_s > 0 and fit.train_s > 0 and fit.eval_s > 0
    # The three parts do not overlap: together they fit in the call's wall time.
    assert fit.compile_s + fit.train_s + fit.eval_s <= wall
    np.testing.assert_allclose(fit.steps_per_s, 7 / fit.train_s)
    one = fit_sysid(model, params, iter(data), tx=optax.adam(1e-2), steps=1)
    assert np.isnan(one.steps_per_s) and one.train_s == 0.0 and one.compile_s > 0


def test_fit_budget_errors(tmp_path):
    model, params, valid, data = _fit_setup(tmp_path, 1)
    tx = optax.adam(1e-2)
    cases = [
        (dict(steps=4, epochs=2, batches_per_epoch=2), "not both"),
        (dict(epochs=2), r"epochs=E with batches_per_epoch=B"),
        (dict(), r"give the budget as steps=N"),
        (dict(epochs=0, batches_per_epoch=2), "epochs must be a positive int, got 0"),
        (dict(epochs=1, batches_per_epoch=2.5), "batches_per_epoch must be a positive int"),
        (dict(steps=True), "steps must be a positive int"),
        (dict(steps=2, eval_every=0), "eval_every must be a positive int"),
        (dict(steps=2, patience=0), "patience must be a positive int"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            fit_sysid(model, params, iter(data), tx=tx, valid=valid, **kwargs)
    with pytest.raises(ValueError, match="ran out after 1 of 4 steps"):
        fit_sysid(model, params, iter(data), tx=tx, epochs=2, batches_per_epoch=2)


def _hand_flat_cos(peak, total, pct_start):
    """fastai's fit_flat_cos schedule written out (flat, then cosine to peak / 1e5)."""
    flat = int(round(pct_start * total))
    end = peak / 1e5

    def value(t):
        p = jnp.clip((jnp.asarray(t, jnp.float32) - flat) / max(total - flat, 1), 0.0, 1.0)
        return end + (peak - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * p))

    return value


def _by_hand(model, params, data, tx, *, noise, loss, seed=0):
    step = jax.jit(make_sysid_step(model, tx, noise=noise, loss=loss))
    p, opt_state, losses = params, tx.init(params.split()[0]), []
    for n, batch in enumerate(data, 1):
        key = jax.random.fold_in(jax.random.key(seed), n)
        p, opt_state, _, metrics = step(p, opt_state, None, batch, key)
        losses.append(float(metrics["loss"]))
    return p, losses


def test_fit_without_recipe_arguments_trains_blox_recipe(tmp_path):
    model, params, valid, data = _fit_setup(tmp_path, 6)
    fit = fit_sysid(model, params, iter(data), steps=6, valid=valid, eval_every=3, seed=2)
    # The recipe by hand: no clipping, Adam at 1e-2 flat for 50 % then cosine,
    # L1 in normalized units, input noise 0.02; the best validation's params.
    tx = optax.adam(_hand_flat_cos(1e-2, 6, 0.5))
    p, losses = _by_hand(model, params, data, tx, noise=0.02, loss="mae", seed=2)
    _assert_same_params(fit.final_params, p)
    np.testing.assert_allclose(fit.losses, losses, rtol=1e-6)
    best = min(fit.history, key=lambda h: h["score"])
    assert fit.best_step == best["step"]
    got, _ = evaluate_free_run(model, fit.params, valid)
    np.testing.assert_allclose(np.mean(got["nrmse"]), best["score"], rtol=1e-6)
    assert fit.best_params is fit.params


def test_fit_recipe_settings_change_the_recipe_one_by_one(tmp_path):
    model, params, valid, data = _fit_setup(tmp_path, 4)
    fit = fit_sysid(model, params, iter(data), steps=4, valid=valid, lr=3e-3, clip=0.05,
                    pct_start=0.0, loss="mae", noise=0.0, select="final")  # fmt: skip
    # Clipping at a norm these gradients exceed, so that it changes the steps.
    tx = optax.chain(optax.clip_by_global_norm(0.05), optax.adam(_hand_flat_cos(3e-3, 4, 0.0)))
    p, losses = _by_hand(model, params, data, tx, noise=0.0, loss="mae")
    unclipped, _ = _by_hand(model, params, data, optax.adam(_hand_flat_cos(3e-3, 4, 0.0)),
                            noise=0.0, loss="mae")  # fmt: skip
    with pytest.raises(AssertionError):  # the clipping mattered
        _assert_same_params(unclipped, p)
    _assert_same_params(fit.final_params, p)
    _assert_same_params(fit.params, p)  # select='final'
    np.testing.assert_allclose(fit.losses, losses, rtol=1e-6)
    # The best params stay available: they score the best validation.
    got, _ = evaluate_free_run(model, fit.best_params, valid)
    np.testing.assert_allclose(np.mean(got["nrmse"]), fit.best_score, rtol=1e-6)
    # A given tx replaces the recipe's optimizer (plain SGD here).
    sgd = fit_sysid(model, params, iter(data), steps=4, tx=optax.sgd(0.1), noise=0.0)
    p, _ = _by_hand(model, params, data, optax.sgd(0.1), noise=0.0, loss="mae")
    _assert_same_params(sgd.params, p)  # no validation: the final params


def test_fit_recipe_errors(tmp_path):
    model, params, valid, data = _fit_setup(tmp_path, 1)
    with pytest.raises(TypeError, match=r"got an Optax transformation; pass the optimizer as tx="):
        fit_sysid(model, params, optax.adam(1e-2), steps=1)
    cases = [
        (dict(tx=optax.adam(1e-2), lr=1e-3), r"tx= replaces the recipe's optimizer; lr=0.001"),
        (dict(tx=optax.adam(1e-2), clip=0.0), "give tx or those, not both"),
        (dict(loss="huber"), r"loss must be one of \('mse', 'mae'\), got 'huber'"),
        (dict(select="last"), r"select must be one of \('best', 'final'\), got 'last'"),
        (dict(lr=0.0), "lr must be > 0, got 0.0"),
        (dict(clip=-1.0), r"clip must be >= 0 \(0: no clipping\), got -1.0"),
        (dict(pct_start=1.5), r"pct_start must be in \[0, 1\], got 1.5"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            fit_sysid(model, params, iter(data), steps=1, valid=valid, **kwargs)
    with pytest.raises(TypeError, match="lr must be a number, got '3e-3'"):
        fit_sysid(model, params, iter(data), steps=1, lr="3e-3")


def test_sysid_recipe_is_read_only():
    from blox.ts import SYSID_RECIPE

    assert set(SYSID_RECIPE) == {"lr", "pct_start", "clip", "loss", "noise", "select"}
    with pytest.raises(TypeError):
        SYSID_RECIPE["lr"] = 1.0


def test_fit_reads_step_losses_back_every_log_every_steps(tmp_path):
    # The losses wait on the device at most `log_every` steps: the number of live device
    # arrays stays flat over the run (it grew by one per step when all were kept to the end).
    model, params, valid, data = _fit_setup(tmp_path, 6)
    tx = optax.adam(1e-2)
    live = []
    fit = fit_sysid(model, params, iter(data * 2), tx=tx, steps=12, log_every=2, noise=0.0,
                    on_step=lambda n, loss: live.append(len(jax.live_arrays())))  # fmt: skip
    assert len(fit.losses) == 12
    assert live[11] - live[3] <= 2, live
    step = jax.jit(make_sysid_step(model, tx, loss="mae"))
    p, opt_state, losses = params, tx.init(params.split()[0]), []
    for n, batch in enumerate(data * 2, 1):
        p, opt_state, _, metrics = step(p, opt_state, None, batch, jax.random.key(n))
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(fit.losses, losses, rtol=1e-6)
