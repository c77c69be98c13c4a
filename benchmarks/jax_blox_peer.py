"""The core-overhead workloads for jax-blox 0.1.6, as a peer to blox.

Run by ``core_overhead.py --peer`` in a *separate* venv where jax-blox is installed
(jax-blox's import name is also ``blox``, so it must never share a process or venv
with this repository's blox), e.g.::

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install jax==0.10.2 optax jax-blox==0.1.6
    .venv-bench/bin/python benchmarks/jax_blox_peer.py --rounds 10 --steps 300

Progress goes to stderr; the last stdout line is a JSON report. The workload code
is shared with blox (`_workloads.py`), so both libraries run the same steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
from importlib import metadata

import _workloads
from _workloads import Config, Outcome

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def import_jax_blox():
    """Imports jax-blox's ``blox``, refusing this repository's package."""
    try:
        version = metadata.version("jax-blox")
    except metadata.PackageNotFoundError:
        raise SystemExit("jax-blox is not installed in this interpreter's environment") from None
    import blox

    where = os.path.abspath(blox.__file__)
    if where.startswith(os.path.join(REPO, "blox")):
        raise SystemExit(f"'blox' resolves to this repository ({where}), not jax-blox")
    return blox, version


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--blocked", action="store_true")
    ap.add_argument("--only", default=None)
    args = ap.parse_args(argv)
    cfg = Config(args.rounds, args.steps, args.warmup, args.quick, not args.blocked)
    bx, version = import_jax_blox()
    lib = "jax-blox"

    workloads = {
        # jax-blox has no MLP: (a) is the same three Linear children in a plain stack.
        "(a)": lambda: _workloads.build_mlp(bx, _workloads.stack_class(bx), None, lib),
        "(b)": lambda: _workloads.build_deep(bx, cfg, None, lib),
        "(c)": lambda: _workloads.build_roundtrip(bx, 24 if cfg.quick else 384, cfg, target=None),
    }
    only = [s.strip() for s in args.only.split(",")] if args.only else None
    out = Outcome()
    for key, build in workloads.items():
        if only is not None and key not in only:
            continue
        t0 = time.perf_counter()
        log(f"== jax-blox {key}")
        try:
            built = build()
        except Exception as e:  # report, keep the other workloads
            log(f"   {key} failed: {type(e).__name__}: {e}")
            out.checks.append(f"{key}: failed with jax-blox {version}: {type(e).__name__}: {e}")
            continue
        _workloads.run(built, cfg, out, log)
        log(f"   done in {time.perf_counter() - t0:.1f}s")

    report = {
        "version": version,
        "python": platform.python_version(),
        "jax": metadata.version("jax"),
        "optax": metadata.version("optax"),
        "outcome": dataclasses.asdict(out),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
