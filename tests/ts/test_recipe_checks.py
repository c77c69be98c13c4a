"""fit_sysid's checks: a validation score that is not finite raises (it used to return
the untrained initial params with best_step 0), and validation recordings
that cannot be scored are refused before training, naming the recording."""

import re

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from blox.ts import RNNModel, fit_sysid

N_SKIP = 3
U_STD = 0.5  # normalized input = u / 0.5: a finite u of 3e38 overflows float32 there


def _setup():
    """A tiny GRU with fixed statistics, four training batches and two validation
    recordings, all NumPy."""
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = RNNModel(g / "gru", ([0.0], [U_STD]), ([0.0], [1.0]), rng, hidden_size=4,
                     linear_skip=True, n_skip=N_SKIP)  # fmt: skip
    gen = np.random.default_rng(0)

    def rec(t):
        u = gen.normal(size=(t, 1)).astype(np.float32)
        return {"u": u, "y": np.cumsum(u, 0).astype(np.float32) * 0.1}

    batches = []
    for _ in range(4):
        b = [rec(10) for _ in range(2)]
        batches.append({k: np.stack([r[k] for r in b]) for k in ("u", "y")})
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, batches[0]["u"])
    return model, params.locked(), batches, [rec(20), rec(16)]


@pytest.fixture(scope="module")
def setup():
    return _setup()


def _first_trainable_path(params):
    return bx.format_path(next(iter(params.split()[0].keys())))


@pytest.mark.parametrize("bad_from", [0, 2], ids=["first-validation", "after-a-good-one"])
def test_a_nan_score_raises_naming_the_diverged_param(setup, bad_from):
    model, params, batches, valid = setup
    # plain SGD whose rate turns NaN at step `bad_from` + 1: the params are NaN after it
    tx = optax.sgd(lambda count: jnp.where(count < bad_from, 1e-3, jnp.nan))
    n = bad_from + 1 if bad_from else 1
    path = re.escape(_first_trainable_path(params))
    before = (
        r"No validation before it scored"
        if bad_from == 0
        else r"The best validation before it was at step [12] \(score [0-9.e-]+\)"
    )
    with pytest.raises(
        ValueError,
        match=rf"validation after step {n} scored nan .*training diverged: the params after "
        rf"step {n} hold NaN or inf \(the first: '{path}'\).*clip=1\.0.*{before}",
    ):
        # the defect guarded: it returned the initial params, best_step 0, without a word
        fit_sysid(model, params, iter(batches), tx=tx, steps=4, valid=valid, eval_every=1,
                  noise=0.0)  # fmt: skip


def test_a_free_run_that_blows_up_raises_naming_the_recording(setup):
    model, params, batches, valid = setup
    # finite params (no step moves them) and a finite input that overflows float32 once
    # normalized, from time step 11 of recording 1 on: the linear skip passes it on
    u = valid[1]["u"].copy()
    u[11:] = 3e38
    blown = [valid[0], {"u": u, "y": valid[1]["y"]}]
    with pytest.raises(
        ValueError,
        match=r"validation after step 2 scored (nan|inf) .*the params are finite, but the free run "
        r"of validation recording 1 turns NaN or inf at time step 11: .*blows up.*"
        r"No validation before it scored",
    ):
        fit_sysid(model, params, iter(batches), tx=optax.sgd(0.0), steps=2, valid=blown,
                  noise=0.0)  # fmt: skip


def test_validation_recordings_that_cannot_be_scored_are_refused_before_training(setup):
    model, params, batches, valid = setup

    def fit(recs):
        # no batch is drawn before the checks: an empty iterator proves it
        return fit_sysid(model, params, iter([]), steps=1, valid=recs)

    short = {k: v[:N_SKIP] for k, v in valid[0].items()}
    # it used to fail with "n_skip must be an int in [0, T) = [0, 0), got 0" when all were
    # short, and a short one among others was silently left out of the score
    for recs, i in (([short], 0), ([valid[0], short], 1)):
        too_short = rf"recording {i} has {N_SKIP} time steps, no more than the model's n_skip="
        with pytest.raises(ValueError, match=too_short + rf"{N_SKIP} warm-up"):
            fit(recs)
    for name, value, step in (("y", np.nan, 7), ("u", np.inf, 0), ("y", -np.inf, 15)):
        bad = {k: v.copy() for k, v in valid[1].items()}
        bad[name][step, 0] = value
        with pytest.raises(
            ValueError,
            match=rf"validation recording 1: '{name}' holds {re.escape(str(value))} at time "
            rf"step {step}, channel 0 \(the first of 1 non-finite values\)",
        ):
            fit([valid[0], bad])
    flat = [{"u": r["u"], "y": np.full_like(r["y"], 2.5)} for r in valid]
    with pytest.raises(ValueError, match=r"output channels \[0\] are constant .*NRMSE"):
        fit(flat)
    # constant before n_skip only is fine: those steps are not scored
    warm = [{"u": r["u"], "y": np.where(np.arange(len(r["y"]))[:, None] < N_SKIP, 2.5, r["y"])}
            for r in valid]  # fmt: skip
    with pytest.raises(ValueError, match="ran out after 0 of 1 steps"):
        fit(warm)


def test_evaluate_free_run_refuses_a_recording_no_longer_than_n_skip(setup):
    # outside fit_sysid the same short recording gave "[0, T) = [0, 0)" alone, and among
    # longer ones it was silently scored on nothing
    model, params, _, valid = setup
    from blox.ts import evaluate_free_run

    short = {k: v[:N_SKIP] for k, v in valid[0].items()}
    for recs, i in (([short], 0), ([valid[0], short], 1)):
        with pytest.raises(
            ValueError,
            match=rf"evaluate_free_run: recording {i} has {N_SKIP} time steps, no more than "
            rf"n_skip={N_SKIP}",
        ):
            evaluate_free_run(model, params, recs)
