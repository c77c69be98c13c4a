"""Recurrent layers: MGU against NumPy, scans as a pair, resets, lengths, carried state,
errors, benchmark smoke. The shared layer checks (jit / vmap / grad / dtypes / no retrace /
sharding) run over the table in ``test_layer_contract.py``.

PyTorch references for GRU, SimpleRNN and Bidirectional live in ``test_rnn_torch.py``.
Tolerances: ``tests/tolerances.py`` ``tol(dtype)``.
"""

from __future__ import annotations

import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import blox as bx
from tests.nn.layer_table import numpy_params
from tests.tolerances import tol

CELLS = ["LSTM", "GRU", "SimpleRNN", "MGU"]


def _cell(kind: str, node, h: int, rng, **kw):
    return getattr(bx, kind)(node, h, rng, **kw)


def _build(kind: str, h: int = 4, is_static: bool = False, **kw):
    """``(layer, rng)`` at 'net/layer'; Bidirectional wraps two GRUs."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    node = g / "layer"
    if kind == "Bidirectional":
        fwd = bx.GRU(node / "fwd", h, rng, is_static=is_static, **kw)
        bwd = bx.MGU(node / "bwd", h, rng, is_static=is_static, **kw)
        return bx.Bidirectional(node, fwd, bwd), rng
    return _cell(kind, node, h, rng, is_static=is_static, **kw), rng


def _init(layer, rng, x):
    """Locked params in the layer's own layout, NumPy-filled (no initializer compiled;
    the initializers are checked in test_parameter_layout_and_initializers)."""
    return numpy_params(layer.apply, rng.seed(bx.Params(), seed=0), x).locked()


# ---------------------------------------------------------------------------
# MGU against a NumPy transcription of its equations
# ---------------------------------------------------------------------------


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def _numpy_mgu(x, h0, w, u, b, flags=None, lengths=None):
    """The paper's equations, one row and one step at a time, with blox's reset (zero the
    state first) and length (freeze the state, zero the output) rules."""
    bsz, steps, _ = x.shape
    hs = h0.shape[1]
    h = h0.copy()
    out = np.zeros((bsz, steps, hs), x.dtype)
    for t in range(steps):
        for row in range(bsz):
            if lengths is not None and t >= lengths[row]:
                continue
            prev = np.zeros(hs, x.dtype) if flags is not None and flags[row, t] else h[row]
            gi = x[row, t] @ w + b
            f = _sigmoid(gi[:hs] + prev @ u[:, :hs])
            n = np.tanh(gi[hs:] + (f * prev) @ u[:, hs:])
            h[row] = (1 - f) * prev + f * n
            out[row, t] = h[row]
    return out, h


def _mgu_weights(params, path=("net", "layer")):
    return [np.asarray(params[(*path, n)].value) for n in ("kernel", "recurrent_kernel", "bias")]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("is_static", [True, False], ids=["static", "dynamic"])
def test_mgu_matches_numpy_with_resets_and_lengths(dtype, is_static):
    """MGU.apply from a given h0, with resets and lengths, vs `_numpy_mgu`: outputs and
    final state. Tolerance: tol(dtype)."""
    b, t, f, h = 4, 7, 3, 5
    rs = np.random.default_rng(0)
    x = rs.standard_normal((b, t, f)).astype(dtype)
    h0 = rs.standard_normal((b, h)).astype(dtype)
    flags = rs.random((b, t)) < 0.25
    lengths = np.array([7, 3, 0, 5])
    with jax.enable_x64(dtype == "float64"):
        layer, rng = _build("MGU", h, is_static, param_dtype=dtype)
        params = _init(layer, rng, jnp.zeros((1, 2, f), dtype))
        ref_out, ref_h = _numpy_mgu(x, h0, *_mgu_weights(params), flags, lengths)
        run = jax.jit(lambda p, x, h0: layer.apply(p, x, h0, is_reset=flags, seq_lengths=lengths))
        (out, state), _ = run(params, x, bx.MGUState(jnp.asarray(h0)))
        assert out.dtype == dtype and isinstance(state, bx.MGUState)
        np.testing.assert_allclose(out, ref_out, **tol(dtype))
        np.testing.assert_allclose(state.hidden, ref_h, **tol(dtype))
        # The zero-length row keeps h0 exactly and outputs zeros.
        np.testing.assert_array_equal(state.hidden[2], h0[2])
        np.testing.assert_array_equal(out[2], 0.0)


def test_mgu_gradients_match_finite_differences():
    """float64 reverse-mode gradients of MGU.apply (with resets and lengths) w.r.t. x,
    h0 and all three weights against central finite differences (jax check_grads)."""
    b, t, f, h = 2, 4, 3, 3
    rs = np.random.default_rng(1)
    with jax.enable_x64(True):
        layer, rng = _build("MGU", h, param_dtype="float64")
        params = _init(layer, rng, jnp.zeros((1, 2, f), jnp.float64))
        x = jnp.asarray(rs.standard_normal((b, t, f)))
        h0 = jnp.asarray(rs.standard_normal((b, h)))
        flags = jnp.asarray([[False, False, True, False], [False, False, False, False]])
        lengths = jnp.asarray([4, 3])

        def f_(x, h0, w, u, bias):
            p = layer.set_param(params, "kernel", jnp.asarray(w))
            p = layer.set_param(p, "recurrent_kernel", jnp.asarray(u))
            p = layer.set_param(p, "bias", jnp.asarray(bias))
            (out, state), _ = layer.apply(
                p, x, bx.MGUState(h0), is_reset=flags, seq_lengths=lengths
            )
            return jnp.sum(jnp.sin(out)) + jnp.sum(state.hidden**2)

        w, u, bias = (jnp.asarray(a) for a in _mgu_weights(params))
        check_grads(jax.jit(f_), (x, h0, w, u, bias), order=1, modes=["rev"], eps=1e-6)


# ---------------------------------------------------------------------------
# Static and dynamic scans as a pair; resets; lengths; carried state
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, locked",
    [*((k, True) for k in [*CELLS, "Bidirectional"]), ("GRU", False), ("Bidirectional", False)],
    ids=lambda v: {True: "locked", False: "unlocked"}.get(v, v) if isinstance(v, bool) else v,
)
def test_static_and_dynamic_agree(kind, locked):
    """One params, both scans (under jit), with resets and lengths: same outputs and final
    state (tol(float32)); the init path (unlocked params) too."""
    b, t, f = 3, 6, 2
    rs = np.random.default_rng(2)
    x = jnp.asarray(rs.standard_normal((b, t, f)), jnp.float32)
    flags = jnp.asarray(rs.random((b, t)) < 0.3)
    lengths = jnp.asarray([6, 4, 1])
    dyn, rng = _build(kind, is_static=False)
    params = _init(dyn, rng, x)
    if not locked:
        params = params.unlocked()
    results = []
    for is_static in (True, False):
        dyn.is_static = is_static
        assert dyn.is_static is is_static

        def run(p, x, dyn=dyn):
            return dyn.apply(p, x, is_reset=flags, seq_lengths=lengths)[0]

        results.append(jax.jit(run)(params, x))
    for other in results[1:]:
        chex.assert_trees_all_close(other, results[0], **tol("float32"))
    out = results[0][0]
    np.testing.assert_array_equal(out[2, 1:], 0.0)


@pytest.mark.parametrize("kind", CELLS[1:])
def test_reset_rows_when_batch_equals_hidden(kind):
    """B == H: a reset zeroes the state of the marked *row* (jax-blox 0.1.6 zeroed hidden
    columns): row 1 from step 2 equals a fresh run on x[1:2, 2:]; other rows unchanged."""
    layer, rng = _build(kind, h=3)
    x = jax.random.normal(jax.random.key(0), (3, 5, 2))
    params = _init(layer, rng, x)
    flags = jnp.zeros((3, 5), bool).at[1, 2].set(True)
    (out, _), _ = layer.apply(params, x, is_reset=flags)
    (fresh, _), _ = layer.apply(params, x[1:2, 2:])
    (plain, _), _ = layer.apply(params, x)
    np.testing.assert_allclose(out[1:2, 2:], fresh, **tol("float32"))
    np.testing.assert_array_equal(out[jnp.array([0, 2])], plain[jnp.array([0, 2])])
    np.testing.assert_array_equal(out[1, :2], plain[1, :2])


@pytest.mark.parametrize("kind", ["LSTM", "MGU"])
def test_lengths_freeze_state_and_zero_outputs(kind):
    """Row b with length L: outputs [:L] equal a run on x[b, :L] alone, outputs [L:]
    are zero, and the final state equals that run's final state (GRU and SimpleRNN:
    against PyTorch's packed sequences in test_rnn_torch.py)."""
    layer, rng = _build(kind)
    x = jax.random.normal(jax.random.key(1), (3, 6, 2))
    params = _init(layer, rng, x)
    lengths = np.array([6, 2, 4])
    (out, state), _ = layer.apply(params, x, seq_lengths=lengths)
    for row, n in enumerate(lengths):
        (ref, ref_state), _ = layer.apply(params, x[row : row + 1, :n])
        np.testing.assert_allclose(out[row : row + 1, :n], ref, **tol("float32"))
        np.testing.assert_array_equal(out[row, n:], 0.0)
        chex.assert_trees_all_close(
            jax.tree.map(lambda s, row=row: s[row : row + 1], state), ref_state, **tol("float32")
        )


@pytest.mark.parametrize("kind", ["GRU", "MGU"])
def test_carried_state_equals_one_long_run(kind):
    """Truncated BPTT: two chunks with the carried final state equal one pass."""
    layer, rng = _build(kind, h=5)
    x = jax.random.normal(jax.random.key(3), (2, 9, 3))
    params = _init(layer, rng, x)
    (h_all, s_all), _ = layer.apply(params, x)
    (h1, s1), _ = layer.apply(params, x[:, :4])
    (h2, s2), _ = layer.apply(params, x[:, 4:], prev_state=s1)
    np.testing.assert_allclose(jnp.concatenate([h1, h2], 1), h_all, **tol("float32"))
    chex.assert_trees_all_close(s2, s_all, **tol("float32"))


def test_traced_lengths_under_jit_match_concrete():
    layer, rng = _build("GRU")
    x = jax.random.normal(jax.random.key(4), (3, 5, 2))
    params = _init(layer, rng, x)
    lengths = jnp.asarray([5, 0, 3])
    eager, _ = layer.apply(params, x, seq_lengths=lengths)
    jitted, _ = jax.jit(lambda p, x, n: layer.apply(p, x, seq_lengths=n))(params, x, lengths)
    chex.assert_trees_all_close(jitted, eager, **tol("float32"))


def test_scan_functions_take_lengths():
    """static_scan / dynamic_scan with seq_lengths on a running-sum step: the closed form
    is the cumulative sum up to each length, then zeros; the state stops at the length."""
    step = lambda p, x, s, r, t: ((s + x, s + x), p)  # noqa: E731
    x = jnp.arange(12, dtype=jnp.float32).reshape(2, 6, 1)
    lengths = np.array([6, 2])
    ref = np.cumsum(np.asarray(x), axis=1)
    ref[1, 2:] = 0.0
    for scan in (bx.static_scan, bx.dynamic_scan):
        (out, final), _ = scan(
            step, bx.Params().locked(), x, jnp.zeros((2, 1)), seq_lengths=lengths
        )
        np.testing.assert_array_equal(out, ref)
        np.testing.assert_array_equal(final[:, 0], [15.0, 6.0 + 7.0])


def test_parameter_layout_and_initializers():
    """Paths, shapes, and the documented initializers: per-gate orthogonal recurrent
    kernels, zero biases."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    gru, rnn, mgu = (
        bx.GRU(g / "gru", 4, rng),
        bx.SimpleRNN(g / "rnn", 4, rng),
        bx.MGU(g / "mgu", 4, rng),
    )
    params = rng.seed(bx.Params(), seed=0)
    for layer in (gru, rnn, mgu):
        _, params = layer.apply(params, jnp.ones((2, 3, 5)))
    shapes = {k: v.value.shape for k, v in params.items() if k[1] != "rng"}
    assert shapes == {
        ("net", "gru", "kernel"): (5, 12),
        ("net", "gru", "recurrent_kernel"): (4, 12),
        ("net", "gru", "bias"): (12,),
        ("net", "gru", "recurrent_bias"): (12,),
        ("net", "rnn", "kernel"): (5, 4),
        ("net", "rnn", "recurrent_kernel"): (4, 4),
        ("net", "rnn", "bias"): (4,),
        ("net", "rnn", "recurrent_bias"): (4,),
        ("net", "mgu", "kernel"): (5, 8),
        ("net", "mgu", "recurrent_kernel"): (4, 8),
        ("net", "mgu", "bias"): (8,),
    }
    for name, gates in (("gru", 3), ("rnn", 1), ("mgu", 2)):
        u = np.asarray(params[("net", name, "recurrent_kernel")].value)
        for k in range(gates):
            block = u[:, 4 * k : 4 * (k + 1)]
            np.testing.assert_allclose(block.T @ block, np.eye(4), atol=1e-5)
        np.testing.assert_array_equal(params[("net", name, "bias")].value, 0.0)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------


def test_cell_errors_name_path_shapes_and_fix():
    layer, rng = _build("GRU")
    x = jnp.ones((2, 5, 3))
    params = _init(layer, rng, x)
    with pytest.raises(
        ValueError,
        match=r"GRU 'net/layer' expects inputs with 3 features \(kernel \(3, 12\) = \(F, 3H\) "
        r"with H=4\), got input shape \(2, 6\)\. Fix the input",
    ):
        layer.apply(params, jnp.ones((2, 5, 6)))
    with pytest.raises(
        ValueError,
        match=r"GRU 'net/layer': seq_lengths must be in \[0, T\] = \[0, 5\], got "
        r"seq_lengths\[1\] = 7 \(seq_lengths shape \(2,\), inputs \[B, T\] = \(2, 5\)\)\. Pad",
    ):
        layer.apply(params, x, seq_lengths=[5, 7])
    with pytest.raises(ValueError, match=r"seq_lengths\[0\] = -1"):
        layer.apply(params, x, seq_lengths=np.array([-1, 2]))
    with pytest.raises(
        ValueError, match=r"GRU 'net/layer': seq_lengths must have shape \[B\] = \(2,\).*\(2, 1\)"
    ):
        layer.apply(params, x, seq_lengths=np.ones((2, 1), int))
    with pytest.raises(TypeError, match=r"seq_lengths must be integers, got dtype float32"):
        layer.apply(params, x, seq_lengths=jnp.ones((2,)))
    with pytest.raises(
        ValueError, match=r"GRU 'net/layer': is_reset must have shape \[B, T\] = \(2, 5\)"
    ):
        layer.apply(params, x, is_reset=jnp.zeros((2,), bool))
    state, _ = layer.initial_state(params, x[:, 0])
    with pytest.raises(ValueError, match=r"'net/layer': is_reset for one step must have shape"):
        layer(params, x[:, 0], state, is_reset=jnp.zeros((3,), bool))
    with pytest.raises(ValueError, match=r"GRU __call__ method requires a valid prev_state"):
        layer(params, x[:, 0])
    with pytest.raises(ValueError, match=r"GRU 'net/layer': one step takes inputs of shape"):
        layer(params, x, state)
    with pytest.raises(
        ValueError,
        match=r"prev_state must be a GRUState with hidden \[B, H\] = \(2, 4\), got GRUState "
        r"with hidden: array of shape \(2, 5\)\. Carry the state returned by the previous call, "
        r"or build one with `state, params = gru\.initial_state\(params, x_t\)`",
    ):
        layer(params, x[:, 0], bx.GRUState(jnp.zeros((2, 5))))
    with pytest.raises(ValueError, match="MGU 'net/bad': hidden_size must be a positive int"):
        bx.MGU(bx.Graph("net") / "bad", 0, rng)
    with pytest.raises(ValueError, match=r"static_scan: seq_lengths must be in \[0, T\]"):
        bx.static_scan(lambda *a: None, params, x, None, seq_lengths=[9, 1])


@pytest.mark.parametrize("kind", CELLS + ["Bidirectional"])
def test_initial_state_pair_and_prev_state_checks(kind):
    """initial_state returns ``(state, params)``. Passing that pair as prev_state fails
    deep inside JAX in jax-blox; here it raises a TypeError that shows the unpacking, in
    both scans and under jit. A state of the wrong type or shape says what to pass."""
    layer, rng = _build(kind, is_static=True)  # eager Python loops: no scan compiles
    x = jax.random.normal(jax.random.key(2), (2, 5, 3))
    params = _init(layer, rng, x)
    pair = layer.initial_state(params, x[:, 0])
    assert isinstance(pair, tuple) and len(pair) == 2 and pair[1] is params
    state = pair[0]
    for leaf in jax.tree.leaves(state):
        np.testing.assert_array_equal(leaf, np.zeros((2, 4)))
    name = "bi" if kind == "Bidirectional" else kind.lower()
    unpack = (
        rf"{kind} 'net/layer': prev_state is \(or contains\) a Params\. initial_state returns "
        r"the pair \(state, params\), not the state alone; unpack it:\n"
        rf"    state, params = {name}\.initial_state\(params, x_t\)"
    )
    for static in (True, False):
        layer.is_static = static
        with pytest.raises(TypeError, match=unpack):
            layer.apply(params, x, prev_state=pair)
        with pytest.raises(TypeError, match=unpack):
            jax.jit(lambda p, x: layer.apply(p, x, prev_state=layer.initial_state(p, x[:, 0])))(
                params, x
            )
    # The unpacked state gives the numbers of the default start.
    layer.is_static = True
    (y, _), _ = layer.apply(params, x, prev_state=state)
    (y_ref, _), _ = layer.apply(params, x)
    np.testing.assert_array_equal(y, y_ref)
    if kind in ("LSTM", "Bidirectional"):
        return  # LSTM: test_dense_lstm_sequential.py; Bidirectional has no one-step call
    state_name = f"{kind}State"
    with pytest.raises(TypeError, match=unpack):
        layer(params, x[:, 0], pair)
    with pytest.raises(
        TypeError,
        match=rf"{kind} 'net/layer': prev_state must be a {state_name} with hidden \[B, H\] = "
        rf"\(2, 4\), got array of shape \(2, 4\)\. .*{name}\.initial_state\(params, x_t\)",
    ):
        layer.apply(params, x, prev_state=jnp.zeros((2, 4)))
    with pytest.raises(TypeError, match=rf"must be a {state_name}.*got LSTMState"):
        layer(params, x[:, 0], bx.LSTMState(jnp.zeros((2, 4)), jnp.zeros((2, 4))))


@pytest.mark.parametrize("kind", CELLS + ["Bidirectional"])
def test_apply_on_one_step_inputs_asks_for_a_sequence(kind):
    """``apply`` on ``[B, F]`` (rank 2 passes the scans' generic rank >= 2 check) says a
    ``[B, T, F]`` sequence is needed, instead of failing in the one-step call and telling
    the user to call apply."""
    layer, rng = _build(kind)
    x = jnp.ones((2, 5, 3))
    params = _init(layer, rng, x)
    for bad in (x[:, 0], x[..., None]):
        with pytest.raises(
            ValueError,
            match=rf"{kind} 'net/layer': apply runs over a whole sequence and needs inputs of "
            r"shape \[B, T, F\] \(rank 3, time on axis 1\), got shape " + re.escape(str(bad.shape)),
        ) as info:
            layer.apply(params, bad)
        assert "use " not in str(info.value) and "x[:, None]" in str(info.value)
        if kind == "Bidirectional":
            assert "single step" not in str(info.value)


@pytest.mark.parametrize("kind", ["GRU", "SimpleRNN", "MGU"])
@pytest.mark.parametrize("name", ["kernel", "recurrent_kernel", "bias"])
def test_stored_weights_of_the_wrong_shape_are_blamed(kind, name):
    """A weight stored in another layout (PyTorch's (out, in), left untransposed) names the
    stored parameter, its shape and the expected one, not the input."""
    layer, rng = _build(kind)
    x = jnp.ones((2, 5, 3))
    params = _init(layer, rng, x).unlocked()
    path = ("net", "layer", name)
    good = np.asarray(params[path].value)
    if good.ndim == 2 and good.shape[0] != good.shape[1]:
        bad = good.T
    else:  # a bias, or SimpleRNN's square (H, H) recurrent kernel: one column too many
        bad = np.zeros(good.shape[:-1] + (good.shape[-1] + 1,), good.dtype)
    params[path] = bx.Param(jnp.asarray(bad))
    gates = {"GRU": "3H", "SimpleRNN": "H", "MGU": "2H"}[kind]
    legend = {"kernel": f"(F, {gates})", "recurrent_kernel": f"(H, {gates})"}.get(
        name, f"({gates},)"
    )
    for static in (True, False):
        layer.is_static = static
        with pytest.raises(
            ValueError,
            match=rf"Parameter 'net/layer/{name}' is stored with shape "
            + re.escape(f"{bad.shape}, but {kind} 'net/layer' expects {good.shape} = {legend} ")
            + r"for F=3, H=4\.",
        ) as info:
            layer.apply(params.locked(), x)
        transposed = bad.shape == good.shape[::-1]
        assert ("The stored value is transposed" in str(info.value)) == transposed


def test_bidirectional_errors():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    node = g / "bi"
    fwd, bwd = bx.GRU(node / "f", 4, rng), bx.GRU(node / "b", 4, rng)
    with pytest.raises(TypeError, match=r"Bidirectional 'net/bi': backward must be a recurrent"):
        bx.Bidirectional(node, fwd, bx.Linear(node / "lin", 3, rng))
    with pytest.raises(ValueError, match="forward and backward are the same module"):
        bx.Bidirectional(g / "bi2", fwd, fwd)
    with pytest.raises(ValueError, match=r"merge must be one of \['concat', 'sum'\]"):
        bx.Bidirectional(g / "bi3", fwd, bwd, merge="max")
    with pytest.raises(TypeError, match="merge must be a string or a function"):
        bx.Bidirectional(g / "bi4", fwd, bwd, merge=3)
    bi = bx.Bidirectional(g / "bi5", fwd, bwd, merge="sum")
    x = jnp.ones((2, 5, 3))
    params = rng.seed(bx.Params(), seed=0)
    (y, _), params = bi(params, x)
    assert y.shape == (2, 5, 4)
    with pytest.raises(ValueError, match=r"Bidirectional 'net/bi5': seq_lengths must be in"):
        bi(params, x, seq_lengths=[6, 1])
    with pytest.raises(ValueError, match=r"Bidirectional 'net/bi5': prev_state must be a pair"):
        bi(params, x, prev_state=bx.GRUState(jnp.zeros((2, 4))))


@pytest.mark.parametrize("kind", CELLS)
@pytest.mark.parametrize("features", [1, 64])
def test_default_input_kernel_scale_is_lecun_over_the_joint_fan_in(kind, features):
    # Closed form: every gate pre-activation sums F input and H recurrent terms; the
    # input weights start at variance 1 / (F + H) for every cell (the LSTM's one kernel
    # over [x, h] has it by its shape). LeCun over F alone started a GRU on one input
    # channel at standard deviation 1, which trained a 2-layer sys-id GRU to about twice
    # TSFast's error (docs/sysid.md, "How the defaults were chosen").
    hidden = 256  # one input row holds kH >= 256 draws: the RMS within ~5 %
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    cell = _cell(kind, g / "cell", hidden, rng)
    _, params = cell.apply(rng.seed(bx.Params(), seed=0), jnp.ones((1, 3, features)))
    weights = {p[-1] if p[-2] != "gates" else "joint": np.asarray(v.value)
               for p, v in params.split()[0].items() if p[-1] in ("kernel",)}  # fmt: skip
    if kind == "LSTM":
        w = weights["joint"][:features]  # the rows of x in the [x, h] kernel
    else:
        w = weights["kernel"]
    assert w.shape[0] == features
    rms = np.sqrt(np.mean(w.astype(np.float64) ** 2))
    np.testing.assert_allclose(rms, 1 / np.sqrt(features + hidden), rtol=0.15)
    # (LeCun over F alone: 1 / sqrt(F), 16x larger at F = 1, 2.2x at F = 64)
