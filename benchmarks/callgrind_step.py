"""Instructions per train step, blox vs raw JAX, counted by valgrind's callgrind.

Wall-clock ratios on a shared 2-core machine swing by several percent with the contender
mix; instruction counts do not depend on what else runs. This script is the program
valgrind runs: it builds a donated Adam train step, runs 20 warm-up steps and then ``N``
more. Per-step instructions are the difference of two runs (N and 0), which cancels
import, tracing and compilation::

    for w in blox raw; do for n in 0 1000; do
      XLA_FLAGS=--xla_cpu_multi_thread_eigen=false valgrind --tool=callgrind \\
        --callgrind-out-file=/tmp/cg.$w.$n .venv/bin/python benchmarks/callgrind_step.py $w $n
    done; done
    grep -h '^summary:' /tmp/cg.*   # per step = (summary at 1000 - summary at 0) / 1000

The optional third argument picks the workload: ``mlp`` (default: the tiny-MLP step of
``core_overhead.py`` (a)) or ``lstm`` (the LSTM B=16 T=200 + dense head step of
``layers_speed.py``; a step costs about 10^8 instructions, so N = 20 is enough).
"""

from __future__ import annotations

import sys

import _raw
import _workloads
import jax
import optax

import blox as bx


def mlp_steps(which: str):
    """``(step, state, x, y)`` of the tiny-MLP step (a) for `which` = blox or raw."""
    tx = optax.adam(1e-3)
    x, y = _raw.batch(32, 32, 10)
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    model = bx.MLP(g / "mlp", [64, 64, 10], rng)
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, x)
    params = params.locked()
    names = [f"linear_{i}" for i in range(3)]
    if which == "blox":
        step = jax.jit(_workloads.split_merge_step(model, tx), donate_argnums=(0, 1))
        return step, [params, tx.init(params.split()[0])], x, y
    raw = {
        f"{a}/{w}": params[("net", "mlp", a, w)].value for a in names for w in ("kernel", "bias")
    }
    step = jax.jit(_raw.train_step(names, tx), donate_argnums=(0, 1))
    return step, [raw, tx.init(raw)], x, y


def lstm_steps(which: str):
    """``(step, state, x, y)`` of the LSTM step of ``layers_speed.py`` (full size)."""
    import layers_speed

    model, params, raw, _, x, y, tx = layers_speed.lstm_workload(200)
    if which == "blox":
        step = jax.jit(_workloads.split_merge_step(model, tx), donate_argnums=(0, 1))
        return step, [params, tx.init(params.split()[0])], x, y
    step = jax.jit(layers_speed.raw_step(tx), donate_argnums=(0, 1))
    return step, [raw, tx.init(raw)], x, y


WORKLOADS = {"mlp": mlp_steps, "lstm": lstm_steps}


def main(which: str, n: int, workload: str = "mlp") -> None:
    if which not in ("blox", "raw"):
        raise SystemExit(f"first argument must be 'blox' or 'raw', got {which!r}")
    if workload not in WORKLOADS:
        raise SystemExit(f"third argument must be one of {sorted(WORKLOADS)}, got {workload!r}")
    step, state, x, y = WORKLOADS[workload](which)
    for _ in range(20 + n):
        state[0], state[1], loss = step(state[0], state[1], x, y)
        loss.block_until_ready()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *sys.argv[3:4])
