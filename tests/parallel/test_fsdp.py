"""Fully sharded data parallelism against independent references: the
one-device run (plain ``jax.value_and_grad`` + Optax on the whole batch) and plain DP
(`make_dp_train_step`); per-device bytes read from the arrays' shardings; the compiled
program's memory analysis and collectives; checkpoints restored onto other layouts; the
errors."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import ckpt
from blox import parallel as bp

N = 8


class MLP(bx.Module):
    """``L`` x (Linear -> tanh), each Linear called through `fsdp_call`."""

    def __init__(self, graph, width, layers, rng, prefetch=False):
        super().__init__(graph)
        self.layers = [bx.Linear(graph / f"fc_{i}", width, rng) for i in range(layers)]
        self.prefetch = prefetch

    def __call__(self, params, x):
        before = None  # with prefetch, a layer's gather waits only for the previous input
        for fc in self.layers:
            after = before if self.prefetch else None
            before = x
            x, params = bp.fsdp_call(fc, params, x, gather_after=after)
            x = jnp.tanh(x)
        return x, params


@functools.cache  # one `init` per model: `_initial` computes its values once
def _setup(width=32, layers=3, prefetch=False):
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    model = MLP(g / "mlp", width, layers, rng, prefetch)

    def init():
        return model(rng.seed(bx.Params(), seed=0), jnp.zeros((1, width)))[1].locked()

    def loss_fn(p, x, y):
        out, p = model(p, x)
        return jnp.mean((out - y) ** 2), p

    return init, loss_fn


def _data(steps, batch, width, seed=0):
    r = np.random.default_rng(seed)
    xs = jnp.asarray(r.normal(size=(steps, batch, width)), jnp.float32)
    ys = jnp.asarray(r.normal(size=(steps, batch, width)), jnp.float32)
    return xs, ys


def _shardings(specs, mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def _state(init, tx, specs, mesh):
    """Params and optimizer state created in place with `specs` (never whole on one device)."""
    abstract = jax.eval_shape(init)
    params = jax.jit(init, out_shardings=_shardings(specs, mesh))()
    t = params.split()[0]
    opt_sh = bp.opt_state_shardings(jax.eval_shape(tx.init, t), specs, mesh)
    assert abstract.keys() == params.keys()
    return params, jax.jit(tx.init, out_shardings=opt_sh)(t)


@functools.cache
def _initial(init) -> bx.Params:
    """``init()``'s params as NumPy arrays, computed once (one compilation) per model."""
    return jax.tree.map(np.asarray, jax.jit(init)())


def _placed_state(init, tx, specs=None, mesh=None):
    """``init()``'s params placed with `specs` on `mesh` (None: on the default device)
    and the optimizer state created there: every run of a test starts from the same
    values (`_initial`), without compiling the initializer again."""
    if mesh is None:
        params = jax.device_put(_initial(init))
        return params, jax.jit(tx.init)(params.split()[0])
    params = jax.tree.map(jax.device_put, _initial(init), _shardings(specs, mesh))
    t = params.split()[0]
    opt_sh = bp.opt_state_shardings(jax.eval_shape(tx.init, t), specs, mesh)
    return params, jax.jit(tx.init, out_shardings=opt_sh)(t)


def _zeros_state(abstract, tx, specs=None, mesh=None):
    """Zero params and optimizer state placed with `specs` on `mesh` (None: on the
    default device) from the host, no initializer compiled: for a test that reads only
    shardings and the compiled step's memory, or a checkpoint's restore target."""
    t = jax.eval_shape(lambda p: p.split()[0], abstract)
    opt = jax.eval_shape(tx.init, t)
    if mesh is None:
        return jax.tree.map(lambda s: jax.device_put(np.zeros(s.shape, s.dtype)), (abstract, opt))

    def put(tree, shardings):
        return jax.tree.map(
            lambda s, sh: jax.device_put(np.zeros(s.shape, s.dtype), sh), tree, shardings
        )

    params = put(abstract, _shardings(specs, mesh))
    return params, put(opt, bp.opt_state_shardings(opt, specs, mesh))


def _one_device_step(loss_fn, tx):
    """The reference: the whole batch on one device, plain jax.value_and_grad + Optax."""

    def step(params, opt, x, y):
        t, nt = params.split()
        (loss, _), g = jax.value_and_grad(lambda t: loss_fn(t.merge(nt), x, y), has_aux=True)(t)
        with jax.numpy_dtype_promotion("standard"):  # Optax mixes float and int32 counts
            updates, opt = tx.update(g, opt, t)
        return optax.apply_updates(t, updates).merge(nt), opt, loss

    return jax.jit(step)


def _run(step, params, opt, xs, ys, steps):
    losses = []
    for i in range(steps):
        params, opt, m = step(params, opt, xs[i], ys[i])
        losses.append(float(m["loss"] if isinstance(m, dict) else m))
    return losses, params


def _tx(clip):
    adam = optax.adam(1e-2)
    return optax.chain(optax.clip_by_global_norm(0.05), adam) if clip else adam


@pytest.mark.parametrize(
    "microbatches, clip, gather, axis_types",
    [(1, False, "per_layer", "explicit"), (2, True, "per_layer", "auto"),
     (2, True, "per_step", "explicit")],
)  # fmt: skip
def test_five_adam_steps_equal_dp_and_one_device(microbatches, clip, gather, axis_types):
    width, batch, steps = 32, 16, 5
    init, loss_fn = _setup(width, prefetch=axis_types == "auto")
    tx = _tx(clip)
    xs, ys = _data(steps, batch, width)
    mesh = bp.make_mesh((N,), ("data",), axis_types=axis_types)
    abstract = jax.eval_shape(init)
    specs = bp.fsdp_specs(abstract, mesh, min_size=64)
    # The kernels are sharded over data (dimension 0 here), the biases replicated.
    assert specs[("net", "mlp", "fc_0", "kernel")].value == P("data", None)
    assert specs[("net", "mlp", "fc_0", "bias")].value == P()
    with jax.default_matmul_precision("highest"):
        fsdp = jax.jit(
            bp.make_fsdp_train_step(
                loss_fn, tx, mesh, specs, microbatches=microbatches, gather=gather,
                grad_norm=True,
            )
        )  # fmt: skip
        p, o = _placed_state(init, tx, specs, mesh)
        assert p[("net", "mlp", "fc_1", "kernel")].value.sharding.spec[0] == "data"
        l_fsdp, p_fsdp = _run(fsdp, p, o, xs, ys, steps)

        rep = jax.tree.map(lambda _: P(), abstract)
        dp = jax.jit(bp.make_dp_train_step(loss_fn, tx, mesh, microbatches=microbatches))
        l_dp, p_dp = _run(dp, *_placed_state(init, tx, rep, mesh), xs, ys, steps)

        l_one, p_one = _run(_one_device_step(loss_fn, tx), *_placed_state(init, tx), xs, ys,
                            steps)  # fmt: skip
    np.testing.assert_allclose(l_fsdp, l_one, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(l_dp, l_one, rtol=1e-5, atol=1e-6)
    for key in p_one.keys():
        np.testing.assert_allclose(p_fsdp[key].value, p_one[key].value, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(p_dp[key].value, p_one[key].value, rtol=1e-5, atol=1e-5)
    assert p_fsdp[("net", "mlp", "fc_2", "kernel")].value.sharding.spec[0] == "data"


def test_grad_norm_metric_equals_the_unsharded_global_norm():
    width, batch = 32, 16
    init, loss_fn = _setup(width)
    tx = optax.sgd(0.0)
    xs, ys = _data(1, batch, width)
    mesh = bp.make_mesh((N,), ("data",))
    specs = bp.fsdp_specs(jax.eval_shape(init), mesh, min_size=64)
    with jax.default_matmul_precision("highest"):
        step = jax.jit(bp.make_fsdp_train_step(loss_fn, tx, mesh, specs, grad_norm=True))
        _, _, m = step(*_placed_state(init, tx, specs, mesh), xs[0], ys[0])
        p = _initial(init)
        t, nt = p.split()
        g = jax.grad(lambda t: loss_fn(t.merge(nt), xs[0], ys[0])[0])(t)
        flat = np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree.leaves(g)])
    np.testing.assert_allclose(float(m["grad_norm"]), np.linalg.norm(flat), rtol=1e-5)


def _small_bytes(params, specs):
    """Bytes of the leaves FSDP leaves replicated (below the size threshold)."""
    sizes = [
        v.size * v.dtype.itemsize
        for v, s in zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=lambda x:
                        isinstance(x, P)), strict=True)
        if "data" not in jax.tree.leaves(tuple(s))
    ]  # fmt: skip
    return sum(sizes)


@pytest.mark.full_optimizations
def test_memory_and_collectives_of_a_16_layer_step():
    width, layers, batch = 128, 16, 16
    init, loss_fn = _setup(width, layers)
    tx = optax.adam(1e-3)
    mesh = bp.make_mesh((N,), ("data",))
    abstract = jax.eval_shape(init)
    specs = bp.fsdp_specs(abstract, mesh)  # default threshold: the biases stay replicated
    params, opt = _zeros_state(abstract, tx, specs, mesh)

    # 1. State bytes per device, read from the shardings: <= 1.1 / N of the replicated
    # run's, plus the small replicated leaves (each held whole, with its Adam moments).
    rep = jax.tree.map(lambda _: P(), abstract)
    r_params, r_opt = _zeros_state(abstract, tx, rep, mesh)
    replicated = bp.bytes_per_device((r_params, r_opt))
    assert replicated == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((r_params, r_opt)))
    small = 3 * _small_bytes(params.split()[0], specs.split()[0])
    assert bp.bytes_per_device((params, opt)) <= 1.1 * replicated / N + small
    assert small < 0.02 * replicated

    # 2. The compiled step's temporaries hold at most two layers' full weights, plus the
    # activations (one (B/N, D) array per layer, counted 4 times); all 16 are 8x more.
    step = jax.jit(bp.make_fsdp_train_step(loss_fn, tx, mesh, specs), donate_argnums=(0, 1))
    x = jax.device_put(jnp.zeros((batch, width)), NamedSharding(mesh, P("data")))
    lowered = step.lower(params, opt, x, x)
    compiled = lowered.compile(compiler_options={"xla_cpu_use_fusion_emitters": True})
    layer = width * width * 4
    acts = layers * (batch // N) * width * 4
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 2 * layer + 4 * acts, (temp, layer, acts)
    assert 2 * layer + 4 * acts < layers * layer / 4

    # 3. Collectives: per layer one all-gather forward, one backward (the first layer's
    # backward needs no weights: the batch gets no gradient), one reduce-scatter; the
    # all-reduces carry biases and scalars only.
    text = lowered.as_text()
    assert text.count("stablehlo.all_gather") == 2 * layers - 1
    assert text.count("stablehlo.reduce_scatter") == layers
    hlo = compiled.as_text()
    assert len(re.findall(r" all-gather\(", hlo)) == 2 * layers - 1
    assert len(re.findall(r" reduce-scatter\(", hlo)) == layers
    for line in (ln for ln in hlo.splitlines() if re.search(r" all-reduce(-start)?\(", ln)):
        shapes = re.findall(r"f32\[([\d,]*)\]", re.split(r" all-reduce(?:-start)?\(", line)[0])
        assert shapes and all(int(np.prod([int(d) for d in s.split(",") if d])) <= width
                              for s in shapes), line  # fmt: skip


def test_a_model_over_the_per_device_budget_trains_under_fsdp():
    width, layers, batch, steps = 256, 6, 16, 3
    budget = 2 * 2**20  # bytes per device
    init, loss_fn = _setup(width, layers)
    tx = optax.adam(1e-3)
    mesh = bp.make_mesh((N,), ("data",))
    abstract = jax.eval_shape(init)
    full = 3 * sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.split()[0]))
    assert full > 2 * budget  # params + Adam's m and v, replicated: over the budget
    specs = bp.fsdp_specs(abstract, mesh)
    params, opt = _state(init, tx, specs, mesh)
    assert bp.bytes_per_device((params, opt)) < budget / 3
    xs, ys = _data(steps, batch, width, seed=3)
    with jax.default_matmul_precision("highest"):
        step = jax.jit(bp.make_fsdp_train_step(loss_fn, tx, mesh, specs), donate_argnums=(0, 1))
        m = step.lower(params, opt, xs[0], ys[0]).compile().memory_analysis()
        peak = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        assert peak + m.temp_size_in_bytes < budget, m
        losses, _ = _run(step, params, opt, xs, ys, steps)
        p1 = init()
        ref, _ = _run(_one_device_step(loss_fn, tx), p1, tx.init(p1.split()[0]), xs, ys, steps)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)


def test_checkpoint_on_fsdp8_restores_onto_dp8_fsdp4_and_one_device(tmp_path):
    width, batch = 32, 16
    init, loss_fn = _setup(width)
    tx = optax.adam(1e-2)
    xs, ys = _data(4, batch, width, seed=5)
    abstract = jax.eval_shape(init)
    mesh8 = bp.make_mesh((N,), ("data",))
    specs8 = bp.fsdp_specs(abstract, mesh8, min_size=64)
    with jax.default_matmul_precision("highest"):
        step8 = jax.jit(bp.make_fsdp_train_step(loss_fn, tx, mesh8, specs8))
        p, o = _placed_state(init, tx, specs8, mesh8)
        p, o = _run_state(step8, p, o, xs[:2], ys[:2])
        with ckpt.CheckpointManager(tmp_path / "c", async_save=False) as mngr:
            mngr.save(2, {"params": p, "opt_state": o}, force=True)
        ref, _ = _run(step8, p, o, xs[2:], ys[2:], 2)

        rep = jax.tree.map(lambda _: P(), abstract)
        mesh4 = bp.make_mesh((4,), ("data",), devices=jax.devices()[:4])
        specs4 = bp.fsdp_specs(abstract, mesh4, min_size=64)
        targets = {  # restore targets: their shardings count, their values do not
            "dp8": (_zeros_state(abstract, tx, rep, mesh8),
                    jax.jit(bp.make_dp_train_step(loss_fn, tx, mesh8))),
            "fsdp4": (_zeros_state(abstract, tx, specs4, mesh4),
                      jax.jit(bp.make_fsdp_train_step(loss_fn, tx, mesh4, specs4))),
            "one": (_zeros_state(abstract, tx), _one_device_step(loss_fn, tx)),
        }  # fmt: skip
        for name, ((tp, to), step) in targets.items():
            with ckpt.CheckpointManager(tmp_path / "c") as mngr:
                state = mngr.restore({"params": tp, "opt_state": to})
            key = ("net", "mlp", "fc_0", "kernel")
            assert state["params"][key].value.sharding == tp[key].value.sharding, name
            losses, _ = _run(step, state["params"], state["opt_state"], xs[2:], ys[2:], 2)
            np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=name)


def _run_state(step, params, opt, xs, ys):
    for x, y in zip(xs, ys, strict=True):
        params, opt, _ = step(params, opt, x, y)
    return params, opt


def test_fsdp_x_tp_on_a_2x4_mesh_equals_one_device():
    d, n, f, t, batch, steps = 16, 4, 32, 4, 4, 3
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    block = bp.ParallelTransformerBlock(g / "block", model_size=d, num_heads=n, rng=rng,
                                        mlp_size=f)  # fmt: skip

    def init():
        p = rng.seed(bx.Params(), seed=0)
        return block(p, jnp.zeros((1, t, d)), is_causal=True, is_training=False)[1].locked()

    def loss_fn(p, x, y):
        out, p = bp.fsdp_call(block, p, x, is_causal=True, is_training=False)
        return jnp.mean((out - y) ** 2), p

    tx = optax.adam(1e-2)
    r = np.random.default_rng(2)
    xs = jnp.asarray(r.normal(size=(steps, batch, t, d)), jnp.float32)
    ys = jnp.asarray(r.normal(size=(steps, batch, t, d)), jnp.float32)
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    abstract = jax.eval_shape(init)
    base = bp.param_specs(abstract, bp.transformer_tp_rules() + [("rng/(seed|counter)", None)],
                          mesh)  # fmt: skip
    specs = bp.fsdp_specs(abstract, mesh, base=base, min_size=64)
    assert specs[("net", "block", "mlp", "linear_0", "kernel")].value == P("data", "model")
    assert specs[("net", "block", "mlp", "linear_1", "kernel")].value == P("model", "data")
    with jax.default_matmul_precision("highest"):
        step = jax.jit(bp.make_fsdp_train_step(loss_fn, tx, mesh, specs))
        losses, p = _run(step, *_placed_state(init, tx, specs, mesh), xs, ys, steps)
        ref, p_ref = _run(_one_device_step(loss_fn, tx), *_placed_state(init, tx), xs, ys, steps)
    np.testing.assert_allclose(losses, ref, rtol=1e-5)
    # The attention key bias has a zero gradient in exact arithmetic (softmax ignores a
    # shift shared by all keys): Adam turns its rounding noise into steps of size lr.
    for key in p_ref.split()[0].keys():
        if key[-2:] != ("key", "bias"):
            np.testing.assert_allclose(
                p[key].value, p_ref[key].value, rtol=1e-5, atol=1e-5, err_msg=str(key)
            )


def test_fsdp_specs_rules_and_defaults():
    mesh = bp.make_mesh((N,), ("data",))
    params = bx.Params()
    params[("a", "kernel")] = bx.Param(jnp.zeros((8, 64)))  # largest divisible: dim 1
    params[("a", "odd")] = bx.Param(jnp.zeros((12, 9)))  # no divisible dimension
    params[("a", "stat")] = bx.Param(jnp.zeros((64, 64)), trainable=False)
    params[("b", "embedding")] = bx.Param(jnp.zeros((64, 16)))
    specs = bp.fsdp_specs(params, mesh, min_size=8, rules=[("b/embedding", 1)])
    got = {"/".join(k): v for k, v in specs.arrays().items()}
    assert got == {"a/kernel": P(None, "data"), "a/odd": P(), "a/stat": P(),
                   "b/embedding": P(None, "data")}  # fmt: skip


@pytest.mark.parametrize("entry", ["fsdp_specs", "make_fsdp_train_step", "make_dp_train_step"])
def test_the_mesh_and_data_axis_checks_name_their_entry_point(entry):
    """DP and FSDP share one check of the mesh and its data axis: the same messages,
    each naming the function called."""
    mesh = bp.make_mesh((N,), ("data",))
    params = bx.Params()
    params[("a", "kernel")] = bx.Param(jnp.zeros((16, 64)))
    specs = bp.fsdp_specs(params, mesh)
    loss_fn, tx = (lambda p, x: (jnp.sum(x), p)), optax.sgd(0.1)
    call = {
        "fsdp_specs": lambda m, a: bp.fsdp_specs(params, m, axis=a),
        "make_fsdp_train_step": lambda m, a: bp.make_fsdp_train_step(loss_fn, tx, m, specs, axis=a),
        "make_dp_train_step": lambda m, a: bp.make_dp_train_step(loss_fn, tx, m, axis=a),
    }[entry]
    with pytest.raises(
        TypeError,
        match=rf"^{entry}: mesh must be a jax.sharding.Mesh, got tuple\. Build one with "
        r"blox\.parallel\.make_mesh\.$",
    ):
        call((8,), "data")
    with pytest.raises(
        ValueError,
        match=rf"^{entry}: data axis 'batch' is not an axis of the mesh \{{'data': 8\}}\. "
        r"Pass axis=<one of \('data',\)>\.$",
    ):
        call(mesh, "batch")


def test_errors():
    mesh = bp.make_mesh((N,), ("data",))
    params = bx.Params()
    params[("a", "kernel")] = bx.Param(jnp.zeros((12, 64)))
    with pytest.raises(ValueError, match=r"data axis 'batch' is not an axis of the mesh"):
        bp.fsdp_specs(params, mesh, axis="batch")
    with pytest.raises(ValueError, match=r"shards dimension 0 of 'a/kernel' \(12, 64\).*"
                       r"does not divide"):  # fmt: skip
        bp.fsdp_specs(params, mesh, rules=[("kernel", 0)])
    with pytest.raises(ValueError, match=r"already uses the data axis 'data'"):
        bp.fsdp_specs(params, mesh, base=bp.param_specs(params, [("kernel", (None, "data"))]))
    with pytest.raises(TypeError, match=r"each rule is \(pattern, dim\)"):
        bp.fsdp_specs(params, mesh, rules=[("kernel", "data")])
    specs = bp.fsdp_specs(params, mesh)
    with pytest.raises(ValueError, match=r"gather must be one of"):
        bp.fsdp_value_and_grad(lambda p: (0.0, p), specs, gather="per_tensor")
    f = bp.fsdp_value_and_grad(lambda p, x: (jnp.sum(x), p), specs)
    with pytest.raises(ValueError, match=r"axis 'data' is not bound here"):
        f(params, jnp.ones(3))
    with pytest.raises(TypeError, match=r"Pass a blox Module .* or under=<path prefix>"):
        bp.fsdp_call(lambda p, x: (x, p), params, jnp.ones(3))
    step = bp.make_fsdp_train_step(lambda p, x: (jnp.sum(x), p), optax.sgd(0.1), mesh, specs)
    with pytest.raises(ValueError, match=r"not divisible by data-parallel size 8"):
        step(params, None, jnp.ones((12, 2)))
    bad = jax.tree.map(lambda _: P(("data", "model")), params)
    with pytest.raises(ValueError, match=r"must be the last name of the entry"):
        bp.fsdp_value_and_grad(lambda p: (0.0, p), bad)
