"""The trace-time guards of the train steps (blox.core._guards) and `bp.place`: an
unlisted Rng under a data axis, a layer first created inside the loss, and `place`'s
checks. Each check is run traced (inside ``jax.jit``), on the misuse and on the
look-alikes that must pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp
from blox.core._guards import check_no_new_params, check_placement, check_rngs_listed


def _model():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 2, rng)
    head = bx.Linear(g / "head", 1, rng)
    params = rng.seed(bx.Params(), seed=0)
    _, params = fc(params, jnp.ones((1, 3)))
    return rng, fc, head, params


# ---------------------------------------------------------------------------
# check_no_new_params
# ---------------------------------------------------------------------------


def test_new_params_raise_under_jit_naming_each_path_and_the_fix():
    rng, fc, head, params = _model()

    def f(p):
        y, p2 = fc(p, jnp.ones((1, 3)))
        _, p2 = head(p2, y)  # created lazily inside the "loss"
        check_no_new_params(p, p2, "make_train_step")
        return p2

    with pytest.raises(ValueError, match=r"make_train_step: .*'net/head/bias', 'net/head/kernel'"):
        jax.jit(f)(params)
    with pytest.raises(ValueError, match=r"(?is)initialize.*params\.locked\(\)"):
        jax.eval_shape(f, params)


def test_same_paths_pass_under_jit():
    rng, fc, head, params = _model()

    def f(p):
        y, p2 = fc(p, jnp.ones((1, 3)))
        _, p2 = rng(p2)  # values change, paths do not
        check_no_new_params(p, p2, "step")
        return y

    jax.jit(f)(params)


# ---------------------------------------------------------------------------
# check_rngs_listed
# ---------------------------------------------------------------------------


def test_unlisted_rng_that_draws_raises_under_jit():
    rng, fc, head, params = _model()

    def f(p, listed):
        key, p2 = rng(p)
        check_rngs_listed(p, p2, listed, "make_dp_train_step")
        return jax.random.uniform(key)

    with pytest.raises(
        ValueError, match=r"make_dp_train_step: the Rng 'net/rng' .*'net/rng/counter'.*rngs="
    ):
        jax.jit(lambda p: f(p, []))(params)
    jax.jit(lambda p: f(p, [rng]))(params)  # listed: fine


def test_rng_passed_through_is_not_flagged():
    """False positives: a loss that never draws, one that reads the counter, a
    dynamic_scan whose step does not draw, and (outside any trace) a rebuilt but equal
    counter all pass."""
    rng, fc, head, params = _model()

    def passthrough(p):
        y, p2 = fc(p, jnp.ones((1, 3)))
        _ = rng.get_counter(p2)
        check_rngs_listed(p, p2, (), "step")
        return y

    jax.jit(passthrough)(params)

    def scanned(p):
        def step_fn(pp, x_t, state, *rest):
            y, pp = fc(pp, x_t)
            return (y, state), pp

        (_, _), p2 = bx.dynamic_scan(step_fn, p, jnp.ones((1, 4, 3)), jnp.zeros((1, 2)))
        check_rngs_listed(p, p2, (), "step")
        return p2

    jax.jit(scanned)(params)
    rebuilt = jax.tree.map(lambda x: jnp.array(x, copy=True), params)
    check_rngs_listed(params, rebuilt, (), "step")


def test_rng_drawn_inside_a_scan_is_flagged():
    rng, fc, head, params = _model()

    def scanned(p):
        def step_fn(pp, x_t, state, *rest):
            key, pp = rng(pp)
            return (x_t + jax.random.uniform(key), state), pp

        (_, _), p2 = bx.dynamic_scan(step_fn, p, jnp.ones((1, 4, 3)), jnp.zeros((1, 2)))
        check_rngs_listed(p, p2, (), "make_fsdp_train_step")
        return p2

    with pytest.raises(ValueError, match=r"make_fsdp_train_step: the Rng 'net/rng'"):
        jax.jit(scanned)(params)


# ---------------------------------------------------------------------------
# place
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    return bp.make_mesh((4,), ("data",), devices=jax.devices()[:4])


def test_place_takes_params_off_an_explicit_mesh(mesh):
    rng, fc, head, params = _model()
    ref = {k: np.asarray(v) for k, v in params.arrays().items()}
    on_mesh = bp.place(params, mesh)
    assert all(isinstance(v.sharding, NamedSharding) for v in on_mesh.arrays().values())
    actor = bp.place(on_mesh, jax.devices()[5])
    for k, v in actor.arrays().items():
        assert v.sharding.device_set == {jax.devices()[5]}
        np.testing.assert_array_equal(np.asarray(v), ref[k])
    assert actor._struct == params._struct  # paths, flags, metadata kept
    y, _ = jax.jit(fc)(actor, jnp.ones((1, 3)))  # a jit on the actor's device works
    y_ref = np.ones((1, 3)) @ ref[("net", "fc", "kernel")] + ref[("net", "fc", "bias")]
    np.testing.assert_allclose(np.asarray(y), y_ref, rtol=1e-6)


def test_place_gathers_a_sharded_leaf_and_moves_a_rollout_onto_the_mesh(mesh):
    x = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    sharded = jax.device_put(x, NamedSharding(mesh, P("data")))
    one = bp.place({"x": sharded}, jax.devices()[6])["x"]
    assert one.sharding.device_set == {jax.devices()[6]}
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a * 2)(one)), 2 * x)
    back = bp.place({"x": one}, NamedSharding(mesh, P("data")))["x"]
    assert back.sharding == NamedSharding(mesh, P("data"))
    np.testing.assert_array_equal(np.asarray(back), x)


def test_device_put_off_the_mesh_is_named_by_check_placement(mesh):
    """The wrong move: JAX keeps the mesh in the type (the jit fails with advice to call
    jax.set_mesh); blox's check names the leaf and bp.place."""
    w = jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, P()))
    moved = jax.device_put({"w": w}, jax.devices()[5])
    with pytest.raises(ValueError, match="set_mesh"):  # JAX's own (misleading) error
        jax.jit(lambda a: a * 2)(moved["w"])
    with pytest.raises(ValueError, match=r"(?s)fit: leaf \['w'\] is on 1 device.*bp\.place"):
        check_placement(moved, "fit")
    check_placement(bp.place(moved, jax.devices()[5]), "fit")  # the right move passes


def test_place_rejects_an_unknown_target():
    with pytest.raises(TypeError, match=r"place: target must be a jax\.Device"):
        bp.place({"x": jnp.ones(2)}, "cpu:0")


def test_fit_and_an_eager_make_train_step_name_params_moved_off_the_mesh(mesh):
    rng, fc, head, params = _model()
    stale = jax.device_put(bp.place(params, mesh), jax.devices()[5])

    def loss_fn(p, x):
        y, p = fc(p, x)
        return jnp.mean(y**2), p

    tx = optax.sgd(0.1)
    step = bx.make_train_step(loss_fn, tx)
    opt = tx.init(params.split()[0])
    with pytest.raises(ValueError, match=r"(?s)make_train_step: leaf .*net/fc/bias.*bp\.place"):
        step(stale, opt, jnp.ones((1, 3)))
    with pytest.raises(ValueError, match=r"(?s)fit: leaf .*net/fc/bias.*bp\.place"):
        bx.fit(jax.jit(step), stale, opt, [(jnp.ones((1, 3)),)], progress=False)
