"""`MoE` against independent references.

* The layer (dropless ``ragged_dot`` path, and the capacity path with no drops) equals a
  by-hand loop over per-expert dense MLPs, routed with ``argsort`` (not ``top_k``),
  forward and every gradient (router, experts, shared expert, input), the losses
  included; f32 at rtol 1e-5, bf16 at the suite's bf16 tolerance.
* Capacity dispatch: for a fixed routing table the kept choices, slots, per-expert
  counts and drops equal tables computed by hand (top-1 choices before top-2, then
  token order), per group.
* The balancing and z losses equal closed forms (uniform router: ``k`` and
  ``log(E)**2``) and a NumPy computation on random logits.
* The routing bias only chooses: the gate weights stay the scores, no gradient flows
  to the bias, and `update_bias` has the formula's signs and zero mean.
* The tiled grouped matmul (the dropless path on XLA:CPU) equals a NumPy row-by-row
  product and its gradients, for empty groups, one group holding every row, row counts
  below, at and off the tile size, and under ``jax.vmap``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx
from blox.nn import _moe
from tests.nn.layer_table import cast_floats, numpy_params
from tests.tolerances import tol

D, E, F, FS = 6, 4, 8, 5
HIGHEST = jax.lax.Precision.HIGHEST


def _build(**kw):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    moe = bx.MoE(g / "moe", E, F, rng, **kw)
    return moe, rng


def _x(n_batch=3, t=5, seed=0, dtype=jnp.float32):
    return jnp.asarray(np.random.default_rng(seed).standard_normal((n_batch, t, D)), dtype)


def _init(moe, rng, x):
    """The layer's params filled with NumPy normals (no initializer compiled)."""
    return numpy_params(moe, rng.seed(bx.Params(), seed=1), x).locked()


def _weights(params, prefix):
    return {k[-1]: v for k, v in params.arrays().items() if k[:-1] == ("net", "moe", prefix)}


# ---------------------------------------------------------------------------------------
# the by-hand reference: every expert a dense MLP over all tokens, masked by the routing


def _mlp(x, w, gated, act):
    up = jnp.dot(x, w["up"], precision=HIGHEST)
    h = act(jnp.dot(x, w["gate"], precision=HIGHEST)) * up if gated else act(up)
    return jnp.dot(h, w["down"], precision=HIGHEST)


def _reference(arrays, x, *, k, score, normalize, gated, keep=None, bias=None):
    """``(y, balance, z, load)`` written out: routing by a descending argsort of the
    scores (+ bias), a Python loop over experts each a dense MLP on every token."""
    act = jax.nn.silu
    d = x.shape[-1]
    xt = x.reshape(-1, d).astype(jnp.float32)
    router = arrays[("net", "moe", "router", "kernel")].astype(jnp.float32)
    logits = jnp.dot(xt, router, precision=HIGHEST)
    n_experts = router.shape[1]
    scores = jax.nn.softmax(logits, -1) if score == "softmax" else jax.nn.sigmoid(logits)
    choose = scores if bias is None else scores + bias[None, :]
    chosen = jnp.argsort(-jax.lax.stop_gradient(choose), axis=-1, stable=True)[:, :k]
    g = jnp.take_along_axis(scores, chosen, -1)
    if normalize:
        g = g / jnp.sum(g, -1, keepdims=True)
    if keep is not None:
        g = g * jnp.asarray(keep, g.dtype)
    experts = {
        name: arrays[("net", "moe", "experts", name)]
        for name in ("gate", "up", "down")
        if ("net", "moe", "experts", name) in arrays
    }
    y = jnp.zeros_like(xt)
    for e in range(n_experts):
        w_e = {name: v[e].astype(jnp.float32) for name, v in experts.items()}
        weight = jnp.sum(jnp.where(chosen == e, g, 0.0), axis=-1)
        y = y + weight[:, None] * _mlp(xt, w_e, gated, act)
    shared = {kk[-1]: v for kk, v in arrays.items() if kk[:3] == ("net", "moe", "shared")}
    if shared:
        y = y + _mlp(xt, {n: v.astype(jnp.float32) for n, v in shared.items()}, gated, act)
    probs = scores if score == "softmax" else scores / jnp.sum(scores, -1, keepdims=True)
    n = xt.shape[0]
    load = jnp.sum(jax.nn.one_hot(chosen, n_experts), axis=(0, 1))
    balance = n_experts * jnp.sum((load / n) * jnp.mean(probs, 0))
    z = jnp.mean(jax.nn.logsumexp(logits, -1) ** 2)
    return y.reshape(x.shape), balance, z, load


def _jit_reference(arrays, x, **kw):
    """`_reference` compiled as one program (eager, every op would compile alone)."""
    keep, bias = kw.pop("keep", None), kw.pop("bias", None)
    keep = None if keep is None else np.asarray(keep, np.float32)

    def f(arrays, x, keep, bias):
        return _reference(arrays, x, keep=keep, bias=bias, **kw)

    return jax.jit(f)(arrays, x, keep, bias)


CASES = [
    dict(score="softmax", k=1, shared=False, normalize=False, gated=True),
    dict(score="softmax", k=2, shared=True, normalize=True, gated=True),
    dict(score="sigmoid", k=1, shared=True, normalize=False, gated=False),
    dict(score="sigmoid", k=2, shared=False, normalize=True, gated=True),
    dict(score="softmax", k=2, shared=False, normalize=False, gated=False),
    dict(score="sigmoid", k=2, shared=True, normalize=False, gated=True),
    dict(score="softmax", k=1, shared=True, normalize=True, gated=False),
    dict(score="sigmoid", k=1, shared=False, normalize=True, gated=True),
]
BW, ZW = 0.1, 0.01


def _case_layer(case, **extra):
    return _build(
        top_k=case["k"],
        score=case["score"],
        normalize=case["normalize"],
        gated=case["gated"],
        shared_hidden_size=FS if case["shared"] else None,
        balance_weight=BW,
        z_weight=ZW,
        **extra,
    )


def _both_grads(moe, params, x, case):
    """Loss, outputs and gradients (every trainable leaf and x) of the layer and of the
    reference, for ``sum(y * r) + aux loss``."""
    r = jnp.asarray(np.random.default_rng(7).standard_normal(x.shape), jnp.float32)
    train, rest = params.split()

    def layer_loss(t, x):
        (y, aux), _ = moe(t.merge(rest), x)
        return jnp.sum(y.astype(jnp.float32) * r) + aux["aux_loss"], (y, aux)

    def ref_loss(t, x):
        y, bal, z, load = _reference(
            t.merge(rest).arrays(),
            x,
            k=case["k"],
            score=case["score"],
            normalize=case["normalize"],
            gated=case["gated"],
        )
        return jnp.sum(y * r) + BW * bal + ZW * z, (y, bal, z, load)

    grad = functools.partial(jax.value_and_grad, argnums=(0, 1), has_aux=True)

    def both(train, x):  # one program: one compilation
        return grad(layer_loss)(train, x), grad(ref_loss)(train, x)

    with jax.default_matmul_precision("highest"):
        return jax.jit(both)(train, x)


def _close(a, b, what, dtype=jnp.float32):
    np.testing.assert_allclose(
        np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=what, **tol(dtype)
    )


@pytest.mark.parametrize("matmul", ["tiled", "ragged_dot"])
@pytest.mark.parametrize(
    "case", CASES, ids=[f"{c['score']}-k{c['k']}-shared{int(c['shared'])}" for c in CASES]
)
def test_dropless_equals_a_loop_over_dense_experts_forward_and_gradients(case, matmul, monkeypatch):
    """Both grouped products of the dropless path: the tiled one XLA:CPU runs while its
    gathered weights stay small, and ``ragged_dot`` (accelerators, large CPU layers),
    forced here by a zero size limit."""
    if matmul == "ragged_dot":
        monkeypatch.setattr(_moe, "_TILED_MAX_BYTES", -1)
    moe, rng = _case_layer(case)
    x = _x()
    params = _init(moe, rng, x)
    ((loss, (y, aux)), (g_t, g_x)), ((ref, (ry, bal, z, load)), (rg_t, rg_x)) = _both_grads(
        moe, params, x, case
    )
    _close(y, ry, "y")
    _close(aux["balance_loss"], bal, "balance loss")
    _close(aux["z_loss"], z, "z loss")
    np.testing.assert_array_equal(np.asarray(aux["load"]), np.asarray(load))
    assert float(aux["dropped"]) == 0.0
    _close(loss, ref, "loss")
    _close(g_x, rg_x, "d/dx")
    got, want = g_t.arrays(), rg_t.arrays()
    assert got.keys() == want.keys()
    for path in got:
        _close(got[path], want[path], f"d/d{'/'.join(path)}")
        assert float(jnp.max(jnp.abs(want[path]))) > 0, path  # every gradient is exercised


def test_capacity_without_drops_equals_dropless():
    """The dense buffer path (capacity_factor = E/k: C = N/G, nothing can drop), the
    one expert parallelism uses, against the same by-hand reference."""
    case = CASES[1]
    moe, rng = _case_layer(case, capacity_factor=E / case["k"], groups=3)
    x = _x()
    params = _init(moe, rng, x)
    assert moe.capacity(15) == 5
    ((loss, (y, aux)), (g_t, g_x)), ((ref, (ry, *_)), (rg_t, rg_x)) = _both_grads(
        moe, params, x, case
    )
    assert float(aux["dropped"]) == 0.0
    _close(y, ry, "y")
    _close(g_x, rg_x, "d/dx")
    for path, v in g_t.arrays().items():
        _close(v, rg_t.arrays()[path], f"d/d{'/'.join(path)}")


def test_bfloat16_params_and_inputs_match_the_reference_at_the_bf16_tolerance():
    case = CASES[1]
    moe, rng = _case_layer(case)
    x = _x()
    params = _init(moe, rng, x)
    p16 = cast_floats(params, jnp.bfloat16)
    x16 = jnp.asarray(np.asarray(x).astype(jnp.bfloat16))
    (y, aux), _ = jax.jit(moe)(p16, x16)
    assert y.dtype == jnp.bfloat16 and aux["aux_loss"].dtype == jnp.float32
    (_, gates, logits), _ = jax.jit(moe.route)(p16, x16.reshape(-1, D))
    assert gates.dtype == logits.dtype == jnp.float32  # the router runs in float32
    # The reference in float32 from the same bf16-rounded values.
    ref = {k: np.asarray(v, np.float32) for k, v in p16.arrays().items()}
    with jax.default_matmul_precision("highest"):
        ry, *_ = _jit_reference(
            ref,
            x16.astype(jnp.float32),
            k=2,
            score="softmax",
            normalize=True,
            gated=True,
        )
    scale = float(jnp.max(jnp.abs(ry)))
    np.testing.assert_allclose(
        np.asarray(y, np.float32), np.asarray(ry), rtol=2e-2, atol=2e-2 * scale
    )


# ---------------------------------------------------------------------------------------
# capacity dispatch: exact tables

# (top-1, top-2) per token, 6 tokens, 3 experts.
TABLE = [(0, 1), (0, 2), (0, 1), (1, 0), (2, 1), (1, 2)]


def _table_layer(groups, capacity_factor=0.5):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    moe = bx.MoE(g / "moe", 3, F, rng, top_k=2, capacity_factor=capacity_factor, groups=groups)
    return moe, rng


@pytest.mark.parametrize(
    "groups, capacity, keep, slots",
    [
        # One group, C = ceil(0.5 * 2 * 6 / 3) = 2. Top-1 choices first, in token order:
        # t0, t1 fill e0, t2 is dropped; t3, t5 -> e1; t4 -> e2. Then top-2: t0 -> e1
        # (full, dropped), t1 -> e2 (slot 1), t2, t3, t4, t5 dropped (e1, e0, e1, e2 full).
        (
            1,
            2,
            [(1, 0), (1, 1), (0, 0), (1, 0), (1, 0), (1, 0)],
            [(0, 6), (1, 5), (6, 6), (2, 6), (4, 6), (3, 6)],
        ),
        # Two groups of 3 tokens, C = ceil(0.5 * 2 * 3 / 3) = 1 per expert per group.
        # Group 0: top-1 t0 -> e0; t1, t2 (e0) dropped; top-2 t0 -> e1, t1 -> e2, t2 (e1)
        # dropped. Group 1: top-1 t3 -> e1, t4 -> e2, t5 (e1) dropped; top-2 t3 -> e0,
        # t4 (e1), t5 (e2) dropped.
        (
            2,
            1,
            [(1, 1), (0, 1), (0, 0), (1, 1), (1, 0), (0, 0)],
            [(0, 1), (3, 2), (3, 3), (1, 0), (2, 3), (3, 3)],
        ),
    ],
    ids=["one-group", "two-groups"],
)
def test_capacity_dispatch_equals_the_hand_table(groups, capacity, keep, slots):
    moe, rng = _table_layer(groups)
    assert moe.capacity(6) == capacity
    experts = jnp.asarray(TABLE, jnp.int32).reshape(groups, 6 // groups, 2)
    slot, kept = moe.dispatch_slots(experts, capacity)
    np.testing.assert_array_equal(np.asarray(kept).reshape(6, 2), np.asarray(keep, bool))
    np.testing.assert_array_equal(np.asarray(slot).reshape(6, 2), np.asarray(slots))

    # The whole layer routed to TABLE: the router is the identity and token t is
    # 3 * onehot(top-1) + 2 * onehot(top-2), so its scores rank the table's choices.
    x = np.zeros((6, 3), np.float32)
    for t, (a, b) in enumerate(TABLE):
        x[t, a], x[t, b] = 3.0, 2.0
    x = jnp.asarray(x)
    params = _init(moe, rng, x).unlocked()
    params[("net", "moe", "router", "kernel")] = bx.Param(jnp.eye(3))
    params = params.locked()
    with jax.default_matmul_precision("highest"):
        (y, aux), _ = jax.jit(moe)(params, x)
        ry, *_ = _jit_reference(
            params.arrays(), x, k=2, score="softmax", normalize=False, gated=True, keep=keep
        )
    _close(y, ry, "y with the hand table's drops")
    assert float(aux["dropped"]) == 12 - int(np.sum(keep))
    # Loads count every choice before drops: e0 4, e1 5, e2 3.
    np.testing.assert_array_equal(np.asarray(aux["load"]), [4.0, 5.0, 3.0])
    # Kept choices per expert per group never exceed C.
    per = np.zeros((groups, 3), int)
    for t, (choice, k_row) in enumerate(zip(TABLE, keep, strict=True)):
        for e, kk in zip(choice, k_row, strict=True):
            per[t // (6 // groups), e] += kk
    assert per.max() <= capacity


def test_groups_must_divide_the_tokens():
    moe, rng = _table_layer(groups=4)
    with pytest.raises(ValueError, match=r"'net/moe': groups=4 does not divide the 6 tokens"):
        moe(rng.seed(bx.Params(), seed=0), jnp.ones((6, 3)))


# ---------------------------------------------------------------------------------------
# losses: closed forms


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("k", [1, 2])
def test_a_uniform_router_gives_balance_k_and_z_log_e_squared(score, k):
    moe, rng = _build(top_k=k, score=score)
    x = _x()
    params = _init(moe, rng, x).unlocked()
    params[("net", "moe", "router", "kernel")] = bx.Param(jnp.zeros((D, E)))
    (_, aux), _ = jax.jit(moe)(params.locked(), x)
    np.testing.assert_allclose(float(aux["balance_loss"]), k, rtol=1e-6)
    np.testing.assert_allclose(float(aux["z_loss"]), np.log(E) ** 2, rtol=1e-6)
    np.testing.assert_allclose(float(aux["aux_loss"]), 0.01 * k, rtol=1e-6)  # default weights


def test_losses_equal_numpy_on_random_logits():
    moe, rng = _build(top_k=2, score="sigmoid", balance_weight=0.5, z_weight=0.25)
    x = _x(seed=3)
    params = _init(moe, rng, x)
    (_, aux), _ = jax.jit(moe)(params, x)
    xt = np.asarray(x, np.float64).reshape(-1, D)
    logits = xt @ np.asarray(params[("net", "moe", "router", "kernel")].value, np.float64)
    s = 1 / (1 + np.exp(-logits))
    top = np.argsort(-s, axis=1, kind="stable")[:, :2]
    density = np.bincount(top.ravel(), minlength=E) / len(xt)
    prob = (s / s.sum(1, keepdims=True)).mean(0)
    balance = np.mean(density * prob) * E**2
    lse = np.log(np.exp(logits).sum(1))
    z = np.mean(lse**2)
    np.testing.assert_allclose(float(aux["balance_loss"]), balance, rtol=1e-5)
    np.testing.assert_allclose(float(aux["z_loss"]), z, rtol=1e-5)
    np.testing.assert_allclose(float(aux["aux_loss"]), 0.5 * balance + 0.25 * z, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# aux-loss-free routing bias


def test_the_routing_bias_chooses_experts_but_never_weights_them():
    moe, rng = _build(top_k=1, routing_bias=True)
    x = _x()
    params = _init(moe, rng, x)
    bias_path = ("net", "moe", "router", "bias")
    assert not params[bias_path].trainable
    call = jax.jit(moe)
    (y0, _), _ = call(params, x)
    # A large bias on expert 3 sends every token there; its gate stays its score.
    biased = params.unlocked()
    biased[bias_path] = bx.Param(jnp.asarray([0.0, 0.0, 0.0, 10.0]), trainable=False)
    biased = biased.locked()
    xt = x.reshape(-1, D)
    (experts, gates, logits), _ = jax.jit(moe.route)(biased, xt)
    np.testing.assert_array_equal(np.asarray(experts), 3)
    np.testing.assert_allclose(
        np.asarray(gates[:, 0]), np.asarray(jax.nn.softmax(logits, -1)[:, 3]), rtol=1e-6
    )
    with jax.default_matmul_precision("highest"):
        (y, aux), _ = call(biased, x)
        ry, *_ = _jit_reference(
            biased.arrays(),
            x,
            k=1,
            score="softmax",
            normalize=False,
            gated=True,
            bias=biased[bias_path].value,
        )
    _close(y, ry, "y with the bias")
    np.testing.assert_array_equal(np.asarray(aux["load"]), [0, 0, 0, 15])
    assert not np.allclose(np.asarray(y), np.asarray(y0))

    # No gradient reaches the bias, even when asked for it.
    def f(b):
        p = biased.unlocked()
        p[bias_path] = bx.Param(b, trainable=False)
        (y, aux), _ = moe(p.locked(), x)
        return jnp.sum(y) + aux["aux_loss"]

    grad = jax.jit(jax.grad(f))(biased[bias_path].value)
    np.testing.assert_array_equal(np.asarray(grad), 0.0)


def test_update_bias_has_the_formula_sign_and_zero_mean_and_changes_only_the_bias():
    moe, rng = _build(top_k=2, routing_bias=True)
    params = _init(moe, rng, _x())
    load = jnp.asarray([5.0, 1.0, 1.0, 1.0])  # mean 2: expert 0 overloaded
    new = moe.update_bias(params, load, rate=0.1)
    bias0 = np.asarray(params[("net", "moe", "router", "bias")].value)
    bias = np.asarray(new[("net", "moe", "router", "bias")].value) - bias0
    # sign(mean - load) = [-1, 1, 1, 1], centred: minus its mean 0.5.
    np.testing.assert_allclose(bias, 0.1 * np.array([-1.5, 0.5, 0.5, 0.5]), rtol=1e-6)
    assert abs(bias.sum()) < 1e-7
    assert bias[0] < 0 < bias[1]
    for path, v in params.arrays().items():
        if path[-1] != "bias":
            np.testing.assert_array_equal(np.asarray(new[path].value), np.asarray(v))
    assert not new[("net", "moe", "router", "bias")].trainable
    # A balanced load leaves the bias unchanged.
    same = moe.update_bias(params, jnp.full((E,), 3.0), rate=0.1)
    path = ("net", "moe", "router", "bias")
    np.testing.assert_array_equal(np.asarray(same[path].value), np.asarray(params[path].value))


def test_update_bias_errors_name_the_layer():
    moe, rng = _build(top_k=2)
    params = _init(moe, rng, _x())
    with pytest.raises(ValueError, match=r"MoE 'net/moe' has no routing bias.*routing_bias=True"):
        moe.update_bias(params, jnp.ones((E,)))
    moe_b, rng_b = _build(top_k=2, routing_bias=True)
    params_b = _init(moe_b, rng_b, _x())
    with pytest.raises(ValueError, match=r"load must have shape \(E,\) = \(4,\).*got \(3,\)"):
        moe_b.update_bias(params_b, jnp.ones((3,)))


def test_constructor_errors_name_the_layer():
    g = bx.Graph("net")
    with pytest.raises(ValueError, match=r"MoE 'net/a': top_k must be an int in \[1, "):
        bx.MoE(g / "a", 4, 8, None, top_k=5)
    with pytest.raises(ValueError, match=r"MoE 'net/b': score must be 'softmax' or 'sigmoid'"):
        bx.MoE(g / "b", 4, 8, None, score="relu")
    with pytest.raises(ValueError, match=r"MoE 'net/c': capacity_factor must be None"):
        bx.MoE(g / "c", 4, 8, None, capacity_factor=0.0)


def test_plain_grad_inside_shard_map_with_replicated_params_equals_one_device():
    """``jax.grad`` inside ``shard_map`` over replicated (``P()``) params: the grouped
    matmul's hand-written VJP sums the weight gradient over the data axis (the transpose
    of the implicit broadcast), as autodiff does for every other op."""
    moe, rng = _build(top_k=2)
    x = _x(n_batch=4, t=2)
    train, rest = _init(moe, rng, x).split()
    mesh = jax.make_mesh(
        (4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:4]
    )

    def loss(t, x):
        (y, aux), _ = moe(t.merge(rest), x)
        return jnp.sum(y * y) + aux["aux_loss"]

    def per_shard(t, x):
        return jax.grad(lambda t: jax.lax.psum(loss(t, x), "data"))(t)

    P = jax.sharding.PartitionSpec
    with jax.default_matmul_precision("highest"):
        got = jax.jit(
            jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
        )(train, x)
        want = jax.jit(jax.grad(lambda t: sum(loss(t, x[i : i + 1]) for i in range(4))))(train)
    for path, v in want.arrays().items():
        _close(got.arrays()[path], v, "/".join(path))


@pytest.mark.parametrize(
    "sizes, tile",
    [
        ((3, 0, 5, 0, 2), 4),  # empty groups, cuts inside tiles, M = 10 off the tile
        ((0, 0, 8, 0, 0), 4),  # one group holds every row
        ((1, 2, 1, 3, 1), 64),  # M below the tile
        ((4, 4, 4, 4, 0), 4),  # boundaries on the tiles
    ],
)
@pytest.mark.parametrize("matmul", ["tiled", "ragged_dot"])
def test_grouped_matmuls_equal_numpy_rows_and_gradients(sizes, tile, matmul):
    """`tiled_grouped_matmul` and `grouped_matmul` (``jax.lax.ragged_dot`` with its own
    backward, and a loop under ``jax.vmap``)."""
    r = np.random.default_rng(sum(sizes) + tile)
    m, g, k, n = sum(sizes), len(sizes), 3, 2
    lhs, ct = r.standard_normal((m, k)), r.standard_normal((m, n))
    rhs = r.standard_normal((g, k, n))
    group = np.repeat(np.arange(g), sizes)
    want = np.einsum("mk,mkn->mn", lhs, rhs[group])
    want_dl = np.einsum("mn,mkn->mk", ct, rhs[group])
    want_dr = np.zeros_like(rhs)
    np.add.at(want_dr, group, np.einsum("mk,mn->mkn", lhs, ct))
    sz = jnp.asarray(sizes, jnp.int32)

    def f(a, b):
        if matmul == "ragged_dot":
            return _moe.grouped_matmul(a, b, sz)
        return _moe.tiled_grouped_matmul(a, b, sz, HIGHEST, tile=tile)

    @jax.jit
    def run(a, b, c):
        y, vjp = jax.vjp(f, a, b)
        return y, *vjp(c), jax.vmap(f, in_axes=(0, None))(jnp.stack([a, 2 * a]), b)

    a, b = jnp.asarray(lhs, jnp.float32), jnp.asarray(rhs, jnp.float32)
    y, dl, dr, twice = run(a, b, jnp.asarray(ct, jnp.float32))
    for got, ref in ((y, want), (dl, want_dl), (dr, want_dr)):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(twice[1]), 2 * want, rtol=1e-5, atol=1e-5)
