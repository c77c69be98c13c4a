"""Reading a parameter without creating it: `Params.value` and `Module.peek_param`, and
no layer reaching into the private attributes of `Params`.

The reference for every read is the public item access ``params[path].value`` (or the
array that was stored), never the accessor under test.
"""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx

# The private attributes and helpers of `Params` (blox/core/_params.py).
PRIVATE = {"_get_value", "_struct", "_values", "_info", "_set", "_make", "_from_items"}

# Only the container's own package reads or rebuilds the flat storage; every other
# package (checkpoints, rules, DP, FSDP, every layer) uses the public API.
ALLOWED = {"blox/core"}

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _params() -> tuple[bx.Params, tuple, jax.Array]:
    path = ("net", "fc", "kernel")
    value = jnp.arange(6.0).reshape(2, 3)
    params = bx.Params()
    params[path] = bx.Param(value, metadata={"sharding": (None, "model")})
    params[("net", "fc", "step")] = bx.Param(jnp.zeros((), jnp.int32), trainable=False)
    return params, path, value


# ----------------------------------------------------------------------------- Params.value


@pytest.mark.parametrize("locked", [False, True])
def test_value_reads_present_absent_and_default(locked):
    params, path, value = _params()
    if locked:
        params = params.locked()
    got = params.value(path)
    assert got is params[path].value  # the stored array itself, no copy
    np.testing.assert_array_equal(got, np.arange(6.0).reshape(2, 3))
    missing = ("net", "fc", "bias")
    assert params.value(missing) is None
    sentinel = object()
    assert params.value(missing, sentinel) is sentinel
    assert params.value(missing, default=0.5) == 0.5
    # A present path ignores the default; reading creates nothing and keeps the lock.
    assert params.value(path, sentinel) is got
    assert list(params.keys()) == [("net", "fc", "kernel"), ("net", "fc", "step")]
    assert params.is_locked == locked


def test_value_refuses_a_string_path_like_item_access():
    params, _, _ = _params()
    with pytest.raises(KeyError, match=r"keyed by path tuples.*\('net', 'fc', 'kernel'\)"):
        params.value("net/fc/kernel")
    for bad in (3, ["net", "fc", "kernel"]):
        with pytest.raises(KeyError, match="keyed by path tuples") as info:
            params.value(bad)
        with pytest.raises(KeyError) as ref:  # item access refuses it the same way
            params[bad]
        assert str(info.value) == str(ref.value)


def test_value_under_jit_returns_the_traced_array():
    params, path, value = _params()

    @jax.jit
    def f(p):
        w = p.value(path)
        assert isinstance(w, jax.core.Tracer)
        return w * 2.0, p.value(("net", "absent"), jnp.float32(-1.0))

    doubled, fallback = f(params.locked())
    np.testing.assert_array_equal(doubled, np.asarray(value) * 2.0)
    assert float(fallback) == -1.0


# ----------------------------------------------------------------------------- Module.peek_param


def test_peek_param_resolves_the_module_path_and_never_creates():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 4, rng)
    params = rng.seed(bx.Params(), seed=0)
    before = len(params)
    assert fc.peek_param(params, "kernel") is None
    assert fc.peek_param(params, "kernel", "none yet") == "none yet"
    assert len(params) == before  # nothing was created
    x = jnp.ones((2, 3))
    y, params = fc(params, x)
    params = params.locked()
    kernel = fc.peek_param(params, "kernel")
    assert kernel is params[("net", "fc", "kernel")].value
    np.testing.assert_allclose(y, np.ones((2, 3)) @ np.asarray(kernel), rtol=1e-6)
    # Another module's name under this path is absent, not an error.
    assert fc.peek_param(params, "recurrent_kernel") is None


def test_peek_param_under_jit_on_locked_params():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    lstm = bx.LSTM(g / "lstm", 3, rng)
    _, params = lstm.apply(rng.seed(bx.Params(), seed=0), jnp.ones((2, 4, 2)))
    params = params.locked()
    stored = params[("net", "lstm", "gates", "kernel")].value

    @jax.jit
    def f(p):
        return lstm.gates.peek_param(p, "kernel").sum(), lstm.peek_param(p, "missing", 0)

    total, missing = f(params)
    np.testing.assert_allclose(total, np.asarray(stored).sum(), rtol=1e-6)
    assert int(missing) == 0


# ----------------------------------------------------------------------------- no private access


def _private_uses(source: str) -> list[tuple[int, str]]:
    """``(line, attribute)`` for every ``<expr>._<private Params attribute>``."""
    tree = ast.parse(source)
    return [
        (node.lineno, node.attr)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE
    ]


def test_the_private_access_detector_finds_each_form():
    src = (
        "v = params._get_value(path)\n"
        "s = params._struct.index\n"
        "w = zip(p._values, p._struct.infos)\n"
        "new = Params._make(x._struct, values)\n"
        "ok = params.value(path)\n"
    )
    found = _private_uses(src)
    assert [a for _, a in found].count("_struct") == 3
    assert {a for _, a in found} == {"_get_value", "_struct", "_values", "_make"}
    assert all(line != 5 for line, _ in found)


def _allowed(rel: str) -> bool:
    return any(rel == a or rel.startswith(a + "/") for a in ALLOWED)


def test_no_layer_reaches_into_private_params_attributes():
    """Every module outside the allow-list (so every `blox.nn`, `blox.ts`, `blox.train`,
    `blox.data` module and the tensor-parallel layers) reads params through
    `Params.value`, `Module.peek_param`, `get_param` or item access."""
    files = sorted((ROOT / "blox").rglob("*.py"))
    nn_files = [f for f in files if f.parent.name == "nn"]
    assert len(nn_files) >= 10  # the scan below sees the layers
    offenders = []
    for f in files:
        rel = f.relative_to(ROOT).as_posix()
        if _allowed(rel):
            continue
        for line, attr in _private_uses(f.read_text()):
            offenders.append(f"{rel}:{line} .{attr}")
    assert not offenders, (
        "private Params attributes used outside core-level code; use params.value(path) "
        "or module.peek_param(params, name):\n" + "\n".join(offenders)
    )
