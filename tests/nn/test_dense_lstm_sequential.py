"""Linear, MLP, LSTM, Dropout and Sequential: scans as a pair, resets, errors, stored
weights, signatures.

The shared checks (jit, vmap, grad, eval_shape, dtypes, no retrace, sharding) run over
the descriptor table in ``test_layer_contract.py``; numerics against PyTorch live in
``test_dense_lstm_torch.py``.
"""

import inspect
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx
from tests.nn.layer_table import numpy_params

# ----------------------------------------------------------------------------- scans


def _lstm_pair():
    g = bx.Graph("model")
    rng = bx.Rng(g / "rng")
    dyn = bx.LSTM(g / "lstm", 8, rng, is_static=False)
    g2 = bx.Graph("model")
    sta = bx.LSTM(g2 / "lstm", 8, bx.Rng(g2 / "rng"), is_static=True)
    return rng, dyn, sta


@pytest.mark.parametrize("use_jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("with_resets", [False, True], ids=["plain", "resets"])
def test_static_and_dynamic_lstm_agree_on_one_params(use_jit, with_resets):
    rng, dyn, sta = _lstm_pair()
    x = jax.random.normal(jax.random.key(2), (3, 9, 4))
    params = rng.seed(bx.Params(), seed=1)
    _, params = dyn.apply(params, x)
    params = params.locked()
    resets = None
    if with_resets:
        resets = jnp.zeros((3, 9), bool).at[0, 4].set(True).at[2, 1].set(True)

    def run(m):
        f = lambda p, x, r: m.apply(p, x, is_reset=r)  # noqa: E731
        return (jax.jit(f) if use_jit else f)(params, x, resets)

    (h_s, s_s), _ = run(sta)
    (h_d, s_d), _ = run(dyn)
    chex.assert_trees_all_close((h_s, s_s), (h_d, s_d), rtol=1e-6, atol=1e-6)
    # Init through the static path creates the same parameters.
    p_static = rng.seed(bx.Params(), seed=1)
    _, p_static = sta.apply(p_static, x)
    assert list(p_static.keys()) == list(params.keys())
    chex.assert_trees_all_equal(p_static.locked(), params)


def test_reset_zeroes_only_marked_rows_when_batch_equals_hidden():
    """B == H: jax-blox 0.1.6 reset hidden *columns* here; blox resets batch rows."""
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    lstm = bx.LSTM(g / "lstm", 3, rng)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4, 2)), jnp.float32)
    params = numpy_params(lstm.apply, rng.seed(bx.Params(), seed=0), x)
    resets = jnp.zeros((3, 4), bool).at[1, 2].set(True)
    (h, _), _ = lstm.apply(params, x, is_reset=resets)
    # Reference: row 1 from step 2 equals a fresh run on x[1:2, 2:].
    (h_fresh, _), _ = lstm.apply(params, x[1:2, 2:])
    np.testing.assert_allclose(h[1:2, 2:], h_fresh, rtol=1e-6, atol=1e-6)
    (h_plain, _), _ = lstm.apply(params, x)
    np.testing.assert_array_equal(h[jnp.array([0, 2])], h_plain[jnp.array([0, 2])])
    np.testing.assert_array_equal(h[1, :2], h_plain[1, :2])


def test_carried_state_equals_one_long_run():
    """Truncated BPTT: two chunks with the carried state equal one pass."""
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    lstm = bx.LSTM(g / "lstm", 5, rng)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 10, 3)), jnp.float32)
    params = numpy_params(lstm.apply, rng.seed(bx.Params(), seed=0), x)
    (h_all, s_all), _ = lstm.apply(params, x)
    (h1, s1), _ = lstm.apply(params, x[:, :6])
    (h2, s2), _ = lstm.apply(params, x[:, 6:], prev_state=s1)
    np.testing.assert_allclose(jnp.concatenate([h1, h2], 1), h_all, rtol=1e-6, atol=1e-6)
    chex.assert_trees_all_close(s2, s_all, rtol=1e-6, atol=1e-6)


def test_scan_functions_directly_and_rng_threading():
    """static_scan / dynamic_scan with a step that draws random numbers each step."""
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")

    def step(params, x_t, state, is_reset, is_training):
        key, params = rng(params)
        noise = jax.random.normal(key, x_t.shape)
        state = state + x_t + noise
        return (state, state), params

    params = rng.seed(bx.Params(), seed=5).locked()
    x = jnp.ones((2, 6, 3))
    init = jnp.zeros((2, 3))
    (out_s, fin_s), p_s = bx.static_scan(step, params, x, init, None, True)
    (out_d, fin_d), p_d = bx.dynamic_scan(step, params, x, init, None, True)
    np.testing.assert_allclose(out_s, out_d, rtol=1e-6)
    assert int(rng.get_counter(p_s)) == int(rng.get_counter(p_d)) == 6
    # Reference: cumulative sum of x + the keys fold_in(seed, t).
    noise = [jax.random.normal(jax.random.fold_in(jax.random.key(5), t), (2, 3)) for t in range(6)]
    np.testing.assert_allclose(out_s, np.cumsum(1.0 + np.stack(noise, 1), axis=1), rtol=1e-5)


def test_scan_errors():
    step = lambda p, x, s, r, t: ((x, s), p)  # noqa: E731
    params = bx.Params().locked()
    with pytest.raises(ValueError, match=r"rank >= 2 \(\[B, T, \.\.\.\]"):
        bx.static_scan(step, params, jnp.ones(3), None)
    with pytest.raises(ValueError, match="share the time length"):
        bx.dynamic_scan(step, params, {"a": jnp.ones((2, 3)), "b": jnp.ones((2, 4))}, None)
    with pytest.raises(ValueError, match=r"is_reset must have shape \[B, T\] = \(2, 3\)"):
        bx.dynamic_scan(step, params, jnp.ones((2, 3)), None, jnp.zeros((3, 2), bool))
    with pytest.raises(ValueError, match="no arrays"):
        bx.static_scan(step, params, {}, None)


# ----------------------------------------------------------------------------- errors


def test_linear_errors_name_path_and_shapes():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 4, rng)
    params = rng.seed(bx.Params(), seed=0)
    with pytest.raises(ValueError, match=r"Linear 'net/fc': input must not be scalar"):
        fc(params, jnp.float32(1.0))
    _, params = fc(params, jnp.ones((2, 3)))
    with pytest.raises(
        ValueError,
        match=r"Linear 'net/fc' expects inputs of shape \(\.\.\., 3\) \(kernel \(3, 4\) = "
        r"\(D_in, D_out\)\), got input shape \(2, 5\)\. Fix the input's last dimension",
    ):
        fc(params.locked(), jnp.ones((2, 5)))
    with pytest.raises(ValueError, match="output_size must be a positive int"):
        bx.Linear(g / "bad", 0, rng)
    with pytest.raises(ValueError, match="output_sizes must not be empty"):
        bx.MLP(g / "mlp", (), rng)


def test_lstm_errors_name_path_and_shapes():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    lstm = bx.LSTM(g / "lstm", 4, rng)
    params = rng.seed(bx.Params(), seed=0)
    x = jnp.ones((2, 5, 3))
    _, params = lstm.apply(params, x)
    with pytest.raises(ValueError, match="requires a valid prev_state"):
        lstm(params, x[:, 0], None)
    with pytest.raises(ValueError, match=r"LSTM 'net/lstm': one step takes inputs of shape"):
        lstm(params, x, lstm.initial_state(params, x)[0])
    with pytest.raises(
        ValueError, match=r"LSTM 'net/lstm' expects inputs with 3 features.*\(2, 6\)"
    ):
        lstm.apply(params, jnp.ones((2, 5, 6)))
    # apply needs a sequence: a [B, F] batch (rank 2 passes the generic rank >= 2 check
    # of the scans) is refused with the sequence shape, not by the one-step call.
    for bad in (jnp.ones((5,)), x[:, 0], jnp.ones((2, 5, 3, 1))):
        with pytest.raises(
            ValueError,
            match=r"LSTM 'net/lstm': apply runs over a whole sequence and needs inputs of "
            r"shape \[B, T, F\] \(rank 3, time on axis 1\), got shape "
            + re.escape(str(bad.shape))
            + r"\. For a single step \[B, F\] call lstm\(params, x_t, state\)",
        ):
            lstm.apply(params, bad)
    with pytest.raises(ValueError, match=r"is_reset must have shape \[B, T\] = \(2, 5\)"):
        lstm.apply(params, x, is_reset=jnp.zeros((2,), bool))
    state, _ = lstm.initial_state(params, x[:, 0])
    with pytest.raises(ValueError, match=r"'net/lstm': is_reset for one step must have shape"):
        lstm(params, x[:, 0], state, is_reset=jnp.zeros((3,), bool))
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        bx.LSTM(g / "bad", -1, rng)


def test_lstm_initial_state_is_a_pair_and_prev_state_is_checked():
    """initial_state returns (state, params); passing that pair as prev_state (today: a
    failure deep inside JAX) raises a TypeError that shows how to unpack it."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    lstm = bx.LSTM(g / "lstm", 4, rng, is_static=True)
    x = jax.random.normal(jax.random.key(1), (2, 5, 3))
    _, params = lstm.apply(rng.seed(bx.Params(), seed=0), x)
    params = params.locked()
    pair = lstm.initial_state(params, x[:, 0])
    assert isinstance(pair, tuple) and len(pair) == 2 and pair[1] is params
    state, _ = pair
    assert isinstance(state, bx.LSTMState)
    np.testing.assert_array_equal(state.hidden, np.zeros((2, 4)))
    np.testing.assert_array_equal(state.cell, np.zeros((2, 4)))
    unpack = (
        r"LSTM 'net/lstm': prev_state is \(or contains\) a Params\. initial_state returns "
        r"the pair \(state, params\), not the state alone; unpack it:\n"
        r"    state, params = lstm\.initial_state\(params, x_t\)"
    )
    for static in (True, False):
        lstm.is_static = static
        with pytest.raises(TypeError, match=unpack):
            lstm.apply(params, x, prev_state=pair)
        with pytest.raises(TypeError, match=unpack):
            jax.jit(lambda p, x: lstm.apply(p, x, prev_state=lstm.initial_state(p, x[:, 0])))(
                params, x
            )
    with pytest.raises(TypeError, match=unpack):
        lstm(params, x[:, 0], pair)
    with pytest.raises(
        TypeError,
        match=r"prev_state must be an LSTMState\(hidden, cell\) with hidden and cell \[B, H\] "
        r"= \(2, 4\), got array of shape \(2, 4\)\. .*lstm\.initial_state",
    ):
        lstm.apply(params, x, prev_state=jnp.zeros((2, 4)))
    with pytest.raises(
        ValueError,
        match=r"prev_state must be an LSTMState\(hidden, cell\) with hidden and cell \[B, H\] "
        r"= \(2, 4\), got LSTMState with hidden: array of shape \(2, 4\), cell: array of shape "
        r"\(3, 4\)",
    ):
        lstm(params, x[:, 0], bx.LSTMState(jnp.zeros((2, 4)), jnp.zeros((3, 4))))
    # A plain (hidden, cell) pair of arrays is accepted and gives the LSTMState's numbers.
    lstm.is_static = True
    (y_tuple, s_tuple), _ = lstm.apply(params, x, prev_state=(state.hidden, state.cell))
    (y_ref, _), _ = lstm.apply(params, x)
    assert isinstance(s_tuple, bx.LSTMState)
    np.testing.assert_array_equal(y_tuple, y_ref)


# ----------------------------------------------------------------------------- stored weights


def _torch_layout(params: bx.Params, path: tuple, value) -> bx.Params:
    """Stores `value` at `path` through item assignment on unlocked params, as a script
    that copies weights from another library does."""
    params = params.unlocked()
    params[path] = bx.Param(jnp.asarray(value))
    return params


def test_stored_weights_of_the_wrong_shape_are_blamed_not_the_input():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 3, rng)
    mlp = bx.MLP(g / "mlp", (6, 2), rng)
    lstm = bx.LSTM(g / "lstm", 4, rng, is_static=True)
    x, seq = jnp.ones((2, 5)), jnp.ones((2, 7, 5))
    params = rng.seed(bx.Params(), seed=0)
    _, params = fc(params, x)
    _, params = mlp(params, x)
    _, params = lstm.apply(params, seq)
    rs = np.random.default_rng(0)
    transposed = (
        r"The stored value is transposed: PyTorch stores weights as \(out, in\) and blox as "
        r"\(in, out\), so store the transpose"
    )

    # Linear: a torch.nn.Linear(5, 3).weight, (out, in), copied without .T.
    p = _torch_layout(params, ("net", "fc", "kernel"), rs.standard_normal((3, 5), np.float32))
    with pytest.raises(
        ValueError,
        match=r"Parameter 'net/fc/kernel' is stored with shape \(3, 5\), but Linear 'net/fc' "
        r"expects \(5, 3\) = \(D_in, D_out\) for input shape \(2, 5\) and output_size=3\. "
        + transposed,
    ) as info:
        fc(p, x)
    assert "Fix the input" not in str(info.value)
    # A kernel that fits no layout: blamed too, without the transpose hint.
    p = _torch_layout(params, ("net", "fc", "kernel"), np.zeros((5, 4), np.float32))
    with pytest.raises(
        ValueError,
        match=r"'net/fc/kernel' is stored with shape \(5, 4\), but Linear 'net/fc' expects "
        r"\(5, 3\).*Replace the stored value",
    ):
        fc(p, x)
    # A bias of the wrong length (checked by get_param for every module).
    p = _torch_layout(params, ("net", "fc", "bias"), np.zeros((5,), np.float32))
    with pytest.raises(
        ValueError, match=r"'net/fc/bias' is stored with shape \(5,\), but Linear 'net/fc' "
    ):
        fc(p, x)
    # Inside an MLP, the inner Linear names its own path.
    p = _torch_layout(params, ("net", "mlp", "linear_1", "kernel"), np.zeros((2, 6), np.float32))
    with pytest.raises(
        ValueError,
        match=r"'net/mlp/linear_1/kernel' is stored with shape \(2, 6\), but Linear "
        r"'net/mlp/linear_1' expects \(6, 2\).*" + transposed,
    ):
        mlp(p, x)
    # LSTM: gates kernel (F + H, 4H) = (9, 16) stored transposed, in both scans.
    p = _torch_layout(params, ("net", "lstm", "gates", "kernel"), np.zeros((16, 9), np.float32))
    for static in (True, False):
        lstm.is_static = static
        with pytest.raises(
            ValueError,
            match=r"Parameter 'net/lstm/gates/kernel' is stored with shape \(16, 9\), but LSTM "
            r"'net/lstm' expects \(9, 16\) = \(F \+ H, 4H\) for F=5, H=4\. " + transposed,
        ):
            lstm.apply(p.locked(), seq)
    p = _torch_layout(params, ("net", "lstm", "gates", "bias"), np.zeros((4,), np.float32))
    with pytest.raises(ValueError, match=r"'net/lstm/gates/bias' is stored with shape \(4,\)"):
        lstm.apply(p, seq)
    # When the stored kernel fits the layer, a wrong input is still the input's fault.
    with pytest.raises(ValueError, match=r"LSTM 'net/lstm' expects inputs with 5 features"):
        lstm.apply(params, jnp.ones((2, 7, 6)))


# ----------------------------------------------------------------------------- signatures


def _positional(cls) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    sig = inspect.signature(cls.__init__)
    return [n for n, p in sig.parameters.items() if p.kind in kinds][1:]  # drop self


# jax-blox 0.1.6's positional order (docs: /work/shared/jax-blox-api.md), kept exactly.
_JAX_BLOX_POSITIONAL = {
    "Linear": [
        "graph",
        "output_size",
        "rng",
        "use_bias",
        "kernel_init",
        "bias_init",
        "kernel_metadata",
        "bias_metadata",
    ],
    "Sequential": ["graph", "layers"],
    "LSTM": ["graph", "hidden_size", "rng", "is_static"],
    "GRU": ["graph", "hidden_size", "rng", "is_static"],
}
# Layers jax-blox does not have: the defining arguments (and rng) only.
_NEW_POSITIONAL = {
    "MLP": ["graph", "output_sizes", "rng"],
    "SimpleRNN": ["graph", "hidden_size", "rng"],
    "MGU": ["graph", "hidden_size", "rng"],
    "Bidirectional": ["graph", "forward", "backward"],
}


@pytest.mark.parametrize("name", sorted({**_JAX_BLOX_POSITIONAL, **_NEW_POSITIONAL}))
def test_constructor_signatures(name):
    """jax-blox's layers keep its positional signatures; for layers it lacks, everything
    after the defining sizes and rng is keyword-only."""
    cls = getattr(bx, name)
    expected = {**_JAX_BLOX_POSITIONAL, **_NEW_POSITIONAL}[name]
    assert _positional(cls) == expected
    sig = inspect.signature(cls.__init__)
    rest = [p for n, p in sig.parameters.items() if n != "self" and n not in expected]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in rest), rest
    if name in _NEW_POSITIONAL and name != "Bidirectional":
        g = bx.Graph("net")
        with pytest.raises(TypeError, match="positional argument"):
            cls(g / "x", 4, None, False)


def test_dropout_behaviour_and_errors():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    drop = bx.Dropout(g / "drop", 0.25, rng)
    params = rng.seed(bx.Params(), seed=0)
    x = jnp.ones((20000,))
    y, params2 = drop(params, x)
    kept = np.asarray(y != 0)
    # Binomial(20000, 0.75): mean 0.75, std 0.003; 6 sigma bound.
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(np.asarray(y)[kept], 1 / 0.75, rtol=1e-6)
    assert int(rng.get_counter(params2)) == 1
    y_eval, params3 = drop(params, x, is_training=False)
    assert y_eval is x and params3 is params
    with pytest.raises(ValueError, match=r"Dropout 'net/bad': rate must be in \[0, 1\)"):
        bx.Dropout(g / "bad", 1.0, rng)


def test_sequential_routes_keyword_arguments():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    seq = bx.Sequential(g / "seq", [bx.Linear(g / "fc", 3, rng), bx.Dropout(g / "d", 0.5, rng)])
    params = rng.seed(bx.Params(), seed=0)
    y_eval, p = seq(params, jnp.ones((2, 4)), is_training=False)
    y_ref, _ = g.children["fc"].module(p, jnp.ones((2, 4)))
    np.testing.assert_array_equal(y_eval, y_ref)
    with pytest.raises(TypeError, match="layer 0 \\(int\\) is not callable"):
        bx.Sequential(g / "bad", [3])
