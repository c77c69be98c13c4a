"""``examples/actor_learner.py``: the actor and the learner agree, and one `Params` keeps
what each writes.

* Replay parity (GRU and LSTM): the logits and values the actor computed one step at a
  time equal the learner's replay of the same sequences from the stored initial state
  (1e-6), over rollouts whose episodes end mid-rollout and whose initial state is not
  zero; replaying with the reset flags shifted by one step (the negative control)
  misses by more than 1e-3.
* The PPO ratio at the first minibatch of the first epoch is 1 (``|ratio - 1| <= 1e-6``)
  at every update; the learner fed a corrupted rollout (reset flags shifted by one
  step, or a zero initial state in place of the stored one) is off by more than 1e-3
  from update 2 on (update 1 starts from the zero state, so the zero-state control
  matches there, as it must).
* Both writers kept: after each update the params hold the learner's weights (equal to
  the learner run on params *without* the actor's writes) and the actor's Rng counter
  (``T + 1`` draws per update, by hand) and observation statistics (NumPy's mean and
  variance of every raw observation of every rollout so far).

* Layouts: Anakin over 8 devices (``shard_map``) and Sebulba (one actor device, a
  4-device learner mesh) at policy lag 0 give the one-device run's losses, ratio errors
  and returns (1e-5); Sebulba at lag 1 trains update n on the params of version n - 1
  (versions count from 1), and two lag-1 runs are bit-identical.

The example's command line (learning, Sebulba's version lines, resume) is run by
``test_actor_learner_runs.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx
from tests.rl.examples import load

al = load("actor_learner")
SMALL = al.Config(
    num_envs=16,  # 8 devices x 2 minibatches
    num_steps=48,
    num_updates=3,
    hidden=16,
    num_minibatches=2,
    update_epochs=2,
    lr=3e-3,
)


@functools.cache
def parts(cell: str):
    p = al.build(al.Config(**{**SMALL.__dict__, "cell": cell}))
    return p, jax.jit(p.init), jax.jit(p.rollout), jax.jit(p.learn), jax.jit(p.agent.replay)


def _bt(a):
    """Time-major ``[T, E, ...]`` -> batch-major ``[E, T, ...]``."""
    return jnp.swapaxes(a, 0, 1)


def _replay_error(cell, params, ro, flags) -> float:
    _, _, _, _, replay = parts(cell)
    tr = ro.traj
    (logits, value), _ = replay(params, _bt(tr.obs_n), ro.hidden0, _bt(flags))
    return max(
        float(jnp.max(jnp.abs(logits - _bt(tr.logits)))),
        float(jnp.max(jnp.abs(value - _bt(tr.value)))),
    )


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_the_learner_replays_the_actor_from_the_stored_state(cell):
    _, init, rollout, _, _ = parts(cell)
    runner = init(jax.random.key(0))
    params, runner, _ = rollout(runner.params, runner)  # a first rollout: state != 0
    params, runner, ro = rollout(params, runner)
    tr = ro.traj
    # episodes start mid-rollout in several environments, and the stored state is live
    assert int(jnp.sum(tr.is_reset[1:])) >= 4, int(jnp.sum(tr.is_reset[1:]))
    assert float(jnp.min(jnp.abs(jax.tree.leaves(ro.hidden0)[0]).sum(-1))) > 0.1
    assert _replay_error(cell, params, ro, tr.is_reset) <= 1e-6
    shifted = _replay_error(cell, params, ro, tr.done)  # resets one step early
    assert shifted > 1e-3, shifted


def _corrupt(ro, kind):
    if kind == "shifted_resets":
        return ro._replace(traj=ro.traj._replace(is_reset=ro.traj.done))
    return ro._replace(hidden0=jax.tree.map(jnp.zeros_like, ro.hidden0))


def _counter(p, params) -> int:
    return int(p.rng.get_counter(params))


def test_ratio_is_one_and_both_writers_are_kept_at_every_update():
    p, init, rollout, learn, _ = parts("gru")
    update = jax.jit(p.update)
    runner = init(jax.random.key(1))
    seen = []
    for n in range(1, SMALL.updates + 1):
        params, opt_state = runner.params, runner.opt_state
        params_a, _, ro = rollout(params, runner)  # the actor alone (what update runs)
        seen.append(np.asarray(ro.traj.obs).reshape(-1, 4))
        # the ratio check, and its two controls
        err = float(learn(params_a, opt_state, ro)[2]["ratio_err"])
        assert err <= 1e-6, (n, err)
        for kind in ("shifted_resets", "zero_state"):
            err = float(learn(params_a, opt_state, _corrupt(ro, kind))[2]["ratio_err"])
            if n >= 2 or kind == "shifted_resets":
                assert err > 1e-3, (n, kind, err)
            else:  # update 1 starts from the zero state: this control is exact there
                assert err <= 1e-6, (n, kind, err)
        runner, metrics = update(runner)
        new = runner.params
        assert float(metrics["ratio_err"]) <= 1e-6, (n, float(metrics["ratio_err"]))
        # the learner's writes: the weights it computes on params without the actor's
        # (another program: its fusions may round the last bit apart)
        alone, _, _ = learn(params, opt_state, ro)
        moved = 0.0
        for path, value in alone.split()[0].arrays().items():
            got = new.arrays()[path]
            np.testing.assert_allclose(got, value, rtol=1e-5, atol=1e-6, err_msg=str(path))
            moved = max(moved, float(np.max(np.abs(got - params.arrays()[path]))))
        assert moved > 1e-3, moved  # the learner's step is in them (lr 3e-3)
        # the actor's writes: T + 1 draws (one per step, one shuffle key) ...
        assert _counter(p, new) == _counter(p, params) + SMALL.num_steps + 1
        # ... and the statistics of every observation it saw, by NumPy
        mean, var, count = p.agent.obs_norm.statistics(new)
        every = np.concatenate(seen).astype(np.float64)
        np.testing.assert_allclose(mean, every.mean(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(var, every.var(0), rtol=1e-4, atol=1e-7)
        assert float(count) == len(every)


def test_devices_times_minibatches_must_divide_the_environments():
    with pytest.raises(ValueError, match=r"--data-parallel 4 x 2 minibatches must divide"):
        al.build(al.Config(**{**SMALL.__dict__, "num_envs": 12, "data_parallel": 4}))


KEYS = ("loss", "ratio_err", "return_sum", "episodes")


def _rows(metrics, seed: int = 0) -> np.ndarray:
    return np.stack([np.asarray(metrics[k])[:, seed] for k in KEYS], axis=1)


@functools.cache
def _one_device_metrics(cfg) -> np.ndarray:
    prog = al.program(cfg)
    _, metrics = prog.chunk(prog.init(al._seed_keys(0, 1)), cfg.updates)
    return _rows(metrics)


def _sebulba(cfg, lag, state=None, ckpt=None, a=1) -> tuple[np.ndarray, list[int]]:
    """Sebulba on `a` actor devices and 4 learner devices: the metrics per update, the
    versions; with `ckpt` (a CheckpointManager) the state is saved after each update."""
    actors, learners = jax.devices()[:a], jax.devices()[a : a + 4]
    if state is None:
        state = al.sebulba_start(cfg, 0, actors, learners)
    rows, versions = [], []
    for n, m, now in al.sebulba(cfg, state, actors, learners, lag):
        m = jax.device_get(m)
        rows.append([float(m[k]) for k in KEYS])
        versions.append(int(m["actor_version"]) + 1)
        if ckpt is not None:
            ckpt.save(n, now)
    return np.array(rows), versions


def test_anakin_8_devices_and_sebulba_at_lag_0_equal_one_device():
    one = _one_device_metrics(SMALL)
    prog = al.program(al.Config(**{**SMALL.__dict__, "data_parallel": 8}))
    _, metrics = prog.chunk(prog.init(al._seed_keys(0, 1)), SMALL.updates)
    dp = _rows(metrics)
    np.testing.assert_allclose(dp, one, rtol=1e-5, atol=1e-6, err_msg="data-parallel 8")
    seb, versions = _sebulba(SMALL, 0)
    np.testing.assert_allclose(seb, one, rtol=1e-5, atol=1e-6, err_msg="Sebulba lag 0")
    assert versions == [1, 2, 3], versions
    # two actor devices, each stepping half the environments: every actor merges all
    # actors' observations into its statistics, so the run is still the one-device run
    seb2, _ = _sebulba(SMALL, 0, a=2)
    np.testing.assert_allclose(seb2, one, rtol=1e-5, atol=1e-6, err_msg="2 actors, lag 0")
    assert np.all(one[:, 1] <= 1e-6) and np.all(one[:, 3] > 0), one


def test_sebulba_at_lag_1_trains_on_the_previous_version_and_resumes_bit_identically(
    tmp_path,
):
    """Two lag-1 runs are bit-identical; a run restored from the checkpoint of update 1
    (learner params and optimizer state, the actor's runner, the rollout collected with
    the previous weights) continues with the same bits."""
    with bx.ckpt.CheckpointManager(tmp_path, save_every=1) as mngr:
        first, versions = _sebulba(SMALL, 1, ckpt=mngr)
    assert versions == [1, 1, 2], versions  # update n: version n - 1 (1: the initial)
    again, _ = _sebulba(SMALL, 1)
    np.testing.assert_array_equal(first, again)
    assert first[0, 1] <= 1e-6 and np.all(first[1:, 1] > 1e-3), first  # off-policy
    target = al.sebulba_start(SMALL, 0, jax.devices()[:1], jax.devices()[1:5])
    with bx.ckpt.CheckpointManager(tmp_path) as mngr:
        state = mngr.restore(target, step=1)
    assert int(state["n"]) == 1
    resumed, versions = _sebulba(SMALL, 1, state=state)
    assert versions == [1, 2], versions
    np.testing.assert_array_equal(resumed, first[1:])


def test_seeds_by_vmap_and_make_train_give_the_one_seed_run():
    """`make_train` (the benchmark's entry point: the whole run under one jit) vmapped
    over seeds 0 and 1, as ``--seeds 2`` runs them: seed 0's numbers are the one-seed
    run's (`program`, another program), seed 1's differ."""
    one = _one_device_metrics(SMALL)
    runner, metrics = jax.vmap(al.make_train(SMALL))(al._seed_keys(0, 2))
    metrics = jax.tree.map(lambda a: jnp.swapaxes(a, 0, 1), metrics)  # [K, U] -> [U, K]
    np.testing.assert_allclose(_rows(metrics, 0), one, rtol=1e-5, atol=1e-6)
    assert not np.allclose(_rows(metrics, 1), one), _rows(metrics, 1)
    assert np.asarray(runner.update).tolist() == [SMALL.updates] * 2
