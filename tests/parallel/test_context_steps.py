"""Context parallelism in the train steps: `make_dp_train_step` and
`make_fsdp_train_step` with ``axis=('data', 'context')`` and the batch laid out by
`cp_batch_spec` (rows over data, sequence over context) train a small GPT (embedding,
two `TransformerBlock`\\ s built with ``context_axis``, tied head) exactly as one device
does on the whole batch, over 3 Adam steps (losses and final params, float32): CP x DP
(ring, Explicit mesh; all-gather, Auto), CP x FSDP (params sharded over data x
context), CP x DP x TP; the rows are checked against the data axes only; the
errors."""

import functools

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

F32 = tol(jnp.float32)
V, D, N, B, T, STEPS = 16, 32, 4, 4, 32, 3


class GPT(bx.Module):
    def __init__(self, graph, rng, **kw):
        super().__init__(graph)
        self.embed = bx.Embed(graph / "embed", V, D, rng)
        self.blocks = [
            bx.TransformerBlock(
                graph / f"block_{i}", D, N, rng, mlp_size=2 * D, use_rope=True, **kw
            )
            for i in range(2)
        ]
        self.norm = bx.LayerNorm(graph / "norm")

    def __call__(self, params, tokens):
        h, params = bp.fsdp_call(self.embed, params, tokens)
        for block in self.blocks:
            h, params = bp.fsdp_call(block, params, h, is_causal=True)
        h, params = self.norm(params, h)
        return bp.fsdp_call(self.embed.attend, params, h)


def _setup(**kw):
    g = bx.Graph("gpt")
    rng = bx.Rng(g / "rng")
    model = GPT(g / "lm", rng, **kw)

    def loss_fn(params, x, y):
        logits, params = model(params, x)
        ll = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(ll, y[..., None], axis=-1)), params

    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, jnp.zeros((1, T), jnp.int32))
    r = np.random.default_rng(0)
    toks = r.integers(0, V, (STEPS, B, T + 1)).astype(np.int32)
    return model, loss_fn, jax.tree.map(np.asarray, params.locked()), toks


@functools.cache
def _reference():
    """One device, the whole batch: the plain model (no context or model axis; the same
    paths and initial values as every model of these tests), jax.value_and_grad and
    Adam, computed once."""
    _, loss_fn, params, toks = _setup()
    with jax.default_matmul_precision("highest"):
        return _reference_run(loss_fn, params, toks, optax.adam(1e-2))


def _reference_run(loss_fn, params, toks, tx):
    params = jax.device_put(params)
    opt = tx.init(params.split()[0])

    @jax.jit
    def step(params, opt, x, y):
        t, nt = params.split()
        loss, g = jax.value_and_grad(lambda t: loss_fn(t.merge(nt), x, y)[0])(t)
        with jax.numpy_dtype_promotion("standard"):  # Optax mixes float and int32 counts
            updates, opt = tx.update(g, opt, t)
        return optax.apply_updates(t, updates).merge(nt), opt, loss

    losses = []
    for i in range(STEPS):
        params, opt, loss = step(params, opt, toks[i, :, :-1], toks[i, :, 1:])
        losses.append(float(loss))
    return losses, params


def _run(step, params, specs, mesh, toks, tx):
    sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
    params = jax.tree.map(jax.device_put, params, sh)
    t = params.split()[0]
    opt = jax.jit(
        tx.init, out_shardings=bp.opt_state_shardings(jax.eval_shape(tx.init, t), specs, mesh)
    )(t)
    step = jax.jit(step)
    losses = []
    for i in range(STEPS):
        params, opt, m = step(params, opt, toks[i, :, :-1], toks[i, :, 1:])
        losses.append(float(m["loss"]))
    return losses, params


def _compare(got, ref):
    (l1, p1), (l0, p0) = got, ref
    np.testing.assert_allclose(l1, l0, **F32)
    for path in p0.keys():
        np.testing.assert_allclose(
            np.asarray(p1[path].value), np.asarray(p0[path].value), rtol=1e-5, atol=1e-5,
            err_msg=str(path),
        )  # fmt: skip


CASES = [
    # (name, mesh shape, axis names, axis types, block kwargs)
    ("dp_ring", (2, 4), ("data", "context"), "explicit", dict(context_axis="context")),
    (
        "dp_allgather",
        (4, 2),
        ("data", "context"),
        "auto",
        dict(context_axis="context", context_variant="allgather"),
    ),
    (
        "dp_tp_ring",
        (2, 2, 2),
        ("data", "model", "context"),
        "auto",
        dict(context_axis="context", tp_axis="model"),
    ),
]


@pytest.mark.parametrize("name,shape,names,types,kw", CASES, ids=[c[0] for c in CASES])
def test_dp_step_over_data_and_context_equals_one_device(name, shape, names, types, kw):
    model, loss_fn, params, toks = _setup(**kw)
    tx = optax.adam(1e-2)
    with jax.default_matmul_precision("highest"):
        ref = _reference()
        mesh = bp.make_mesh(shape, names, axis_types=types)
        rules = [("rng/.*", None), ("embed/embedding", None)]
        if "model" in names:
            rules = bp.transformer_tp_rules("model") + rules
        specs = bp.param_specs(params, rules, mesh, replicate_rest=True)
        bp.check_context_parallel(model, "context")
        step = bp.make_dp_train_step(
            loss_fn,
            tx,
            mesh,
            axis=("data", "context"),
            param_specs=specs,
            batch_spec=bp.cp_batch_spec("data", "context"),
        )
        _compare(_run(step, params, specs, mesh, toks, tx), ref)


def test_fsdp_step_sharded_over_data_and_context_equals_one_device():
    model, loss_fn, params, toks = _setup(context_axis="context")
    tx = optax.adam(1e-2)
    with jax.default_matmul_precision("highest"):
        ref = _reference()
        mesh = bp.make_mesh((2, 4), ("data", "context"))
        axes = ("data", "context")
        specs = bp.fsdp_specs(params, mesh, axis=axes, min_size=256)
        kernel = specs[("gpt", "lm", "block_0", "mlp", "linear_0", "kernel")].value
        assert axes in tuple(kernel), kernel  # sharded over both axes (8 shards)
        step = bp.make_fsdp_train_step(
            loss_fn, tx, mesh, specs, axis=axes, batch_spec=bp.cp_batch_spec(*axes)
        )
        _compare(_run(step, params, specs, mesh, toks, tx), ref)
        # Specs sharded over data only do not fit a step over data x context.
        specs_d = bp.fsdp_specs(params, mesh, axis="data", min_size=256)
        with pytest.raises(
            ValueError, match="fsdp_specs\\(params, mesh, axis=\\('data', 'context'\\)"
        ):
            bp.make_fsdp_train_step(loss_fn, tx, mesh, specs_d, axis=axes)


def test_batch_checks_count_the_data_axes_only_and_errors_name_the_axes():
    _, loss_fn, params, toks = _setup(context_axis="context")
    tx = optax.adam(1e-2)
    mesh = bp.make_mesh((2, 4), ("data", "context"))
    step = bp.make_dp_train_step(
        loss_fn, tx, mesh, axis=("data", "context"), batch_spec=bp.cp_batch_spec()
    )
    p = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), params)
    opt = tx.init(p.split()[0])
    x = toks[0, :, :-1]
    # 2 rows split over data (2): fine for the check; 3 rows are not.
    with pytest.raises(ValueError, match="has 3 rows, not divisible by data-parallel size 2"):
        step(p, opt, x[:3], x[:3])
    with pytest.raises(
        ValueError, match="dimension 1 \\(length 30\\) is split over \\('context',\\)"
    ):
        step(p, opt, x[:, :30], x[:, :30])
    with pytest.raises(
        ValueError, match="data axis 'seq' of axis=\\('data', 'seq'\\) is not an axis"
    ):
        bp.make_dp_train_step(loss_fn, tx, mesh, axis=("data", "seq"))
    with pytest.raises(TypeError, match="tuple of distinct names"):
        bp.make_dp_train_step(loss_fn, tx, mesh, axis=("data", "data"))


def test_dropout_differs_on_every_data_and_context_shard():
    """The seeds are folded with both indices: with ``loss = sum(w * dropout(1))`` the
    gradient of ``w`` is the mean of the 8 shards' masks scaled by 1 / (1 - 0.5), so
    its entries are multiples of 2 / 8; masks shared along ``context`` would give
    multiples of 2 / 2 only."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    drop = bx.Dropout(g / "drop", 0.5, rng)
    params = rng.seed(bx.Params(), seed=0)
    params[("net", "w")] = bx.Param(jnp.zeros((64,)))

    def loss_fn(params, x):
        m, params = drop(params, jnp.ones((64,)), is_training=True)
        return jnp.sum(params[("net", "w")].value * m) + 0.0 * jnp.sum(x), params

    mesh = bp.make_mesh((2, 4), ("data", "context"))
    tx = optax.sgd(1.0)
    step = bp.make_dp_train_step(
        loss_fn, tx, mesh, axis=("data", "context"), batch_spec=bp.cp_batch_spec(), rngs=[rng]
    )
    p = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(mesh, P())), params)
    new, _, _ = jax.jit(step)(p, tx.init(p.split()[0]), jnp.zeros((2, 4)))
    grad = -np.asarray(new[("net", "w")].value)  # one SGD step of size 1 from 0
    np.testing.assert_allclose(grad * 4, np.round(grad * 4), atol=1e-6)  # k / 4
    assert np.any(np.abs(grad - np.round(grad)) > 0.1)  # not all multiples of 1
