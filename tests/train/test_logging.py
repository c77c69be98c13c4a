"""`CSVLogger(append=True)` continuing a resumed run's CSV, and the training KeyErrors that
print readably (`History`, EMA). The reference for the CSV rows is the `History` of an
uninterrupted `fit` run (not the logger); files are read back with the `csv` module."""

from __future__ import annotations

import csv

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from blox import ckpt


def _read(path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def _write(path, header, rows) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=header)
        w.writeheader()
        w.writerows(rows)


def _problem():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    model = bx.Linear(g / "fc", 1, rng)
    r = np.random.default_rng(0)
    w_true = r.standard_normal((3, 1)).astype(np.float32)
    xs = [r.standard_normal((8, 3)).astype(np.float32) for _ in range(2)]
    batches = [(x, x @ w_true) for x in xs]
    params = model(rng.seed(bx.Params(), seed=0), xs[0])[1].locked()

    def loss_fn(params, x, y):
        y_hat, params = model(params, x)
        return bx.mse(y_hat, y), params

    tx = optax.sgd(0.05)
    step = jax.jit(bx.make_train_step(loss_fn, tx))
    return params, tx.init(params.split()[0]), batches, step


def test_csv_append_keeps_the_epochs_of_a_resumed_run(tmp_path):
    params, opt_state, batches, step = _problem()
    full = bx.fit(step, params, opt_state, batches, epochs=4, progress=False)

    def run(epochs, logger):
        mngr = ckpt.CheckpointManager(tmp_path / "ckpt", save_every=100, async_save=False)
        return bx.fit(
            step,
            params,
            opt_state,
            batches,
            epochs=epochs,
            callbacks=[ckpt.CheckpointCallback(mngr)],
            loggers=[logger],
            progress=False,
        )

    path = tmp_path / "log" / "metrics.csv"
    assert not path.exists()
    run(2, bx.CSVLogger(path, append=True))  # no file yet: starts it
    resumed = run(4, bx.CSVLogger(path, append=True))
    assert [r["epoch"] for r in resumed.history.rows] == [3, 4]  # really resumed
    header, rows = _read(path)
    assert header[:2] == ["step", "epoch"]
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4]
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    np.testing.assert_allclose(
        [float(r["train/loss"]) for r in rows], full.history["train/loss"], rtol=1e-6
    )
    # The default overwrites: a resumed run alone in the file (what append=True fixes).
    run(5, bx.CSVLogger(path))
    assert [int(r["epoch"]) for r in _read(path)[1]] == [5]


def test_csv_append_drops_the_rows_the_resumed_run_logs_again(tmp_path):
    # The file ran ahead of the checkpoint: epochs 1..3 logged, resumed at epoch 3.
    path = tmp_path / "m.csv"
    header = ["step", "epoch", "train/loss", "eval/acc"]
    _write(
        path,
        header,
        [
            {"step": 4, "epoch": 1, "train/loss": 3.0, "eval/acc": ""},
            {"step": 8, "epoch": 2, "train/loss": 2.0, "eval/acc": 0.5},
            {"step": 12, "epoch": 3, "train/loss": 9.0, "eval/acc": ""},
        ],
    )
    logger = bx.CSVLogger(path, append=True)
    # An epoch without evaluation (columns a subset of the header).
    logger.log(12, {"epoch": 3, "train/loss": 1.0})
    # Then a new column: earlier rows get an empty cell, the header's order is kept.
    logger.log(16, {"epoch": 4, "train/loss": 0.5, "eval/acc": 0.9, "lr": 0.1})
    header2, rows = _read(path)
    assert header2 == header + ["lr"]
    assert [(r["epoch"], r["train/loss"], r["eval/acc"], r["lr"]) for r in rows] == [
        ("1", "3.0", "", ""),
        ("2", "2.0", "0.5", ""),
        ("3", "1.0", "", ""),
        ("4", "0.5", "0.9", "0.1"),
    ]
    # A first row with more columns than the file (the first evaluation after resuming).
    _write(path, ["step", "epoch", "train/loss"], [{"step": 4, "epoch": 1, "train/loss": 3}])
    logger = bx.CSVLogger(path, append=True)
    logger.log(8, {"epoch": 2, "train/loss": 2.0, "eval/acc": 0.5})
    assert _read(path) == (
        ["step", "epoch", "train/loss", "eval/acc"],
        [
            {"step": "4", "epoch": "1", "train/loss": "3", "eval/acc": ""},
            {"step": "8", "epoch": "2", "train/loss": "2.0", "eval/acc": "0.5"},
        ],
    )
    # An empty file is a new file.
    path.write_text("")
    logger = bx.CSVLogger(path, append=True)
    logger.log(1, {"epoch": 1, "train/loss": 1.0})
    assert _read(path)[0] == ["step", "epoch", "train/loss"]


def test_csv_append_errors_name_the_file(tmp_path):
    path = tmp_path / "other.csv"
    _write(path, ["step", "epoch", "train/acc"], [{"step": 4, "epoch": 1, "train/acc": 0.1}])
    before = path.read_text()
    logger = bx.CSVLogger(path, append=True)
    with pytest.raises(
        ValueError,
        match=r"CSVLogger: '.*other\.csv' has the columns \['step', 'epoch', 'train/acc'\], "
        r"but this run logs \['step', 'epoch', 'train/loss'\]: \['train/loss'\] are not in "
        r"the file and \['train/acc'\] are only in the file.*another path, or pass "
        r"append=False",
    ):
        logger.log(8, {"epoch": 2, "train/loss": 1.0})
    assert path.read_text() == before  # nothing written
    path.write_text("step,epoch\n4,1,0.5\n")
    with pytest.raises(ValueError, match=r"'.*other\.csv' line 2 does not have the 2 cells"):
        bx.CSVLogger(path, append=True)
    with pytest.raises(TypeError, match="CSVLogger: append must be a bool, got 'yes'"):
        bx.CSVLogger(path, append="yes")


def _readable(err: BaseException, text: str) -> None:
    """Still a KeyError, printed as written: no quotes, real newlines if any."""
    assert isinstance(err, KeyError)
    msg = str(err)
    assert msg.startswith(text) and not msg.startswith(("'", '"')) and "\\n" not in msg


def test_training_key_errors_print_readably():
    h = bx.History([{"epoch": 1, "train/loss": 2.0}])
    with pytest.raises(KeyError, match=r"History has no metric 'eval/f1'") as info:
        h.series("eval/f1")
    _readable(info.value, "History has no metric 'eval/f1'; logged: ['epoch', 'train/loss'].")
    params = bx.Params()
    params[("net", "w")] = bx.Param(jnp.ones((2,), jnp.float32))
    with pytest.raises(KeyError, match="no EMA params under 'ema'") as info:
        bx.ema_update(params, 0.9)
    _readable(info.value, "ema_update: no EMA params under 'ema'.")
    ema = bx.ema_init(params)
    with pytest.raises(KeyError, match=r"without a source weight: \['net/w'\]") as info:
        bx.ema_params(ema.split(lambda path, _: path != ("net", "w"))[0])
    _readable(info.value, "ema_params: EMA copies without a source weight")
