"""The benchmark timing harness (``benchmarks/_timing.py``): call order and ratios.

Timing values are not asserted (the machine is shared); what is checked is the order in
which contenders are called, and the ratio arithmetic against a hand computation.
"""

import argparse
import importlib.util
import os
import statistics
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def timing():
    spec = importlib.util.spec_from_file_location(
        "_blox_bench_timing", os.path.join(REPO, "benchmarks", "_timing.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def _recording(timing, names):
    log = []

    def make(name):
        def call():
            log.append(name)
            return 0

        return timing.Contender(name, call)

    return [make(n) for n in names], log


def test_interleaved_calls_each_contender_steps_times_in_varying_order(timing):
    names = ["a", "b", "c", "d"]
    contenders, log = _recording(timing, names)
    warmup, steps = 3, 200
    stats = timing.time_interleaved(contenders, steps, warmup, seed=0)
    assert set(stats) == set(names)
    assert all(log.count(n) == warmup + steps for n in names)

    timed = log[warmup * len(names) :]
    # Every cycle holds each contender exactly once...
    for i in range(steps):
        assert sorted(timed[i * len(names) : (i + 1) * len(names)]) == names
    # ... and no contender always runs right after the same other one (a fixed cyclic
    # order would give exactly one predecessor each).
    preds = {n: set() for n in names}
    for prev, cur in zip(timed, timed[1:], strict=False):
        preds[cur].add(prev)
    assert all(len(preds[n] - {n}) == len(names) - 1 for n in names), preds


def test_interleaved_order_is_reproducible_and_seeded(timing):
    orders = []
    for seed in (0, 0, 1):
        contenders, log = _recording(timing, ["a", "b", "c"])
        timing.time_interleaved(contenders, 50, 1, seed=seed)
        orders.append(log)
    assert orders[0] == orders[1]
    assert orders[0] != orders[2]


def test_run_rounds_rotates_start_order_and_blocked_mode(timing):
    contenders, log = _recording(timing, ["a", "b", "c"])
    results = timing.run_rounds(contenders, rounds=3, steps=4, warmup=2, interleave=False)
    assert len(results) == 3
    # Blocked: per round, each contender's warmup + steps calls form one block, and the
    # first block of round r is contender r.
    block = 2 + 4
    firsts = [log[r * 3 * block] for r in range(3)]
    assert firsts == ["a", "b", "c"]
    for r in range(3):
        for k in range(3):
            chunk = log[(r * 3 + k) * block : (r * 3 + k + 1) * block]
            assert len(set(chunk)) == 1


def test_compare_is_the_median_of_same_round_ratios(timing):
    rs = timing.RoundStats
    results = [
        {"x": rs(2.0, 1.0), "y": rs(1.0, 1.0)},
        {"x": rs(3.0, 1.5), "y": rs(2.0, 1.0)},
        {"x": rs(1.0, 0.9), "y": rs(4.0, 1.0)},
    ]
    (p,) = timing.compare(results, [timing.Pair("x/y", "x", "y", 1.0)])
    assert p.round_ratios == [2.0, 1.5, 0.25]
    assert p.median_ratio == 1.5
    assert p.min_ratio == statistics.median([1.0, 1.5, 0.9])
    assert p.num_us == pytest.approx(2e6) and p.den_us == pytest.approx(2e6)
    assert p.verdict == "FAIL"


def test_ratio_row_primary_ratio_decides_the_verdict(timing):
    p = timing.Pair("x/y", "x", "y", target=1.0)
    p.median_ratio, p.min_ratio, p.round_ratios = 1.2, 0.9, [1.1, 1.3]
    p.num_us, p.den_us = 12.34, 10.0
    assert timing.ratio_row(p) == [
        "x/y", "12.3", "10.0", "**1.200x**", "0.900x", "1.100 - 1.300", "<= 1.00x", "FAIL"
    ]  # fmt: skip
    row = timing.ratio_row(p, primary="min", us_digits=0, target_suffix=" (min-based)")
    assert row[1:4] == ["12", "10", "**0.900x**"] and row[6:] == ["<= 1.00x (min-based)", "PASS"]
    p.target = None
    assert timing.ratio_row(p)[6:] == ["(diagnostic)", "info"]
    assert len(timing.ratio_row(p, with_target=False)) == 6


def test_count_args_defaults_quick_and_explicit(timing):
    counts = timing.CountArgs(steps=300, warmup=30, quick_steps=5, quick_warmup=2)
    ap = argparse.ArgumentParser()
    counts.add_to(ap, quick_help="smoke test")
    assert counts.resolve(ap, ap.parse_args([])) == (10, 300, 30)
    assert counts.resolve(ap, ap.parse_args(["--quick"])) == (2, 5, 2)
    args = ap.parse_args(["--quick", "--steps", "7", "--out", "x.md"])
    assert counts.resolve(ap, args) == (2, 7, 2) and args.out == "x.md"
    with pytest.raises(SystemExit):
        counts.resolve(ap, ap.parse_args(["--warmup", "-1"]))
