"""Expert parallelism against one device (8 simulated CPU devices).

* EP = 8, EP x DP = 2 x 4, EP x TP = 4 x 2 (tensor parallelism inside the experts) and
  EP x FSDP = 4 x 2 (expert kernels also split over 'data', gathered and
  reduce-scattered by the step), each on an Explicit and an Auto mesh, train 3 steps
  equal to one device (1e-5): a dropless `MoE` on one device (``ragged_dot``) against
  the dense all-to-all path with the worst-case capacity, the balancing and z losses
  weighted > 0, the routing bias updated every step from the global loads.
* With drops (capacity factor 1), one device with ``groups = N`` equals EP = N: the
  same tokens dropped, the same outputs and gradients.
* Expert kernels per device are 1/N of the unsharded ones (N: the devices they are
  split over).
* `ragged_dispatch_plan`'s offsets and sizes, run through a NumPy model of
  ``ragged_all_to_all``, deliver every row to its expert's device grouped by local
  expert and bring it back to its place; ``dispatch='ragged'`` on XLA:CPU raises.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp
from tests.nn.layer_table import numpy_params

D, E, F = 8, 8, 8
B, T = 16, 4  # 64 tokens: 8 per device on 8 devices
RULES = bp.moe_ep_rules() + [(".*", None)]
LR, RATE = 0.1, 0.01


def _mesh(shape, names, kind):
    t = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[kind]
    return jax.make_mesh(shape, names, axis_types=(t,) * len(shape))


def _layers(token_axes, model_axis=None, **kw):
    """The EP layer and a plain `MoE` at the same paths (one Params serves both)."""
    cfg = dict(top_k=2, routing_bias=True, balance_weight=0.1, z_weight=0.01, **kw)
    g1, g2 = bx.Graph("net"), bx.Graph("net")
    ep = bp.ExpertParallelMoE(
        g1 / "moe", E, F, bx.Rng(g1 / "rng"), token_axes=token_axes, model_axis=model_axis, **cfg
    )
    rng = bx.Rng(g2 / "rng")
    one = bx.MoE(g2 / "moe", E, F, rng, **cfg)
    return ep, one, rng


def _data(seed=0):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((B, T, D)), jnp.float32)
    target = jnp.asarray(r.standard_normal((B, T, D)), jnp.float32)
    return x, target


def _init(one, rng, x):
    """The layer's params filled with NumPy normals (no initializer compiled); the
    routing bias starts at zero."""
    params = numpy_params(one, rng.seed(bx.Params(), seed=0), x).unlocked()
    params[("net", "moe", "router", "bias")] = bx.Param(jnp.zeros((E,)), trainable=False)
    return params.locked()


def _loss_fn(layer):
    def loss_fn(params, x, target):
        (y, aux), params = layer(params, x)
        return (jnp.mean(jnp.square(y - target)) + aux["aux_loss"], aux), params

    return loss_fn


def _one_device_steps(one, params, x, target, steps):
    """Plain jax.grad + SGD + the bias update, on one device, over the whole batch."""
    loss_fn = _loss_fn(one)

    @jax.jit
    def step(params):
        train, rest = params.split()

        def f(t):
            (loss, aux), _ = loss_fn(t.merge(rest), x, target)
            return loss, aux

        (loss, aux), g = jax.value_and_grad(f, has_aux=True)(train)
        train = jax.tree.map(lambda p, g: p - LR * g, train, g)
        params = one.update_bias(train.merge(rest), aux["load"], RATE)
        return params, loss, aux

    out = []
    for _ in range(steps):
        params, loss, aux = step(params)
        out.append((float(loss), np.asarray(aux["load"]), float(aux["dropped"])))
    return params, out


def _ep_steps(ep, params, x, target, mesh, batch_axes, data_axes, steps, rules=RULES, fsdp=False):
    """The user's step: shard_map over the mesh, ep_value_and_grad, SGD on the local
    shards, the bias update from the global loads. `fsdp`: the step gets the specs, so
    leaves split over the data axis are FSDP shards."""
    specs = bp.param_specs(params, rules, mesh)
    params = jax.device_put(params, bp.param_shardings(params, rules, mesh))
    grad_fn = bp.ep_value_and_grad(
        _loss_fn(ep), data_axes=data_axes, has_aux=True, specs=specs if fsdp else None
    )

    def body(params, x, target):
        (loss, aux), g, params = grad_fn(params, x, target)
        train, rest = params.split()
        train = jax.tree.map(lambda p, g: p - LR * g, train, g)
        params = ep.update_bias(train.merge(rest), aux["load"], RATE)
        return params, loss, aux

    batch = P(batch_axes)
    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(specs, batch, batch), out_specs=(specs, P(), P()))
    )
    x = jax.device_put(x, NamedSharding(mesh, batch))
    target = jax.device_put(target, NamedSharding(mesh, batch))
    out = []
    for _ in range(steps):
        params, loss, aux = step(params, x, target)
        out.append((float(loss), np.asarray(aux["load"]), float(aux["dropped"])))
    return params, out


def _compare(ep_run, one_run):
    (p_ep, out_ep), (p_one, out_one) = ep_run, one_run
    for i, ((l_ep, load_ep, d_ep), (l_one, load_one, d_one)) in enumerate(
        zip(out_ep, out_one, strict=True)
    ):
        np.testing.assert_allclose(l_ep, l_one, rtol=1e-5, err_msg=f"loss at step {i}")
        np.testing.assert_array_equal(load_ep, load_one, err_msg=f"load at step {i}")
        assert d_ep == d_one, (i, d_ep, d_one)
    got, want = p_ep.arrays(), p_one.arrays()
    assert got.keys() == want.keys()
    for path in want:
        np.testing.assert_allclose(
            np.asarray(got[path]),
            np.asarray(want[path]),
            rtol=1e-5,
            atol=1e-6,
            err_msg="/".join(path),
        )
    return out_ep


# EP x FSDP: the expert kernels split over 'expert' on E and over 'data' on another
# dimension, the router kernel over 'data'; the step gathers them and reduce-scatters.
FSDP_RULES = [
    ("experts/(gate|up)", ("expert", "data", None)),
    ("experts/down", ("expert", None, "data")),
    ("router/kernel", ("data", None)),
    (".*", None),
]


@pytest.mark.parametrize(
    "shape, names, kind, batch_axes, data_axes, fsdp, n",
    [
        ((8,), ("expert",), "explicit", "expert", None, False, 8),
        ((8,), ("expert",), "auto", "expert", None, False, 8),
        ((4, 2), ("data", "expert"), "auto", ("data", "expert"), "data", False, 2),
        ((4, 2), ("data", "expert"), "explicit", ("data", "expert"), "data", False, 2),
        ((4, 2), ("expert", "model"), "explicit", "expert", None, False, 8),
        ((4, 2), ("expert", "model"), "auto", "expert", None, False, 8),
        ((2, 4), ("data", "expert"), "explicit", ("data", "expert"), "data", True, 8),
        ((2, 4), ("data", "expert"), "auto", ("data", "expert"), "data", True, 8),
    ],
    ids=[
        "ep8-explicit",
        "ep8-auto",
        "dp4xep2-auto",
        "dp4xep2-explicit",
        "ep4xtp2-explicit",
        "ep4xtp2-auto",
        "fsdp2xep4-explicit",
        "fsdp2xep4-auto",
    ],
)
def test_ep_equals_one_device_over_three_steps(shape, names, kind, batch_axes, data_axes, fsdp, n):
    """`n`: the devices each expert kernel is split over (expert x model, or x data
    with FSDP); each device holds 1/n of its bytes."""
    mesh = _mesh(shape, names, kind)
    model = "model" if "model" in names else None
    token_axes = tuple(a for a in names if a != "model")
    ep, one, rng = _layers(token_axes, model_axis=model)
    rules = FSDP_RULES if fsdp else bp.moe_ep_rules(model_axis=model) + [(".*", None)]
    x, target = _data()
    params = _init(one, rng, x)
    with jax.default_matmul_precision("highest"):
        ref = _one_device_steps(one, params, x, target, 3)
        run = _ep_steps(ep, params, x, target, mesh, batch_axes, data_axes, 3, rules, fsdp)
    out = _compare(run, ref)
    assert all(d == 0 for _, _, d in out)  # worst-case capacity: nothing dropped
    bias = np.asarray(run[0][("net", "moe", "router", "bias")].value)
    assert np.any(bias != 0) and abs(bias.sum()) < 1e-6  # the bias moved, centred
    for path, v in run[0].arrays().items():
        if path[-2] == "experts":
            local = v.addressable_shards[0].data.nbytes
            assert local <= 1.1 * v.nbytes / n, (path, local, v.nbytes)


def test_with_drops_one_device_with_n_groups_equals_ep_n():
    mesh = _mesh((8,), ("expert",), "explicit")
    ep, _, _ = _layers(("expert",), capacity_factor=1.0)
    _, one, rng = _layers(None, capacity_factor=1.0, groups=8)
    x, target = _data(seed=1)
    params = _init(one, rng, x)
    assert one.capacity(B * T) == 2  # ceil(1.0 * 2 * 8 / 8) per expert per device
    with jax.default_matmul_precision("highest"):
        ref = _one_device_steps(one, params, x, target, 2)
        run = _ep_steps(ep, params, x, target, mesh, "expert", None, 2)
    out = _compare(run, ref)
    assert all(d > 0 for _, _, d in out), out  # tokens were dropped, the same ones


def test_params_replicated_instead_of_split_are_named():
    mesh = _mesh((8,), ("expert",), "auto")
    ep, one, rng = _layers(("expert",))
    x, _ = _data()
    params = _init(one, rng, x)
    specs = bp.param_specs(params, [(".*", None)], mesh)  # forgot moe_ep_rules
    f = jax.shard_map(
        lambda p, x: ep(p, x)[0][0], mesh=mesh, in_specs=(specs, P("expert")), out_specs=P()
    )
    with pytest.raises(
        ValueError,
        match=r"'net/moe/experts/(gate|up)' has local shape \(8, 8, 8\), expected \(1, 8, 8\)",
    ):
        jax.eval_shape(f, params, x)


def test_ragged_dispatch_raises_naming_the_backend_on_cpu():
    mesh = _mesh((8,), ("expert",), "auto")
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    ep = bp.ExpertParallelMoE(g / "moe", E, F, rng, token_axes="expert", dispatch="ragged")
    _, one, rng1 = _layers(None)
    x, _ = _data()
    params = _init(one, rng1, x)
    f = jax.shard_map(
        lambda p, x: ep(p, x)[0][0],
        mesh=mesh,
        in_specs=(bp.param_specs(params, RULES, mesh), P("expert")),
        out_specs=P("expert"),
    )
    if jax.devices()[0].platform != "cpu":
        pytest.skip("the error is for backends without ragged_all_to_all")
    with pytest.raises(ValueError, match=r"the 'cpu' backend does not implement.*'dense'"):
        jax.eval_shape(f, params, x)


# ---------------------------------------------------------------------------------------
# ragged dispatch plan against a NumPy model of ragged_all_to_all


def _numpy_ragged_all_to_all(operands, outputs, plans):
    """The documented semantics, one device per list entry: device i sends
    ``operand[input_offsets[s] : + send_sizes[s]]`` of slot s to device ``s // L``,
    where it lands at ``output_offsets[s]`` (the sender's), ``recv_sizes`` rows."""
    n = len(operands)
    results = [o.copy() for o in outputs]
    slots = len(plans[0][0])
    per = slots // n
    for i in range(n):
        in_off, send, out_off, _ = (np.asarray(a) for a in plans[i])
        for s in range(slots):
            dst = s // per
            rows = operands[i][in_off[s] : in_off[s] + send[s]]
            results[dst][out_off[s] : out_off[s] + send[s]] = rows
    # The receivers' recv_sizes agree with what was sent (the documented contract).
    for j in range(n):
        recv = np.asarray(plans[j][3])
        for s in range(slots):
            i, local = divmod(s, per)
            assert recv[s] == np.asarray(plans[i][1])[j * per + local], (i, j, s)
    return results


@pytest.mark.parametrize("n, experts", [(4, 8), (2, 2), (8, 8)])
def test_ragged_plan_delivers_rows_grouped_by_expert_and_back(n, experts):
    r = np.random.default_rng(n + experts)
    counts = r.integers(0, 4, (n, experts))
    counts[0, :] = 0  # a device that sends nothing
    local = experts // n
    # Each device's rows, sorted by expert: (source, expert, index) labels.
    operands = []
    for i in range(n):
        rows = [(i, e, j) for e in range(experts) for j in range(counts[i, e])]
        operands.append(np.array(rows, np.int64).reshape(-1, 3))
    cap = int(counts.sum())
    plan = jax.jit(bp.ragged_dispatch_plan)  # one compile for every device index
    plans = [plan(counts, me) for me in range(n)]
    received = _numpy_ragged_all_to_all(
        operands, [np.full((cap, 3), -1) for _ in range(n)], [p["dispatch"] for p in plans]
    )
    for j in range(n):
        sizes = np.asarray(plans[j]["group_sizes"])
        expected = [
            (i, j * local + l_, k)
            for l_ in range(local)
            for i in range(n)
            for k in range(counts[i, j * local + l_])
        ]
        got = received[j][: len(expected)]
        np.testing.assert_array_equal(got, np.array(expected).reshape(-1, 3))
        np.testing.assert_array_equal(sizes, counts[:, j * local : (j + 1) * local].sum(0))
        assert np.all(received[j][len(expected) :] == -1)  # nothing else written
    back = _numpy_ragged_all_to_all(
        received,
        [np.full_like(o, -1) for o in operands],
        [p["combine"] for p in plans],
    )
    for i in range(n):
        np.testing.assert_array_equal(back[i], operands[i])


def _ragged_step(mesh):
    """A gradient step of a dropless layer with ``dispatch='ragged'`` and of the same
    layer with dense dispatch, as functions of (params, x, target)."""
    out = []
    for dispatch in ("ragged", "dense"):
        g = bx.Graph("net")
        ep = bp.ExpertParallelMoE(
            g / "moe", E, F, bx.Rng(g / "rng"), top_k=2, token_axes="expert", dispatch=dispatch
        )
        grad_fn = bp.ep_value_and_grad(_loss_fn(ep), data_axes=None, has_aux=True)
        out.append(lambda p, x, t, grad_fn=grad_fn: grad_fn(p, x, t)[:2])
    return out


def test_ragged_dispatch_traces_and_equals_dense_where_the_backend_has_it(monkeypatch):
    """On XLA:CPU the ragged program is traced and lowered (forward and gradient: shapes,
    offsets, the collectives' transposes), not compiled; on a backend with
    ragged_all_to_all it runs and equals dense dispatch."""
    mesh = _mesh((8,), ("expert",), "auto")
    _, one, rng = _layers(None)
    x, target = _data()
    params = _init(one, rng, x)
    specs = bp.param_specs(params, RULES, mesh)
    ragged, dense = (
        jax.jit(
            jax.shard_map(
                f,
                mesh=mesh,
                in_specs=(specs, P("expert"), P("expert")),
                out_specs=((P(), P()), specs.split()[0]),
            )
        )
        for f in _ragged_step(mesh)
    )
    runs = jax.devices()[0].platform != "cpu"
    if not runs:
        monkeypatch.setattr(bp._expert, "_ragged_supported", lambda platform: True)
        text = ragged.lower(params, x, target).as_text()
        # Dispatch, combine, and combine's transpose (the tokens themselves are not
        # differentiated, so dispatch needs none).
        assert text.count("ragged_all_to_all") == 3
        return
    with jax.default_matmul_precision("highest"):
        (loss_r, _), g_r = ragged(params, x, target)
        (loss_d, _), g_d = dense(params, x, target)
    np.testing.assert_allclose(float(loss_r), float(loss_d), rtol=1e-5)
    for path, v in g_d.arrays().items():
        np.testing.assert_allclose(np.asarray(g_r[path].value), np.asarray(v), rtol=1e-5, atol=1e-6)


def test_misuse_is_named():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    with pytest.raises(ValueError, match=r"'net/a': dispatch must be 'dense' or 'ragged'"):
        bp.ExpertParallelMoE(g / "a", E, F, rng, dispatch="sparse")
    with pytest.raises(ValueError, match=r"'net/b': dispatch='ragged' .* capacity_factor=None"):
        bp.ExpertParallelMoE(g / "b", E, F, rng, dispatch="ragged", capacity_factor=1.0)
    with pytest.raises(ValueError, match=r"'net/c': model_axis must be None or a mesh-axis"):
        bp.ExpertParallelMoE(g / "c", E, F, rng, model_axis="expert")

    mesh = _mesh((8,), ("expert",), "auto")
    x = jax.ShapeDtypeStruct((16, D), jnp.float32)

    def trace(layer, params, check_vma=True, rules=RULES):
        f = jax.shard_map(
            lambda p, x: layer(p, x)[0][0],
            mesh=mesh,
            in_specs=(bp.param_specs(params, rules, mesh), P("expert")),
            out_specs=P("expert"),
            check_vma=check_vma,
        )
        return jax.eval_shape(f, params, x)

    _, one, r1 = _layers(None)
    params = _init(one, r1, jnp.zeros((16, D)))
    six = bp.ExpertParallelMoE(g / "d", 6, F, rng)
    p6 = _init_other(six, rng)
    with pytest.raises(ValueError, match=r"'net/d': num_experts=6 is not divisible by the size 8"):
        trace(six, p6, rules=[(".*", None)])  # bp.param_specs refuses the EP rules
    ep, _, _ = _layers(("expert", "data"))
    with pytest.raises(ValueError, match=r"token_axes \('expert', 'data'\) are only partly bound"):
        trace(ep, params)
    ep, _, _ = _layers(("expert",))
    with pytest.raises(ValueError, match=r"needs jax.shard_map\(\.\.\., check_vma=True\)"):
        trace(ep, params, check_vma=False)
    ep, _, _ = _layers(("expert",), model_axis="model")
    with pytest.raises(ValueError, match=r"model_axis 'model' is not bound inside this shard_map"):
        trace(ep, params)


def _init_other(layer, rng):
    return numpy_params(layer, rng.seed(bx.Params(), seed=0), jnp.zeros((16, D))).locked()


def test_moe_with_token_axes_under_make_dp_train_step_equals_one_device():
    """Plain data parallelism (every device holds every expert): with
    ``token_axes='data'`` the balancing loss and the loads are global, so
    `make_dp_train_step` gives the one-device step's loss, params and loads."""
    import optax

    mesh = _mesh((8,), ("data",), "explicit")
    g1 = bx.Graph("net")
    cfg = dict(top_k=2, balance_weight=0.1, z_weight=0.01, routing_bias=True)
    dp_moe = bx.MoE(g1 / "moe", E, F, bx.Rng(g1 / "rng"), token_axes="data", **cfg)
    g2 = bx.Graph("net")
    rng = bx.Rng(g2 / "rng")
    one = bx.MoE(g2 / "moe", E, F, rng, **cfg)
    x, target = _data(seed=2)
    params = _init(one, rng, x)
    tx = optax.sgd(LR)

    def loss_fn(layer):
        def f(params, x, target):
            (y, aux), params = layer(params, x)
            return (jnp.mean(jnp.square(y - target)) + aux["aux_loss"], aux), params

        return f

    step = jax.jit(bp.make_dp_train_step(loss_fn(dp_moe), tx, mesh, has_aux=True))
    opt = tx.init(params.split()[0])
    placed = jax.device_put(params, NamedSharding(mesh, P()))
    with jax.default_matmul_precision("highest"):
        new, _, metrics = step(placed, jax.device_put(opt, NamedSharding(mesh, P())), x, target)
        ref, out = _one_device_steps(one, params, x, target, 1)
    np.testing.assert_allclose(float(metrics["loss"]), out[0][0], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(metrics["load"]), out[0][1])
    for path, v in ref.split()[0].arrays().items():  # the reference also moved the bias
        np.testing.assert_allclose(
            np.asarray(new[path].value), np.asarray(v), rtol=1e-5, atol=1e-6, err_msg=str(path)
        )


def test_fsdp_specs_misuse_is_named():
    """A non-trainable leaf split over a data axis is refused naming the leaf, and specs
    that are not a Params of PartitionSpec say what to pass."""
    mesh = _mesh((2, 4), ("data", "expert"), "auto")
    ep, one, rng = _layers(("data", "expert"))
    x, target = _data()
    params = _init(one, rng, x)
    batch = P(("data", "expert"))
    specs = bp.param_specs(params, [("router/bias", ("data",))] + FSDP_RULES, mesh)

    def trace(step_specs):
        f = bp.ep_value_and_grad(_loss_fn(ep), data_axes="data", has_aux=True, specs=step_specs)
        g = jax.shard_map(
            f,
            mesh=mesh,
            in_specs=(specs, batch, batch),
            out_specs=((P(), P()), specs.split()[0], specs),
        )
        return jax.eval_shape(g, params, x, target)

    with pytest.raises(ValueError, match=r"'net/moe/router/bias' has spec .* non-trainable"):
        trace(specs)
    with pytest.raises(TypeError, match=r"specs must be the params' PartitionSpec tree"):
        trace(dict(specs.arrays()))
    specs = bp.param_specs(
        params, [("experts/up", (("data", "expert"), None, None)), (".*", None)], mesh
    )
    with pytest.raises(ValueError, match=r"'net/moe/experts/up' .* must be the last name"):
        trace(specs)


def test_microbatches_weights_and_a_bias_set_in_the_loss_equal_one_device():
    """DP x EP = 2 x 4 with 2 microbatches per device, a masked loss weighted by
    ``aux['weight']`` (parts with 1 to 4 real tokens) and the routing bias updated
    inside the loss from each microbatch's global loads: the loss, the gradients and
    the bias equal one device running the 2 global microbatches (microbatch j: the j-th
    half of every device's rows) in order, weighted by their real tokens."""
    mesh = _mesh((2, 4), ("data", "expert"), "auto")
    ep, one, rng = _layers(("data", "expert"))
    x, target = _data(seed=3)
    mask = np.ones((B, T), np.float32)  # per token; each device's part is 1 row
    mask[6, 1:] = 0.0
    mask[11, :2] = 0.0
    mask = jnp.asarray(mask)
    params = _init(one, rng, x)

    def loss_fn(layer):
        def f(params, x, target, mask):
            (y, aux), params = layer(params, x)
            err = jnp.sum(jnp.square(y - target), axis=-1) * mask
            count = jnp.sum(mask)
            loss = jnp.sum(err) / jnp.maximum(count, 1.0) + aux["aux_loss"]
            params = layer.update_bias(params, aux["load"], RATE)
            return (loss, {"weight": count}), params

        return f

    specs = bp.param_specs(params, RULES, mesh)
    grad_fn = bp.ep_value_and_grad(loss_fn(ep), data_axes="data", has_aux=True, microbatches=2)
    batch = P(("data", "expert"))
    step = jax.jit(
        jax.shard_map(
            grad_fn,
            mesh=mesh,
            in_specs=(specs, batch, batch, batch),
            out_specs=((P(), P()), specs.split()[0], specs),
        )
    )
    # One device: microbatch j holds row j of every device's 2 rows.
    micro = [(a.reshape(8, 2, *a.shape[1:])[:, j]) for j in range(2) for a in (x, target, mask)]
    ref_fn = loss_fn(one)
    with jax.default_matmul_precision("highest"):
        (loss, aux), grads, new = step(params, x, target, mask)

        def f(t, rest, *mb):
            (l_, a), out = ref_fn(t.merge(rest), *mb)
            return l_, (a["weight"], out)

        ref_step = jax.jit(jax.value_and_grad(f, has_aux=True))
        p, total, wsum, gsum = params, 0.0, 0.0, None
        for j in range(2):
            (l_, (w, p)), g = ref_step(*p.split(), *micro[3 * j : 3 * j + 3])
            total += float(l_) * float(w)
            wsum += float(w)
            g = jax.tree.map(lambda v, w=w: v * w, g)
            gsum = g if gsum is None else jax.tree.map(jnp.add, gsum, g)
    np.testing.assert_allclose(float(loss), total / wsum, rtol=1e-5)
    assert float(aux["weight"]) == wsum == B * T - 5
    for path, v in gsum.arrays().items():
        np.testing.assert_allclose(
            np.asarray(grads[path].value), np.asarray(v) / wsum, rtol=1e-5, atol=1e-6
        )
    bias = ("net", "moe", "router", "bias")
    np.testing.assert_allclose(np.asarray(new[bias].value), np.asarray(p[bias].value), atol=1e-7)
    assert np.any(np.asarray(p[bias].value) != 0)  # the bias moved twice, as one device's
