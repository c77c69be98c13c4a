"""`Linear`, `MLP` and `LSTM` against PyTorch on CPU, with the weights copied across.

Every test builds the blox layer, takes its own parameter layout from an abstract forward
pass (``torch_reference.layout``: no initializer runs), fills it with the PyTorch module's weights
(transposed / reordered as documented) and compares the forward pass *and* the gradients of
a scalar loss with respect to the inputs and to every weight.

Tolerances: ``tests/tolerances.py`` ``tol(dtype)``, i.e. ``rtol=1e-5, atol=1e-6`` in float32
and ``rtol=1e-10, atol=1e-12`` in float64. float64 runs inside ``jax.enable_x64(True)``
(a context manager, so x64 never leaks into other tests). The shared helpers (weight
loading, conversions, comparisons) live in ``tests/nn/torch_reference.py``.

Weight mapping (PyTorch -> blox):

* ``nn.Linear``: ``kernel (in, out) = weight.T``, ``bias = bias``.
* ``nn.LSTM``: the gate rows of ``weight_ih (4H, F)`` / ``weight_hh (4H, H)`` are in the
  order i, f, g, o; blox's ``gates/kernel (F + H, 4H)`` acts on ``concat([x, h])`` with
  gate columns in the order i, g, f, o, and ``gates/bias = bias_ih + bias_hh`` (reordered).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import blox as bx
from tests.nn.torch_reference import (
    DTYPES,
    TORCH_DTYPES,
    assert_close,
    dtype_context,
    jit_grads,
    layout,
    load_weights,
    lstm_bias_from_torch,
    lstm_kernel_from_torch,
    to_np,
)
from tests.tolerances import tol

# ---------------------------------------------------------------------------
# Linear
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("use_bias", [True, False])
def test_linear_matches_torch(dtype, use_bias):
    """bx.Linear vs torch.nn.Linear on (2, 3, 5) inputs: outputs, d/dx, d/dkernel, d/dbias.

    Tolerance: tol(dtype) (f32 rtol 1e-5 / atol 1e-6; f64 rtol 1e-10 / atol 1e-12).
    """
    torch.manual_seed(0)
    d_in, d_out = 5, 4
    ref = torch.nn.Linear(d_in, d_out, bias=use_bias, dtype=TORCH_DTYPES[dtype])
    rs = np.random.default_rng(1)
    x = rs.standard_normal((2, 3, d_in)).astype(dtype)
    r = rs.standard_normal((2, 3, d_out)).astype(dtype)

    x_t = torch.tensor(x, requires_grad=True)
    y_t = ref(x_t)
    (y_t * torch.tensor(r)).sum().backward()

    with dtype_context(dtype):
        g = bx.Graph("net")
        rng = bx.Rng(g / "rng")
        layer = bx.Linear(g / "fc", d_out, rng, use_bias=use_bias, param_dtype=dtype)
        params = layout(layer, rng.seed(bx.Params(), seed=0), jnp.zeros((1, d_in), dtype))
        weights = {("net", "fc", "kernel"): to_np(ref.weight).T.copy()}
        if use_bias:
            weights[("net", "fc", "bias")] = to_np(ref.bias)
        params = load_weights(params, weights)
        expected_paths = {("net", "rng", "seed"), ("net", "rng", "counter"), *weights}
        assert set(params.keys()) == expected_paths

        y, _ = layer(params, jnp.asarray(x))
        assert_close(y, to_np(y_t), dtype, "Linear output")

        def loss(params, x):
            y, _ = layer(params, x)
            return jnp.sum(y * jnp.asarray(r))

        g_params, g_x = jit_grads(loss, params, jnp.asarray(x))

    assert_close(g_x, to_np(x_t.grad), dtype, "d loss / d x")
    assert_close(
        g_params[("net", "fc", "kernel")].value, to_np(ref.weight.grad).T, dtype, "d/d kernel"
    )
    if use_bias:
        assert_close(g_params[("net", "fc", "bias")].value, to_np(ref.bias.grad), dtype, "d/d bias")
    assert set(g_params.keys()) == set(weights)


def test_torch_linear_weight_copied_without_transpose_is_named():
    """torch.nn.Linear(5, 4).weight is (out, in) = (4, 5). Stored as is, the error blames
    that parameter (path, stored shape, expected (5, 4), "transposed"), not the input;
    stored as weight.T it gives PyTorch's output (tol float32)."""
    torch.manual_seed(0)
    ref = torch.nn.Linear(5, 4)
    x = np.random.default_rng(2).standard_normal((3, 5)).astype(np.float32)
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    layer = bx.Linear(g / "fc", 4, rng)
    _, params = layer(rng.seed(bx.Params(), seed=0), jnp.zeros((1, 5)))
    params[("net", "fc", "kernel")] = bx.Param(jnp.asarray(to_np(ref.weight)))
    params[("net", "fc", "bias")] = bx.Param(jnp.asarray(to_np(ref.bias)))
    with pytest.raises(
        ValueError,
        match=r"Parameter 'net/fc/kernel' is stored with shape \(4, 5\), but Linear 'net/fc' "
        r"expects \(5, 4\) = \(D_in, D_out\) for input shape \(3, 5\) and output_size=4\. "
        r"The stored value is transposed: .*params\[\('net', 'fc', 'kernel'\)\] = "
        r"bx\.Param\(weight\.T\)",
    ):
        layer(params, jnp.asarray(x))
    params[("net", "fc", "kernel")] = bx.Param(jnp.asarray(to_np(ref.weight).T.copy()))
    y, _ = layer(params, jnp.asarray(x))
    assert_close(y, to_np(ref(torch.tensor(x))), "float32", "Linear output after .T")


def test_torch_lstm_weights_stacked_without_transpose_are_named():
    """torch.nn.LSTM's weights stacked the way blox wants but without the transposes give
    a (4H, F + H) gates kernel; the error names it with the expected (F + H, 4H)."""
    f, h = 3, 4
    ref = _torch_lstm(f, h, "float32")
    lstm, params = _blox_lstm(ref, f, h, "float32", is_static=False)
    wrong = np.concatenate([to_np(ref.weight_ih_l0), to_np(ref.weight_hh_l0)], axis=1)
    assert wrong.shape == (4 * h, f + h)
    params = params.unlocked()
    params[("net", "lstm", "gates", "kernel")] = bx.Param(jnp.asarray(wrong))
    with pytest.raises(
        ValueError,
        match=r"Parameter 'net/lstm/gates/kernel' is stored with shape \(16, 7\), but LSTM "
        r"'net/lstm' expects \(7, 16\) = \(F \+ H, 4H\) for F=3, H=4\. The stored value is "
        r"transposed",
    ):
        lstm.apply(params.locked(), jnp.zeros((2, 5, f)))


# ---------------------------------------------------------------------------
# MLP
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "activation, torch_activation, activate_final",
    [(jax.nn.relu, torch.nn.ReLU, False), (jnp.tanh, torch.nn.Tanh, True)],
    ids=["relu", "tanh-final"],
)
def test_mlp_matches_torch(dtype, activation, torch_activation, activate_final):
    """bx.MLP (5 -> 16 -> 8 -> 3) vs a torch.nn.Sequential of Linear + activation layers:
    outputs and gradients w.r.t. the inputs and every kernel and bias.

    Tolerance: tol(dtype) (f32 rtol 1e-5 / atol 1e-6; f64 rtol 1e-10 / atol 1e-12).
    """
    torch.manual_seed(0)
    sizes = (16, 8, 3)
    d_in = 5
    tdt = TORCH_DTYPES[dtype]
    linears = []
    layers = []
    prev = d_in
    for i, size in enumerate(sizes):
        lin = torch.nn.Linear(prev, size, dtype=tdt)
        linears.append(lin)
        layers.append(lin)
        if i < len(sizes) - 1 or activate_final:
            layers.append(torch_activation())
        prev = size
    ref = torch.nn.Sequential(*layers)

    rs = np.random.default_rng(2)
    x = rs.standard_normal((7, d_in)).astype(dtype)
    r = rs.standard_normal((7, sizes[-1])).astype(dtype)
    x_t = torch.tensor(x, requires_grad=True)
    y_t = ref(x_t)
    (y_t * torch.tensor(r)).sum().backward()

    with dtype_context(dtype):
        g = bx.Graph("net")
        rng = bx.Rng(g / "rng")
        mlp = bx.MLP(
            g / "mlp",
            sizes,
            rng,
            activation=activation,
            activate_final=activate_final,
            param_dtype=dtype,
        )
        params = layout(mlp, rng.seed(bx.Params(), seed=0), jnp.zeros((1, d_in), dtype))
        weights = {}
        for i, lin in enumerate(linears):
            weights[("net", "mlp", f"linear_{i}", "kernel")] = to_np(lin.weight).T.copy()
            weights[("net", "mlp", f"linear_{i}", "bias")] = to_np(lin.bias)
        params = load_weights(params, weights)

        y, _ = mlp(params, jnp.asarray(x))
        assert_close(y, to_np(y_t), dtype, "MLP output")

        def loss(params, x):
            y, _ = mlp(params, x)
            return jnp.sum(y * jnp.asarray(r))

        g_params, g_x = jit_grads(loss, params, jnp.asarray(x))

    assert_close(g_x, to_np(x_t.grad), dtype, "d loss / d x")
    assert set(g_params.keys()) == set(weights)
    for i, lin in enumerate(linears):
        base = ("net", "mlp", f"linear_{i}")
        assert_close(
            g_params[base + ("kernel",)].value, to_np(lin.weight.grad).T, dtype, f"{base} kernel"
        )
        assert_close(g_params[base + ("bias",)].value, to_np(lin.bias.grad), dtype, f"{base} bias")


# ---------------------------------------------------------------------------
# LSTM
# ---------------------------------------------------------------------------


def _torch_lstm(f: int, h: int, dtype: str) -> torch.nn.LSTM:
    torch.manual_seed(0)
    return torch.nn.LSTM(f, h, batch_first=True, dtype=TORCH_DTYPES[dtype])


def _blox_lstm(ref: torch.nn.LSTM, f: int, h: int, dtype: str, is_static: bool):
    """An initialized bx.LSTM holding `ref`'s weights: ``(lstm, locked params)``."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    lstm = bx.LSTM(g / "lstm", h, rng, is_static=is_static, param_dtype=dtype)
    params = layout(lstm.apply, rng.seed(bx.Params(), seed=0), jnp.zeros((1, 2, f), dtype))
    kernel = lstm_kernel_from_torch(to_np(ref.weight_ih_l0), to_np(ref.weight_hh_l0))
    bias = lstm_bias_from_torch(to_np(ref.bias_ih_l0) + to_np(ref.bias_hh_l0))
    params = load_weights(
        params, {("net", "lstm", "gates", "kernel"): kernel, ("net", "lstm", "gates", "bias"): bias}
    )
    assert set(params.keys()) == {
        ("net", "rng", "seed"),
        ("net", "rng", "counter"),
        ("net", "lstm", "gates", "kernel"),
        ("net", "lstm", "gates", "bias"),
    }
    return lstm, params


def _check_lstm_grads(g_params, ref: torch.nn.LSTM, dtype: str) -> None:
    """blox gate-kernel/bias gradients against PyTorch's, mapped to blox's layout."""
    assert ref.weight_ih_l0.grad is not None
    # d/d bias_ih == d/d bias_hh == d/d (their sum), which is blox's single bias.
    np.testing.assert_allclose(to_np(ref.bias_ih_l0.grad), to_np(ref.bias_hh_l0.grad), **tol(dtype))
    assert_close(
        g_params[("net", "lstm", "gates", "kernel")].value,
        lstm_kernel_from_torch(to_np(ref.weight_ih_l0.grad), to_np(ref.weight_hh_l0.grad)),
        dtype,
        "d/d gates/kernel",
    )
    assert_close(
        g_params[("net", "lstm", "gates", "bias")].value,
        lstm_bias_from_torch(to_np(ref.bias_ih_l0.grad)),
        dtype,
        "d/d gates/bias",
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "given-state"])
def test_lstm_sequence_matches_torch(dtype, is_static, with_state):
    """lstm.apply on x [B=3, T=6, F=4] with H=5 vs torch.nn.LSTM(batch_first=True):
    outputs [B, T, H], final (h, c), and gradients of
    ``sum(out * r) + sum(h_T * rh) + sum(c_T * rc)`` w.r.t. x, the gate kernel and bias
    (and the initial (h0, c0) when given).

    Tolerance: tol(dtype) (f32 rtol 1e-5 / atol 1e-6; f64 rtol 1e-10 / atol 1e-12).
    """
    b, t, f, h = 3, 6, 4, 5
    ref = _torch_lstm(f, h, dtype)
    rs = np.random.default_rng(3)
    x = rs.standard_normal((b, t, f)).astype(dtype)
    r = rs.standard_normal((b, t, h)).astype(dtype)
    rh = rs.standard_normal((b, h)).astype(dtype)
    rc = rs.standard_normal((b, h)).astype(dtype)
    h0 = (0.5 * rs.standard_normal((b, h))).astype(dtype)
    c0 = (0.5 * rs.standard_normal((b, h))).astype(dtype)

    x_t = torch.tensor(x, requires_grad=True)
    h0_t = torch.tensor(h0[None], requires_grad=True)
    c0_t = torch.tensor(c0[None], requires_grad=True)
    out_t, (hT_t, cT_t) = ref(x_t, (h0_t, c0_t)) if with_state else ref(x_t)
    loss_t = (
        (out_t * torch.tensor(r)).sum()
        + (hT_t[0] * torch.tensor(rh)).sum()
        + (cT_t[0] * torch.tensor(rc)).sum()
    )
    loss_t.backward()

    with dtype_context(dtype):
        lstm, params = _blox_lstm(ref, f, h, dtype, is_static)
        state0 = bx.LSTMState(jnp.asarray(h0), jnp.asarray(c0)) if with_state else None

        (out, state), new_params = lstm.apply(params, jnp.asarray(x), prev_state=state0)
        assert isinstance(state, bx.LSTMState)
        assert new_params.is_locked
        assert_close(out, to_np(out_t), dtype, "LSTM outputs")
        assert_close(state.hidden, to_np(hT_t[0]), dtype, "final h")
        assert_close(state.cell, to_np(cT_t[0]), dtype, "final c")

        def loss(params, x, h0, c0):
            prev = bx.LSTMState(h0, c0) if with_state else None
            (out, state), _ = lstm.apply(params, x, prev_state=prev)
            return (
                jnp.sum(out * jnp.asarray(r))
                + jnp.sum(state.hidden * jnp.asarray(rh))
                + jnp.sum(state.cell * jnp.asarray(rc))
            )

        g_params, g_x, g_h0, g_c0 = jit_grads(
            loss, params, jnp.asarray(x), jnp.asarray(h0), jnp.asarray(c0)
        )

    assert_close(g_x, to_np(x_t.grad), dtype, "d loss / d x")
    _check_lstm_grads(g_params, ref, dtype)
    if with_state:
        assert_close(g_h0, to_np(h0_t.grad[0]), dtype, "d loss / d h0")
        assert_close(g_c0, to_np(c0_t.grad[0]), dtype, "d loss / d c0")


@pytest.mark.parametrize("dtype", DTYPES)
def test_lstm_single_step_matches_torch_cell(dtype):
    """One ``lstm(params, x_t, state)`` step vs torch.nn.LSTMCell with the same weights:
    output, new (h, c), and gradients w.r.t. x_t, h, c and the weights.

    Tolerance: tol(dtype) (f32 rtol 1e-5 / atol 1e-6; f64 rtol 1e-10 / atol 1e-12).
    """
    b, f, h = 4, 3, 6
    ref = _torch_lstm(f, h, dtype)
    cell = torch.nn.LSTMCell(f, h, dtype=TORCH_DTYPES[dtype])
    with torch.no_grad():
        cell.weight_ih.copy_(ref.weight_ih_l0)
        cell.weight_hh.copy_(ref.weight_hh_l0)
        cell.bias_ih.copy_(ref.bias_ih_l0)
        cell.bias_hh.copy_(ref.bias_hh_l0)
    rs = np.random.default_rng(4)
    x = rs.standard_normal((b, f)).astype(dtype)
    h0 = rs.standard_normal((b, h)).astype(dtype)
    c0 = rs.standard_normal((b, h)).astype(dtype)
    rh = rs.standard_normal((b, h)).astype(dtype)
    rc = rs.standard_normal((b, h)).astype(dtype)

    x_t, h0_t, c0_t = (torch.tensor(a, requires_grad=True) for a in (x, h0, c0))
    h1_t, c1_t = cell(x_t, (h0_t, c0_t))
    ((h1_t * torch.tensor(rh)).sum() + (c1_t * torch.tensor(rc)).sum()).backward()

    with dtype_context(dtype):
        lstm, params = _blox_lstm(ref, f, h, dtype, is_static=False)
        (out, state), _ = lstm(
            params, jnp.asarray(x), bx.LSTMState(jnp.asarray(h0), jnp.asarray(c0))
        )
        assert_close(out, to_np(h1_t), dtype, "step output")
        assert_close(state.hidden, to_np(h1_t), dtype, "step h")
        assert_close(state.cell, to_np(c1_t), dtype, "step c")

        def loss(params, x, h0, c0):
            (_, state), _ = lstm(params, x, bx.LSTMState(h0, c0))
            return jnp.sum(state.hidden * jnp.asarray(rh)) + jnp.sum(state.cell * jnp.asarray(rc))

        g_params, g_x, g_h0, g_c0 = jit_grads(
            loss, params, jnp.asarray(x), jnp.asarray(h0), jnp.asarray(c0)
        )

    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x")
    assert_close(g_h0, to_np(h0_t.grad), dtype, "d/d h0")
    assert_close(g_c0, to_np(c0_t.grad), dtype, "d/d c0")
    # LSTMCell's parameters carry the gradients here; copy them onto `ref` for the check.
    ref.weight_ih_l0.grad = cell.weight_ih.grad
    ref.weight_hh_l0.grad = cell.weight_hh.grad
    ref.bias_ih_l0.grad = cell.bias_ih.grad
    ref.bias_hh_l0.grad = cell.bias_hh.grad
    _check_lstm_grads(g_params, ref, dtype)


def _reset_flags(b: int, t: int) -> np.ndarray:
    """[B, T] flags: row 0 never resets, row 1 resets at t=0 and t=3, the rest random."""
    flags = np.random.default_rng(5).random((b, t)) < 0.3
    flags[0] = False
    flags[1] = False
    flags[1, [0, 3]] = True
    return flags


def _torch_lstm_with_resets(ref, x_t, h0_t, c0_t, flags):
    """Reference: each row is cut into segments at its resets; the first segment starts
    from (h0, c0) (zeros if the row resets at t=0), every later one from zeros."""
    b, t, _ = x_t.shape
    h = ref.hidden_size
    outs, hs, cs = [], [], []
    for row in range(b):
        starts = [0] + [s for s in range(1, t) if flags[row, s]]
        ends = starts[1:] + [t]
        if flags[row, 0]:
            state = (x_t.new_zeros(1, 1, h), x_t.new_zeros(1, 1, h))
        else:
            state = (h0_t[:, row : row + 1], c0_t[:, row : row + 1])
        pieces = []
        for k, (s, e) in enumerate(zip(starts, ends, strict=True)):
            if k > 0:
                state = (x_t.new_zeros(1, 1, h), x_t.new_zeros(1, 1, h))
            out, state = ref(x_t[row : row + 1, s:e], state)
            pieces.append(out)
        outs.append(torch.cat(pieces, dim=1))
        hs.append(state[0][0])
        cs.append(state[1][0])
    return torch.cat(outs, dim=0), torch.cat(hs, dim=0), torch.cat(cs, dim=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("b, h", [(3, 5), (4, 4)], ids=["B!=H", "B==H"])
def test_lstm_reset_matches_torch_segments(dtype, is_static, b, h):
    """lstm.apply with ``is_reset`` [B, T] vs PyTorch run per row on the
    segments between resets, restarting from a zero state at each reset (a reset at t=0
    discards the given initial state). Checks outputs, final (h, c) and gradients w.r.t.
    x, h0, c0 and the weights, for B != H and B == H (jax-blox 0.1.6 broadcast [B] flags
    along the hidden axis: an error for B != H, wrong rows reset for B == H).

    Tolerance: tol(dtype) (f32 rtol 1e-5 / atol 1e-6; f64 rtol 1e-10 / atol 1e-12).
    """
    t, f = 7, 3
    ref = _torch_lstm(f, h, dtype)
    flags = _reset_flags(b, t)
    rs = np.random.default_rng(6)
    x = rs.standard_normal((b, t, f)).astype(dtype)
    h0 = rs.standard_normal((b, h)).astype(dtype)
    c0 = rs.standard_normal((b, h)).astype(dtype)
    r = rs.standard_normal((b, t, h)).astype(dtype)
    rh = rs.standard_normal((b, h)).astype(dtype)
    rc = rs.standard_normal((b, h)).astype(dtype)

    x_t = torch.tensor(x, requires_grad=True)
    h0_t = torch.tensor(h0[None], requires_grad=True)
    c0_t = torch.tensor(c0[None], requires_grad=True)
    out_t, hT_t, cT_t = _torch_lstm_with_resets(ref, x_t, h0_t, c0_t, flags)
    (
        (out_t * torch.tensor(r)).sum()
        + (hT_t * torch.tensor(rh)).sum()
        + (cT_t * torch.tensor(rc)).sum()
    ).backward()

    with dtype_context(dtype):
        lstm, params = _blox_lstm(ref, f, h, dtype, is_static)

        def run(params, x, h0, c0):
            return lstm.apply(
                params, x, prev_state=bx.LSTMState(h0, c0), is_reset=jnp.asarray(flags)
            )

        (out, state), _ = run(params, jnp.asarray(x), jnp.asarray(h0), jnp.asarray(c0))
        assert_close(out, to_np(out_t), dtype, "LSTM outputs with resets")
        assert_close(state.hidden, to_np(hT_t), dtype, "final h with resets")
        assert_close(state.cell, to_np(cT_t), dtype, "final c with resets")

        def loss(params, x, h0, c0):
            (out, state), _ = run(params, x, h0, c0)
            return (
                jnp.sum(out * jnp.asarray(r))
                + jnp.sum(state.hidden * jnp.asarray(rh))
                + jnp.sum(state.cell * jnp.asarray(rc))
            )

        g_params, g_x, g_h0, g_c0 = jit_grads(
            loss, params, jnp.asarray(x), jnp.asarray(h0), jnp.asarray(c0)
        )

    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x with resets")
    assert_close(g_h0, to_np(h0_t.grad[0]), dtype, "d/d h0 with resets")
    assert_close(g_c0, to_np(c0_t.grad[0]), dtype, "d/d c0 with resets")
    # Row 1 resets at t=0, so its initial state gets no gradient at all.
    np.testing.assert_array_equal(np.asarray(g_h0)[1], 0.0)
    _check_lstm_grads(g_params, ref, dtype)


@pytest.mark.parametrize("is_static", [True, False], ids=["static", "dynamic"])
def test_lstm_unlocked_params_match_torch(is_static):
    """The init path (unlocked params: dynamic_scan runs step 0 in Python, then lax.scan)
    gives the same outputs as PyTorch. Tolerance: tol(float32)."""
    b, t, f, h = 2, 5, 3, 4
    ref = _torch_lstm(f, h, "float32")
    x = np.random.default_rng(7).standard_normal((b, t, f)).astype(np.float32)
    out_t, (hT_t, cT_t) = ref(torch.tensor(x))
    lstm, params = _blox_lstm(ref, f, h, "float32", is_static)
    (out, state), new_params = lstm.apply(params.unlocked(), jnp.asarray(x))
    assert not new_params.is_locked
    assert_close(out, to_np(out_t), "float32", "outputs (unlocked)")
    assert_close(state.hidden, to_np(hT_t[0]), "float32", "final h (unlocked)")
    assert_close(state.cell, to_np(cT_t[0]), "float32", "final c (unlocked)")


@pytest.mark.parametrize("is_static", [True, False], ids=["static", "dynamic"])
@pytest.mark.parametrize("locked", [True, False], ids=["locked", "unlocked"])
@pytest.mark.parametrize("b, h", [(3, 5), (4, 4)], ids=["B!=H", "B==H"])
def test_lstm_reset_flags_bt1_match_torch_segments(is_static, locked, b, h):
    """``is_reset`` given as [B, T, 1] (the jax-blox 0.1.6 workaround) resets the same
    rows as [B, T]; also on unlocked params (the init path). Forward only, float32,
    against the PyTorch per-segment reference. Tolerance: tol(float32)."""
    t, f = 6, 2
    ref = _torch_lstm(f, h, "float32")
    flags = _reset_flags(b, t)
    rs = np.random.default_rng(8)
    x = rs.standard_normal((b, t, f)).astype(np.float32)
    h0 = rs.standard_normal((b, h)).astype(np.float32)
    c0 = rs.standard_normal((b, h)).astype(np.float32)
    with torch.no_grad():
        out_t, hT_t, cT_t = _torch_lstm_with_resets(
            ref, torch.tensor(x), torch.tensor(h0[None]), torch.tensor(c0[None]), flags
        )
    lstm, params = _blox_lstm(ref, f, h, "float32", is_static)
    if not locked:
        params = params.unlocked()
    (out, state), _ = lstm.apply(
        params,
        jnp.asarray(x),
        prev_state=bx.LSTMState(jnp.asarray(h0), jnp.asarray(c0)),
        is_reset=jnp.asarray(flags[..., None]),
    )
    assert_close(out, to_np(out_t), "float32", "outputs, [B, T, 1] resets")
    assert_close(state.hidden, to_np(hT_t), "float32", "final h, [B, T, 1] resets")
    assert_close(state.cell, to_np(cT_t), "float32", "final c, [B, T, 1] resets")
