"""DP x TP x PP: a small GPT whose stages are `ParallelTransformerBlock`\\ s, pipelined
over a (data 2, stage 2, model 2) mesh after each schedule family (1F1B, ZB-H1 with its
split backward, interleaved 1F1B with two chunks per device), against the same GPT
(plain `TransformerBlock`\\ s, the same params) run on one device with
``jax.value_and_grad`` (the reference): loss and every gradient per step, over two
optimizer steps."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from blox import parallel as bp

VOCAB, WIDTH, HEADS, CONTEXT, BATCH, P = 16, 16, 4, 8, 8, 2


def _gpt(parallel: bool, n_stages: int = P, **block_kw):
    g = bx.Graph("lm")
    rng = bx.Rng(g / "rng")
    embed = bx.Embed(g / "embed", VOCAB, WIDTH, rng)
    norm = bx.LayerNorm(g / "final_norm")
    sg = bx.Graph("stage")
    srng = bx.Rng(sg / "rng")
    cls = bp.ParallelTransformerBlock if parallel else bx.TransformerBlock
    block = cls(sg / "block", WIDTH, HEADS, srng, use_rope=True, **block_kw)

    def first_fn(params, tokens):
        return embed(params, tokens)

    def stage_fn(params, h):
        return block(params, h, is_causal=True)

    def last_fn(params, h, targets):
        h, params = norm(params, h)
        logits, params = embed.attend(params, h)
        ll = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(ll, targets[..., None], axis=-1)), params

    def init():
        tokens = jnp.zeros((1, CONTEXT), jnp.int32)
        h, shared = first_fn(rng.seed(bx.Params(), seed=0), tokens)
        shared = last_fn(shared, h, tokens)[1].locked()
        stages = [stage_fn(srng.seed(bx.Params(), seed=1 + s), h)[1].locked()
                  for s in range(n_stages)]  # fmt: skip
        return stages, shared

    return first_fn, stage_fn, last_fn, init


def _batch(step):
    r = np.random.default_rng(step)
    tok = r.integers(0, VOCAB, size=(BATCH, CONTEXT + 1))
    return jnp.asarray(tok[:, :-1], jnp.int32), jnp.asarray(tok[:, 1:], jnp.int32)


def _reference_grad(first_fn, stage_fn, last_fn):
    def loss_fn(tr, st_stages, st_sh, x, y):
        tr_stages, tr_sh = tr
        h, shared = first_fn(tr_sh.merge(st_sh), x)
        for s in range(len(tr_stages)):
            h, _ = stage_fn(tr_stages[s].merge(st_stages[s]), h)
        return last_fn(shared, h, y)[0]

    def step(stages, shared, x, y):
        tr = ([s.split()[0] for s in stages], shared.split()[0])
        sts = [s.split()[1] for s in stages]
        return jax.value_and_grad(loss_fn)(tr, sts, shared.split()[1], x, y)

    return jax.jit(step)


@pytest.mark.parametrize("schedule, v", [("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_dp_tp_pp_gpt_equals_one_device(schedule, v):
    first_fn, ref_stage_fn, last_fn, init = _gpt(parallel=False, n_stages=v * P)
    _, tp_stage_fn, _, _ = _gpt(parallel=True, n_stages=v * P)
    stages, shared = init()
    mesh = jax.make_mesh((2, P, 2), ("data", "stage", "model"))
    rules = [*bp.transformer_tp_rules(), ("rng/.*", None)]
    specs = bp.param_specs(stages[0], rules, mesh)
    step = jax.jit(
        bp.pipeline_value_and_grad(
            tp_stage_fn,
            last_fn,
            mesh,
            schedule=schedule,
            num_microbatches=2,
            first_fn=first_fn,
            data_axis="data",
            stage_specs=specs,
            virtual_stages=v if v > 1 else None,
        )
    )
    ref = _reference_grad(first_fn, ref_stage_fn, last_fn)
    tx = optax.sgd(0.5)
    stacked = bp.stack_stages(stages, virtual_stages=v)
    opt = tx.init((stacked.split()[0], shared.split()[0]))
    ref_stages, ref_shared = stages, shared
    for i in range(2):
        x, y = _batch(i)
        with jax.default_matmul_precision("highest"):
            loss, (g, g_sh), (stacked, shared) = step(stacked, shared, x, y)
            ref_loss, (ref_g, ref_g_sh) = ref(ref_stages, ref_shared, x, y)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g_sh), jax.tree.leaves(ref_g_sh), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        for s, gs in enumerate(bp.unstack_stages(g, virtual_stages=v)):
            for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(ref_g[s]), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        # one SGD step on both, from their own gradients
        upd, opt = tx.update((g, g_sh), opt)
        tr_s, tr_sh = optax.apply_updates((stacked.split()[0], shared.split()[0]), upd)
        stacked, shared = tr_s.merge(stacked.split()[1]), tr_sh.merge(shared.split()[1])
        ref_stages = [
            jax.tree.map(lambda p, d: p - 0.5 * d, s.split()[0], gs).merge(s.split()[1])
            for s, gs in zip(ref_stages, ref_g, strict=True)
        ]
        ref_shared = jax.tree.map(lambda p, d: p - 0.5 * d, ref_shared.split()[0], ref_g_sh).merge(
            ref_shared.split()[1]
        )
