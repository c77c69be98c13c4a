"""YOLO-style building blocks: `ConvBNSiLU`, `Bottleneck`, `C2f`, `SPPF`, the `YOLONeck`
(FPN upsample-and-concat, then PAN downsample-and-concat), a small `YOLOBackbone`, and
`YOLOBackboneNeck` (both together).

The blocks follow the YOLOv8 design (Conv-BN-SiLU units, cross-stage-partial C2f blocks,
a fast spatial pyramid pool) and its parameter layout: a block's children are named
``cv1``, ``cv2`` and ``m/<i>`` like the PyTorch attributes, so a PyTorch state-dict key
``m.0.cv1.conv.weight`` corresponds to the blox path ``.../m/0/cv1/conv/kernel``
(weights permuted as in `Conv`; BatchNorm ``weight`` is ``scale``).

Every block takes its defining sizes and ``rng`` positionally (``ConvBNSiLU(graph,
kernel_size, output_channels, rng)``, ``C2f(graph, output_channels, rng)``,
``YOLONeck(graph, rng)``, ...) and every option after ``rng`` by keyword only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp

from blox.core import Graph, Module, Params, Rng
from blox.nn._activations import get_activation
from blox.nn._batchnorm import BatchNorm
from blox.nn._conv import Conv, PaddingLike
from blox.nn._pool import max_pool
from blox.nn._resize import upsample

__all__ = [
    "Bottleneck",
    "C2f",
    "ConvBNSiLU",
    "SPPF",
    "YOLOBackbone",
    "YOLOBackboneNeck",
    "YOLONeck",
]

Activation = str | Callable[[jax.Array], jax.Array] | None
_M = TypeVar("_M", bound=Module)


def _kernel_tuple(kernel_size: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(kernel_size, int) and not isinstance(kernel_size, bool):
        return (kernel_size, kernel_size)
    return tuple(kernel_size)


def _channel_axis(x: jax.Array, channels_first: bool) -> int:
    return 1 if channels_first else x.ndim - 1


class ConvBNSiLU(Module):
    """Convolution without bias -> `BatchNorm` -> SiLU: the unit every YOLO block is
    built from (PyTorch: ``Conv2d(bias=False)``, ``BatchNorm2d``, ``SiLU``).

    Shapes: ``(B, H, W, C_in)`` -> ``(B, H', W', C_out)`` (channels last), or
    ``(B, C_in, H, W)`` -> ``(B, C_out, H', W')`` with ``channels_first=True``.
    ``H' = ceil(H / stride)`` with the default padding and an odd kernel.

    Args:
      graph: this module's node.
      kernel_size: an int ``k`` (a ``k x k`` 2-D kernel) or one int per spatial axis
        (``(k,)`` for 1-D, ``(k, k, k)`` for 3-D).
      output_channels: C_out.
      rng: the `Rng` for the convolution kernel's initialization.
      strides: an int or one per spatial axis.
      padding: default ``None``: ``(d * (k - 1)) // 2`` on both sides of each axis
        (PyTorch/YOLO "autopad"; for stride 2 this differs from ``'SAME'``, which pads
        only the high side); otherwise any `Conv` padding.
      feature_group_count: groups of the convolution.
      kernel_dilation: dilation of the convolution.
      activation: a function, a PyTorch name for `get_activation` (default ``'silu'``)
        or ``None`` for no activation.
      bn_momentum, bn_epsilon: `BatchNorm` settings; the defaults 0.97 / 1e-3 are
        YOLOv8's (PyTorch ``momentum=0.03, eps=1e-3``).
      channels_first: ``(B, C, ...)`` inputs.
      dtype, param_dtype: passed to `Conv` and `BatchNorm`.

    Parameters: ``<path>/conv/kernel`` ``(*k, C_in // G, C_out)``, ``<path>/bn/scale``,
    ``<path>/bn/bias`` (trainable) and ``<path>/bn/running_mean``,
    ``<path>/bn/running_var`` (non-trainable), each ``(C_out,)``.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> block = bx.ConvBNSiLU(g / 'stem', 3, 16, rng, strides=2)
    >>> y, params = block(rng.seed(bx.Params(), seed=0), jnp.ones((2, 32, 32, 3)))
    >>> y.shape
    (2, 16, 16, 16)
    """

    def __init__(
        self,
        graph: Graph,
        kernel_size: int | Sequence[int],
        output_channels: int,
        rng: Rng | None,
        *,
        strides: int | Sequence[int] = 1,
        padding: PaddingLike | None = None,
        feature_group_count: int = 1,
        kernel_dilation: int | Sequence[int] = 1,
        activation: Activation = "silu",
        bn_momentum: float = 0.97,
        bn_epsilon: float = 1e-3,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        k = _kernel_tuple(kernel_size)
        if padding is None:
            d = (
                (kernel_dilation,) * len(k)
                if isinstance(kernel_dilation, int)
                else tuple(kernel_dilation)
            )
            if len(d) == len(k):
                padding = [(di * (ki - 1)) // 2 for ki, di in zip(k, d, strict=True)]
            else:
                padding = "SAME"  # let Conv report the length mismatch
        self.output_channels = output_channels
        self.channels_first = channels_first
        self.activation = None if activation is None else get_activation(activation)
        self.conv = Conv(
            graph.child("conv"),
            k,
            output_channels,
            rng,
            strides=strides,
            padding=padding,
            kernel_dilation=kernel_dilation,
            feature_group_count=feature_group_count,
            use_bias=False,
            channels_first=channels_first,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.bn = BatchNorm(
            graph.child("bn"),
            momentum=bn_momentum,
            epsilon=bn_epsilon,
            channels_first=channels_first,
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def __call__(
        self, params: Params, x: jax.Array, is_training: bool = True
    ) -> tuple[jax.Array, Params]:
        """Returns ``(act(bn(conv(x))), params)``; BatchNorm statistics update when
        training."""
        y, params = self.conv(params, x)
        y, params = self.bn(params, y, is_training=is_training)
        if self.activation is not None:
            y = self.activation(y)
        return y, params


class _Block(Module):
    """A YOLO block made of `ConvBNSiLU` units and smaller blocks that all share one set
    of unit settings (activation, BatchNorm momentum and epsilon, layout, dtypes):
    `_set_unit` records them, `_child` builds each part with them under this block's node."""

    def _set_unit(
        self,
        activation: Activation,
        bn_momentum: float,
        bn_epsilon: float,
        channels_first: bool,
        dtype: Any | None,
        param_dtype: Any,
    ) -> None:
        """Records the unit settings that `_child` passes on (call it in ``__init__``,
        after ``super().__init__(graph)`` and the block's own checks)."""
        self.channels_first = channels_first
        self._unit = {
            "activation": activation,
            "bn_momentum": bn_momentum,
            "bn_epsilon": bn_epsilon,
            "channels_first": channels_first,
            "dtype": dtype,
            "param_dtype": param_dtype,
        }

    def _child(
        self, cls: type[_M], name: str, *args: Any, under: Graph | None = None, **options: Any
    ) -> _M:
        """``cls(node.child(name), *args, **options)`` with this block's unit settings,
        where node is `under` (default: this block's node)."""
        node = self.graph if under is None else under
        return cls(node.child(name), *args, **options, **self._unit)


def _concat_cv2(
    cv2: ConvBNSiLU, params: Params, parts: list[jax.Array], is_training: bool
) -> tuple[jax.Array, Params]:
    """`cv2` over the concatenation of `parts` along the channel axis."""
    y = jnp.concatenate(parts, axis=_channel_axis(parts[0], cv2.channels_first))
    return cv2(params, y, is_training=is_training)


class Bottleneck(_Block):
    """Two `ConvBNSiLU` (``cv1``: ``k1``, ``C_out * expansion`` channels; ``cv2``:
    ``k2``, ``C_out`` channels, grouped) with a residual connection when ``shortcut``
    is set and ``C_in == C_out``.

    Shapes: ``(B, H, W, C_in)`` -> ``(B, H, W, C_out)`` (or channels first).

    Args:
      graph: this module's node.
      output_channels: C_out.
      rng: the `Rng` for initialization.
      shortcut: add the input to the output (only when ``C_in == C_out``).
      feature_group_count: groups of ``cv2``.
      kernel_sizes: ``(k1, k2)`` (default ``(3, 3)``).
      expansion: hidden channels ``int(C_out * expansion)``.
      activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype: passed
        to both `ConvBNSiLU`.

    Parameters: ``<path>/cv1/...`` and ``<path>/cv2/...`` (see `ConvBNSiLU`).

    >>> import blox as bx, jax, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> block = bx.Bottleneck(g / 'b', 8, rng)
    >>> x = jax.ShapeDtypeStruct((1, 6, 6, 8), jnp.float32)
    >>> y, params = jax.eval_shape(block, rng.seed(bx.Params(), seed=0), x)  # shapes only
    >>> y.shape, params[('net', 'b', 'cv1', 'conv', 'kernel')].value.shape
    ((1, 6, 6, 8), (3, 3, 8, 4))
    """

    def __init__(
        self,
        graph: Graph,
        output_channels: int,
        rng: Rng | None,
        *,
        shortcut: bool = True,
        feature_group_count: int = 1,
        kernel_sizes: tuple[int | Sequence[int], int | Sequence[int]] = (3, 3),
        expansion: float = 0.5,
        activation: Activation = "silu",
        bn_momentum: float = 0.97,
        bn_epsilon: float = 1e-3,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        hidden = int(output_channels * expansion)
        if hidden < 1:
            raise ValueError(
                f"Bottleneck '{self.path_str}': output_channels={output_channels} * "
                f"expansion={expansion} gives {hidden} hidden channels; use a larger "
                "expansion or more channels."
            )
        self._set_unit(activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype)
        self.output_channels = output_channels
        self.shortcut = shortcut
        self.cv1 = self._child(ConvBNSiLU, "cv1", kernel_sizes[0], hidden, rng)
        self.cv2 = self._child(
            ConvBNSiLU,
            "cv2",
            kernel_sizes[1],
            output_channels,
            rng,
            feature_group_count=feature_group_count,
        )

    def __call__(
        self, params: Params, x: jax.Array, is_training: bool = True
    ) -> tuple[jax.Array, Params]:
        """Returns ``(x + cv2(cv1(x)) or cv2(cv1(x)), params)``."""
        y, params = self.cv1(params, x, is_training=is_training)
        y, params = self.cv2(params, y, is_training=is_training)
        if self.shortcut and x.shape[_channel_axis(x, self.channels_first)] == self.output_channels:
            y = x.astype(y.dtype) + y
        return y, params


class C2f(_Block):
    """The YOLOv8 cross-stage-partial block: ``cv1`` (1x1) makes ``2c`` channels
    (``c = int(C_out * expansion)``), split in two halves ``a, b``; ``num_blocks``
    `Bottleneck` (``c`` channels, expansion 1, 3x3 kernels) run in a chain from ``b``;
    ``cv2`` (1x1) maps the concatenation ``[a, b, m_0, ..., m_{n-1}]``
    (``(2 + n) c`` channels) to ``C_out``.

    Shapes: ``(B, H, W, C_in)`` -> ``(B, H, W, C_out)`` (or channels first).

    Args:
      graph: this module's node.
      output_channels: C_out.
      rng: the `Rng` for initialization.
      num_blocks: n, the number of bottlenecks.
      shortcut: residual connections inside the bottlenecks (YOLOv8: on in the
        backbone, off in the neck).
      feature_group_count: groups of the bottlenecks' second convolution.
      expansion: ``c = int(C_out * expansion)`` (default 0.5).
      activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype: passed
        to every `ConvBNSiLU`.

    Parameters: ``<path>/cv1/...``, ``<path>/cv2/...`` and ``<path>/m/<i>/cv1/...``,
    ``<path>/m/<i>/cv2/...`` (PyTorch ``m.<i>``).

    >>> import blox as bx, jax, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> c2f = bx.C2f(g / 'c2f', 16, rng, num_blocks=2)
    >>> x = jax.ShapeDtypeStruct((1, 8, 8, 8), jnp.float32)
    >>> y, params = jax.eval_shape(c2f, rng.seed(bx.Params(), seed=0), x)  # shapes only
    >>> y.shape, params[('net', 'c2f', 'cv2', 'conv', 'kernel')].value.shape
    ((1, 8, 8, 16), (1, 1, 32, 16))
    """

    def __init__(
        self,
        graph: Graph,
        output_channels: int,
        rng: Rng | None,
        *,
        num_blocks: int = 1,
        shortcut: bool = False,
        feature_group_count: int = 1,
        expansion: float = 0.5,
        activation: Activation = "silu",
        bn_momentum: float = 0.97,
        bn_epsilon: float = 1e-3,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        c = int(output_channels * expansion)
        if c < 1 or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(
                f"C2f '{self.path_str}': needs int(output_channels * expansion) >= 1 and "
                f"num_blocks >= 0, got output_channels={output_channels}, "
                f"expansion={expansion}, num_blocks={num_blocks!r}."
            )
        self._set_unit(activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype)
        self.hidden = c
        self.cv1 = self._child(ConvBNSiLU, "cv1", 1, 2 * c, rng)
        self.cv2 = self._child(ConvBNSiLU, "cv2", 1, output_channels, rng)
        m = self.graph.child("m")
        self.m = [
            self._child(
                Bottleneck,
                str(i),
                c,
                rng,
                shortcut=shortcut,
                feature_group_count=feature_group_count,
                kernel_sizes=(3, 3),
                expansion=1.0,
                under=m,
            )
            for i in range(num_blocks)
        ]

    def __call__(
        self, params: Params, x: jax.Array, is_training: bool = True
    ) -> tuple[jax.Array, Params]:
        """Returns ``(cv2(concat([a, b, m_0(b), ...])), params)``."""
        y, params = self.cv1(params, x, is_training=is_training)
        parts = list(jnp.split(y, 2, axis=_channel_axis(y, self.channels_first)))
        for block in self.m:
            z, params = block(params, parts[-1], is_training=is_training)
            parts.append(z)
        return _concat_cv2(self.cv2, params, parts, is_training)


class SPPF(_Block):
    """Spatial pyramid pooling, fast: ``cv1`` (1x1) to ``hidden`` channels, three
    cascaded ``k x k`` max-pools (stride 1, padding ``k // 2``, so the size is kept;
    together they see 5x5, 9x9, 13x13 windows for ``k = 5``), and ``cv2`` (1x1) over the
    concatenation of the four maps (``4 * hidden`` channels) to ``C_out``.

    Shapes: ``(B, H, W, C_in)`` -> ``(B, H, W, C_out)`` (or channels first).

    Args:
      graph: this module's node.
      output_channels: C_out.
      rng: the `Rng` for initialization.
      kernel_size: the pooling window ``k`` (odd; default 5).
      hidden_channels: ``cv1``'s output channels; default ``C_out // 2`` (YOLOv8 uses
        ``C_in // 2``, the same number since its SPPF keeps the channel count).
      activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype: passed
        to both `ConvBNSiLU`.

    Parameters: ``<path>/cv1/...`` and ``<path>/cv2/...``; pooling has none.

    >>> import blox as bx, jax, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> sppf = bx.SPPF(g / 'sppf', 16, rng)
    >>> x = jax.ShapeDtypeStruct((1, 4, 4, 16), jnp.float32)
    >>> y, _ = jax.eval_shape(sppf, rng.seed(bx.Params(), seed=0), x)  # shapes only
    >>> y.shape
    (1, 4, 4, 16)
    """

    def __init__(
        self,
        graph: Graph,
        output_channels: int,
        rng: Rng | None,
        *,
        kernel_size: int = 5,
        hidden_channels: int | None = None,
        activation: Activation = "silu",
        bn_momentum: float = 0.97,
        bn_epsilon: float = 1e-3,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        hidden = output_channels // 2 if hidden_channels is None else hidden_channels
        if not isinstance(kernel_size, int) or kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(
                f"SPPF '{self.path_str}': kernel_size must be an odd positive int (the "
                f"pools keep the spatial size with padding k // 2), got {kernel_size!r}."
            )
        if hidden < 1:
            raise ValueError(
                f"SPPF '{self.path_str}': hidden_channels must be >= 1, got {hidden} "
                f"(output_channels={output_channels}); pass hidden_channels=..."
            )
        self._set_unit(activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype)
        self.kernel_size = kernel_size
        self.cv1 = self._child(ConvBNSiLU, "cv1", 1, hidden, rng)
        self.cv2 = self._child(ConvBNSiLU, "cv2", 1, output_channels, rng)

    def __call__(
        self, params: Params, x: jax.Array, is_training: bool = True
    ) -> tuple[jax.Array, Params]:
        """Returns ``(cv2(concat([y, p(y), p(p(y)), p(p(p(y)))])), params)``."""
        y, params = self.cv1(params, x, is_training=is_training)
        k, window = self.kernel_size, (self.kernel_size,) * (y.ndim - 2)
        parts = [y]
        for _ in range(3):
            parts.append(max_pool(parts[-1], window, 1, k // 2, channels_first=self.channels_first))
        return _concat_cv2(self.cv2, params, parts, is_training)


def _spatial(x: jax.Array, channels_first: bool) -> tuple[int, ...]:
    return tuple(x.shape[2:]) if channels_first else tuple(x.shape[1:-1])


class YOLONeck(_Block):
    """The YOLOv8 neck over three backbone scales ``(P3, P4, P5)`` (strides 8, 16, 32):
    a top-down FPN path (upsample x2 nearest, concatenate with the finer map, `C2f`) and
    a bottom-up PAN path (3x3 stride-2 `ConvBNSiLU`, concatenate, `C2f`):

        N4 = C2f_c4(concat(up(P5), P4));  O3 = C2f_c3(concat(up(N4), P3))
        O4 = C2f_c4(concat(down(O3), N4)); O5 = C2f_c5(concat(down(O4), P5))

    Shapes (channels last): ``P3 (B, 4h, 4w, *)``, ``P4 (B, 2h, 2w, *)``,
    ``P5 (B, h, w, *)`` -> ``O3 (B, 4h, 4w, c3)``, ``O4 (B, 2h, 2w, c4)``,
    ``O5 (B, h, w, c5)``.

    Args:
      graph: this module's node.
      rng: the `Rng` for initialization.
      channels: ``(c3, c4, c5)``, the output channels per scale.
      depth: bottlenecks per `C2f`.
      activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype: passed
        to every block.

    Parameters under ``<path>/``: ``top_p4`` (C2f), ``out_p3`` (C2f), ``down_p3``
    (ConvBNSiLU), ``out_p4`` (C2f), ``down_p4`` (ConvBNSiLU), ``out_p5`` (C2f).
    """

    def __init__(
        self,
        graph: Graph,
        rng: Rng | None,
        *,
        channels: Sequence[int] = (64, 128, 256),
        depth: int = 1,
        activation: Activation = "silu",
        bn_momentum: float = 0.97,
        bn_epsilon: float = 1e-3,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        channels = tuple(channels)
        if len(channels) != 3:
            raise ValueError(
                f"YOLONeck '{self.path_str}': channels must be (c3, c4, c5), got {channels!r}."
            )
        c3, c4, c5 = channels
        self._set_unit(activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype)
        self.channels = channels
        self.top_p4 = self._child(C2f, "top_p4", c4, rng, num_blocks=depth)
        self.out_p3 = self._child(C2f, "out_p3", c3, rng, num_blocks=depth)
        self.down_p3 = self._child(ConvBNSiLU, "down_p3", 3, c3, rng, strides=2)
        self.out_p4 = self._child(C2f, "out_p4", c4, rng, num_blocks=depth)
        self.down_p4 = self._child(ConvBNSiLU, "down_p4", 3, c4, rng, strides=2)
        self.out_p5 = self._child(C2f, "out_p5", c5, rng, num_blocks=depth)

    def __call__(
        self,
        params: Params,
        features: Sequence[jax.Array],
        is_training: bool = True,
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], Params]:
        """``features = (P3, P4, P5)``; returns ``((O3, O4, O5), params)``."""
        if len(features) != 3:
            raise ValueError(
                f"YOLONeck '{self.path_str}': expects the three scales (P3, P4, P5), got "
                f"{len(features)} arrays."
            )
        p3, p4, p5 = (jnp.asarray(f) for f in features)
        cf = self.channels_first
        s3, s4, s5 = _spatial(p3, cf), _spatial(p4, cf), _spatial(p5, cf)
        if s4 != tuple(2 * n for n in s5) or s3 != tuple(2 * n for n in s4):
            raise ValueError(
                f"YOLONeck '{self.path_str}': the scales must halve exactly, P3 -> P4 -> "
                f"P5, got spatial sizes {s3}, {s4}, {s5} (shapes {tuple(p3.shape)}, "
                f"{tuple(p4.shape)}, {tuple(p5.shape)}). Use input images whose height "
                "and width are multiples of 32."
            )
        ax = _channel_axis(p3, cf)
        kw = dict(is_training=is_training)
        n4, params = self.top_p4(
            params, jnp.concatenate([upsample(p5, channels_first=cf), p4], ax), **kw
        )
        o3, params = self.out_p3(
            params, jnp.concatenate([upsample(n4, channels_first=cf), p3], ax), **kw
        )
        d3, params = self.down_p3(params, o3, **kw)
        o4, params = self.out_p4(params, jnp.concatenate([d3, n4], ax), **kw)
        d4, params = self.down_p4(params, o4, **kw)
        o5, params = self.out_p5(params, jnp.concatenate([d4, p5], ax), **kw)
        return (o3, o4, o5), params


class YOLOBackbone(_Block):
    """A small YOLOv8-style backbone: a 3x3 stride-2 stem, then four stages of a 3x3
    stride-2 `ConvBNSiLU` and a `C2f` (with shortcuts), and `SPPF` at the end.

    ``widths = (w0, w1, w2, w3, w4)`` are the channels of the stem and the four stages
    (YOLOv8n: ``(16, 32, 64, 128, 256)``), ``depths`` the bottlenecks per stage
    (YOLOv8n: ``(1, 2, 2, 1)``).

    Shapes (channels last): ``(B, H, W, C)`` -> ``(P3, P4, P5)`` with
    ``P3 (B, H/8, W/8, w2)``, ``P4 (B, H/16, W/16, w3)``, ``P5 (B, H/32, W/32, w4)``
    (each division rounds up).

    Args:
      graph: this module's node.
      rng: the `Rng` for initialization.
      widths: five channel counts.
      depths: four bottleneck counts.
      sppf_kernel: the SPPF pooling window.
      activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype: passed
        to every block.

    Parameters under ``<path>/``: ``stem``, ``down_<i>`` and ``stage_<i>`` for
    ``i = 1..4``, ``sppf``.
    """

    def __init__(
        self,
        graph: Graph,
        rng: Rng | None,
        *,
        widths: Sequence[int] = (16, 32, 64, 128, 256),
        depths: Sequence[int] = (1, 2, 2, 1),
        sppf_kernel: int = 5,
        activation: Activation = "silu",
        bn_momentum: float = 0.97,
        bn_epsilon: float = 1e-3,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        widths, depths = tuple(widths), tuple(depths)
        if len(widths) != 5 or len(depths) != 4:
            raise ValueError(
                f"YOLOBackbone '{self.path_str}': widths needs 5 entries (stem and four "
                f"stages) and depths 4, got widths={widths!r}, depths={depths!r}."
            )
        self._set_unit(activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype)
        self.widths, self.depths = widths, depths
        self.stem = self._child(ConvBNSiLU, "stem", 3, widths[0], rng, strides=2)
        self.downs, self.stages = [], []
        for i, (w, n) in enumerate(zip(widths[1:], depths, strict=True), start=1):
            self.downs.append(self._child(ConvBNSiLU, f"down_{i}", 3, w, rng, strides=2))
            self.stages.append(self._child(C2f, f"stage_{i}", w, rng, num_blocks=n, shortcut=True))
        self.sppf = self._child(SPPF, "sppf", widths[4], rng, kernel_size=sppf_kernel)

    def __call__(
        self, params: Params, x: jax.Array, is_training: bool = True
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], Params]:
        """Returns ``((P3, P4, P5), params)``."""
        x = jnp.asarray(x)
        if x.ndim != 4:
            layout = "(B, C, H, W)" if self.channels_first else "(B, H, W, C)"
            raise ValueError(
                f"YOLOBackbone '{self.path_str}': expects images {layout}, got shape "
                f"{tuple(x.shape)}. Add a batch axis with x[None]."
            )
        y, params = self.stem(params, x, is_training=is_training)
        outs = []
        for down, stage in zip(self.downs, self.stages, strict=True):
            y, params = down(params, y, is_training=is_training)
            y, params = stage(params, y, is_training=is_training)
            outs.append(y)
        p5, params = self.sppf(params, outs[3], is_training=is_training)
        return (outs[1], outs[2], p5), params


class YOLOBackboneNeck(_Block):
    """`YOLOBackbone` followed by `YOLONeck`: images -> three feature maps
    ``(O3, O4, O5)`` at strides 8, 16, 32 with ``widths[2:]`` channels, ready for
    detection heads.

    Shapes (channels last): ``(B, H, W, C)`` with ``H, W`` multiples of 32 ->
    ``((B, H/8, W/8, w2), (B, H/16, W/16, w3), (B, H/32, W/32, w4))``.

    Args:
      graph: this module's node.
      rng: the `Rng` for initialization.
      widths, depths, sppf_kernel: the backbone's (see `YOLOBackbone`).
      neck_depth: bottlenecks per neck `C2f` (default ``max(1, depths[-1])``).
      activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype: passed
        to every block.

    Parameters under ``<path>/backbone/...`` and ``<path>/neck/...``.

    >>> import blox as bx, jax, jax.numpy as jnp
    >>> g = bx.Graph('yolo'); rng = bx.Rng(g / 'rng')
    >>> model = bx.YOLOBackboneNeck(g / 'net', rng, widths=(4, 8, 8, 16, 16),
    ...                             depths=(1, 1, 1, 1))
    >>> x = jax.ShapeDtypeStruct((1, 64, 64, 3), jnp.float32)
    >>> outs, params = jax.eval_shape(model, rng.seed(bx.Params(), seed=0), x)
    >>> [o.shape for o in outs]
    [(1, 8, 8, 8), (1, 4, 4, 16), (1, 2, 2, 16)]
    """

    def __init__(
        self,
        graph: Graph,
        rng: Rng | None,
        *,
        widths: Sequence[int] = (16, 32, 64, 128, 256),
        depths: Sequence[int] = (1, 2, 2, 1),
        sppf_kernel: int = 5,
        neck_depth: int | None = None,
        activation: Activation = "silu",
        bn_momentum: float = 0.97,
        bn_epsilon: float = 1e-3,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        self._set_unit(activation, bn_momentum, bn_epsilon, channels_first, dtype, param_dtype)
        self.backbone = self._child(
            YOLOBackbone, "backbone", rng, widths=widths, depths=depths, sppf_kernel=sppf_kernel
        )
        widths, depths = self.backbone.widths, self.backbone.depths
        depth = max(1, depths[-1]) if neck_depth is None else neck_depth
        self.neck = self._child(YOLONeck, "neck", rng, channels=widths[2:], depth=depth)

    def __call__(
        self, params: Params, x: jax.Array, is_training: bool = True
    ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], Params]:
        """Returns ``((O3, O4, O5), params)``."""
        feats, params = self.backbone(params, x, is_training=is_training)
        return self.neck(params, feats, is_training=is_training)
