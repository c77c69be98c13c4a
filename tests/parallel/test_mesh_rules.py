"""Mesh building and description, sharding rules (golden spec tables, every error),
Optax state shardings, and the printed table."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp

# -- mesh ------------------------------------------------------------------------------


def test_make_mesh_infers_one_length_and_keeps_axis_types():
    mesh = bp.make_mesh((-1, 2), ("data", "model"))
    assert dict(mesh.shape) == {"data": 4, "model": 2}
    assert mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)
    auto = bp.make_mesh((2, None), ("data", "model"), axis_types="auto")
    assert dict(auto.shape) == {"data": 2, "model": 4}
    assert auto.axis_types == (AxisType.Auto, AxisType.Auto)
    sub = bp.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    assert sub.devices.size == 2
    assert bp.describe_mesh(mesh) == (
        "Mesh(data=4, model=2; Explicit) over 8 cpu devices (cpu), 1 process"
    )


@pytest.mark.parametrize(
    "shapes,names,match",
    [
        ((3, -1), ("data", "model"), r"\(data=3, model=\?\) multiply to 3.*8 devices"),
        ((2, 2), ("data", "model"), r"axes \(data=2, model=2\) need 4 devices, but 8"),
        ((-1, None), ("data", "model"), "at most one length may be -1/None"),
        ((8,), ("data", "data"), "distinct non-empty strings"),
        ((8, 1), ("data",), "2 lengths"),
        ((0, -1), ("data", "model"), "axis 'data' has length 0"),
    ],
)
def test_make_mesh_errors_name_axes_sizes_and_device_count(shapes, names, match):
    with pytest.raises(ValueError, match=match):
        bp.make_mesh(shapes, names)


def test_make_mesh_bad_axis_type():
    with pytest.raises(ValueError, match="'manual' is not 'explicit' or 'auto'"):
        bp.make_mesh((8,), ("data",), axis_types="manual")


# -- rules -----------------------------------------------------------------------------


def _lm_params():
    g = bx.Graph("gpt")
    rng = bx.Rng(g / "rng")
    lm = bx.TransformerLM(
        g / "lm", vocab_size=32, model_size=16, num_layers=2, num_heads=4, rng=rng
    )
    params = rng.seed(bx.Params(), seed=0)
    return jax.eval_shape(lambda p: lm(p, jnp.zeros((1, 8), jnp.int32))[1], params)


LM_RULES = bp.transformer_tp_rules() + [
    ("embed/embedding", (None, "model")),
    ("rng/(seed|counter)", None),
]


def test_golden_partition_spec_table_of_the_gpt_example():
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    params = _lm_params()
    specs = bp.param_specs(params, LM_RULES, mesh)
    got = {"/".join(k): tuple(v.value) for k, v in specs.items()}
    want = {}
    for i in range(2):
        b = f"gpt/lm/block_{i}/"
        for name in ("query", "key", "value"):
            want[b + f"attn/{name}/kernel"] = (None, "model")
            want[b + f"attn/{name}/bias"] = ("model",)
        want[b + "attn/out/kernel"] = ("model", None)
        want[b + "attn/out/bias"] = ()
        want[b + "mlp/linear_0/kernel"] = (None, "model")
        want[b + "mlp/linear_0/bias"] = ("model",)
        want[b + "mlp/linear_1/kernel"] = ("model", None)
        want[b + "mlp/linear_1/bias"] = ()
        for n in ("norm1", "norm2"):
            want[b + f"{n}/scale"] = ()
            want[b + f"{n}/bias"] = ()
    want.update(
        {
            "gpt/lm/embed/embedding": (None, "model"),
            "gpt/lm/final_norm/scale": (),
            "gpt/lm/final_norm/bias": (),
            "gpt/rng/seed": (),
            "gpt/rng/counter": (),
        }
    )
    assert got == want
    table = bp.sharding_table(params, LM_RULES, mesh)
    line = next(x for x in table.splitlines() if x.startswith("gpt/lm/block_0/mlp/linear_0/kernel"))
    assert line.split() == ["gpt/lm/block_0/mlp/linear_0/kernel", "(16,", "64)", "P(None,",
                            "'model')", "(16,", "16)", "rule", "6"]  # fmt: skip
    assert table.splitlines()[-1].startswith("mesh data=2 x model=4; ")


def test_golden_table_of_the_dp_classifier():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    conv = bx.Conv(g / "conv1", (3, 3), 4, rng)
    bn = bx.BatchNorm(g / "bn")
    head = bx.Linear(g / "head", 10, rng)

    def init(p):
        h, p = conv(p, jnp.zeros((2, 8, 8, 1)))
        h, p = bn(p, h)
        return head(p, h.reshape(2, -1))[1]

    params = jax.eval_shape(init, rng.seed(bx.Params(), seed=0))
    mesh = bp.make_mesh((8,), ("data",))
    table = bp.sharding_table(params, [(".*", None)], mesh)
    rows = [line.split()[0] for line in table.splitlines()[2:-1]]
    assert rows == sorted("/".join(k) for k in params.keys())
    assert all("P()" in line for line in table.splitlines()[2:-1])


def test_every_layer_is_reachable_by_rules_recurrent_norms_included():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    lstm = bx.LSTM(g / "lstm", 8, rng)
    norm = bx.LayerNorm(g / "norm")
    params = rng.seed(bx.Params(), seed=0)
    x = jnp.zeros((2, 3, 4))

    def init(p):
        (out, _), p = lstm.apply(p, x)
        return norm(p, out)[1]

    params = jax.eval_shape(init, params)
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    rules = [("lstm/.*kernel.*|lstm/w_.*", (None, "model")), (".*", None)]
    lstm_paths = [k for k in params.keys() if "lstm" in k and params[k].value.ndim == 2]
    assert lstm_paths
    specs = bp.param_specs(params, [(p, None) for p in ()] + [
        ("/".join(k[1:]), (None, "model")) for k in lstm_paths
    ], mesh, replicate_rest=True)  # fmt: skip
    for k in lstm_paths:
        assert tuple(specs[k].value) == (None, "model")
    assert tuple(specs[("net", "norm", "scale")].value) == ()
    del rules


def test_rules_win_over_metadata_and_the_table_says_so():
    params = bx.Params()
    params[("fc", "kernel")] = bx.Param(jnp.zeros((4, 8)), metadata={"sharding": ("model", None)})
    params[("fc", "bias")] = bx.Param(jnp.zeros((8,)), metadata={"sharding": ("model",)})
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    specs = bp.param_specs(params, [("fc/kernel", (None, "model"))], mesh)
    assert specs[("fc", "kernel")].value == P(None, "model")  # the rule
    assert specs[("fc", "bias")].value == P("model")  # metadata, no rule
    table = bp.sharding_table(params, [("fc/kernel", (None, "model"))], mesh)
    assert "rule 0 (overrides metadata ('model', None))" in table
    assert "metadata" in table.splitlines()[2]


def test_unmatched_paths_are_listed_next_to_the_rules():
    params = _lm_params()
    with pytest.raises(ValueError, match=r"(?s)3 parameter\(s\) match no sharding rule.*"
                       r"'gpt/lm/embed/embedding' \(32, 16\).*rule 0 \('attn/query/kernel'.*"
                       r"replicate_rest=True"):  # fmt: skip
        bp.param_specs(params, bp.transformer_tp_rules())
    specs = bp.param_specs(params, bp.transformer_tp_rules(), replicate_rest=True)
    assert specs[("gpt", "rng", "seed")].value == P()


@pytest.mark.parametrize(
    "rules,match",
    [
        ([("fc/kernel", ("model",))], r"'net/fc/kernel' of shape \(4, 8\) has 2 dimension"),
        ([("fc/kernel", (None, "tensor"))], r"'net/fc/kernel' of shape \(4, 8\).*axis 'tensor'"),
        ([("fc/kernel", (None, "data"))], r"'net/fc/kernel' of shape \(4, 8\).*size 3"),
        ([("fc/kernel", ("model", "model"))], "uses mesh axis 'model' for dimensions 0 and 1"),
        ([("fc/(kernel", None)], "is not a regular expression"),
    ],
)
def test_rule_errors_name_path_and_shape(rules, match):
    params = bx.Params()
    params[("net", "fc", "kernel")] = bx.Param(jnp.zeros((4, 8)))
    mesh = bp.make_mesh((3, 2), ("data", "model"), devices=jax.devices()[:6])
    with pytest.raises(ValueError, match=match):
        bp.param_specs(params, rules, mesh)


def test_malformed_rules_raise_type_errors():
    params = bx.Params()
    params[("fc", "kernel")] = bx.Param(jnp.zeros((4, 8)))
    with pytest.raises(TypeError, match="list of \\(pattern, spec\\) pairs"):
        bp.param_specs(params, {"fc/kernel": None})
    with pytest.raises(TypeError, match="spec entry 3"):
        bp.param_specs(params, [("kernel", (None, 3))])


def test_opt_state_shardings_follow_their_parameters():
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    params = _lm_params()
    specs = bp.param_specs(params, LM_RULES, mesh)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    trainable = params.split()[0]
    state = jax.eval_shape(tx.init, trainable)
    sh = bp.opt_state_shardings(state, specs, mesh)
    adam = sh[1][0]
    k = ("gpt", "lm", "block_1", "mlp", "linear_1", "kernel")
    assert adam.mu[k].value.spec == P("model", None)
    assert adam.nu[k].value.spec == P("model", None)
    assert adam.count.spec == P()
    # Sharded init of params and optimizer state, then a real update keeps the layout.
    concrete = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), trainable)
    # The trainable half has no RNG state, so the RNG rule places nothing there.
    t = jax.device_put(concrete, bp.param_shardings(trainable, LM_RULES, mesh, allow_unused=True))
    opt = jax.jit(tx.init, out_shardings=sh)(t)
    assert opt[1][0].mu[k].value.sharding.spec == P("model", None)
    np.testing.assert_array_equal(np.asarray(opt[1][0].mu[k].value), 0.0)


def test_opt_state_leaf_outside_params_raises():
    params = bx.Params()
    params[("fc", "kernel")] = bx.Param(jnp.zeros((4, 8)))
    specs = bp.param_specs(params, [("kernel", None)])
    with pytest.raises(ValueError, match=r"leaf \['w'\] of shape \(4, 8\) is not inside a Params"):
        bp.opt_state_specs({"w": jnp.zeros((4, 8))}, specs)
