"""`GRU`, `SimpleRNN` and `Bidirectional` against PyTorch on CPU, weights copied across.

Each test initializes the blox layer with a forward pass, overwrites its parameters with
the PyTorch module's weights, and compares the forward pass *and* the gradients of a
scalar loss with respect to the inputs, the initial state and every weight.

Tolerances: ``tests/tolerances.py`` ``tol(dtype)`` (f32 ``rtol=1e-5, atol=1e-6``; f64
``rtol=1e-10, atol=1e-12``); float64 runs inside ``jax.enable_x64(True)``.

Weight mapping (PyTorch -> blox), the same for ``nn.GRU`` (gates r, z, n) and ``nn.RNN``:
``kernel = weight_ih_l0.T``, ``recurrent_kernel = weight_hh_l0.T``, ``bias = bias_ih_l0``,
``recurrent_bias = bias_hh_l0``; the ``_reverse`` weights go to the backward layer of
`Bidirectional`. Sequence lengths are checked against ``pack_padded_sequence``.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

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

KINDS = ["GRU", "SimpleRNN"]
_NAMES = ("kernel", "recurrent_kernel", "bias", "recurrent_bias")


def _torch_rnn(kind: str, f: int, h: int, dtype: str, bidirectional: bool = False):
    torch.manual_seed(0)
    cls = torch.nn.GRU if kind == "GRU" else torch.nn.RNN
    return cls(f, h, batch_first=True, bidirectional=bidirectional, dtype=TORCH_DTYPES[dtype])


def _torch_weights(ref, suffix: str = "", grad: bool = False) -> tuple[np.ndarray, ...]:
    """(kernel, recurrent_kernel, bias, recurrent_bias) in blox's layout."""
    ts = [getattr(ref, f"{n}_l0{suffix}") for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
    w_ih, w_hh, b_ih, b_hh = (to_np(t.grad if grad else t) for t in ts)
    return w_ih.T.copy(), w_hh.T.copy(), b_ih, b_hh


def _make(kind: str, node, h: int, rng, dtype: str, is_static: bool):
    cls = bx.GRU if kind == "GRU" else bx.SimpleRNN
    return cls(node, h, rng, is_static=is_static, param_dtype=dtype)


def _blox_rnn(kind, ref, f, h, dtype, is_static):
    """An initialized layer at 'net/rnn' holding `ref`'s weights: ``(layer, params)``."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    layer = _make(kind, g / "rnn", h, rng, dtype, is_static)
    params = layout(layer.apply, rng.seed(bx.Params(), seed=0), jnp.zeros((1, 2, f), dtype))
    weights = dict(zip([("net", "rnn", n) for n in _NAMES], _torch_weights(ref), strict=True))
    params = load_weights(params, weights)
    assert set(params.keys()) == {("net", "rng", "seed"), ("net", "rng", "counter"), *weights}
    return layer, params


@pytest.mark.parametrize("kind", KINDS)
def test_torch_weights_copied_without_transpose_are_named(kind):
    """weight_ih_l0 (gH, F) and weight_hh_l0 (gH, H) copied without ``.T``: the error names
    the stored parameter, its shape and the expected one, and says it is transposed (the
    square (H, H) weight_hh of nn.RNN cannot be told apart and is not checked here)."""
    f, h = 3, 5
    ref = _torch_rnn(kind, f, h, "float32")
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    layer = _make(kind, g / "rnn", h, rng, "float32", is_static=False)
    params = layout(layer.apply, rng.seed(bx.Params(), seed=0), jnp.zeros((1, 2, f)))
    gates = "3H" if kind == "GRU" else "H"
    cases = [("kernel", ref.weight_ih_l0, f"(F, {gates})")]
    if kind == "GRU":
        cases.append(("recurrent_kernel", ref.weight_hh_l0, f"(H, {gates})"))
    for name, weight, legend in cases:
        wrong = params.unlocked()
        wrong[("net", "rnn", name)] = bx.Param(jnp.asarray(to_np(weight)))
        stored = tuple(weight.shape)
        with pytest.raises(
            ValueError,
            match=rf"Parameter 'net/rnn/{name}' is stored with shape "
            + re.escape(f"{stored}, but {kind} 'net/rnn' expects {stored[::-1]} = {legend} ")
            + r"for F=3, H=5\. The stored value is transposed",
        ):
            layer.apply(wrong.locked(), jnp.zeros((2, 4, f)))


def _check_weight_grads(g_params, base, ref, dtype, suffix="") -> None:
    expected = _torch_weights(ref, suffix, grad=True)
    for name, want in zip(_NAMES, expected, strict=True):
        assert_close(g_params[(*base, name)].value, want, dtype, f"d/d {base}/{name}")


def _inputs(seed, b, t, f, h, dtype, n_state=1):
    rs = np.random.default_rng(seed)
    x = rs.standard_normal((b, t, f)).astype(dtype)
    h0 = (0.5 * rs.standard_normal((n_state, b, h))).astype(dtype)
    r = rs.standard_normal((b, t, n_state * h)).astype(dtype)
    rh = rs.standard_normal((n_state, b, h)).astype(dtype)
    return x, h0, r, rh


# ---------------------------------------------------------------------------
# Whole sequences, one step
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_sequence_matches_torch(kind, dtype):
    """layer.apply on x [B=3, T=6, F=4], H=5, from a given h0, vs torch.nn.GRU / RNN(tanh):
    outputs, final h, and gradients of ``sum(out * r) + sum(h_T * rh)`` w.r.t. x, h0 and
    the four weights. Tolerance: tol(dtype). (The static scan is checked against PyTorch
    in the lengths test and against the dynamic scan in test_rnn.py.)"""
    b, t, f, h = 3, 6, 4, 5
    ref = _torch_rnn(kind, f, h, dtype)
    x, h0, r, rh = _inputs(1, b, t, f, h, dtype)
    x_t, h0_t = torch.tensor(x, requires_grad=True), torch.tensor(h0, requires_grad=True)
    out_t, hT_t = ref(x_t, h0_t)
    ((out_t * torch.tensor(r)).sum() + (hT_t * torch.tensor(rh)).sum()).backward()

    with dtype_context(dtype):
        layer, params = _blox_rnn(kind, ref, f, h, dtype, is_static=False)
        state_cls = type(layer.initial_state(params, jnp.zeros((b, f), dtype))[0])

        def loss(params, x, h0):
            (out, state), _ = layer.apply(params, x, prev_state=state_cls(h0))
            return jnp.sum(out * jnp.asarray(r)) + jnp.sum(state.hidden * jnp.asarray(rh[0]))

        (out, state), new = layer.apply(
            params, jnp.asarray(x), prev_state=state_cls(jnp.asarray(h0[0]))
        )
        assert new.is_locked and isinstance(state, state_cls)
        assert_close(out, to_np(out_t), dtype, f"{kind} outputs")
        assert_close(state.hidden, to_np(hT_t[0]), dtype, f"{kind} final h")
        g_params, g_x, g_h0 = jit_grads(loss, params, jnp.asarray(x), jnp.asarray(h0[0]))

    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x")
    assert_close(g_h0, to_np(h0_t.grad[0]), dtype, "d/d h0")
    _check_weight_grads(g_params, ("net", "rnn"), ref, dtype)


def test_simple_rnn_relu_matches_torch():
    """SimpleRNN(activation=relu) vs torch.nn.RNN(nonlinearity='relu'), float32 forward
    and d/dx. Tolerance: tol(float32)."""
    b, t, f, h = 2, 5, 3, 4
    torch.manual_seed(0)
    ref = torch.nn.RNN(f, h, nonlinearity="relu", batch_first=True)
    x, _, r, _ = _inputs(2, b, t, f, h, "float32")
    x_t = torch.tensor(x, requires_grad=True)
    out_t, _ = ref(x_t)
    (out_t * torch.tensor(r)).sum().backward()
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    layer = bx.SimpleRNN(g / "rnn", h, rng, activation=jax.nn.relu)
    params = layout(layer.apply, rng.seed(bx.Params(), seed=0), jnp.zeros((1, 2, f)))
    params = load_weights(
        params, dict(zip([("net", "rnn", n) for n in _NAMES], _torch_weights(ref), strict=True))
    )
    (out, _), _ = layer.apply(params, jnp.asarray(x))
    assert_close(out, to_np(out_t), "float32", "relu RNN outputs")
    _, g_x = jit_grads(
        lambda p, x: jnp.sum(layer.apply(p, x)[0][0] * jnp.asarray(r)), params, jnp.asarray(x)
    )
    assert_close(g_x, to_np(x_t.grad), "float32", "d/d x (relu)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
def test_single_step_matches_torch_cell(kind, dtype):
    """One ``layer(params, x_t, state)`` step vs torch.nn.GRUCell / RNNCell with the same
    weights: new h and gradients w.r.t. x_t, h and the weights. Tolerance: tol(dtype)."""
    b, f, h = 4, 3, 6
    ref = _torch_rnn(kind, f, h, dtype)
    cell_cls = torch.nn.GRUCell if kind == "GRU" else torch.nn.RNNCell
    cell = cell_cls(f, h, dtype=TORCH_DTYPES[dtype])
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(cell, name).copy_(getattr(ref, f"{name}_l0"))
    rs = np.random.default_rng(4)
    x, h0, rh = (rs.standard_normal(s).astype(dtype) for s in ((b, f), (b, h), (b, h)))
    x_t, h0_t = torch.tensor(x, requires_grad=True), torch.tensor(h0, requires_grad=True)
    h1_t = cell(x_t, h0_t)
    (h1_t * torch.tensor(rh)).sum().backward()

    with dtype_context(dtype):
        layer, params = _blox_rnn(kind, ref, f, h, dtype, is_static=False)
        state_cls = bx.GRUState if kind == "GRU" else bx.SimpleRNNState
        (out, state), _ = layer(params, jnp.asarray(x), state_cls(jnp.asarray(h0)))
        assert_close(out, to_np(h1_t), dtype, "step output")
        assert_close(state.hidden, to_np(h1_t), dtype, "step h")

        def loss(params, x, h0):
            (_, state), _ = layer(params, x, state_cls(h0))
            return jnp.sum(state.hidden * jnp.asarray(rh))

        g_params, g_x, g_h0 = jit_grads(loss, params, jnp.asarray(x), jnp.asarray(h0))

    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x_t")
    assert_close(g_h0, to_np(h0_t.grad), dtype, "d/d h")
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        getattr(ref, f"{name}_l0").grad = getattr(cell, name).grad
    _check_weight_grads(g_params, ("net", "rnn"), ref, dtype)


# ---------------------------------------------------------------------------
# Sequence lengths vs packed sequences
# ---------------------------------------------------------------------------

LENGTHS = np.array([6, 2, 4, 1])


def _pack(x_t: torch.Tensor):
    return pack_padded_sequence(x_t, torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False)


@pytest.mark.parametrize(
    "kind, dtype, is_static",
    [
        ("GRU", "float32", True),
        ("GRU", "float32", False),
        ("GRU", "float64", False),
        ("SimpleRNN", "float32", False),
        ("SimpleRNN", "float64", False),
    ],
    ids=["GRU-f32-static", "GRU-f32-dynamic", "GRU-f64-dynamic", "RNN-f32", "RNN-f64"],
)
def test_seq_lengths_match_torch_packed(kind, dtype, is_static):
    """``seq_lengths`` [B] vs ``pack_padded_sequence(enforce_sorted=False)``: outputs
    (zero past each length, ``pad_packed_sequence(total_length=T)``), the final state
    (the state after each row's last valid step, torch's h_n) and gradients w.r.t. x
    (zero on the padding), h0 and the weights. Tolerance: tol(dtype)."""
    b, t, f, h = 4, 6, 3, 5
    ref = _torch_rnn(kind, f, h, dtype)
    x, h0, r, rh = _inputs(5, b, t, f, h, dtype)
    x_t, h0_t = torch.tensor(x, requires_grad=True), torch.tensor(h0, requires_grad=True)
    packed = pack_padded_sequence(
        x_t, torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False
    )
    out_p, hT_t = ref(packed, h0_t)
    out_t, _ = pad_packed_sequence(out_p, batch_first=True, total_length=t)
    ((out_t * torch.tensor(r)).sum() + (hT_t * torch.tensor(rh)).sum()).backward()

    with dtype_context(dtype):
        layer, params = _blox_rnn(kind, ref, f, h, dtype, is_static)
        state_cls = bx.GRUState if kind == "GRU" else bx.SimpleRNNState

        def run(params, x, h0):
            return layer.apply(params, x, prev_state=state_cls(h0), seq_lengths=LENGTHS)

        (out, state), _ = run(params, jnp.asarray(x), jnp.asarray(h0[0]))
        assert_close(out, to_np(out_t), dtype, "outputs with lengths")
        assert_close(state.hidden, to_np(hT_t[0]), dtype, "final h with lengths")

        def loss(params, x, h0):
            (out, state), _ = run(params, x, h0)
            return jnp.sum(out * jnp.asarray(r)) + jnp.sum(state.hidden * jnp.asarray(rh[0]))

        g_params, g_x, g_h0 = jit_grads(loss, params, jnp.asarray(x), jnp.asarray(h0[0]))

    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x with lengths")
    assert not np.asarray(g_x)[1, 2:].any()  # row 1 has length 2
    assert_close(g_h0, to_np(h0_t.grad[0]), dtype, "d/d h0 with lengths")
    _check_weight_grads(g_params, ("net", "rnn"), ref, dtype)


# ---------------------------------------------------------------------------
# Resets vs PyTorch per segment
# ---------------------------------------------------------------------------


def _reset_flags(b: int, t: int) -> np.ndarray:
    """Row 0 never resets, row 1 at t=0 and t=3, the others at random steps."""
    flags = np.random.default_rng(5).random((b, t)) < 0.3
    flags[0] = False
    flags[1] = False
    flags[1, [0, 3]] = True
    return flags


def _segments(flags_row: np.ndarray) -> list[tuple[int, int]]:
    t = len(flags_row)
    starts = [0] + [s for s in range(1, t) if flags_row[s]]
    return list(zip(starts, starts[1:] + [t], strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gru_resets_match_torch_segments(dtype):
    """GRU ``is_reset`` [B, T] with B == H (jax-blox 0.1.6 reset hidden columns there)
    vs torch.nn.GRU run per row on the segments between resets from a zero state (the
    first from h0 unless the row resets at t=0): outputs, final h and gradients w.r.t.
    x, h0 and the weights. Tolerance: tol(dtype)."""
    b = h = 4
    t, f = 7, 3
    ref = _torch_rnn("GRU", f, h, dtype)
    flags = _reset_flags(b, t)
    x, h0, r, rh = _inputs(6, b, t, f, h, dtype)
    x_t, h0_t = torch.tensor(x, requires_grad=True), torch.tensor(h0, requires_grad=True)
    outs, finals = [], []
    for row in range(b):
        state = None if flags[row, 0] else h0_t[:, row : row + 1]
        pieces = []
        for k, (s, e) in enumerate(_segments(flags[row])):
            out, state = ref(x_t[row : row + 1, s:e], None if k else state)
            pieces.append(out)
        outs.append(torch.cat(pieces, 1))
        finals.append(state[0])
    out_t, hT_t = torch.cat(outs, 0), torch.cat(finals, 0)
    ((out_t * torch.tensor(r)).sum() + (hT_t * torch.tensor(rh[0])).sum()).backward()

    with dtype_context(dtype):
        layer, params = _blox_rnn("GRU", ref, f, h, dtype, is_static=False)

        def run(params, x, h0):
            return layer.apply(params, x, bx.GRUState(h0), is_reset=jnp.asarray(flags))

        (out, state), _ = run(params, jnp.asarray(x), jnp.asarray(h0[0]))
        assert_close(out, to_np(out_t), dtype, "outputs with resets")
        assert_close(state.hidden, to_np(hT_t), dtype, "final h with resets")

        def loss(params, x, h0):
            (out, state), _ = run(params, x, h0)
            return jnp.sum(out * jnp.asarray(r)) + jnp.sum(state.hidden * jnp.asarray(rh[0]))

        g_params, g_x, g_h0 = jit_grads(loss, params, jnp.asarray(x), jnp.asarray(h0[0]))

    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x with resets")
    assert_close(g_h0, to_np(h0_t.grad[0]), dtype, "d/d h0 with resets")
    np.testing.assert_array_equal(np.asarray(g_h0)[1], 0.0)  # row 1 resets at t=0
    _check_weight_grads(g_params, ("net", "rnn"), ref, dtype)


# ---------------------------------------------------------------------------
# Bidirectional
# ---------------------------------------------------------------------------


def _blox_bidirectional(kind, ref, f, h, dtype, is_static):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    node = g / "bi"
    if kind == "LSTM":
        fwd = bx.LSTM(node / "fwd", h, rng, is_static=is_static, param_dtype=dtype)
        bwd = bx.LSTM(node / "bwd", h, rng, is_static=is_static, param_dtype=dtype)
    else:
        fwd = _make(kind, node / "fwd", h, rng, dtype, is_static)
        bwd = _make(kind, node / "bwd", h, rng, dtype, is_static)
    bi = bx.Bidirectional(node, fwd, bwd)
    params = layout(bi, rng.seed(bx.Params(), seed=0), jnp.zeros((1, 2, f), dtype))
    weights = {}
    for direction, suffix in (("fwd", ""), ("bwd", "_reverse")):
        base = ("net", "bi", direction)
        if kind == "LSTM":
            w_ih, w_hh, b_ih, b_hh = (
                to_np(getattr(ref, f"{n}_l0{suffix}"))
                for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
            )
            weights[(*base, "gates", "kernel")] = lstm_kernel_from_torch(w_ih, w_hh)
            weights[(*base, "gates", "bias")] = lstm_bias_from_torch(b_ih + b_hh)
        else:
            values = _torch_weights(ref, suffix)
            weights.update(zip([(*base, n) for n in _NAMES], values, strict=True))
    params = load_weights(params, weights)
    assert set(params.keys()) == {("net", "rng", "seed"), ("net", "rng", "counter"), *weights}
    return bi, params


@pytest.mark.parametrize(
    "dtype, with_lengths",
    [("float32", False), ("float32", True), ("float64", True)],
    ids=["f32", "f32-lengths", "f64-lengths"],
)
def test_bidirectional_gru_matches_torch(dtype, with_lengths):
    """Bidirectional(GRU, GRU) vs torch.nn.GRU(bidirectional=True) from a given h0 [2, B,
    H]; with lengths, on packed sequences (the backward direction reverses each row
    within its length). Outputs [B, T, 2H] (forward | backward), both final states
    (torch h_n[0], h_n[1]) and gradients w.r.t. x, h0 and both directions' weights.
    Tolerance: tol(dtype)."""
    b, t, f, h = 4, 6, 3, 5
    ref = _torch_rnn("GRU", f, h, dtype, bidirectional=True)
    x, h0, r, rh = _inputs(7, b, t, f, h, dtype, n_state=2)
    x_t, h0_t = torch.tensor(x, requires_grad=True), torch.tensor(h0, requires_grad=True)
    if with_lengths:
        packed = _pack(x_t)
        out_p, hT_t = ref(packed, h0_t)
        out_t, _ = pad_packed_sequence(out_p, batch_first=True, total_length=t)
    else:
        out_t, hT_t = ref(x_t, h0_t)
    ((out_t * torch.tensor(r)).sum() + (hT_t * torch.tensor(rh)).sum()).backward()
    lengths = LENGTHS if with_lengths else None

    with dtype_context(dtype):
        bi, params = _blox_bidirectional("GRU", ref, f, h, dtype, is_static=False)

        def run(params, x, h0):
            prev = (bx.GRUState(h0[0]), bx.GRUState(h0[1]))
            return bi(params, x, prev, seq_lengths=lengths)

        (out, (s_f, s_b)), _ = run(params, jnp.asarray(x), jnp.asarray(h0))
        assert_close(out, to_np(out_t), dtype, "bidirectional outputs")
        assert_close(s_f.hidden, to_np(hT_t[0]), dtype, "forward final h")
        assert_close(s_b.hidden, to_np(hT_t[1]), dtype, "backward final h")

        def loss(params, x, h0):
            (out, (s_f, s_b)), _ = run(params, x, h0)
            return (
                jnp.sum(out * jnp.asarray(r))
                + jnp.sum(s_f.hidden * jnp.asarray(rh[0]))
                + jnp.sum(s_b.hidden * jnp.asarray(rh[1]))
            )

        g_params, g_x, g_h0 = jit_grads(loss, params, jnp.asarray(x), jnp.asarray(h0))

    assert_close(g_x, to_np(x_t.grad), dtype, "d/d x (bidirectional)")
    assert_close(g_h0, to_np(h0_t.grad), dtype, "d/d h0 (bidirectional)")
    _check_weight_grads(g_params, ("net", "bi", "fwd"), ref, dtype)
    _check_weight_grads(g_params, ("net", "bi", "bwd"), ref, dtype, suffix="_reverse")


def test_bidirectional_lstm_with_lengths_matches_torch():
    """Bidirectional(LSTM, LSTM) vs torch.nn.LSTM(bidirectional=True) on packed
    sequences: outputs, final (h, c) of both directions and d/dx. Tolerance:
    tol(float32)."""
    b, t, f, h = 4, 6, 3, 5
    torch.manual_seed(0)
    ref = torch.nn.LSTM(f, h, batch_first=True, bidirectional=True)
    x, _, r, _ = _inputs(8, b, t, f, h, "float32", n_state=2)
    x_t = torch.tensor(x, requires_grad=True)
    packed = pack_padded_sequence(
        x_t, torch.tensor(LENGTHS), batch_first=True, enforce_sorted=False
    )
    out_p, (hT_t, cT_t) = ref(packed)
    out_t, _ = pad_packed_sequence(out_p, batch_first=True, total_length=t)
    (out_t * torch.tensor(r)).sum().backward()

    bi, params = _blox_bidirectional("LSTM", ref, f, h, "float32", is_static=False)
    (out, (s_f, s_b)), _ = bi(params, jnp.asarray(x), seq_lengths=LENGTHS)
    assert_close(out, to_np(out_t), "float32", "bidirectional LSTM outputs")
    for i, s in enumerate((s_f, s_b)):
        assert_close(s.hidden, to_np(hT_t[i]), "float32", f"direction {i} final h")
        assert_close(s.cell, to_np(cT_t[i]), "float32", f"direction {i} final c")
    _, g_x = jit_grads(
        lambda p, x: jnp.sum(bi(p, x, seq_lengths=LENGTHS)[0][0] * jnp.asarray(r)),
        params,
        jnp.asarray(x),
    )
    assert_close(g_x, to_np(x_t.grad), "float32", "d/d x (bidirectional LSTM)")


def test_bidirectional_resets_match_torch_segments():
    """Bidirectional(GRU, GRU) with ``is_reset`` and ``seq_lengths``: every segment
    between resets (cut at the row's length) equals torch.nn.GRU(bidirectional=True) run
    on that segment alone from zeros; outputs are zero past the length. Outputs and
    d/dx, float32. Tolerance: tol(float32)."""
    b, t, f, h = 4, 7, 3, 4
    lengths = np.array([7, 5, 6, 3])
    ref = _torch_rnn("GRU", f, h, "float32", bidirectional=True)
    flags = _reset_flags(b, t)
    x, _, r, _ = _inputs(9, b, t, f, h, "float32", n_state=2)
    x_t = torch.tensor(x, requires_grad=True)
    rows = []
    for row in range(b):
        pieces = []
        for s, e in _segments(flags[row]):
            e = min(e, lengths[row])
            if s < e:
                pieces.append(ref(x_t[row : row + 1, s:e])[0])
        pieces.append(x_t.new_zeros(1, t - lengths[row], 2 * h))
        rows.append(torch.cat(pieces, 1))
    out_t = torch.cat(rows, 0)
    (out_t * torch.tensor(r)).sum().backward()

    bi, params = _blox_bidirectional("GRU", ref, f, h, "float32", is_static=False)

    def run(params, x):
        return bi(params, x, is_reset=jnp.asarray(flags), seq_lengths=lengths)[0][0]

    assert_close(run(params, jnp.asarray(x)), to_np(out_t), "float32", "outputs, resets")
    _, g_x = jit_grads(lambda p, x: jnp.sum(run(p, x) * jnp.asarray(r)), params, jnp.asarray(x))
    assert_close(g_x, to_np(x_t.grad), "float32", "d/d x, resets")
