"""Recurrent layers in their default ``lax.scan`` mode inside ``jax.shard_map`` over a data
axis (the defect guarded: the zero initial state was invariant over the axis while the
state after one step varies with the batch shard, and ``lax.scan`` refused the carry).

Reference: the same layer on one device over the whole batch with ``is_static=True`` (the
Python-loop scan, no ``lax.scan``): rows are independent, so each shard's rows equal the
single-device rows. The table-wide checks (every layer under ``shard_map``,
``make_dp_train_step`` and as a pipeline stage) are in ``test_layer_contract.py``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from tests.tolerances import tol

F32 = tol(jnp.float32)
B, T, F, H = 4, 5, 3, 4
CELLS = {"LSTM": bx.LSTM, "GRU": bx.GRU, "SimpleRNN": bx.SimpleRNN, "MGU": bx.MGU}


def _setup(cls):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    cell = cls(g / "cell", H, rng)
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(B, T, F)), jnp.float32)
    resets = jnp.asarray(r.random((B, T)) < 0.3)
    lengths = jnp.asarray([T, 2, 0, 4], jnp.int32)
    params = cell.apply(rng.seed(bx.Params(), seed=0), x)[1].locked()
    return cell, params, x, resets, lengths


def _programs(cell):
    """Three ways to run the cell over time, each returning ``(outputs, final state)``."""

    def default(p, x, resets, lengths):
        return cell.apply(p, x, is_reset=resets, seq_lengths=lengths)[0]

    def given_state(p, x, state):  # a carried state from outside: invariant over 'data'
        return cell.apply(p, x, prev_state=state)[0]

    def hand_written(p, x):  # the user's own lax.scan over one-step calls
        state, p = cell.initial_state(p, x[:, 0])

        def body(s, x_t):
            (y, s), _ = cell(p, x_t, s)
            return s, y

        state, ys = jax.lax.scan(body, state, jnp.swapaxes(x, 0, 1))
        return jnp.swapaxes(ys, 0, 1), state

    return default, given_state, hand_written


@pytest.mark.parametrize("types", ["explicit", "auto"])
@pytest.mark.parametrize("name", list(CELLS))
def test_lax_scan_recurrence_inside_shard_map_equals_one_device(name, types):
    cell, params, x, resets, lengths = _setup(CELLS[name])
    default, given_state, hand_written = _programs(cell)
    state0 = jax.tree.map(lambda v: v + 0.5, cell.initial_state(params, x[:, 0])[0])

    cell.is_static = True  # the reference: Python loop, one device, whole batch
    with jax.default_matmul_precision("highest"):
        ref = (
            default(params, x, resets, lengths),
            given_state(params, x, jax.tree.map(lambda v: jnp.tile(v[:2], (2, 1)), state0)),
            hand_written(params, x),
        )
    cell.is_static = False

    mesh = bx.parallel.make_mesh((2,), ("data",), devices=jax.devices()[:2], axis_types=types)
    d, rep = P("data"), P()

    def body(p, x, resets, lengths, s):
        return (default(p, x, resets, lengths), given_state(p, x, s), hand_written(p, x))

    run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(rep, d, d, d, rep), out_specs=d))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    with jax.default_matmul_precision("highest"):
        got = run(
            put(params, rep),
            put(x, d),
            put(resets, d),
            put(lengths, d),
            jax.tree.map(lambda v: put(v[:2], rep), state0),  # the same 2 rows on each shard
        )
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), **F32)
