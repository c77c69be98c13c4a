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

from blox import parallel as bp
from tests.parallel.test_pipeline_3d import _batch, _gpt, _reference_grad
from tests.tolerances import tol

F32 = tol(jnp.float32)


def _model(context_axis=None, variant="allgather"):
    """``first_fn, stage_fn, last_fn, shared, stages`` of `test_pipeline_3d`'s two-stage
    GPT, its block built with the context axis (the same paths and values without)."""
    kw = {} if context_axis is None else dict(context_axis=context_axis, context_variant=variant)
    first_fn, stage_fn, last_fn, init = _gpt(False, **kw)
    stages, shared = init()
    return first_fn, stage_fn, last_fn, shared, stages


def _reference():
    first_fn, stage_fn, last_fn, shared, stages = _model()
    with jax.default_matmul_precision("highest"):
        loss, (g, g_sh) = _reference_grad(first_fn, stage_fn, last_fn)(stages, shared, *_data())
    return loss, (g_sh, g)


def _data():
    return _batch(0)


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
    with pytest.raises(ValueError, match=r"dimension 1 \(length 7\) is split over \('context',\)"):
        step(bp.stack_stages(stages), shared, x[:, :7], y[:, :7])
    with pytest.raises(ValueError, match=r"names the stage axis 'stage'"):
        bp.pipeline_value_and_grad(
            stage_fn, last_fn, mesh, num_microbatches=2, data_axis=("data", "stage")
        )
    with pytest.raises(ValueError, match=r"batch_spec=.* needs data_axis="):
        bp.pipeline_value_and_grad(
            stage_fn, last_fn, mesh, num_microbatches=2, batch_spec=P("data")
        )
