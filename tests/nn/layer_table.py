"""The descriptor table of every public `blox.nn` layer, read by ``test_layer_contract.py``.

One `Descriptor` per row: how to build the layer (at ``'net/layer'``, with the `Rng` at
``'net/rng'``), how to call it, an example input, a wrong input and the error it must
raise, and the sharding rules that place its parameters on a ``('data', 'model')`` mesh.
Adding a layer means one file (the layer) plus one row here; the contract test fails
naming every public `Module` of `blox.nn` that has no row.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import blox as bx

PATH = "net/layer"  # every row builds its layer here


def _plain(layer, params, x):
    return layer(params, x)


@dataclass(frozen=True)
class Descriptor:
    """One row of the table.

    Attributes:
      name: the test id.
      cls: the public class (or function) the row covers.
      build: ``build(node, rng) -> layer`` with ``node`` at `PATH`.
      inputs: ``inputs(seed) -> pytree of NumPy arrays``, the example input.
      call: ``call(layer, params, x) -> (outputs, params)``; default ``layer(params, x)``.
      bad: a wrong input; calling with it must raise naming `PATH` and matching
        `bad_match` (None: the layer accepts every shape; `no_bad_reason` says why).
      rules: ``(pattern, spec)`` sharding rules covering every parameter of the layer
        (the test adds one replicating the `Rng`'s seed and counter).
      in_spec: the input's ``PartitionSpec`` (a pytree of them for tuple inputs).
      float_input: the input is floating (cast with the params); False for tokens.
      bf16_rtol: relative tolerance of bf16 against float32, as a fraction of the
        largest float32 output (deep stacks round more than one layer).
      stochastic: the call draws random numbers (dropout): float64 draws other bits than
        float32, so only the elements both runs keep are compared.
      eager: the reference is the eager call. False for a deep composite whose blocks
        all have rows checked eagerly (one eager pass compiles every op on its own, and
        costs minutes); its reference is then one ``jax.jit`` run.
      covers: further public classes whose ``__call__`` runs entirely inside this row's
        layer (`YOLOBackboneNeck` runs `YOLOBackbone` and `YOLONeck`), so they need no
        row of their own.
    """

    name: str
    cls: Any
    build: Callable[[bx.Graph, bx.Rng], Any]
    inputs: Callable[[int], Any]
    call: Callable = _plain
    bad: Callable[[], Any] | None = None
    bad_match: str = ""
    no_bad_reason: str = ""
    rules: tuple = ()
    in_spec: Any = field(default_factory=lambda: P("data"))
    float_input: bool = True
    bf16_rtol: float = 2e-2
    stochastic: bool = False
    eager: bool = True
    covers: tuple = ()


def normal(*shape: int) -> Callable[[int], np.ndarray]:
    return lambda seed: np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def tokens(vocab: int, *shape: int) -> Callable[[int], np.ndarray]:
    return lambda seed: np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def _apply(layer, params, x):
    return layer.apply(params, x)


def _eval(layer, params, x):
    return layer(params, x, is_training=False)


def _causal(layer, params, x):
    return layer(params, x, is_causal=True)


def _fn(f):
    """A parameter-free function as a row: ``(f(x), params)``."""
    return lambda layer, params, x: (f(x), params)


RNG = ("rng/(seed|counter)", None)  # added to every row's rules by the test
COL = (None, "model")  # a kernel's output features over 'model'
ROW = ("model", None)  # a kernel's input features over 'model'
VEC = ("model",)
CONV_OUT = (None, None, None, "model")  # a 2-D conv kernel's output channels
CONV_IN = (None, None, "model", None)
BN = ("bn/(scale|bias|running_mean|running_var)", VEC)


def _seq(node, rng):
    return bx.Sequential(
        node, [bx.Linear(node / "fc", 8, rng), jax.nn.relu, bx.Dropout(node / "drop", 0.5, rng)]
    )


def _bidirectional(node, rng):
    return bx.Bidirectional(node, bx.GRU(node / "fwd", 4, rng), bx.MGU(node / "bwd", 4, rng))


_CELL_RULES = (("(kernel|recurrent_kernel)", COL), ("(bias|recurrent_bias)", VEC))


_ATTN_RULES = (
    ("(query|key|value)/kernel", COL),
    ("(query|key|value)/bias", VEC),
    ("out/kernel", ROW),
    ("out/bias", None),
)
_BLOCK_RULES = _ATTN_RULES + (
    ("mlp/linear_0/kernel", COL),
    ("mlp/linear_0/bias", VEC),
    ("mlp/linear_1/kernel", ROW),
    ("mlp/linear_1/bias", None),
    ("norm[12]/(scale|bias)", None),
)
# Every convolution's output channels and its BatchNorm over 'model' (column-parallel
# convolutions chained: each next convolution contracts over sharded input channels).
_YOLO_RULES = (("conv/kernel", CONV_OUT), BN)


def _moe(layer, params, x):
    """The MoE output with its aux loss added, so every check also covers the router's
    losses (float32 by design: cast to the output dtype)."""
    (y, aux), params = layer(params, x)
    return y + aux["aux_loss"].astype(y.dtype), params


# Expert kernels (E, D, F) / (E, F, D): the hidden features over 'model'.
_MOE_RULES = (
    ("router/kernel", None),
    ("experts/(gate|up)", (None, None, "model")),
    ("experts/down", (None, "model", None)),
    ("shared/(gate|up)", COL),
    ("shared/down", ROW),
)

_SEQ_3 = "apply runs over a whole sequence and needs inputs of shape"
# Every channel count a multiple of 4 (the 'model' axis): C2f halves its width.
_YOLO_SMALL = dict(widths=(8, 8, 8, 16, 16), depths=(1, 1, 1, 1))

DESCRIPTORS: list[Descriptor] = [
    # -- dense ---------------------------------------------------------------------------
    Descriptor(
        "Linear",
        bx.Linear,
        lambda node, rng: bx.Linear(node, 8, rng),
        normal(4, 6),
        bad=lambda: np.ones((4, 6, 1), np.float32),
        bad_match=r"expects inputs of shape \(\.\.\., 6\)",
        rules=(("kernel", COL), ("bias", VEC)),
    ),
    Descriptor(
        "MLP",
        bx.MLP,
        lambda node, rng: bx.MLP(node, (8, 4), rng),
        normal(4, 6),
        bad=lambda: np.ones((4, 5), np.float32),
        bad_match=r"expects inputs of shape \(\.\.\., 6\)",
        rules=(
            ("linear_0/kernel", COL),
            ("linear_0/bias", VEC),
            ("linear_1/kernel", ROW),
            ("linear_1/bias", None),
        ),
    ),
    Descriptor(
        "Sequential",
        bx.Sequential,
        _seq,
        normal(4, 6),
        call=lambda layer, p, x: layer(p, x, is_training=True),
        bad=lambda: np.ones((4, 5), np.float32),
        bad_match=r"Linear 'net/layer/fc' expects inputs of shape \(\.\.\., 6\)",
        rules=(("fc/kernel", COL), ("fc/bias", VEC)),
        stochastic=True,
    ),
    Descriptor(
        "Dropout",
        bx.Dropout,
        lambda node, rng: bx.Dropout(node, 0.3, rng),
        normal(4, 8),
        no_bad_reason="dropout is elementwise: every shape is valid",
        rules=(),
        stochastic=True,
        in_spec=P("data", "model"),
    ),
    # -- convolutions --------------------------------------------------------------------
    Descriptor(
        "Conv2d",
        bx.Conv,
        lambda node, rng: bx.Conv(node, (3, 3), 8, rng, strides=2),
        normal(2, 6, 6, 3),
        bad=lambda: np.ones((6, 6), np.float32),
        bad_match=r"is 2-D .* expects inputs of shape \(\.\.\., H, W, C\)",
        rules=(("kernel", CONV_OUT), ("bias", VEC)),
    ),
    Descriptor(
        "Conv2d-row-NCHW",
        bx.Conv,
        lambda node, rng: bx.Conv(node, (3, 3), 6, rng, padding=1, channels_first=True),
        normal(2, 8, 5, 5),
        bad=lambda: np.ones((2, 5, 5, 8), np.float32),
        bad_match=r"kernel has shape \(3, 3, 8, 6\) in params, but input shape \(2, 5, 5, 8\)",
        rules=(("kernel", CONV_IN), ("bias", None)),
        in_spec=P("data", "model"),
    ),
    Descriptor(
        "Conv1d-depthwise-causal",
        bx.Conv,
        lambda node, rng: bx.Conv(node, 3, 8, rng, padding="CAUSAL", feature_group_count=4),
        normal(2, 7, 4),
        bad=lambda: np.ones((2, 7, 6), np.float32),
        bad_match=r"6 channels .* not divisible by feature_group_count=4",
        rules=(("kernel", (None, None, "model")), ("bias", VEC)),
    ),
    Descriptor(
        "ConvTranspose2d-grouped",
        bx.ConvTranspose,
        lambda node, rng: bx.ConvTranspose(node, (3, 3), 8, rng, 2, feature_group_count=2),
        normal(2, 3, 3, 4),
        bad=lambda: np.ones((2, 3, 3, 3), np.float32),
        bad_match=r"3 channels .* not divisible by feature_group_count=2",
        rules=(("kernel", (None, None, "model", None)), ("bias", VEC)),
    ),
    Descriptor(
        "ConvTranspose1d-torch-layout",
        bx.ConvTranspose,
        lambda node, rng: bx.ConvTranspose(node, 4, 4, rng, 2, transpose_kernel=True),
        normal(2, 5, 8),
        bad=lambda: np.ones((5,), np.float32),
        bad_match=r"is 1-D .* expects inputs of shape \(\.\.\., W, C\) with at least 2 axes",
        rules=(("kernel", (None, None, "model")), ("bias", None)),
        in_spec=P("data", None, "model"),
    ),
    # -- embeddings and positions --------------------------------------------------------
    Descriptor(
        "Embed",
        bx.Embed,
        lambda node, rng: bx.Embed(node, 12, 8, rng),
        tokens(12, 2, 5),
        bad=lambda: np.ones((2, 5), np.float32),
        bad_match=r"indices must be integers",
        rules=(("embedding", COL),),
        float_input=False,
    ),
    Descriptor(
        "LearnedPositionalEmbedding",
        bx.LearnedPositionalEmbedding,
        lambda node, rng: bx.LearnedPositionalEmbedding(node, 6, rng),
        normal(2, 5, 8),
        bad=lambda: np.ones((2, 7, 8), np.float32),
        bad_match=r"7 positions|length 7|T = 7|7 > ",
        rules=(("embedding", COL),),
        in_spec=P("data", None, "model"),
    ),
    Descriptor(
        "SinusoidalPositionalEncoding",
        bx.SinusoidalPositionalEncoding,
        lambda node, rng: bx.SinusoidalPositionalEncoding(node),
        normal(2, 5, 8),
        bad=lambda: np.ones((2, 5, 7), np.float32),
        bad_match=r"feature size must be even",
        rules=(),
        in_spec=P("data", None, "model"),
    ),
    # -- normalization and activations ---------------------------------------------------
    Descriptor(
        "LayerNorm",
        bx.LayerNorm,
        lambda node, rng: bx.LayerNorm(node),
        normal(4, 8),
        bad=lambda: np.ones((4, 6), np.float32),
        bad_match=r"normalizes 8 features \(scale \(8,\)\), got input shape \(4, 6\)",
        rules=(("(scale|bias)", VEC),),
        in_spec=P("data", "model"),
    ),
    Descriptor(
        "RMSNorm",
        bx.RMSNorm,
        lambda node, rng: bx.RMSNorm(node),
        normal(4, 8),
        bad=lambda: np.ones((4, 6), np.float32),
        bad_match=r"normalizes 8 features \(scale \(8,\)\), got input shape \(4, 6\)",
        rules=(("scale", VEC),),
        in_spec=P("data", "model"),
    ),
    Descriptor(
        "BatchNorm",
        bx.BatchNorm,
        lambda node, rng: bx.BatchNorm(node),
        normal(4, 3, 8),
        bad=lambda: np.ones((8,), np.float32),
        bad_match=r"has rank 1; expected rank >= 2",
        rules=(("(scale|bias|running_mean|running_var)", VEC),),
        in_spec=P("data", None, "model"),
    ),
    Descriptor(
        "BatchNorm-NCHW-eval",
        bx.BatchNorm,
        lambda node, rng: bx.BatchNorm(node, channels_first=True),
        normal(4, 8, 3),
        call=_eval,
        bad=lambda: np.ones((4, 6, 3), np.float32),
        bad_match=r"\(6,\)|6 channels|\(8,\)",
        rules=(("(scale|bias|running_mean|running_var)", VEC),),
        in_spec=P("data", "model"),
    ),
    Descriptor(
        "RunningMeanStd",
        bx.RunningMeanStd,
        lambda node, rng: bx.RunningMeanStd(node),
        normal(4, 8),
        bad=lambda: np.ones((4, 6), np.float32),
        bad_match=r"'net/layer/running_mean' is stored with shape \(8,\)",
        rules=(("running_(mean|var)", VEC), ("count", None)),
        in_spec=P("data", "model"),
    ),
    Descriptor(
        "GroupNorm",
        bx.GroupNorm,
        lambda node, rng: bx.GroupNorm(node, 2),
        normal(2, 3, 8),
        bad=lambda: np.ones((2, 3, 5), np.float32),
        bad_match=r"num_groups=2 does not divide the 5 channels",
        rules=(("(scale|bias)", VEC),),
        in_spec=P("data", None, "model"),
    ),
    Descriptor(
        "PReLU",
        bx.PReLU,
        lambda node, rng: bx.PReLU(node, 8, rng),
        normal(4, 8),
        bad=lambda: np.ones((4, 6), np.float32),
        bad_match=r"num_parameters=8 needs 8 channels on the last axis",
        rules=(("negative_slope", VEC),),
        in_spec=P("data", "model"),
    ),
    # -- attention and transformers ------------------------------------------------------
    Descriptor(
        "MultiHeadAttention",
        bx.MultiHeadAttention,
        lambda node, rng: bx.MultiHeadAttention(node, 8, 4, rng),
        normal(2, 5, 8),
        call=_causal,
        bad=lambda: np.ones((2, 5, 6), np.float32),
        bad_match=r"expects x of shape \(B, T, 8\)",
        rules=_ATTN_RULES,
    ),
    Descriptor(
        "TransformerBlock",
        bx.TransformerBlock,
        lambda node, rng: bx.TransformerBlock(node, 8, 4, rng, mlp_size=16),
        normal(2, 5, 8),
        call=_causal,
        bad=lambda: np.ones((2, 5, 6), np.float32),
        bad_match=r"LayerNorm 'net/layer/norm1' normalizes 8 features",
        rules=_BLOCK_RULES,
    ),
    Descriptor(
        "TransformerLM",
        bx.TransformerLM,
        lambda node, rng: bx.TransformerLM(node, 12, 8, 1, 4, rng, mlp_size=16),
        tokens(12, 2, 5),
        bad=lambda: np.ones((2, 5, 3), np.int32),
        bad_match=r"\(B, T\)",
        rules=_BLOCK_RULES + (("embed/embedding", COL), ("final_norm/(scale|bias)", None)),
        float_input=False,
    ),
    Descriptor(
        "MoE",
        bx.MoE,
        lambda node, rng: bx.MoE(node, 4, 8, rng, top_k=2, shared_hidden_size=8),
        normal(2, 3, 8),
        call=_moe,
        bad=lambda: np.ones((2, 3, 6), np.float32),
        bad_match=r"expects inputs of shape \(\.\.\., 8\)",
        rules=_MOE_RULES,
    ),
    # -- recurrent -----------------------------------------------------------------------
    Descriptor(
        "LSTM",
        bx.LSTM,
        lambda node, rng: bx.LSTM(node, 8, rng),
        normal(2, 5, 3),
        call=_apply,
        bad=lambda: np.ones((2, 3), np.float32),
        bad_match=_SEQ_3,
        rules=(("gates/kernel", COL), ("gates/bias", VEC)),
    ),
    Descriptor(
        "GRU",
        bx.GRU,
        lambda node, rng: bx.GRU(node, 4, rng),
        normal(2, 5, 3),
        call=_apply,
        bad=lambda: np.ones((2, 3), np.float32),
        bad_match=_SEQ_3,
        rules=_CELL_RULES,
    ),
    Descriptor(
        "SimpleRNN",
        bx.SimpleRNN,
        lambda node, rng: bx.SimpleRNN(node, 8, rng),
        normal(2, 5, 3),
        call=_apply,
        bad=lambda: np.ones((2, 3), np.float32),
        bad_match=_SEQ_3,
        rules=_CELL_RULES,
    ),
    Descriptor(
        "MGU",
        bx.MGU,
        lambda node, rng: bx.MGU(node, 4, rng),
        normal(2, 5, 3),
        call=_apply,
        bad=lambda: np.ones((2, 3), np.float32),
        bad_match=_SEQ_3,
        rules=_CELL_RULES,
    ),
    Descriptor(
        "Bidirectional",
        bx.Bidirectional,
        _bidirectional,
        normal(2, 5, 3),
        call=_apply,
        bad=lambda: np.ones((2, 3), np.float32),
        bad_match=r"\[B, T, F\]|\[B, T, \.\.\.\]|rank 3",
        rules=_CELL_RULES,
    ),
    # -- YOLO blocks ---------------------------------------------------------------------
    Descriptor(
        "ConvBNSiLU",
        bx.ConvBNSiLU,
        lambda node, rng: bx.ConvBNSiLU(node, 3, 8, rng),
        normal(2, 6, 6, 3),
        bad=lambda: np.ones((6, 6), np.float32),
        bad_match=r"is 2-D .* expects inputs",
        rules=_YOLO_RULES,
    ),
    Descriptor(
        "C2f",
        bx.C2f,
        lambda node, rng: bx.C2f(node, 8, rng, shortcut=True),
        normal(2, 6, 6, 8),
        covers=(bx.Bottleneck,),
        bad=lambda: np.ones((6, 6), np.float32),
        bad_match=r"is 2-D .* expects inputs",
        rules=_YOLO_RULES,
    ),
    Descriptor(
        "SPPF",
        bx.SPPF,
        lambda node, rng: bx.SPPF(node, 8, rng),
        normal(2, 6, 6, 8),
        bad=lambda: np.ones((6, 6), np.float32),
        bad_match=r"is 2-D .* expects inputs",
        rules=_YOLO_RULES,
    ),
    Descriptor(
        "YOLOBackboneNeck",
        bx.YOLOBackboneNeck,
        lambda node, rng: bx.YOLOBackboneNeck(node, rng, **_YOLO_SMALL),
        normal(2, 32, 32, 3),
        covers=(bx.YOLOBackbone, bx.YOLONeck),
        bad=lambda: np.ones((32, 32, 3), np.float32),
        call=_eval,  # batch statistics of 2 values at stride 32 are ill-conditioned
        bad_match=r"YOLOBackbone 'net/layer/backbone': expects images \(B, H, W, C\)",
        rules=_YOLO_RULES,
        bf16_rtol=5e-2,
        eager=False,
    ),
    # -- parameter-free functions (cheap rows: the same checks) --------------------------
    Descriptor(
        "max_pool",
        bx.max_pool,
        lambda node, rng: None,
        normal(2, 6, 6, 4),
        call=_fn(lambda x: bx.max_pool(x, (2, 2), padding="SAME")),
        no_bad_reason="a function, not a layer: its errors name the function (test_pool.py)",
        rules=(),
        in_spec=P("data", None, None, "model"),
    ),
    Descriptor(
        "avg_pool",
        bx.avg_pool,
        lambda node, rng: None,
        normal(2, 6, 6, 4),
        call=_fn(lambda x: bx.avg_pool(x, (3, 3), 2, padding="SAME")),
        no_bad_reason="a function, not a layer: its errors name the function (test_pool.py)",
        rules=(),
        in_spec=P("data", None, None, "model"),
    ),
    Descriptor(
        "upsample",
        bx.upsample,
        lambda node, rng: None,
        normal(2, 3, 3, 4),
        call=_fn(bx.upsample),
        no_bad_reason="a function, not a layer: its errors name the function",
        rules=(),
        in_spec=P("data", None, None, "model"),
    ),
]


def by_name() -> dict[str, Descriptor]:
    return {d.name: d for d in DESCRIPTORS}


def public_modules() -> dict[str, type]:
    """Every public `blox.nn` name that is a `Module` subclass."""
    out = {}
    for name in bx.nn.__all__:
        obj = getattr(bx.nn, name)
        if isinstance(obj, type) and issubclass(obj, bx.Module):
            out[name] = obj
    return out


def filled_params(
    init: Callable, params: bx.Params, *args: Any, fill: Callable[[str, Any], np.ndarray]
) -> bx.Params:
    """The params that ``init(params, *args)`` (a layer call returning ``(outputs,
    params)``) creates, without compiling any initializer (random initializers cost
    seconds of XLA compilation per shape): the layer's own paths, shapes, dtypes, flags
    and metadata from ``jax.eval_shape``, the arrays already in `params` (the `Rng`'s)
    kept, ``fill(path, shape_dtype)`` (a NumPy array) for every new one."""
    _, abstract = jax.eval_shape(init, params, *args)
    given = {"/".join(k): v for k, v in params.arrays().items()}

    def one(kp, s):
        path = kp[0].key
        return given[path] if path in given else jnp.asarray(fill(path, s))

    return jax.tree_util.tree_map_with_path(one, abstract)


def numpy_params(init: Callable, params: bx.Params, *args: Any) -> bx.Params:
    """`filled_params` with NumPy normals (kernels scaled by ``1 / sqrt(fan_in)``,
    positive scales and variances), seeded by the path."""

    def normal(path, s):
        v = np.random.default_rng(zlib.crc32(path.encode())).standard_normal(s.shape)
        if len(s.shape) >= 2:
            v = v / np.sqrt(np.prod(s.shape[:-1]))
        elif path.endswith(("running_var", "scale")):
            v = 1.0 + 0.2 * np.abs(v)
        else:
            v = 0.2 * v
        return v.astype(s.dtype)

    return filled_params(init, params, *args, fill=normal)


def cast_floats(tree: Any, dtype: Any) -> Any:
    """Every floating leaf of `tree` cast to `dtype` (integer leaves kept)."""
    return jax.tree.map(
        lambda v: v.astype(dtype) if jnp.issubdtype(jnp.asarray(v).dtype, jnp.floating) else v,
        tree,
    )
