"""What a pipeline time slot runs: only the transfers some device makes in it (per the
static schedule program) and no gradient arithmetic in forward and idle slots, with
gradients equal to the sequential one-device model; `unstack_stages` compiles once per
shape and mesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blox.parallel import _pipeline, unstack_stages
from tests.parallel.test_pipeline_interleaved import (
    P,
    check_against_sequential,
    mesh,
    mlp_step,
)


def _subjaxprs(eqn):
    """The jaxprs an equation runs, with their trip counts: a scan's body ``length``
    times; a cond's / switch's branches as alternatives (None); others once."""
    p = eqn.params
    if eqn.primitive.name == "scan":
        return [(p["jaxpr"].jaxpr, p["length"])]
    if eqn.primitive.name == "cond":
        return [(b.jaxpr, None) for b in p["branches"]]
    if eqn.primitive.name == "while":
        raise AssertionError("a while loop: its trip count is not static")
    out = []
    for v in p.values():
        for j in v if isinstance(v, (tuple, list)) else (v,):
            inner = getattr(j, "jaxpr", j)
            if hasattr(inner, "eqns"):
                out.append((inner, 1))
    return out


def ppermutes_run(jaxpr) -> int:
    """The ``ppermute``\\ s one device runs: each in the jaxpr times the trip counts of
    the scans around it; of a conditional's branches, the one that runs the most (an
    upper bound of the branch the static program takes)."""
    n = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ppermute":
            n += 1
            continue
        subs = _subjaxprs(eqn)
        alternatives = [ppermutes_run(j) for j, k in subs if k is None]
        n += max(alternatives, default=0)
        n += sum(k * ppermutes_run(j) for j, k in subs if k is not None)
    return n


@pytest.mark.parametrize("m", [4, 8, 16])
def test_1f1b_slot_sends_once(m):
    """A 1F1B step of 2 (m + p - 1) slots sends one transfer per slot at most: the
    devices doing a forward send their activation to the next stage and those doing a
    backward their cotangent to the previous one in the same ``ppermute`` (no device
    receives both in one slot). The runtime that sent both directions in every slot ran
    4 (m + p - 1)."""
    step, args = mlp_step("1f1b", m)
    n = ppermutes_run(jax.make_jaxpr(step)(*args).jaxpr)
    assert n <= 2 * (m + P - 1), (n, 2 * (m + P - 1))


@pytest.mark.parametrize("schedule", ["1f1b", "1f1b-2f"])
def test_slots_match_sequential(schedule):
    """Gradients and state equal the sequential model's when each slot sends only its
    groups (``'1f1b-2f'``: two forwards per cell, two groups in some slots). ZB-H1 and
    interleaved (circular transfers) are checked in their own files."""
    check_against_sequential(schedule, 8, 1)


def test_unstack_stages_compiles_once_per_shape_and_mesh():
    """Two calls on arrays of one shape and mesh trace the split once (the jitted
    function's cache holds one entry more after the first call, none after the
    second); the result is the stacked array's rows."""
    sharding = jax.sharding.NamedSharding(mesh(), jax.sharding.PartitionSpec("stage"))
    x = jax.device_put(jnp.arange(P * 3.0).reshape(P, 3), sharding)
    stacked = {"w": x}
    split = _pipeline._unstack_whole
    before = split._cache_size()
    first = unstack_stages(stacked)
    after_first = split._cache_size()
    second = unstack_stages({"w": jax.device_put(jnp.arange(P * 3.0).reshape(P, 3) + 1, sharding)})
    assert after_first == before + 1
    assert split._cache_size() == after_first
    for k in range(P):
        np.testing.assert_array_equal(np.asarray(first[k]["w"]), np.arange(3.0) + 3 * k)
        np.testing.assert_array_equal(np.asarray(second[k]["w"]), np.arange(3.0) + 3 * k + 1)
