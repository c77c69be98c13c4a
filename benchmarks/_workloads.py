"""Workload builders shared by blox and the jax-blox peer.

Nothing here imports blox: each builder takes the library module (``bx``) as an
argument and uses only the API the two share (`Graph`, `Rng`, `Linear`, `Module`,
`Param`, `Params` with ``split``/``merge``/``locked``), so ``core_overhead.py`` passes
blox and ``jax_blox_peer.py`` (another venv) passes jax-blox, with identical code.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import _raw
import _timing
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import Contender, Pair

__all__ = [
    "Built",
    "Config",
    "assert_same_step",
    "build_deep",
    "build_mlp",
    "build_roundtrip",
    "build_train",
    "fresh_states",
    "raw_dict",
    "split_merge_step",
    "stack_class",
]


@dataclass
class Config:
    rounds: int
    steps: int
    warmup: int
    quick: bool
    interleave: bool = True


@dataclass
class Built:
    """What a workload builder returns: the timed contenders and their comparisons."""

    contenders: list[Contender]
    pairs: list[Pair]
    checks: list[str] = field(default_factory=list)
    flops: list[tuple[str, float, float]] = field(default_factory=list)
    # Optional per-round micro-benchmark: [(name, library value, dict value, target)].
    micro: Callable[[], list[tuple[str, float, float, float | None]]] | None = None


# ---------------------------------------------------------------------------
# Train steps
# ---------------------------------------------------------------------------


def split_merge_step(model: Any, tx: optax.GradientTransformation):
    """The documented blox train step: split, grad w.r.t. the trainable half, merge."""

    def loss_fn(t, nt, x, y):
        y_hat, p = model(t.merge(nt), x)
        return _raw.mse(y_hat, y), p.split()[1]

    def step(params, opt_state, x, y):
        t, nt = params.split()
        (loss, nt2), g = jax.value_and_grad(loss_fn, has_aux=True)(t, nt, x, y)
        updates, opt_state = tx.update(g, opt_state, t)
        t = optax.apply_updates(t, updates)
        return t.merge(nt2), opt_state, loss

    return step


def raw_step_with_rng(names: Sequence[str], tx: optax.GradientTransformation):
    """The raw step, also passing an Rng-state dict (seed, counter) through unchanged."""
    inner = _raw.train_step(names, tx)

    def step(p, opt_state, x, y, rng_state):
        p, opt_state, loss = inner(p, opt_state, x, y)
        return p, opt_state, loss, rng_state

    return step


def stepper(name: str, step: Callable, params: Any, opt_state: Any, x, y, extra=None):
    """A `Contender` that threads (params, opt_state[, extra]) through `step`."""
    state = [params, opt_state, extra]
    if extra is None:

        def call():
            state[0], state[1], loss = step(state[0], state[1], x, y)
            return loss

    else:

        def call():
            state[0], state[1], loss, state[2] = step(state[0], state[1], x, y, state[2])
            return loss

    return Contender(name, call)


def raw_dict(params: Any, paths: Mapping[str, tuple[str, ...]]) -> dict[str, jax.Array]:
    """Copies of the library `params` values at ``paths[k]``, as a raw dict keyed ``k``."""
    return {k: jnp.array(params[path].value, copy=True) for k, path in paths.items()}


def fresh_states(
    tx: optax.GradientTransformation, params: Any, raw: dict[str, jax.Array]
) -> tuple[Callable[..., tuple[Any, Any]], Callable[[], tuple[Any, Any]]]:
    """``(b_state, r_state)``: each call gives a fresh ``(params, opt_state)``.

    ``b_state(p=params)`` copies the library params `p` (``tx`` state of their trainable
    half), ``r_state()`` the `raw` dict; fresh buffers, so one copy can be donated.
    """

    def b_state(p: Any = params) -> tuple[Any, Any]:
        p = _raw.copy_tree(p)
        return p, tx.init(p.split()[0])

    def r_state() -> tuple[Any, Any]:
        p = _raw.copy_tree(raw)
        return p, tx.init(p)

    return b_state, r_state


def assert_same_step(
    b_step: Callable,
    r_step: Callable,
    b_state: Callable[[], tuple[Any, Any]],
    r_state: Callable[[], tuple[Any, Any]],
    x: Any,
    y: Any,
    paths: Mapping[str, tuple[str, ...]],
) -> tuple[float, float, float]:
    """Runs one step of each side from fresh states; asserts the same math (to 1e-6).

    Equal first losses, and equal weights after the step: raw key ``k`` against the
    library params at ``paths[k]``. Returns (library loss, raw loss, max |weight diff|).
    """
    bp, _, b_loss = b_step(*b_state(), x, y)
    rp, _, r_loss = r_step(*r_state(), x, y)
    b_loss, r_loss = float(b_loss), float(r_loss)
    np.testing.assert_allclose(b_loss, r_loss, rtol=1e-6, atol=1e-6)
    w_diff = max(float(jnp.max(jnp.abs(bp[path].value - rp[k]))) for k, path in paths.items())
    assert w_diff <= 1e-6, w_diff
    return b_loss, r_loss, w_diff


def stack_class(bx: ModuleType) -> type:
    """A ``bx.Module`` of ``bx.Linear`` children ``linear_<i>`` with ReLU between them."""

    class Stack(bx.Module):
        def __init__(self, graph, sizes: Sequence[int], rng):
            super().__init__(graph)
            self.layers = [
                bx.Linear(graph.child(f"linear_{i}"), size, rng) for i, size in enumerate(sizes)
            ]

        def __call__(self, params, x):
            last = len(self.layers) - 1
            for i, layer in enumerate(self.layers):
                x, params = layer(params, x)
                if i < last:
                    x = jax.nn.relu(x)
            return x, params

    return Stack


def build_train(
    bx: ModuleType,
    key: str,
    make_model: Callable[[Any, Any], Any],
    model_path: tuple[str, ...],
    num_layers: int,
    d_in: int,
    d_out: int,
    batch_size: int,
    target: float | None,
    lib: str = "blox",
) -> Built:
    """A train-step workload: the `bx` model vs raw JAX, plain and donated.

    `make_model(graph, rng)` builds the model under ``graph``; its layers must be
    ``bx.Linear`` modules at ``model_path + ('linear_<i>',)``.
    """
    names = [f"linear_{i}" for i in range(num_layers)]
    x, y = _raw.batch(batch_size, d_in, d_out)
    tx = optax.adam(1e-3)

    # Library: Graph + Rng + modules; init by seed + forward, then lock.
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    model = make_model(g, rng)
    params = bx.Params()
    params = rng.seed(params, seed=0)
    _, params = model(params, x)
    params = params.locked()
    b_step = split_merge_step(model, tx)

    # Raw: the same initial values in a {str: array} dict.
    paths = {f"{n}/{w}": (*model_path, n, w) for n in names for w in ("kernel", "bias")}
    raw = raw_dict(params, paths)
    r_step = _raw.train_step(names, tx)
    n_train = len(params.split()[0])
    assert n_train == len(raw), (n_train, len(raw))

    b_jit, r_jit = jax.jit(b_step), jax.jit(r_step)
    b_don = jax.jit(b_step, donate_argnums=(0, 1))
    r_don = jax.jit(r_step, donate_argnums=(0, 1))

    b_state, r_state = fresh_states(tx, params, raw)

    # Same math: the first loss and the weights after one Adam step.
    b_loss, r_loss, w_diff = assert_same_step(b_jit, r_jit, b_state, r_state, x, y, paths)
    checks = [
        f"{key}: first loss: {lib} {b_loss:.9g}, raw {r_loss:.9g} "
        f"(|diff| {abs(b_loss - r_loss):.1e}); max |weight diff| after one Adam step "
        f"{w_diff:.1e}; leaves: {lib} {len(params)} ({n_train} trainable + Rng seed and "
        f"counter), raw {len(raw)}"
    ]
    flops = [(key, _timing.flops(b_jit, *b_state(), x, y), _timing.flops(r_jit, *r_state(), x, y))]

    # Diagnostics (donated), to locate a gap: "raw+rng" also passes the same Rng seed
    # (blox: uint32 key data; jax-blox: a typed key) and counter through the raw step;
    # "<lib>-rng" drops the Rng state from the params (the forward pass does not use it
    # once initialised).
    rng_state = {
        "seed": params[("net", "rng", "seed")].value,
        "counter": params[("net", "rng", "counter")].value,
    }
    rr_don = jax.jit(raw_step_with_rng(names, tx), donate_argnums=(0, 1, 4))
    no_rng = params.split(lambda path, _: path[:2] != ("net", "rng"))[0]

    b_don_norng = jax.jit(b_step, donate_argnums=(0, 1))
    contenders = [
        stepper(lib, b_jit, *b_state(), x, y),
        stepper("raw", r_jit, *r_state(), x, y),
        stepper(f"{lib}+donate", b_don, *b_state(), x, y),
        stepper("raw+donate", r_don, *r_state(), x, y),
        stepper("raw+rng+donate", rr_don, *r_state(), x, y, _raw.copy_tree(rng_state)),
        # Its own jit object, so that no contender's cache holds two structures.
        stepper(f"{lib}-rng+donate", b_don_norng, *b_state(no_rng), x, y),
    ]
    pairs = [
        Pair(f"{key} step", lib, "raw", target),
        Pair(f"{key} step, donated", f"{lib}+donate", "raw+donate", target),
        Pair(
            f"{key} diag: {lib} / raw passing the same Rng leaves, donated",
            f"{lib}+donate",
            "raw+rng+donate",
        ),
        Pair(
            f"{key} diag: {lib} without Rng leaves / raw, donated",
            f"{lib}-rng+donate",
            "raw+donate",
        ),
    ]
    return Built(contenders, pairs, checks, flops)


def build_mlp(bx: ModuleType, mlp: type, target: float | None, lib: str = "blox") -> Built:
    """Workload (a): MLP 32->64->64->10, ``mlp(graph, (64, 64, 10), rng)``, batch 32."""
    return build_train(
        bx,
        "(a) MLP",
        lambda g, rng: mlp(g / "mlp", (64, 64, 10), rng),
        ("net", "mlp"),
        num_layers=3,
        d_in=32,
        d_out=10,
        batch_size=32,
        target=target,
        lib=lib,
    )


def build_deep(bx: ModuleType, cfg: Config, target: float | None, lib: str = "blox") -> Built:
    """Workload (b): 64 (quick: 4) ``bx.Linear`` children of width 32, batch 32."""
    depth = 4 if cfg.quick else 64
    stack = stack_class(bx)
    return build_train(
        bx,
        f"(b) {depth} Linear",
        lambda g, rng: stack(g / "deep", (32,) * depth, rng),
        ("net", "deep"),
        num_layers=depth,
        d_in=32,
        d_out=32,
        batch_size=32,
        target=target,
        lib=lib,
    )


# ---------------------------------------------------------------------------
# jit round trip and pytree flatten / unflatten
# ---------------------------------------------------------------------------


def build_roundtrip(bx: ModuleType, n: int, cfg: Config, target: float | None) -> Built:
    """``jax.jit(identity)`` of an n-leaf ``bx.Params`` vs an n-entry ``dict[str, array]``.

    Also a per-round micro-benchmark of ``tree_flatten`` / ``tree_unflatten`` (us/leaf).
    """
    kinds = ("kernel", "bias", "scale")
    paths = [("net", f"block_{i // 3:03d}", kinds[i % 3]) for i in range(n)]
    params = bx.Params()
    for i, path in enumerate(paths):
        params[path] = bx.Param(jnp.full((4,), i, jnp.float32))
    params = params.locked()
    d = {"/".join(p[1:]): jnp.full((4,), i, jnp.float32) for i, p in enumerate(paths)}
    p0, d0 = paths[0], "/".join(paths[0][1:])

    f_p = jax.jit(lambda p: p)
    f_d = jax.jit(lambda p: p)
    sp, sd = [params], [d]

    def call_p():
        sp[0] = f_p(sp[0])
        return sp[0][p0].value  # O(1): one leaf; every output comes from one executable

    def call_d():
        sd[0] = f_d(sd[0])
        return sd[0][d0]

    out = f_p(params)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(params)
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(d), strict=True):
        assert bool(jnp.all(a == b))

    p_leaves, p_def = jax.tree_util.tree_flatten(params)
    d_leaves, d_def = jax.tree_util.tree_flatten(d)
    number = 20 if cfg.quick else 2000

    def per_leaf(fn):
        return _timing.per_call_us(fn, number, 5) / n

    def micro():
        return [
            (
                "tree_flatten",
                per_leaf(lambda: jax.tree_util.tree_flatten(params)),
                per_leaf(lambda: jax.tree_util.tree_flatten(d)),
                0.1,
            ),
            (
                "tree_unflatten",
                per_leaf(lambda: jax.tree_util.tree_unflatten(p_def, p_leaves)),
                per_leaf(lambda: jax.tree_util.tree_unflatten(d_def, d_leaves)),
                0.05,
            ),
        ]

    return Built(
        [Contender("Params", call_p), Contender("dict", call_d)],
        [Pair(f"(c) jit identity, {n} leaves", "Params", "dict", target)],
        [f"(c): {n} leaves of shape (4,) float32; each call waits for one output leaf"],
        micro=micro,
    )


# ---------------------------------------------------------------------------
# Running a workload
# ---------------------------------------------------------------------------


@dataclass
class Micro:
    """A pure-Python micro-benchmark: library vs dict, per leaf, with an absolute target."""

    name: str
    lib_us: float
    dict_us: float
    target: float | None

    @property
    def verdict(self) -> str:
        if self.target is None:
            return "info"
        return "PASS" if self.lib_us <= self.target else "FAIL"


@dataclass
class Outcome:
    """Everything measured for a set of workloads (JSON-able via `dataclasses.asdict`)."""

    pairs: list[Pair] = field(default_factory=list)
    micros: list[Micro] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    flops: list[tuple[str, float, float]] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict) -> Outcome:
        return cls(
            [Pair(**p) for p in d["pairs"]],
            [Micro(**m) for m in d["micros"]],
            list(d["checks"]),
            [tuple(f) for f in d["flops"]],
        )


def run(built: Built, cfg: Config, out: Outcome, log: Callable[[str], None]) -> None:
    """Times `built` (same-round ratios) and appends the results to `out`."""
    out.checks += built.checks
    out.flops += built.flops
    results = _timing.run_rounds(
        built.contenders, cfg.rounds, cfg.steps, cfg.warmup, cfg.interleave
    )
    for p in _timing.compare(results, built.pairs):
        out.pairs.append(p)
        target = "" if p.target is None else f" target <= {p.target:.2f}x {p.verdict}"
        log(
            f"   {p.name}: {p.num_us:.1f} vs {p.den_us:.1f} us/call, ratio "
            f"{p.median_ratio:.3f}x (min-based {p.min_ratio:.3f}x){target}; per round: "
            + " ".join(f"{r:.3f}" for r in p.round_ratios)
        )
    if built.micro is not None:
        rows = [built.micro() for _ in range(cfg.rounds)]
        for i, (name, _, _, target) in enumerate(rows[0]):
            m = Micro(
                name,
                statistics.median(r[i][1] for r in rows),
                statistics.median(r[i][2] for r in rows),
                target,
            )
            out.micros.append(m)
            log(
                f"   {m.name}: Params {m.lib_us:.4f} us/leaf, dict {m.dict_us:.4f} us/leaf "
                f"(target <= {m.target}) {m.verdict}"
            )
