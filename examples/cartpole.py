"""CartPole-v1 written in JAX: gymnasium's dynamics, termination and time limit, with
automatic reset, as pure functions that run under ``jax.jit``, ``jax.vmap`` and
``jax.lax.scan``.

    obs, state = reset(key)                                   # obs [4] float32
    obs, state, reward, done, info = step(key, state, action) # action: 0 (left) or 1 (right)

The physics are gymnasium's ``CartPoleEnv`` (Barto, Sutton and Anderson 1983; Euler
integration, ``tau = 0.02`` s), in float32. An episode *terminates* when the cart leaves
``|x| <= 2.4`` or the pole leaves ``|theta| <= 12`` degrees, and is *truncated* after 500
steps (gymnasium's ``TimeLimit`` of CartPole-v1). Every step gives reward 1, the last one
included. When ``done = terminated | truncated``, `step` resets the environment with
`key` and returns the *new* episode's first observation (auto-reset, as gymnax and
PureJaxRL do); ``info['final_obs']`` holds the observation that ended the episode.

``tests/rl/test_cartpole.py`` checks every step against gymnasium's CartPole-v1, driven
with the same actions from the same state.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

GRAVITY = 9.8
MASS_CART = 1.0
MASS_POLE = 0.1
TOTAL_MASS = MASS_CART + MASS_POLE
LENGTH = 0.5  # half the pole's length
POLE_MASS_LENGTH = MASS_POLE * LENGTH
FORCE_MAG = 10.0
TAU = 0.02
THETA_THRESHOLD = 12 * 2 * 3.141592653589793 / 360
X_THRESHOLD = 2.4
MAX_STEPS = 500
OBS_SIZE = 4
NUM_ACTIONS = 2


class EnvState(NamedTuple):
    """The state of one environment: the physics ``(x, x_dot, theta, theta_dot)``, each a
    float32 scalar, and ``t`` (int32), the steps taken in the current episode."""

    x: jax.Array
    x_dot: jax.Array
    theta: jax.Array
    theta_dot: jax.Array
    t: jax.Array


def observe(state: EnvState) -> jax.Array:
    """The observation ``[x, x_dot, theta, theta_dot]`` (float32 ``[4]``)."""
    return jnp.stack([state.x, state.x_dot, state.theta, state.theta_dot])


def reset(key: jax.Array) -> tuple[jax.Array, EnvState]:
    """A new episode: each state variable uniform in ``[-0.05, 0.05)``, as gymnasium's
    ``reset``. Returns ``(obs [4], state)``."""
    s = jax.random.uniform(key, (4,), jnp.float32, -0.05, 0.05)
    state = EnvState(s[0], s[1], s[2], s[3], jnp.zeros((), jnp.int32))
    return observe(state), state


def dynamics(state: EnvState, action: jax.Array) -> EnvState:
    """One Euler step of the physics (``t`` advanced by one), gymnasium's equations."""
    force = jnp.where(action == 1, FORCE_MAG, -FORCE_MAG).astype(jnp.float32)
    cos, sin = jnp.cos(state.theta), jnp.sin(state.theta)
    temp = (force + POLE_MASS_LENGTH * jnp.square(state.theta_dot) * sin) / TOTAL_MASS
    theta_acc = (GRAVITY * sin - cos * temp) / (
        LENGTH * (4.0 / 3.0 - MASS_POLE * jnp.square(cos) / TOTAL_MASS)
    )
    x_acc = temp - POLE_MASS_LENGTH * theta_acc * cos / TOTAL_MASS
    return EnvState(
        x=state.x + TAU * state.x_dot,
        x_dot=state.x_dot + TAU * x_acc,
        theta=state.theta + TAU * state.theta_dot,
        theta_dot=state.theta_dot + TAU * theta_acc,
        t=state.t + 1,
    )


def step(
    key: jax.Array, state: EnvState, action: jax.Array
) -> tuple[jax.Array, EnvState, jax.Array, jax.Array, dict[str, jax.Array]]:
    """One step with automatic reset.

    Args:
      key: used only to reset when the episode ends.
      state: the current `EnvState`.
      action: int scalar, 0 pushes left, 1 pushes right.

    Returns:
      ``(obs [4], state, reward (), done (), info)``: ``reward`` is 1.0 (float32),
      ``done = terminated | truncated`` (bool). On ``done`` the returned ``obs`` and
      ``state`` are the next episode's first ones. ``info`` holds ``terminated``,
      ``truncated`` and ``final_obs`` (the observation reached by this step, before any
      reset).
    """
    nxt = dynamics(state, action)
    terminated = (
        (nxt.x < -X_THRESHOLD)
        | (nxt.x > X_THRESHOLD)
        | (nxt.theta < -THETA_THRESHOLD)
        | (nxt.theta > THETA_THRESHOLD)
    )
    truncated = nxt.t >= MAX_STEPS  # gymnasium's TimeLimit: both may be true
    done = terminated | truncated
    final_obs = observe(nxt)
    reset_obs, reset_state = reset(key)
    state = jax.tree.map(lambda r, n: jnp.where(done, r, n), reset_state, nxt)
    obs = jnp.where(done, reset_obs, final_obs)
    info = {"terminated": terminated, "truncated": truncated, "final_obs": final_obs}
    return obs, state, jnp.ones((), jnp.float32), done, info


def random_policy_returns(num_envs: int, steps: int, seed: int) -> jax.Array:
    """Returns of the episodes that `num_envs` environments finish in `steps` steps under
    a uniformly random policy (a sanity check of the environment: about 22 on average
    for CartPole-v1), NaN for the slots of episodes not finished."""

    def one_env(key):
        key, k0 = jax.random.split(key)
        _, state = reset(k0)

        def body(carry, key):
            state, ret = carry
            k_act, k_reset = jax.random.split(key)
            action = jax.random.bernoulli(k_act).astype(jnp.int32)
            _, state, reward, done, _ = step(k_reset, state, action)
            ret = ret + reward
            return (state, jnp.where(done, 0.0, ret)), jnp.where(done, ret, jnp.nan)

        _, finished = jax.lax.scan(body, (state, jnp.float32(0)), jax.random.split(key, steps))
        return finished

    return jax.jit(jax.vmap(one_env))(jax.random.split(jax.random.key(seed), num_envs))


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="CartPole-v1 in JAX under a random policy.")
    parser.add_argument("--size", choices=("tiny", "default"), default="default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n_envs, n_steps = (8, 200) if args.size == "tiny" else (256, 500)
    done_returns = random_policy_returns(n_envs, n_steps, args.seed)
    done_returns = done_returns[~jnp.isnan(done_returns)]
    print(f"episodes={int(done_returns.size)} mean_return={float(done_returns.mean())!r}")
