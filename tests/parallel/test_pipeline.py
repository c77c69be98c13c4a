"""Pipeline parallelism (GPipe, 1F1B) against the same model run sequentially on one
device with plain ``jax.value_and_grad`` (the independent reference), the schedule
tables, compiled temp memory, DP x PP, and every misuse error."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from blox.parallel._pipeline import pipeline_value_and_grad, stack_stages, unstack_stages
from blox.parallel._schedules import (
    Action,
    Schedule,
    gpipe_schedule,
    interleaved_schedule,
    one_f_one_b_schedule,
    zero_bubble_schedule,
    zero_bubble_v_schedule,
)
from tests.parallel.pipeline_common import Counter
from tests.tolerances import tol

P_STAGES, WIDTH, D_IN, CLASSES = 4, 8, 5, 3
F32 = tol(jnp.float32)


def _model(dtype=None):
    """`dtype`: the layers' compute dtype (a mixed-precision policy: params stay f32)."""
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

    def stage_fn(params, h):
        y, params = fc(params, h, precision="highest")
        y, params = count(params, y)
        return h + jnp.tanh(y), params

    def last_fn(params, h, y):
        logits, params = head(params, h, precision="highest")
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y)
        return jnp.mean(ce), params

    shared = rng.seed(bx.Params(), seed=0)
    h, shared = first_fn(shared, jnp.zeros((1, D_IN)))
    _, shared = last_fn(shared, h, jnp.zeros((1,), jnp.int32))
    stages = []
    for s in range(P_STAGES):
        p = srng.seed(bx.Params(), seed=10 + s)
        stages.append(stage_fn(p, h)[1].locked())
    return first_fn, stage_fn, last_fn, shared.locked(), stages


def _data(n, seed=0):
    r = np.random.default_rng(seed)
    return (
        jnp.asarray(r.normal(size=(n, D_IN)), jnp.float32),
        jnp.asarray(r.integers(0, CLASSES, size=(n,)), jnp.int32),
    )


def _sequential(first_fn, stage_fn, last_fn, shared, stages, x, y, m):
    """One device, no pipeline: microbatch by microbatch (a ``lax.scan``, so the compile
    does not grow with m), stage by stage, under ``jax.value_and_grad``."""
    xs = x.reshape(m, x.shape[0] // m, *x.shape[1:])
    ys = y.reshape(m, y.shape[0] // m, *y.shape[1:])

    def loss_fn(trainables, states, st_sh):
        tr_sh, trs = trainables

        def one(carry, xy):
            states, st_sh = carry
            h, p_sh = first_fn(tr_sh.merge(st_sh), xy[0])
            new_states = []
            for s in range(P_STAGES):
                h, p = stage_fn(trs[s].merge(states[s]), h)
                new_states.append(p.split()[1])
            loss, p_sh = last_fn(p_sh, h, xy[1])
            return (new_states, p_sh.split()[1]), loss

        (states, st_sh), losses = jax.lax.scan(one, (states, st_sh), (xs, ys))
        return jnp.mean(losses), (states, st_sh)

    trainables = (shared.split()[0], [s.split()[0] for s in stages])
    with jax.default_matmul_precision("highest"):
        (loss, (states, st_sh)), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
            trainables, [s.split()[1] for s in stages], shared.split()[1]
        )
    return loss, grads, states, st_sh


def _mesh(shape=(P_STAGES,), names=("stage",)):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _close(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


# -- 1. numerics against the sequential model -----------------------------------------------
# The full m grid runs for f32 without remat; remat and the bf16 policy (f32 params, bf16
# compute) run at the smallest and the largest m, to keep the suite fast.
GRID = [("gpipe", m, None, False) for m in (4, 8, 16, 32)]
GRID += [("1f1b", m, None, False) for m in (4, 8, 16, 32)]
GRID += [(s, m, None, True) for s in ("gpipe", "1f1b") for m in (4, 32)]
GRID += [("gpipe", 4, "bf16", False), ("1f1b", 32, "bf16", False)]
GRID += [("gpipe", 32, "bf16", True), ("1f1b", 4, "bf16", True)]
# 1F1B whose slots hold one backward or two forwards
GRID += [("1f1b-2f", m, None, False) for m in (4, 8)]
GRID += [("1f1b-2f", 32, None, True), ("1f1b-2f", 8, "bf16", False), ("1f1b-3f", 8, None, False)]


@pytest.mark.parametrize("schedule,m,policy,remat", GRID)
def test_matches_sequential(schedule, m, policy, remat):
    first_fn, stage_fn, last_fn, shared, stages = _model(jnp.bfloat16 if policy == "bf16" else None)
    x, y = _data(2 * m)
    ref_loss, (ref_g_sh, ref_g), ref_states, ref_st_sh = _sequential(
        first_fn, stage_fn, last_fn, shared, stages, x, y, m
    )
    step = jax.jit(
        pipeline_value_and_grad(
            stage_fn,
            last_fn,
            _mesh(),
            schedule=schedule,
            num_microbatches=m,
            first_fn=first_fn,
            remat=remat,
        )
    )
    with jax.default_matmul_precision("highest"):
        loss, (g, g_sh), (new_stages, new_shared) = step(stack_stages(stages), shared, x, y)
    # bf16 policy: the same bf16 ops as the reference, summed in another order
    t = tol(jnp.bfloat16) if policy == "bf16" else F32
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=t["rtol"])
    assert jax.tree.leaves(g)[0].dtype == jnp.float32  # accumulated in the params' dtype
    _close(g_sh, ref_g_sh, **t)
    for s, gs in enumerate(unstack_stages(g)):
        _close(gs, ref_g[s], **t)
    for s, ps in enumerate(unstack_stages(new_stages)):  # non-trainable state came back
        assert (
            int(ps["stage", "count", "calls"].value)
            == int(stages[s]["stage", "count", "calls"].value) + m
        )
        _close(ps.split()[1], ref_states[s], **t)
    _close(new_shared.split()[1], ref_st_sh, rtol=0, atol=0)


def test_bfloat16_activations_and_params_match_the_bf16_sequential_model():
    """bf16 inputs and params (bf16 gradients): the pipeline agrees with the same bf16
    model run sequentially to bf16 tolerance (a comparison with the f32 model at rtol 0.1 /
    atol 0.05 was too loose to catch a bf16 error)."""
    first_fn, stage_fn, last_fn, shared, stages = _model()
    bf = lambda t: jax.tree.map(  # noqa: E731
        lambda v: v.astype(jnp.bfloat16) if v.dtype == jnp.float32 else v, t
    )
    stages, shared = [bf(s) for s in stages], bf(shared)
    x, y = _data(8)
    x = x.astype(jnp.bfloat16)
    ref_loss, (ref_g_sh, ref_g), _, _ = _sequential(
        first_fn, stage_fn, last_fn, shared, stages, x, y, 4
    )
    step = jax.jit(
        pipeline_value_and_grad(
            stage_fn, last_fn, _mesh(), schedule="1f1b", num_microbatches=4, first_fn=first_fn
        )
    )
    with jax.default_matmul_precision("highest"):
        loss, (g, g_sh), _ = step(stack_stages(stages), shared, x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), **tol(jnp.bfloat16))
    assert jax.tree.leaves(g)[0].dtype == jnp.bfloat16
    f32 = lambda t: jax.tree.map(lambda v: v.astype(jnp.float32), t)  # noqa: E731
    _close(f32(g_sh), f32(ref_g_sh), **tol(jnp.bfloat16))
    for s, gs in enumerate(unstack_stages(g)):
        _close(f32(gs), f32(ref_g[s]), **tol(jnp.bfloat16))


def test_masked_loss_matches_sequential():
    """A padding mask travels with the targets; the masked mean per microbatch matches."""
    first_fn, stage_fn, _, shared, stages = _model()
    x, y = _data(16)
    mask = jnp.asarray(np.random.default_rng(1).random(16) < 0.6, jnp.float32)

    g = bx.Graph("masked")
    rng = bx.Rng(g / "rng")
    head = bx.Linear(g / "head", CLASSES, rng)

    def last_fn(params, h, ym):
        yy, mm = ym
        logits, params = head(params, h, precision="highest")
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, yy)
        return jnp.sum(ce * mm) / jnp.maximum(jnp.sum(mm), 1.0), params

    shared = head(rng.seed(shared.unlocked(), seed=3), jnp.zeros((1, WIDTH)))[1].locked()
    step = jax.jit(
        pipeline_value_and_grad(
            stage_fn, last_fn, _mesh(), schedule="gpipe", num_microbatches=4, first_fn=first_fn
        )
    )
    loss, (_, g_sh), _ = step(stack_stages(stages), shared, x, (y, mask))

    def ref(tr_sh):
        tot = 0.0
        for i in range(4):
            sl = slice(4 * i, 4 * i + 4)
            h, p = first_fn(tr_sh.merge(shared.split()[1]), x[sl])
            for s in range(P_STAGES):
                h, _ = stage_fn(stages[s], h)
            tot = tot + last_fn(p, h, (y[sl], mask[sl]))[0]
        return tot / 4

    with jax.default_matmul_precision("highest"):
        rl, rg = jax.jit(jax.value_and_grad(ref))(shared.split()[0])
    np.testing.assert_allclose(float(loss), float(rl), rtol=1e-5)
    _close(g_sh, rg, rtol=1e-5, atol=1e-6)


# -- 2. schedule tables -----------------------------------------------------------------------
def _check_table(s):
    p, m, t = s.num_stages, s.num_microbatches, s.times()
    for st in range(p):
        for i in range(m):
            assert t["F", st, i] < t["B", st, i]
            if st:
                assert t["F", st - 1, i] < t["F", st, i]
            if st < p - 1:
                assert t["B", st + 1, i] < t["B", st, i]


@pytest.mark.parametrize("p,m", [(4, 4), (4, 8), (4, 16), (2, 5), (3, 7)])
def test_schedule_tables(p, m):
    for s in (gpipe_schedule(p, m), one_f_one_b_schedule(p, m)):
        _check_table(s)
        cells = [c for row in s.table for c in row]
        idle = sum(c is None for c in cells)  # counted from the table itself
        assert idle / len(cells) == pytest.approx((p - 1) / (m + p - 1))
        assert s.idle_fraction() == pytest.approx((p - 1) / (m + p - 1))
        live = [0] * p
        peak = [0] * p
        for row in s.table:
            for st, c in enumerate(row):
                if c is not None:
                    live[st] += 1 if c.kind == "F" else -1
                    peak[st] = max(peak[st], live[st])
        if s.name == "1f1b":
            assert max(peak) <= p and peak == [p - st for st in range(p)]
        else:
            assert peak == [m] * p
        assert s.in_flight() == peak
        text = str(s)
        assert text.count("\n") == p + 1 and "F0" in text and f"B{m - 1}" in text


def test_schedule_printed_p4_m8():
    text = str(one_f_one_b_schedule(4, 8)).splitlines()
    assert text[2].split()[2:10] == ["F0", "F1", "F2", "F3", ".", ".", ".", "B0"]
    assert text[5].split()[2:7] == [".", ".", ".", "F0", "B0"]


@pytest.mark.parametrize("p,m", [(2, 4), (3, 6), (4, 8), (4, 32), (8, 16)])
def test_packed_1f1b_fills_its_slots(p, m):
    """1F1B with slots of one backward or two forwards: a valid table whose cells are a
    backward or one / two forwards, at most 2 (p - s) in flight on stage s, and with a
    backward costing two forwards a busy fraction equal to the closed form for such slots
    (all slots full but the 2 (p - 1) of fill and drain: 3m / (3m + 4 (p - 1))), above
    plain 1F1B's."""
    s = one_f_one_b_schedule(p, m, forwards_per_slot=2)
    _check_table(s)
    assert s.name == "1f1b-2f" and s.lanes == 2
    for t in range(s.num_slots):
        for st in range(p):
            kinds = [a.kind for a in s.actions(t, st)]
            assert kinds in ([], ["B"], ["F"], ["F", "F"]), (t, st, kinds)
    assert s.in_flight() == [min(m, 2 * (p - st)) for st in range(p)]
    busy = 1 - s.idle_fraction(forward=1.0, backward=2.0)
    assert busy == pytest.approx(3 * m / (3 * m + 4 * (p - 1)))
    assert busy > 1 - one_f_one_b_schedule(p, m).idle_fraction(1.0, 2.0)
    assert "F0+F1" in str(s) and "with B = 2 F" in str(s).splitlines()[0]


def test_idle_fraction_weighs_cells_by_their_cost():
    """Slot-synchronous: a slot lasts as long as its busiest stage. GPipe p = 2, m = 2
    with per-stage forward costs (1, 3) and backward 2: slot loads (1, 0), (1, 3), (0, 3),
    (0, 2), (2, 2), (2, 0), counted by hand."""
    s = gpipe_schedule(2, 2)
    busy, span = 1 + 4 + 3 + 2 + 4 + 2, 1 + 3 + 3 + 2 + 2 + 2
    assert s.idle_fraction(forward=[1.0, 3.0], backward=2.0) == pytest.approx(1 - busy / (2 * span))
    assert s.idle_fraction() == pytest.approx(4 / 12)
    with pytest.raises(ValueError, match="forward has 3 entries.*one per stage"):
        s.idle_fraction(forward=[1.0, 1.0, 1.0])


def test_idle_fraction_with_pairwise_sync_counted_by_hand():
    """``sync='pairs'``: a device waits only for the other end of its own transfers.
    1F1B p = 2, m = 2, F = 1, B = 2 (table ``F0 F1 . B0 . B1`` over ``. F0 B0 F1 B1 .``):
    device 0 ends its slots at 1, 2, 4 (waits for device 1's B0), 6, 7 (waits for B1),
    9; device 1 at 1, 2, 4, 5, 7, 7: the step lasts 9 against the slot bound's
    1 + 1 + 2 + 2 + 2 + 2 = 10, for 12 busy units on 2 devices."""
    s = one_f_one_b_schedule(2, 2)
    assert s.idle_fraction(1.0, 2.0, sync="pairs") == pytest.approx(1 - 12 / 18)
    assert s.idle_fraction(1.0, 2.0) == pytest.approx(1 - 12 / 20)
    assert s.idle_time(1.0, 2.0, sync="pairs") == pytest.approx(2 * 9 - 12)
    with pytest.raises(ValueError, match="sync='barrier'.*'slot', 'pairs'"):
        s.idle_fraction(sync="barrier")


@pytest.mark.parametrize("seed", range(3))
def test_pairwise_sync_never_idles_more_than_the_slot_bound(seed):
    """The shape of the pairwise model over every table kind and random per-stage costs:
    never more idle than the slot bound, and equal to it when every cell costs the same."""
    r = np.random.default_rng(seed)
    p, m = 4, 8
    tables = [
        gpipe_schedule(p, m), one_f_one_b_schedule(p, m), interleaved_schedule(p, m, 2),
        zero_bubble_schedule(p, m), zero_bubble_v_schedule(p, m),
    ]  # fmt: skip
    for s in tables:
        n = p * s.virtual_stages
        f, b, w = (list(r.uniform(0.5, 2.0, n)) for _ in range(3))
        assert s.idle_fraction(f, b, w, sync="pairs") <= s.idle_fraction(f, b, w) + 1e-12, s.name
        assert s.idle_fraction(sync="pairs") == pytest.approx(s.idle_fraction()), s.name


def test_packed_schedule_errors():
    with pytest.raises(ValueError, match="forwards_per_slot must be an int >= 1"):
        one_f_one_b_schedule(4, 8, forwards_per_slot=0)
    with pytest.raises(ValueError, match="1f1b-2f"):
        pipeline_value_and_grad(lambda p, h: (h, p), lambda p, h, y: (0.0, p), _mesh(),
                                schedule="2f1b", num_microbatches=4)  # fmt: skip
    with pytest.raises(ValueError, match="slot 0, stage 0: .* is not a cell"):
        Schedule("mine", 1, 1, (((("F", 0, 1)),),))
    # a cell of two forwards: stage 1 may not run F0 in the slot stage 0 sends it
    two = ((("F", 0), ("F", 1)), (("F", 0), ("F", 1)))
    with pytest.raises(ValueError, match="stage 1 runs F0 at slot 0, not after stage 0"):
        Schedule("mine", 2, 2, (two, (None, (("B", 0), ("B", 1))), ((("B", 0), ("B", 1)), None)))


@pytest.mark.parametrize(
    "table,match",
    [
        (((("B", 0),), (("F", 0),)), "before or with"),
        (((("F", 0),), (("F", 0),)), "runs twice"),
        (((("F", 0),),), "never runs B0"),
        (((("F", 0), None), (None, None)), "never runs"),
        (((("F", 0), ("F", 0)), (None, ("B", 0)), (("B", 0), None)), "not after stage 0"),
        (((("F", 0), None), (("B", 0), ("F", 0)), (None, ("B", 0))), "not after stage 1"),
        (((("X", 0),),), "is not"),
        (((("F", 0), None, None),), "has 3 cells"),
    ],
)
def test_invalid_tables_rejected(table, match):
    p = 2 if len(table[0]) in (2, 3) else 1
    with pytest.raises(ValueError, match=match):
        Schedule("mine", p, 1, table)


def test_custom_schedule_runs():
    """A user-written table (GPipe order with reversed backwards) is followed."""
    p, m = P_STAGES, 4
    n = m + p - 1
    table = [[None] * p for _ in range(2 * n)]
    for s in range(p):
        for i in range(m):
            table[s + i][s] = Action("F", i)
            table[n + (p - 1 - s) + (m - 1 - i)][s] = Action("B", i)
    sched = Schedule("reversed", p, m, tuple(tuple(r) for r in table))
    first_fn, stage_fn, last_fn, shared, stages = _model()
    x, y = _data(8)
    ref_loss, (_, ref_g), _, _ = _sequential(first_fn, stage_fn, last_fn, shared, stages, x, y, m)
    step = jax.jit(
        pipeline_value_and_grad(stage_fn, last_fn, _mesh(), schedule=sched, first_fn=first_fn)
    )
    with jax.default_matmul_precision("highest"):
        loss, (g, _), _ = step(stack_stages(stages), shared, x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    _close(unstack_stages(g)[0], ref_g[0], rtol=1e-5, atol=1e-6)


# -- 3. memory: tests/parallel/test_pipeline_cost.py --------------------------------------------


# -- 5. DP x PP ----------------------------------------------------------------------------------
def test_data_x_pipeline_2d_mesh():
    first_fn, stage_fn, last_fn, shared, stages = _model()
    x, y = _data(16)
    # reference: mean over the two data shards of each shard's 4-microbatch loss
    half = [
        _sequential(
            first_fn,
            stage_fn,
            last_fn,
            shared,
            stages,
            x[k * 8 : (k + 1) * 8],
            y[k * 8 : (k + 1) * 8],
            4,
        )
        for k in range(2)
    ]
    ref_loss = (half[0][0] + half[1][0]) / 2
    ref_g = jax.tree.map(lambda a, b: (a + b) / 2, half[0][1], half[1][1])
    mesh = _mesh((2, P_STAGES), ("data", "stage"))
    step = jax.jit(
        pipeline_value_and_grad(
            stage_fn,
            last_fn,
            mesh,
            schedule="1f1b",
            num_microbatches=4,
            first_fn=first_fn,
            data_axis="data",
        )
    )
    with jax.default_matmul_precision("highest"):
        loss, (g, g_sh), new = step(stack_stages(stages), shared, x, y)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    _close(g_sh, ref_g[0], rtol=1e-5, atol=1e-6)
    # Averaging the state over the data axis keeps integer leaves (Rng seed and counter,
    # uint32) in their dtype: the step can be called again with what it returned.
    old_dtypes = [v.dtype for v in jax.tree.leaves((stack_stages(stages), shared))]
    assert [v.dtype for v in jax.tree.leaves(new)] == old_dtypes
    assert jnp.dtype(jnp.uint32) in old_dtypes
    for s, gs in enumerate(unstack_stages(g)):
        _close(gs, ref_g[1][s], rtol=1e-5, atol=1e-6)


# -- 4. errors -----------------------------------------------------------------------------------
def _simple():
    first_fn, stage_fn, last_fn, shared, stages = _model()
    return first_fn, stage_fn, last_fn, shared, stack_stages(stages)


def test_error_fewer_microbatches_than_stages_1f1b():
    with pytest.raises(ValueError, match=r"num_microbatches=2 < num_stages=4.*gpipe"):
        one_f_one_b_schedule(4, 2)
    _, stage_fn, last_fn, _, _ = _simple()
    with pytest.raises(ValueError, match=r"num_microbatches=3 < num_stages=4"):
        pipeline_value_and_grad(stage_fn, last_fn, _mesh(), schedule="1f1b", num_microbatches=3)


def test_error_stage_count_not_axis_size():
    _, stage_fn, last_fn, _, _ = _simple()
    with pytest.raises(ValueError, match=r"num_stages=2 but mesh axis 'stage' has 4"):
        pipeline_value_and_grad(stage_fn, last_fn, _mesh(), schedule=gpipe_schedule(2, 4))
    first_fn, stage_fn, last_fn, shared, stages = _model()
    step = pipeline_value_and_grad(
        stage_fn, last_fn, _mesh(), schedule="gpipe", num_microbatches=4, first_fn=first_fn
    )
    x, y = _data(8)
    with pytest.raises(
        ValueError, match=r"stage parameter 'stage/.*' has shape \(3,.*stack_stages"
    ):
        step(stack_stages(stages[:3]), shared, x, y)


def test_error_batch_not_divisible():
    first_fn, stage_fn, last_fn, shared, stages = _simple()
    step = pipeline_value_and_grad(
        stage_fn, last_fn, _mesh(), schedule="gpipe", num_microbatches=4, first_fn=first_fn
    )
    x, y = _data(10)
    with pytest.raises(ValueError, match=r"inputs has batch size 10.*num_microbatches=4"):
        step(stages, shared, x, y)


def test_error_axis_missing_and_unknown_schedule():
    _, stage_fn, last_fn, _, _ = _simple()
    with pytest.raises(ValueError, match=r"stage_axis='pipe' is not an axis"):
        pipeline_value_and_grad(stage_fn, last_fn, _mesh(), stage_axis="pipe", num_microbatches=4)
    with pytest.raises(ValueError, match=r"data_axis='data' is not an axis"):
        pipeline_value_and_grad(stage_fn, last_fn, _mesh(), data_axis="data", num_microbatches=4)
    with pytest.raises(ValueError, match=r"unknown schedule 'zb-h2'.*'zbv'"):
        pipeline_value_and_grad(stage_fn, last_fn, _mesh(), schedule="zb-h2", num_microbatches=4)
    with pytest.raises(ValueError, match=r"pass num_microbatches="):
        pipeline_value_and_grad(stage_fn, last_fn, _mesh())


def test_error_stage_changes_shape_and_bad_return():
    first_fn, stage_fn, last_fn, shared, stages = _simple()
    x, y = _data(8)
    grow = pipeline_value_and_grad(
        lambda p, h: (jnp.concatenate([h, h], -1), p),
        last_fn,
        _mesh(),
        schedule="gpipe",
        num_microbatches=4,
        first_fn=first_fn,
    )
    with pytest.raises(ValueError, match=r"keep the activation's shape.*first_fn / last_fn"):
        grow(stages, shared, x, y)
    bad = pipeline_value_and_grad(
        lambda p, h: h, last_fn, _mesh(), schedule="gpipe", num_microbatches=4, first_fn=first_fn
    )
    with pytest.raises(TypeError, match=r"stage_fn must return \(outputs, params\)"):
        bad(stages, shared, x, y)


def test_error_stack_stages_mismatch():
    *_, stages = _model()
    with pytest.raises(ValueError, match="got no stages"):
        stack_stages([])
    other = bx.Params().locked()
    with pytest.raises(ValueError, match="stage 1 has a different structure"):
        stack_stages([stages[0], other])
