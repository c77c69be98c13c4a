"""The recurrent layers share one set of argument checks: every check raises the same
exception, with the same message naming the path and the shapes, for `LSTM`, `GRU`,
`MGU`, `SimpleRNN` and `Bidirectional` (whose state checks are its directions' own).

Each test is one check parametrized over the kinds; the expected messages come from one
table (the layer's path, its state type), not from per-kind copies.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx

CELLS = ["LSTM", "GRU", "MGU", "SimpleRNN"]
KINDS = CELLS + ["Bidirectional"]
B, T, F, H = 2, 3, 3, 4


def _layer(kind: str, hidden_size=H, node=None, rng=None):
    g = bx.Graph("net")
    rng = rng or bx.Rng(g / "rng")
    node = node or g / "layer"
    if kind == "Bidirectional":
        fwd = bx.GRU(node / "fwd", hidden_size, rng, is_static=True)
        bwd = bx.LSTM(node / "bwd", hidden_size, rng, is_static=True)
        return bx.Bidirectional(node, fwd, bwd), rng
    return getattr(bx, kind)(node, hidden_size, rng, is_static=True), rng


@functools.cache
def _built(kind: str):
    """``(layer, locked params, x)``: eager loops (is_static), no compile."""
    layer, rng = _layer(kind)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((B, T, F)), jnp.float32)
    _, params = layer.apply(rng.seed(bx.Params(), seed=0), x)
    return layer, params.locked(), x


def _where(kind: str) -> str:
    """Who a sequence check names: the layer itself."""
    return f"{kind} 'net/layer'"


def _cell_of(kind: str) -> tuple[str, str]:
    """``(kind, path)`` of the cell whose state and weights a check meets first: the
    layer itself, or Bidirectional's forward GRU."""
    return ("GRU", "net/layer/fwd") if kind == "Bidirectional" else (kind, "net/layer")


_STATES = {
    "LSTM": ("an", "LSTMState", ("hidden", "cell")),
    "GRU": ("a", "GRUState", ("hidden",)),
    "MGU": ("a", "MGUState", ("hidden",)),
    "SimpleRNN": ("a", "SimpleRNNState", ("hidden",)),
}


def _state_msg(cell: str, path: str) -> str:
    article, name, fields = _STATES[cell]
    sig = f"({', '.join(fields)})" if len(fields) > 1 else ""
    return re.escape(
        f"{cell} '{path}': prev_state must be {article} {name}{sig} with "
        f"{' and '.join(fields)} [B, H] = ({B}, {H}), got "
    )


def _fix(cell: str) -> str:
    return re.escape(
        "Carry the state returned by the previous call, or build one with "
        f"`state, params = {cell.lower()}.initial_state(params, x_t)`."
    )


def _bad_states(kind: str, make):
    """`make(cell_kind)` builds one direction's state; Bidirectional gets a pair."""
    if kind == "Bidirectional":
        return (make("GRU"), make("LSTM"))
    return make(kind)


# ----------------------------------------------------------------------------- construction


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bad", [True, False, 0, -3, 2.5, "4", None, np.bool_(True)])
def test_hidden_size_must_be_a_positive_int_and_not_a_bool(kind, bad):
    cell, path = _cell_of(kind)
    with pytest.raises(
        ValueError,
        match=re.escape(f"{cell} '{path}': hidden_size must be a positive int, got {bad!r}.")
        + " Pass the width of the state",
    ):
        _layer(kind, hidden_size=bad)


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_size_accepts_numpy_integers_as_int(kind):
    layer, _ = _layer(kind, hidden_size=np.int64(H))
    cells = [layer.forward, layer.backward] if kind == "Bidirectional" else [layer]
    for c in cells:
        assert type(c.hidden_size) is int and c.hidden_size == H


# ----------------------------------------------------------------------------- sequence inputs


@pytest.mark.parametrize("kind", KINDS)
def test_apply_needs_rank_three_inputs(kind):
    layer, params, x = _built(kind)
    for bad in (x[:, 0], x[..., None]):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"{_where(kind)}: apply runs over a whole sequence and needs inputs of shape "
                f"[B, T, F] (rank 3, time on axis 1), got shape {tuple(bad.shape)}."
            ),
        ):
            layer.apply(params, bad)


@pytest.mark.parametrize("kind", KINDS)
def test_seq_lengths_shape_dtype_and_range(kind):
    layer, params, x = _built(kind)
    where = re.escape(_where(kind))
    with pytest.raises(
        ValueError,
        match=where + re.escape(f": seq_lengths must have shape [B] = ({B},)") + r".*\(2, 1\)",
    ):
        layer.apply(params, x, seq_lengths=np.ones((B, 1), np.int32))
    with pytest.raises(TypeError, match=where + r": seq_lengths must be integers, got dtype float"):
        layer.apply(params, x, seq_lengths=np.ones((B,), np.float32))
    for lengths, b, v in (([T, T + 1], 1, T + 1), ([-1, 2], 0, -1)):
        with pytest.raises(
            ValueError,
            match=where
            + re.escape(f": seq_lengths must be in [0, T] = [0, {T}], got seq_lengths[{b}] = {v}"),
        ):
            layer.apply(params, x, seq_lengths=np.asarray(lengths, np.int32))


@pytest.mark.parametrize("kind", KINDS)
def test_is_reset_must_be_batch_by_time(kind):
    layer, params, x = _built(kind)
    for bad in (np.zeros((B,), bool), np.zeros((B, T + 1), bool), np.zeros((B + 1, T), bool)):
        with pytest.raises(
            ValueError,
            match=re.escape(
                f"{_where(kind)}: is_reset must have shape [B, T] = ({B}, {T}) (one flag per "
                f"sequence and step), got {bad.shape}."
            ),
        ):
            layer.apply(params, x, is_reset=bad)


# ----------------------------------------------------------------------------- prev_state


@pytest.mark.parametrize("kind", KINDS)
def test_prev_state_of_the_wrong_type_is_a_type_error(kind):
    layer, params, x = _built(kind)
    cell, path = _cell_of(kind)
    array = jnp.zeros((B, H))
    foreign = {
        "LSTM": bx.GRUState(array),
        "GRU": bx.LSTMState(array, array),
        "MGU": bx.LSTMState(array, array),
        "SimpleRNN": bx.LSTMState(array, array),
    }
    for bad, described in (
        (array, f"array of shape ({B}, {H})"),
        (foreign[cell], type(foreign[cell]).__name__),
        ((array, array, array), "tuple of length 3"),
    ):
        state = (bad, bad) if kind == "Bidirectional" else bad
        with pytest.raises(
            TypeError,
            match=_state_msg(cell, path) + re.escape(described) + r"\. " + _fix(cell),
        ):
            layer.apply(params, x, prev_state=state)


@pytest.mark.parametrize("kind", KINDS)
def test_prev_state_of_the_wrong_shape_names_every_field(kind):
    layer, params, x = _built(kind)
    cell, path = _cell_of(kind)

    def wrong(c):
        name, fields = _STATES[c][1], _STATES[c][2]
        return getattr(bx, name)(*[jnp.zeros((B, H + 1)) for _ in fields])

    fields = _STATES[cell][2]
    got = ", ".join(f"{f}: array of shape ({B}, {H + 1})" for f in fields)
    with pytest.raises(
        ValueError,
        match=_state_msg(cell, path) + re.escape(f"{_STATES[cell][1]} with {got}. ") + _fix(cell),
    ):
        layer.apply(params, x, prev_state=_bad_states(kind, wrong))


@pytest.mark.parametrize("kind", KINDS)
def test_plain_tuple_of_the_state_fields_is_accepted(kind):
    """A plain tuple of the state's fields gives the numbers of the zero start."""
    layer, params, x = _built(kind)

    def zeros(c):
        return tuple(jnp.zeros((B, H)) for _ in _STATES[c][2])

    (y, state), _ = layer.apply(params, x, prev_state=_bad_states(kind, zeros))
    (y_ref, state_ref), _ = layer.apply(params, x)
    np.testing.assert_array_equal(y, y_ref)
    # Converted to the state type (a NamedTuple has another tree structure than a tuple).
    assert jax.tree.structure(state) == jax.tree.structure(state_ref)


# ----------------------------------------------------------------------------- one step


@pytest.mark.parametrize("kind", CELLS)  # Bidirectional has no one-step call
def test_one_step_needs_a_state_and_a_two_dimensional_input(kind):
    layer, params, x = _built(kind)
    name = kind.lower()
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"The {kind} __call__ method requires a valid prev_state ('net/layer' runs one "
            f"step). Get one with `state, params = {name}.initial_state(params, x_t)`, or run "
            f"a whole sequence with {name}.apply(params, x)."
        ),
    ):
        layer(params, x[:, 0])
    state, _ = layer.initial_state(params, x[:, 0])
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{kind} 'net/layer': one step takes inputs of shape [B, F], got {tuple(x.shape)}. "
            f"For a sequence [B, T, F] use {name}.apply(params, x)."
        ),
    ):
        layer(params, x, state)
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{kind} 'net/layer': is_reset for one step must have shape [B] = ({B},), got (3,)."
        ),
    ):
        layer(params, x[:, 0], state, is_reset=jnp.zeros((3,), bool))


# ----------------------------------------------------------------------------- stored weights

_KERNELS = {  # the input kernel: (path under the cell, shape, layout)
    "LSTM": ("gates/kernel", (F + H, 4 * H), "(F + H, 4H)"),
    "GRU": ("kernel", (F, 3 * H), "(F, 3H)"),
    "MGU": ("kernel", (F, 2 * H), "(F, 2H)"),
    "SimpleRNN": ("kernel", (F, H), "(F, H)"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_input_of_another_size_names_the_size_the_kernel_expects(kind):
    layer, params, x = _built(kind)
    cell, path = _cell_of(kind)
    name, shape, layout = _KERNELS[cell]
    wide = jnp.ones((B, T, F + 2))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"{cell} '{path}' expects inputs with {F} features ({name} {shape} = {layout} "
            f"with H={H}), got input shape ({B}, {F + 2}). Fix the input's last dimension; "
            f"or, if '{path}/{name}' was made for another input size, replace it or "
            "re-initialize."
        ),
    ):
        layer.apply(params, wide)


@pytest.mark.parametrize("kind", KINDS)
def test_a_transposed_kernel_is_blamed_with_the_pytorch_hint(kind):
    layer, params, x = _built(kind)
    cell, path = _cell_of(kind)
    name, shape, layout = _KERNELS[cell]
    full = tuple(path.split("/")) + tuple(name.split("/"))
    p = params.unlocked()
    p[full] = bx.Param(jnp.asarray(np.asarray(p[full].value).T))
    with pytest.raises(
        ValueError,
        match=re.escape(
            f"Parameter '{path}/{name}' is stored with shape {shape[::-1]}, but {cell} "
            f"'{path}' expects {shape} = {layout} for F={F}, H={H}. The stored value is "
            "transposed: PyTorch stores weights as (out, in) and blox as (in, out), so "
            f"store the transpose, e.g. params[{full!r}] = bx.Param(weight.T)."
        ),
    ):
        layer.apply(p.locked(), x)
