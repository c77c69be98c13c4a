"""The blox.ts examples at --size tiny, the benchmark's quick run, and the API page."""

import re
from pathlib import Path

import pytest

import blox.ts
from tests.scripts import run_benchmark_quick, run_script

ROOT = Path(__file__).resolve().parents[2]
STEP = re.compile(r"^step=(\d+) loss=(\S+)$", re.M)


def _steps(out: str) -> list[float]:
    rows = STEP.findall(out)
    assert [int(n) for n, _ in rows] == list(range(1, len(rows) + 1)), out
    return [float(v) for _, v in rows]


@pytest.mark.slow
@pytest.mark.parametrize("script", ["sysid_silverbox", "sysid_wiener_hammerstein"])
def test_sysid_examples_run_tiny(script, tmp_path):
    out = run_script(f"examples/{script}.py", "--size", "tiny", "--steps", "4", "--seed", "1",
                     "--data", str(tmp_path / "data"), "--out", str(tmp_path))  # fmt: skip
    losses = _steps(out)
    assert len(losses) == 4 and all(v == v for v in losses), out
    assert re.search(r"^arx +\S+ +\S+ +\S+ +1\.000$", out, re.M), out
    assert re.search(r"^gru +\S+", out, re.M), out
    assert list(tmp_path.glob("*_gru.png")), out
    assert (tmp_path / "data" / "test.h5").exists()


@pytest.mark.slow
def test_sysid_example_trains_by_epochs(tmp_path):
    out = run_script("examples/sysid_wiener_hammerstein.py", "--size", "tiny", "--epochs", "2",
                     "--batches-per-epoch", "3", "--seed", "1", "--data", str(tmp_path / "data"),
                     "--out", str(tmp_path))  # fmt: skip
    losses = _steps(out)
    assert len(losses) == 6 and all(v == v for v in losses), out
    # Validated at each epoch's end: the best params are those of step 3 or 6.
    assert re.search(r"^gru: 6 steps in \S+ s \(\S+ steps/s\), best validation NRMSE \S+ at "
                     r"step [36]$", out, re.M), out  # fmt: skip
    assert re.search(r"^gru +\S+", out, re.M), out


@pytest.mark.slow
def test_sysid_physics_example_runs_tiny(tmp_path):
    out = run_script("examples/sysid_physics.py", "--size", "tiny", "--steps", "5",
                     "--out", str(tmp_path))  # fmt: skip
    assert len(_steps(out)) == 5, out
    assert "physics-informed / data only" in out
    assert (tmp_path / "physics.png").exists()


@pytest.mark.slow
def test_ts_speed_benchmark_quick(tmp_path):
    from tests.bench_checks import bold_ratios, loss_pairs, max_diffs, section

    text = run_benchmark_quick("ts_speed.py", "ts_speed", tmp_path / "benchmarks.md")
    assert "GRU sysid train step" in text and "GRU free-run simulation" in text
    s = section(text, "ts_speed")
    bold_ratios(s, at_least=2)  # train step and free run: finite and positive
    max_diffs(s, at_least=2, tol=1e-4)  # weights after one Adam step; free-run outputs
    loss_pairs(s, at_least=1)


def test_every_public_ts_name_has_a_docstring_and_an_api_page():
    page = (ROOT / "docs" / "api" / "ts.md").read_text()
    names = blox.ts.__all__
    assert not [n for n in names if not (getattr(blox.ts, n).__doc__ or "").strip()]
    assert not [n for n in names if f"`{n}`" not in page]


@pytest.mark.slow
def test_sysid_vs_tsfast_harness_quick_blox_side(tmp_path):
    text = run_benchmark_quick("sysid_vs_tsfast.py", "sysid_vs_tsfast", tmp_path / "bench.md",
                               "--no-tsfast", "--systems", "wh", "--models", "lstm",
                               "--data", str(tmp_path / "data"))  # fmt: skip
    row = re.search(r"^\| Wiener-Hammerstein-like \| LSTM 1x40 \| 0, 1 \| not run \| (\S+) \|",
                    text, re.M)  # fmt: skip
    assert row, text
    rmse = float(row.group(1))
    assert 0 < rmse < 10, text  # finite, and a free run of the test recording, not garbage
    assert "SMALL BUDGET" in text
    # Every blox run also scores its other params (here the final ones).
    assert re.search(r"^\| Wiener-Hammerstein-like \| LSTM 1x40 \| base, final params \| .* "
                     r"\| 1 \| \d\.\d{3}e[-+]\d\d \|", text, re.M), text  # fmt: skip
