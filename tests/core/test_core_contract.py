"""Contract tests for the core API (names and behaviour kept from jax-blox 0.1.6)."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx

# ----------------------------------------------------------------------------- Graph


def test_graph_paths_children_and_walk():
    g = bx.Graph("net")
    a = g.child("enc")
    b = a / "lstm"
    odd = g / "a/b c.x"
    assert g.path == ("net",)
    assert b.path == ("net", "enc", "lstm")
    assert odd.path == ("net", "a/b c.x")
    assert b.parent is a and b.root is g and g.parent is None
    rng = bx.Rng(g / "rng")
    lin = bx.Linear(b / "fc", 3, rng)
    # Nodes without a module are skipped but their children are visited; creation order.
    assert [(p, m) for p, m in g.walk()] == [
        (("net", "enc", "lstm", "fc"), lin),
        (("net", "rng"), rng),
    ]
    assert lin.graph.module is lin


def test_graph_duplicate_child_and_root_binding_errors():
    g = bx.Graph("net")
    g.child("fc")
    with pytest.raises(ValueError, match=r"'net' already has a child named 'fc'"):
        g.child("fc")
    with pytest.raises(ValueError, match=r"Cannot bind 'Linear' to root graph node 'net'"):
        bx.Linear(g, 3, None)
    node = g / "x"
    bx.Rng(node)
    with pytest.raises(ValueError, match=r"'net/x' is already bound to Rng"):
        bx.Rng(node)
    with pytest.raises(ValueError, match="must have a name"):
        bx.Graph("")
    with pytest.raises(TypeError, match="Graph node"):
        bx.Linear("net/fc", 3, None)


def test_shared_module_keeps_its_own_path():
    """A module created elsewhere and passed in keeps its path: that is parameter sharing."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    shared = bx.Linear(g / "shared", 4, rng)
    actor = bx.Sequential(g / "actor", [shared, jnp.tanh])
    critic = bx.Sequential(g / "critic", [shared, bx.Linear(g / "v", 1, rng)])
    params = rng.seed(bx.Params(), seed=0)
    x = jnp.ones((2, 3))
    a, params = actor(params, x)
    v, params = critic(params, x)
    assert sorted(k for k in params.keys() if k[1] != "rng") == [
        ("net", "shared", "bias"),
        ("net", "shared", "kernel"),
        ("net", "v", "bias"),
        ("net", "v", "kernel"),
    ]
    w = np.asarray(params[("net", "shared", "kernel")].value)
    np.testing.assert_allclose(a, np.tanh(np.ones((2, 3)) @ w), rtol=1e-6)


# ----------------------------------------------------------------------------- Param


def test_param_fields_and_validation():
    p = bx.Param(jnp.zeros(3))
    assert p.trainable is True and p.metadata == {} and p.sharding == ()
    q = p.replace(trainable=False, metadata={"sharding": ("model",)})
    assert q.sharding == ("model",) and p.trainable is True
    with pytest.raises(TypeError, match="trainable must be a bool, got int"):
        bx.Param(jnp.zeros(3), trainable=1)
    with pytest.raises(TypeError, match="metadata must be a dict"):
        bx.Param(jnp.zeros(3), metadata=[("a", 1)])
    with pytest.raises(TypeError, match="unknown field"):
        p.replace(shape=(2,))


# ----------------------------------------------------------------------------- Params


def _params():
    p = bx.Params()
    p[("m", "w")] = bx.Param(jnp.ones((2, 3)), metadata={"sharding": (None, "model")})
    p[("m", "b")] = bx.Param(jnp.zeros(3))
    p[("m", "count")] = bx.Param(jnp.zeros((), jnp.int32), trainable=False)
    return p


def test_params_read_access():
    p = _params()
    assert len(p) == 3
    assert ("m", "w") in p and ("m", "x") not in p and "m/w" not in p
    assert list(p) == list(p.keys()) == sorted(p.keys())
    assert isinstance(p[("m", "w")], bx.Param)
    assert p[("m", "w")].sharding == (None, "model")
    assert [k for k, _ in p.items()] == list(p.keys())
    assert all(isinstance(v, bx.Param) for v in p.values())
    assert p.get(("nope",)) is None
    with pytest.raises(KeyError, match=r"Path 'm/ww' not found.*Did you mean \('m', 'w'\)"):
        p[("m", "ww")]
    with pytest.raises(KeyError, match=r"Use a tuple such as \('m', 'w'\)"):
        p["m/w"]


def test_params_lock_flags_are_copies():
    p = _params()
    locked = p.locked()
    assert locked.is_locked and not p.is_locked
    assert not locked.unlocked().is_locked and locked.is_locked
    with pytest.raises(RuntimeError, match=r"Cannot set 'm/w': these Params are locked"):
        locked[("m", "w")] = bx.Param(jnp.ones((2, 3)))
    with pytest.raises(TypeError, match=r"Expected Param for 'm/z', got ndarray"):
        p[("m", "z")] = np.zeros(2)


def test_split_default_predicate_and_merge_precedence():
    p = _params()
    t, nt = p.split()
    assert list(t.keys()) == [("m", "b"), ("m", "w")]
    assert list(nt.keys()) == [("m", "count")]
    big, small = p.split(lambda path, param: param.value.size > 3)
    assert list(big.keys()) == [("m", "w")]
    override = bx.Params()
    override[("m", "b")] = bx.Param(jnp.full(3, 7.0))
    merged = p.merge(override)
    np.testing.assert_array_equal(merged[("m", "b")].value, np.full(3, 7.0))
    np.testing.assert_array_equal(p[("m", "b")].value, np.zeros(3))  # original untouched
    assert t.merge(nt).keys() == p.keys()


def test_merge_lock_mismatch_names_the_locked_side():
    p = _params()
    with pytest.raises(ValueError, match=r"self is locked but other is unlocked.*other.locked\(\)"):
        p.locked().merge(p)
    with pytest.raises(ValueError, match=r"other is locked but self is unlocked"):
        p.merge(p.locked())
    with pytest.raises(TypeError, match="expects Params"):
        p.merge({"m": 1})


def test_tree_map_keeps_type_flags_metadata_and_paths():
    p = _params().locked()
    q = jax.tree.map(lambda x: x + 1, p)
    assert isinstance(q, bx.Params) and q.is_locked
    assert q[("m", "count")].trainable is False
    assert q[("m", "w")].metadata == {"sharding": (None, "model")}
    np.testing.assert_array_equal(q[("m", "w")].value, np.full((2, 3), 2.0))
    leaves = jax.tree_util.tree_flatten_with_path(p)[0]
    assert [jax.tree_util.keystr(path) for path, _ in leaves] == [
        "['m/b']",
        "['m/count']",
        "['m/w']",
    ]
    assert jax.tree.structure(p) != jax.tree.structure(p.unlocked())


@pytest.mark.standard_promotion  # the test's own Optax calls
def test_params_under_jit_grad_vmap_and_optax():
    p = _params().locked()
    t, nt = p.split()

    @jax.jit
    def f(t, nt):
        return jnp.sum(t[("m", "w")].value * 2.0) + jnp.sum(t[("m", "b")].value), nt

    grads, _ = jax.grad(f, has_aux=True)(t, nt)
    np.testing.assert_array_equal(grads[("m", "w")].value, np.full((2, 3), 2.0))
    np.testing.assert_array_equal(grads[("m", "b")].value, np.ones(3))
    tx = optax.adam(0.1)
    state = tx.init(t)
    assert isinstance(state[0].mu, bx.Params)
    updates, state = tx.update(grads, state, t)
    new_t = optax.apply_updates(t, updates)
    # Adam's first step moves every coordinate by -lr * sign(g).
    np.testing.assert_allclose(new_t[("m", "w")].value, np.full((2, 3), 0.9), rtol=1e-6)
    batched = jax.vmap(lambda t: jax.tree.map(lambda x: x * 2, t))(
        jax.tree.map(lambda x: jnp.stack([x, x]), t)
    )
    assert batched[("m", "w")].value.shape == (2, 2, 3)


def test_jit_does_not_retrace_on_params_from_previous_step():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    mlp = bx.MLP(g / "mlp", (8, 2), rng)
    params = rng.seed(bx.Params(), seed=0)
    _, params = mlp(params, jnp.ones((4, 3)))
    params = params.locked()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(params, x):
        t, nt = params.split()
        grads = jax.grad(lambda t: jnp.sum(mlp(t.merge(nt), x)[0]))(t)
        return jax.tree.map(lambda w, g: w - 0.1 * g, t, grads).merge(nt)

    for _ in range(3):
        params = step(params, jnp.ones((4, 3)))


# ----------------------------------------------------------------------------- Module


def test_get_param_creates_lazily_then_returns_existing():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    mod = bx.Linear(g / "fc", 2, rng)
    params = rng.seed(bx.Params(), seed=3)
    w, params = mod.get_param(params, "w", (2, 3), jax.nn.initializers.normal(), rng=rng)
    # The init key is fold_in(seed, counter) with counter 0, and the counter advances.
    expected = jax.nn.initializers.normal()(jax.random.fold_in(jax.random.key(3), 0), (2, 3))
    np.testing.assert_array_equal(w, expected)
    assert int(rng.get_counter(params)) == 1
    w2, params2 = mod.get_param(params, "w", (2, 3), jax.nn.initializers.ones, rng=rng)
    assert params2 is params
    np.testing.assert_array_equal(w2, w)
    c, params = mod.get_param(
        params, "count", (), jax.nn.initializers.zeros, dtype=jnp.int32, trainable=False
    )
    assert params[("net", "fc", "count")].trainable is False and c.dtype == jnp.int32


def test_get_param_errors_name_the_path_and_shapes():
    g = bx.Graph("net")
    mod = bx.Linear(g / "fc", 2, None)
    params = bx.Params()
    with pytest.raises(KeyError, match=r"'net/fc/w' not found. To create a new parameter"):
        mod.get_param(params, "w")
    _, params = mod.get_param(params, "w", (2, 3), jax.nn.initializers.zeros)
    # The stored parameter is blamed: its path, its shape, the module and the expected shape.
    with pytest.raises(
        ValueError,
        match=r"Parameter 'net/fc/w' is stored with shape \(2, 3\), but Linear 'net/fc' "
        r"expects \(3, 3\)\. Replace the stored value",
    ):
        mod.get_param(params, "w", (3, 3), jax.nn.initializers.zeros)
    with pytest.raises(ValueError, match=r"expects \(3, 2\)\. The stored value is transposed"):
        mod.get_param(params, "w", (3, 2), jax.nn.initializers.zeros)
    with pytest.raises(ValueError, match=r"'net/fc/w' is stored as float32.*int32"):
        mod.get_param(params, "w", (2, 3), jax.nn.initializers.zeros, dtype=jnp.int32)
    # A float param cast to another width (bf16 compute, float64 checks) is accepted.
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    v, _ = mod.get_param(cast, "w", (2, 3), jax.nn.initializers.zeros)
    assert v.dtype == jnp.bfloat16
    with pytest.raises(KeyError, match=r"'net/fc/v' is missing and the params are locked"):
        mod.get_param(params.locked(), "v", (1,), jax.nn.initializers.zeros)
    with pytest.raises(TypeError, match=r"Initializer for parameter 'net/fc/v' failed.*Rng"):
        mod.get_param(params, "v", (2,), jax.nn.initializers.normal())


def test_set_param_returns_new_params_and_checks():
    g = bx.Graph("net")
    mod = bx.Linear(g / "fc", 2, None)
    _, params = mod.get_param(bx.Params(), "w", (2,), jax.nn.initializers.zeros)
    params = params.locked()
    new = mod.set_param(params, "w", jnp.ones(2), trainable=False, metadata={"tag": "x"})
    assert new.is_locked and new[("net", "fc", "w")].trainable is False
    assert new[("net", "fc", "w")].metadata == {"tag": "x"}
    np.testing.assert_array_equal(params[("net", "fc", "w")].value, np.zeros(2))
    with pytest.raises(KeyError, match="'net/fc/q' not found"):
        mod.set_param(params, "q", jnp.ones(2))
    with pytest.raises(ValueError, match="nothing to change"):
        mod.set_param(params, "w")
    with pytest.raises(TypeError, match=r"value must be a jax.Array, got ndarray"):
        mod.set_param(params, "w", np.ones(2))


def test_constructor_arguments_recorded_and_forgotten_super_init():
    g = bx.Graph("net")
    lin = bx.Linear(g / "fc", 5, None, use_bias=False)
    assert lin._init_args == {"output_size": 5, "rng": None, "use_bias": False}
    assert repr(lin) == "Linear(output_size=5, rng=None, use_bias=False) at 'net/fc'"

    class Broken(bx.Module):
        def __init__(self, graph, size):
            self.size = size

    with pytest.raises(RuntimeError, match=r"Did you forget to call super\(\).__init__\(graph\)"):
        Broken(g / "broken", 3)


# ----------------------------------------------------------------------------- Rng


def test_rng_seed_counter_and_keys():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    params = rng.seed(bx.Params(), seed=7)
    assert params[("net", "rng", "seed")].trainable is False
    assert params[("net", "rng", "counter")].value.dtype == jnp.uint32
    k0, params = rng(params)
    k1, params = rng(params)
    np.testing.assert_array_equal(
        jax.random.key_data(k0), jax.random.key_data(jax.random.fold_in(jax.random.key(7), 0))
    )
    np.testing.assert_array_equal(
        jax.random.key_data(k1), jax.random.key_data(jax.random.fold_in(jax.random.key(7), 1))
    )
    params = rng.seed(params, counter=0)
    k0b, _ = rng(params)
    np.testing.assert_array_equal(jax.random.key_data(k0b), jax.random.key_data(k0))
    # Stored as raw key data (cheap to dispatch, saves as a plain array); typed on the way out.
    stored = params[("net", "rng", "seed")]
    assert stored.value.dtype == jnp.uint32 and stored.metadata["impl"] == "threefry2x32"
    assert str(jax.random.key_impl(rng.get_seed(params))) == "threefry2x32"
    np.testing.assert_array_equal(jax.random.key_data(rng.get_seed(params)), [0, 7])


def test_rng_keeps_a_non_default_prng_impl():
    rng = bx.Rng(bx.Graph("net") / "rng")
    params = rng.seed(bx.Params(), seed=jax.random.key(3, impl="rbg"))
    assert params[("net", "rng", "seed")].value.shape == (4,)
    key, params = rng(params)
    expected = jax.random.fold_in(jax.random.key(3, impl="rbg"), 0)
    assert str(jax.random.key_impl(key)) == "rbg"
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(expected))
    # Reseeding with a default key switches the impl back.
    params = rng.seed(params, seed=5)
    assert str(jax.random.key_impl(rng.get_seed(params))) == "threefry2x32"


def test_rng_errors():
    rng = bx.Rng(bx.Graph("net") / "rng")
    with pytest.raises(ValueError, match=r"Rng 'net/rng' not initialized. Seed is required"):
        rng.seed(bx.Params(), counter=1)
    with pytest.raises(KeyError, match=r"rng.seed\(bx.Params\(\), seed=0\)"):
        rng(bx.Params())
    with pytest.raises(KeyError, match="not initialized"):
        rng.get_seed(bx.Params())
    params = rng.seed(bx.Params(), seed=1)
    with pytest.raises(ValueError, match="At least one of seed= or counter="):
        rng.seed(params)
    with pytest.raises(TypeError, match="seed must be an int"):
        rng.seed(bx.Params(), seed=1.5)
    layer = bx.Linear(bx.Graph("m") / "fc", 2, bx.Rng(bx.Graph("m2") / "rng"))
    with pytest.raises(KeyError, match="Rng 'm2/rng' not initialized"):
        layer(bx.Params(), jnp.ones((1, 2)))


# ----------------------------------------------------------------------------- lazy init


def test_eval_shape_of_init_allocates_nothing_and_matches():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    mlp = bx.MLP(g / "mlp", (16, 4), rng)

    def init():
        p = rng.seed(bx.Params(), seed=0)
        _, p = mlp(p, jnp.zeros((1, 8)))
        return p.locked()

    abstract = jax.eval_shape(init)
    assert all(isinstance(v.value, jax.ShapeDtypeStruct) for v in abstract.values())
    concrete = init()
    assert jax.tree.structure(abstract) == jax.tree.structure(concrete)
    assert [v.value.shape for v in abstract.values()] == [v.value.shape for v in concrete.values()]


# ----------------------------------------------------------------------------- conversion


def test_to_dict_from_dict_round_trip_keeps_flags():
    p = _params().locked()
    nested = bx.to_dict(p)
    assert set(nested["m"]) == {"w", "b", "count"}
    assert isinstance(nested["m"]["w"], jax.Array)
    back = bx.from_dict(nested, like=p)
    assert back.is_locked and back[("m", "count")].trainable is False
    assert back[("m", "w")].metadata == {"sharding": (None, "model")}
    exact = bx.from_dict(bx.to_dict(p, with_info=True))
    assert exact[("m", "count")].trainable is False and not exact.is_locked
    plain = bx.from_dict({"a": {"b": jnp.ones(2)}}, trainable=False)
    assert plain[("a", "b")].trainable is False


def test_from_dict_errors_list_paths_and_shapes():
    p = _params()
    nested = bx.to_dict(p)
    del nested["m"]["b"]
    nested["m"]["extra"] = jnp.ones(1)
    with pytest.raises(ValueError, match=r"Missing: \['m/b'\]. Unexpected: \['m/extra'\]"):
        bx.from_dict(nested, like=p)
    bad = bx.to_dict(p)
    bad["m"]["w"] = jnp.ones((3, 2))
    with pytest.raises(ValueError, match=r"'m/w' has shape \(3, 2\), the model expects \(2, 3\)"):
        bx.from_dict(bad, like=p)
    clash = bx.Params()
    clash[("a",)] = bx.Param(jnp.ones(1))
    clash[("a", "b")] = bx.Param(jnp.ones(1))
    with pytest.raises(ValueError, match="both a parameter and a prefix"):
        bx.to_dict(clash)


# ----------------------------------------------------------------------------- KeyError text


def _key_errors():
    """(what, thunk) pairs that raise blox's KeyErrors whose messages carry a fix."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 2, rng)
    return [
        ("unseeded Rng", lambda: rng(bx.Params())),
        ("unseeded Rng via a layer", lambda: fc(bx.Params(), jnp.ones((1, 3)))),
        ("new parameter in locked params", lambda: fc(bx.Params().locked(), jnp.ones((1, 3)))),
        ("unknown path", lambda: bx.Params()[("net", "fc", "kernel")]),
    ]


@pytest.mark.parametrize("index", range(4), ids=[w for w, _ in _key_errors()])
def test_key_errors_print_their_message_unquoted_with_real_newlines(index):
    """jax-blox raises KeyError here and user code may catch it, so blox keeps the type;
    but a plain KeyError prints repr(message): one quoted line with literal backslash-n."""
    import traceback

    _, thunk = _key_errors()[index]
    with pytest.raises(KeyError) as info:
        thunk()
    err = info.value
    message = err.args[0]
    assert isinstance(err, KeyError) and isinstance(message, str)
    assert str(err) == message  # not repr(message)
    assert not str(err).startswith(("'", '"')) and "\\n" not in str(err)
    shown = "".join(traceback.format_exception_only(type(err), err))
    assert shown.rstrip("\n").endswith(message.splitlines()[-1])
    assert ": " + message.splitlines()[0] in shown.splitlines()[0]
    if index < 3:  # the messages that carry code to fix the call span several lines
        assert len(shown.rstrip("\n").splitlines()) == len(message.splitlines()) >= 3
    try:  # still caught by `except KeyError`
        thunk()
    except KeyError:
        pass
