"""Context parallelism: ring and all-gather attention on 8 devices vs one device.

Run::

    .venv/bin/python benchmarks/context_speed.py --out docs/benchmarks.md

On CPU the script simulates 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``).

Causal self-attention, B=1, N=2 heads (K=2), H=16, float32, forward and backward (the
gradients of ``sum(out * c)`` with respect to q, k, v), at T in {1k, 2k, 4k, 8k, 16k}:

- one device: ``jax.nn.dot_product_attention`` (what `MultiHeadAttention` calls) on the
  whole sequence, timed while its compiled temporaries fit the memory budget;
- ring: ``bp.ring_attention`` inside ``jax.shard_map`` over a ``context`` axis of C=8,
  the sequence in the head-tail layout (positions passed, blocks above the diagonal
  skipped);
- all-gather: ``bp.allgather_attention``, same layout.

Per-device temporaries come from ``compiled.memory_analysis().temp_size_in_bytes``
(compiled with the CPU fusion emitters on, as users compile). Before timing, the script
asserts that the ring and the all-gather outputs and gradients equal the one-device ones
at the smallest T. The 8 simulated devices share this machine's cores: the times show
the extra work of the split (and the block skipping), not the overlap of transfers with
compute that real devices give.
"""

from __future__ import annotations

import argparse
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    )

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _timing  # noqa: E402
from _timing import Contender, CountArgs, log  # noqa: E402

from blox import parallel as bp  # noqa: E402

COUNTS = CountArgs(steps=2, warmup=1, quick_steps=1, quick_warmup=1, rounds=3, quick_rounds=1)
C, B, N, K, H = 8, 1, 2, 2, 16
BUDGET = 4 << 30  # bytes of temporaries (all devices together) a timed contender may need
OPTS = {"xla_cpu_use_fusion_emitters": True}


def _grad(f):
    def step(q, k, v, c):
        loss = lambda q, k, v: jnp.sum(f(q, k, v) * c)  # noqa: E731
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    return jax.jit(step)


def build(t: int, mesh):
    """The three fwd+bwd steps at sequence length t, their compiled temporaries, inputs."""
    ks = jax.random.split(jax.random.key(t), 4)
    q = jax.random.normal(ks[0], (B, t, N, H))
    k, v = (jax.random.normal(kk, (B, t, K, H)) for kk in ks[1:3])
    c = jax.random.normal(ks[3], (B, t, N, H))
    one = _grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True))
    seq, pspec = P(None, "context"), P("context")
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    pos = put(bp.balance_sequence(jnp.arange(t, dtype=jnp.int32), C, axis=0), pspec)
    bal = [put(bp.balance_sequence(a, C), seq) for a in (q, k, v, c)]

    def sharded(fn):
        def attend(q, k, v, pos):
            return fn(q, k, v, axis="context", causal=True, positions=pos)

        sm = jax.shard_map(attend, mesh=mesh, in_specs=(seq, seq, seq, pspec), out_specs=seq)
        step = _grad(lambda q, k, v: sm(q, k, v, pos))
        return step

    steps = {"one": (one, (q, k, v, c)), "ring": (sharded(bp.ring_attention), bal),
             "allgather": (sharded(bp.allgather_attention), bal)}  # fmt: skip
    temps = {}
    for name, (f, args) in steps.items():
        compiled = f.lower(*args).compile(compiler_options=OPTS)
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
    local = jax.ShapeDtypeStruct((B, t // C, N, H), jnp.float32)
    lk = jax.ShapeDtypeStruct((B, t // C, K, H), jnp.float32)
    compiled = one.lower(local, lk, lk, local).compile(compiler_options=OPTS)
    temps["one at T/C"] = compiled.memory_analysis().temp_size_in_bytes
    return steps, temps


def check_same_math(steps) -> str:
    one, args = steps["one"]
    want = one(*args)
    worst = 0.0
    for name in ("ring", "allgather"):
        f, bal = steps[name]
        got = [bp.unbalance_sequence(np.asarray(g), C) for g in f(*bal)]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, np.asarray(w), rtol=1e-4, atol=1e-5, err_msg=name)
            worst = max(worst, float(np.max(np.abs(g - np.asarray(w)))))
    return (
        f"T = {args[0].shape[1]}: ring and all-gather dQ, dK, dV equal the one-device "
        f"gradients (max |diff| {worst:.1e})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    COUNTS.add_to(ap, quick_help="T in {1k, 2k} only (smoke test)")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    args = ap.parse_args(argv)
    rounds, steps_n, warmup = COUNTS.resolve(ap, args)
    started, env, command = _timing.start_run("blox context parallel speed")
    if len(jax.devices()) < C:
        log(f"needs {C} devices")
        return 1
    mesh = bp.make_mesh((C,), ("context",))
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.quick:
        lengths = lengths[:2]
    rows, checks = [], []
    mb = lambda b: f"{b / 2**20:,.1f}"  # noqa: E731
    for t in lengths:
        steps, temps = build(t, mesh)
        if not checks:
            checks.append(check_same_math(steps))
            log(checks[-1])
        fits = {
            "one": temps["one"] <= BUDGET,
            "ring": C * temps["ring"] <= BUDGET,
            "allgather": C * temps["allgather"] <= BUDGET,
        }
        contenders = [
            Contender(name, lambda f=f, a=a: f(*a)[0])
            for name, (f, a) in steps.items()
            if fits[name]
        ]
        results = _timing.run_rounds(contenders, rounds, steps_n, warmup)
        med = {c.name: float(np.median([r[c.name].min for r in results])) for c in contenders}

        def ratio(name, med=med, results=results):
            if name not in med or "one" not in med:
                return "-"
            per = [r[name].min / r["one"].min for r in results]
            return f"{np.median(per):.2f}x"

        sec = lambda name, med=med: f"{med[name]:.3f}" if name in med else "does not fit"  # noqa: E731
        row = [
            f"{t:,}", sec("one"), sec("ring"), sec("allgather"), ratio("ring"),
            ratio("allgather"), mb(temps["one"]), mb(temps["ring"]), mb(temps["allgather"]),
            f"{temps['ring'] / temps['one at T/C']:.2f}x",
        ]  # fmt: skip
        log(" | ".join(row))
        rows.append(row)
    header = [
        "T", "one device s/step", "ring C=8 s/step", "all-gather C=8 s/step",
        "ring / one", "all-gather / one", "one device temp MiB", "ring temp MiB/device",
        "all-gather temp MiB/device", "ring temp / one device's at T/C",
    ]  # fmt: skip
    quick = "T in {1k, 2k} only, numbers meaningless" if args.quick else None
    lines = [
        *_timing.report_head(
            "Context parallelism: ring and all-gather attention vs one device",
            env,
            started,
            command,
            _timing.Counts(rounds, steps_n, warmup),
            quick,
        ),
        f"Causal self-attention, B={B}, {N} heads (K={K}), H={H}, float32, forward + "
        "gradients of `sum(out * c)` with respect to q, k, v. One device: "
        "`jax.nn.dot_product_attention` on the whole sequence. Ring and all-gather: "
        f"`bp.ring_attention` / `bp.allgather_attention` in `jax.shard_map` over a "
        f"`context` axis of C={C} simulated CPU devices, the sequence in the head-tail "
        "layout (`bp.balance_sequence`, global positions passed, so the ring skips the "
        "blocks above the diagonal: 17 of 32 block pairs computed per device). s/step: "
        "median over rounds of the per-round minimum; ratios: median over rounds of "
        "same-round minima. Temporaries: `compile().memory_analysis().temp_size_in_bytes` "
        "per device (fusion emitters on); the last column compares the ring at T with one "
        f"device at T/C. A contender whose temporaries (all devices together) exceed "
        f"{BUDGET >> 30} GiB is not timed ('does not fit').",
        "",
        _timing.format_table(header, rows),
        "",
        f"The {C} simulated devices share this machine's {env['nproc']} cores, so a ring "
        "or all-gather time is the total work of all devices plus the split's overhead "
        "(the permutes and gathers are memory copies): it shows the extra work, not the "
        "overlap of transfers with compute, nor the C-fold speed-up, that real devices "
        "give. The ring beats one device here because it computes 17 of the 32 block pairs "
        "per device (the causal skipping) on cache-sized blocks, whereas "
        "`jax.nn.dot_product_attention` on XLA:CPU computes the whole masked (T, T) "
        "logits and keeps (T, T) arrays for the backward (its temp column); the all-gather "
        "variant computes the whole masked (T/C, T) logits on each device, the same total "
        "as one device.",
        "",
        *_timing.same_math_section(checks),
    ]
    _timing.publish("\n".join(lines), args.out, "context_speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
