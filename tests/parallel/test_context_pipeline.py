"""Context parallelism inside pipeline stages: `pipeline_value_and_grad` with
``data_axis=('data', 'context')`` and ``batch_spec=cp_batch_spec('data', 'context')``
trains a small GPT cut into 2 stages (one `TransformerBlock` built with ``context_axis``
per stage; the embedding in ``first_fn``, the tied head and loss in ``last_fn``): the
loss and every gradient equal one device's ``jax.value_and_grad`` of the same model on
the whole batch (float32, rtol 1e-5), with the all-gather variant, under GPipe, 1F1B and
ZB-H1, with and without a data axis. The ring variant raises: its ``ppermute`` is a
collective of every device, and the stages run different cells in a slot (run anyway,
it paired with another stage's collective and gave a loss 6 % off). The errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp
from tests.tolerances import tol

F32 = tol(jnp.float32)
V, D, N, B, T = 16, 32, 4, 8, 16


def _model(context_axis=None, variant="ring"):
    """``first_fn, stage_fn, last_fn, shared, stages``: the same paths and values with
    and without a context axis."""
    g = bx.Graph("gpt")
    rng = bx.Rng(g / "rng")
    embed = bx.Embed(g / "embed", V, D, rng)
    norm = bx.LayerNorm(g / "norm")
    sg = bx.Graph("stage")
    srng = bx.Rng(sg / "rng")
    kw = {} if context_axis is None else dict(context_axis=context_axis, context_variant=variant)
    block = bx.TransformerBlock(sg / "block", D, N, srng, mlp_size=2 * D, use_rope=True, **kw)

    def first_fn(params, tokens):
        return embed(params, tokens)

    def stage_fn(params, h):
        return block(params, h, is_causal=True)

    def last_fn(params, h, y):
        h, params = norm(params, h)
        logits, params = embed.attend(params, h)
        ll = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(ll, y[..., None], axis=-1)), params

    x0 = jnp.zeros((1, T), jnp.int32)
    shared = rng.seed(bx.Params(), seed=0)
    h, shared = first_fn(shared, x0)
    shared = last_fn(shared, h, x0)[1].locked()
    stages = [stage_fn(srng.seed(bx.Params(), seed=1 + s), h)[1].locked() for s in range(2)]
    return first_fn, stage_fn, last_fn, shared, stages


def _data():
    r = np.random.default_rng(0)
    toks = r.integers(0, V, (B, T + 1)).astype(np.int32)
    return jnp.asarray(toks[:, :-1]), jnp.asarray(toks[:, 1:])


def _reference():
    first_fn, stage_fn, last_fn, shared, stages = _model()
    x, y = _data()

    def loss(tr_sh, tr_stages):
        p_sh = tr_sh.merge(shared.split()[1])
        h, _ = first_fn(p_sh, x)
        for tr, st in zip(tr_stages, stages, strict=True):
            h, _ = stage_fn(tr.merge(st.split()[1]), h)
        return last_fn(p_sh, h, y)[0]

    with jax.default_matmul_precision("highest"):
        return jax.jit(jax.value_and_grad(loss, (0, 1)))(
            shared.split()[0], [s.split()[0] for s in stages]
        )


@pytest.mark.parametrize("schedule, data", [("1f1b", 2), ("zb", 1), ("gpipe", 2)])
def test_context_parallel_stages_equal_one_device(schedule, data):
    ref_loss, (ref_sh, ref_stages) = _reference()
    first_fn, stage_fn, last_fn, shared, stages = _model("context", "allgather")
    ctx = 8 // (2 * data)
    mesh = bp.make_mesh((data, 2, ctx), ("data", "stage", "context"))
    step = bp.pipeline_value_and_grad(
        stage_fn, last_fn, mesh, schedule=schedule, num_microbatches=2, first_fn=first_fn,
        data_axis=("data", "context"), batch_spec=bp.cp_batch_spec("data", "context"),
    )  # fmt: skip
    x, y = _data()
    with jax.default_matmul_precision("highest"):
        loss, (g, g_sh), _ = jax.jit(step)(bp.stack_stages(stages), shared, x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), **F32)
    for key, v in ref_sh.arrays().items():
        np.testing.assert_allclose(g_sh.arrays()[key], v, **F32, err_msg=str(key))
    for s, (got, ref) in enumerate(zip(bp.unstack_stages(g), ref_stages, strict=True)):
        for key, v in ref.arrays().items():
            np.testing.assert_allclose(got.arrays()[key], v, **F32, err_msg=f"stage {s} {key}")


def test_ring_attention_in_a_stage_raises_naming_the_axis():
    first_fn, stage_fn, last_fn, shared, stages = _model("context", "ring")
    mesh = bp.make_mesh((2, 2, 2), ("data", "stage", "context"))
    step = bp.pipeline_value_and_grad(
        stage_fn, last_fn, mesh, num_microbatches=2, first_fn=first_fn,
        data_axis=("data", "context"), batch_spec=bp.cp_batch_spec("data", "context"),
    )  # fmt: skip
    x, y = _data()
    with pytest.raises(ValueError, match=r"stage_fn runs a ppermute over \['context'\].*allgather"):
        step(bp.stack_stages(stages), shared, x, y)


def test_fsdp_over_two_data_axes_and_misplaced_batch_raise():
    first_fn, stage_fn, last_fn, shared, stages = _model("context", "allgather")
    mesh = bp.make_mesh((2, 2, 2), ("data", "stage", "context"))
    specs = bp.fsdp_specs(stages[0], mesh, axis="data", min_size=16)
    step = bp.pipeline_value_and_grad(
        stage_fn, last_fn, mesh, num_microbatches=2, first_fn=first_fn,
        data_axis=("data", "context"), batch_spec=bp.cp_batch_spec("data", "context"),
        stage_specs=specs,
    )  # fmt: skip
    x, y = _data()
    with pytest.raises(ValueError, match=r"FSDP inside the stages takes one data axis"):
        step(bp.stack_stages(stages), shared, x, y)
    step = bp.pipeline_value_and_grad(
        stage_fn, last_fn, mesh, num_microbatches=2, first_fn=first_fn,
        data_axis=("data", "context"), batch_spec=bp.cp_batch_spec("data", "context"),
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"dimension 1 \(length 15\) is split over \('context',\)"):
        step(bp.stack_stages(stages), shared, x[:, :15], y[:, :15])
    with pytest.raises(ValueError, match=r"names the stage axis 'stage'"):
        bp.pipeline_value_and_grad(
            stage_fn, last_fn, mesh, num_microbatches=2, data_axis=("data", "stage")
        )
    with pytest.raises(ValueError, match=r"batch_spec=.* needs data_axis="):
        bp.pipeline_value_and_grad(
            stage_fn, last_fn, mesh, num_microbatches=2, batch_spec=P("data")
        )
