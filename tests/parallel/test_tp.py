"""Tensor parallelism against the unsharded blox.nn layers (same Params): forward and
every gradient, GQA, masks, dropout, the all-reduce count in the HLO, global (jit) mode
on Explicit and Auto meshes, and the errors."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx
from blox import parallel as bp
from tests.tolerances import tol

F32 = tol(jnp.float32)
TYPES = ["explicit", "auto"]
RULES = bp.transformer_tp_rules() + [("rng/(seed|counter)", None)]
D, N, F, B, T = 16, 4, 32, 4, 6


def _x(seed=0, shape=(B, T, D)):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _pair(make_ref, make_tp, x, seed=0, name="block"):
    """The unsharded and the TP module on two graphs with the same paths; one Params."""
    g1, g2 = bx.Graph("net"), bx.Graph("net")
    r1, r2 = bx.Rng(g1 / "rng"), bx.Rng(g2 / "rng")
    ref, tp = make_ref(g1 / name, r1), make_tp(g2 / name, r2)
    params = r1.seed(bx.Params(), seed=seed)
    _, params = ref(params, x, is_training=False)
    return ref, tp, params.locked(), (r1, r2)


def _block_pair(x, **kw):
    return _pair(
        lambda g, r: bx.TransformerBlock(g, model_size=D, num_heads=N, rng=r, mlp_size=F, **kw),
        lambda g, r: bp.ParallelTransformerBlock(
            g, model_size=D, num_heads=N, rng=r, mlp_size=F, **kw
        ),
        x,
    )


def _sharded_call(tp, params, mesh, rules, call_kw, x_spec=None):
    x_spec = P("data") if x_spec is None else x_spec
    # allow_unused: the block's rules also cover layers an attention-only model lacks.
    specs = bp.param_specs(params, rules, mesh, allow_unused=True)
    cot = _x(7, (B, T, D))

    def fwd(p, x):
        return tp(p, x, **call_kw)[0]

    def loss(t, nt, x, c):
        # Sum over the data shards inside the loss: the gradient is the total.
        return jax.lax.psum(jnp.sum(fwd(t.merge(nt), x) * c), "data")

    def body(p, x, c):
        t, nt = p.split()
        return fwd(p, x), jax.grad(loss)(t, nt, x, c)

    t_specs = specs.split()[0]
    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(specs, x_spec, x_spec), out_specs=(x_spec, t_specs)
        )
    )
    ps = jax.device_put(params, bp.param_shardings(params, rules, mesh, allow_unused=True))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, x_spec))  # noqa: E731
    return f, ps, put, cot


def _check(ref, params, x, call_kw, y, grads, cot):
    def ref_loss(p):
        return jnp.sum(ref(p, x, **call_kw)[0] * cot)

    np.testing.assert_allclose(np.asarray(y), np.asarray(ref(params, x, **call_kw)[0]), **F32)
    t, nt = params.split()
    ref_g = jax.grad(lambda t: ref_loss(t.merge(nt)))(t)
    paths = list(params.split()[0].keys())
    # rtol 1e-5; atol 1e-6 or 1e-5 of the largest gradient entry of the whole model:
    # entries that cancel to ~0 carry float32 sum-order noise of the big terms (summation
    # order differs by shard). The key bias's gradient is zero in exact arithmetic
    # (softmax ignores a shift shared by all keys), so all of it is such noise.
    scale = max(float(np.max(np.abs(np.asarray(ref_g[p].value)))) for p in paths)
    for path in paths:
        np.testing.assert_allclose(
            np.asarray(grads[path].value),
            np.asarray(ref_g[path].value),
            rtol=F32["rtol"],
            atol=max(F32["atol"], 1e-5 * scale),
            err_msg=str(path),
        )


@pytest.mark.parametrize("types", TYPES)
def test_block_on_2x4_equals_unsharded_forward_and_every_gradient(types):
    x = _x()
    ref, tp, params, _ = _block_pair(x)
    mesh = bp.make_mesh((2, 4), ("data", "model"), axis_types=types)
    kw = dict(is_causal=True, is_training=False)
    with jax.default_matmul_precision("highest"):
        f, ps, put, cot = _sharded_call(tp, params, mesh, RULES, kw)
        y, grads = f(ps, put(x), put(cot))
        _check(ref, params, x, kw, y, grads, cot)
    assert grads[("net", "block", "attn", "query", "kernel")].value.sharding.spec == P(
        None, "model"
    )


def _count_all_reduce(f, *args):
    text = jax.jit(f).lower(*args).as_text()
    return len(re.findall(r"stablehlo\.all_reduce|all-reduce\(", text))


def test_hlo_has_one_all_reduce_per_row_parallel_layer_in_forward():
    x = _x()
    ref, tp, params, _ = _block_pair(x)
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    specs = bp.param_specs(params, RULES, mesh)
    ps = jax.device_put(params, bp.param_shardings(params, RULES, mesh))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))

    def block(p, x):
        return tp(p, x, is_causal=True, is_training=False)[0]

    def mlp(p, x):
        return tp.mlp(p, x)[0]

    for fn, n in ((block, 2), (mlp, 1)):
        f = jax.shard_map(fn, mesh=mesh, in_specs=(specs, P("data")), out_specs=P("data"))
        assert _count_all_reduce(f, ps, xs) == n, fn.__name__


@pytest.mark.parametrize(
    "heads,kv,model,shard_kv",
    [(4, 2, 2, True), (8, 4, 4, True), (4, 1, 4, False)],
)
def test_attention_heads_split_with_gqa_and_masks(heads, kv, model, shard_kv):
    x = _x(1)
    key_mask = jnp.asarray(np.arange(T)[None, :] < np.array([6, 4, 5, 3])[:, None])
    ref, tp, params, _ = _pair(
        lambda g, r: bx.MultiHeadAttention(
            g, model_size=D, num_heads=heads, rng=r, num_kv_heads=kv, use_rope=True
        ),
        lambda g, r: bp.ParallelMultiHeadAttention(
            g, model_size=D, num_heads=heads, rng=r, num_kv_heads=kv, use_rope=True
        ),
        x,
        name="attn",
    )
    data = 8 // model
    mesh = bp.make_mesh((data, model), ("data", "model"))
    rules = bp.transformer_tp_rules(shard_kv=shard_kv) + [("rng/(seed|counter)", None)]
    with jax.default_matmul_precision("highest"):
        kw = dict(is_causal=True, is_training=False)
        f, ps, put, cot = _sharded_call(tp, params, mesh, rules, kw)
        y, grads = f(ps, put(x), put(cot))
        _check(ref, params, x, kw, y, grads, cot)
    if kv != 1:
        return
    # A padding mask (one case: it costs a compile), model-only mesh (not split over data).
    mesh = bp.make_mesh((1, model), ("data", "model"), devices=jax.devices()[:model])
    kw = dict(key_mask=key_mask, is_training=False)
    with jax.default_matmul_precision("highest"):
        f, ps, put, cot = _sharded_call(tp, params, mesh, rules, kw)
        y, grads = f(ps, put(x), put(cot))
        _check(ref, params, x, kw, y, grads, cot)


def test_attention_masks_by_rank_as_multi_head_attention_on_2x4():
    """A 3-D mask is (B, T, S), shared by the heads, as in bx.MultiHeadAttention, also when
    B == N (it was read as per-head (1, N, T, S)); a 4-D mask is per head, each device
    keeping its own heads. Masks are sharded over the data axis like x."""
    x = _x(4)
    assert B == N  # the case where a rank-blind reader mistakes sequences for heads
    lengths = np.array([6, 2, 5, 3])
    pad = np.arange(T)[None, None, :] < lengths[:, None, None]  # (B, 1, S)
    mask3 = jnp.asarray(np.broadcast_to(pad, (B, T, T)))  # (B, T, S) padding mask
    per_head = np.random.default_rng(5).random((B, N, T, T)) < 0.6
    mask4 = jnp.asarray(per_head | np.eye(T, dtype=bool))  # (B, N, T, S), no empty row
    ref, tp, params, _ = _pair(
        lambda g, r: bx.MultiHeadAttention(g, model_size=D, num_heads=N, rng=r),
        lambda g, r: bp.ParallelMultiHeadAttention(g, model_size=D, num_heads=N, rng=r),
        x,
        name="attn",
    )
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    specs = bp.param_specs(params, RULES, mesh, allow_unused=True)  # attention only
    ps = jax.device_put(params, bp.param_shardings(params, RULES, mesh, allow_unused=True))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))  # noqa: E731
    f = jax.jit(
        jax.shard_map(
            lambda p, x, m: tp(p, x, mask=m, is_training=False)[0],
            mesh=mesh,
            in_specs=(specs, P("data"), P("data")),
            out_specs=P("data"),
        )
    )
    with jax.default_matmul_precision("highest"):
        for mask in (mask3, mask4):
            want = ref(params, x, mask=mask, is_training=False)[0]
            y = f(ps, put(x), put(mask))
            np.testing.assert_allclose(np.asarray(y), np.asarray(want), **F32)
            # Unsharded (no shard_map): the same reading.
            y1 = tp(params, x, mask=mask, is_training=False)[0]
            np.testing.assert_allclose(np.asarray(y1), np.asarray(want), **F32)
    # The padding mask really is (B, T, S): it equals the key_mask of the same lengths.
    key_mask = jnp.asarray(pad[:, 0])
    np.testing.assert_allclose(
        np.asarray(tp(params, x, key_mask=key_mask, is_training=False)[0]),
        np.asarray(tp(params, x, mask=mask3, is_training=False)[0]),
        **F32,
    )
    for bad in (jnp.ones((T,), bool), jnp.ones((N, T, T + 1), bool), jnp.ones((3, T, T), bool)):
        with pytest.raises(
            ValueError,
            match=rf"'net/attn': mask of shape {re.escape(str(tuple(bad.shape)))} does not "
            r"match \(T, S\) = \(6, 6\), \(B, T, S\) = \(4, 6, 6\) or \(B, N, T, S\) = "
            r"\(4, 4, 6, 6\).*a 3-D mask is \(B, T, S\), shared by the heads",
        ):
            tp(params, x, mask=bad, is_training=False)


def test_dropout_in_tp_block_equals_unsharded_with_the_same_keys():
    x = _x(2)
    ref, tp, params, _ = _block_pair(x, dropout_rate=0.2, attention_dropout_rate=0.3)
    mesh = bp.make_mesh((1, 4), ("data", "model"), devices=jax.devices()[:4])
    kw = dict(is_causal=True, is_training=True)
    with jax.default_matmul_precision("highest"):
        f, ps, put, cot = _sharded_call(tp, params, mesh, RULES, kw)
        y, grads = f(ps, put(x), put(cot))
        _check(ref, params, x, kw, y, grads, cot)
    assert not np.allclose(
        np.asarray(y), np.asarray(ref(params, x, is_causal=True, is_training=False)[0])
    )


@pytest.mark.parametrize("types", TYPES)
def test_global_mode_under_jit_on_explicit_and_auto_meshes(types):
    """No shard_map: params sharded by the rules, jit; on an Explicit mesh the
    row-parallel matmuls pass out_sharding (JAX raises without it)."""
    x = _x(3)
    ref, tp, params, _ = _block_pair(x)
    mesh = bp.make_mesh((2, 4), ("data", "model"), axis_types=types)
    ps = jax.device_put(params, bp.param_shardings(params, RULES, mesh))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))
    with jax.default_matmul_precision("highest"):
        y = jax.jit(lambda p, x: tp(p, x, is_causal=True, is_training=False)[0])(ps, xs)
        want = ref(params, x, is_causal=True, is_training=False)[0]
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), **F32)
    if types == "explicit":
        assert y.sharding.spec == P("data", None, None)


def test_same_params_serve_both_and_layouts_match():
    x = _x()
    ref, tp, params, _ = _block_pair(x)
    g = bx.Graph("net")
    r = bx.Rng(g / "rng")
    tp2 = bp.ParallelTransformerBlock(g / "block", model_size=D, num_heads=N, rng=r, mlp_size=F)
    _, own = tp2(r.seed(bx.Params(), seed=0), x, is_training=False)
    assert own.keys() == params.keys()
    for k in params.keys():
        assert own[k].value.shape == params[k].value.shape, k


def test_errors_heads_hidden_unsharded_params_and_check_vma():
    x = _x()
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))  # noqa: E731
    # Heads not divisible by the model axis.
    ref, tp, params, _ = _pair(
        lambda g, r: bx.MultiHeadAttention(g, model_size=D, num_heads=2, rng=r),
        lambda g, r: bp.ParallelMultiHeadAttention(g, model_size=D, num_heads=2, rng=r),
        x,
        name="attn",
    )
    rep = bp.param_specs(params, [(".*", None)])
    f = jax.shard_map(
        lambda p, x: tp(p, x)[0], mesh=mesh, in_specs=(rep, P("data")), out_specs=P("data")
    )
    with pytest.raises(ValueError, match="num_heads = 2 is not divisible by the size 4"):
        f(jax.device_put(params, NamedSharding(mesh, P())), put(x))
    # Hidden size not divisible.
    g = bx.Graph("net")
    r = bx.Rng(g / "rng")
    mlp = bp.ParallelMLP(g / "mlp", 6, D, r)
    _, mp = mlp(r.seed(bx.Params(), seed=0), x)
    specs = bp.param_specs(mp.locked(), [(".*", None)])
    f = jax.shard_map(
        lambda p, x: mlp(p, x)[0], mesh=mesh, in_specs=(specs, P("data")), out_specs=P("data")
    )
    with pytest.raises(ValueError, match=r"'kernel' \(16, 6\) \(size 6\) is not divisible by"):
        f(jax.device_put(mp.locked(), NamedSharding(mesh, P())), put(x))
    # Params passed replicated where the layer expects shards.
    g = bx.Graph("net")
    r = bx.Rng(g / "rng")
    mlp = bp.ParallelMLP(g / "mlp", 8, D, r)
    mp = mlp(r.seed(bx.Params(), seed=0), x)[1].locked()
    specs = bp.param_specs(mp, [(".*", None)])
    f = jax.shard_map(
        lambda p, x: mlp(p, x)[0], mesh=mesh, in_specs=(specs, P("data")), out_specs=P("data")
    )
    with pytest.raises(ValueError, match=r"local shape \(16, 8\), expected \(16, 2\)"):
        f(jax.device_put(mp, NamedSharding(mesh, P())), put(x))
    # check_vma=False.
    mlp_rules = bp.transformer_tp_rules() + [("rng/.*", None)]  # the MLP's rules are used
    tp_specs = bp.param_specs(mp, mlp_rules, mesh, allow_unused=True)
    f = jax.shard_map(
        lambda p, x: mlp(p, x)[0],
        mesh=mesh,
        in_specs=(tp_specs, P("data")),
        out_specs=P("data"),
        check_vma=False,
    )
    with pytest.raises(ValueError, match="need jax.shard_map.*check_vma=True"):
        f(
            jax.device_put(mp, bp.param_shardings(mp, mlp_rules, mesh, allow_unused=True)),
            put(x),
        )


def _random_bits_sizes(hlo: str) -> list[int]:
    """Element counts of the unsigned-integer tensors (random bits) in StableHLO text."""
    sizes = []
    for dims in re.findall(r"tensor<((?:\d+x)*)ui32>", hlo):
        sizes.append(int(np.prod([int(d) for d in dims.split("x") if d], dtype=np.int64)))
    return sizes


@pytest.mark.parametrize("heads,kv,model,shard_kv", [(8, 8, 4, True), (4, 1, 4, False)])
def test_attention_dropout_draws_only_the_local_heads_with_the_unsharded_bits(
    heads, kv, model, shard_kv
):
    """Each device draws the keep-mask of its own heads only (the largest random-bits
    tensor of the TP program is one device's heads, never all N), with the bits of the
    unsharded layer: the TP output with dropout 0.5 equals `MultiHeadAttention`'s (one
    differing mask element moves an output by O(1)), forward and gradients."""
    x = _x(4)
    ref, tp, params, _ = _pair(
        lambda g, r: bx.MultiHeadAttention(
            g, model_size=D, num_heads=heads, rng=r, num_kv_heads=kv, dropout_rate=0.5
        ),
        lambda g, r: bp.ParallelMultiHeadAttention(
            g, model_size=D, num_heads=heads, rng=r, num_kv_heads=kv, dropout_rate=0.5
        ),
        x,
        name="attn",
    )
    mesh = bp.make_mesh((1, model), ("data", "model"), devices=jax.devices()[:model])
    rules = bp.transformer_tp_rules(shard_kv=shard_kv) + [("rng/(seed|counter)", None)]
    kw = dict(is_causal=True, is_training=True)
    with jax.default_matmul_precision("highest"):
        f, ps, put, cot = _sharded_call(tp, params, mesh, rules, kw)
        y, grads = f(ps, put(x), put(cot))
        _check(ref, params, x, kw, y, grads, cot)
        hlo = f.lower(ps, put(x), put(cot)).as_text()
        ref_hlo = jax.jit(lambda p, x: ref(p, x, **kw)[0]).lower(params, x).as_text()
    y_eval = ref(params, x, is_causal=True, is_training=False)[0]
    assert not np.allclose(np.asarray(y), np.asarray(y_eval))  # the dropout is on
    all_heads, local = B * heads * T * T, B * (heads // model) * T * T
    assert all_heads in _random_bits_sizes(ref_hlo)  # the unsharded layer draws all N heads
    sizes = _random_bits_sizes(hlo)
    assert local in sizes, sizes
    assert max(sizes) == local, f"the TP program draws {max(sizes)} bits, > {local}: {sizes}"


MLP_RULES = [
    (r"linear_(0|2)/kernel", (None, "model")),
    (r"linear_(0|2)/bias", ("model",)),
    (r"linear_(1|3)/kernel", ("model", None)),
    (r"linear_(1|3)/bias", None),
    ("rng/(seed|counter)", None),
]


@pytest.mark.parametrize("which", ["block", "mlp"])
def test_nn_layers_in_tp_mode_equal_the_same_layers_unsharded(which):
    """The `blox.nn` layers themselves with ``tp_axis='model'`` (no Parallel* class),
    inside shard_map on a 2x4 mesh, equal the same layers without ``tp_axis`` on one
    device, forward and every gradient: a `TransformerBlock` with grouped-query heads
    (K = 2 < M = 4: key/value projections replicated, each device keeping its shared
    head) and RoPE at given positions; a four-layer `MLP` (column, row, column, row)."""
    x = _x(5)
    if which == "block":
        kw = dict(mlp_size=F, num_kv_heads=2, use_rope=True)
        ref, tp, params, _ = _pair(
            lambda g, r: bx.TransformerBlock(g, D, N, r, **kw),
            lambda g, r: bx.TransformerBlock(g, D, N, r, tp_axis="model", **kw),
            x,
        )
        rules = bp.transformer_tp_rules(shard_kv=False) + [("rng/(seed|counter)", None)]
        call_kw = dict(is_causal=True, is_training=False, positions=jnp.arange(T) + 3)
    else:
        g1, g2 = bx.Graph("net"), bx.Graph("net")
        r1, r2 = bx.Rng(g1 / "rng"), bx.Rng(g2 / "rng")
        sizes = (F, D, F, D)
        ref = bx.MLP(g1 / "mlp", sizes, r1, activation=jnp.tanh)
        tp = bx.MLP(g2 / "mlp", sizes, r2, activation=jnp.tanh, tp_axis="model")
        params = ref(r1.seed(bx.Params(), seed=0), x)[1].locked()
        rules, call_kw = MLP_RULES, {}
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    with jax.default_matmul_precision("highest"):
        f, ps, put, cot = _sharded_call(tp, params, mesh, rules, call_kw)
        y, grads = f(ps, put(x), put(cot))
        _check(ref, params, x, call_kw, y, grads, cot)
    if which == "mlp":  # two row-split layers: two all-reduces in forward
        specs = bp.param_specs(params, rules, mesh)
        g = jax.shard_map(
            lambda p, x: tp(p, x)[0], mesh=mesh, in_specs=(specs, P("data")), out_specs=P("data")
        )
        assert _count_all_reduce(g, ps, put(x)) == 2


def test_tp_mode_misuse_names_the_layer_the_axis_and_the_fix():
    """A tp_axis the enclosing shard_map's mesh lacks, heads the axis does not divide,
    an odd tensor-parallel MLP, decoding inside the shard_map, an unknown split and an
    out_sharding inside the shard_map raise, each naming the layer's path."""
    x = _x()
    g = bx.Graph("net")
    r = bx.Rng(g / "rng")
    params = r.seed(bx.Params(), seed=0)
    layers = {
        "typo": bx.MultiHeadAttention(g / "typo", D, N, r, tp_axis="mdl"),
        "fc": bx.Linear(g / "fc", 8, r, tp_axis="mdl"),
        "two": bx.MultiHeadAttention(g / "two", D, 2, r, tp_axis="model"),
        "cache": bx.MultiHeadAttention(g / "cache", D, N, r, tp_axis="model"),
        "col": bp.ColumnParallelLinear(g / "col", 8, r),
    }
    for layer in layers.values():  # global mode (no shard_map): every tp_axis is fine
        params = layer(params, x)[1]
    params = params.locked()
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    rep = bp.param_specs(params, [(".*", None)])
    ps = jax.device_put(params, NamedSharding(mesh, P()))
    xs = jax.device_put(x, NamedSharding(mesh, P("data")))

    def traced(fn):  # the errors come at trace time: nothing compiles
        f = jax.shard_map(fn, mesh=mesh, in_specs=(rep, P("data")), out_specs=P("data"))
        return jax.jit(f).trace(ps, xs)

    axes = r"\(axes \('data', 'model'\)\)"
    with pytest.raises(
        ValueError,
        match=r"MultiHeadAttention 'net/typo': tp_axis='mdl' is not an axis of the enclosing "
        rf"jax.shard_map's mesh {axes}, so the layer cannot split its heads over it\. Build "
        r"the layer with tp_axis set to the mesh's model axis \(one of \('data', 'model'\)\)",
    ):
        traced(lambda p, x: layers["typo"](p, x)[0])
    with pytest.raises(
        ValueError, match=rf"Linear 'net/fc': tp_axis='mdl' is not an axis .* mesh {axes}"
    ):
        traced(lambda p, x: layers["fc"](p, x)[0][..., :D] + x)
    with pytest.raises(
        ValueError,
        match=r"MultiHeadAttention 'net/two': num_heads = 2 is not divisible by the size 4 "
        r"of model axis 'model'.*Use num_heads in multiples of 4 or a model axis dividing 2",
    ):
        traced(lambda p, x: layers["two"](p, x)[0])
    with pytest.raises(
        ValueError,
        match=r"'net/cache': decode=True inside jax.shard_map over tp_axis 'model' is not "
        r"supported.*Decode outside the shard_map",
    ):
        traced(lambda p, x: layers["cache"](p, x, decode=True)[0])
    with pytest.raises(ValueError, match=r"ColumnParallelLinear 'net/col': out_sharding has no"):
        traced(lambda p, x: layers["col"](p, x, out_sharding=P())[0][..., :D] + x)
    with pytest.raises(
        ValueError,
        match=r"MLP 'net/odd': with tp_axis='model' the layers alternate column- and "
        r"row-split, so their number must be even; got output_sizes=\(8, 4, 2\)",
    ):
        bx.MLP(g / "odd", (8, 4, 2), r, tp_axis="model")
    with pytest.raises(
        ValueError,
        match=r"Linear 'net/bad': tp_split must be one of \('column', 'row', 'replicated'\), "
        r"got 'rows'",
    ):
        bx.Linear(g / "bad", 8, r, tp_axis="model", tp_split="rows")
