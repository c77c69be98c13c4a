"""Shared timing helpers for the blox benchmarks.

Plain JAX/NumPy only (no blox import), so a peer script running in another
virtual environment (e.g. one with jax-blox installed) can reuse it.

Method: every round times every contender, its start order rotated by one position
per round: ``warmup`` untimed calls each, then ``steps`` timed calls each, either
interleaved one call at a time (the default: bursts of load from other processes hit
every contender alike) or as one block per contender. Interleaved, every cycle of one
call per contender runs in a fresh random order (seeded, so runs are repeatable): a
fixed cyclic order A B C A B C ... would give each contender the same predecessor in
every cycle, and the predecessor matters. A donated step that always runs right after
a non-donated one (which just allocated and freed its output buffers) was measured 5 %
slower than the same step after a donated one; a rotation of the start order keeps
cyclic neighbours, so it does not remove that bias. Each call is timed alone and
synchronised with ``block_until_ready`` on the value the contender returns. A round
summarises a contender by the median and the min of its per-call times. Comparisons
are *same-round* ratios (contender A's per-call time over contender B's in the same
round), so slow drifts of a shared, noisy machine cancel; the report gives the median
over rounds of those ratios.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal, NamedTuple

import jax

__all__ = [
    "Contender",
    "CountArgs",
    "Counts",
    "Pair",
    "RoundStats",
    "compare",
    "compare_and_log",
    "counts_bullet",
    "cpu_model",
    "environment",
    "flops",
    "format_table",
    "log",
    "min_ratio_table",
    "per_call_us",
    "publish",
    "ratio_row",
    "report_head",
    "run_header",
    "run_rounds",
    "same_math_section",
    "start_run",
    "write_section",
]


@dataclass
class Contender:
    """One timed callable.

    ``call()`` performs one step (threading its own state, if any) and returns the
    value to synchronise on; that value should be O(1) to produce, e.g. the loss, so
    that waiting for it costs the same for every contender.
    """

    name: str
    call: Callable[[], Any]


@dataclass
class RoundStats:
    """Per-call times (seconds) of one contender in one round."""

    median: float
    min: float


@dataclass
class Pair:
    """A comparison ``name`` = ``numerator`` / ``denominator`` with a target ratio."""

    name: str
    numerator: str
    denominator: str
    target: float | None = None
    # Filled by `compare`.
    median_ratio: float = float("nan")
    min_ratio: float = float("nan")
    round_ratios: list[float] = field(default_factory=list)
    num_us: float = float("nan")
    den_us: float = float("nan")

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "info"
        return "PASS" if self.median_ratio <= self.target else "FAIL"


def time_contender(c: Contender, steps: int, warmup: int) -> RoundStats:
    """Times `steps` calls of `c` (after `warmup` untimed calls)."""
    for _ in range(warmup):
        jax.block_until_ready(c.call())
    times = []
    perf = time.perf_counter
    for _ in range(steps):
        t0 = perf()
        jax.block_until_ready(c.call())
        times.append(perf() - t0)
    return RoundStats(statistics.median(times), min(times))


def time_interleaved(
    order: Sequence[Contender], steps: int, warmup: int, seed: int = 0
) -> dict[str, RoundStats]:
    """Times `steps` calls of each contender, one call of each per cycle.

    Each cycle runs the contenders in a fresh random order (``random.Random(seed)``),
    so that no contender always follows the same other one.
    """
    for c in order:
        for _ in range(warmup):
            jax.block_until_ready(c.call())
    shuffle = random.Random(seed).shuffle
    slots = list(range(len(order)))
    times: list[list[float]] = [[] for _ in order]
    perf = time.perf_counter
    for _ in range(steps):
        shuffle(slots)
        for i in slots:
            call = order[i].call
            t0 = perf()
            jax.block_until_ready(call())
            times[i].append(perf() - t0)
    return {
        c.name: RoundStats(statistics.median(ts), min(ts))
        for c, ts in zip(order, times, strict=True)
    }


def run_rounds(
    contenders: Sequence[Contender],
    rounds: int,
    steps: int,
    warmup: int,
    interleave: bool = True,
) -> list[dict[str, RoundStats]]:
    """Times all contenders in each round, rotating their start order by one per round.

    With `interleave` (default) a round alternates single calls of the contenders, in a
    fresh random order every cycle (seeded by the round number), so a burst of load
    from other processes hits all of them alike and no contender always runs after the
    same other one; without it each contender runs its `steps` calls as one block.
    """
    out = []
    n = len(contenders)
    for r in range(rounds):
        order = [contenders[(i + r) % n] for i in range(n)]
        if interleave:
            out.append(time_interleaved(order, steps, warmup, seed=r))
        else:
            out.append({c.name: time_contender(c, steps, warmup) for c in order})
    return out


def compare(results: list[dict[str, RoundStats]], pairs: Sequence[Pair]) -> list[Pair]:
    """Fills each pair's ratios from same-round statistics.

    ``median_ratio``: median over rounds of (median per-call time of the numerator /
    that of the denominator). ``min_ratio``: the same with per-round minima.
    """
    for p in pairs:
        med = [r[p.numerator].median / r[p.denominator].median for r in results]
        mins = [r[p.numerator].min / r[p.denominator].min for r in results]
        p.round_ratios = med
        p.median_ratio = statistics.median(med)
        p.min_ratio = statistics.median(mins)
        p.num_us = 1e6 * statistics.median(r[p.numerator].median for r in results)
        p.den_us = 1e6 * statistics.median(r[p.denominator].median for r in results)
    return list(pairs)


def per_call_us(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """Min over `repeat` runs of the mean time (microseconds) of `number` calls of fn."""
    best = float("inf")
    perf = time.perf_counter
    for _ in range(repeat):
        t0 = perf()
        for _ in range(number):
            fn()
        best = min(best, (perf() - t0) / number)
    return best * 1e6


def compiled_flops(compiled: Any) -> float:
    """FLOPs of a compiled executable's optimised HLO, from XLA's cost analysis."""
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    return float(cost.get("flops", float("nan"))) if cost else float("nan")


def flops(jitted: Any, *args: Any) -> float:
    """FLOPs of the optimised HLO of ``jitted`` at ``args``."""
    return compiled_flops(jitted.lower(*args).compile())


def count_transposes(compiled: Any) -> int:
    """The number of ``transpose`` instructions in a compiled executable's optimised HLO."""
    return len(re.findall(r"=\s*\S+\s+transpose\(", compiled.as_text()))


# ---------------------------------------------------------------------------
# Report helpers
# ---------------------------------------------------------------------------


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def environment() -> dict[str, str]:
    """Date, machine and versions, as strings."""
    devices = jax.devices()
    return {
        "date": datetime.date.today().isoformat(),
        "nproc": str(os.cpu_count()),
        "cpu": cpu_model(),
        "backend": f"{jax.default_backend()} ({len(devices)} device(s): {devices[0].device_kind})",
        "python": platform.python_version(),
        "jax": _version("jax"),
        "jaxlib": _version("jaxlib"),
        "optax": _version("optax"),
        "numpy": _version("numpy"),
        "git": _git_rev(),
        "load": _load_average(),
    }


def _load_average() -> str:
    try:
        return "/".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        return "unknown"


def run_header(env: dict[str, str], started: datetime.datetime, command: str) -> list[str]:
    """The Date / Machine / Versions / Command bullets that open every report section.

    The load average (1, 5, 15 min) is the one `environment()` read before timing; on
    a shared machine it says whether other jobs were running.
    """
    return [
        f"- Date: {started:%Y-%m-%d %H:%M} UTC",
        f"- Machine: `nproc` = {env['nproc']}, {env['cpu']}, JAX backend {env['backend']}; "
        f"load average before the run {env['load']} (1/5/15 min). The machine is shared: "
        "absolute times drift with other jobs, so only same-round ratios are compared.",
        f"- Versions: Python {env['python']}, jax {env['jax']}, jaxlib {env['jaxlib']}, "
        f"optax {env['optax']}, numpy {env['numpy']}; blox at git {env['git']}",
        f"- Command: `{command}`",
    ]


def _git(*args: str) -> str:
    """The stripped stdout of ``git ARGS`` run in this folder (raises if git fails)."""
    return subprocess.run(
        ["git", *args],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    ).stdout.strip()


def _git_rev() -> str:
    """HEAD's short hash, marked when the measured code (the library, the benchmark
    scripts, the package metadata) differs from it. The reports the scripts write into
    ``docs/`` do not count, so a script that runs after another one in ``make bench``
    still reads clean."""
    try:
        rev = _git("rev-parse", "--short", "HEAD")
        top = _git("rev-parse", "--show-toplevel")
        code = [os.path.join(top, p) for p in ("blox", "benchmarks", "pyproject.toml")]
        dirty = _git("status", "--porcelain", "--untracked-files=no", "--", *code)
        return rev + (" (code modified)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(path: str, name: str, body: str, title: str) -> None:
    """Writes `body` between ``<!-- bench:NAME:begin/end -->`` markers in `path`.

    The section is replaced if present, else appended; the rest of the file is kept,
    so each benchmark script owns one section of the same document.
    """
    begin, end = f"<!-- bench:{name}:begin -->", f"<!-- bench:{name}:end -->"
    block = f"{begin}\n{body.rstrip()}\n{end}\n"
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end) + r"\n?", re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _: block, text, count=1)
    else:
        if not text:
            text = f"# {title}\n\n"
        elif not text.endswith("\n\n"):
            text = text.rstrip("\n") + "\n\n"
        text += block
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def command_line() -> str:
    """The command that ran this process, with the interpreter relative to the cwd."""
    exe = os.path.relpath(sys.executable) if sys.executable else "python"
    if exe.startswith(".."):
        exe = sys.executable
    script = os.path.relpath(sys.argv[0])
    return " ".join([exe, script, *sys.argv[1:]])


# ---------------------------------------------------------------------------
# Script scaffolding: command line, progress, report pieces
# ---------------------------------------------------------------------------


def log(msg: str) -> None:
    """Prints a progress line at once (stdout, flushed)."""
    print(msg, flush=True)


class Counts(NamedTuple):
    """The resolved repetition counts of a run."""

    rounds: int
    steps: int
    warmup: int


@dataclass(frozen=True)
class CountArgs:
    """A script's ``--rounds/--steps/--warmup/--quick/--out`` options and their defaults.

    A count left out (or given as 0) takes the script's default, or its ``quick_``
    default under ``--quick``.
    """

    steps: int
    warmup: int
    quick_steps: int
    quick_warmup: int
    rounds: int = 10
    quick_rounds: int = 2

    def add_to(self, ap: argparse.ArgumentParser, quick_help: str) -> None:
        """Adds the options to `ap`; `quick_help` says what ``--quick`` shrinks."""
        ap.add_argument(
            "--rounds",
            type=int,
            default=None,
            help=f"rounds (default {self.rounds}; quick {self.quick_rounds})",
        )
        ap.add_argument(
            "--steps", type=int, default=None, help=f"timed calls per round (default {self.steps})"
        )
        ap.add_argument(
            "--warmup",
            type=int,
            default=None,
            help=f"untimed calls per round (default {self.warmup})",
        )
        ap.add_argument("--quick", action="store_true", help=quick_help)
        ap.add_argument("--out", default=None, help="markdown file whose section is (re)written")

    def resolve(self, ap: argparse.ArgumentParser, args: argparse.Namespace) -> Counts:
        """The counts `args` ask for; exits through `ap` if one is negative."""
        q = args.quick
        counts = Counts(
            rounds=args.rounds or (self.quick_rounds if q else self.rounds),
            steps=args.steps or (self.quick_steps if q else self.steps),
            warmup=args.warmup or (self.quick_warmup if q else self.warmup),
        )
        if min(counts) < 1:
            ap.error("--rounds, --steps and --warmup must be positive")
        return counts

    def parse(
        self, argv: Sequence[str] | None, doc: str, quick_help: str
    ) -> tuple[argparse.Namespace, Counts]:
        """A script's whole command line: the parser (described by `doc`'s first line)
        with only these options, parsed from `argv`; ``(args, counts)``."""
        ap = argparse.ArgumentParser(description=doc.split("\n")[0])
        self.add_to(ap, quick_help=quick_help)
        args = ap.parse_args(argv)
        return args, self.resolve(ap, args)


def start_run(title: str) -> tuple[datetime.datetime, dict[str, str], str]:
    """Start time (UTC), `environment()` and `command_line()`; logs ``TITLE: COMMAND``."""
    started = datetime.datetime.now(datetime.UTC)
    env = environment()
    command = command_line()
    log(f"{title}: {command}")
    return started, env, command


def publish(report: str, out: str | None, section: str) -> None:
    """Logs `report` and, if `out` is given, writes it as `section` of that file."""
    log("\n" + report)
    if out:
        write_section(out, section, report, "Benchmarks")
        log(f"wrote {out}")


def counts_bullet(rounds: int, steps: int, warmup: int, mode: str, quick: str | None) -> str:
    """The ``- N rounds; per round and contender ...`` bullet of a report.

    `mode`: how the timed calls run (e.g. "interleaved"); `quick`: what a ``--quick``
    run shrank, ending in "numbers meaningless" (None: not a quick run).
    """
    return (
        f"- {rounds} rounds; per round and contender {warmup} warm-up calls, "
        f"then {steps} timed calls, {mode}" + (f". QUICK smoke run: {quick}." if quick else ".")
    )


def report_head(
    title: str,
    env: dict[str, str],
    started: datetime.datetime,
    command: str,
    counts: Counts,
    quick: str | None,
    mode: str = "interleaved",
) -> list[str]:
    """A report's first lines: the ``## title`` heading, `run_header`, `counts_bullet`
    (`mode`, `quick` as there) and a blank line."""
    return [
        f"## {title}",
        "",
        *run_header(env, started, command),
        counts_bullet(*counts, mode, quick),
        "",
    ]


def ratio_row(
    pair: Pair,
    primary: Literal["median", "min"] = "median",
    us_digits: int = 1,
    target_suffix: str = "",
    with_target: bool = True,
) -> list[str]:
    """A ratio-table row of a compared `pair`.

    Columns: name, both sides' us/call (`us_digits` decimals), the `primary` ratio in
    bold (median of per-round median ratios, or of per-round min ratios), the other
    one, the per-round range (of median ratios), and with `with_target` the target
    (``<= T.TTx`` + `target_suffix`, or "(diagnostic)") and the verdict on the
    primary ratio ("info" without a target).
    """
    ratios = (pair.median_ratio, pair.min_ratio)
    first, second = ratios if primary == "median" else ratios[::-1]
    row = [
        pair.name,
        f"{pair.num_us:.{us_digits}f}",
        f"{pair.den_us:.{us_digits}f}",
        f"**{first:.3f}x**",
        f"{second:.3f}x",
        f"{min(pair.round_ratios):.3f} - {max(pair.round_ratios):.3f}",
    ]
    if with_target:
        if pair.target is None:
            row += ["(diagnostic)", "info"]
        else:
            verdict = "PASS" if first <= pair.target else "FAIL"
            row += [f"<= {pair.target:.2f}x{target_suffix}", verdict]
    return row


def min_ratio_table(pairs: Sequence[Pair], num: str = "blox", den: str = "raw") -> str:
    """The table of compared `pairs` whose target is on the min-based ratio: us/call of
    `num` and `den` (no decimals), both ratios (min-based first), the per-round range,
    the target and the verdict (see `ratio_row`)."""
    header = [
        "workload",
        f"{num} us/call",
        f"{den} us/call",
        "min-based ratio",
        "median ratio",
        "per-round ratios (min - max)",
        "target",
        "verdict",
    ]
    rows = [ratio_row(p, primary="min", us_digits=0, target_suffix=" (min-based)") for p in pairs]
    return format_table(header, rows)


def compare_and_log(results: list[dict[str, RoundStats]], pairs: Sequence[Pair]) -> list[Pair]:
    """`compare`, then one `log` line per pair: both sides' us/call, the min-based and
    median ratios and the per-round (median) ratios."""
    pairs = compare(results, pairs)
    for p in pairs:
        log(
            f"{p.name}: {p.num_us:.0f} vs {p.den_us:.0f} us/call; min-based ratio "
            f"{p.min_ratio:.3f}x, median ratio {p.median_ratio:.3f}x; per round: "
            + " ".join(f"{r:.3f}" for r in p.round_ratios)
        )
    return pairs


def same_math_section(checks: Sequence[str]) -> list[str]:
    """The ``### Same-math checks`` heading and one bullet per check, as report lines."""
    return ["### Same-math checks", "", *[f"- {c}" for c in checks], ""]
