"""Zero-bubble ZB-H1 in the pipeline runtime (issue 27): the backward split into ``B``
(the cotangent of the stage input, which the previous stage waits for) and ``W`` (the
weight gradient, in otherwise idle slots), against the sequential model on one device
(the reference; helpers in test_pipeline_interleaved.py); the split's cost (B + W run
the matrix products of one whole backward) and memory (1F1B's) from the compiled
program; a slot's cost flat in m."""

import re

import pytest

from tests.parallel.pipeline_common import conditional_heads
from tests.parallel.test_pipeline_interleaved import (
    MEMORY,
    check_against_sequential,
    check_linear_in_m,
    compiled,
    temp_bytes,
)


@pytest.mark.parametrize("m,policy", [(4, None), (8, None), (16, None), (8, "bf16")])
def test_zero_bubble_matches_sequential(m, policy):
    check_against_sequential("zb-h1", m, 1, policy)


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
    cotangents from the one B received would add 7."""
    dots = {
        s: len(re.findall(r" dot\(", compiled(s, 8, layers=4).as_text())) for s in ("1f1b", "zb-h1")
    }
    assert dots["1f1b"] == 24, dots
    assert dots["zb-h1"] == dots["1f1b"], dots
