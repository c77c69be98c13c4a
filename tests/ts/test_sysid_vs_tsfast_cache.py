"""The result cache of ``benchmarks/sysid_vs_tsfast.py``: what keys a run, which runs a
rerun skips, and which cached runs the report is rendered from (pure functions, no run)."""

import argparse
import hashlib
import importlib.util
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # its `import _timing`
    spec = importlib.util.spec_from_file_location(
        "_blox_bench_sysid_vs_tsfast", os.path.join(REPO, "benchmarks", "sysid_vs_tsfast.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)
        sys.path.remove(os.path.join(REPO, "benchmarks"))


def _args(**kw):
    base = dict(epochs=10, batches_per_epoch=300, size="default", threads=1, seeds=2,
                systems=["wh"], models=["lstm"], no_tsfast=False, no_base=False,
                variants=[])  # fmt: skip
    return argparse.Namespace(**dict(base, **kw))


def test_the_key_holds_every_field_and_the_recipe_hash(bench):
    fields = dict(epochs=10, batches_per_epoch=300, size="default", threads=1)
    key = bench.run_key("blox:base", "wh", "gru", 0, **fields)
    text = json.dumps(dict(bench.RECIPE), sort_keys=True, separators=(",", ":"))
    assert json.loads(key) == dict(v=bench.CACHE_VERSION, lib="blox", system="wh",
                                   model="gru", seed=0, recipe=hashlib.sha256(
                                       text.encode()).hexdigest()[:12], **fields)  # fmt: skip
    # The LSTM's one kernel spans [x, h]: the joint and the F-only LeCun draw are the
    # same run (one key); for the GRU (split kernels) they differ.
    lstm = [bench.run_key(f"blox:{v}", "wh", "lstm", 0, **fields) for v in ("base", "lecun_f_init")]
    assert lstm[0] == lstm[1]
    assert key != bench.run_key("blox:lecun_f_init", "wh", "gru", 0, **fields)
    key = lstm[0]
    others = [
        bench.run_key("tsfast", "wh", "lstm", 0, **fields),
        bench.run_key("blox:mse", "wh", "lstm", 0, **fields),
        bench.run_key("blox:base", "silverbox", "lstm", 0, **fields),
        bench.run_key("blox:base", "wh", "gru", 0, **fields),
        bench.run_key("blox:base", "wh", "lstm", 1, **fields),
        bench.run_key("blox:base", "wh", "lstm", 0, **dict(fields, epochs=9)),
        bench.run_key("blox:base", "wh", "lstm", 0, **dict(fields, batches_per_epoch=299)),
        bench.run_key("blox:base", "wh", "lstm", 0, **dict(fields, size="tiny")),
        bench.run_key("blox:base", "wh", "lstm", 0, **dict(fields, threads=2)),
    ]
    assert len({key, *others}) == len(others) + 1


def test_a_changed_recipe_default_changes_the_key(bench, monkeypatch):
    fields = dict(epochs=10, batches_per_epoch=300, size="default", threads=1)
    before = bench.run_key("blox:base", "wh", "lstm", 0, **fields)
    mse = bench.run_key("blox:mse", "wh", "lstm", 0, **fields)
    tsfast = bench.run_key("tsfast", "wh", "lstm", 0, **fields)
    monkeypatch.setitem(bench.RECIPE, "loss", "mse")
    after = bench.run_key("blox:base", "wh", "lstm", 0, **fields)
    assert after != before
    # The recipe's new default is what the MSE variant trained: the same run, cached once.
    assert after == mse
    assert bench.run_key("tsfast", "wh", "lstm", 0, **fields) == tsfast


def test_unknown_variant_is_named(bench):
    with pytest.raises(ValueError, match=r"unknown variant 'nope'"):
        bench.recipe_settings("blox:nope")


def test_jobs_order_then_a_rerun_skips_the_cached_runs(bench, tmp_path):
    args = _args(variants=["mse", "clip_1"])
    jobs = bench._jobs(args)
    assert jobs == [("tsfast", "wh", "lstm", 0), ("blox:base", "wh", "lstm", 0),
                    ("tsfast", "wh", "lstm", 1), ("blox:base", "wh", "lstm", 1),
                    ("blox:mse", "wh", "lstm", 0), ("blox:mse", "wh", "lstm", 1),
                    ("blox:clip_1", "wh", "lstm", 0),
                    ("blox:clip_1", "wh", "lstm", 1)]  # fmt: skip
    path = str(tmp_path / "runs" / "results.jsonl")
    assert bench.load_cache(path) == {}  # no file yet
    for job in jobs[:3]:
        bench.append_cache(path, _record(bench, job, args))
    cache = bench.load_cache(path)
    assert bench.pending_jobs(jobs, cache, args) == jobs[3:]
    # Another budget or thread count finds none of them.
    assert bench.pending_jobs(jobs, cache, _args(variants=["mse", "clip_1"], epochs=5)) == jobs
    assert bench.pending_jobs(jobs, cache, _args(variants=["mse", "clip_1"], threads=2)) == jobs


def _record(bench, job, args, **kw):
    side, system, model, seed = job
    rec = dict(side=side, system=system, model=model, seed=seed, epochs=args.epochs,
               batches_per_epoch=args.batches_per_epoch, size=args.size, threads=args.threads,
               recipe_settings=bench.recipe_settings(side), rmse=1.0)  # fmt: skip
    return dict(rec, **kw)


def test_load_cache_leaves_out_a_torn_line_and_keeps_the_last_record(bench, tmp_path):
    args = _args()
    a = _record(bench, ("blox:base", "wh", "lstm", 0), args, rmse=1.0)
    b = _record(bench, ("tsfast", "wh", "lstm", 0), args, rmse=2.0)
    a2 = dict(a, rmse=3.0)
    path = tmp_path / "results.jsonl"
    lines = [json.dumps(a), json.dumps(b), json.dumps({"rmse": 4.0}), json.dumps(a2),
             json.dumps(a)[:40]]  # fmt: skip
    path.write_text("\n".join(lines))
    cache = bench.load_cache(str(path))
    assert cache == {bench._key_for(("blox:base", "wh", "lstm", 0), args): a2,
                     bench._key_for(("tsfast", "wh", "lstm", 0), args): b}  # fmt: skip


def test_the_report_reads_every_cached_seed_of_the_current_recipe(bench, tmp_path):
    args = _args(seeds=1)
    path = str(tmp_path / "results.jsonl")
    recs = [("tsfast", 0, args), ("tsfast", 3, args), ("blox:base", 0, args),
            ("blox:base", 1, _args(epochs=1)),  # another budget: left out
            ("blox:mse", 2, args)]  # fmt: skip
    for side, seed, a in recs:
        bench.append_cache(path, _record(bench, (side, "wh", "gru", seed), a))
    got = bench.cached_results(bench.load_cache(path), _args(seeds=1, models=["gru"]))
    assert [(r["side"], r["seed"]) for r in got] == [("tsfast", 0), ("tsfast", 3),
                                                     ("blox:base", 0), ("blox:mse", 2)]  # fmt: skip
    assert bench.cached_results(bench.load_cache(path), _args(models=["lstm"])) == []


def test_an_older_record_without_clipping_keys_as_the_recipe_without_clipping(bench):
    args = _args()
    assert bench.RECIPE["clip"] == 0.0  # the recipe does not clip (docs/sysid.md)
    old = _record(bench, ("blox:base", "wh", "lstm", 0), args)
    old["recipe_settings"] = dict(old["recipe_settings"], clip=None)  # as written before
    assert bench.record_key(old) == bench._key_for(("blox:base", "wh", "lstm", 0), args)
    assert bench.record_key(old) != bench._key_for(("blox:clip_1", "wh", "lstm", 0), args)
    assert bench.record_key({"side": "tsfast"}) is None  # lacks the key's fields


def test_the_timing_table_takes_the_recipes_runs_of_this_size_and_threads(bench):
    args = _args(systems=["wh"], models=["lstm", "gru"])

    def rec(side, step, free, **kw):
        return _record(bench, (side, "wh", "lstm", 0), args, step_s=step, free_run_s=free,
                       load=[1.5, 1.0, 1.0], **kw)  # fmt: skip

    records = [rec("tsfast", 0.050, 0.040), rec("tsfast", 0.060, 0.030),
               rec("tsfast", 0.070, 0.050),
               rec("blox:base", 0.030, 0.010), rec("blox:base", 0.020, 0.014),
               rec("blox:base", 0.001, 0.001, threads=2),  # other thread count: left out
               rec("blox:mse", 0.001, 0.001),  # a variant, not the recipe: left out
               rec("blox:base", 0.001, 0.001, size="tiny")]  # fmt: skip
    rows = bench.timing_rows(records, args)
    # One row (LSTM; no GRU runs): medians 60 ms vs 25 ms, 0.040 s vs 0.012 s.
    assert rows == [["Wiener-Hammerstein-like", "LSTM 1x40", "3, 2", "60.0", "25.0",
                     "**0.42**", "0.040", "0.012", "**0.30**", "1.5"]]  # fmt: skip


def _read(path):
    with open(path) as f:
        return f.read()


def test_a_claimed_run_is_not_claimed_again_and_a_dead_claim_is_taken_over(bench, tmp_path):
    cache = str(tmp_path / "results.jsonl")
    first = bench.claim_run(cache, "key-a")
    assert first is not None and _read(first) == str(os.getpid())
    assert bench.claim_run(cache, "key-a") is None  # held by a live process (this one)
    assert bench.claim_run(cache, "key-b") not in (None, first)  # another run: its own
    os.remove(first)
    dead = bench.claim_run(cache, "key-a")
    assert dead == first
    with open(dead, "w") as f:  # a holder that has exited (no such pid)
        f.write("999999999")
    assert bench.claim_run(cache, "key-a") == first
    assert _read(first) == str(os.getpid())
