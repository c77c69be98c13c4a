"""Interleaved (virtual-stage) 1F1B in the pipeline runtime: each device runs
``v`` stage chunks (model stage ``c p + s`` on device ``s``), against the same ``v p``
stages run sequentially on one device with plain ``jax.value_and_grad`` (the
independent reference): loss, every gradient and the non-trainable state; memory and
cost per slot from the compiled program; DP x PP; every misuse error."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from blox import parallel as bp
from blox.parallel import pipeline_value_and_grad, stack_stages, unstack_stages
from blox.parallel._schedules import schedule_from
from tests.parallel.pipeline_common import Counter, conditional_heads
from tests.tolerances import tol

P, WIDTH, D_IN, CLASSES = 4, 8, 5, 3
F32 = tol(jnp.float32)


def model(n_stages, dtype=None):
    """An embedding (`first_fn`), `n_stages` stages of Linear + tanh (+ a residual and a
    `Counter`), a head and cross-entropy (`last_fn`). `dtype`: the layers' compute dtype
    (a mixed-precision policy: params stay f32)."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    embed = bx.Linear(g / "embed", WIDTH, rng, dtype=dtype)
    head = bx.Linear(g / "head", CLASSES, rng, dtype=dtype)
    sg = bx.Graph("stage")
    srng = bx.Rng(sg / "rng")
    fc = bx.Linear(sg / "fc", WIDTH, srng, dtype=dtype)
    count = Counter(sg / "count")

    def first_fn(params, x):
        return embed(params, x, precision="highest")

    def stage_fn(params, h):  # fsdp_call: a plain call unless the weights are FSDP shards
        y, params = bp.fsdp_call(fc, params, h, precision="highest")
        y, params = count(params, y)
        return h + jnp.tanh(y), params

    def last_fn(params, h, y):
        logits, params = head(params, h, precision="highest")
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return jnp.mean(ce), params

    shared = rng.seed(bx.Params(), seed=0)
    h, shared = first_fn(shared, jnp.zeros((1, D_IN)))
    _, shared = last_fn(shared, h, jnp.zeros((1,), jnp.int32))
    stages = [stage_fn(srng.seed(bx.Params(), seed=10 + s), h)[1].locked() for s in range(n_stages)]
    return first_fn, stage_fn, last_fn, shared.locked(), stages


def data(n, seed=0):
    r = np.random.default_rng(seed)
    return (
        jnp.asarray(r.normal(size=(n, D_IN)), jnp.float32),
        jnp.asarray(r.integers(0, CLASSES, size=(n,)), jnp.int32),
    )


def sequential(first_fn, stage_fn, last_fn, shared, stages, x, y, m):
    """One device, no pipeline: microbatch by microbatch, stage by stage in model order
    (two nested ``lax.scan``\\ s, so the compile does not grow with m or the stage count),
    under ``jax.value_and_grad``; returns the loss, the gradients ``(shared, [per
    stage])``, the stages' state and the shared state."""
    xs = x.reshape(m, x.shape[0] // m, *x.shape[1:])
    ys = y.reshape(m, y.shape[0] // m, *y.shape[1:])
    stack = lambda ts: jax.tree.map(lambda *a: jnp.stack(a), *ts)  # noqa: E731

    def loss_fn(trainables, states, st_sh):
        tr_sh, trs = trainables

        def stage(h, tr_st):
            h, p = stage_fn(tr_st[0].merge(tr_st[1]), h)
            return h, p.split()[1]

        def one(carry, xy):
            states, st_sh = carry
            h, p_sh = first_fn(tr_sh.merge(st_sh), xy[0])
            h, states = jax.lax.scan(stage, h, (trs, states))
            loss, p_sh = last_fn(p_sh, h, xy[1])
            return (states, p_sh.split()[1]), loss

        (states, st_sh), losses = jax.lax.scan(one, (states, st_sh), (xs, ys))
        return jnp.mean(losses), (states, st_sh)

    trainables = (shared.split()[0], stack([s.split()[0] for s in stages]))
    with jax.default_matmul_precision("highest"):
        (loss, (states, st_sh)), (g_sh, g) = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
            trainables, stack([s.split()[1] for s in stages]), shared.split()[1]
        )
    n = len(stages)
    split = lambda t: [jax.tree.map(lambda a, k=k: a[k], t) for k in range(n)]  # noqa: E731
    return loss, (g_sh, split(g)), split(states), st_sh


def mesh(shape=(P,), names=("stage",)):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def close(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def check_against_sequential(schedule, m, v, policy=None, **kw):
    """Runs `schedule` on a (stage,) mesh of P devices with v chunks each and compares
    loss, gradients and state with the sequential model of v P stages (stacked in the
    schedule's `stacking_order`: model order, or ZB-V's)."""
    dtype = jnp.bfloat16 if policy == "bf16" else None
    first_fn, stage_fn, last_fn, shared, stages = model(v * P, dtype)
    x, y = data(2 * m)
    ref_loss, (ref_g_sh, ref_g), ref_states, ref_st_sh = sequential(
        first_fn, stage_fn, last_fn, shared, stages, x, y, m
    )
    interleaved = schedule == "interleaved"
    order = schedule_from(schedule, P, m, v if interleaved else None).stacking_order
    step = jax.jit(
        pipeline_value_and_grad(
            stage_fn,
            last_fn,
            mesh(),
            schedule=schedule,
            num_microbatches=m,
            first_fn=first_fn,
            virtual_stages=v if interleaved else None,
            **kw,
        )
    )
    with jax.default_matmul_precision("highest"):
        loss, (g, g_sh), (new_stages, new_shared) = step(
            stack_stages([stages[k] for k in order], virtual_stages=v), shared, x, y
        )
    # bf16 policy: the same bf16 ops as the reference, summed in another order
    t = tol(jnp.bfloat16) if policy == "bf16" else F32
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=t["rtol"])
    assert jax.tree.leaves(g)[0].dtype == jnp.float32  # accumulated in the params' dtype
    close(g_sh, ref_g_sh, **t)
    got = unstack_stages(g, virtual_stages=v)
    assert len(got) == v * P
    for j, gs in enumerate(got):
        close(gs, ref_g[order[j]], **t)
    for j, ps in enumerate(unstack_stages(new_stages, virtual_stages=v)):
        k = order[j]
        calls = int(stages[k]["stage", "count", "calls"].value)
        assert int(ps["stage", "count", "calls"].value) == calls + m
        close(ps.split()[1], ref_states[k], **t)
    close(new_shared.split()[1], ref_st_sh, rtol=0, atol=0)


GRID = [(v, m, None) for v in (2, 4) for m in (4, 8, 16)] + [(2, 8, "bf16")]


@pytest.mark.parametrize("v,m,policy", GRID)
def test_interleaved_matches_sequential(v, m, policy):
    check_against_sequential("interleaved", m, v, policy)


# -- cost: compiled programs --------------------------------------------------------------
def mlp_step(schedule, m, *, v=1, layers=1, rows=6, width=10, hidden=40):
    """A jitted step (and abstract arguments) whose stage is `layers` residual MLP
    blocks (Linear width -> hidden -> width; ``hidden=None``: one Linear width -> width)
    and whose loss is an MSE: ``v P`` chunks of `layers` blocks each."""
    g = bx.Graph("cost")
    rng = bx.Rng(g / "rng")
    fcs = [
        (bx.Linear(g / f"fc{k}a", hidden or width, rng), bx.Linear(g / f"fc{k}b", width, rng))
        for k in range(layers)
    ]

    def stage_fn(params, h):
        for l1, l2 in fcs:
            y, params = l1(params, h)
            if hidden is not None:
                y, params = l2(params, jnp.tanh(y))
            h = h + jnp.tanh(y)
        return h, params

    def last_fn(params, h, y):
        return jnp.mean((h - y) ** 2), params

    def init(seed):
        return stage_fn(rng.seed(bx.Params(), seed=seed), jnp.zeros((1, width)))[1].locked()

    stages = jax.eval_shape(lambda: stack_stages([init(k) for k in range(v * P)], virtual_stages=v))
    x = jax.ShapeDtypeStruct((m * rows, width), jnp.float32)
    step = jax.jit(
        pipeline_value_and_grad(
            stage_fn,
            last_fn,
            mesh(),
            schedule=schedule,
            num_microbatches=m,
            virtual_stages=v if schedule == "interleaved" else None,
        )
    )
    return step, (stages, bx.Params().locked(), x, x)


@functools.cache  # shared by the memory and the linearity checks
def compiled(schedule, m, **kw):
    step, args = mlp_step(schedule, m, **kw)
    # As users compile (the suite turns the CPU fusion emitters off; tests/conftest.py).
    return step.lower(*args).compile(compiler_options={"xla_cpu_use_fusion_emitters": True})


def check_linear_in_m(schedule, **kw):
    """No conditional's operands hold a buffer of m = 32 microbatches (the inputs are
    ``[32, 64, 32]``), and the compiled program has as many copies at m = 32 as at m =
    8: a slot costs the same at any m."""
    hlo = {m: compiled(schedule, m, **MEMORY, **kw).as_text() for m in (8, 32)}
    heads = conditional_heads(hlo[32])
    assert heads
    m_sized = re.compile(r"\[32,64,")
    assert m_sized.search(hlo[32])  # the inputs exist, outside the conditionals
    assert not [h for h in heads if m_sized.search(h)], [h[:300] for h in heads]
    copies = {m: len(re.findall(r"= \S+ copy\(", t)) for m, t in hlo.items()}
    assert copies[32] == copies[8], copies


@functools.cache  # the 1F1B baseline is compiled once per session
def temp_bytes(schedule, m, **kw):
    return compiled(schedule, m, **kw).memory_analysis().temp_size_in_bytes


MEMORY = dict(rows=64, width=32, hidden=128)  # activations outweigh the params


@pytest.mark.full_optimizations
def test_interleaved_cost_per_slot_flat_in_m():
    check_linear_in_m("interleaved", v=2, layers=2)


@pytest.mark.full_optimizations
@pytest.mark.parametrize("v", [2, 4])
def test_interleaved_temp_bytes_bound(v):
    """v P chunks of 4 / v residual blocks against 1F1B's P stages of 4 blocks (the same
    model; activations outweigh the params): more microbatches in flight, each chunk's
    residuals 1 / v of a stage's, so at most 1F1B's temp bytes x (1 + (P - 1) / (v P))."""
    base = temp_bytes("1f1b", 8, layers=4, **MEMORY)
    got = temp_bytes("interleaved", 8, v=v, layers=4 // v, **MEMORY)
    assert got <= base * (1 + (P - 1) / (v * P)), (v, got, base, got / base)


# -- DP x PP and FSDP inside the chunks ------------------------------------------------------
def test_interleaved_data_x_pipeline_fsdp_stages():
    """A (data 2, stage 4) mesh, 2 chunks per device: loss and gradients are the mean of
    the two data shards' sequential runs; ``stage_specs`` from `bp.fsdp_specs` shard the
    chunk weights over data too (``P(None, 'stage', *spec)``; FSDP inside the chunks)."""
    v, m = 2, 4
    first_fn, stage_fn, last_fn, shared, stages = model(v * P)
    x, y = data(4 * m)
    half = [
        sequential(first_fn, stage_fn, last_fn, shared, stages, x[k::2], y[k::2], m)
        for k in range(2)
    ]
    ref_loss = (half[0][0] + half[1][0]) / 2
    ref_g = jax.tree.map(lambda a, b: (a + b) / 2, half[0][1], half[1][1])
    grid = mesh((2, P), ("data", "stage"))
    specs = bp.fsdp_specs(stages[0], grid, min_size=0)
    step = jax.jit(
        pipeline_value_and_grad(
            stage_fn,
            last_fn,
            grid,
            schedule="interleaved",
            virtual_stages=v,
            num_microbatches=m,
            first_fn=first_fn,
            data_axis="data",
            stage_specs=specs,
        )
    )
    # the data axis splits the batch in two contiguous halves: order the rows so that
    # shard k holds x[k::2]
    order = np.concatenate([np.arange(0, 4 * m, 2), np.arange(1, 4 * m, 2)])
    with jax.default_matmul_precision("highest"):
        loss, (g, g_sh), _ = step(
            stack_stages(stages, virtual_stages=v), shared, x[order], y[order]
        )
    np.testing.assert_allclose(float(loss), float(ref_loss), **F32)
    close(g_sh, ref_g[0], **F32)
    for k, gs in enumerate(unstack_stages(g, virtual_stages=v)):
        close(gs, ref_g[1][k], **F32)
    kernel = g["stage", "fc", "kernel"].value
    assert kernel.shape == (v, P, WIDTH, WIDTH)
    assert kernel.sharding.spec[:2] == (None, "stage")
    assert "data" in jax.tree.leaves(tuple(kernel.sharding.spec))


# -- misuse ----------------------------------------------------------------------------------
def test_errors_virtual_stages():
    first_fn, stage_fn, last_fn, shared, stages = model(2 * P)
    x, y = data(8)
    step = pipeline_value_and_grad(
        stage_fn,
        last_fn,
        mesh(),
        schedule="interleaved",
        virtual_stages=2,
        num_microbatches=4,
        first_fn=first_fn,
    )
    # params stacked as p stages (leaves (p, ...)), not (v, p, ...)
    with pytest.raises(
        ValueError,
        match=r"'stage/.*' has shape \(8,.*\(virtual_stages, stages\) = \(2, 4\).*"
        r"stack_stages\(stages, virtual_stages=2\)",
    ):
        step(stack_stages(stages), shared, x, y)
    # params stacked for v = 4 under a schedule with v = 2
    *_, stages16 = model(4 * P)
    with pytest.raises(ValueError, match=r"has shape \(4, 4.*= \(2, 4\)"):
        step(stack_stages(stages16, virtual_stages=4), shared, x, y)
    # a Schedule with v = 2 and virtual_stages=4
    with pytest.raises(
        ValueError,
        match=r"virtual_stages=4 but the schedule 'interleaved' has "
        r"virtual_stages=2",
    ):
        pipeline_value_and_grad(
            stage_fn,
            last_fn,
            mesh(),
            schedule=schedule_from("interleaved", P, 4, 2),
            virtual_stages=4,
        )
    with pytest.raises(ValueError, match=r"'interleaved' needs virtual_stages >= 2"):
        pipeline_value_and_grad(
            stage_fn, last_fn, mesh(), schedule="interleaved", num_microbatches=4
        )
    with pytest.raises(ValueError, match=r"virtual_stages must be an int >= 1"):
        pipeline_value_and_grad(
            stage_fn, last_fn, mesh(), schedule="1f1b", num_microbatches=4, virtual_stages=0
        )
    with pytest.raises(ValueError, match=r"got 6 stages, not a multiple of virtual_stages=4"):
        stack_stages(stages[:6], virtual_stages=4)
    with pytest.raises(ValueError, match=r"leading dimension should be virtual_stages=4"):
        unstack_stages(stack_stages(stages, virtual_stages=2), virtual_stages=4)
    with pytest.raises(ValueError, match=r"virtual_stages must be an int >= 1"):
        stack_stages(stages, virtual_stages=0)
