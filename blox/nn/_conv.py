"""Convolutions: `Conv` and `ConvTranspose` (1-, 2- and 3-D, or more).

Both take channels-last inputs by default (``(..., W, C)``, ``(..., H, W, C)``,
``(..., D, H, W, C)``) with any number of leading batch axes, and channels-first inputs
(``(..., C, H, W)``) with ``channels_first=True``. The kernel layout does not depend on
the input layout, so one set of parameters gives the same numbers in both layouts.

The padding arithmetic (shared with the pooling functions) lives in ``_padding.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from blox.core import Graph, Module, Params, Rng
from blox.core._module import is_local_shard, stored_shape_error
from blox.core._params import format_path
from blox.core._sharding import conv_out_sharding, reshard_dim, resolve_out_sharding
from blox.nn._dtype import compute_dtype
from blox.nn._padding import (
    PaddingLike,
    dilate,
    int_tuple,
    layout,
    normalize_padding,
    resolve_pads,
    split_input,
    transpose_pads,
)

__all__ = ["Conv", "ConvTranspose", "PaddingLike"]

_default_kernel_init = jax.nn.initializers.lecun_normal()
# ConvTranspose kernels are (*k, C_out, C_in // G) (or, with transpose_kernel=True,
# (*k, C_out // G, C_in)). The default is jax-blox's, for the same numbers: lecun_normal()
# with its default axes on (*k, C_out, C_in // G), so the fan-in it counts is
# prod(k) * C_out (PyTorch's ConvTranspose counts C_out // G * prod(k) too).
_default_transpose_kernel_init = jax.nn.initializers.lecun_normal()


def _transpose_kernel_init(groups: int) -> Callable:
    """The default init for ``transpose_kernel=True`` kernels ``(*k, C_out // G, C_in)``:
    variance ``1 / (prod(k) * C_out)``, as for the default layout."""
    return jax.nn.initializers.variance_scaling(
        1.0 / groups, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1
    )


_default_bias_init = jax.nn.initializers.zeros

_SPATIAL = "0123456789"  # spatial letters for lax dimension numbers (any unique chars)
_PAD_STRINGS = ("SAME", "SAME_LOWER", "VALID", "CAUSAL")


def _dimension_numbers(n: int, channels_first: bool, kernel_spec: str) -> tuple[str, str, str]:
    sp = _SPATIAL[:n]
    lhs = "NC" + sp if channels_first else "N" + sp + "C"
    return (lhs, sp + kernel_spec, lhs)


# ---------------------------------------------------------------------------
# Conv
# ---------------------------------------------------------------------------


class _ConvBase(Module):
    """Shared configuration and checks of `Conv` and `ConvTranspose`."""

    _kind = "Conv"

    def _configure(
        self,
        kernel_size: int | Sequence[int],
        output_channels: int,
        rng: Rng | None,
        strides: int | Sequence[int],
        padding: PaddingLike,
        kernel_dilation: int | Sequence[int],
        feature_group_count: int,
        use_bias: bool,
        kernel_init: Callable,
        bias_init: Callable,
        kernel_metadata: dict | None,
        bias_metadata: dict | None,
        channels_first: bool,
        dtype: Any | None,
        param_dtype: Any,
        allowed_padding: Sequence[str],
    ) -> None:
        where = f"{self._kind} '{self.path_str}'"
        if isinstance(kernel_size, int) and not isinstance(kernel_size, bool):
            kernel_size = (kernel_size,)
        try:
            kernel_size = tuple(kernel_size)
        except TypeError:
            raise TypeError(
                f"{where}: kernel_size must be an int (1-D) or a tuple of ints, e.g. (3, 3) "
                f"for 2-D, got {kernel_size!r}."
            ) from None
        if not kernel_size:
            raise ValueError(f"{where}: kernel_size must not be empty; e.g. (3, 3) for 2-D.")
        n = len(kernel_size)
        self.num_spatial_dims = n
        self.kernel_size = int_tuple(kernel_size, n, "kernel_size", where, "")
        fix = f"Give one value per spatial dimension or a single int (kernel_size={kernel_size})."
        self.strides = int_tuple(strides, n, "strides", where, fix)
        self.kernel_dilation = int_tuple(kernel_dilation, n, "kernel_dilation", where, fix)
        if (
            not isinstance(output_channels, int)
            or isinstance(output_channels, bool)
            or output_channels <= 0
        ):
            raise ValueError(
                f"{where}: output_channels must be a positive int, got {output_channels!r}."
            )
        if (
            not isinstance(feature_group_count, int)
            or isinstance(feature_group_count, bool)
            or feature_group_count < 1
        ):
            raise ValueError(
                f"{where}: feature_group_count must be a positive int, got {feature_group_count!r}."
            )
        if output_channels % feature_group_count:
            raise ValueError(
                f"{where}: output_channels={output_channels} is not divisible by "
                f"feature_group_count={feature_group_count}. Each group produces "
                "output_channels / feature_group_count channels; choose output_channels as "
                "a multiple of the group count."
            )
        self.padding = normalize_padding(padding, n, where, allowed_padding)
        self.output_channels = output_channels
        self.feature_group_count = feature_group_count
        self.rng = rng
        self.use_bias = use_bias
        self.kernel_init = kernel_init
        self.bias_init = bias_init
        self.kernel_metadata = kernel_metadata
        self.bias_metadata = bias_metadata
        self.channels_first = bool(channels_first)
        self.dtype = dtype
        self.param_dtype = param_dtype

    @property
    def _where(self) -> str:
        return f"{self._kind} '{self.path_str}'"

    def _check_input(self, x: jax.Array) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
        n = self.num_spatial_dims
        if x.ndim < n + 1:
            raise ValueError(
                f"{self._where} is {n}-D (kernel_size={self.kernel_size}) and expects inputs "
                f"of shape {layout(n, self.channels_first)} with at least {n + 1} axes, got "
                f"shape {tuple(x.shape)}. Add the channel axis (e.g. x[..., None] for one "
                "channel) or use a kernel_size with as many entries as spatial axes."
            )
        batch, cin, spatial = split_input(x, n, self.channels_first)
        g = self.feature_group_count
        if cin % g:
            axis = -self.num_spatial_dims - 1 if self.channels_first else -1
            raise ValueError(
                f"{self._where}: the input has {cin} channels (axis {axis}, input shape "
                f"{tuple(x.shape)}), which is not divisible by feature_group_count={g}. Use "
                "a group count that divides the input channels"
                + ("" if self.channels_first else ", or pass channels_first=True for NCHW input")
                + "."
            )
        return batch, cin, spatial

    def _check_kernel(
        self,
        params: Params,
        expected: tuple[int, ...],
        x: jax.Array,
        legend: str,
        fixed: int,
        torch_shape: tuple[int, ...],
        torch_fix: str,
    ) -> None:
        """Checks a stored kernel against ``expected`` (laid out as ``legend``).

        The spatial axes and the channel axis ``fixed`` (-1 or -2) follow from the
        configuration alone: a stored kernel that differs there is blamed, not the input,
        and PyTorch's layout (``torch_shape``) is recognized and told how to convert
        (``torch_fix``). Only the input-channel axis follows from the input, so a stored
        kernel that differs there alone means the input changed.
        """
        path = self.param_path("kernel")
        shape = getattr(params.value(path), "shape", None)
        if shape is None or tuple(shape) == expected or is_local_shard(tuple(shape), expected):
            return  # a per-device shard inside jax.shard_map is accepted
        stored, n = tuple(shape), self.num_spatial_dims
        if len(stored) != n + 2 or stored[:n] != expected[:n] or stored[fixed] != expected[fixed]:
            why = f" = {legend} for input shape {tuple(x.shape)}"
            if stored == torch_shape:
                raise ValueError(
                    f"Parameter '{format_path(path)}' is stored with shape {stored}, but "
                    f"{self._where} expects {expected}{why}. The stored value is in "
                    f"PyTorch's layout {torch_fix}."
                )
            raise ValueError(stored_shape_error(self, path, stored, expected, why))
        raise ValueError(
            f"{self._where}: its kernel has shape {stored} in params, but input "
            f"shape {tuple(x.shape)} needs {expected} (layout "
            f"{layout(n, self.channels_first)}). Fix the input's "
            "channel axis (or the layout: channels_first) or re-initialize the params."
        )

    def _permute(self) -> str:
        """PyTorch weight axes -> blox kernel axes, e.g. ``'2, 3, 1, 0'`` for 2-D."""
        return ", ".join(str(i) for i in (*range(2, self.num_spatial_dims + 2), 1, 0))

    def _convolve(
        self,
        x: jax.Array,
        rhs: jax.Array,
        batch: tuple[int, ...],
        out_sharding: Any,
        **conv: Any,
    ) -> tuple[jax.Array, tuple[NamedSharding | None, NamedSharding | None]]:
        """``lax.conv_general_dilated`` over `x` (batch axes flattened to one) and `rhs`.

        Returns ``(y, (sharding, placement))``: `sharding` is the convolution's
        ``out_sharding`` on an Explicit mesh (the user's, or inferred by
        `conv_out_sharding` where JAX needs one), `placement` what `_finish` still
        applies to the whole output (a constraint on an Auto mesh, or a reshard of a
        user's Explicit sharding when several batch axes were flattened)."""
        xb = x if len(batch) == 1 else x.reshape((math.prod(batch),) + x.shape[len(batch) :])
        dn = lax.conv_dimension_numbers(xb.shape, rhs.shape, self._dn)
        sharding = placement = None
        if out_sharding is not None:
            n, cf = self.num_spatial_dims, self.channels_first
            sharding, placement = resolve_out_sharding(
                self._where, out_sharding, x.ndim, f"{layout(n, cf)} (C = {self.output_channels})"
            )
            if sharding is not None and len(batch) != 1:  # for the unflattened output
                sharding, placement = None, sharding
        if sharding is None:
            shape = _conv_out_shape(xb, rhs, dn, conv)
            sharding = conv_out_sharding(xb, rhs, dn, shape)
        y = lax.conv_general_dilated(xb, rhs, dimension_numbers=dn, out_sharding=sharding, **conv)
        return y, (sharding, placement)

    def _finish(
        self,
        params: Params,
        y: jax.Array,
        batch: tuple[int, ...],
        cd: Any,
        shardings: tuple[NamedSharding | None, NamedSharding | None],
    ) -> tuple[jax.Array, Params]:
        sharding, placement = shardings
        if self.use_bias:
            bias, params = self.get_param(
                params,
                "bias",
                (self.output_channels,),
                self.bias_init,
                dtype=self.param_dtype,
                metadata=self.bias_metadata,
                rng=self.rng,
            )
            bias = bias.astype(cd)
            if sharding is not None:  # the bias on the output's channel spec
                bias = reshard_dim(bias, 0, sharding, 1 if self.channels_first else y.ndim - 1)
            if self.channels_first:
                bias = bias.reshape((self.output_channels,) + (1,) * self.num_spatial_dims)
            y = y + jnp.expand_dims(bias, tuple(range(y.ndim - bias.ndim)))
        if len(batch) != 1:
            y = y.reshape(batch + tuple(y.shape[1:]))
        if placement is not None:
            if placement.mesh.explicit_axes:
                y = jax.sharding.reshard(y, placement)
            else:
                y = jax.lax.with_sharding_constraint(y, placement)
        return y, params


class Conv(_ConvBase):
    """An N-D convolution (cross-correlation, as in PyTorch and ``lax``) with bias.

    Legend: B batch axes (any number, also none), C_in / C_out channels, ``k`` the kernel
    size, G ``feature_group_count``; N spatial axes, ``N = len(kernel_size)``.

    Shapes: channels-last (default) ``(*B, *spatial, C_in)`` -> ``(*B, *spatial', C_out)``,
    e.g. ``(B, H, W, C)`` for 2-D; with ``channels_first=True`` ``(*B, C_in, *spatial)``
    -> ``(*B, C_out, *spatial')`` (NCHW). Per spatial axis of size ``n``, with
    ``n' = (n - 1) * input_dilation + 1`` and ``K = (k - 1) * kernel_dilation + 1``, the
    output size is ``floor((n' + low + high - K) / stride) + 1``.

    Padding: ``'SAME'`` pads ``n'`` so that the output size is ``ceil(n' / stride)``, an
    odd extra cell going to the high side (``'SAME_LOWER'``: the low side), as XLA and
    TensorFlow do; ``'VALID'`` pads nothing; ``'CAUSAL'`` (1-D only) pads ``K - 1`` on the
    low side, so output ``t`` sees inputs ``<= t * stride`` only; an int ``p`` pads ``p``
    on both sides of every spatial axis (PyTorch's ``padding=p``); one int per axis; or one
    ``(low, high)`` pair per axis (for 1-D also a bare ``(low, high)``).

    Groups: ``feature_group_count=G`` splits the input and output channels into G
    groups convolved separately (both must be divisible by G); depthwise is
    ``G = C_in`` with ``output_channels = m * C_in``.

    Args:
      graph: this module's node.
      kernel_size: an int (1-D) or a tuple of ints, one per spatial axis.
      output_channels: C_out.
      rng: the `Rng` that provides initialization keys.
      strides: an int or one per spatial axis.
      padding: see above (default ``'SAME'``).
      input_dilation: an int or one per spatial axis (zeros inserted between inputs).
      kernel_dilation: an int or one per spatial axis (atrous convolution).
      feature_group_count: G.
      use_bias: add a bias per output channel.
      kernel_init: ``init(key, shape, dtype)``; default LeCun normal over the kernel's
        fan-in ``prod(k) * C_in / G``.
      bias_init: default zeros.
      kernel_metadata, bias_metadata: stored with the parameters, e.g. sharding.
      channels_first: inputs and outputs are ``(*B, C, *spatial)`` (NCHW) instead of
        ``(*B, *spatial, C)`` (NHWC). The parameters are the same in both layouts.
      dtype: the compute dtype; default: the promotion of the input and param dtypes
        (explicit casts, so it runs under strict dtype promotion).
      param_dtype: the dtype parameters are created in (default float32).

    Parameters: ``<path>/kernel`` ``(*kernel_size, C_in // G, C_out)`` (PyTorch's
    ``weight (C_out, C_in // G, *k)`` moved to ``weight.permute(2, ..., 1, 0)``) and
    ``<path>/bias`` ``(C_out,)``.

    Call: ``conv(params, x, precision=None, *, out_sharding=None)``. On sharded inputs
    and kernels the layer computes the unsharded math. JAX infers a convolution's output
    sharding on an *Explicit* mesh only for a replicated kernel and unsharded input
    channels; otherwise (e.g. a kernel with its output channels over ``'model'``, or
    input channels sharded in ``x`` and the kernel) the layer infers one: ``x``'s batch
    and spatial specs kept, the output channels following the kernel's when that axis
    is free, else replicated (the compiler all-reduces). ``out_sharding`` (a
    ``NamedSharding``, or a ``PartitionSpec`` under ``jax.set_mesh``) chooses it
    instead; on an *Auto* mesh it becomes a ``with_sharding_constraint``. Off a mesh and
    on Auto meshes nothing is added.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> conv = bx.Conv(g / 'conv', (3, 3), 8, rng, strides=2)
    >>> y, params = conv(rng.seed(bx.Params(), seed=0), jnp.ones((4, 28, 28, 1)))
    >>> y.shape, params[('net', 'conv', 'kernel')].value.shape
    ((4, 14, 14, 8), (3, 3, 1, 8))
    >>> nchw = bx.Conv(g / 'nchw', (3, 3), 8, rng, padding=1, channels_first=True)
    >>> nchw(params, jnp.ones((4, 1, 28, 28)))[0].shape
    (4, 8, 28, 28)
    """

    def __init__(
        self,
        graph: Graph,
        kernel_size: int | Sequence[int],
        output_channels: int,
        rng: Rng | None,
        strides: int | Sequence[int] = 1,
        padding: PaddingLike = "SAME",
        input_dilation: int | Sequence[int] = 1,
        kernel_dilation: int | Sequence[int] = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        kernel_init: Callable = _default_kernel_init,
        bias_init: Callable = _default_bias_init,
        kernel_metadata: dict | None = None,
        bias_metadata: dict | None = None,
        *,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        one_d = isinstance(kernel_size, int) or _len(kernel_size) == 1
        allowed = _PAD_STRINGS if one_d else _PAD_STRINGS[:3]
        self._configure(
            kernel_size,
            output_channels,
            rng,
            strides,
            padding,
            kernel_dilation,
            feature_group_count,
            use_bias,
            kernel_init,
            bias_init,
            kernel_metadata,
            bias_metadata,
            channels_first,
            dtype,
            param_dtype,
            allowed,
        )
        n = self.num_spatial_dims
        self.input_dilation = int_tuple(
            input_dilation, n, "input_dilation", self._where, "One value per spatial axis."
        )
        self._dn = _dimension_numbers(n, self.channels_first, "IO")

    def output_pads(self, spatial: Sequence[int]) -> list[tuple[int, int]]:
        """The ``(low, high)`` padding applied to each (input-dilated) spatial axis of
        an input with spatial shape `spatial`."""
        sizes = [dilate(s, d) for s, d in zip(spatial, self.input_dilation, strict=True)]
        windows = [
            dilate(k, d) for k, d in zip(self.kernel_size, self.kernel_dilation, strict=True)
        ]
        return resolve_pads(self.padding, sizes, windows, self.strides)

    def __call__(
        self,
        params: Params,
        x: jax.Array,
        precision: Any = None,
        *,
        out_sharding: NamedSharding | PartitionSpec | None = None,
    ) -> tuple[jax.Array, Params]:
        """Applies the convolution; returns ``(y, params)`` (shapes in the class doc).
        ``out_sharding``: the output's sharding (see the class docstring)."""
        x = jnp.asarray(x)
        batch, cin, spatial = self._check_input(x)
        n, g = self.num_spatial_dims, self.feature_group_count
        pads = self.output_pads(spatial)
        for i in range(n):
            size = dilate(spatial[i], self.input_dilation[i])
            window = dilate(self.kernel_size[i], self.kernel_dilation[i])
            lo, hi = pads[i]
            if size + lo + hi < window:
                raise ValueError(
                    f"{self._where}: spatial axis {i} of the input has size {spatial[i]} "
                    f"(input shape {tuple(x.shape)}; with input_dilation and padding "
                    f"({lo}, {hi}): {size + lo + hi}), smaller than the dilated kernel size "
                    f"{window} (kernel_size={self.kernel_size}, kernel_dilation="
                    f"{self.kernel_dilation}), so the output would be empty. Use "
                    "padding='SAME', a smaller kernel or dilation, or a larger input."
                )
        kshape = self.kernel_size + (cin // g, self.output_channels)
        perm = self._permute()
        self._check_kernel(
            params,
            kshape,
            x,
            "(*kernel_size, C_in // G, C_out)",
            -1,
            (self.output_channels, cin // g) + self.kernel_size,
            f"(C_out, C_in // G, *kernel_size): store kernel = weight.permute({perm}) (NumPy: "
            f"weight.transpose({perm})); weight.T would also reverse the kernel axes",
        )
        kernel, params = self.get_param(
            params,
            "kernel",
            kshape,
            self.kernel_init,
            dtype=self.param_dtype,
            metadata=self.kernel_metadata,
            rng=self.rng,
        )
        cd = compute_dtype(x, kernel.dtype, self.dtype)
        y, shardings = self._convolve(
            x.astype(cd),
            kernel.astype(cd),
            batch,
            out_sharding,
            window_strides=self.strides,
            padding=pads,
            lhs_dilation=self.input_dilation,
            rhs_dilation=self.kernel_dilation,
            feature_group_count=g,
            precision=precision,
        )
        return self._finish(params, y, batch, cd, shardings)


def _conv_out_shape(
    lhs: jax.Array, rhs: jax.Array, dn: lax.ConvDimensionNumbers, conv: dict
) -> tuple[int, ...]:
    """The output shape of ``lax.conv_general_dilated(lhs, rhs, **conv)`` (explicit pads)."""
    lhs_dims, rhs_dims, out_dims = dn
    n = len(lhs_dims) - 2
    out = [0] * lhs.ndim
    out[out_dims[0]] = lhs.shape[lhs_dims[0]]
    out[out_dims[1]] = rhs.shape[rhs_dims[0]]
    lhs_dil = conv.get("lhs_dilation") or (1,) * n
    rhs_dil = conv.get("rhs_dilation") or (1,) * n
    for i in range(n):
        size = dilate(lhs.shape[lhs_dims[2 + i]], lhs_dil[i])
        window = dilate(rhs.shape[rhs_dims[2 + i]], rhs_dil[i])
        lo, hi = conv["padding"][i]
        out[out_dims[2 + i]] = (size + lo + hi - window) // conv["window_strides"][i] + 1
    return tuple(out)


def _len(value: Any) -> int | None:
    try:
        return len(value)
    except TypeError:
        return None


# ---------------------------------------------------------------------------
# ConvTranspose
# ---------------------------------------------------------------------------


class ConvTranspose(_ConvBase):
    """An N-D transposed convolution (fractionally strided convolution) that uses its
    kernel as stored by default (Flax's semantics), or PyTorch's semantics with
    ``transpose_kernel=True``.

    Legend as in `Conv`.

    Shapes: channels-last ``(*B, *spatial, C_in)`` -> ``(*B, *spatial', C_out)``;
    ``channels_first=True``: ``(*B, C_in, *spatial)`` -> ``(*B, C_out, *spatial')``.

    It is a stride-1 convolution over the input with ``stride - 1`` zeros inserted
    between elements, padded by ``(low, high)`` per axis::

        y = lax.conv_general_dilated(x, kernel, window_strides=1, padding=pads,
                                     lhs_dilation=strides, rhs_dilation=kernel_dilation,
                                     feature_group_count=G)   # kernel (*k, C_out, C_in // G)

    For G = 1 this is ``lax.conv_transpose(x, kernel, strides, padding,
    kernel_dilation, ('NHWC', 'HWOI', 'NHWC'), transpose_kernel=False)`` (2-D), what
    Flax's ``ConvTranspose`` computes (its kernel is ``(*k, C_in, C_out)``: see below).
    With groups (``feature_group_count > 1``) group ``g`` maps input channels
    ``g*C_in/G:(g+1)*C_in/G`` with kernel columns ``kernel[..., g*C_out/G:(g+1)*C_out/G, :]``.

    ``transpose_kernel=True`` gives PyTorch's ``ConvTranspose`` (and
    ``lax.conv_transpose(..., transpose_kernel=True)``): the kernel is then that of the
    `Conv` whose gradient this layer is, ``(*k, C_out // G, C_in)``, flipped spatially
    before use. The two layouts hold the same numbers for G = 1 up to a flip of the
    spatial axes: ``kernel_default = kernel_transposed[::-1, ::-1]`` (2-D), so a
    kernel loaded into the wrong mode runs without error and gives wrong outputs.

    With ``K = (k - 1) * kernel_dilation + 1`` the output size is
    ``(n - 1) * stride + 1 + low + high - K + 1``:

    * ``'SAME'``: output ``n * stride`` (as ``lax.conv_transpose``);
    * ``'VALID'``: output ``n * stride + max(K - stride, 0)`` (idem);
    * ``'CAUSAL'`` (1-D): ``(K - 1, stride - 1)``, output ``n * stride`` where output
      ``t`` depends only on inputs ``j`` with ``j * stride <= t``;
    * explicit ``(low, high)`` pairs (or ints) are those pads themselves.

    ``output_padding`` adds that many cells on the high side of every (or each) axis; it
    must be smaller than ``max(stride, kernel_dilation)``.

    Porting weights (each recipe is checked by a test):

    * jax-blox 0.1.6: nothing to convert (see docs/migrating.md).
    * Flax ``nn.ConvTranspose(features, k, strides, padding)`` (``transpose_kernel=False``,
      kernel ``(*k, C_in, C_out)``): ``kernel = flax_kernel.swapaxes(-1, -2)`` (same
      padding); with Flax's ``transpose_kernel=True`` (kernel ``(*k, C_out, C_in)``) use
      ``transpose_kernel=True`` and the kernel as it is.
    * PyTorch ``ConvTranspose2d(C_in, C_out, k, stride=s, padding=p, output_padding=op,
      dilation=d, groups=G)``, weight ``(C_in, C_out // G, kh, kw)``: ``ConvTranspose(graph,
      (k, k), C_out, rng, strides=s, padding=K - 1 - p, output_padding=op,
      kernel_dilation=d, feature_group_count=G, transpose_kernel=True)`` with ``K = d *
      (k - 1) + 1`` and ``kernel = weight.permute(2, 3, 1, 0)``; or, in the default mode,
      ``kernel = weight.reshape(G, C_in // G, C_out // G, kh, kw).flip(3, 4).permute(3, 4,
      0, 2, 1).reshape(kh, kw, C_out, C_in // G)`` (for G = 1:
      ``weight.flip(2, 3).permute(2, 3, 1, 0)``).

    Args:
      graph: this module's node.
      kernel_size: an int (1-D) or a tuple of ints, one per spatial axis.
      output_channels: C_out.
      rng: the `Rng` that provides initialization keys.
      strides: an int or one per spatial axis (the upsampling factor).
      padding: ``'SAME'`` (default), ``'VALID'``, ``'CAUSAL'`` (1-D) or explicit pads.
      kernel_dilation: an int or one per spatial axis.
      feature_group_count: G; both channel counts must be divisible by it.
      use_bias: add a bias per output channel.
      kernel_init: default: jax-blox's ``lecun_normal()`` on ``(*k, C_out, C_in // G)``,
        a truncated normal with variance ``1 / (prod(k) * C_out)`` (the same variance
        with ``transpose_kernel=True``).
      bias_init: default zeros.
      kernel_metadata, bias_metadata: stored with the parameters.
      output_padding: an int or one per spatial axis (default 0).
      transpose_kernel: False (default): Flax's semantics, kernel
        ``(*k, C_out, C_in // G)`` used as stored. True: PyTorch's, kernel
        ``(*k, C_out // G, C_in)`` flipped spatially (the gradient of a `Conv` with
        that kernel).
      channels_first: NCHW-style inputs and outputs (same parameters).
      dtype: the compute dtype (default: promotion of input and param dtypes).
      param_dtype: the dtype parameters are created in (default float32).

    The arguments up to ``bias_metadata`` may be positional; the others are
    keyword-only.

    Parameters: ``<path>/kernel`` ``(*kernel_size, C_out, C_in // G)`` (default;
    ``(*kernel_size, C_out // G, C_in)`` with ``transpose_kernel=True``) and
    ``<path>/bias`` ``(C_out,)``.

    Call: ``up(params, x, precision=None, *, out_sharding=None)``; sharded inputs,
    kernels and ``out_sharding`` as for `Conv`.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> up = bx.ConvTranspose(g / 'up', (4, 4), 6, rng, strides=2, feature_group_count=2)
    >>> y, params = up(rng.seed(bx.Params(), seed=0), jnp.ones((2, 7, 7, 16)))
    >>> y.shape, params[('net', 'up', 'kernel')].value.shape
    ((2, 14, 14, 6), (4, 4, 6, 8))
    """

    _kind = "ConvTranspose"

    def __init__(
        self,
        graph: Graph,
        kernel_size: int | Sequence[int],
        output_channels: int,
        rng: Rng | None,
        strides: int | Sequence[int] = 1,
        padding: PaddingLike = "SAME",
        kernel_dilation: int | Sequence[int] = 1,
        feature_group_count: int = 1,
        use_bias: bool = True,
        kernel_init: Callable = _default_transpose_kernel_init,
        bias_init: Callable = _default_bias_init,
        kernel_metadata: dict | None = None,
        bias_metadata: dict | None = None,
        *,
        output_padding: int | Sequence[int] = 0,
        transpose_kernel: bool = False,
        channels_first: bool = False,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        if not isinstance(transpose_kernel, bool):
            raise TypeError(
                f"ConvTranspose '{self.path_str}': transpose_kernel must be a bool, got "
                f"{transpose_kernel!r}."
            )
        self.transpose_kernel = transpose_kernel
        one_d = isinstance(kernel_size, int) or _len(kernel_size) == 1
        allowed = ("SAME", "VALID", "CAUSAL") if one_d else ("SAME", "VALID")
        self._configure(
            kernel_size,
            output_channels,
            rng,
            strides,
            padding,
            kernel_dilation,
            feature_group_count,
            use_bias,
            kernel_init,
            bias_init,
            kernel_metadata,
            bias_metadata,
            channels_first,
            dtype,
            param_dtype,
            allowed,
        )
        n = self.num_spatial_dims
        if isinstance(output_padding, int) and not isinstance(output_padding, bool):
            output_padding = (output_padding,) * n
        op = tuple(output_padding)
        if len(op) != n or not all(isinstance(v, int) and v >= 0 for v in op):
            raise ValueError(
                f"{self._where}: output_padding must be a non-negative int or {n} of them, "
                f"got {output_padding!r}."
            )
        for i, (v, s, d) in enumerate(zip(op, self.strides, self.kernel_dilation, strict=True)):
            if v >= max(s, d):
                raise ValueError(
                    f"{self._where}: output_padding[{i}]={v} must be smaller than "
                    f"max(stride, kernel_dilation)={max(s, d)} (strides={self.strides}); "
                    "larger values add outputs that see no input. Use explicit padding to "
                    "grow the output further."
                )
        self.output_padding = op
        if transpose_kernel and kernel_init is _default_transpose_kernel_init:
            self.kernel_init = _transpose_kernel_init(self.feature_group_count)
        # Default: the kernel (*k, C_out, C_in // G) as stored ("OI"). transpose_kernel:
        # flipped, and for G > 1 regrouped to (*k, C_in // G, C_out) ("IO").
        grouped_tk = transpose_kernel and self.feature_group_count > 1
        self._dn = _dimension_numbers(n, self.channels_first, "IO" if grouped_tk else "OI")

    def output_pads(self) -> list[tuple[int, int]]:
        """The ``(low, high)`` padding of the stride-dilated input on each spatial axis."""
        windows = [
            dilate(k, d) for k, d in zip(self.kernel_size, self.kernel_dilation, strict=True)
        ]
        pads = transpose_pads(self.padding, windows, self.strides)
        return [(lo, hi + op) for (lo, hi), op in zip(pads, self.output_padding, strict=True)]

    def _check_output_size(self, x: jax.Array, spatial, pads) -> None:
        """Refuses padding that leaves a spatial axis of the output empty."""
        for i in range(self.num_spatial_dims):
            size = dilate(spatial[i], self.strides[i])
            window = dilate(self.kernel_size[i], self.kernel_dilation[i])
            lo, hi = pads[i]
            if size + lo + hi < window:
                raise ValueError(
                    f"{self._where}: spatial axis {i} (input shape {tuple(x.shape)}) with "
                    f"padding ({lo}, {hi}) gives an empty output (dilated kernel size "
                    f"{window}). Use larger padding values or a smaller kernel."
                )

    def _kernel_shape(self, params: Params, x: jax.Array, cin: int) -> tuple[int, ...]:
        """The kernel's stored shape in this layer's layout (`transpose_kernel`); refuses a
        stored kernel in the other layout, naming the fix."""
        g, cout = self.feature_group_count, self.output_channels
        tk_shape = self.kernel_size + (cout // g, cin)
        kshape = tk_shape if self.transpose_kernel else self.kernel_size + (cout, cin // g)
        other = self.kernel_size + (cout, cin // g) if self.transpose_kernel else tk_shape
        existing = getattr(self.peek_param(params, "kernel"), "shape", None)
        if existing is not None and tuple(existing) == other != kshape:
            raise ValueError(
                f"{self._where}: its kernel has shape {tuple(existing)} in params, the "
                f"layout of transpose_kernel={not self.transpose_kernel}, but this layer has "
                f"transpose_kernel={self.transpose_kernel} and needs {kshape} for input "
                f"shape {tuple(x.shape)}. Construct it with transpose_kernel="
                f"{not self.transpose_kernel} (PyTorch weights: True), or convert the "
                "kernel as the ConvTranspose docstring shows."
            )
        return kshape

    def __call__(
        self,
        params: Params,
        x: jax.Array,
        precision: Any = None,
        *,
        out_sharding: NamedSharding | PartitionSpec | None = None,
    ) -> tuple[jax.Array, Params]:
        """Applies the transposed convolution; returns ``(y, params)``.
        ``out_sharding``: the output's sharding (as for `Conv`)."""
        x = jnp.asarray(x)
        batch, cin, spatial = self._check_input(x)
        n, g, cout = self.num_spatial_dims, self.feature_group_count, self.output_channels
        pads = self.output_pads()
        self._check_output_size(x, spatial, pads)
        kshape = self._kernel_shape(params, x, cin)
        perm = self._permute()
        self._check_kernel(
            params,
            kshape,
            x,
            "(*kernel_size, C_out // G, C_in)"
            if self.transpose_kernel
            else "(*kernel_size, C_out, C_in // G)",
            -2,
            (cin, cout // g) + self.kernel_size,
            f"(C_in, C_out // G, *kernel_size): store kernel = weight.permute({perm})"
            + (
                ""
                if self.transpose_kernel
                else " and construct the layer with transpose_kernel=True (PyTorch's semantics; "
                "the default mode needs the spatially flipped kernel, see the ConvTranspose "
                "docstring)"
            ),
        )
        kernel, params = self.get_param(
            params,
            "kernel",
            kshape,
            self.kernel_init,
            dtype=self.param_dtype,
            metadata=self.kernel_metadata,
            rng=self.rng,
        )
        cd = compute_dtype(x, kernel.dtype, self.dtype)
        rhs = kernel.astype(cd)
        if self.transpose_kernel:
            rhs = lax.rev(rhs, tuple(range(n)))
        if self.transpose_kernel and g > 1:
            # (*k, C_out/G, G, C_in/G) -> (*k, C_in/G, G, C_out/G) -> (*k, C_in/G, C_out).
            rhs = rhs.reshape(self.kernel_size + (cout // g, g, cin // g))
            rhs = jnp.swapaxes(rhs, n, n + 2).reshape(self.kernel_size + (cin // g, cout))
        y, shardings = self._convolve(
            x.astype(cd),
            rhs,
            batch,
            out_sharding,
            window_strides=(1,) * n,
            padding=pads,
            lhs_dilation=self.strides,
            rhs_dilation=self.kernel_dilation,
            feature_group_count=g,
            precision=precision,
        )
        return self._finish(params, y, batch, cd, shardings)
