"""Sharding rules: first match wins (a catch-all last), rules that place no parameter
raise (unless allowed), and optimizer-state leaves whose shape differs from their
parameter's (Adafactor's factored statistics) get a valid spec."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp


def _params():
    p = bx.Params()
    p[("net", "fc", "kernel")] = bx.Param(jnp.zeros((16, 256)))
    p[("net", "fc", "bias")] = bx.Param(jnp.zeros((256,)))
    p[("net", "deep", "kernel")] = bx.Param(jnp.zeros((4, 16, 256)))
    p[("net", "norm", "scale")] = bx.Param(jnp.zeros((16,)))
    return p


RULES = [
    ("fc/kernel", (None, "model")),
    ("fc/bias", ("model",)),
    ("deep/kernel", ("data", None, "model")),
    (".*", None),
]


# -- first match wins -------------------------------------------------------------------


def test_first_matching_rule_wins_so_a_catch_all_can_come_last():
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    specs = bp.param_specs(_params(), RULES, mesh)
    got = {"/".join(k): v.value for k, v in specs.items()}
    assert got == {
        "net/fc/kernel": P(None, "model"),
        "net/fc/bias": P("model"),
        "net/deep/kernel": P("data", None, "model"),
        "net/norm/scale": P(),
    }
    table = bp.sharding_table(_params(), RULES, mesh)
    assert [line.split()[-2:] for line in table.splitlines()[2:-1]] == [
        ["rule", "2"],  # net/deep/kernel
        ["rule", "1"],  # net/fc/bias
        ["rule", "0"],  # net/fc/kernel
        ["rule", "3"],  # net/norm/scale: the catch-all
    ]


def test_overlapping_rules_with_different_specs_take_the_earlier_one():
    """Once a conflict error; now the order decides, in both orders."""
    params = bx.Params()
    params[("net", "fc", "kernel")] = bx.Param(jnp.zeros((4, 8)))
    params[("net", "head", "kernel")] = bx.Param(jnp.zeros((4, 8)))
    a = bp.param_specs(params, [("fc/kernel", (None, "model")), ("kernel", ("model", None))])
    assert a[("net", "fc", "kernel")].value == P(None, "model")
    assert a[("net", "head", "kernel")].value == P("model", None)
    b = bp.param_specs(
        params, [("kernel", ("model", None)), ("fc/kernel", (None, "model"))], allow_unused=True
    )
    assert b[("net", "fc", "kernel")].value == P("model", None)


# -- unused rules -----------------------------------------------------------------------


def test_a_misspelled_rule_hidden_by_replicate_rest_raises_naming_it():
    rules = [("fc/kernal", (None, "model"))]
    with pytest.raises(
        ValueError,
        match=r"(?s)1 sharding rule\(s\) place no parameter.*rule 0 \('fc/kernal' -> "
        r"\(None, 'model'\)\) matches no parameter; some paths: 'net/fc/kernel'"
        r".*allow_unused=True",
    ):
        bp.param_specs(_params(), rules, replicate_rest=True)
    specs = bp.param_specs(_params(), rules, replicate_rest=True, allow_unused=True)
    assert specs[("net", "fc", "kernel")].value == P()


def test_a_rule_shadowed_by_an_earlier_one_raises_naming_both():
    rules = [(".*", None), ("fc/kernel", (None, "model"))]
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    for fn in (bp.param_specs, bp.param_shardings, bp.sharding_table):
        with pytest.raises(
            ValueError,
            match=r"rule 1 \('fc/kernel' -> \(None, 'model'\)\) is shadowed: every parameter "
            r"it matches is taken by an earlier rule \(rule 0 \('\.\*' -> None\)\), e\.g\. "
            r"'net/fc/kernel'",
        ):
            fn(_params(), rules, mesh)
    sh = bp.param_shardings(_params(), rules, mesh, allow_unused=True)
    assert sh[("net", "fc", "kernel")].value.spec == P()


def test_a_rule_that_wins_somewhere_is_used_even_if_shadowed_elsewhere():
    rules = [("net/fc/kernel", None), ("kernel", (None, None, "model")), (".*", None)]
    specs = bp.param_specs(_params(), rules)  # rule 1 places net/deep/kernel: no error
    assert specs[("net", "deep", "kernel")].value == P(None, None, "model")
    assert specs[("net", "fc", "kernel")].value == P()


# -- optimizer state whose shapes differ from the parameters' ----------------------------


def _assert_valid_for(tree, state, mesh):
    """Every spec fits its leaf (one entry per dim, divisible), the check jit makes."""
    sizes = dict(mesh.shape)
    specs = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, NamedSharding))
    leaves = jax.tree.leaves(state)
    assert len(specs) == len(leaves)
    for sh, leaf in zip(specs, leaves, strict=True):
        spec = sh.spec
        assert len(spec) in (0, leaf.ndim), (spec, leaf.shape)
        for entry, size in zip(spec, leaf.shape, strict=False):
            if entry is not None:
                assert size % sizes[entry] == 0, (spec, leaf.shape)


@pytest.mark.parametrize(
    "name,tx",
    [
        ("adafactor", optax.adafactor(1e-2, min_dim_size_to_factor=8)),
        ("adam", optax.adam(1e-2)),
        (
            "chain",
            optax.chain(
                optax.clip_by_global_norm(1.0),
                optax.scale_by_adam(),
                optax.scale_by_schedule(optax.linear_schedule(1.0, 0.1, 10)),
                optax.scale(-1e-2),
            ),
        ),
    ],  # fmt: skip
)
@pytest.mark.standard_promotion  # the reference's own Optax update
def test_sharded_optimizer_init_and_update_equal_the_unsharded_run(name, tx):
    """`jax.jit(tx.init, out_shardings=opt_state_shardings(...))` works for factored
    (Adafactor: (16,) row and (256,) column statistics of a (16, 256) kernel, (1,)
    placeholders), unfactored (Adam) and chained states with scalar counts; a sharded
    update equals the single-device one."""
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: jnp.asarray(rng.standard_normal(s.shape).astype(np.float32)), _params()
    )
    grads = jax.tree.map(lambda v: jnp.cos(v) * 0.1, params)
    specs = bp.param_specs(params, RULES, mesh)
    abstract = jax.eval_shape(tx.init, params)
    shardings = bp.opt_state_shardings(abstract, specs, mesh)
    _assert_valid_for(shardings, abstract, mesh)
    p_sh = bp.param_shardings(params, RULES, mesh)
    sharded_params = jax.device_put(params, p_sh)
    state = jax.jit(tx.init, out_shardings=shardings)(sharded_params)
    update = jax.jit(tx.update, out_shardings=(p_sh, shardings))
    updates, state = update(jax.device_put(grads, p_sh), state, sharded_params)
    updates, state = update(jax.device_put(grads, p_sh), state, sharded_params)
    # The reference: the same two updates on one device, no shardings.
    ref_state = tx.init(params)
    ref_updates, ref_state = tx.update(grads, ref_state, params)
    ref_updates, ref_state = tx.update(grads, ref_state, params)
    for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(ref_updates), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-7)
    k = ("net", "fc", "kernel")
    if name == "adafactor":
        st = state[0]
        assert st.v_row[k].value.shape == (16,) and st.v_row[k].value.sharding.spec == P()
        assert st.v_col[k].value.shape == (256,) and st.v_col[k].value.sharding.spec == P()
        assert st.v[k].value.shape == (1,) and st.v[k].value.sharding.spec == P()
        # The unfactored bias keeps its parameter's full-shape statistic, sharded like it.
        assert st.v[("net", "fc", "bias")].value.sharding.spec == P("model")
    else:
        adam = state[0] if name == "adam" else state[1]
        assert adam.mu[k].value.sharding.spec == P(None, "model")
        assert adam.count.sharding.spec == P()


def test_opt_state_specs_without_a_mesh_replicate_what_cannot_take_the_spec():
    specs = bp.param_specs(_params(), RULES)
    state = jax.eval_shape(optax.adafactor(1e-2, min_dim_size_to_factor=8).init, _params())
    tree = bp.opt_state_specs(state, specs)
    st = tree[0]
    assert st.v_row[("net", "deep", "kernel")].value == P()  # (4, 16): one dim fewer
    assert st.v_row[("net", "fc", "bias")].value == P()  # (1,) placeholder
    assert st.v[("net", "fc", "bias")].value == P("model")  # (256,): the parameter's shape
    assert st.v[("net", "deep", "kernel")].value == P()  # (1,) placeholder


def test_opt_state_specs_mesh_must_be_a_mesh():
    specs = bp.param_specs(_params(), RULES)
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh or None, got tuple"):
        bp.opt_state_specs({}, specs, (2, 4))
    with pytest.raises(TypeError, match="opt_state_shardings needs a jax.sharding.Mesh, got"):
        bp.opt_state_shardings({}, specs, None)
