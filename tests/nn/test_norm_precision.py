"""Normalization in half precision: statistics in float32, outputs in the compute dtype.

References: NumPy float64 on the same half-precision inputs and parameters (the value a
correctly rounded half-precision result approximates), PyTorch CPU (``nn.GroupNorm`` in
bfloat16 as the bar for the bf16 error; ``nn.GroupNorm`` / ``nn.BatchNorm2d`` in float64
for a train step's gradients), and the jaxpr of a bf16 `Policy` train step (every
convolution must run in bf16).

Tolerances: ``tol(float16)`` (rtol/atol 2e-3) for float16 outputs against float64, which
is one float16 ulp at the largest normalized values here (|y| < 8); the bf16 errors are
compared with PyTorch's, not with a fixed tolerance (within 5 %: both round once from
float32 statistics, so they agree to the last bit on these inputs). The float16 train
step's loss and gradients are checked against float64 PyTorch at rtol/atol 2e-2 (about
ten float16 ulps: the forward and backward pass run through four float16 layers).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import blox as bx
from tests.tolerances import tol

F16 = tol("float16")


def _np_groupnorm(x, groups, scale, bias, eps=1e-5):
    """Float64 group norm of an ``(N, C, ...)`` array."""
    n, c = x.shape[:2]
    xg = x.reshape(n, groups, -1)
    y = (xg - xg.mean(-1, keepdims=True)) / np.sqrt(xg.var(-1, keepdims=True) + eps)
    shape = (1, c) + (1,) * (x.ndim - 2)
    return y.reshape(x.shape) * scale.reshape(shape) + bias.reshape(shape)


def _with(params: bx.Params, values: dict, dtype) -> bx.Params:
    out = params.unlocked()
    for path, v in values.items():
        old = params[path]
        out[path] = bx.Param(jnp.asarray(v, dtype), old.trainable, old.metadata)
    return out.locked()


def _outlier_batch(shape=(2, 4, 4, 4), at=(0, 1, 2, 0), offset=300.0):
    """A float16 batch (channels last) with one activation `offset` away from the rest."""
    x = np.random.default_rng(0).standard_normal(shape)
    x[at] += offset
    return np.asarray(x, np.float16)


# ---------------------------------------------------------------------------
# float16: one large activation (item: squares overflow float16)
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("channels_first", [False, True], ids=["NHWC", "NCHW"])
def test_groupnorm_float16_outlier_stays_finite_and_matches_float64(channels_first):
    """300 away from its group mean: 300**2 = 90000 overflows float16 (max 65504). The
    group must still normalize (outlier ~ +7, the rest ~ -0.15), not collapse to 0."""
    x = _outlier_batch()  # (B, H, W, C); the outlier is in channel 0, group 0
    if channels_first:
        x = np.moveaxis(x, -1, 1)
    rs = np.random.default_rng(1)
    scale = rs.uniform(0.5, 1.5, 4).astype(np.float16)
    bias = rs.standard_normal(4).astype(np.float16)
    gn = bx.GroupNorm(bx.Graph("net") / "gn", 2, channels_first=channels_first)
    _, params = gn(bx.Params(), jnp.zeros(x.shape, jnp.float16))
    params = _with(
        params, {("net", "gn", "scale"): scale, ("net", "gn", "bias"): bias}, jnp.float16
    )
    y, _ = gn(params, jnp.asarray(x))
    assert y.dtype == jnp.float16
    x64 = np.asarray(x, np.float64)
    nchw = x64 if channels_first else np.moveaxis(x64, -1, 1)
    ref = _np_groupnorm(nchw, 2, scale.astype(np.float64), bias.astype(np.float64))
    ref = ref if channels_first else np.moveaxis(ref, 1, -1)
    assert np.isfinite(np.asarray(y, np.float64)).all()
    np.testing.assert_allclose(np.asarray(y, np.float64), ref, **F16)


def test_batchnorm_float16_params_outlier_keeps_running_var_finite():
    """float16 parameters and input (param_dtype=float16), one activation 300 away from
    its channel mean: output, running_mean and running_var (unbiased, momentum 0.9)
    against float64; then eval mode with those statistics."""
    x = _outlier_batch()
    bn = bx.BatchNorm(bx.Graph("net") / "bn", param_dtype=jnp.float16)
    rs = np.random.default_rng(2)
    scale = rs.uniform(0.5, 1.5, 4).astype(np.float16)
    bias = rs.standard_normal(4).astype(np.float16)
    _, params = bn(bx.Params(), jnp.zeros(x.shape, jnp.float16), is_training=False)
    params = _with(
        params, {("net", "bn", "scale"): scale, ("net", "bn", "bias"): bias}, jnp.float16
    )
    y, new = bn(params, jnp.asarray(x))
    assert y.dtype == jnp.float16
    flat = np.asarray(x, np.float64).reshape(-1, 4)
    mean, var = flat.mean(0), flat.var(0)
    ref = (flat - mean) / np.sqrt(var + 1e-5) * scale.astype(np.float64) + bias
    np.testing.assert_allclose(np.asarray(y, np.float64).reshape(-1, 4), ref, **F16)
    r_mean = new[("net", "bn", "running_mean")].value
    r_var = new[("net", "bn", "running_var")].value
    assert r_mean.dtype == r_var.dtype == jnp.float16
    assert np.isfinite(np.asarray(r_var, np.float64)).all()
    np.testing.assert_allclose(np.asarray(r_mean, np.float64), 0.1 * mean, **F16)
    np.testing.assert_allclose(
        np.asarray(r_var, np.float64), 0.9 + 0.1 * flat.var(0, ddof=1), **F16
    )
    y_eval, _ = bn(new, jnp.asarray(x), is_training=False)
    rm, rv = np.asarray(r_mean, np.float64), np.asarray(r_var, np.float64)
    ref_eval = (flat - rm) / np.sqrt(rv + 1e-5) * scale.astype(np.float64) + bias
    np.testing.assert_allclose(np.asarray(y_eval, np.float64).reshape(-1, 4), ref_eval, **F16)


# ---------------------------------------------------------------------------
# bfloat16: GroupNorm's error no worse than PyTorch's
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_groupnorm_bf16_error_is_no_worse_than_torch(seed):
    """Both libraries in bf16 (input, weight, bias), both measured against float64 on the
    same bf16 values. Statistics taken in bf16 gave 2-3x PyTorch's error."""
    rs = np.random.default_rng(seed)
    c, groups = 32, 8
    x = torch.tensor(rs.standard_normal((4, c, 8, 8)) * 2.0 + 3.0).to(torch.bfloat16)
    w = torch.tensor(rs.uniform(0.5, 1.5, c)).to(torch.bfloat16)
    b = torch.tensor(rs.standard_normal(c)).to(torch.bfloat16)
    ref = torch.nn.GroupNorm(groups, c, dtype=torch.bfloat16)
    with torch.no_grad():
        ref.weight.copy_(w)
        ref.bias.copy_(b)
        y_torch = ref(x).double().numpy()
    x64, w64, b64 = (t.double().numpy() for t in (x, w, b))
    exact = _np_groupnorm(x64, groups, w64, b64)

    gn = bx.GroupNorm(bx.Graph("net") / "gn", groups, channels_first=True)
    _, params = gn(bx.Params(), jnp.zeros(x.shape, jnp.bfloat16))
    params = _with(params, {("net", "gn", "scale"): w64, ("net", "gn", "bias"): b64}, "bfloat16")
    y, _ = gn(params, jnp.asarray(x64, jnp.bfloat16))
    assert y.dtype == jnp.bfloat16
    err_blox = np.abs(np.asarray(y, np.float64) - exact)
    err_torch = np.abs(y_torch - exact)
    assert err_blox.mean() <= 1.05 * err_torch.mean(), (err_blox.mean(), err_torch.mean())
    assert err_blox.max() <= 1.05 * err_torch.max(), (err_blox.max(), err_torch.max())


# ---------------------------------------------------------------------------
# Policy: normalization returns the compute dtype
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_norms_return_the_compute_dtype_of_policy_cast_params(dtype):
    """What a `Policy` passes: trainable scale/bias cast to the compute dtype, the
    running statistics left float32. Every norm returns the compute dtype; BatchNorm's
    statistics stay float32 (and equal the float64 running update)."""
    g = bx.Graph("net")
    layers = {
        "bn": bx.BatchNorm(g / "bn"),
        "gn": bx.GroupNorm(g / "gn", 2),
        "ln": bx.LayerNorm(g / "ln"),
        "rms": bx.RMSNorm(g / "rms"),
    }
    x = np.random.default_rng(3).standard_normal((4, 3, 4)).astype(np.float32)
    policy = bx.Policy(compute_dtype=dtype)
    for name, layer in layers.items():
        _, params = layer(bx.Params(), jnp.zeros(x.shape))  # creates the parameters
        train, rest = params.split()
        cast = policy.cast_to_compute(train).merge(rest)
        y, new = layer(cast, policy.cast_to_compute(jnp.asarray(x)))
        assert y.dtype == jnp.dtype(dtype), (name, y.dtype)
        if name == "bn":
            rv_old = np.asarray(params[("net", "bn", "running_var")].value, np.float64)
            rv = new[("net", "bn", "running_var")].value
            assert rv.dtype == jnp.float32
            xs = np.asarray(jnp.asarray(x, dtype), np.float64).reshape(-1, 4)
            expected = 0.9 * rv_old + 0.1 * xs.var(0, ddof=1)
            np.testing.assert_allclose(rv, expected, **tol("float32"))


def _conv_primitive_dtypes(jaxpr) -> list[tuple[str, ...]]:
    """The operand dtypes of every ``conv_general_dilated`` in `jaxpr`, nested jaxprs
    (jit, custom_jvp, remat, scan bodies) included."""
    found = []

    def sub_jaxprs(value):
        if hasattr(value, "jaxpr") and hasattr(value, "consts"):  # a ClosedJaxpr
            yield value.jaxpr
        elif hasattr(value, "eqns"):  # a Jaxpr
            yield value
        elif isinstance(value, tuple | list):
            for v in value:
                yield from sub_jaxprs(v)

    def walk(jx):
        for eqn in jx.eqns:
            if eqn.primitive.name == "conv_general_dilated":
                found.append(tuple(str(v.aval.dtype) for v in eqn.invars))
            for value in eqn.params.values():
                for sub in sub_jaxprs(value):
                    walk(sub)

    walk(jaxpr.jaxpr)
    return found


def test_bf16_policy_train_step_runs_every_convolution_in_bf16():
    """A YOLO-style Conv-BN-SiLU stack (two ConvBNSiLU, a C2f block, global pool, Linear)
    under ``Policy(compute_dtype='bfloat16')``: in the jaxpr of the whole train step,
    forward and backward, every convolution has bf16 operands. (A BatchNorm that returned
    float32 made every later convolution float32.) The BatchNorm statistics stay float32
    and the gradients arrive in the float32 master dtype."""
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    stem = bx.ConvBNSiLU(g / "stem", 3, 8, rng, strides=2)
    down = bx.ConvBNSiLU(g / "down", 3, 16, rng, strides=2)
    block = bx.C2f(g / "c2f", 16, rng)
    head = bx.Linear(g / "head", 1, rng)

    def model(params, x):
        y, params = stem(params, x)
        y, params = down(params, y)
        y, params = block(params, y)
        return head(params, bx.global_avg_pool(y))

    x = jax.ShapeDtypeStruct((2, 16, 16, 3), jnp.float32)  # only traced, never run
    target = jax.ShapeDtypeStruct((2, 1), jnp.float32)
    _, params = jax.eval_shape(model, rng.seed(bx.Params(), seed=0), x)

    def loss_fn(params, x, target):
        pred, params = model(params, x)
        return jnp.mean(jnp.square(pred - target.astype(pred.dtype))), params

    step = bx.value_and_grad(loss_fn, policy=bx.Policy(compute_dtype="bfloat16"))
    jaxpr = jax.make_jaxpr(step)(params.locked(), x, target)
    convs = _conv_primitive_dtypes(jaxpr)
    # Per convolution: the forward, d/dkernel and d/dinput (but the stem's input, the
    # batch, gets no gradient).
    kernels = [p for p in params.keys() if p[-2:] == ("conv", "kernel")]
    assert len(kernels) >= 4 and len(convs) == 3 * len(kernels) - 1, (kernels, len(convs))
    not_bf16 = [c for c in convs if c != ("bfloat16", "bfloat16")]
    assert not not_bf16, f"{len(not_bf16)} of {len(convs)} convolutions not bf16: {not_bf16}"

    loss, grads, new = jax.eval_shape(step, params.locked(), x, target)  # dtypes only
    assert loss.dtype == jnp.float32
    assert {v.dtype for v in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
    stats = [v for p, v in new.items() if p[-1] in ("running_mean", "running_var")]
    assert stats and all(s.value.dtype == jnp.float32 for s in stats)


# ---------------------------------------------------------------------------
# float16 Policy: a train step with an outlier activation
# ---------------------------------------------------------------------------


def test_float16_policy_train_step_has_finite_grads_that_match_float64_torch():
    """GroupNorm -> SiLU -> BatchNorm -> global mean -> Linear, NCHW, under
    ``Policy(compute_dtype='float16')``, on a batch with one input 300 away from its
    group mean. Loss and every gradient are finite and match PyTorch in float64 on the
    same (float16-rounded) input and weights; the running statistics too."""
    c = 4
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    gn = bx.GroupNorm(g / "gn", 2, channels_first=True)
    bn = bx.BatchNorm(g / "bn", channels_first=True)
    head = bx.Linear(g / "head", 1, rng)

    def model(params, x):
        y, params = gn(params, x)
        y, params = bn(params, jax.nn.silu(y))
        return head(params, bx.global_avg_pool(y, channels_first=True))

    # (4, C, 5, 5), float16 values. Contiguous: PyTorch 2.13's CPU GroupNorm backward
    # crashes on the channels-last strides np.moveaxis would give it.
    x = np.ascontiguousarray(np.moveaxis(_outlier_batch((4, 5, 5, c)), -1, 1))
    target = np.random.default_rng(5).standard_normal((4, 1)).astype(np.float32)
    _, params = model(rng.seed(bx.Params(), seed=0), jnp.asarray(x, jnp.float32))
    rs = np.random.default_rng(6)
    weights = {  # float16-representable, so the policy's cast is exact
        ("net", "gn", "scale"): rs.uniform(0.5, 1.5, c),
        ("net", "gn", "bias"): rs.standard_normal(c),
        ("net", "bn", "scale"): rs.uniform(0.5, 1.5, c),
        ("net", "bn", "bias"): rs.standard_normal(c),
        ("net", "head", "kernel"): rs.standard_normal((c, 1)),
        ("net", "head", "bias"): rs.standard_normal(1),
    }
    weights = {k: np.asarray(v, np.float16).astype(np.float32) for k, v in weights.items()}
    stats = {("net", "bn", "running_mean"): np.zeros(c), ("net", "bn", "running_var"): np.ones(c)}
    params = _with(params, {**weights, **stats}, jnp.float32)  # undo the init's update

    def loss_fn(params, x, target):
        pred, params = model(params, x)
        return jnp.mean(jnp.square(pred.astype(jnp.float32) - target.astype(jnp.float32))), params

    step = jax.jit(bx.value_and_grad(loss_fn, policy=bx.Policy(compute_dtype="float16")))
    loss, grads, new = step(params, jnp.asarray(x, jnp.float32), jnp.asarray(target))
    assert all(bool(jnp.isfinite(v).all()) for v in jax.tree.leaves(grads))

    # PyTorch float64 reference.
    t_gn = torch.nn.GroupNorm(2, c, dtype=torch.float64)
    t_bn = torch.nn.BatchNorm2d(c, momentum=0.1, dtype=torch.float64)
    t_head = torch.nn.Linear(c, 1, dtype=torch.float64)
    with torch.no_grad():
        t_gn.weight.copy_(torch.tensor(weights[("net", "gn", "scale")]))
        t_gn.bias.copy_(torch.tensor(weights[("net", "gn", "bias")]))
        t_bn.weight.copy_(torch.tensor(weights[("net", "bn", "scale")]))
        t_bn.bias.copy_(torch.tensor(weights[("net", "bn", "bias")]))
        t_head.weight.copy_(torch.tensor(weights[("net", "head", "kernel")].T))
        t_head.bias.copy_(torch.tensor(weights[("net", "head", "bias")]))
    h = t_bn(torch.nn.functional.silu(t_gn(torch.tensor(x, dtype=torch.float64))))
    pred = t_head(h.mean((2, 3)))
    t_loss = ((pred - torch.tensor(target, dtype=torch.float64)) ** 2).mean()
    t_loss.backward()

    close = dict(rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(float(loss), t_loss.item(), **close)
    expected = {
        ("net", "gn", "scale"): t_gn.weight.grad,
        ("net", "gn", "bias"): t_gn.bias.grad,
        ("net", "bn", "scale"): t_bn.weight.grad,
        ("net", "bn", "bias"): t_bn.bias.grad,
        ("net", "head", "kernel"): t_head.weight.grad.T,
        ("net", "head", "bias"): t_head.bias.grad,
    }
    for path, ref in expected.items():
        got = grads[path].value
        assert got.dtype == jnp.float32, path
        np.testing.assert_allclose(got, ref.numpy(), **close, err_msg="/".join(path))
    for name, ref in (("running_mean", t_bn.running_mean), ("running_var", t_bn.running_var)):
        got = new[("net", "bn", name)].value
        assert got.dtype == jnp.float32 and bool(jnp.isfinite(got).all()), name
        np.testing.assert_allclose(got, ref.numpy(), **close, err_msg=name)


def test_norms_without_parameters_return_float32_for_integer_inputs():
    """No scale or bias and an int32 input: the result is float32 (it used to be cast to
    int32 for LayerNorm, RMSNorm and GroupNorm, truncating every value). NumPy float64
    reference."""
    x = np.arange(24, dtype=np.int32).reshape(2, 3, 4) ** 2
    xf = x.astype(np.float64)
    g = bx.Graph("net")
    ln = bx.LayerNorm(g / "ln", use_scale=False, use_bias=False)
    rms = bx.RMSNorm(g / "rms", use_scale=False)
    gn = bx.GroupNorm(g / "gn", 2, use_scale=False, use_bias=False)
    grouped = xf.reshape(2, 3, 2, 2)
    expected = {
        "ln": (xf - xf.mean(-1, keepdims=True)) / np.sqrt(xf.var(-1, keepdims=True) + 1e-5),
        "rms": xf / np.sqrt((xf**2).mean(-1, keepdims=True) + 1e-5),
        "gn": (
            (grouped - grouped.mean((1, 3), keepdims=True))
            / np.sqrt(grouped.var((1, 3), keepdims=True) + 1e-5)
        ).reshape(x.shape),
    }
    for name, layer in (("ln", ln), ("rms", rms), ("gn", gn)):
        y, _ = layer(bx.Params(), jnp.asarray(x))
        assert y.dtype == jnp.float32, name
        np.testing.assert_allclose(y, expected[name], **tol("float32"), err_msg=name)
