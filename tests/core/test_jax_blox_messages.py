"""Error texts that jax-blox 0.1.6's tests match on: blox keeps its
longer messages, and they contain jax-blox's words, so `pytest.raises(match=...)` written
for jax-blox keeps passing."""

import jax.numpy as jnp
import pytest

import blox as bx


def _fc():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 3, rng)
    params = fc(rng.seed(bx.Params(), seed=0), jnp.ones((1, 2)))[1]
    return fc, rng, params


def test_set_param_with_nothing_to_change_says_at_least_one_of():
    fc, _, params = _fc()
    with pytest.raises(ValueError, match="At least one of") as err:
        fc.set_param(params, "kernel")
    assert "'net/fc/kernel'" in str(err.value)  # blox's message names the path
    assert "value=, trainable= or metadata=" in str(err.value)  # and the fix


def test_rng_seed_with_neither_seed_nor_counter_says_at_least_one_of():
    _, rng, params = _fc()
    with pytest.raises(ValueError, match="At least one of seed") as err:
        rng.seed(params)
    assert "Rng 'net/rng'" in str(err.value)


@pytest.mark.parametrize("rate", [1.0, 1.5, -0.1])
def test_dropout_rate_error_names_the_rate(rate):
    g = bx.Graph("net")
    with pytest.raises(ValueError, match=r"Dropout rate") as err:
        bx.Dropout(g / "drop", rate, bx.Rng(g / "rng"))
    assert "rate" in str(err.value) and f"got {rate}" in str(err.value)
    assert "Dropout 'net/drop'" in str(err.value)
