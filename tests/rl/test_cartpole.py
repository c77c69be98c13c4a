"""``examples/cartpole.py`` against gymnasium's CartPole-v1 (the reference), step by step:
both are driven with the same actions from the same state, and the next observation
(float32 tolerance), the reward and the termination / truncation flags must agree. The
JAX environment's state is copied into gymnasium's before every step, so float32 vs
float64 rounding cannot accumulate over an episode and every step is a one-step check."""

from __future__ import annotations

import gymnasium as gym
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.rl.examples import load

cp = load("cartpole")
STEP = jax.jit(cp.step)


def _gym_env():
    env = gym.make("CartPole-v1")
    env.reset(seed=0)
    return env


def _drive(policy, state, env, steps: int, key) -> dict[str, int]:
    """Steps both environments with ``policy(obs)``; returns counts of the events seen."""
    seen = {"terminated": 0, "truncated": 0}
    obs = np.asarray(cp.observe(state))
    for i in range(steps):
        action = int(policy(obs, i))
        inner = env.unwrapped
        inner.state = np.asarray(cp.observe(state), np.float64)
        inner.steps_beyond_terminated = None
        env._elapsed_steps = int(state.t)  # the TimeLimit wrapper's step counter
        g_obs, g_rew, g_term, g_trunc, _ = env.step(action)
        obs, state, rew, done, info = STEP(jax.random.fold_in(key, i), state, jnp.int32(action))
        np.testing.assert_allclose(info["final_obs"], g_obs, rtol=1e-5, atol=1e-6, err_msg=i)
        assert float(rew) == g_rew == 1.0, i
        assert bool(info["terminated"]) == g_term, (i, g_obs)
        assert bool(info["truncated"]) == g_trunc, (i, int(state.t))
        assert bool(done) == (g_term or g_trunc), i
        if done:
            seen["terminated"] += g_term
            seen["truncated"] += g_trunc
            assert int(state.t) == 0 and np.all(np.abs(obs) <= 0.05), obs  # auto-reset
            np.testing.assert_allclose(obs, cp.observe(state), rtol=1e-6)
        else:  # (other fusions of one expression may round the last bit apart)
            np.testing.assert_allclose(obs, info["final_obs"], rtol=1e-6)
            assert int(state.t) == env._elapsed_steps
        obs = np.asarray(obs)
    return seen


def test_random_actions_match_gymnasium_with_terminations_and_auto_resets():
    """Random actions: episodes end by the angle or the position (both seen), then reset."""
    rs = np.random.default_rng(0)
    env = _gym_env()
    _, state = cp.reset(jax.random.key(0))
    seen = _drive(lambda obs, i: rs.integers(2), state, env, 400, jax.random.key(1))
    assert seen["terminated"] >= 10 and seen["truncated"] == 0, seen


def test_position_termination_matches_gymnasium():
    """Always pushing right from a balanced pole lets the cart leave |x| <= 2.4 or the pole
    fall; a state placed near the edge checks the position threshold itself."""
    env = _gym_env()
    state = cp.EnvState(*(jnp.float32(v) for v in (2.35, 1.0, 0.0, 0.0)), jnp.int32(7))
    seen = _drive(lambda obs, i: 1, state, env, 3, jax.random.key(2))
    assert seen["terminated"] == 1, seen


def test_a_balancing_controller_is_truncated_at_500_steps_like_gymnasium():
    """A PD controller keeps the pole up: the episode ends by truncation at step 500."""
    env = _gym_env()
    _, state = cp.reset(jax.random.key(3))
    seen = _drive(
        lambda o, i: o[2] + 0.5 * o[3] + 0.01 * o[0] + 0.1 * o[1] > 0,
        state,
        env,
        510,
        jax.random.key(4),
    )
    assert seen["truncated"] == 1 and seen["terminated"] == 0, seen


def test_reset_draws_uniform_states_and_vmaps():
    obs, state = jax.vmap(cp.reset)(jax.random.split(jax.random.key(5), 256))
    assert obs.shape == (256, 4) and obs.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(obs))) <= 0.05 and float(jnp.std(obs)) > 0.02
    assert int(jnp.max(state.t)) == 0


@pytest.mark.parametrize("action", [0, 1])
def test_one_step_from_rest_matches_the_closed_form(action):
    """From the zero state a push of +-10 N gives x_dot = tau * F * (1 + ...) by hand:
    temp = F / M, theta_acc = -temp / (l (4/3 - m / M)), x_acc = temp - m l theta_acc / M."""
    zero = cp.EnvState(*(jnp.float32(0) for _ in range(4)), jnp.int32(0))
    nxt = cp.dynamics(zero, jnp.int32(action))
    f = 10.0 if action else -10.0
    temp = f / 1.1
    theta_acc = -temp / (0.5 * (4 / 3 - 0.1 / 1.1))
    x_acc = temp - 0.05 * theta_acc / 1.1
    np.testing.assert_allclose(
        cp.observe(nxt), [0.0, 0.02 * x_acc, 0.0, 0.02 * theta_acc], rtol=1e-6
    )


def test_random_policy_returns_match_gymnasium_random_policy():
    # The example's random-policy check against gymnasium's CartPole-v1 under the same
    # kind of policy: mean episode returns agree within sampling error.
    returns = np.asarray(cp.random_policy_returns(64, 300, seed=0))
    ours = returns[~np.isnan(returns)]
    env = gym.make("CartPole-v1")
    rng = np.random.default_rng(0)
    theirs = []
    env.reset(seed=0)
    while len(theirs) < 400:
        _, total, done = env.reset(seed=int(rng.integers(1 << 31))), 0.0, False
        while not done:
            _, r, term, trunc, _ = env.step(int(rng.integers(2)))
            total, done = total + r, term or trunc
        theirs.append(total)
    theirs = np.asarray(theirs)
    assert len(ours) > 400 and ours.min() >= 8 and ours.max() <= 500
    se = np.sqrt(ours.var() / len(ours) + theirs.var() / len(theirs))
    assert abs(ours.mean() - theirs.mean()) < 4 * se, (ours.mean(), theirs.mean(), se)
