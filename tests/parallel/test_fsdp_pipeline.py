"""FSDP inside the pipeline stages (ZeRO-3 x PP): a small MLP stack pipelined over
p = 2 stages on a (data, stage) mesh, each stage's weights sharded over the data axis
(``stage_specs`` from `bp.fsdp_specs`) and gathered layer by layer with `bp.fsdp_call`,
against the same model run on one device with ``jax.value_and_grad`` (the reference)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx
from blox import parallel as bp

WIDTH, BATCH, P = 16, 8, 2


def _model():
    g = bx.Graph("stage")
    rng = bx.Rng(g / "rng")
    fc1 = bx.Linear(g / "fc1", WIDTH, rng)
    fc2 = bx.Linear(g / "fc2", WIDTH, rng)
    hg = bx.Graph("lm")
    hrng = bx.Rng(hg / "rng")
    head = bx.Linear(hg / "head", WIDTH, hrng)

    def stage_fn(params, h):  # fsdp_call is a plain call when nothing is marked
        h, params = bp.fsdp_call(fc1, params, h)
        h, params = bp.fsdp_call(fc2, params, jnp.tanh(h))
        return jnp.tanh(h), params

    def last_fn(params, h, y):
        out, params = head(params, h)
        return jnp.mean((out - y) ** 2), params

    def init():
        x = jnp.zeros((1, WIDTH))
        stages = [stage_fn(rng.seed(bx.Params(), seed=1 + s), x)[1].locked() for s in range(P)]
        shared = last_fn(hrng.seed(bx.Params(), seed=0), x, x)[1].locked()
        return stages, shared

    return stage_fn, last_fn, init


def _reference(stage_fn, last_fn):
    def loss_fn(tr, sts, st_sh, x, y):
        tr_stages, tr_sh = tr
        h = x
        for s in range(P):
            h, _ = stage_fn(tr_stages[s].merge(sts[s]), h)
        return last_fn(tr_sh.merge(st_sh), h, y)[0]

    def step(stages, shared, x, y):
        tr = ([s.split()[0] for s in stages], shared.split()[0])
        return jax.value_and_grad(loss_fn)(
            tr, [s.split()[1] for s in stages], shared.split()[1], x, y
        )

    return jax.jit(step)


def _batch():
    r = np.random.default_rng(0)
    x = r.standard_normal((BATCH, WIDTH)).astype(np.float32)
    y = r.standard_normal((BATCH, WIDTH)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


@pytest.mark.parametrize(("data", "schedule"), [(2, "1f1b"), (4, "1f1b"), (2, "gpipe"), (2, "zb")])
def test_fsdp_stages_equal_one_device(data, schedule):
    stage_fn, last_fn, init = _model()
    stages, shared = init()
    mesh = jax.make_mesh((data, P), ("data", "stage"), devices=jax.devices()[: data * P])
    specs = bp.fsdp_specs(stages[0], mesh, min_size=0)
    # every weight and bias of a stage is sharded over data; the Rng state is not
    kernel = specs["stage", "fc1", "kernel"].value
    assert "data" in jax.tree.leaves(tuple(kernel))
    step = jax.jit(
        bp.pipeline_value_and_grad(
            stage_fn,
            last_fn,
            mesh,
            schedule=schedule,
            num_microbatches=2,
            data_axis="data",
            stage_specs=specs,
        )
    )
    stacked = bp.stack_stages(stages)
    x, y = _batch()
    with jax.default_matmul_precision("highest"):
        loss, (g, g_sh), _ = step(stacked, shared, x, y)
        ref_loss, (ref_g, ref_g_sh) = _reference(stage_fn, last_fn)(stages, shared, x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_sh), jax.tree.leaves(ref_g_sh), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for s, gs in enumerate(bp.unstack_stages(g)):
        assert gs.keys() == ref_g[s].keys()
        for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(ref_g[s]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # the stage gradients leave sharded like the stage weights: over stage and data
    kg = g["stage", "fc1", "kernel"].value
    assert kg.sharding.spec[0] == "stage" and "data" in jax.tree.leaves(tuple(kg.sharding.spec))


def test_fsdp_stage_collectives_in_the_lowered_step():
    """Each FSDP stage weight is reduce-scattered once per step (in its backward) and no
    all-reduce runs on a shard-sized buffer (no second average over data); the only
    parameter-sized all-reduces are those of the replicated shared head."""
    stage_fn, last_fn, init = _model()
    stages, shared = init()
    mesh = jax.make_mesh((2, P), ("data", "stage"), devices=jax.devices()[:4])
    specs = bp.fsdp_specs(stages[0], mesh, min_size=0)
    step = jax.jit(
        bp.pipeline_value_and_grad(
            stage_fn, last_fn, mesh, num_microbatches=2, data_axis="data", stage_specs=specs
        )
    )
    text = step.lower(bp.stack_stages(stages), shared, *_batch()).as_text()
    weights = len(stages[0].split()[0].keys())  # fc1, fc2: kernel and bias
    assert text.count("stablehlo.reduce_scatter") == weights == 4
    reduced = re.findall(r"stablehlo\.all_reduce.*?\n(?:.*\n)*?.*?\}\) : \((.*?)\)", text)
    half = {f"tensor<{WIDTH // 2}x{WIDTH}xf32>", f"tensor<{WIDTH // 2}xf32>"}
    assert f"tensor<{WIDTH}x{WIDTH}xf32>" in reduced  # the head's kernel: regex works
    assert not half & set(reduced), reduced


def test_fsdp_stage_weights_bytes_per_device():
    _, _, init = _model()
    stages, _ = init()
    data = 4
    mesh = jax.make_mesh((data, P), ("data", "stage"))
    fsdp = bp.fsdp_specs(stages[0], mesh, min_size=0)
    stacked = bp.stack_stages(stages).split()[0]

    def placed(specs):
        def put(x, s):
            return jax.device_put(x, jax.NamedSharding(mesh, jax.P("stage", *s)))

        return jax.tree.map(put, stacked, specs.split()[0])

    plain = jax.tree.map(lambda _: jax.P(), fsdp)
    whole = sum(int(np.prod(v.shape)) * v.dtype.itemsize for v in jax.tree.leaves(stacked))
    assert bp.bytes_per_device(placed(plain)) == whole // P
    assert bp.bytes_per_device(placed(fsdp)) == whole // (P * data)


def test_fsdp_stage_specs_on_state_raise():
    stage_fn, last_fn, init = _model()
    stages, shared = init()
    mesh = jax.make_mesh((2, P), ("data", "stage"), devices=jax.devices()[:4])
    specs = bp.fsdp_specs(stages[0], mesh, min_size=0)
    specs = jax.tree_util.tree_map_with_path(
        lambda kp, s: jax.P("data") if kp[0].key == "stage/rng/seed" else s, specs
    )
    step = bp.pipeline_value_and_grad(
        stage_fn, last_fn, mesh, num_microbatches=2, data_axis="data", stage_specs=specs
    )
    x, y = _batch()
    with pytest.raises(ValueError, match="non-trainable 'stage/rng/seed'.*data axis 'data'"):
        step(bp.stack_stages(stages), shared, x, y)


def _gpt_stage(parallel: bool):
    sg = bx.Graph("stage")
    srng = bx.Rng(sg / "rng")
    cls = bp.ParallelTransformerBlock if parallel else bx.TransformerBlock
    block = cls(sg / "block", WIDTH, 4, srng, use_rope=True)

    def stage_fn(params, h):  # the whole block's weights gathered at once
        return bp.fsdp_call(block, params, h, is_causal=True)

    def init(s):
        return stage_fn(srng.seed(bx.Params(), seed=1 + s), jnp.zeros((1, 8, WIDTH)))[1].locked()

    return stage_fn, init


def test_fsdp_tp_pp_transformer_equals_one_device():
    """FSDP x TP x PP on a (data 2, stage 2, model 2) mesh: the stage specs are the TP
    rules with the data axis added (``fsdp_specs(base=...)``)."""
    tp_stage_fn, init = _gpt_stage(parallel=True)
    ref_stage_fn, _ = _gpt_stage(parallel=False)
    _, last_fn, init_mlp = _model()
    stages = [init(s) for s in range(P)]
    shared = init_mlp()[1]
    mesh = jax.make_mesh((2, P, 2), ("data", "stage", "model"))
    rules = [*bp.transformer_tp_rules(), ("rng/.*", None)]
    tp = bp.param_specs(stages[0], rules, mesh)
    specs = bp.fsdp_specs(stages[0], mesh, base=tp, min_size=0)
    qkv = [s for s in specs.arrays().values() if "model" in jax.tree.leaves(tuple(s))]
    assert qkv and all("data" in jax.tree.leaves(tuple(s)) for s in qkv)
    step = jax.jit(
        bp.pipeline_value_and_grad(
            tp_stage_fn,
            last_fn,
            mesh,
            num_microbatches=2,
            data_axis="data",
            stage_specs=specs,
        )
    )
    r = np.random.default_rng(1)
    x = jnp.asarray(r.standard_normal((BATCH, 8, WIDTH)), jnp.float32)
    y = jnp.asarray(r.standard_normal((BATCH, 8, WIDTH)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        loss, (g, g_sh), _ = step(bp.stack_stages(stages), shared, x, y)
        ref_loss, (ref_g, ref_g_sh) = _reference(ref_stage_fn, last_fn)(stages, shared, x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    for a, b in zip(jax.tree.leaves(g_sh), jax.tree.leaves(ref_g_sh), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    for s, gs in enumerate(bp.unstack_stages(g)):
        for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(ref_g[s]), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _wide(remat: bool, width: int = 128):
    """Two FSDP Linear layers of `width` (their weights outweigh a microbatch of 2 rows);
    `remat` is what the stage passes to `fsdp_call`."""
    g = bx.Graph("stage")
    rng = bx.Rng(g / "rng")
    fc1, fc2 = bx.Linear(g / "fc1", width, rng), bx.Linear(g / "fc2", width, rng)

    def stage_fn(params, h):
        h, params = bp.fsdp_call(fc1, params, h, remat=remat)
        h, params = bp.fsdp_call(fc2, params, jnp.tanh(h), remat=remat)
        return jnp.tanh(h), params

    def last_fn(params, h, y):
        return jnp.mean((h - y) ** 2), params

    stages = [
        stage_fn(rng.seed(bx.Params(), seed=s), jnp.zeros((1, width)))[1].locked() for s in range(P)
    ]
    mesh = jax.make_mesh((2, P), ("data", "stage"), devices=jax.devices()[: 2 * P])
    specs = bp.fsdp_specs(stages[0], mesh, min_size=0)
    return stage_fn, last_fn, bp.stack_stages(stages), mesh, specs


def test_fsdp_remat_false_in_a_stage_raises():
    """``fsdp_call(..., remat=False)`` keeps the gathered full weights for the backward:
    inside a pipeline, once per microbatch in flight; the step refuses it, naming the
    leaf and the fix."""
    stage_fn, last_fn, stacked, mesh, specs = _wide(remat=False, width=16)
    step = bp.pipeline_value_and_grad(
        stage_fn, last_fn, mesh, num_microbatches=2, data_axis="data", stage_specs=specs
    )
    x = jnp.ones((8, 16))
    with pytest.raises(
        ValueError,
        match=r"full\) weight 'stage/fc1/kernel'.*remat='weights' \(the default\) or remat=True",
    ):
        step(stacked, bx.Params().locked(), x, x)


@pytest.mark.full_optimizations
@pytest.mark.parametrize("remat", ["weights", True])
def test_fsdp_stash_holds_no_full_weight(remat):
    """GPipe stashes every microbatch: with FSDP stage weights (``fsdp_call``'s default
    ``remat='weights'``, or ``remat=True``) each further microbatch adds less temp
    memory than a quarter of one stage's full weights: it keeps the layers' activations
    (4 rows; with ``True`` their inputs only), never a gathered weight."""
    stage_fn, last_fn, stacked, mesh, specs = _wide(remat=remat)
    width = 128
    full = 2 * width * width * 4  # the stage's two full f32 kernels

    def temp(m, stage_specs):
        step = jax.jit(
            bp.pipeline_value_and_grad(
                stage_fn, last_fn, mesh, schedule="gpipe", num_microbatches=m,
                data_axis="data", stage_specs=stage_specs,
            )
        )  # fmt: skip
        x = jax.ShapeDtypeStruct((4 * m, width), jnp.float32)
        args = (jax.eval_shape(lambda: stacked), bx.Params().locked(), x, x)
        compiled = step.lower(*args).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    t2, t8 = temp(2, specs), temp(8, specs)
    assert (t8 - t2) / 6 < full / 4, (t2, t8, full)
