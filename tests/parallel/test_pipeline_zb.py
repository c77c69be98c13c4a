"""Zero-bubble ZB-H1 and ZB-V in the pipeline runtime: the backward split into ``B``
(the cotangent of the stage input, which the previous stage waits for) and ``W`` (the
weight gradient, in otherwise idle slots), against the sequential model on one device
(the reference; helpers in test_pipeline_interleaved.py); the split's cost (B + W run
the matrix products of one whole backward) and memory (1F1B's) from the compiled
program; a slot's cost flat in m. ZB-V: two chunks per device in a V."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx
from blox.parallel import pipeline_value_and_grad, stack_stages, unstack_stages
from tests.parallel.pipeline_common import conditional_heads
from tests.parallel.test_pipeline_interleaved import (
    F32,
    MEMORY,
    P,
    check_against_sequential,
    check_linear_in_m,
    close,
    compiled,
    mesh,
    temp_bytes,
)


@pytest.mark.parametrize("m,policy", [(4, None), (8, None), (16, None), (8, "bf16")])
def test_zero_bubble_matches_sequential(m, policy):
    check_against_sequential("zb-h1", m, 1, policy)


@pytest.mark.parametrize("m,policy", [(4, None), (8, None), (16, "bf16")])
def test_zero_bubble_v_matches_sequential(m, policy):
    """ZB-V: device s runs model stages s and 2 P - 1 - s (params stacked in the
    schedule's `stacking_order`); loss, gradients and state equal the sequential
    model's."""
    check_against_sequential("zbv", m, 2, policy)


@pytest.mark.full_optimizations
def test_zero_bubble_v_temp_bytes_bound():
    """The same model as 1F1B's (4 residual blocks per device: two chunks of 2): ZB-V
    keeps up to 2 P chunk-microbatches from F to W (P stages' worth, 1F1B's on device
    0): at most 1.25 times 1F1B's temp bytes."""
    base = temp_bytes("1f1b", 8, layers=4, **MEMORY)
    got = temp_bytes("zbv", 8, v=2, layers=2, **MEMORY)
    assert got <= 1.25 * base, (got, base, got / base)


def test_zero_bubble_with_remat_matches_sequential():
    """With ``remat=True`` the backward recomputes the stage (a ``checkpoint`` call in its
    jaxpr, which the split inlines): B and W still sum to the sequential gradients."""
    check_against_sequential("zb-h1", 8, 1, None, remat=True)


@pytest.mark.full_optimizations
def test_split_backward_costs_one_backward():
    """A stage of one Linear (+ tanh, residual): its forward is one matrix product, its
    whole backward two (input and weight cotangents). Under 1F1B the program runs 1 + 2;
    under ZB-H1, B computes only the input cotangent and W only the weight gradient (the
    other half of the VJP is dead code XLA removes in each branch), so the program has
    as many products (1 + 1 + 1), not 1 + 2 + 2, in a switch of four branches."""
    dots = {}
    for schedule in ("1f1b", "zb-h1"):
        hlo = compiled(schedule, 8, hidden=None).as_text()
        dots[schedule] = len(re.findall(r" dot\(", hlo))
        branches = re.findall(r"branch_computations=\{([^}]*)\}", hlo)
        # the cells' switch (the slot's transfers are another switch, one branch per
        # pattern of sends)
        assert (4 if schedule == "zb-h1" else 3) in {len(b.split(",")) for b in branches}
        assert conditional_heads(hlo)
    assert dots["1f1b"] == 3, dots
    assert dots["zb-h1"] == dots["1f1b"], dots


@pytest.mark.full_optimizations
def test_zero_bubble_cost_per_slot_flat_in_m():
    check_linear_in_m("zb-h1", layers=4)


@pytest.mark.full_optimizations
def test_zero_bubble_temp_bytes_bound():
    """The same model as 1F1B's (P stages of 4 residual blocks): the stash lives until
    the W (ZB-H1 keeps 1F1B's p microbatches in flight) plus the cotangents B keeps for
    W: at most 1F1B's temp bytes x 1.1."""
    base = temp_bytes("1f1b", 8, layers=4, **MEMORY)
    got = temp_bytes("zb-h1", 8, layers=4, **MEMORY)
    assert got <= 1.1 * base, (got, base, got / base)


@pytest.mark.full_optimizations
def test_split_backward_of_a_deep_stage_derives_no_cotangent_twice():
    """A stage of 4 residual MLP blocks (8 chained matrix products): its forward runs 8
    products, its whole backward 16. Under ZB-H1, B keeps the cotangents where the
    weights are used and W runs only the 8 weight-gradient products from them: the
    program has as many products as 1F1B's (24). A W that re-derived the inner
    cotangents from the one B received would add 7. On CPU every product contracts its
    left operand's trailing dimension (row-major: XLA:CPU's fast matmul kernel), also
    the 8 weight-gradient products ``x^T dy``, which JAX's own backward writes over the
    rows of ``x``."""
    hlo = {s: compiled(s, 8, layers=4).as_text() for s in ("1f1b", "zb-h1")}
    dots = {s: re.findall(r" dot\(.*?lhs_contracting_dims=\{(\d)\}", t) for s, t in hlo.items()}
    assert dots["1f1b"] == ["1"] * 24, dots
    assert dots["zb-h1"] == ["1"] * 24, dots


class _Scanned(bx.Module):
    """``LAYERS`` tanh layers in one ``lax.scan`` over a stacked kernel: the stage's
    backward is one scan equation that yields the input cotangent and the weight
    gradient together (the split falls back to W re-running the weight half)."""

    def __call__(self, params, h):
        k, params = self.get_param(
            params, "kernel", (LAYERS, WIDTH_SCAN, WIDTH_SCAN), INIT, rng=self.rng
        )
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), h, k)
        return h, params

    def __init__(self, node, rng):
        super().__init__(node)
        self.rng = rng


LAYERS, WIDTH_SCAN = 3, 6
INIT = jax.nn.initializers.normal(0.5)


def test_zero_bubble_scan_stage_matches_sequential():
    g = bx.Graph("scan")
    rng = bx.Rng(g / "rng")
    layer = _Scanned(g / "layers", rng)
    stages = [
        layer(rng.seed(bx.Params(), seed=s), jnp.zeros((1, WIDTH_SCAN)))[1].locked()
        for s in range(P)
    ]

    def last_fn(params, h, y):
        return jnp.mean((h - y) ** 2), params

    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(16, WIDTH_SCAN)), jnp.float32)
    y = jnp.asarray(r.normal(size=(16, WIDTH_SCAN)), jnp.float32)

    def reference(trs):  # the stages one after the other, on the whole batch
        h = x
        for tr, st in zip(trs, [s.split()[1] for s in stages], strict=True):
            h = layer(tr.merge(st), h)[0]
        return jnp.mean((h - y) ** 2)

    with jax.default_matmul_precision("highest"):
        ref_loss, ref_g = jax.value_and_grad(reference)([s.split()[0] for s in stages])
        step = jax.jit(
            pipeline_value_and_grad(layer, last_fn, mesh(), schedule="zb-h1", num_microbatches=4)
        )
        loss, (g_stage, _), _ = step(stack_stages(stages), bx.Params().locked(), x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=F32["rtol"])
    for got, want in zip(unstack_stages(g_stage), ref_g, strict=True):
        close(got, want, **F32)
