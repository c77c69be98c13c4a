"""Core overhead of blox against raw JAX on a plain ``{str: array}`` dict.

Run (``make bench``)::

    .venv/bin/python benchmarks/core_overhead.py --out docs/benchmarks.md

Every workload pits a blox version against a raw-JAX version with the same math
(checked before timing: equal first losses, equal weights after one Adam step, equal
optimised-HLO FLOPs reported). Timing is same-round: each round times every
contender (one call of each in turn, in a fresh random order per cycle), and the
reported figure is the median over rounds of the per-round ratio of median per-call
times; see `_timing.py`.

Workloads live in a small registry (`WORKLOADS`); add one with the `workload`
decorator. The builders themselves are in `_workloads.py` and take the library
module as an argument, so that ``jax_blox_peer.py`` runs the very same code against
jax-blox 0.1.6 in a separate interpreter (``--peer``; default: ``.venv-bench`` if it
has jax-blox). jax-blox's import name is also ``blox``: it is never imported here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import _timing
import _workloads
from _timing import CountArgs, log
from _workloads import Built, Config, Outcome

import blox as bx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COUNTS = CountArgs(steps=300, warmup=30, quick_steps=5, quick_warmup=2)


# ---------------------------------------------------------------------------
# Workload registry
# ---------------------------------------------------------------------------


@dataclass
class Workload:
    key: str
    title: str
    build: Callable[[Config], Built]


WORKLOADS: dict[str, Workload] = {}


def workload(key: str, title: str):
    """Registers ``build(cfg) -> Built`` under `key`."""

    def register(build: Callable[[Config], Built]) -> Callable[[Config], Built]:
        WORKLOADS[key] = Workload(key, title, build)
        return build

    return register


@workload("(a)", "tiny MLP 32->64->64->10 (bx.MLP), batch 32, MSE, Adam step")
def mlp_workload(cfg: Config) -> Built:
    return _workloads.build_mlp(bx, bx.MLP, target=1.05)


@workload("(b)", "64 bx.Linear children of width 32 (128 param leaves), batch 32, Adam step")
def deep_workload(cfg: Config) -> Built:
    return _workloads.build_deep(bx, cfg, target=1.10)


@workload("(c)", "jax.jit(identity) on 384 leaves: Params vs dict[str, array]")
def roundtrip_workload(cfg: Config) -> Built:
    return _workloads.build_roundtrip(bx, 24 if cfg.quick else 384, cfg, target=1.0)


# ---------------------------------------------------------------------------
# jax-blox peer (separate interpreter)
# ---------------------------------------------------------------------------


def run_peer(python: str, cfg: Config, only: str | None) -> dict | None:
    """Runs ``jax_blox_peer.py`` under `python`; returns its JSON report (or None)."""
    script = os.path.join(REPO, "benchmarks", "jax_blox_peer.py")
    cmd = [python, script, "--rounds", str(cfg.rounds), "--steps", str(cfg.steps)]
    cmd += ["--warmup", str(cfg.warmup)]
    if cfg.quick:
        cmd.append("--quick")
    if not cfg.interleave:
        cmd.append("--blocked")
    if only:
        cmd += ["--only", only]
    shown = " ".join(os.path.relpath(c, REPO) if c.startswith(REPO) else c for c in cmd)
    log(f"\n== peer (separate process): {shown}")
    try:
        # Progress goes to stderr (inherited); the JSON report is the last stdout line.
        res = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=3600, cwd=REPO)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"peer failed: {e}")
        return None
    if res.returncode:
        log(f"peer exited with {res.returncode}; skipped")
        return None
    report = json.loads(res.stdout.strip().splitlines()[-1])
    report["command"] = shown
    return report


def peer_python(arg: str) -> str | None:
    if arg == "off":
        return None
    path = os.path.join(REPO, ".venv-bench", "bin", "python") if arg == "auto" else arg
    if not os.path.exists(path):
        return None
    ok = subprocess.run(
        [path, "-c", "import importlib.metadata as m; m.version('jax-blox')"],
        capture_output=True,
        cwd="/",
    )
    return path if ok.returncode == 0 else None


# ---------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    COUNTS.add_to(ap, quick_help="tiny sizes and counts (smoke test)")
    ap.add_argument(
        "--blocked",
        action="store_true",
        help="time each contender's calls as one block per round (default: interleaved)",
    )
    ap.add_argument("--only", default=None, help="comma-separated workload keys, e.g. '(a),(c)'")
    ap.add_argument(
        "--peer",
        default="auto",
        help="python of a venv with jax-blox 0.1.6 ('auto': .venv-bench if usable; 'off')",
    )
    args = ap.parse_args(argv)
    cfg = Config(*COUNTS.resolve(ap, args), quick=args.quick, interleave=not args.blocked)
    started, env, command = _timing.start_run("blox core overhead")
    log(
        f"{env['nproc']} CPUs ({env['cpu']}), {env['backend']}; jax {env['jax']}; "
        f"rounds={cfg.rounds} steps={cfg.steps} warmup={cfg.warmup}"
    )

    only = [s.strip() for s in args.only.split(",")] if args.only else None
    out = Outcome()
    for w in WORKLOADS.values():
        if only is not None and w.key not in only:
            continue
        t0 = time.perf_counter()
        log(f"\n== {w.key} {w.title}")
        built = w.build(cfg)
        log(f"   built and checked in {time.perf_counter() - t0:.1f}s")
        _workloads.run(built, cfg, out, log)
        log(f"   done in {time.perf_counter() - t0:.1f}s")

    peer = None
    py = peer_python(args.peer)
    if py is not None:
        peer = run_peer(py, cfg, args.only)
    elif args.peer not in ("auto", "off"):
        log(f"peer python {args.peer!r} has no jax-blox; skipped")

    report = render(env, command, started, cfg, out, peer)
    _timing.publish(report, args.out, "core_overhead")
    return 0


def _pairs_table(pairs, lib: str, with_target: bool) -> str:
    header = [
        "workload",
        f"{lib} us/call",
        "reference us/call",
        "ratio (median of rounds)",
        "min-based ratio",
        "per-round ratios (min - max)",
    ]
    if with_target:
        header += ["target", "verdict"]
    rows = [_timing.ratio_row(p, with_target=with_target) for p in pairs]
    return _timing.format_table(header, rows)


def _micro_table(micros, lib: str, with_target: bool) -> str:
    header = ["operation", f"{lib} Params us/leaf", "dict us/leaf", "Params / dict"]
    if with_target:
        header += ["target", "verdict"]
    rows = []
    for m in micros:
        row = [m.name, f"{m.lib_us:.4f}", f"{m.dict_us:.4f}", f"{m.lib_us / m.dict_us:.2f}x"]
        if with_target:
            row += [f"<= {m.target} us/leaf", m.verdict]
        rows.append(row)
    return _timing.format_table(header, rows)


def render(env, command, started, cfg: Config, out: Outcome, peer: dict | None) -> str:
    mode = (
        "interleaved (one call of each contender per cycle, in a fresh seeded random order "
        "every cycle)"
        if cfg.interleave
        else "blocked (each contender's calls in one block)"
    )
    lines = [
        "## Core overhead: blox vs raw JAX",
        "",
        *_timing.run_header(env, started, command),
        _timing.counts_bullet(
            cfg.rounds,
            cfg.steps,
            cfg.warmup,
            mode,
            "sizes shrunk, numbers meaningless" if cfg.quick else None,
        ),
        "",
        "Method: in each round every contender is timed. Interleaved, each cycle runs one "
        "call of every contender in a fresh random order, so that no contender always runs "
        "after the same other one (a fixed order made a donated step that always followed "
        "a non-donated one read 5 % slow). Each call is timed alone and waits "
        "(`block_until_ready`) for its output "
        "(the loss for train steps, one leaf for the round trip). A round's figure per "
        "contender is its median (and min) per-call time; the *ratio* is the median over "
        "rounds of the same-round ratio blox / reference, the *min-based ratio* the median "
        "over rounds of the ratio of per-round minima. Both sides do the same math: the "
        "first losses and the weights after one Adam step are asserted equal (to 1e-6) "
        "before timing, and the optimised-HLO FLOPs are reported below. The blox train "
        "step is the documented pattern (`t, nt = params.split()`; "
        "`value_and_grad(loss_fn, has_aux=True)(t, nt)`; `tx.update(g, opt, t)`; "
        "`t.merge(nt2)`), initialised by `rng.seed`, one forward pass and `.locked()`; the "
        "raw step is `value_and_grad` on a `{str: array}` dict holding the same initial "
        "values. Donated variants use `jax.jit(step, donate_argnums=(0, 1))`.",
        "",
        "### Step-time ratios",
        "",
        _pairs_table(out.pairs, "blox", with_target=True),
        "",
        "us/call: median over rounds of the per-round median. Reference: raw JAX on a dict "
        "for (a) and (b), a `dict[str, array]` for (c). *diag* rows locate the gap: the "
        "blox params also carry the `bx.Rng` state (the seed as uint32 key data and a uint32 "
        'counter) that the raw dict does not; "raw passing the same Rng leaves" threads '
        'those two arrays through the raw step too, "blox without Rng leaves" drops them '
        "from the blox params.",
        "",
    ]
    if out.micros:
        lines += [
            "### Pytree flatten / unflatten (pure Python, per leaf)",
            "",
            _micro_table(out.micros, "blox", with_target=True),
            "",
            "`jax.tree_util.tree_flatten` / `tree_unflatten` of the (c) trees; median over "
            "rounds of the best-of-5 mean.",
            "",
        ]
    if out.flops:
        lines += [
            "### Optimised-HLO FLOPs of the train step",
            "",
            _timing.format_table(
                ["workload", "blox FLOPs", "raw FLOPs", "equal"],
                [[k, f"{b:.0f}", f"{r:.0f}", "yes" if b == r else "NO"] for k, b, r in out.flops],
            ),
            "",
            "From `jax.jit(step).lower(*args).compile().cost_analysis()['flops']`.",
            "",
        ]
    lines += _timing.same_math_section(out.checks)
    if peer is not None:
        lines += render_peer(peer)
    return "\n".join(lines)


def render_peer(peer: dict) -> list[str]:
    res = Outcome.from_json(peer["outcome"])
    lines = [
        f"### Peer: jax-blox {peer['version']} vs raw JAX (separate process)",
        "",
        f"Run by `{peer['command']}` right after the run above, in its own venv (Python "
        f"{peer['python']}, jax {peer['jax']}, optax {peer['optax']}), with the same "
        "workload code (`benchmarks/_workloads.py`, the library passed in as a module), the "
        "same raw-JAX reference and the same method. jax-blox has no `MLP`, so (a) is the "
        "same three `Linear` children built by hand. Its ratios are to raw JAX in *its* "
        "process: compare them with the blox ratios above, not the absolute times.",
        "",
        _pairs_table(res.pairs, "jax-blox", with_target=False),
        "",
    ]
    if res.micros:
        lines += [_micro_table(res.micros, "jax-blox", with_target=False), ""]
    lines += [f"- {c}" for c in res.checks] + [""]
    return lines


if __name__ == "__main__":
    sys.exit(main())
