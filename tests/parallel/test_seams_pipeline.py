"""The pipeline's seams (where it composes with DP, dropout, padding, shared state
and low precision): `pipeline_value_and_grad` against one-device runs
written with plain ``jax.value_and_grad`` (the independent references).

* Every schedule (GPipe, 1F1B, 1F1B-2F, interleaved, ZB-H1) on a (data 2, stage 2) mesh
  with a padded batch (a masked loss and ``aux['weight']``, one microbatch all padding,
  its loss NaN), dropout in the stages and one `Rng` shared by ``first_fn`` and
  ``last_fn``, listed in ``rngs=``: loss and gradients are the global weighted mean of
  one-device runs of each shard with its seeds folded by the shard index, and the final
  counters are the one-device run's.
* ``first_fn`` and ``last_fn`` drawing from one shared `Rng` (no data axis): the
  one-device sequential run's loss, gradients and counter; state that cannot be
  merged raises naming the leaf.
* bf16 params: the accumulation over microbatches and the collectives run in float32
  (the lowered program's scan carry and all-reduces; FSDP stages' reduce-scatter), and
  gradients match the float32 model within bf16 compute error where bf16 sums are 5 %
  off.
* Integer state computed from the batch on a data axis raises naming the leaf.
* Misuse raises at trace time: a parameter created in a function, an `Rng` that draws on
  a data axis without being listed in ``rngs=``.
"""

from __future__ import annotations

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
from tests.parallel.pipeline_common import Counter
from tests.tolerances import tol

P, WIDTH, D_IN, CLASSES = 2, 8, 3, 3
M, ROWS = 4, 2  # microbatches per data shard, rows per microbatch
F32 = tol(jnp.float32)
# One mask row per example: the data shards get 7 and 5 real rows, and shard 0's
# microbatch 1 is all padding (its masked mean is 0 / 0 = NaN).
MASK = np.array([1, 1, 0, 0, 1, 0, 1, 1, 1, 1, 1, 0, 0, 1, 0, 1], np.float32)


def _model(n_stages):
    """`first_fn` (embedding + noise from the shared Rng), `n_stages` stages (Linear,
    dropout from the stage's Rng, residual), `last_fn` (dropout from the shared Rng, head,
    masked cross-entropy with ``aux['weight']``); `rows` is `last_fn` per example."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    embed = bx.Linear(g / "embed", WIDTH, rng)
    head = bx.Linear(g / "head", CLASSES, rng)
    sg = bx.Graph("stage")
    srng = bx.Rng(sg / "rng")
    fc = bx.Linear(sg / "fc", WIDTH, srng)

    def first_fn(params, x):
        h, params = embed(params, x, precision="highest")
        key, params = rng(params)
        return h + 0.1 * jax.random.normal(key, h.shape), params

    def stage_fn(params, h):
        y, params = fc(params, h, precision="highest")
        key, params = srng(params)
        keep = jax.random.bernoulli(key, 0.75, y.shape)
        return h + jnp.where(keep, jnp.tanh(y) / 0.75, 0.0), params

    def rows(params, h, y):
        key, params = rng(params)
        h = jnp.where(jax.random.bernoulli(key, 0.8, h.shape), h / 0.8, 0.0)
        logits, params = head(params, h, precision="highest")
        return optax.softmax_cross_entropy_with_integer_labels(logits, y), params

    def last_fn(params, h, ym):
        y, mask = ym
        ce, params = rows(params, h, y)
        return (jnp.sum(ce * mask) / jnp.sum(mask), {"weight": jnp.sum(mask)}), params

    shared = rng.seed(bx.Params(), seed=0)
    h, shared = embed(shared, jnp.zeros((1, D_IN)))
    _, shared = head(shared, h)
    stages = [fc(srng.seed(bx.Params(), seed=10 + s), h)[1].locked() for s in range(n_stages)]
    return (first_fn, stage_fn, last_fn, rows), shared.locked(), stages, (rng, srng)


def _data(n=2 * M * ROWS):
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(n, D_IN)), jnp.float32)
    return x, jnp.asarray(r.integers(0, CLASSES, size=(n,)), jnp.int32)


def _mesh(shape, names):
    return jax.make_mesh(shape, names, devices=jax.devices()[: int(np.prod(shape))])


def _close(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kw)


def _sequential(fns, n_stages, weighted):
    """The one-device model, jitted once per model: microbatch by microbatch (a
    ``lax.scan``), stage by stage, every Rng advancing in call order. ``weighted``: the
    sum over rows of ``ce * mask`` (no NaN); else the sum of the microbatch means."""
    first_fn, stage_fn, last_fn, rows = fns

    def run(trainables, states, st_sh, x, y, mask):
        tr_sh, trs = trainables
        xs, ys, ms = (a.reshape(M, -1, *a.shape[1:]) for a in (x, y, mask))

        def one(carry, b):
            states, st_sh = carry
            h, p_sh = first_fn(tr_sh.merge(st_sh), b[0])
            new_states = []
            for s in range(n_stages):
                h, p = stage_fn(trs[s].merge(states[s]), h)
                new_states.append(p.split()[1])
            if weighted:
                ce, p_sh = rows(p_sh, h, b[1])
                value = jnp.sum(ce * b[2])
            else:
                (value, _), p_sh = last_fn(p_sh, h, (b[1], b[2]))
            return (new_states, p_sh.split()[1]), value

        (states, st_sh), values = jax.lax.scan(one, (states, st_sh), (xs, ys, ms))
        return jnp.sum(values), (states, st_sh)

    return jax.jit(jax.value_and_grad(run, has_aux=True))


@functools.cache
def _reference(n_stages):
    """Per data shard k: the one-device run of its rows with every Rng's seed folded by k
    (what ``rngs=`` does); loss and gradients the weighted mean over all rows of both
    shards; the state after shard 0 (counters advance alike on both)."""
    fns, shared, stages, (rng, srng) = _model(n_stages)
    x, y = _data()
    f = _sequential(fns, n_stages, weighted=True)
    total, grads, state = 0.0, None, None
    half = M * ROWS
    for k in range(2):
        fold = lambda p, r, k=k: r.seed(p, seed=jax.random.fold_in(r.get_seed(p), k))  # noqa: E731
        sh = fold(shared, rng)
        sts = [fold(s, srng) for s in stages]
        tr = (sh.split()[0], [s.split()[0] for s in sts])
        rows = slice(k * half, (k + 1) * half)
        with jax.default_matmul_precision("highest"):
            (value, st), g = f(tr, [s.split()[1] for s in sts], sh.split()[1], x[rows], y[rows],
                               jnp.asarray(MASK[rows]))  # fmt: skip
        total = total + value
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        state = st if state is None else state
    w = MASK.sum()
    return total / w, jax.tree.map(lambda a: a / w, grads), state


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("1f1b-2f", 1), ("interleaved", 2), ("zb", 1)]


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_padded_batch_dropout_shared_rng_every_schedule(schedule, v):
    """DP x PP on a padded batch with dropout: the global weighted mean (not the mean of
    shard means: the shards hold 7 and 5 real rows), a NaN-loss weight-0 microbatch
    adding nothing, per-shard masks from the folded seeds, and the shared Rng's draws in
    first_fn and last_fn in one-device order."""
    fns, shared, stages, (rng, srng) = _model(v * P)
    first_fn, stage_fn, last_fn, _ = fns
    x, y = _data()
    step = jax.jit(
        pipeline_value_and_grad(
            stage_fn,
            last_fn,
            _mesh((2, P), ("data", "stage")),
            schedule=schedule,
            num_microbatches=M,
            first_fn=first_fn,
            data_axis="data",
            virtual_stages=v if v > 1 else None,
            has_aux=True,
            rngs=[srng, rng],
        )
    )
    with jax.default_matmul_precision("highest"):
        (loss, aux), (g, g_sh), (new_stages, new_shared) = step(
            stack_stages(stages, virtual_stages=v), shared, x, (y, jnp.asarray(MASK))
        )
    ref_loss, (ref_g_sh, ref_g), (ref_states, ref_st_sh) = _reference(v * P)
    assert float(aux["weight"]) == MASK.sum()
    np.testing.assert_allclose(float(loss), float(ref_loss), **F32)
    _close(g_sh, ref_g_sh, **F32)
    for k, gs in enumerate(unstack_stages(g, virtual_stages=v)):
        _close(gs, ref_g[k], **F32)
    # the counters advanced as on one device, the seeds came back unfolded
    for k, ps in enumerate(unstack_stages(new_stages, virtual_stages=v)):
        assert ps["stage", "rng", "counter"].value == ref_states[k]["stage", "rng", "counter"].value
        assert int(srng.get_counter(ps)) == int(srng.get_counter(stages[k])) + M
        _close(
            ps["stage", "rng", "seed"].value,
            stages[k]["stage", "rng", "seed"].value,
            rtol=0,
            atol=0,
        )
    assert new_shared["net", "rng", "counter"].value == ref_st_sh["net", "rng", "counter"].value
    # first_fn's and last_fn's draws
    assert int(rng.get_counter(new_shared)) == int(rng.get_counter(shared)) + 2 * M
    _close(
        new_shared["net", "rng", "seed"].value, shared["net", "rng", "seed"].value, rtol=0, atol=0
    )


def test_shared_rng_in_first_and_last_equals_one_device():
    """first_fn and last_fn draw from one Rng, no data axis: each call gets the key it
    gets on one device (loss and gradients equal), and the counter counts both sides'
    draws (before: both sides drew the same keys, and only one side's advance was kept)."""
    fns, shared, stages, (rng, _) = _model(P)
    first_fn, stage_fn, last_fn, _ = fns
    x, y = _data(M * ROWS)
    mask = jnp.ones((M * ROWS,), jnp.float32)
    plain_last = lambda p, h, ym: (lambda out: (out[0][0], out[1]))(last_fn(p, h, ym))  # noqa: E731
    step = jax.jit(
        pipeline_value_and_grad(
            stage_fn, plain_last, _mesh((P,), ("stage",)), num_microbatches=M, first_fn=first_fn
        )
    )
    with jax.default_matmul_precision("highest"):
        loss, (g, g_sh), (_, new_shared) = step(stack_stages(stages), shared, x, (y, mask))
        ref = _sequential(fns, P, weighted=False)
        (value, (_, ref_st_sh)), (ref_g_sh, ref_g) = ref(
            (shared.split()[0], [s.split()[0] for s in stages]),
            [s.split()[1] for s in stages],
            shared.split()[1],
            x,
            y,
            mask,
        )
    np.testing.assert_allclose(float(loss), float(value) / M, **F32)
    _close(g_sh, jax.tree.map(lambda a: a / M, ref_g_sh), **F32)
    for k, gs in enumerate(unstack_stages(g)):
        _close(gs, jax.tree.map(lambda a: a / M, ref_g[k]), **F32)
    _close(new_shared.split()[1], ref_st_sh, rtol=0, atol=0)
    assert int(rng.get_counter(new_shared)) == int(rng.get_counter(shared)) + 2 * M


def test_state_both_ends_change_raises_naming_the_leaf():
    """Running statistics updated by both first_fn and last_fn cannot be merged (one
    device applies one after the other): the step raises naming the leaf. The integer
    call count beside it, a constant added per call, would be counted."""
    g = bx.Graph("net")
    count = Counter(g / "count")
    sg = bx.Graph("stage")
    rng = bx.Rng(sg / "rng")
    fc = bx.Linear(sg / "fc", WIDTH, rng)

    def stage_fn(params, h):
        y, params = fc(params, h)
        return h + y, params

    def last_fn(params, h, y):
        h, params = count(params, h)
        return jnp.mean((h - y) ** 2), params

    stages = [fc(rng.seed(bx.Params(), seed=s), jnp.zeros((1, WIDTH)))[1] for s in range(P)]
    shared = count(bx.Params(), jnp.zeros((1, WIDTH)))[1].locked()
    step = pipeline_value_and_grad(
        stage_fn, last_fn, _mesh((P,), ("stage",)), num_microbatches=M, first_fn=count
    )
    x = jnp.zeros((M * ROWS, WIDTH))
    with pytest.raises(ValueError, match=r"first_fn and last_fn both change .* 'net/count/mean'"):
        jax.eval_shape(step, stack_stages([s.locked() for s in stages]), shared, x, x)


# -- bf16 params: float32 sums ------------------------------------------------------------------
def _bf16_step(reduce_dtype=None, fsdp=False):
    """Stages ``h * w`` and a loss ``mean(h * s)`` with bf16 ``w`` (per stage) and ``s``
    (shared), on a (data 2, stage 2) mesh with 16 microbatches per shard; inputs 256 in
    shard 0's microbatch 0 and 1 elsewhere, so that its gradient is 256x each other
    microbatch's: summed in bf16, the 15 small ones vanish (4 + 1/64 rounds to 4).
    ``fsdp``: ``w`` sharded over data (FSDP stages, gathered by `bp.fsdp_call`)."""
    m, width, bf = 16, 4, jnp.bfloat16

    def scale(params, h):
        return h * params["stage", "w"].value[None], params

    def stage_fn(params, h):
        return bp.fsdp_call(scale, params, h, under=("stage",)) if fsdp else scale(params, h)

    def last_fn(params, h, y):
        return jnp.mean((h * params["net", "s"].value[None]).astype(jnp.float32)), params

    stages, shared = bx.Params(), bx.Params()
    stages[("stage", "w")] = bx.Param(jnp.ones((P, width), bf))
    shared[("net", "s")] = bx.Param(jnp.ones((width,), bf))
    x = np.ones((2 * m * ROWS, width), np.float32)
    x[:ROWS] = 256.0
    mesh = _mesh((2, P), ("data", "stage"))
    one = jax.tree.map(lambda a: a[0], stages)
    step = jax.jit(
        pipeline_value_and_grad(
            stage_fn,
            last_fn,
            mesh,
            num_microbatches=m,
            data_axis="data",
            reduce_dtype=reduce_dtype,
            stage_specs=bp.fsdp_specs(one, mesh, min_size=0) if fsdp else None,
        )
    )
    args = (stages.locked(), shared.locked(), jnp.asarray(x, bf), jnp.asarray(x, bf))
    return step, args, x


def _reduction_types(lowered_text, op="all_reduce"):
    """The element types of every `op` (all_reduce, reduce_scatter) in a lowered
    (StableHLO) program: its reduction region's arguments."""
    ops = re.findall(rf'"stablehlo.{op}".*?\^bb0\(%\w+: tensor<(\w+)>', lowered_text, re.S)
    assert ops, f"no {op} in the program"
    return set(ops)


def test_bf16_params_accumulate_and_reduce_in_float32():
    step, args, x = _bf16_step()
    lowered = step.lower(*args)
    text = lowered.as_text()
    types = _reduction_types(text)
    assert "f32" in types and "bf16" not in types, types
    # the slots' scan carries the gradient sums of w (this device's (1, 4)) and s in f32
    (carry,) = re.findall(r"stablehlo.while\(.*?\) : ([^\n]*)", text)
    assert "tensor<1x4xf32>" in carry and "tensor<4xf32>" in carry, carry
    loss, (g, g_sh), _ = lowered.compile()(*args)
    assert g["stage", "w"].value.dtype == jnp.bfloat16  # returned in the params' dtype
    # the float32 reference on one device: the mean over all rows of x * (the other w) * s
    ref = x.mean(0) / x.shape[1]  # d/dw = d/ds = mean_r x[r, j] / width (all ones)
    for got in (*np.asarray(g["stage", "w"].value, np.float32), g_sh["net", "s"].value):
        np.testing.assert_allclose(np.asarray(got, np.float32), ref, **tol(jnp.bfloat16))
    np.testing.assert_allclose(float(loss), x.mean(), **tol(jnp.bfloat16))


def test_reduce_dtype_is_honoured_and_checked():
    step, args, _ = _bf16_step(reduce_dtype=jnp.bfloat16)
    assert "bf16" in _reduction_types(step.lower(*args).as_text())
    # FSDP stages: the weights' reduce-scatter (inside fsdp_call) in the reduction dtype too
    for rd, want in ((None, "f32"), (jnp.bfloat16, "bf16")):
        step, args, _ = _bf16_step(reduce_dtype=rd, fsdp=True)
        assert _reduction_types(step.lower(*args).as_text(), "reduce_scatter") == {want}
    with pytest.raises(ValueError, match=r"reduce_dtype must be a floating dtype.*int32"):
        _bf16_step(reduce_dtype=jnp.int32)


# -- misuse, at trace time ------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["stage_fn", "first_fn", "last_fn"])
def test_parameter_created_in_a_function_raises(where):
    """A layer first created inside one of the functions would be drawn anew at every
    step and dropped from the returned params: the step raises naming its path."""
    fns, shared, stages, _ = _model(P)
    first_fn, stage_fn, last_fn, _ = fns
    ng = bx.Graph("new")
    nrng = bx.Rng(ng / "rng")
    extra = bx.Linear(ng / "fc", WIDTH, nrng)

    def grow(fn):
        def f(params, *args):
            out, params = fn(params, *args)
            _, params = extra(params, jnp.zeros((1, WIDTH)))
            return out, params

        return f

    fs = {"stage_fn": stage_fn, "first_fn": first_fn, "last_fn": last_fn}
    fs[where] = grow(fs[where])
    step = pipeline_value_and_grad(
        fs["stage_fn"], fs["last_fn"], _mesh((P,), ("stage",)), num_microbatches=M,
        first_fn=fs["first_fn"], has_aux=True,
    )  # fmt: skip
    x, y = _data(M * ROWS)
    with pytest.raises(
        ValueError, match=rf"(?s){where}: the loss created 2 .*'new/fc/kernel'.*locked"
    ):
        jax.eval_shape(
            step,
            stack_stages([nrng.seed(s.unlocked(), seed=0) for s in stages]),
            nrng.seed(shared.unlocked(), seed=0),
            x,
            (y, jnp.ones(M * ROWS)),
        )


def test_unlisted_rng_on_a_data_axis_raises():
    """With a data axis, an Rng that draws but is not in rngs= would draw the same masks
    on every shard: the step raises naming its path and rngs=."""
    fns, shared, stages, (rng, srng) = _model(P)
    first_fn, stage_fn, last_fn, _ = fns
    x, y = _data()
    batch = (stack_stages(stages), shared, x, (y, jnp.asarray(MASK)))
    mesh = _mesh((2, P), ("data", "stage"))
    for listed, missing in (([rng], "stage/rng"), ([srng], "net/rng")):
        step = pipeline_value_and_grad(
            stage_fn, last_fn, mesh, num_microbatches=M, first_fn=first_fn, data_axis="data",
            has_aux=True, rngs=listed,
        )  # fmt: skip
        with pytest.raises(ValueError, match=rf"Rng '{missing}' drew keys.*not in rngs="):
            jax.eval_shape(step, *batch)
    other = bx.Rng(bx.Graph("elsewhere") / "rng")
    step = pipeline_value_and_grad(
        stage_fn, last_fn, mesh, num_microbatches=M, first_fn=first_fn, data_axis="data",
        has_aux=True, rngs=[rng, srng, other],
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"Rng 'elsewhere/rng'.*neither stage_params"):
        jax.eval_shape(step, *batch)


class _Tally(bx.Module):
    """Integer state computed from the data: the positive activations seen."""

    def __call__(self, params, h):
        n, params = self.get_param(
            params, "count", (), jax.nn.initializers.zeros, dtype=jnp.int32, trainable=False
        )
        return h, self.set_param(params, "count", n + jnp.sum(h > 0).astype(jnp.int32))


def test_integer_state_from_the_batch_raises_on_a_data_axis():
    """Each data shard's pipeline counts its own rows, and an integer cannot be averaged
    over the shards (the step returned the larger shard's count): it raises naming the
    leaf, as the DP and FSDP steps do. The stage's Rng counter, carried with the
    activation through a lax.scan, depends on no data and passes."""
    fns, shared, stages, rngs = _model(P)
    first_fn, stage_fn, last_fn, _ = fns
    tally = _Tally(bx.Graph("stage") / "tally")

    def counting(params, h):
        h, params = stage_fn(params, h)
        return tally(params, h)

    def scanning(params, h):
        def body(carry, _):
            return stage_fn(carry[1], carry[0]), None

        return jax.lax.scan(body, (h, params), None, length=2)[0]

    x, y = _data()
    counted = [tally(s.unlocked(), jnp.zeros((1, WIDTH)))[1].locked() for s in stages]
    for fn, params in ((counting, counted), (scanning, stages)):
        step = pipeline_value_and_grad(
            fn, last_fn, _mesh((2, P), ("data", "stage")), num_microbatches=M,
            first_fn=first_fn, data_axis="data", has_aux=True, rngs=rngs,
        )  # fmt: skip
        args = (stack_stages(params), shared, x, (y, jnp.asarray(MASK)))
        if fn is scanning:
            jax.eval_shape(step, *args)
            continue
        with pytest.raises(
            ValueError,
            match=r"non-trainable parameter 'stage/tally/count' \(int32\) differs between "
            r"the shards of the data axis 'data': stage_fn computes it from the batch",
        ):
            jax.eval_shape(step, *args)
