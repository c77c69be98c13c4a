"""Recurrent PPO on CartPole-v1: an actor and a learner sharing one `Params`.

    python examples/actor_learner.py --size tiny              # seconds (smoke test)
    python examples/actor_learner.py                          # PureJaxRL's run: 5e5 steps
    python examples/actor_learner.py --seeds 5                # seeds 0-4 in one program
    python examples/actor_learner.py --size tiny --data-parallel 8    # Anakin over 8 devices
    python examples/actor_learner.py --size tiny --actor-devices 1 --learner-devices 4 \
        --policy-lag 1                                        # Sebulba, one version behind

(more devices than the machine has: XLA_FLAGS=--xla_force_host_platform_device_count=8)

PureJaxRL's ``ppo_rnn.py`` shape, written with blox (see docs/rl.md): the environment
(``cartpole.py`` beside this file) and the agent run in one jitted program, ``jax.vmap``
over environments, ``jax.lax.scan`` over the rollout, the epochs, the minibatches and the
updates, ``jax.vmap`` over seeds.

* The **actor** steps a GRU (or LSTM) one step at a time, ``is_reset`` = the previous
  step's ``done``, and samples actions with keys from the `Params`' `Rng`, one key per
  step folded with each environment's *global* index. It normalizes observations with
  a `blox.nn.RunningMeanStd` as of the rollout's start, stores the normalized
  observations, and merges the rollout's raw observations into the statistics after it.
  It writes the Rng counter and the statistics.
* The **learner** replays each environment's sequence with ``apply`` from the hidden
  state stored at the rollout's start and the stored reset flags, and writes the
  weights and the optimizer state: ``train, rest = params.split()`` after the actor's
  writes, and ``params = rest.merge(new_train)``.

Every update prints ``step=<n> loss=<repr> ratio_err=<float> episode_return=<float>``
(of the first seed): ``loss`` is the mean total PPO loss over the update's minibatches,
``ratio_err`` the max ``|ratio - 1|`` at the first minibatch of the first epoch (0 up
to float rounding when the learner reproduces the actor), ``episode_return`` the mean
return of the episodes that ended in the rollout. At the end, one line
``seed=<s> env_steps=<n> mean_return=<float>`` per seed (the mean return of the episodes
that ended in the last 10 updates) and ``env_steps_per_s=<float>`` (compile excluded).

Layouts: one device by default; ``--data-parallel D`` runs Anakin over D devices with
``jax.shard_map`` (the environments split over them; keys fold the global environment
index, the minibatch permutation is over all environments, each minibatch loss is the
global mean, so the lines equal the one-device run's up to float rounding).
``--actor-devices A --learner-devices L --policy-lag 0|1`` runs Sebulba: actors on the
first A devices, the learner data-parallel on the next L, weights pushed to the actors
after each update (lag 1: the next rollout runs on the previous weights while the
learner trains); it also prints ``update=<n> actor_version=<v>`` (versions count from 1,
the initial params). ``--ckpt-dir/--save-every`` checkpoint the whole run state and
resume it; ``--curve FILE`` writes each seed's returns (docs/rl.md's plot).

`make_train(cfg)` returns ``train(key)``, the whole one-device training under one
``jax.jit`` (benchmarks/rl_speed.py times it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp


def _load_cartpole():
    """``cartpole.py`` beside this file (``examples/`` is not a package)."""
    if "cartpole" in sys.modules:
        return sys.modules["cartpole"]
    spec = importlib.util.spec_from_file_location(
        "cartpole", Path(__file__).resolve().with_name("cartpole.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["cartpole"] = module
    spec.loader.exec_module(module)
    return module


cartpole = _load_cartpole()
AXIS = "data"  # the device axis of --data-parallel


@dataclasses.dataclass(frozen=True)
class Config:
    """The hyperparameters. The defaults are PureJaxRL's ppo_rnn CartPole-v1 settings
    (4 envs x 128 steps, 5e5 steps, 4 epochs x 4 minibatches, lr 2.5e-4 annealed
    linearly, ...); see docs/rl.md for where the example differs."""

    num_envs: int = 4
    num_steps: int = 128
    total_timesteps: int = 500_000
    num_updates: int | None = None  # None: total_timesteps // (num_envs * num_steps)
    update_epochs: int = 4
    num_minibatches: int = 4
    lr: float = 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_eps: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    hidden: int = 128
    cell: str = "gru"  # or "lstm"
    data_parallel: int = 1

    @property
    def updates(self) -> int:
        if self.num_updates is not None:
            return self.num_updates
        return self.total_timesteps // (self.num_envs * self.num_steps)


SIZES = {
    "tiny": Config(num_envs=32, num_steps=32, num_updates=30, hidden=32, lr=3e-3),
    "default": Config(),
}


# --------------------------------------------------------------------------- the agent


class Agent(bx.Module):
    """Observation normalizer, embedding, GRU/LSTM, policy and value heads.

    Shapes: one step ``obs [B, 4]`` -> logits ``[B, 2]``, value ``[B]``; a replay
    ``obs [B, T, 4]`` -> ``[B, T, 2]``, ``[B, T]``."""

    def __init__(self, graph: bx.Graph, rng: bx.Rng, cfg: Config, axis_name: str | None):
        super().__init__(graph)
        orth = jax.nn.initializers.orthogonal
        self.obs_norm = bx.RunningMeanStd(graph / "obs_norm", axis_name=axis_name)
        h = cfg.hidden
        self.embed = bx.Linear(graph / "embed", h, rng, kernel_init=orth(math.sqrt(2)))
        cell = {"gru": bx.GRU, "lstm": bx.LSTM}[cfg.cell]
        self.rnn = cell(graph / "rnn", h, rng)
        self.pi = bx.Linear(graph / "pi", h, rng, kernel_init=orth(math.sqrt(2)))
        self.pi_out = bx.Linear(graph / "pi_out", cartpole.NUM_ACTIONS, rng, kernel_init=orth(0.01))
        self.v = bx.Linear(graph / "v", h, rng, kernel_init=orth(math.sqrt(2)))
        self.v_out = bx.Linear(graph / "v_out", 1, rng, kernel_init=orth(1.0))

    def _heads(self, params, h):
        a, params = self.pi(params, h)
        logits, params = self.pi_out(params, jax.nn.relu(a))
        c, params = self.v(params, h)
        value, params = self.v_out(params, jax.nn.relu(c))
        return logits, value[..., 0], params

    def initial_state(self, params, obs):
        return self.rnn.initial_state(params, obs)

    def step(self, params, obs_n, state, is_reset):
        """The actor: one step from normalized observations ``[B, 4]``."""
        x, params = self.embed(params, obs_n)
        (h, state), params = self.rnn(params, jax.nn.relu(x), state, is_reset=is_reset)
        logits, value, params = self._heads(params, h)
        return (logits, value, state), params

    def replay(self, params, obs_n, state0, is_reset):
        """The learner: whole sequences ``[B, T, 4]`` from the stored initial state."""
        x, params = self.embed(params, obs_n)
        (h, _), params = self.rnn.apply(
            params, jax.nn.relu(x), prev_state=state0, is_reset=is_reset
        )
        logits, value, params = self._heads(params, h)
        return (logits, value), params


class Transition(NamedTuple):
    """One step of every environment (the rollout stacks them time-major, ``[T, E]``)."""

    obs: jax.Array  # raw observation the actor saw [E, 4]
    obs_n: jax.Array  # ... normalized with the statistics as of the rollout's start
    is_reset: jax.Array  # the previous step's done: the state was reset before this step
    done: jax.Array  # this step ended the episode
    action: jax.Array
    logp: jax.Array
    value: jax.Array
    logits: jax.Array
    reward: jax.Array
    finished_return: jax.Array  # the episode's return where done, else 0


class Runner(NamedTuple):
    """Everything a run carries from one update to the next (and checkpoints)."""

    params: bx.Params  # weights, Rng seed/counter, observation statistics
    opt_state: Any
    env_state: Any  # cartpole.EnvState, [E] leaves
    obs: jax.Array  # [E, 4] the next observation (raw)
    done: jax.Array  # [E] the last step's done (the next step's is_reset)
    hidden: Any  # the actor's recurrent state [E, H]
    ep_return: jax.Array  # [E] the running episode returns
    env_ids: jax.Array  # [E] int32: the environments' global indices (keys fold them)
    update: jax.Array  # int32: updates done (the params' version)


class Rollout(NamedTuple):
    """What the actor hands the learner for one update."""

    traj: Transition  # [T, E]
    hidden0: Any  # the recurrent state at the rollout's start [E, H]
    last_value: jax.Array  # [E] the value of the observation after the rollout
    shuffle_key: jax.Array  # the learner's minibatch key (raw uint32), drawn by the actor
    version: jax.Array  # the params version the actor used


# --------------------------------------------------------------------------- the parts


class Parts(NamedTuple):
    """The run's pieces for one device (``D`` = 1) or one device of D (inside
    ``shard_map`` over `AXIS`): each a pure function of explicit state."""

    cfg: Config
    graph: bx.Graph
    rng: bx.Rng
    agent: Agent
    tx: optax.GradientTransformation
    init: Any  # (key, env_ids=None) -> Runner
    rollout: Any  # (params, Runner) -> (params, Runner, Rollout)
    learn: Any  # (params, opt_state, Rollout) -> (params, opt_state, metrics)
    update: Any  # Runner -> (Runner, metrics)
    observe: Any  # (params, raw obs [..., 4]) -> params: the statistics merge them


def build(cfg: Config, *, actor_shards: int | None = None) -> Parts:
    """The agent, the optimizer and the run's functions for `cfg`: for one device of
    ``cfg.data_parallel`` (Anakin), or, with `actor_shards`, for one Sebulba actor device
    stepping ``num_envs / actor_shards`` environments (no collective)."""
    e, d, m = cfg.num_envs, cfg.data_parallel, cfg.num_minibatches
    if e % (d * m):
        raise ValueError(
            f"--data-parallel {d} x {m} minibatches must divide the {e} environments "
            f"(each device takes an equal share of every minibatch): use a number of "
            f"environments that is a multiple of {d * m}, or fewer devices."
        )
    if cfg.cell not in ("gru", "lstm"):
        raise ValueError(f"cell must be 'gru' or 'lstm', got {cfg.cell!r}.")
    axis = AXIS if d > 1 and actor_shards is None else None
    if actor_shards is not None and e % actor_shards:
        raise ValueError(
            f"--actor-devices {actor_shards} must divide the {e} environments (each actor "
            "device steps an equal share)."
        )
    e_local = e // (actor_shards or d)
    shared_stats = (actor_shards or 1) > 1  # statistics of all actors' environments
    mb = e // m  # environments per minibatch
    mb_local = mb // d

    graph = bx.Graph("ppo")
    rng = bx.Rng(graph / "rng")
    agent = Agent(graph / "agent", rng, cfg, axis)
    steps_per_update = cfg.update_epochs * m

    def lr(count):
        if not cfg.anneal_lr:
            return cfg.lr
        done = (count // steps_per_update).astype(jnp.float32)
        return cfg.lr * (1.0 - done / cfg.updates)

    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(lr, eps=1e-5))

    def pmean(x):
        return x if axis is None else jax.lax.pmean(x, axis)

    def env_keys(key, env_ids):
        """One key per environment: ``key`` folded with its global index."""
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, env_ids)

    def init(key, env_ids=None) -> Runner:
        """A new run; `env_ids`: this device's environments (default: the device's
        share of ``0 .. num_envs - 1`` along `AXIS`, or all of them)."""
        if env_ids is None:
            offset = 0 if axis is None else jax.lax.axis_index(axis) * e_local
            env_ids = offset + jnp.arange(e_local, dtype=jnp.int32)
        params = rng.seed(bx.Params(), seed=key)
        obs0 = jnp.zeros((e_local, cartpole.OBS_SIZE), jnp.float32)
        state, params = agent.initial_state(params, obs0)
        _, params = agent.obs_norm(params, obs0, is_training=False)
        _, params = agent.step(params, obs0, state, jnp.zeros((e_local,), bool))
        params = params.locked()
        reset_key, params = rng(params)
        obs, env_state = jax.vmap(cartpole.reset)(env_keys(reset_key, env_ids))
        return Runner(
            params=params,
            opt_state=tx.init(params.split()[0]),
            env_state=env_state,
            obs=obs,
            done=jnp.zeros((e_local,), bool),
            hidden=state,
            ep_return=jnp.zeros((e_local,), jnp.float32),
            env_ids=jnp.asarray(env_ids, jnp.int32),
            update=jnp.zeros((), jnp.int32),
        )

    def actor_step(carry, _):
        params, env_state, obs, done, state, ep_return, ids = carry
        key, params = rng(params)  # the actor's write: one counter tick per step
        act_keys, reset_keys = jnp.moveaxis(jax.vmap(jax.random.split)(env_keys(key, ids)), 1, 0)
        obs_n, _ = agent.obs_norm(params, obs, is_training=False)
        (logits, value, state), _ = agent.step(params, obs_n, state, done)
        action = jax.vmap(jax.random.categorical)(act_keys, logits)
        logp_all = jax.nn.log_softmax(logits)
        logp = jnp.take_along_axis(logp_all, action[:, None], axis=1)[:, 0]
        next_obs, env_state, reward, next_done, _ = jax.vmap(cartpole.step)(
            reset_keys, env_state, action
        )
        ret = ep_return + reward
        tr = Transition(
            obs,
            obs_n,
            done,
            next_done,
            action,
            logp,
            value,
            logits,
            reward,
            jnp.where(next_done, ret, 0.0),
        )
        ep_return = jnp.where(next_done, 0.0, ret)
        return (params, env_state, next_obs, next_done, state, ep_return, ids), tr

    def rollout(params, runner: Runner):
        carry = (params, runner.env_state, runner.obs, runner.done, runner.hidden,
                 runner.ep_return, runner.env_ids)  # fmt: skip
        carry, traj = jax.lax.scan(actor_step, carry, length=cfg.num_steps)
        params, env_state, obs, done, state, ep_return, _ = carry
        obs_n, _ = agent.obs_norm(params, obs, is_training=False)
        (_, last_value, _), _ = agent.step(params, obs_n, state, done)
        # The statistics move only now: the whole rollout was normalized as of its start.
        # (Several Sebulba actors merge every actor's observations instead: `_act`.)
        if not shared_stats:
            params = agent.obs_norm.update(params, traj.obs)
        shuffle_key, params = rng(params)
        shuffle_key = jax.random.key_data(shuffle_key)  # raw: checkpointable
        out = Rollout(traj, runner.hidden, last_value, shuffle_key, runner.update)
        runner = runner._replace(
            env_state=env_state, obs=obs, done=done, hidden=state, ep_return=ep_return
        )
        return params, runner, out

    def gae(traj: Transition, last_value):
        def back(carry, tr):
            adv, next_value = carry
            live = 1.0 - tr.done.astype(jnp.float32)
            delta = tr.reward + cfg.gamma * next_value * live - tr.value
            adv = delta + cfg.gamma * cfg.gae_lambda * live * adv
            return (adv, tr.value), adv

        _, adv = jax.lax.scan(back, (jnp.zeros_like(last_value), last_value), traj, reverse=True)
        return adv, adv + traj.value

    def gather(tree, axis_):
        if axis is None:
            return tree
        return jax.tree.map(lambda a: jax.lax.all_gather(a, axis, axis=axis_, tiled=True), tree)

    def loss_fn(train, rest, batch):
        """PPO's total loss on this device's share of a minibatch (batch-major)."""
        traj, state0, adv, targets = batch
        params = rest.merge(train)
        (logits, value), _ = agent.replay(params, traj.obs_n, state0, traj.is_reset)
        logp_all = jax.nn.log_softmax(logits)
        logp = jnp.take_along_axis(logp_all, traj.action[..., None], axis=-1)[..., 0]
        ratio = jnp.exp(logp - traj.logp)
        # advantages normalized over the whole (global) minibatch
        mean = pmean(jnp.mean(adv))
        std = jnp.sqrt(pmean(jnp.mean(jnp.square(adv - mean))))
        adv = (adv - mean) / (std + 1e-8)
        actor = -jnp.mean(
            jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
        )
        v_clipped = traj.value + jnp.clip(value - traj.value, -cfg.clip_eps, cfg.clip_eps)
        v_loss = 0.5 * jnp.mean(
            jnp.maximum(jnp.square(value - targets), jnp.square(v_clipped - targets))
        )
        entropy = -jnp.mean(jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1))
        total = actor + cfg.vf_coef * v_loss - cfg.ent_coef * entropy
        ratio_err = jnp.max(jnp.abs(ratio - 1.0))
        return total, ratio_err

    def learn(params, opt_state, ro: Rollout):
        """PPO epochs over minibatches of whole environment sequences."""
        adv, targets = gae(ro.traj, ro.last_value)
        # every device sees the whole rollout, so the permutation is the one-device one
        traj, adv, targets = gather((ro.traj, adv, targets), 1)
        state0 = gather(ro.hidden0, 0)
        train, rest = params.split()  # rest: the actor's writes, kept as they are
        first = 0 if axis is None else jax.lax.axis_index(axis) * mb_local

        def minibatch(carry, idx):
            train, opt_state = carry
            mine = jax.lax.dynamic_slice_in_dim(idx, first, mb_local)
            batch = (
                jax.tree.map(lambda a: jnp.swapaxes(a[:, mine], 0, 1), traj),
                jax.tree.map(lambda a: a[mine], state0),
                jnp.swapaxes(adv[:, mine], 0, 1),
                jnp.swapaxes(targets[:, mine], 0, 1),
            )
            # Inside shard_map, the gradient of a per-device loss with respect to
            # replicated (invariant) params comes back already psum-ed over the devices;
            # cast them to varying first so that each device's gradient stays its own,
            # then average once (see blox/parallel/_dp.py).
            local = train if axis is None else jax.lax.pcast(train, axis, to="varying")
            (loss, ratio_err), grads = jax.value_and_grad(loss_fn, has_aux=True)(local, rest, batch)
            loss, grads = pmean((loss, grads))  # the global mean over the minibatch
            if axis is not None:
                ratio_err = jax.lax.pmax(ratio_err, axis)
            # Optax mixes Python floats with int32 counters (Adam's b1 ** count)
            with jax.numpy_dtype_promotion("standard"):
                updates, opt_state = tx.update(grads, opt_state, train)
                train = optax.apply_updates(train, updates)
            return (train, opt_state), (loss, ratio_err)

        def epoch(carry, k):
            key = jax.random.wrap_key_data(ro.shuffle_key)
            perm = jax.random.permutation(jax.random.fold_in(key, k), e)
            return jax.lax.scan(minibatch, carry, perm.reshape(m, mb))

        (train, opt_state), (losses, ratio_errs) = jax.lax.scan(
            epoch, (train, opt_state), jnp.arange(cfg.update_epochs)
        )
        returns = ro.traj.finished_return
        count = jnp.sum(ro.traj.done.astype(jnp.float32))
        total_return = jnp.sum(returns)
        if axis is not None:
            count, total_return = jax.lax.psum((count, total_return), axis)
        metrics = {
            "loss": jnp.mean(losses),
            "losses": losses,  # [epochs, minibatches]
            "ratio_err": ratio_errs[0, 0],
            "return_sum": total_return,
            "episodes": count,
            "actor_version": ro.version,
        }
        return rest.merge(train), opt_state, metrics

    def update(runner: Runner):
        params, runner, ro = rollout(runner.params, runner)
        params, opt_state, metrics = learn(params, runner.opt_state, ro)
        runner = runner._replace(params=params, opt_state=opt_state, update=runner.update + 1)
        return runner, metrics

    return Parts(cfg, graph, rng, agent, tx, init, rollout, learn, update, agent.obs_norm.update)


def make_train(cfg: Config | dict):
    """``train(key) -> (Runner, metrics)``: the whole one-device run (init, then
    ``lax.scan`` over `cfg.updates` updates, each a rollout scan and a learner scan),
    jitted; ``metrics`` leaves are ``[updates]``. ``jax.vmap`` it over keys for seeds."""
    cfg = cfg if isinstance(cfg, Config) else Config(**cfg)
    if cfg.data_parallel != 1:
        raise ValueError("make_train runs on one device: use data_parallel=1.")
    parts = build(cfg)

    @jax.jit
    def train(key):
        runner = parts.init(key)
        return jax.lax.scan(lambda r, _: parts.update(r), runner, length=cfg.updates)

    return train


# --------------------------------------------------------------------------- layouts


def _seed_keys(seed: int, seeds: int):
    return jax.vmap(jax.random.key)(jnp.arange(seed, seed + seeds, dtype=jnp.uint32))


def _env_spec(a):
    """Seed axis first, then the environments (over the devices) when there are any."""
    return P(None, AXIS) if a.ndim >= 2 else P()


def runner_specs(runner: Runner) -> Runner:
    """The ``PartitionSpec`` of each leaf of a seeds-stacked `Runner`: params, optimizer
    state and the update count replicated, the environment leaves split over `AXIS`."""
    rep = jax.tree.map(lambda _: P(), (runner.params, runner.opt_state, runner.update))
    env = jax.tree.map(
        _env_spec,
        (runner.env_state, runner.obs, runner.done, runner.hidden, runner.ep_return,
         runner.env_ids),
    )  # fmt: skip
    return Runner(rep[0], rep[1], *env, rep[2])


class Program(NamedTuple):
    """The compiled-on-demand functions of a layout: seeds-stacked runners."""

    init: Any  # keys [K] -> Runner
    chunk: Any  # (Runner, n) -> (Runner, metrics [n, K])


def program(cfg: Config) -> Program:
    """One device (``jax.jit``) or Anakin over ``cfg.data_parallel`` devices
    (``jax.shard_map`` over `AXIS`), seeds by ``jax.vmap``."""
    parts = build(cfg)
    init = jax.vmap(parts.init)
    update = jax.vmap(parts.update)

    def scan(runner, n):
        return jax.lax.scan(lambda r, _: update(r), runner, length=n)

    if cfg.data_parallel == 1:
        return Program(jax.jit(init), jax.jit(scan, static_argnums=1))
    mesh = jax.make_mesh(
        (cfg.data_parallel,),
        (AXIS,),
        devices=jax.devices()[: cfg.data_parallel],
        axis_types=(jax.sharding.AxisType.Explicit,),
    )
    # the specs need only the structure: the one-device run's has it
    one = build(dataclasses.replace(cfg, data_parallel=1))
    specs = runner_specs(jax.eval_shape(jax.vmap(one.init), _seed_keys(0, 1)))
    metric_specs = P()

    sm_init = jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=specs)

    def sm_scan(runner, n):
        f = jax.shard_map(
            lambda r: scan(r, n), mesh=mesh, in_specs=(specs,), out_specs=(specs, metric_specs)
        )
        return f(runner)

    return Program(jax.jit(sm_init), jax.jit(sm_scan, static_argnums=1))


# --------------------------------------------------------------------------- Sebulba


def rollout_specs(ro: Rollout) -> Rollout:
    """The learner mesh's ``PartitionSpec`` of each leaf of a `Rollout`: environments
    over `AXIS` (axis 1 of the time-major trajectory, axis 0 of the rest)."""
    return Rollout(
        traj=jax.tree.map(lambda _: P(None, AXIS), ro.traj),
        hidden0=jax.tree.map(lambda _: P(AXIS), ro.hidden0),
        last_value=P(AXIS),
        shuffle_key=P(),
        version=P(),
    )


def _concat(rollouts: list[Rollout], device) -> Rollout:
    """The actors' rollouts as one, on `device` (environments in global order)."""
    if len(rollouts) == 1:
        return rollouts[0]
    local = [bp.place(r, device) for r in rollouts]
    traj = jax.tree.map(lambda *a: jnp.concatenate(a, axis=1), *[r.traj for r in local])
    cat0 = functools.partial(jnp.concatenate, axis=0)
    return local[0]._replace(
        traj=traj,
        hidden0=jax.tree.map(lambda *a: cat0(a), *[r.hidden0 for r in local]),
        last_value=cat0([r.last_value for r in local]),
    )


@functools.cache
def _sebulba_programs(cfg: Config, actor_devices: tuple, learner_devices: tuple) -> dict:
    """The actor's and the learner's jitted functions and the learner mesh (kept, so
    that runs of one process with the same layout compile once)."""
    actor = build(cfg, actor_shards=len(actor_devices))
    learner = build(dataclasses.replace(cfg, data_parallel=len(learner_devices)))
    mesh = jax.make_mesh(
        (len(learner_devices),),
        (AXIS,),
        devices=learner_devices,
        axis_types=(jax.sharding.AxisType.Explicit,),
    )
    init, rollout, observe = jax.jit(actor.init), jax.jit(actor.rollout), jax.jit(actor.observe)
    return {"mesh": mesh, "init": init, "rollout": rollout, "observe": observe,
            "actor_devices": actor_devices, "learner": learner, "learn": None}  # fmt: skip


def sebulba_start(cfg: Config, seed: int, actor_devices, learner_devices) -> dict:
    """The state of a Sebulba run before its first update (also the structure a
    checkpoint restores into): the learner's params and optimizer state on its mesh, each
    actor's `Runner` on its device, the actors' first rollouts, and ``n``, the updates
    done."""
    progs = _sebulba_programs(cfg, tuple(actor_devices), tuple(learner_devices))
    mesh, init = progs["mesh"], progs["init"]
    e_a = cfg.num_envs // len(actor_devices)
    key = jax.random.key(seed)
    runners = [
        init(bp.place(key, dev), bp.place(jnp.arange(a * e_a, (a + 1) * e_a), dev))
        for a, dev in enumerate(actor_devices)
    ]
    runners, rollouts = _act(progs, runners)
    return {
        # the learner's copy of the params (the same initial weights), on its mesh
        "params": bp.place(runners[0].params, mesh),
        "opt_state": bp.place(runners[0].opt_state, mesh),
        "runners": runners,
        "rollouts": rollouts,  # the next update's trajectory, already collected
        "n": np.zeros((), np.int32),
    }


def _act(progs: dict, runners: list[Runner]):
    """Each actor's rollout on its device. With several actors, each then merges *every*
    actor's raw observations (environments in global order) into its statistics, so all
    of them normalize as one device does (an exchange of ``T x E x 4`` floats)."""
    out = [progs["rollout"](r.params, r) for r in runners]
    params, new, rollouts = ([o[i] for o in out] for i in range(3))
    if len(runners) > 1:
        devices = progs["actor_devices"]
        params = [
            progs["observe"](p, jnp.concatenate([bp.place(ro.traj.obs, dev) for ro in rollouts], 1))
            for p, dev in zip(params, devices, strict=True)
        ]
    return [r._replace(params=p) for p, r in zip(params, new, strict=True)], rollouts


def sebulba(cfg: Config, state: dict, actor_devices, learner_devices, lag: int):
    """Sebulba (Podracer) from `state` (`sebulba_start` or a restored checkpoint):
    actors step their share of the environments on their own devices; the learner runs
    data-parallel (``shard_map``) on a mesh of other devices. After each update the
    learner's weights are pushed to every actor device (``bp.place``), where they are
    merged into the actor's own params (its Rng counter and observation statistics stay
    the actor's). With ``lag=1`` the actor's next rollout is dispatched *before* the
    push, so it runs with the previous weights while the learner trains (JAX dispatches
    asynchronously): the trajectory of update n comes from the params after n - 2
    updates (the first two from the initial ones, as in cleanba). Yields ``(n, metrics,
    state)`` per update; ``metrics['actor_version']`` is the number of updates in the
    params that collected the trajectory, and `state` holds everything the next update
    needs (at lag 1 the rollout collected with the previous weights included)."""
    progs = _sebulba_programs(cfg, tuple(actor_devices), tuple(learner_devices))
    mesh = progs["mesh"]
    params, opt_state = state["params"], state["opt_state"]
    runners, rollouts = state["runners"], state["rollouts"]
    for n in range(int(state["n"]) + 1, cfg.updates + 1):
        ro = _concat(rollouts, actor_devices[0])
        specs = rollout_specs(ro)
        ro = bp.place(ro, specs, mesh=mesh)  # the actors' trajectory onto the learner mesh
        if progs["learn"] is None:
            learn = progs["learner"].learn
            sm = jax.shard_map(learn, mesh=mesh, in_specs=(P(), P(), specs), out_specs=P())
            progs["learn"] = jax.jit(sm)
        params, opt_state, metrics = progs["learn"](params, opt_state, ro)
        if lag == 1 and n < cfg.updates:
            runners, rollouts = _act(progs, runners)  # overlaps the learner: old weights
        weights, _ = params.split()
        runners = [  # the push: the learner's weights into each actor's own params
            r._replace(
                params=r.params.merge(bp.place(weights, dev)),
                update=bp.place(jnp.asarray(n, jnp.int32), dev),
            )
            for r, dev in zip(runners, actor_devices, strict=True)
        ]
        if lag == 0 and n < cfg.updates:
            runners, rollouts = _act(progs, runners)
        state = {
            "params": params,
            "opt_state": opt_state,
            "runners": runners,
            "rollouts": rollouts,
            "n": np.asarray(n, np.int32),
        }
        yield n, metrics, state


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=None, help="updates (default: the size's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, help="run seeds S .. S+K-1 (vmap)")
    parser.add_argument("--cell", choices=("gru", "lstm"), default="gru")
    parser.add_argument("--data-parallel", type=int, default=1, help="Anakin over D devices")
    parser.add_argument("--actor-devices", type=int, default=None, help="Sebulba: A actors")
    parser.add_argument("--learner-devices", type=int, default=None, help="... L learners")
    parser.add_argument("--policy-lag", type=int, choices=(0, 1), default=0)
    parser.add_argument("--ckpt-dir", default=None, help="checkpoint here; resume if it holds one")
    parser.add_argument("--save-every", type=int, default=None, help="updates between saves")
    parser.add_argument("--curve", default=None, help="write each seed's returns (JSON)")
    args = parser.parse_args(argv)
    cfg = dataclasses.replace(
        SIZES[args.size],
        cell=args.cell,
        data_parallel=args.data_parallel,
    )
    if args.steps is not None:
        cfg = dataclasses.replace(cfg, num_updates=args.steps)
    if args.data_parallel > len(jax.devices()):
        raise SystemExit(
            f"--data-parallel {args.data_parallel} needs that many devices, found "
            f"{len(jax.devices())}; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={args.data_parallel}."
        )
    total = cfg.updates
    if (args.actor_devices is None) != (args.learner_devices is None):
        raise SystemExit("Sebulba needs both --actor-devices A and --learner-devices L.")
    if args.actor_devices is not None:
        return _main_sebulba(args, cfg)
    chunk = args.save_every or total
    prog = program(cfg)

    t0 = time.perf_counter()
    runner = prog.init(_seed_keys(args.seed, args.seeds))
    # per update and seed; checkpointed with the runner (the final lines need them all)
    history = {
        k: np.zeros((total, args.seeds), np.float32)
        for k in ("loss", "ratio_err", "return_sum", "episodes")
    }
    run_s, ran_here = 0.0, 0  # this process's training time (compile excluded), updates
    with contextlib.ExitStack() as stack:
        mngr = None
        if args.ckpt_dir is not None:
            mngr = stack.enter_context(
                bx.ckpt.CheckpointManager(args.ckpt_dir, save_every=args.save_every or total)
            )
            if mngr.latest_step() is not None:
                state = mngr.restore({"runner": runner, "history": history})
                runner = state["runner"]
                history = {k: np.array(v) for k, v in state["history"].items()}
                done_updates = int(runner.update[0])
                print(f"resumed from update {done_updates} of {args.ckpt_dir}", flush=True)
        compiled = {}
        while int(runner.update[0]) < total:
            start = int(runner.update[0])
            n = min(chunk - start % chunk, total - start)
            if n not in compiled:
                compiled[n] = prog.chunk.lower(runner, n).compile()
            t1 = time.perf_counter()
            runner, metrics = compiled[n](runner)
            metrics = jax.device_get(metrics)
            run_s += time.perf_counter() - t1
            ran_here += n
            for i in range(n):
                step = start + i + 1
                _print_update(
                    step, *(float(metrics[k][i, 0]) for k in ("loss", "ratio_err")),
                    *(float(metrics[k][i, 0]) for k in ("return_sum", "episodes")),
                )  # fmt: skip
                for k in history:
                    history[k][step - 1] = np.asarray(metrics[k][i])
            if mngr is not None:
                mngr.save(start + n, {"runner": runner, "history": history})
    return _report(args, cfg, history, ran_here, run_s, t0)


def _print_update(step: int, loss: float, ratio_err: float, ret_sum: float, episodes: float):
    ret = ret_sum / max(episodes, 1.0)
    print(
        f"step={step} loss={loss!r} ratio_err={ratio_err!r} episode_return={ret:.2f}",
        flush=True,
    )


def _main_sebulba(args, cfg: Config) -> dict[str, Any]:
    a, l_ = args.actor_devices, args.learner_devices
    devices = jax.devices()
    if a < 1 or l_ < 1 or a + l_ > len(devices):
        raise SystemExit(
            f"--actor-devices {a} --learner-devices {l_} needs {a + l_} devices, found "
            f"{len(devices)}; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=8."
        )
    if args.seeds != 1 or args.data_parallel != 1:
        raise SystemExit("Sebulba runs one seed, without --data-parallel.")
    history = {
        k: np.zeros((cfg.updates, 1), np.float32)
        for k in ("loss", "ratio_err", "return_sum", "episodes")
    }
    t0 = time.perf_counter()
    actors, learners = devices[:a], devices[a : a + l_]
    state = sebulba_start(cfg, args.seed, actors, learners)
    with contextlib.ExitStack() as stack:
        mngr = None
        if args.ckpt_dir is not None:
            mngr = stack.enter_context(
                bx.ckpt.CheckpointManager(args.ckpt_dir, save_every=args.save_every or cfg.updates)
            )
            if mngr.latest_step() is not None:  # into the same devices and mesh
                restored = mngr.restore({"state": state, "history": history})
                state = restored["state"]
                history = {k: np.array(v) for k, v in restored["history"].items()}
                print(f"resumed from update {int(state['n'])} of {args.ckpt_dir}", flush=True)
        run = sebulba(cfg, state, actors, learners, args.policy_lag)
        t1, timed = None, 0  # timed from the end of the first update (its compile)
        for n, metrics, now in run:
            m = jax.device_get(metrics)
            if t1 is None:
                t1 = time.perf_counter()
            else:
                timed += 1
            row = [float(m["loss"]), float(m["ratio_err"]), float(m["return_sum"])]
            _print_update(n, *row, float(m["episodes"]))
            print(f"update={n} actor_version={int(m['actor_version']) + 1}", flush=True)
            for k in history:
                history[k][n - 1] = m[k]
            if mngr is not None:
                mngr.save(n, {"state": now, "history": history})
    return _report(args, cfg, history, timed, time.perf_counter() - (t1 or t0), t0)


def _report(args, cfg: Config, history, ran_here: int, run_s: float, t0: float):
    """The final lines (and the --curve file)."""
    total = cfg.updates
    sums = history["return_sum"][-10:].sum(0)
    counts = history["episodes"][-10:].sum(0)
    env_steps = total * cfg.num_envs * cfg.num_steps
    result = {"mean_return": [], "env_steps": env_steps}
    for k in range(args.seeds):
        mean_return = float(sums[k] / max(counts[k], 1.0))
        result["mean_return"].append(mean_return)
        print(f"seed={args.seed + k} env_steps={env_steps} mean_return={mean_return:.2f}")
    per_s = ran_here * args.seeds * cfg.num_envs * cfg.num_steps / max(run_s, 1e-9)
    print(f"env_steps_per_s={per_s:.1f}")
    print(f"wall_s={time.perf_counter() - t0:.1f}", flush=True)
    result["env_steps_per_s"] = per_s
    if args.curve is not None:  # the learning curve of docs/rl.md
        curve = {
            "seeds": list(range(args.seed, args.seed + args.seeds)),
            "env_steps_per_update": cfg.num_envs * cfg.num_steps,
            "return_sum": history["return_sum"].tolist(),
            "episodes": history["episodes"].tolist(),
        }
        Path(args.curve).write_text(json.dumps(curve))
    return result


if __name__ == "__main__":
    main()
