"""Data parallelism against the one-device full-batch run (NumPy-free reference: plain
``jax.value_and_grad`` on one device), the gradient trap, accumulation with padding
masks, BatchNorm's axis_name, dropout per shard, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp
from tests.tolerances import tol

TYPES = ["explicit", "auto"]
F32 = tol(jnp.float32)


def _mesh(dp, types="explicit"):
    return bp.make_mesh((dp,), ("data",), devices=jax.devices()[:dp], axis_types=types)


def _data(n=16, d=5, c=3, seed=0):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(n, d)), jnp.float32)
    y = jnp.asarray(r.integers(0, c, size=(n,)), jnp.int32)
    return x, y


def _model(dropout=0.0, batchnorm=False):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc1 = bx.Linear(g / "fc1", 8, rng)
    bn = bx.BatchNorm(g / "bn", axis_name="data") if batchnorm else None
    drop = bx.Dropout(g / "drop", dropout, rng) if dropout else None
    fc2 = bx.Linear(g / "fc2", 3, rng)

    def model(params, x, axis_bound=True):
        h, params = fc1(params, x, precision="highest")
        if bn is not None:
            if not axis_bound:  # the one-device reference: statistics over the batch
                bn.axis_name = None
            h, params = bn(params, h)
            bn.axis_name = "data"
        h = jax.nn.relu(h)
        if drop is not None:
            h, params = drop(params, h)
        return fc2(params, h, precision="highest")

    x, _ = _data()
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, x, axis_bound=False)
    return model, rng, params.locked()


def _ce(logits, y):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def _reference_steps(model, params, tx, x, y, steps, axis_bound=False):
    """One device, full batch, split/grad/merge by hand."""

    def loss_fn(t, nt):
        logits, p = model(t.merge(nt), x, axis_bound=axis_bound)
        return _ce(logits, y), p.split()[1]

    opt_state = tx.init(params.split()[0])
    out = []
    for _ in range(steps):
        t, nt = params.split()
        (loss, nt), g = jax.value_and_grad(loss_fn, has_aux=True)(t, nt)
        updates, opt_state = tx.update(g, opt_state, t)
        params = optax.apply_updates(t, updates).merge(nt)
        out.append((loss, g, params))
    return out


def _close(a, b, **kw):
    for pa, pb in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(pa), np.asarray(pb), **(kw or F32))


@pytest.mark.standard_promotion  # the reference's own Optax update
@pytest.mark.parametrize("types", TYPES)
def test_dp8_three_adamw_steps_equal_one_device(types):
    model, _, params = _model()
    x, y = _data()
    tx = optax.adamw(1e-2)
    mesh = _mesh(8, types)
    with jax.default_matmul_precision("highest"):
        ref = _reference_steps(model, params, tx, x, y, 3)

        def loss_fn(p, x, y):
            logits, p = model(p, x)
            return _ce(logits, y), p

        # Gradients from dp_value_and_grad inside a hand-written shard_map.
        grad_fn = bp.dp_value_and_grad(loss_fn, axis="data")
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        ys = jax.device_put(y, NamedSharding(mesh, P("data")))
        rep = jax.device_put(params, NamedSharding(mesh, P()))
        trainable = params.split()[0]
        loss, grads, _ = jax.jit(
            jax.shard_map(
                grad_fn,
                mesh=mesh,
                in_specs=(P(), P("data"), P("data")),
                out_specs=(P(), P(), P()),
            )
        )(rep, xs, ys)
        np.testing.assert_allclose(float(loss), float(ref[0][0]), **F32)
        _close(grads, ref[0][1])
        assert grads.keys() == trainable.keys()

        step = jax.jit(bp.make_dp_train_step(loss_fn, tx, mesh))
        opt_state = jax.device_put(tx.init(trainable), NamedSharding(mesh, P()))
        p = rep
        for i in range(3):
            p, opt_state, metrics = step(p, opt_state, x, y)
            np.testing.assert_allclose(float(metrics["loss"]), float(ref[i][0]), **F32)
            _close(p, ref[i][2])


def test_the_gradient_trap_in_plain_jax():
    """check_vma=True: grads of a per-shard loss w.r.t. P() params are already summed over
    the shards, so a hand-written pmean gives N x the one-device gradient."""
    mesh = _mesh(8)
    w = jnp.asarray(np.random.default_rng(1).normal(size=(5, 3)), jnp.float32)
    x, _ = _data()

    def loss(w, x):
        return jnp.mean(jnp.dot(x, w, precision="highest") ** 2)

    ref = jax.grad(loss)(w, x)
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    ws = jax.device_put(w, NamedSharding(mesh, P()))

    def wrong(w, x):
        return jax.lax.pmean(jax.grad(loss)(w, x), "data")

    def right_pmean_loss(w, x):
        return jax.grad(lambda w: jax.lax.pmean(loss(w, x), "data"))(w)

    def right_varying(w, x):
        w = jax.lax.pcast(w, "data", to="varying")
        return jax.lax.pmean(jax.grad(loss)(w, x), "data")

    run = lambda f: jax.jit(  # noqa: E731
        jax.shard_map(f, mesh=mesh, in_specs=(P(), P("data")), out_specs=P())
    )(ws, xs)
    np.testing.assert_allclose(run(wrong), 8 * ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(run(right_pmean_loss), ref, **F32)
    np.testing.assert_allclose(run(right_varying), ref, **F32)


def _masked_setup(n=32, t=4, d=3, seed=3):
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.normal(size=(n, t, d)), jnp.float32)
    y = jnp.asarray(r.normal(size=(n, t, 2)), jnp.float32)
    lengths = r.integers(0, t + 1, size=(n,))
    lengths[0] = t  # at least one real token
    mask = jnp.asarray(np.arange(t)[None, :] < lengths[:, None])
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 2, rng)
    params = fc(rng.seed(bx.Params(), seed=0), x)[1].locked()
    return fc, params, x, y, mask


@pytest.mark.parametrize("dp", [1, 2, 8])
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_accumulation_times_dp_equals_one_large_batch_update(dp, k, masked):
    fc, params, x, y, mask = _masked_setup()
    if not masked:
        mask = jnp.ones(mask.shape, bool)
    tx = optax.sgd(0.1)

    def per_token(p, x, y):
        y_hat, p = fc(p, x, precision="highest")
        return jnp.sum((y_hat - y) ** 2, axis=-1), p

    def loss_fn(p, x, y, m):
        err, p = per_token(p, x, y)
        w = jnp.sum(m)
        loss = jnp.sum(jnp.where(m, err, 0.0)) / jnp.maximum(w, 1).astype(jnp.float32)
        return (loss, {"weight": w}), p

    def ref_loss(t):
        err, _ = per_token(t, x, y)
        return jnp.sum(jnp.where(mask, err, 0.0)) / jnp.sum(mask).astype(jnp.float32)

    t = params.split()[0]
    ref_l, ref_g = jax.value_and_grad(ref_loss)(t)
    ref_p = optax.apply_updates(t, tx.update(ref_g, tx.init(t), t)[0])

    mesh = _mesh(dp)
    step = jax.jit(bp.make_dp_train_step(loss_fn, tx, mesh, microbatches=k, has_aux=True))
    rep = jax.device_put(params, NamedSharding(mesh, P()))
    opt_state = jax.device_put(tx.init(t), NamedSharding(mesh, P()))
    new, _, metrics = step(rep, opt_state, x, y, mask)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_l), **F32)
    assert int(metrics["weight"]) == int(jnp.sum(mask))
    _close(new.split()[0], ref_p)


def test_weight_gives_the_token_mean_and_no_weight_the_mean_of_microbatch_means():
    """dp 2 x k 4 = 8 microbatches of 4 rows holding different numbers of real tokens:
    with ``aux['weight']`` the gradient is the masked mean over all real tokens; without
    it every microbatch counts equally: the mean of the 8 microbatch masked means. Both
    references are plain ``jax.value_and_grad`` on one device (the microbatches cut with
    NumPy), and they differ, so each path is told apart from the other."""
    fc, params, x, y, mask = _masked_setup()

    def masked_mean(p, x, y, m):
        y_hat, p = fc(p, x, precision="highest")
        err = jnp.sum((y_hat - y) ** 2, axis=-1)
        return jnp.sum(jnp.where(m, err, 0.0)) / jnp.sum(m).astype(jnp.float32), p

    def weighted(p, x, y, m):
        loss, p = masked_mean(p, x, y, m)
        return (loss, {"weight": jnp.sum(m)}), p

    def unweighted(p, x, y, m):
        loss, p = masked_mean(p, x, y, m)
        return (loss, {}), p

    t = params.split()[0]
    chunks = [slice(4 * c, 4 * c + 4) for c in range(8)]  # shard-major, as the rows split
    with jax.default_matmul_precision("highest"):
        ref_tokens = jax.value_and_grad(lambda t: masked_mean(t, x, y, mask)[0])(t)
        ref_means = jax.value_and_grad(
            lambda t: sum(masked_mean(t, x[c], y[c], mask[c])[0] for c in chunks) / 8
        )(t)
        mesh = _mesh(2)
        rep = jax.device_put(params, NamedSharding(mesh, P()))
        put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))  # noqa: E731
        got = {}
        for name, fn in (("tokens", weighted), ("means", unweighted)):
            f = bp.dp_value_and_grad(fn, microbatches=4, has_aux=True)
            sm = jax.shard_map(f, mesh=mesh, in_specs=(P(),) + (P("data"),) * 3, out_specs=P())
            (loss, _), grads, _ = jax.jit(sm)(rep, put(x), put(y), put(mask))
            got[name] = (loss, grads)
    gap = abs(float(ref_tokens[0]) - float(ref_means[0]))
    assert gap > 100 * F32["atol"] + F32["rtol"] * abs(float(ref_means[0])), gap
    for name, ref in (("tokens", ref_tokens), ("means", ref_means)):
        np.testing.assert_allclose(float(got[name][0]), float(ref[0]), **F32, err_msg=name)
        _close(got[name][1], ref[1])


@pytest.mark.parametrize("types", TYPES)
def test_batchnorm_axis_name_gives_full_batch_statistics(types):
    model, _, params = _model(batchnorm=True)
    x, y = _data()
    tx = optax.sgd(0.1)
    with jax.default_matmul_precision("highest"):
        ref = _reference_steps(model, params, tx, x, y, 1)

        def loss_fn(p, x, y):
            logits, p = model(p, x)
            return _ce(logits, y), p

        mesh = _mesh(8, types)
        step = jax.jit(bp.make_dp_train_step(loss_fn, tx, mesh))
        rep = jax.device_put(params, NamedSharding(mesh, P()))
        opt = jax.device_put(tx.init(params.split()[0]), NamedSharding(mesh, P()))
        new, _, metrics = step(rep, opt, x, y)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref[0][0]), **F32)
    _close(new, ref[0][2])  # weights and the running statistics


def test_dropout_masks_differ_per_shard_and_runs_repeat():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    drop = bx.Dropout(g / "drop", 0.5, rng)
    params = rng.seed(bx.Params(), seed=0).locked()
    mesh = _mesh(8)

    def body(p, x):
        p, seeds = bp.fold_seeds(p, rng, "data")
        out, p = drop(p, x)
        return out, bp.restore_seeds(p, seeds)

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=(P("data"), P()))
    )
    rep = jax.device_put(params, NamedSharding(mesh, P()))
    x = jax.device_put(jnp.ones((8, 64)), NamedSharding(mesh, P("data")))  # placed first
    out, new = f(rep, x)
    masks = np.asarray(out) > 0  # one row per shard
    assert len({row.tobytes() for row in masks}) == 8  # 8 different masks
    np.testing.assert_array_equal(np.asarray(f(rep, x)[0]), np.asarray(out))  # reproducible
    # The seed is restored (replicated), the counter advanced once.
    seed = ("net", "rng", "seed")
    np.testing.assert_array_equal(np.asarray(new[seed].value), np.asarray(params[seed].value))
    assert int(rng.get_counter(new)) == int(rng.get_counter(params)) + 1


def test_dp_step_with_dropout_is_reproducible():
    model, rng, params = _model(dropout=0.3)
    x, y = _data()
    tx = optax.adamw(1e-2)
    mesh = _mesh(8)

    def loss_fn(p, x, y):
        logits, p = model(p, x)
        return _ce(logits, y), p

    step = jax.jit(bp.make_dp_train_step(loss_fn, tx, mesh, rngs=[rng], microbatches=2))
    runs = []
    for _ in range(2):
        p = jax.device_put(params, NamedSharding(mesh, P()))
        o = jax.device_put(tx.init(params.split()[0]), NamedSharding(mesh, P()))
        losses = []
        for _ in range(2):
            p, o, m = step(p, o, x, y)
            losses.append(float(m["loss"]))
        runs.append(losses)
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def test_batch_not_divisible_raises_before_compiling():
    model, _, params = _model()
    tx = optax.sgd(0.1)

    def loss_fn(p, x, y):
        logits, p = model(p, x)
        return _ce(logits, y), p

    step = bp.make_dp_train_step(loss_fn, tx, _mesh(8), microbatches=2)
    x, y = _data(n=24)
    with pytest.raises(ValueError, match=r"shape \(24, 5\).*data-parallel size 8 x microbatches 2"):
        step(params, tx.init(params.split()[0]), x, y)


def test_dp_value_and_grad_outside_shard_map_names_the_axis():
    model, _, params = _model()
    x, y = _data()

    def loss_fn(p, x, y):
        logits, p = model(p, x)
        return _ce(logits, y), p

    with pytest.raises(ValueError, match="axis 'data' is not bound here.*shard_map"):
        jax.jit(bp.dp_value_and_grad(loss_fn))(params, x, y)


def test_unknown_data_axis_and_bad_loss_fn_raise():
    model, _, params = _model()
    tx = optax.sgd(0.1)
    with pytest.raises(ValueError, match="data axis 'batch' is not an axis of the mesh"):
        bp.make_dp_train_step(lambda p, x: (0.0, p), tx, _mesh(2), axis="batch")
    mesh = _mesh(2)
    f = jax.shard_map(
        bp.dp_value_and_grad(lambda p, x: jnp.sum(x)),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=(P(), P(), P()),
    )
    with pytest.raises(TypeError, match=r"must return \(loss, params\)"):
        f(
            jax.device_put(params, NamedSharding(mesh, P())),
            jax.device_put(jnp.ones((4, 5)), NamedSharding(mesh, P("data"))),
        )
