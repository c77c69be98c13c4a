"""RL training-loop speed: the recurrent PPO example on blox against the same math on
plain dicts, whole compiled training loops, environment steps per second.

Run (``make bench``)::

    .venv/bin/python benchmarks/rl_speed.py --out docs/benchmarks.md

blox: ``examples/actor_learner.py``'s ``make_train(cfg)``, the whole one-device run
(init, then ``lax.scan`` over updates of a rollout scan and a learner scan) under one
``jax.jit``. Raw: the same math written PureJaxRL style on ``{str: array}`` dicts in
this file (``raw_make_train``): a hand-written GRU, dense layers, running observation
statistics, a counter-based key (``fold_in(seed, counter)``, as ``bx.Rng``), GAE and
the PPO loss, over the same JAX CartPole (``examples/cartpole.py``). Same
hyperparameters and sizes as the example's default (4 environments x 128 steps, GRU
128, 4 epochs x 4 minibatches); a call runs ``--updates`` updates, so the env steps per
call are ``updates x 4 x 128``. A second pair runs 32 environments.

Each contender is compiled once (``lower(...).compile()``, timed and reported apart)
and its executable is called; a call is a whole training run from the same key, timed
to its end. Timing is same-round (see ``_timing.py``): the ratio blox / raw of per-call
times is the inverse ratio of env steps per second; the target is <= 1.03.

Anakin rows: the example's ``program(cfg)`` (``jax.vmap`` over one seed; with
``data_parallel=8`` a ``jax.shard_map`` over 8 simulated CPU devices), 32 environments,
one chunk of ``--updates`` updates per call. On a 2-core machine 8 simulated devices
share the same cores, so that row measures the cost of the layout, not a speed-up.
Sebulba rows run only when the example has the ``--actor-devices`` flag.

Same math: before timing, blox's initial run state is loaded into the raw dict state
(weights, observation statistics, Rng seed and counter, environments, hidden state) and
two updates run on each side; the 16 minibatch losses, the ratio check, the weights and
the statistics after each update are compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import _timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import Contender, CountArgs, Pair, log  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ANCHOR = ROOT / "benchmarks" / "results" / "rl_anchor_purejaxrl.json"
TARGET = 1.03
COUNTS = CountArgs(steps=2, warmup=1, quick_steps=1, quick_warmup=1, rounds=5, quick_rounds=2)
DP_DEVICES = 8


def load_example():
    """``examples/actor_learner.py`` as a module (``examples/`` is not a package)."""
    if "actor_learner" in sys.modules:
        return sys.modules["actor_learner"]
    path = ROOT / "examples" / "actor_learner.py"
    spec = importlib.util.spec_from_file_location("actor_learner", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["actor_learner"] = module
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- raw JAX


class RawRunner(NamedTuple):
    """The raw run state: every leaf a plain array or a dict of them."""

    train: dict[str, jax.Array]  # the trainable weights
    stats: dict[str, jax.Array]  # running_mean [4], running_var [4], count ()
    seed: jax.Array  # uint32 key data
    counter: jax.Array  # uint32 ()
    opt_state: Any
    env_state: Any
    obs: jax.Array  # [E, 4]
    done: jax.Array  # [E]
    hidden: jax.Array  # [E, H]
    ep_return: jax.Array  # [E]
    update: jax.Array  # int32 ()


def raw_init_weights(key: jax.Array, hidden: int, obs_size: int, actions: int):
    """The weights, drawn with the example's initializers (not its draws)."""
    orth = jax.nn.initializers.orthogonal
    ks = jax.random.split(key, 9)
    gru_in = jax.nn.initializers.variance_scaling(0.5, "fan_in", "truncated_normal")
    zeros = jnp.zeros
    h = hidden
    return {
        "embed/kernel": orth(math.sqrt(2))(ks[0], (obs_size, h)),
        "embed/bias": zeros((h,)),
        "rnn/kernel": gru_in(ks[1], (h, 3 * h)),
        "rnn/recurrent_kernel": jnp.concatenate([orth()(k, (h, h)) for k in ks[2:5]], axis=1),
        "rnn/bias": zeros((3 * h,)),
        "rnn/recurrent_bias": zeros((3 * h,)),
        "pi/kernel": orth(2.0)(ks[5], (h, h)),
        "pi/bias": zeros((h,)),
        "pi_out/kernel": orth(0.01)(ks[6], (h, actions)),
        "pi_out/bias": zeros((actions,)),
        "v/kernel": orth(2.0)(ks[7], (h, h)),
        "v/bias": zeros((h,)),
        "v_out/kernel": orth(1.0)(ks[8], (h, 1)),
        "v_out/bias": zeros((1,)),
    }


def raw_parts(cfg, cartpole):
    """``(init, update, tx)`` of the raw run for the example's `cfg` (one device)."""
    e, m, t_steps, h = cfg.num_envs, cfg.num_minibatches, cfg.num_steps, cfg.hidden
    mb = e // m
    steps_per_update = cfg.update_epochs * m

    def lr(count):
        if not cfg.anneal_lr:
            return cfg.lr
        return cfg.lr * (1.0 - (count // steps_per_update).astype(jnp.float32) / cfg.updates)

    tx = optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), optax.adam(lr, eps=1e-5))

    def next_key(seed, counter):
        return jax.random.fold_in(jax.random.wrap_key_data(seed), counter), counter + 1

    def env_keys(key):
        return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(e))

    def dense(p, name, x):
        return jnp.dot(x, p[name + "/kernel"]) + p[name + "/bias"]

    def gru(p, x, hid):
        gi = jnp.dot(x, p["rnn/kernel"]) + p["rnn/bias"][None, :]
        gh = jnp.dot(hid, p["rnn/recurrent_kernel"]) + p["rnn/recurrent_bias"][None, :]
        ri, zi, ni = jnp.split(gi, 3, axis=-1)
        rh, zh, nh = jnp.split(gh, 3, axis=-1)
        r = jax.nn.sigmoid(ri + rh)
        z = jax.nn.sigmoid(zi + zh)
        n = jnp.tanh(ni + r * nh)
        return (1 - z) * n + z * hid

    def heads(p, hid):
        logits = dense(p, "pi_out", jax.nn.relu(dense(p, "pi", hid)))
        value = dense(p, "v_out", jax.nn.relu(dense(p, "v", hid)))
        return logits, value[..., 0]

    def normalize(stats, x):
        inv = jax.lax.rsqrt(stats["running_var"] + jnp.float32(1e-8))
        return (x - stats["running_mean"]) * inv

    def merge_stats(stats, x):
        xs = jax.lax.stop_gradient(x).reshape(-1, x.shape[-1])
        k = jnp.asarray(xs.shape[0], jnp.float32)
        batch_mean = jnp.sum(xs, axis=0) / k
        batch_var = jnp.sum(jnp.square(xs - batch_mean[None]), axis=0) / k
        n, m_a, v_a = stats["count"], stats["running_mean"], stats["running_var"]
        count = n + k
        delta = batch_mean - m_a
        return {
            "running_mean": m_a + delta * (k / count),
            "running_var": (v_a * n + batch_var * k + jnp.square(delta) * (n * k / count)) / count,
            "count": count,
        }

    def net_step(p, obs_n, hid, is_reset):
        x = jax.nn.relu(dense(p, "embed", obs_n))
        hid = jnp.where(is_reset[:, None], jnp.zeros_like(hid), hid)
        hid = gru(p, x, hid)
        logits, value = heads(p, hid)
        return logits, value, hid

    def replay(p, obs_n, hid0, is_reset):
        """Batch-major ``[B, T, ...]`` in and out, ``lax.scan`` over time."""
        x = jax.nn.relu(dense(p, "embed", obs_n))

        def body(hid, xr):
            x_t, r_t = xr
            hid = gru(p, x_t, jnp.where(r_t[:, None], jnp.zeros_like(hid), hid))
            return hid, hid

        _, hs = jax.lax.scan(body, hid0, (jnp.swapaxes(x, 0, 1), jnp.swapaxes(is_reset, 0, 1)))
        return heads(p, jnp.swapaxes(hs, 0, 1))

    def init(key) -> RawRunner:
        wkey, key = jax.random.split(key)
        train = raw_init_weights(wkey, h, cartpole.OBS_SIZE, cartpole.NUM_ACTIONS)
        stats = {
            "running_mean": jnp.zeros((cartpole.OBS_SIZE,)),
            "running_var": jnp.ones((cartpole.OBS_SIZE,)),
            "count": jnp.zeros(()),
        }
        seed, counter = jax.random.key_data(key), jnp.zeros((), jnp.uint32)
        reset_key, counter = next_key(seed, counter)
        obs, env_state = jax.vmap(cartpole.reset)(env_keys(reset_key))
        return RawRunner(
            train,
            stats,
            seed,
            counter,
            tx.init(train),
            env_state,
            obs,
            jnp.zeros((e,), bool),
            jnp.zeros((e, h), jnp.float32),
            jnp.zeros((e,), jnp.float32),
            jnp.zeros((), jnp.int32),
        )

    def update(r: RawRunner):
        p, stats, seed = r.train, r.stats, r.seed

        def env_step(carry, _):
            counter, env_state, obs, done, hid, ep_return = carry
            key, counter = next_key(seed, counter)
            act_keys, reset_keys = jnp.moveaxis(jax.vmap(jax.random.split)(env_keys(key)), 1, 0)
            obs_n = normalize(stats, obs)
            logits, value, hid = net_step(p, obs_n, hid, done)
            action = jax.vmap(jax.random.categorical)(act_keys, logits)
            logp_all = jax.nn.log_softmax(logits)
            logp = jnp.take_along_axis(logp_all, action[:, None], axis=1)[:, 0]
            next_obs, env_state, reward, next_done, _ = jax.vmap(cartpole.step)(
                reset_keys, env_state, action
            )
            ret = ep_return + reward
            tr = {
                "obs": obs,
                "obs_n": obs_n,
                "is_reset": done,
                "done": next_done,
                "action": action,
                "logp": logp,
                "value": value,
                "reward": reward,
                "finished_return": jnp.where(next_done, ret, 0.0),
            }
            ep_return = jnp.where(next_done, 0.0, ret)
            return (counter, env_state, next_obs, next_done, hid, ep_return), tr

        carry = (r.counter, r.env_state, r.obs, r.done, r.hidden, r.ep_return)
        carry, traj = jax.lax.scan(env_step, carry, length=t_steps)
        counter, env_state, obs, done, hid, ep_return = carry
        _, last_value, _ = net_step(p, normalize(stats, obs), hid, done)
        new_stats = merge_stats(stats, traj["obs"])
        shuffle_key, counter = next_key(seed, counter)

        def back(carry, tr):
            adv, next_value = carry
            live = 1.0 - tr["done"].astype(jnp.float32)
            delta = tr["reward"] + cfg.gamma * next_value * live - tr["value"]
            adv = delta + cfg.gamma * cfg.gae_lambda * live * adv
            return (adv, tr["value"]), adv

        _, adv = jax.lax.scan(back, (jnp.zeros_like(last_value), last_value), traj, reverse=True)
        targets = adv + traj["value"]

        def loss_fn(p, batch):
            tr, hid0, adv, targets = batch
            logits, value = replay(p, tr["obs_n"], hid0, tr["is_reset"])
            logp_all = jax.nn.log_softmax(logits)
            logp = jnp.take_along_axis(logp_all, tr["action"][..., None], axis=-1)[..., 0]
            ratio = jnp.exp(logp - tr["logp"])
            mean = jnp.mean(adv)
            std = jnp.sqrt(jnp.mean(jnp.square(adv - mean)))
            adv = (adv - mean) / (std + 1e-8)
            clipped = jnp.clip(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps)
            actor = -jnp.mean(jnp.minimum(ratio * adv, clipped * adv))
            v_clipped = tr["value"] + jnp.clip(value - tr["value"], -cfg.clip_eps, cfg.clip_eps)
            v_loss = 0.5 * jnp.mean(
                jnp.maximum(jnp.square(value - targets), jnp.square(v_clipped - targets))
            )
            entropy = -jnp.mean(jnp.sum(jnp.exp(logp_all) * logp_all, axis=-1))
            total = actor + cfg.vf_coef * v_loss - cfg.ent_coef * entropy
            return total, jnp.max(jnp.abs(ratio - 1.0))

        def minibatch(carry, idx):
            p, opt_state = carry
            batch = (
                jax.tree.map(lambda a: jnp.swapaxes(a[:, idx], 0, 1), traj),
                r.hidden[idx],
                jnp.swapaxes(adv[:, idx], 0, 1),
                jnp.swapaxes(targets[:, idx], 0, 1),
            )
            (loss, ratio_err), grads = jax.value_and_grad(loss_fn, has_aux=True)(p, batch)
            with jax.numpy_dtype_promotion("standard"):
                updates, opt_state = tx.update(grads, opt_state, p)
                p = optax.apply_updates(p, updates)
            return (p, opt_state), (loss, ratio_err)

        def epoch(carry, k):
            perm = jax.random.permutation(jax.random.fold_in(shuffle_key, k), e)
            return jax.lax.scan(minibatch, carry, perm.reshape(m, mb))

        (p, opt_state), (losses, ratio_errs) = jax.lax.scan(
            epoch, (p, r.opt_state), jnp.arange(cfg.update_epochs)
        )
        metrics = {
            "loss": jnp.mean(losses),
            "losses": losses,
            "ratio_err": ratio_errs[0, 0],
            "return_sum": jnp.sum(traj["finished_return"]),
            "episodes": jnp.sum(traj["done"].astype(jnp.float32)),
        }
        runner = RawRunner(
            p, new_stats, seed, counter, opt_state, env_state, obs, done, hid, ep_return,
            r.update + 1,
        )  # fmt: skip
        return runner, metrics

    return init, update, tx


def raw_make_train(cfg, cartpole):
    """``train(key)``: the raw run, init and a ``lax.scan`` over updates, jitted."""
    init, update, _ = raw_parts(cfg, cartpole)

    @jax.jit
    def train(key):
        return jax.lax.scan(lambda r, _: update(r), init(key), length=cfg.updates)

    return train


# --------------------------------------------------------------------------- same math


def blox_to_raw(al, parts, runner, raw_tx) -> RawRunner:
    """The raw run state holding the values of blox's `runner` (a fresh optimizer state,
    as blox's own fresh one: zeros)."""
    params = runner.params
    prefix = parts.agent.param_path("_")[:-1]
    train = {}
    for path, param in params.items():
        if path[: len(prefix)] == prefix and path[len(prefix)] != "obs_norm":
            train["/".join(path[len(prefix) :])] = param.value
    mean, var, count = parts.agent.obs_norm.statistics(params)
    stats = {"running_mean": mean, "running_var": var, "count": count}
    seed = params.value(parts.rng.param_path("seed"))
    counter = parts.rng.get_counter(params)
    return RawRunner(
        train, stats, seed, counter, raw_tx.init(train), runner.env_state, runner.obs,
        runner.done, runner.hidden.hidden, runner.ep_return, runner.update,
    )  # fmt: skip


def same_math(al, cfg, updates: int = 2) -> list[str]:
    """Runs `updates` updates of blox and raw from the same state; asserts and reports."""
    parts = al.build(cfg)
    _, raw_update, raw_tx = raw_parts(cfg, al.cartpole)
    b_runner = jax.jit(parts.init)(jax.random.key(0))
    r_runner = blox_to_raw(al, parts, b_runner, raw_tx)
    b_up, r_up = jax.jit(parts.update), jax.jit(raw_update)
    lines = []
    prefix = parts.agent.param_path("_")[:-1]
    for u in range(1, updates + 1):
        b_runner, bm = b_up(b_runner)
        r_runner, rm = r_up(r_runner)
        b_losses, r_losses = np.asarray(bm["losses"]), np.asarray(rm["losses"])
        loss_diff = float(np.max(np.abs(b_losses - r_losses)))
        w_diff = max(
            float(jnp.max(jnp.abs(b_runner.params[(*prefix, *k.split("/"))].value - v)))
            for k, v in r_runner.train.items()
        )
        stats = al_stats(parts, b_runner.params)
        s_diff = max(float(jnp.max(jnp.abs(stats[k] - r_runner.stats[k]))) for k in stats)
        b_counter = int(parts.rng.get_counter(b_runner.params))
        assert loss_diff <= 1e-5 * max(1.0, float(np.max(np.abs(r_losses)))), (u, loss_diff)
        assert w_diff <= 1e-5 and s_diff <= 1e-5, (u, w_diff, s_diff)
        assert b_counter == int(r_runner.counter), (b_counter, int(r_runner.counter))
        lines.append(
            f"update {u}: mean loss blox {float(bm['loss']):.9g}, raw {float(rm['loss']):.9g}; "
            f"max |minibatch loss diff| over the {b_losses.size} minibatches {loss_diff:.1e}; "
            f"max |weight diff| after the update {w_diff:.1e}; max |statistics diff| "
            f"{s_diff:.1e}; ratio check (max |ratio - 1| at epoch 1, minibatch 1) blox "
            f"{float(bm['ratio_err']):.1e}, raw {float(rm['ratio_err']):.1e}; Rng counter "
            f"{b_counter} both"
        )
    return lines


def al_stats(parts, params) -> dict[str, jax.Array]:
    mean, var, count = parts.agent.obs_norm.statistics(params)
    return {"running_mean": mean, "running_var": var, "count": count}


# --------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Entry:
    """A timed contender: its executable and what one call does."""

    name: str
    env_steps: int  # per call
    lower_s: float
    compile_s: float
    call: Any
    flops: float = float("nan")  # XLA's cost analysis of the optimised HLO
    copies: int = 0  # copy instructions in the optimised HLO


def compiled_entry(name: str, jitted, args: tuple, env_steps: int, out) -> Entry:
    """Lowers and compiles `jitted` at `args` (timed apart); a call runs it and returns
    ``out(result)`` to wait on."""
    t0 = time.perf_counter()
    lowered = jitted.lower(*args)
    t1 = time.perf_counter()
    exe = lowered.compile()
    t2 = time.perf_counter()
    flops = _timing.compiled_flops(exe)
    copies = len(re.findall(r"=\s*\S+\s+copy\(", exe.as_text()))
    return Entry(name, env_steps, t1 - t0, t2 - t1, lambda: out(exe(*args)), flops, copies)


def build(al, updates: int, quick: bool, dp: bool):
    """The timed entries and the pairs compared."""
    base = al.SIZES["tiny"] if quick else al.SIZES["default"]
    cfg4 = dataclasses.replace(base, num_updates=updates)
    cfg32 = dataclasses.replace(cfg4, num_envs=32)
    key = jax.random.key(0)
    entries, pairs = [], []
    for cfg in (cfg4,) if quick else (cfg4, cfg32):
        tag = f"{cfg.num_envs} envs"
        steps = updates * cfg.num_envs * cfg.num_steps
        entries.append(compiled_entry(f"blox {tag}", al.make_train(cfg), (key,), steps, _loss_of))
        entries.append(
            compiled_entry(f"raw {tag}", raw_make_train(cfg, al.cartpole), (key,), steps, _loss_of)
        )
        pairs.append(
            Pair(
                f"whole training loop, {cfg.num_envs} envs x {cfg.num_steps} steps, GRU "
                f"{cfg.hidden}, {updates} updates",
                f"blox {tag}",
                f"raw {tag}",
                TARGET,
            )
        )
    if dp:
        keys = jax.vmap(jax.random.key)(jnp.arange(1, dtype=jnp.uint32))
        cfg_dp = cfg4 if quick else cfg32
        steps = updates * cfg_dp.num_envs * cfg_dp.num_steps
        for d in (1, DP_DEVICES):
            prog = al.program(dataclasses.replace(cfg_dp, data_parallel=d))
            runner = prog.init(keys)
            chunk = _StaticChunk(prog.chunk, updates)
            entries.append(compiled_entry(f"anakin {d}", chunk, (runner,), steps, _loss_of))
        pairs.append(
            Pair(
                f"Anakin over {DP_DEVICES} simulated devices / 1 device, {cfg_dp.num_envs} envs",
                f"anakin {DP_DEVICES}",
                "anakin 1",
                None,
            )
        )
    return entries, pairs


class _StaticChunk:
    """``prog.chunk`` with its static update count bound, so it lowers like one-arg jit."""

    def __init__(self, chunk, n: int):
        self.chunk, self.n = chunk, n

    def lower(self, runner):
        return self.chunk.lower(runner, self.n)


def _loss_of(result):
    return result[1]["loss"]


def sebulba_note(al) -> str | None:
    """None when the example runs Sebulba (its ``sebulba`` function), else why the rows
    are skipped."""
    if hasattr(al, "sebulba"):
        return None
    return (
        "Sebulba: skipped, `examples/actor_learner.py` has no `sebulba` layout "
        "(`--actor-devices` / `--learner-devices`) yet."
    )


ACTORS, LEARNERS = 1, 4
SEBULBA_MIN_UPDATES = 3  # the first update compiles: at least two steady ones


def sebulba_rows(al, cfg, updates: int) -> list[list[str]]:
    """One Sebulba run per policy lag (``al.sebulba``: 1 actor device, 4 learner devices),
    `updates` updates, waiting for each update's loss as the example's CLI does. The
    first update includes compilation; the steady rate is over the updates after it."""
    devices = jax.devices()
    cfg = dataclasses.replace(cfg, num_updates=updates)
    steps = cfg.num_envs * cfg.num_steps
    rows = []
    actors, learners = devices[:ACTORS], devices[ACTORS : ACTORS + LEARNERS]
    for lag in (0, 1):
        t0 = time.perf_counter()
        done = []
        if hasattr(al, "sebulba_start"):  # sebulba(cfg, state, ...) from sebulba_start
            run = al.sebulba(cfg, al.sebulba_start(cfg, 0, actors, learners), actors,
                             learners, lag)  # fmt: skip
        else:
            run = al.sebulba(cfg, 0, actors, learners, lag)
        for item in run:
            jax.block_until_ready(item[1]["loss"])
            done.append(time.perf_counter())
        steady = (done[-1] - done[0]) / (len(done) - 1)
        rows.append(
            [
                f"Sebulba, {ACTORS} actor + {LEARNERS} learner devices, policy lag {lag}, "
                f"{cfg.num_envs} envs",
                f"{done[0] - t0:.1f}",
                f"{steady:.3f}",
                f"{steps / steady:,.0f}",
            ]
        )
        log(f"   sebulba lag {lag}: first update {done[0] - t0:.1f}s, {steady:.3f} s/update")
    return rows


# --------------------------------------------------------------------------- report


def anchor_lines() -> list[str]:
    """The PureJaxRL anchor's summary from its JSON (run apart, see the docstring)."""
    if not ANCHOR.exists():
        return ["PureJaxRL anchor: no `benchmarks/results/rl_anchor_purejaxrl.json` yet."]
    a = json.loads(ANCHOR.read_text())
    finals = ", ".join(f"{v:.1f}" for v in a["final_return_per_seed"])
    return [
        "### Recurrent anchor: PureJaxRL `ppo_rnn.py` on this machine",
        "",
        f"From `benchmarks/results/rl_anchor_purejaxrl.json` ({a['date']}; not rerun by "
        f"this script): {a['what']}. Patched only for API changes: "
        + "; ".join(a["patches"])
        + ". Versions: "
        + ", ".join(f"{k} {v}" for k, v in a["versions"].items())
        + f". Mode: {a['mode']}.",
        "",
        _timing.format_table(
            [
                "env steps per seed",
                "final return per seed",
                "median",
                "compile s",
                "run s",
                "env steps/s (all seeds)",
            ],
            [
                [
                    a["env_steps"],
                    finals,
                    f"{a['median_final_return']:.1f}",
                    a["compile_s"],
                    a["run_s"],
                    a["env_steps_per_s_all_seeds"],
                ]
            ],
        ),  # fmt: skip
        "",
        f"Final return: {a['final_definition']}. The JSON holds each seed's curve "
        f"({a['curve_definition']}).",
        *reach_line(a),
        "",
    ]


def reach_line(a: dict) -> list[str]:
    """When the anchor's 10-update mean return first reaches 475, per seed."""
    if "reach_475_env_steps" not in a:
        return []
    reach = ", ".join("never" if r is None else f"{r:,}" for r in a["reach_475_env_steps"])
    return ["", f"First reaches 475 ({a['reach_475_definition']}): {reach}."]


def render(env, command, started, counts, quick, cfg, entries, pairs, checks, notes, seb):
    updates = cfg.num_updates
    by_name = {e.name: e for e in entries}
    header = ["workload", "blox s/call", "raw s/call", "blox env steps/s", "raw env steps/s"]
    header += ["min-based ratio blox/raw", "median ratio"]
    header += ["per-round ratios (min - max)", "target", "verdict"]
    rows, dp_rows = [], []
    for p in pairs:
        num, den = by_name[p.numerator], by_name[p.denominator]
        num_s, den_s = p.num_us / 1e6, p.den_us / 1e6
        if p.target is None:
            dp_rows.append(
                [
                    p.name,
                    f"{den_s:.2f}",
                    f"{num_s:.2f}",
                    f"{den.env_steps / den_s:,.0f}",
                    f"{num.env_steps / num_s:,.0f}",
                    f"**{p.median_ratio:.3f}x**",
                    f"{min(p.round_ratios):.3f} - {max(p.round_ratios):.3f}",
                ]
            )
            continue
        verdict = "PASS" if p.min_ratio <= p.target else "FAIL"
        rows.append(
            [
                p.name,
                f"{num_s:.2f}",
                f"{den_s:.2f}",
                f"{num.env_steps / num_s:,.0f}",
                f"{den.env_steps / den_s:,.0f}",
                f"**{p.min_ratio:.3f}x**",
                f"{p.median_ratio:.3f}x",
                f"{min(p.round_ratios):.3f} - {max(p.round_ratios):.3f}",
                f"<= {p.target:.2f}x (min-based)",
                verdict,
            ]
        )
    lines = [
        *_timing.report_head(
            "RL: recurrent PPO training loop, blox vs raw JAX",
            env,
            started,
            command,
            counts,
            "tiny sizes, numbers meaningless" if quick else None,
        ),
        "blox: `examples/actor_learner.py`'s `make_train(cfg)` (recurrent PPO, GRU, on the "
        "JAX CartPole-v1 of `examples/cartpole.py`): init, then `lax.scan` over updates of "
        "a rollout scan (`vmap` over environments) and the PPO epochs and minibatches, all "
        "under one `jax.jit`. Raw: the same math on `{str: array}` dicts, PureJaxRL style "
        "(`raw_make_train` in `benchmarks/rl_speed.py`: a hand-written GRU, dense layers, "
        "running observation statistics, `fold_in(seed, counter)` keys, GAE, the PPO "
        "loss), on the same environment. Hyperparameters: the example's "
        f"`--size {'tiny' if quick else 'default'}` (lr {cfg.lr:g}"
        f"{' annealed linearly' if cfg.anneal_lr else ''}, {cfg.update_epochs} epochs x "
        f"{cfg.num_minibatches} minibatches, GRU {cfg.hidden}), "
        f"{updates} updates per call (`--updates`); one call is a whole training run from "
        "the same key. Env steps/s = env steps per call / median per-call time; the ratio "
        "blox/raw of per-call times (same round) is raw's env steps/s over blox's. The "
        "target is on the *min-based ratio* (the median over rounds of the ratio of "
        "per-round minima): calls of seconds on 2 cores shared with other jobs (load "
        "average 9 to 11 in these runs) draw load bursts that the per-round minimum "
        "filters; the *median ratio* uses per-round medians.",
        "",
        _timing.format_table(header, rows),
        "",
    ]
    if dp_rows:
        lines += [
            "### Anakin on 1 and 8 devices",
            "",
            "The example's `program(cfg)` (`jax.vmap` over one seed; 8 devices: "
            "`jax.shard_map` over 8 simulated CPU devices, the environments split over "
            "them, gradients and minibatch statistics averaged with `pmean`), one chunk "
            f"of {updates} updates per call, run state from `program(cfg).init`. The 8 "
            f"simulated devices share this machine's {env['nproc']} cores, so the row "
            "measures what the layout costs (collectives, smaller per-device work), not a "
            "speed-up.",
            "",
            _timing.format_table(
                [
                    "layout",
                    "1 device s/call",
                    "8 devices s/call",
                    "1 device env steps/s",
                    "8 devices env steps/s",
                    "8 / 1 time ratio (median of rounds)",
                    "per-round ratios (min - max)",
                ],
                dp_rows,
            ),  # fmt: skip
            "",
        ]
    if seb:
        seb_updates = max(updates, SEBULBA_MIN_UPDATES)
        anakin1 = next((e for e in entries if e.name == "anakin 1"), None)
        per_update = ""
        if anakin1 is not None:
            p1 = next(p for p in pairs if p.denominator == "anakin 1")
            per_update = (
                f" For comparison, Anakin on 1 device above: {p1.den_us / 1e6 / updates:.3f} "
                f"s/update ({anakin1.env_steps / (p1.den_us / 1e6):,.0f} env steps/s), "
                "measured in the rounds, not beside these runs."
            )
        lines += [
            "### Sebulba",
            "",
            "The example's `sebulba(cfg, sebulba_start(...), actor_devices, learner_devices, "
            "lag)`: the "
            "actor (a `jax.jit` rollout) on simulated device 0, the learner (`shard_map` of "
            "the same `learn`) on a mesh of devices 1-4; each update moves the rollout to "
            "the learner mesh and pushes the weights back with `bp.place`, driven from "
            "Python, waiting for each update's loss as the example's command line does. "
            f"One run of {seb_updates} updates per lag, after the timed rounds; the first "
            "update includes compiling where JAX's caches miss (the lag-1 run finds most "
            "of the lag-0 run's functions compiled), the steady rate is over the updates "
            "after it." + per_update,
            "",
            _timing.format_table(
                [
                    "layout",
                    "first update s (with compile)",
                    "steady s/update",
                    "steady env steps/s",
                ],
                seb,
            ),  # fmt: skip
            "",
        ]
    lines += [
        "### Compile time (apart from the timed calls)",
        "",
        _timing.format_table(
            ["contender", "trace + lower s", "compile s", "optimised-HLO FLOPs", "copy ops"],
            [
                [e.name, f"{e.lower_s:.1f}", f"{e.compile_s:.1f}", f"{e.flops:.0f}", e.copies]
                for e in entries
            ],
        ),
        "",
        "FLOPs from `compile().cost_analysis()['flops']` (XLA counts a loop body once, "
        "so these are per-iteration sums, comparable between blox and raw of one size); "
        "copy ops: `copy(` instructions in `compile().as_text()`.",
        "",
        *[n for n in notes],
        "",
        *_timing.same_math_section(checks),
        *anchor_lines(),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    COUNTS.add_to(ap, quick_help="tiny sizes, 2 updates, no 32-env pair (smoke test)")
    ap.add_argument("--updates", type=int, default=None, help="updates per call (default 20)")
    ap.add_argument("--no-dp", action="store_true", help="skip the Anakin 1 / 8 device rows")
    args = ap.parse_args(argv)
    counts = COUNTS.resolve(ap, args)
    updates = args.updates or (2 if args.quick else 20)
    started, env, command = _timing.start_run("blox RL training-loop speed")
    if not (ROOT / "examples" / "actor_learner.py").exists():
        log("skipped: examples/actor_learner.py (the blox side) is not in this checkout")
        return 0
    al = load_example()
    t0 = time.perf_counter()
    checks = same_math(al, al.SIZES["tiny"] if args.quick else al.SIZES["default"])
    for c in checks:
        log(f"   {c}")
    log(f"same-math checks in {time.perf_counter() - t0:.1f}s")
    dp = not args.no_dp and len(jax.devices()) >= DP_DEVICES
    notes = []
    if not dp:
        notes.append(
            f"Anakin 1 / {DP_DEVICES} devices: skipped ({len(jax.devices())} devices"
            + (", --no-dp" if args.no_dp else "")
            + ")."
        )
    note = sebulba_note(al)
    if note:
        notes.append(note)
        log(note)
    t0 = time.perf_counter()
    entries, pairs = build(al, updates, args.quick, dp)
    for e in entries:
        log(f"   {e.name}: trace + lower {e.lower_s:.1f}s, compile {e.compile_s:.1f}s")
    log(f"built in {time.perf_counter() - t0:.1f}s")
    contenders = [Contender(e.name, e.call) for e in entries]
    results = _timing.run_rounds(contenders, *counts)
    pairs = _timing.compare_and_log(results, pairs)
    seb = []
    if dp and note is None:
        base = al.SIZES["tiny"] if args.quick else al.SIZES["default"]
        try:
            seb = sebulba_rows(
                al,
                base if args.quick else dataclasses.replace(base, num_envs=32),
                max(updates, SEBULBA_MIN_UPDATES),
            )
        except Exception as err:  # the example's API moved: report, keep the timings
            notes.append(f"Sebulba: failed ({type(err).__name__}: {err}).")
            log(notes[-1])
    size = al.SIZES["tiny"] if args.quick else al.SIZES["default"]
    cfg = dataclasses.replace(size, num_updates=updates)
    report = render(
        env, command, started, counts, args.quick, cfg, entries, pairs, checks, notes, seb
    )
    _timing.publish(report, args.out, "rl_speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
