"""YOLO-style blocks against PyTorch, output shapes at every scale, a training step, errors.

The PyTorch reference modules below are written here from the YOLOv8 design (Conv2d
without bias + BatchNorm2d(eps=1e-3, momentum=0.03) + SiLU; Bottleneck; C2f; SPPF;
the backbone and the FPN/PAN neck) and run in NCHW. Weights are copied to blox
(``kernel = weight.permute(2, 3, 1, 0)``, BatchNorm ``weight -> scale``, running
statistics as they are), and the comparison covers outputs in training mode (batch
statistics), the running statistics after that step, outputs in eval mode, and the
gradients of ``sum(y * r)`` w.r.t. the input and every trainable weight.

Parameters are created with ``jax.eval_shape`` (no random initialization runs) and then
filled with PyTorch's weights. Tolerances: float64 ``tol(float64)`` (rtol 1e-10,
atol 1e-12) for single blocks; the whole backbone+neck (30 convolutions, 30
normalizations in a chain) uses rtol 1e-8, atol 1e-10 in float64; the float32 Conv-BN-SiLU
case uses rtol 1e-4, atol 1e-5 (f32 convolution sums in a different order, amplified
by the batch normalization).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from torch import nn

import blox as bx
from tests.nn.torch_reference import dtype_context, to_np
from tests.tolerances import tol

F32_BLOCK_TOL = dict(rtol=1e-4, atol=1e-5)
F64_STACK_TOL = dict(rtol=1e-8, atol=1e-10)


# ---------------------------------------------------------------------------
# PyTorch reference modules (NCHW)
# ---------------------------------------------------------------------------


class TConv(nn.Module):
    def __init__(self, c1, c2, k=1, s=1, g=1, d=1, act=True):
        super().__init__()
        self.conv = nn.Conv2d(c1, c2, k, s, d * (k - 1) // 2, dilation=d, groups=g, bias=False)
        self.bn = nn.BatchNorm2d(c2, eps=1e-3, momentum=0.03)
        self.act = nn.SiLU() if act else nn.Identity()

    def forward(self, x):
        return self.act(self.bn(self.conv(x)))


class TBottleneck(nn.Module):
    def __init__(self, c1, c2, shortcut=True, g=1, e=0.5):
        super().__init__()
        c_ = int(c2 * e)
        self.cv1 = TConv(c1, c_, 3)
        self.cv2 = TConv(c_, c2, 3, g=g)
        self.add = shortcut and c1 == c2

    def forward(self, x):
        y = self.cv2(self.cv1(x))
        return x + y if self.add else y


class TC2f(nn.Module):
    def __init__(self, c1, c2, n=1, shortcut=False, e=0.5):
        super().__init__()
        self.c = int(c2 * e)
        self.cv1 = TConv(c1, 2 * self.c, 1)
        self.cv2 = TConv((2 + n) * self.c, c2, 1)
        self.m = nn.ModuleList(TBottleneck(self.c, self.c, shortcut, e=1.0) for _ in range(n))

    def forward(self, x):
        parts = list(self.cv1(x).chunk(2, 1))
        for m in self.m:
            parts.append(m(parts[-1]))
        return self.cv2(torch.cat(parts, 1))


class TSPPF(nn.Module):
    def __init__(self, c1, c2, k=5):
        super().__init__()
        c_ = c2 // 2
        self.cv1 = TConv(c1, c_, 1)
        self.cv2 = TConv(c_ * 4, c2, 1)
        self.pool = nn.MaxPool2d(k, 1, k // 2)

    def forward(self, x):
        parts = [self.cv1(x)]
        for _ in range(3):
            parts.append(self.pool(parts[-1]))
        return self.cv2(torch.cat(parts, 1))


class TBackboneNeck(nn.Module):
    def __init__(self, cin, w, d):
        super().__init__()
        self.stem = TConv(cin, w[0], 3, 2)
        self.downs = nn.ModuleList(TConv(w[i], w[i + 1], 3, 2) for i in range(4))
        self.stages = nn.ModuleList(TC2f(w[i + 1], w[i + 1], d[i], True) for i in range(4))
        self.sppf = TSPPF(w[4], w[4])
        c3, c4, c5 = w[2:]
        n = max(1, d[-1])
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.top_p4 = TC2f(c5 + c4, c4, n)
        self.out_p3 = TC2f(c4 + c3, c3, n)
        self.down_p3 = TConv(c3, c3, 3, 2)
        self.out_p4 = TC2f(c3 + c4, c4, n)
        self.down_p4 = TConv(c4, c4, 3, 2)
        self.out_p5 = TC2f(c4 + c5, c5, n)

    def forward(self, x):
        y = self.stem(x)
        outs = []
        for down, stage in zip(self.downs, self.stages, strict=True):
            y = stage(down(y))
            outs.append(y)
        p3, p4, p5 = outs[1], outs[2], self.sppf(outs[3])
        n4 = self.top_p4(torch.cat([self.up(p5), p4], 1))
        o3 = self.out_p3(torch.cat([self.up(n4), p3], 1))
        o4 = self.out_p4(torch.cat([self.down_p3(o3), n4], 1))
        o5 = self.out_p5(torch.cat([self.down_p4(o4), p5], 1))
        return o3, o4, o5


# ---------------------------------------------------------------------------
# weight mapping
# ---------------------------------------------------------------------------


def _conv_weights(prefix: tuple, m: TConv) -> dict:
    t = lambda v: to_np(v).copy()  # noqa: E731  (a copy: torch updates in place)
    return {
        prefix + ("conv", "kernel"): t(m.conv.weight).transpose(2, 3, 1, 0),
        prefix + ("bn", "scale"): t(m.bn.weight),
        prefix + ("bn", "bias"): t(m.bn.bias),
        prefix + ("bn", "running_mean"): t(m.bn.running_mean),
        prefix + ("bn", "running_var"): t(m.bn.running_var),
    }


def _weights(prefix: tuple, m: nn.Module) -> dict:
    """blox path -> array for a reference module (recursively, by the blox names)."""
    if isinstance(m, TConv):
        return _conv_weights(prefix, m)
    out = {}
    if isinstance(m, TBackboneNeck):
        bb, nk = prefix + ("backbone",), prefix + ("neck",)
        out.update(_weights(bb + ("stem",), m.stem))
        for i in range(4):
            out.update(_weights(bb + (f"down_{i + 1}",), m.downs[i]))
            out.update(_weights(bb + (f"stage_{i + 1}",), m.stages[i]))
        out.update(_weights(bb + ("sppf",), m.sppf))
        for name in ("top_p4", "out_p3", "down_p3", "out_p4", "down_p4", "out_p5"):
            out.update(_weights(nk + (name,), getattr(m, name)))
        return out
    out.update(_weights(prefix + ("cv1",), m.cv1))
    out.update(_weights(prefix + ("cv2",), m.cv2))
    for i, b in enumerate(getattr(m, "m", [])):
        out.update(_weights(prefix + ("m", str(i)), b))
    return out


def _randomize(m: nn.Module, seed: int) -> None:
    """Non-trivial BatchNorm weights and running statistics (conv weights: torch init)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, nn.BatchNorm2d):
                c = mod.num_features
                mod.weight.copy_(torch.rand(c, generator=gen) + 0.5)
                mod.bias.copy_(torch.randn(c, generator=gen) * 0.2)
                mod.running_mean.copy_(torch.randn(c, generator=gen) * 0.1)
                mod.running_var.copy_(torch.rand(c, generator=gen) + 0.5)


def _params_from(module, rng, x, weights: dict, dtype) -> bx.Params:
    """Params with the module's own layout (via eval_shape: no initializer runs), filled
    with `weights`; every parameter but the Rng's must be covered."""

    def init(x):
        return module(rng.seed(bx.Params(), seed=0), x, is_training=False)[1]

    own, _ = jax.eval_shape(init, x).split(lambda path, _: path[1] != "rng")
    assert set(own.keys()) == set(weights), set(own.keys()) ^ set(weights)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), own).unlocked()
    for path, value in weights.items():
        old = params[path]
        assert old.value.shape == value.shape, (path, old.value.shape, value.shape)
        params[path] = bx.Param(jnp.asarray(value, dtype), old.trainable, old.metadata)
    return params.locked()


def _conv_modules(prefix: tuple, m: nn.Module) -> list:
    """(blox path, TConv) pairs, with the same naming as `_weights`."""
    found = []

    def walk(p, mod):
        if isinstance(mod, TConv):
            found.append((p, mod))
        elif isinstance(mod, TBackboneNeck):
            bb, nk = p + ("backbone",), p + ("neck",)
            walk(bb + ("stem",), mod.stem)
            for i in range(4):
                walk(bb + (f"down_{i + 1}",), mod.downs[i])
                walk(bb + (f"stage_{i + 1}",), mod.stages[i])
            walk(bb + ("sppf",), mod.sppf)
            for name in ("top_p4", "out_p3", "down_p3", "out_p4", "down_p4", "out_p5"):
                walk(nk + (name,), getattr(mod, name))
        else:
            walk(p + ("cv1",), mod.cv1)
            walk(p + ("cv2",), mod.cv2)
            for i, b in enumerate(getattr(mod, "m", [])):
                walk(p + ("m", str(i)), b)

    walk(prefix, m)
    return found


def _run_case(
    name, make_blox, make_ref, x_shape, dtype, channels_first, check_tol, seed=0, grads=True
):
    """One training step (outputs, all gradients, running statistics), then eval
    outputs with the updated statistics: blox vs the PyTorch reference."""
    torch.manual_seed(seed)
    tdtype = getattr(torch, dtype)
    ref = make_ref()
    _randomize(ref, seed)
    ref = ref.to(tdtype)
    before = _weights(("net", name), ref)  # torch updates its statistics in forward
    rs = np.random.default_rng(seed)
    x_nchw = rs.standard_normal(x_shape)
    x_t = torch.tensor(x_nchw, dtype=tdtype, requires_grad=True)
    ref.train()
    ys_t = ref(x_t)
    ys_t = ys_t if isinstance(ys_t, tuple) else (ys_t,)
    rs_t = [rs.standard_normal(tuple(y.shape)) for y in ys_t]
    sum(
        torch.sum(y * torch.tensor(r, dtype=tdtype)) for y, r in zip(ys_t, rs_t, strict=True)
    ).backward()
    after = _weights(("net", name), ref)
    to = (lambda a: a) if channels_first else (lambda a: np.moveaxis(a, 1, -1))

    with dtype_context(dtype):
        g = bx.Graph("net")
        rng = bx.Rng(g / "rng")
        module = make_blox(g / name, rng)
        x = jnp.asarray(to(x_nchw), dtype)
        params = _params_from(module, rng, x, before, dtype)
        cot = [jnp.asarray(to(r), dtype) for r in rs_t]

        def loss(train, rest, x):
            ys, new = module(train.merge(rest), x, is_training=True)
            ys = ys if isinstance(ys, tuple) else (ys,)
            return sum(jnp.sum(y * r) for y, r in zip(ys, cot, strict=True)), (ys, new)

        train, rest = params.split()
        if grads:
            grad_fn = jax.jit(jax.grad(loss, argnums=(0, 2), has_aux=True))
            (g_train, g_x), (ys, new) = grad_fn(train, rest, x)
        else:  # forward only (the blocks' gradients are checked one by one)
            ys, new = jax.jit(lambda p, x: loss(p, rest, x)[1])(train, x)
        for i, (y, yt) in enumerate(zip(ys, ys_t, strict=True)):
            np.testing.assert_allclose(
                y, to(to_np(yt)), **check_tol, err_msg=f"{name} train output {i}"
            )
        if grads:
            np.testing.assert_allclose(
                g_x, to(to_np(x_t.grad)), **check_tol, err_msg=f"{name} d/dx"
            )
            grads_t = {}
            for path, mod in _conv_modules(("net", name), ref):
                kernel_grad = to_np(mod.conv.weight.grad).transpose(2, 3, 1, 0)
                grads_t[path + ("conv", "kernel")] = kernel_grad
                grads_t[path + ("bn", "scale")] = to_np(mod.bn.weight.grad)
                grads_t[path + ("bn", "bias")] = to_np(mod.bn.bias.grad)
            assert set(grads_t) == set(g_train.keys())
            for path, expected in grads_t.items():
                np.testing.assert_allclose(
                    g_train[path].value, expected, **check_tol, err_msg=f"d/d {path}"
                )
        for path, value in after.items():
            if path[-1].startswith("running_"):
                np.testing.assert_allclose(
                    new[path].value, value, **check_tol, err_msg=f"{path} after one step"
                )
        ref.eval()
        with torch.no_grad():
            ye_t = ref(torch.tensor(x_nchw, dtype=tdtype))
        ye, _ = jax.jit(lambda p, x: module(p, x, is_training=False))(new, x)
        ye_t = ye_t if isinstance(ye_t, tuple) else (ye_t,)
        ye = ye if isinstance(ye, tuple) else (ye,)
        for i, (y, yt) in enumerate(zip(ye, ye_t, strict=True)):
            np.testing.assert_allclose(
                y, to(yt.numpy()), **check_tol, err_msg=f"{name} eval output {i}"
            )


CONV_CASES = [
    # (c_in, c_out, k, s, groups, dilation, channels_first, dtype)
    (3, 8, 3, 2, 1, 1, False, "float64"),
    (4, 6, 1, 1, 1, 1, True, "float64"),
    (4, 8, 3, 1, 2, 2, False, "float64"),
    (3, 8, 3, 2, 1, 1, True, "float32"),
]


@pytest.mark.parametrize("c_in,c_out,k,s,groups,dilation,channels_first,dtype", CONV_CASES)
def test_conv_bn_silu_matches_torch(c_in, c_out, k, s, groups, dilation, channels_first, dtype):
    def make(graph, rng):
        return bx.ConvBNSiLU(
            graph,
            k,
            c_out,
            rng,
            strides=s,
            feature_group_count=groups,
            kernel_dilation=dilation,
            channels_first=channels_first,
            param_dtype=dtype,
        )

    check = tol(dtype) if dtype == "float64" else F32_BLOCK_TOL
    _run_case(
        "cbs",
        make,
        lambda: TConv(c_in, c_out, k, s, groups, dilation),
        (3, c_in, 9, 8),
        dtype,
        channels_first,
        check,
    )


BLOCK_CASES = [
    # (name, blox builder (graph, rng, channels_first), torch builder, C_in, channels_first)
    (
        "bottleneck",
        lambda g, r, cf: bx.Bottleneck(g, 6, r, channels_first=cf, param_dtype="float64"),
        lambda: TBottleneck(6, 6, True),
        6,
        False,
    ),
    (
        "bottleneck_noadd",
        lambda g, r, cf: bx.Bottleneck(g, 8, r, channels_first=cf, param_dtype="float64"),
        lambda: TBottleneck(6, 8, True),
        6,
        True,
    ),
    (
        "c2f",
        lambda g, r, cf: bx.C2f(
            g, 8, r, num_blocks=2, shortcut=True, channels_first=cf, param_dtype="float64"
        ),
        lambda: TC2f(6, 8, 2, True),
        6,
        False,
    ),
    (
        "sppf",
        lambda g, r, cf: bx.SPPF(g, 8, r, channels_first=cf, param_dtype="float64"),
        lambda: TSPPF(8, 8),
        8,
        True,
    ),
]


@pytest.mark.parametrize(
    "name,make,make_ref,c_in,channels_first", BLOCK_CASES, ids=[c[0] for c in BLOCK_CASES]
)
def test_blocks_match_torch(name, make, make_ref, c_in, channels_first):
    """Bottleneck (with the residual, NHWC; without, NCHW), C2f (2 bottlenecks with
    residuals, NHWC), SPPF (NCHW); float64."""
    _run_case(
        name,
        lambda g, r: make(g, r, channels_first),
        make_ref,
        (2, c_in, 7, 6),
        "float64",
        channels_first,
        tol("float64"),
    )


TINY = dict(widths=(4, 6, 8, 8, 12), depths=(1, 1, 1, 1))


def test_backbone_and_neck_match_torch_float64():
    """The whole YOLOBackboneNeck vs the PyTorch composition: the 3 output scales in
    training mode, every running statistic after that step, and eval outputs (forward
    only: each block's gradients are checked above; compiling the whole stack's
    backward pass in float64 costs a minute on CPU)."""

    def make(graph, rng):
        return bx.YOLOBackboneNeck(graph, rng, param_dtype="float64", **TINY)

    _run_case(
        "yolo",
        make,
        lambda: TBackboneNeck(3, TINY["widths"], TINY["depths"]),
        (2, 3, 64, 64),
        "float64",
        False,
        F64_STACK_TOL,
        grads=False,
    )


# ---------------------------------------------------------------------------
# shapes, training step
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("channels_first", [False, True], ids=["last", "first"])
@pytest.mark.parametrize("hw", [(64, 64), (96, 160)])
def test_output_shapes_at_every_scale(hw, channels_first):
    g = bx.Graph("yolo")
    rng = bx.Rng(g / "rng")
    model = bx.YOLOBackboneNeck(g / "net", rng, channels_first=channels_first, **TINY)
    backbone = model.backbone
    h, w = hw
    x = jax.ShapeDtypeStruct((2, 3, h, w) if channels_first else (2, h, w, 3), jnp.float32)
    params = rng.seed(bx.Params(), seed=0)
    feats, _ = jax.eval_shape(backbone, params, x)
    outs, p = jax.eval_shape(model, params, x)

    def shape(c, s):
        return (2, c, h // s, w // s) if channels_first else (2, h // s, w // s, c)

    widths = TINY["widths"]
    assert [f.shape for f in feats] == [
        shape(widths[2], 8),
        shape(widths[3], 16),
        shape(widths[4], 32),
    ]
    assert [o.shape for o in outs] == [
        shape(widths[2], 8),
        shape(widths[3], 16),
        shape(widths[4], 32),
    ]
    assert all(o.dtype == jnp.float32 for o in outs)
    # Every BatchNorm has its two non-trainable statistics.
    stats = [k for k in p.keys() if k[-1].startswith("running_")]
    assert stats and all(not p[k].trainable for k in stats)
    assert ("yolo", "net", "neck", "out_p5", "m", "0", "cv2", "conv", "kernel") in p


@pytest.fixture(scope="module")
def tiny_yolo():
    """A tiny YOLOBackboneNeck with He-normal kernels drawn by NumPy and BatchNorm at
    its initial values. The layout comes from jax.eval_shape; compiling JAX's random
    initializers for every kernel shape would dominate this test's time on CPU (the
    example in examples/yolo_blocks.py uses the real initializers)."""
    g = bx.Graph("yolo")
    rng = bx.Rng(g / "rng")
    model = bx.YOLOBackboneNeck(g / "net", rng, widths=(4, 4, 8, 8, 8), depths=(1, 1, 1, 1))
    x = jax.random.normal(jax.random.key(1), (4, 32, 32, 3))
    abstract = jax.eval_shape(lambda x: model(rng.seed(bx.Params(), seed=0), x)[1], x)
    own, _ = abstract.split(lambda path, _: path[1] != "rng")
    rs = np.random.default_rng(0)
    params = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), own).unlocked()
    for path, p in list(params.items()):
        shape = p.value.shape
        if path[-1] == "kernel":
            value = rs.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[:-1]))
        elif path[-1] in ("scale", "running_var"):
            value = np.ones(shape)
        else:
            value = np.zeros(shape)
        params[path] = bx.Param(jnp.asarray(value, jnp.float32), p.trainable, p.metadata)
    return model, params.locked(), x


@pytest.mark.standard_promotion  # the test's own Optax calls
def test_a_few_adam_steps_lower_a_loss_and_update_running_stats(tiny_yolo):
    """Regress the three scales to fixed random targets: the loss after 8 Adam steps is
    lower than before; the running statistics moved; the params tree is unchanged."""
    model, params, x = tiny_yolo
    outs0, _ = jax.eval_shape(model, params, x)
    targets = [jax.random.normal(jax.random.key(i), o.shape) for i, o in enumerate(outs0)]
    tx = optax.adam(1e-2)

    def loss_fn(train, rest, x):
        outs, new = model(train.merge(rest), x, is_training=True)
        loss = sum(jnp.mean((o - t) ** 2) for o, t in zip(outs, targets, strict=True))
        return loss, new

    @jax.jit
    def step(params, opt_state, x):
        train, rest = params.split()
        (loss, new), grads = jax.value_and_grad(loss_fn, has_aux=True)(train, rest, x)
        updates, opt_state = tx.update(grads, opt_state, train)
        _, new_rest = new.split()
        return optax.apply_updates(train, updates).merge(new_rest), opt_state, loss

    opt_state = tx.init(params.split()[0])
    p = params
    losses = []
    for _ in range(8):
        p, opt_state, loss = step(p, opt_state, x)
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0], losses
    assert jax.tree.structure(p) == jax.tree.structure(params)
    path = ("yolo", "net", "backbone", "stem", "bn", "running_mean")
    assert not np.allclose(p[path].value, params[path].value)


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------


def test_neck_rejects_scales_that_do_not_halve():
    g = bx.Graph("yolo")
    rng = bx.Rng(g / "rng")
    model = bx.YOLOBackboneNeck(g / "net", rng, **TINY)
    params = rng.seed(bx.Params(), seed=0)
    with pytest.raises(
        ValueError,
        match=r"YOLONeck 'yolo/net/neck': the scales must halve exactly.*\(5, 5\), \(3, 3\), "
        r"\(2, 2\).*multiples of 32",
    ):
        jax.eval_shape(model, params, jax.ShapeDtypeStruct((1, 40, 40, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"'yolo/net/neck': expects the three scales"):
        model.neck(params, (jnp.ones((1, 4, 4, 8)),) * 2)


def test_block_errors_name_the_path_shapes_and_fix():
    g = bx.Graph("net")
    with pytest.raises(ValueError, match=r"YOLOBackbone 'net/bb': expects images \(B, H, W, C\)"):
        bx.YOLOBackbone(g / "bb", None)(bx.Params(), jnp.ones((32, 32, 3)))
    with pytest.raises(ValueError, match=r"YOLOBackbone 'net/bb2': widths needs 5 entries"):
        bx.YOLOBackbone(g / "bb2", None, widths=(4, 8))
    with pytest.raises(ValueError, match=r"SPPF 'net/sppf': kernel_size must be an odd"):
        bx.SPPF(g / "sppf", 8, None, kernel_size=4)
    with pytest.raises(ValueError, match=r"C2f 'net/c2f': needs int\(output_channels"):
        bx.C2f(g / "c2f", 1, None)
    with pytest.raises(ValueError, match=r"Bottleneck 'net/b': .* 0 hidden channels"):
        bx.Bottleneck(g / "b", 1, None)
    with pytest.raises(ValueError, match=r"YOLONeck 'net/neck': channels must be"):
        bx.YOLONeck(g / "neck", None, channels=(8, 16))
    # Errors of the inner layers keep their full paths.
    cbs = bx.ConvBNSiLU(g / "cbs", 3, 8, None)
    with pytest.raises(ValueError, match=r"Conv 'net/cbs/conv' is 2-D"):
        cbs(bx.Params(), jnp.ones((5, 3)))
