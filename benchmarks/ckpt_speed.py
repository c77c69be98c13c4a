"""Checkpoint speed: how long a training loop is blocked by an async vs a sync save, and
the restore time, for ~100 MB of params plus Adam state (``bx.ckpt.CheckpointManager``);
and how long the *first* async save blocks compared with the later ones, for a small
data-parallel state replicated over every local device (``examples/dp_classifier.py``).

    .venv/bin/python benchmarks/ckpt_speed.py --out docs/benchmarks.md
    .venv/bin/python benchmarks/ckpt_speed.py --quick     # tiny model, smoke test

Method: one train state (params of 4 ``bx.Linear`` layers, Adam moments, a step) is saved
`--repeats` times to a fresh directory per mode. "Blocked" is the wall time of the
``save()`` call, i.e. what the loop waits before its next step; for async saves the time
until the step is committed (``wait()``) is reported too. Restore is the wall time of
``restore()`` of the latest step into an abstract target, arrays ready. Medians over the
repeats, on local disk (a temporary directory).

First save: a fresh manager saves 4 steps, and the first ``save()`` call's blocked time
is compared with the median of the three later ones, for two states: the one above, and
a small one replicated over all local devices (on CPU, 8 simulated devices unless
XLA_FLAGS sets a count). Each is measured with three ways of starting the checksums,
same run, their order rotated per repeat: as ``CheckpointManager`` does (``now``: no copy
and no compilation in ``save``), as it did before (``before``: leaves up to 1 MiB copied
to the host and summed in ``save``, the others summed by a program compiled in ``save``),
and none (``off``: the step has no checksums; a benchmark-only switch). Every manager
gets new shapes, so no program compiled for another one is reused; a manager's close
waits for its background compilation, so none runs into the next measurement.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _timing  # noqa: E402

import blox as bx  # noqa: E402
from blox import ckpt  # noqa: E402
from blox.ckpt import _checksum  # noqa: E402


class _Before:
    """Starts the checksums as ``save`` did before: small leaves copied and summed on the
    host, the others by a program compiled and dispatched in ``save``."""

    start = staticmethod(_checksum.start_checksums)

    def wait(self) -> None:
        pass


class _Off(_Before):
    """No checksums (benchmark only: such a step restores only with allow_unverified)."""

    @staticmethod
    def start(named_leaves):
        return _checksum.PendingChecksums({})


CHECKSUM_MODES = {"now": None, "before": _Before, "off": _Off}


def build(width: int, layers: int):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    mods = [bx.Linear(g / f"fc{i}", width, rng) for i in range(layers)]

    def init():
        params = rng.seed(bx.Params(), seed=0)
        x = jnp.zeros((1, width))
        for m in mods:
            x, params = m(params, x)
        return params.locked()

    params = jax.jit(init)()
    tx = optax.adam(1e-3)
    opt_state = jax.jit(tx.init)(params.split()[0])
    return {"params": params, "opt_state": opt_state, "step": 0}


def nbytes(tree) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes"))


def time_saves(root: Path, state, repeats: int, async_save: bool):
    blocked, committed = [], []
    with ckpt.CheckpointManager(root, async_save=async_save, max_to_keep=2) as mngr:
        for i in range(1, repeats + 1):
            s = dict(state, step=i)
            jax.block_until_ready(s)
            t0 = time.perf_counter()
            mngr.save(i, s)
            t1 = time.perf_counter()
            mngr.wait()
            t2 = time.perf_counter()
            blocked.append(t1 - t0)
            committed.append(t2 - t0)
    return blocked, committed


def dp_state(width: int):
    """A dp_classifier-sized MLP (64 -> width -> width -> 10) with Adam state, replicated
    over every local device."""
    g = bx.Graph("dp")
    rng = bx.Rng(g / "rng")
    mlp = bx.MLP(g / "mlp", (width, width, 10), rng)
    params = mlp(rng.seed(bx.Params(), seed=0), jnp.zeros((1, 64)))[1].locked()
    opt_state = optax.adam(1e-3).init(params.split()[0])
    mesh = jax.make_mesh(
        (jax.local_device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    state = {"params": params, "opt_state": opt_state}
    state = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    return {**state, "step": 0}


def time_first_saves(root: Path, make_state, repeats: int):
    """{mode: (first save's blocked time, median of the next three's, first save's time
    until committed) per repeat}, every
    manager with new shapes (``make_state(k)``), the modes' order rotated per repeat."""
    out = {mode: [] for mode in CHECKSUM_MODES}
    modes = list(CHECKSUM_MODES)
    for r in range(repeats):
        for j in range(len(modes)):
            mode = modes[(r + j) % len(modes)]
            state = make_state(len(modes) * r + j)
            blocked, committed = [], []
            with ckpt.CheckpointManager(root / f"first_{r}_{mode}", max_to_keep=2) as mngr:
                if CHECKSUM_MODES[mode] is not None:
                    mngr._checksums = CHECKSUM_MODES[mode]()
                for i in range(1, 5):
                    s = dict(state, step=i)
                    jax.block_until_ready(s)
                    t0 = time.perf_counter()
                    mngr.save(i, s)
                    blocked.append(time.perf_counter() - t0)
                    mngr.wait()
                    committed.append(time.perf_counter() - t0)
            out[mode].append((blocked[0], statistics.median(blocked[1:]), committed[0]))
            del state
    return out


def first_rows(times) -> list[list[str]]:
    """Table rows: per mode, the medians of the first and of the later saves' blocked
    times and of the first save's time until committed (ms)."""
    rows = []
    for mode, runs in times.items():
        medians = [statistics.median(run[k] for run in runs) for k in range(3)]
        rows.append([mode, *(f"{m * 1e3:.0f}" for m in medians)])
    return rows


def median_first(times, mode: str) -> float:
    return statistics.median(p[0] for p in times[mode])


def time_restores(root: Path, state, repeats: int):
    target = jax.eval_shape(lambda: state)
    target["step"] = 0
    times = []
    mngr = ckpt.CheckpointManager(root)
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = mngr.restore(target)
        jax.block_until_ready(out)
        times.append(time.perf_counter() - t0)
    mngr.close()
    for a, b in zip(jax.tree.leaves(out["params"]), jax.tree.leaves(state["params"]), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny model (smoke test)")
    ap.add_argument("--repeats", type=int, default=None, help="saves per mode (default 5)")
    ap.add_argument("--out", default=None, help="markdown file to write the section into")
    args = ap.parse_args(argv)
    repeats = args.repeats or (2 if args.quick else 5)
    width, layers = (64, 2) if args.quick else (2500, 4)
    started, env, command = _timing.start_run("blox checkpoint speed")
    state = build(width, layers)
    mb_params = nbytes(state["params"]) / 1e6
    mb_total = nbytes(state) / 1e6
    _timing.log(f"state: params {mb_params:.1f} MB, with Adam state {mb_total:.1f} MB")
    tmp = Path(tempfile.mkdtemp(prefix="blox_ckpt_bench_"))
    try:
        results = {}
        for mode in (True, False):
            blocked, committed = time_saves(tmp / f"async_{mode}", state, repeats, mode)
            results[mode] = (statistics.median(blocked), statistics.median(committed))
            _timing.log(f"async={mode}: blocked {results[mode][0]:.3f}s committed "
                        f"{results[mode][1]:.3f}s")  # fmt: skip
        restore = statistics.median(time_restores(tmp / "async_True", state, repeats))
        _timing.log(f"restore {restore:.3f}s")
        del state
        firsts = {
            "big": time_first_saves(tmp / "big", lambda k: build(width + 8 * k, layers), repeats),
            "dp": time_first_saves(tmp / "dp", lambda k: dp_state(256 + 8 * k), repeats),
        }
        for which, times in firsts.items():
            for row in first_rows(times):
                _timing.log(
                    f"first save ({which}) {row[0]}: blocked {row[1]} ms, later {row[2]} ms, "
                    f"committed {row[3]} ms"
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    (a_blk, a_com), (s_blk, s_com) = results[True], results[False]
    rows = [
        ["async save (default)", f"{a_blk * 1e3:.0f}", f"{a_com * 1e3:.0f}",
         f"{mb_total / a_com:.0f}"],
        ["sync save", f"{s_blk * 1e3:.0f}", f"{s_com * 1e3:.0f}", f"{mb_total / s_com:.0f}"],
        ["restore (abstract target)", f"{restore * 1e3:.0f}", "-", f"{mb_total / restore:.0f}"],
    ]  # fmt: skip
    lines = [
        "## Checkpoints: async vs sync save, restore",
        "",
        *_timing.run_header(env, started, command),
        f"- Workload: {layers} `bx.Linear` layers {width}x{width} ({mb_params:.1f} MB of "
        f"float32 params), Adam moments, a step: {mb_total:.1f} MB saved per step by "
        "`bx.ckpt.CheckpointManager` (Orbax OCDBT) to local disk; median of "
        f"{repeats} saves per mode"
        + (". QUICK smoke run: numbers meaningless." if args.quick else "."),
        "",
        _timing.format_table(
            ["operation", "loop blocked (ms)", "until committed (ms)", "MB/s (committed)"], rows
        ),
        "",
        f"An async save blocks the loop {s_blk / a_blk:.1f}x less than a sync one: the call "
        "returns once the arrays are copied to host memory, and a background thread writes "
        "them. Restore reads every array into the target's shardings and checks it against "
        'the checksum saved with it; "until committed" includes computing those checksums '
        "(summed in the commit thread, so an async save does not wait for them).",
        "",
        "First save of a manager, blocked time (ms), median of "
        f"{repeats} fresh managers per row (new shapes each), with the checksums started "
        "`now` (no copy, no compilation and on CPU no dispatch in `save`: every save keeps "
        "a NumPy view of each leaf, summed in the commit thread; on an accelerator the "
        "first save copies each leaf asynchronously to host memory while one program for "
        "all leaves compiles in a background thread, and later saves dispatch it), "
        "`before` (leaves up to 1 MiB copied to the host and summed in `save`, the "
        "others summed by a program compiled in `save`) and `off` (no checksums):",
        "",
        _timing.format_table(
            [
                "state",
                "checksums",
                "first save blocked (ms)",
                "later saves blocked (ms, median of 3)",
                "first save until committed (ms)",
            ],
            [
                [label, *row]
                for label, which in (
                    (f"{mb_total:.0f} MB (above)", "big"),
                    (f"MLP 64-256-256-10 + Adam, replicated x{jax.local_device_count()}", "dp"),
                )
                for row in first_rows(firsts[which])
            ],
        ),
        "",
        *[
            f"- {label}: the first save blocks {median_first(t, 'now') * 1e3:.0f} ms, "
            f"{median_first(t, 'now') / median_first(t, 'off'):.2f}x the same save without "
            f"checksums ({median_first(t, 'before') * 1e3:.0f} ms before)."
            for label, t in (("Large state", firsts["big"]), ("Small state", firsts["dp"]))
        ],
        "",
        "Orbax writes a replicated array cooperatively (each replica slices out its part "
        "on device, one small program compiled per array shape during the first save); "
        "`CheckpointManager` does this only for slices of at least 16 MiB per replica, so "
        "a small state's first save compiles nothing.",
    ]
    _timing.publish("\n".join(lines), args.out, "ckpt_speed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
