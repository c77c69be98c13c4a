"""Parallel steps: blox.parallel helpers vs the same steps written by hand (8 devices).

Run (``make bench``)::

    .venv/bin/python benchmarks/parallel_speed.py --out docs/benchmarks.md

On CPU the script simulates 8 devices (``XLA_FLAGS=--xla_force_host_platform_device_count=8``).

(a) DP train step of ``examples/dp_classifier.py``'s CNN (batch 64 of 8x8x1, conv 32 ->
    pool -> conv 64 -> pool -> dense 10, softmax cross-entropy, Adam) on an 8-device data
    mesh: ``bp.make_dp_train_step`` on `bx.Params` against a hand-written
    ``jax.shard_map`` (params cast to varying, local gradients, ``lax.pmean``) on a
    ``{str: array}`` dict, Adam outside the ``shard_map`` in both.
(b) TP transformer block, forward and backward (gradients of ``sum(y * c)``), on a
    ``data 2 x model 4`` mesh: ``bp.ParallelTransformerBlock`` inside ``jax.shard_map``
    against the same Megatron block by hand (local heads, ``lax.psum`` after each
    row-parallel matmul) on a dict.

(c) FSDP train step of an MLP (L x Linear -> tanh, MSE, Adam) on an 8-device data mesh:
    ``bp.make_fsdp_train_step`` (params and Adam state sharded by ``bp.fsdp_specs``,
    each layer gathered in ``bp.fsdp_call``, with ``remat`` False, True and 'weights')
    against the same model under ``jax.jit`` with the same FSDP shardings on an Auto mesh,
    XLA inserting the collectives (GSPMD), and against plain DP (``make_dp_train_step``,
    replicated). Per-device memory (arguments + outputs - aliases + temporaries, from
    ``compiled.memory_analysis()``) for all.

Before timing, the script asserts the same math (first loss and weights after one step;
block outputs and gradients). Timing is same-round and interleaved (``_timing.py``);
targets (<= 1.05x) are on the ratio of per-round minima; the median ratio is reported too.
"""

from __future__ import annotations

import argparse
import os
import sys

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import _timing  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _timing import Contender, CountArgs, Pair, log  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import blox as bx  # noqa: E402
from blox import parallel as bp  # noqa: E402

TARGET = 1.05
COUNTS = CountArgs(steps=30, warmup=3, quick_steps=2, quick_warmup=1)


# ---------------------------------------------------------------------------
# (a) DP classifier step
# ---------------------------------------------------------------------------


class CNN(bx.Module):
    def __init__(self, graph, rng):
        super().__init__(graph)
        self.conv1 = bx.Conv(graph / "conv1", (3, 3), 32, rng)
        self.conv2 = bx.Conv(graph / "conv2", (3, 3), 64, rng)
        self.head = bx.Linear(graph / "head", 10, rng)

    def __call__(self, params, x):
        x, params = self.conv1(params, x)
        x = bx.max_pool(jax.nn.relu(x), (2, 2))
        x, params = self.conv2(params, x)
        x = bx.max_pool(jax.nn.relu(x), (2, 2))
        return self.head(params, x.reshape(x.shape[0], -1))


def raw_cnn(p, x):
    dn = ("NHWC", "HWIO", "NHWC")
    for name in ("conv1", "conv2"):
        x = lax.conv_general_dilated(x, p[name + "/kernel"], (1, 1), "SAME", dimension_numbers=dn)
        x = jax.nn.relu(x + p[name + "/bias"])
        x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    return jnp.dot(x.reshape(x.shape[0], -1), p["head/kernel"]) + p["head/bias"]


def ce(logits, y):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y))


def build_dp(batch: int):
    mesh = bp.make_mesh((8,), ("data",))
    r = np.random.default_rng(0)
    x = jnp.asarray(r.random((batch, 8, 8, 1), dtype=np.float32))
    y = jnp.asarray(r.integers(0, 10, size=(batch,)), jnp.int32)
    tx = optax.adam(1e-3)
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    model = CNN(g / "cnn", rng)
    params = model(rng.seed(bx.Params(), seed=0), x[:2])[1].locked()
    rep = NamedSharding(mesh, P())
    data = NamedSharding(mesh, P("data"))
    names = [f"{n}/{w}" for n in ("conv1", "conv2", "head") for w in ("kernel", "bias")]

    def loss_fn(p, x, y):
        logits, p = model(p, x)
        return ce(logits, y), p

    b_step = jax.jit(bp.make_dp_train_step(loss_fn, tx, mesh))

    def raw_grads(p, x, y):
        p = jax.lax.pcast(p, "data", to="varying")  # local gradients (check_vma=True)
        loss, g = jax.value_and_grad(lambda p: ce(raw_cnn(p, x), y))(p)
        return jax.lax.pmean((loss, g), "data")

    def r_step_fn(p, opt_state, x, y):
        loss, g = jax.shard_map(raw_grads, mesh=mesh, in_specs=(P(), P("data"), P("data")),
                                out_specs=P())(p, x, y)  # fmt: skip
        updates, opt_state = tx.update(g, opt_state, p)
        return optax.apply_updates(p, updates), opt_state, {"loss": loss}

    r_step = jax.jit(r_step_fn)

    def b_state():
        p = jax.device_put(jax.tree.map(jnp.copy, params), rep)
        return p, jax.device_put(tx.init(params.split()[0]), rep)

    def r_state():
        p = {k: jnp.array(params[("net", "cnn", *k.split("/"))].value) for k in names}
        p = jax.device_put(p, rep)
        return p, jax.device_put(tx.init(p), rep)

    xs, ys = jax.device_put(x, data), jax.device_put(y, data)
    pb, ob = b_state()
    pr, orr = r_state()
    pb, _, mb = b_step(pb, ob, xs, ys)
    pr, _, mr = r_step(pr, orr, xs, ys)
    diff = max(
        float(jnp.max(jnp.abs(pb[("net", "cnn", *k.split("/"))].value - pr[k]))) for k in names
    )
    lb, lr = float(mb["loss"]), float(mr["loss"])
    assert abs(lb - lr) <= 1e-6 * abs(lr) and diff <= 1e-6, (lb, lr, diff)
    check = (f"(a) first loss: blox {lb:.9g}, by hand {lr:.9g}; max |weight diff| after one "
             f"Adam step {diff:.1e}")  # fmt: skip
    return [_stateful("dp blox", b_step, b_state, xs, ys),
            _stateful("dp hand", r_step, r_state, xs, ys)], check  # fmt: skip


def _stateful(name, step, state, x, y):
    s = list(state())

    def call():
        s[0], s[1], m = step(s[0], s[1], x, y)
        return m["loss"]

    return Contender(name, call)


# ---------------------------------------------------------------------------
# (b) TP transformer block, forward + backward
# ---------------------------------------------------------------------------


def build_tp(batch: int, width: int, heads: int, seq: int):
    mesh = bp.make_mesh((2, 4), ("data", "model"))
    m = 4
    r = np.random.default_rng(1)
    x = jnp.asarray(r.normal(size=(batch, seq, width)), jnp.float32)
    c = jnp.asarray(r.normal(size=(batch, seq, width)), jnp.float32)
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    block = bp.ParallelTransformerBlock(g / "block", model_size=width, num_heads=heads, rng=rng)
    params = block(rng.seed(bx.Params(), seed=0), x[:1], is_training=False)[1].locked()
    rules = bp.transformer_tp_rules() + [("rng/(seed|counter)", None)]
    specs = bp.param_specs(params, rules, mesh)
    t_specs = specs.split()[0]
    ps = jax.device_put(params, bp.param_shardings(params, rules, mesh))
    data = NamedSharding(mesh, P("data"))
    xs, cs = jax.device_put(x, data), jax.device_put(c, data)

    def b_body(p, x, c):
        t, nt = p.split()

        def loss(t):
            y = block(t.merge(nt), x, is_causal=True, is_training=False)[0]
            return jnp.sum(y * c)

        loss, grads = jax.value_and_grad(loss)(t)
        return loss[None], grads

    b_fn = jax.jit(jax.shard_map(b_body, mesh=mesh, in_specs=(specs, P("data"), P("data")),
                                 out_specs=(P("data"), t_specs)))  # fmt: skip

    # By hand on a dict with the same local shards.
    keys = [k for k in params.split()[0].keys()]
    raw = {"/".join(k[2:]): ps[k].value for k in keys}
    raw_specs = {"/".join(k[2:]): t_specs[k].value for k in keys}
    h = width // heads

    def ln(p, name, x):
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
        return (x - mu) * lax.rsqrt(var + 1e-5) * p[name + "/scale"] + p[name + "/bias"]

    def dense(p, name, x):
        return jnp.dot(x, p[name + "/kernel"]) + p[name + "/bias"]

    def row(p, name, x):
        return lax.psum(jnp.dot(x, p[name + "/kernel"]), "model") + p[name + "/bias"]

    def raw_block(p, x):
        b, t, _ = x.shape
        a = ln(p, "norm1", x)
        q = dense(p, "attn/query", a).reshape(b, t, heads // m, h)
        k = dense(p, "attn/key", a).reshape(b, t, heads // m, h)
        v = dense(p, "attn/value", a).reshape(b, t, heads // m, h)
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, -1)
        x = x + row(p, "attn/out", o)
        a = jax.nn.gelu(dense(p, "mlp/linear_0", ln(p, "norm2", x)))
        return x + row(p, "mlp/linear_1", a)

    def r_body(p, x, c):
        loss, grads = jax.value_and_grad(lambda p: jnp.sum(raw_block(p, x) * c))(p)
        return loss[None], grads

    r_fn = jax.jit(jax.shard_map(r_body, mesh=mesh, in_specs=(raw_specs, P("data"), P("data")),
                                 out_specs=(P("data"), raw_specs)))  # fmt: skip
    lb, gb = b_fn(ps, xs, cs)
    lr, gr = r_fn(raw, xs, cs)
    lb, lr = np.asarray(lb).sum(), np.asarray(lr).sum()
    gdiff = max(float(jnp.max(jnp.abs(gb[k].value - gr["/".join(k[2:])]))) for k in keys)
    assert abs(lb - lr) <= 1e-4 * abs(lr) + 1e-4 and gdiff <= 1e-4, (lb, lr, gdiff)
    hlo_b = b_fn.lower(ps, xs, cs).as_text().count("stablehlo.all_reduce")
    hlo_r = r_fn.lower(raw, xs, cs).as_text().count("stablehlo.all_reduce")
    check = (
        f"(b) sum of per-shard losses: blox {lb:.6g}, by hand {lr:.6g}; max |grad diff| "
        f"{gdiff:.1e}; all-reduces in the lowered fwd+bwd: blox {hlo_b}, by hand {hlo_r}"
    )
    return [Contender("tp blox", lambda: b_fn(ps, xs, cs)[0]),
            Contender("tp hand", lambda: r_fn(raw, xs, cs)[0])], check  # fmt: skip


# ---------------------------------------------------------------------------
# (c) FSDP train step
# ---------------------------------------------------------------------------


class MLP(bx.Module):
    def __init__(self, graph, width, layers, rng, remat):
        super().__init__(graph)
        self.layers = [bx.Linear(graph / f"fc_{i}", width, rng) for i in range(layers)]
        self.remat = remat

    def __call__(self, params, x):
        for fc in self.layers:
            x, params = bp.fsdp_call(fc, params, x, remat=self.remat)
            x = jnp.tanh(x)
        return x, params


def _device_bytes(jitted, *args) -> int:
    m = jitted.lower(*args).compile().memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
            + m.temp_size_in_bytes)  # fmt: skip


def build_fsdp(batch: int, width: int, layers: int):
    tx = optax.adam(1e-3)
    r = np.random.default_rng(2)
    x = jnp.asarray(r.normal(size=(batch, width)), jnp.float32)
    y = jnp.asarray(r.normal(size=(batch, width)), jnp.float32)
    is_spec = lambda s: isinstance(s, P)  # noqa: E731
    out, checks = [], []
    first = {}
    modes = [("fsdp blox", False, "fsdp"), ("fsdp blox remat", True, "fsdp"),
             ("fsdp blox weights", "weights", "fsdp"),
             ("fsdp gspmd", False, "gspmd"), ("mlp dp blox", False, "dp")]  # fmt: skip
    for name, remat, mode in modes:
        g = bx.Graph("net")
        rng = bx.Rng(g / "rng")
        model = MLP(g / "mlp", width, layers, rng, remat)

        def init(model=model, rng=rng):
            return model(rng.seed(bx.Params(), seed=0), x[:1])[1].locked()

        def loss_fn(p, x, y, model=model):
            out, p = model(p, x)
            return jnp.mean((out - y) ** 2), p

        mesh = bp.make_mesh((8,), ("data",), axis_types="auto" if mode == "gspmd" else None)
        abstract = jax.eval_shape(init)
        specs = (bp.fsdp_specs(abstract, mesh) if mode != "dp"
                 else jax.tree.map(lambda _: P(), abstract))  # fmt: skip
        shard = jax.tree.map(lambda s, m=mesh: NamedSharding(m, s), specs, is_leaf=is_spec)
        opt_sh = bp.opt_state_shardings(jax.eval_shape(tx.init, abstract.split()[0]), specs, mesh)
        if mode == "fsdp":
            fn = bp.make_fsdp_train_step(loss_fn, tx, mesh, specs)
        elif mode == "dp":
            fn = bp.make_dp_train_step(loss_fn, tx, mesh)
        else:

            def fn(p, o, x, y, loss_fn=loss_fn):  # global view; XLA partitions it
                t, nt = p.split()
                (loss, _), g = jax.value_and_grad(lambda t: loss_fn(t.merge(nt), x, y),
                                                  has_aux=True)(t)  # fmt: skip
                updates, o = tx.update(g, o, t)
                return optax.apply_updates(t, updates).merge(nt), o, {"loss": loss}

        data = NamedSharding(mesh, P("data"))
        step = jax.jit(fn, in_shardings=(shard, opt_sh, data, data),
                       out_shardings=(shard, opt_sh, None), donate_argnums=(0, 1))  # fmt: skip
        xs, ys = jax.device_put(x, data), jax.device_put(y, data)

        def state(init=init, shard=shard, opt_sh=opt_sh):
            p = jax.jit(init, out_shardings=shard)()
            return p, jax.jit(tx.init, out_shardings=opt_sh)(p.split()[0])

        p, o = state()
        mem = _device_bytes(step, p, o, xs, ys)
        p, o, m = step(p, o, xs, ys)
        first[name] = (float(m["loss"]), np.asarray(p[("net", "mlp", "fc_0", "kernel")].value))
        checks.append(f"{name}: {mem / 2**20:.2f} MiB per device")
        out.append(_stateful(name, step, state, xs, ys))
    ref_loss, ref_w = first["mlp dp blox"]
    diff = max(float(np.max(np.abs(w - ref_w))) for _, w in first.values())
    assert all(abs(v - ref_loss) <= 1e-5 * abs(ref_loss) for v, _ in first.values()), first
    assert diff <= 1e-5, diff
    check = (f"(c) first loss {ref_loss:.9g} in all five; max |fc_0 kernel diff| after one Adam "
             f"step {diff:.1e}; per-device memory: " + "; ".join(checks))  # fmt: skip
    return out, check


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    COUNTS.add_to(ap, quick_help="tiny counts and shapes (smoke test)")
    args = ap.parse_args(argv)
    rounds, steps, warmup = COUNTS.resolve(ap, args)
    started, env, command = _timing.start_run("blox parallel speed")
    if len(jax.devices()) < 8:
        log("needs 8 devices")
        return 1
    batch = 16 if args.quick else 64
    width, heads, seq, tb = (32, 4, 8, 4) if args.quick else (128, 8, 64, 8)
    with jax.default_matmul_precision("highest"):
        dp, c1 = build_dp(batch)
        tp, c2 = build_tp(tb, width, heads, seq)
        fw, fl = (64, 2) if args.quick else (512, 8)
        fsdp, c3 = build_fsdp(batch, fw, fl)
        log(c1)
        log(c2)
        log(c3)
        results = _timing.run_rounds(dp + tp + fsdp, rounds, steps, warmup)
    pairs = _timing.compare(results, [Pair("(a) DP train step, 8 devices", "dp blox", "dp hand",
                                           TARGET),
                                      Pair("(b) TP block fwd+bwd, 2x4 mesh", "tp blox", "tp hand",
                                           TARGET),
                                      Pair("(c) FSDP step vs GSPMD (jit, same shardings)",
                                           "fsdp blox", "fsdp gspmd", TARGET),
                                      Pair("(c) FSDP step with backward re-gather vs GSPMD",
                                           "fsdp blox remat", "fsdp gspmd", None),
                                      Pair("(c) FSDP step, remat='weights' (the default) vs "
                                           "GSPMD", "fsdp blox weights", "fsdp gspmd", None),
                                      Pair("(c) FSDP step vs plain DP", "fsdp blox",
                                           "mlp dp blox", None)])  # fmt: skip
    for p in pairs:
        log(f"{p.name}: {p.num_us:.0f} vs {p.den_us:.0f} us, ratio of minima {p.min_ratio:.3f}x, "
            f"median ratio {p.median_ratio:.3f}x")  # fmt: skip
    header = ["workload", "blox us/call", "by hand us/call", "ratio of minima",
              "ratio of medians", "per-round ratios (min - max)", "target", "verdict"]  # fmt: skip
    lines = [
        "## Parallel steps: blox.parallel vs the same by hand",
        "",
        *_timing.run_header(env, started, command),
        f"- (a) DP: `examples/dp_classifier.py`'s CNN, global batch {batch} of 8x8x1, Adam, "
        "8-device `data` mesh; blox `bp.make_dp_train_step` on `bx.Params` vs a hand-written "
        "`jax.shard_map` (params cast to varying, `lax.pmean` of loss and gradients) on a "
        "dict, Adam outside the `shard_map` in both.",
        f"- (b) TP: one pre-norm transformer block (D={width}, {heads} heads, F={4 * width}, "
        f"T={seq}, batch {tb}), causal, forward + gradients of `sum(y * c)`, on a data 2 x "
        "model 4 mesh; `bp.ParallelTransformerBlock` vs the same Megatron block by hand "
        "(local heads, `lax.psum` after each row-parallel matmul) on a dict.",
        f"- (c) FSDP: an MLP of {fl} x (Linear {fw}x{fw} -> tanh), MSE, Adam, global batch "
        f"{batch}, 8-device `data` mesh; `bp.make_fsdp_train_step` (params and Adam state "
        "sharded by `bp.fsdp_specs`, layers gathered in `bp.fsdp_call`: `remat=False` keeps "
        "the full weights for the backward, `remat=True` re-gathers them and recomputes the "
        "layer, `remat='weights'` (the default) re-gathers only the weights) vs the same "
        "model under `jax.jit` with the same shardings "
        "on an Auto mesh (XLA inserts the collectives: GSPMD) and vs `bp.make_dp_train_step` "
        "(replicated). Per-device memory of each compiled step is under 'Same math'.",
        _timing.counts_bullet(
            rounds,
            steps,
            warmup,
            "interleaved in a random order per cycle",
            "shapes and counts shrunk, numbers meaningless" if args.quick else None,
        ),  # fmt: skip
        "",
        _timing.format_table(
            header, [_timing.ratio_row(p, primary="min", us_digits=0) for p in pairs]
        ),  # fmt: skip
        "",
        "Ratio of minima: median over rounds of blox's per-round minimum over the hand-written "
        "one's (the target applies to it); ratio of medians: the same with per-round medians. "
        "8 simulated CPU devices share this machine's cores, so the times include the "
        "simulation's overhead for both contenders alike.",
        "",
        *_timing.same_math_section([c1, c2, c3]),
    ]
    _timing.publish("\n".join(lines), args.out, "parallel_speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
