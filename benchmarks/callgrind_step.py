"""Instructions per train step, blox vs raw JAX, counted by valgrind's callgrind.

Wall-clock ratios on a shared 2-core machine swing by several percent with the contender
mix; instruction counts do not depend on what else runs. This script is the program
valgrind runs: it builds the tiny-MLP Adam step of ``core_overhead.py`` (a), donated,
runs 20 warm-up steps and then ``N`` more. Per-step instructions are the difference of
two runs (N and 0), which cancels import, tracing and compilation::

    for w in blox raw; do for n in 0 1000; do
      XLA_FLAGS=--xla_cpu_multi_thread_eigen=false valgrind --tool=callgrind \\
        --callgrind-out-file=/tmp/cg.$w.$n .venv/bin/python benchmarks/callgrind_step.py $w $n
    done; done
    grep -h '^summary:' /tmp/cg.*   # per step = (summary at 1000 - summary at 0) / 1000
"""

from __future__ import annotations

import sys

import _raw
import _workloads
import jax
import optax

import blox as bx


def main(which: str, n: int) -> None:
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
        state = [params, tx.init(params.split()[0])]
    elif which == "raw":
        raw = {
            f"{a}/{w}": params[("net", "mlp", a, w)].value
            for a in names
            for w in ("kernel", "bias")
        }
        step = jax.jit(_raw.train_step(names, tx), donate_argnums=(0, 1))
        state = [raw, tx.init(raw)]
    else:
        raise SystemExit(f"first argument must be 'blox' or 'raw', got {which!r}")
    for _ in range(20 + n):
        state[0], state[1], loss = step(state[0], state[1], x, y)
        loss.block_until_ready()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
