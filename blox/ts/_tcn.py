"""`TCN`: residual blocks of dilated causal 1-D convolutions, and the `TCNBlocks` stack."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from blox.core import Graph, Module, Params, Rng
from blox.nn import Conv
from blox.ts._models import SysIdModel

__all__ = ["TCN", "TCNBlocks"]


class TCNBlocks(Module):
    """Residual blocks of dilated causal convolutions (Bai et al., 2018), channels last.

    Legend: B batch, T time, F input channels, C ``channels``, k ``kernel_size``.

    Block ``i`` with dilation ``d_i``::

        h = act(conv_a(x))             # causal, kernel k, dilation d_i, C channels
        h = act(conv_b(h))             # causal, kernel k, dilation d_i
        x = act(h + proj(x))           # proj: a 1x1 conv where F != C, else identity

    Output ``t`` depends on inputs ``t - R + 1 .. t`` only, ``R =`` `receptive_field`
    ``= 1 + 2 (k - 1) sum(d_i)``.

    Args:
      graph: this module's node.
      channels: C.
      rng: the `Rng` for initialization.
      kernel_size: k.
      dilations: one dilation per block (default ``(1, 2, 4, 8)``).
      activation: default ``jax.nn.relu``.
      dtype, param_dtype: passed to every `blox.nn.Conv`.

    Shapes: ``[B, T, F]`` -> ``[B, T, C]``.

    Parameters: ``<path>/block_<i>/conv_a/{kernel,bias}`` ``(k, F_i, C)``, ``(C,)``;
    ``conv_b`` ``(k, C, C)``; ``<path>/block_0/proj/{kernel,bias}`` ``(1, F, C)`` when
    ``F != C``.

    >>> import blox as bx, jax.numpy as jnp
    >>> from blox.ts import TCNBlocks
    >>> g = bx.Graph('m'); rng = bx.Rng(g / 'rng')
    >>> tcn = TCNBlocks(g / 'tcn', 16, rng, kernel_size=3, dilations=(1, 2))
    >>> h, params = tcn(rng.seed(bx.Params(), seed=0), jnp.ones((2, 30, 3)))
    >>> h.shape, tcn.receptive_field
    ((2, 30, 16), 13)
    """

    def __init__(
        self,
        graph: Graph,
        channels: int,
        rng: Rng | None,
        *,
        kernel_size: int = 3,
        dilations: Sequence[int] = (1, 2, 4, 8),
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        dilations = tuple(dilations)
        for name, v in [("channels", channels), ("kernel_size", kernel_size)] + [
            (f"dilations[{i}]", d) for i, d in enumerate(dilations)
        ]:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(
                    f"TCNBlocks '{self.path_str}': {name} must be a positive int, got {v!r}."
                )
        if not dilations:
            raise ValueError(
                f"TCNBlocks '{self.path_str}': dilations must name at least one block, "
                "e.g. (1, 2, 4, 8)."
            )
        self.channels, self.kernel_size, self.dilations = channels, kernel_size, dilations
        self.activation = activation
        self._common = dict(dtype=dtype, param_dtype=param_dtype)
        self.blocks = []
        block_graphs = [graph / f"block_{i}" for i in range(len(dilations))]
        for bg, d in zip(block_graphs, dilations, strict=True):
            conv = dict(padding="CAUSAL", kernel_dilation=d, **self._common)
            self.blocks.append(
                (
                    Conv(bg / "conv_a", kernel_size, channels, rng, **conv),
                    Conv(bg / "conv_b", kernel_size, channels, rng, **conv),
                )
            )
        # Used only when the input has F != C channels (block 0's residual path).
        self.proj = Conv(block_graphs[0] / "proj", 1, channels, rng, **self._common)

    @property
    def receptive_field(self) -> int:
        """``R = 1 + 2 (k - 1) sum(dilations)``: output t sees inputs t - R + 1 .. t."""
        return 1 + 2 * (self.kernel_size - 1) * sum(self.dilations)

    def __call__(self, params: Params, x: ArrayLike) -> tuple[jax.Array, Params]:
        """``x`` ``[B, T, F]`` -> ``(h [B, T, C], params)``."""
        x = jnp.asarray(x)
        if x.ndim != 3:
            raise ValueError(
                f"TCNBlocks '{self.path_str}': input must be [B, T, F], got shape {tuple(x.shape)}."
            )
        for i, (conv_a, conv_b) in enumerate(self.blocks):
            h, params = conv_a(params, x)
            h, params = conv_b(params, self.activation(h))
            h = self.activation(h)
            if i == 0 and x.shape[-1] != self.channels:
                x, params = self.proj(params, x)
            x = self.activation(h + x.astype(h.dtype))
        return x, params


class TCN(SysIdModel):
    """A temporal convolutional simulation model: raw ``u`` in, raw ``y`` out.

    Legend: B batch, T time, Cu input / Cy output channels, C ``channels``.

    Shapes: ``u [B, T, Cu]`` -> ``y_hat [B, T, Cy]`` (the state is ``None``).

    ``y = denorm(head(TCNBlocks(norm(u))))``. Causal: output ``t`` depends on ``u``
    at ``t - R + 1 .. t`` only (``R`` = `receptive_field`, reported), so the first
    ``R - 1`` outputs of a window see zero-padded history: set ``n_skip >= R - 1`` to
    keep them out of the loss. Stateless: ``state`` is always ``None``, and a truncated
    BPTT chunk sees only itself.

    Args:
      graph: this model's node.
      u_stats, y_stats: the training statistics (see `SysIdModel`).
      rng: the `Rng` for initialization.
      channels: C.
      kernel_size: k.
      dilations: one per residual block (default ``(1, 2, 4, 8)``).
      activation: default ``jax.nn.relu``.
      n_skip: warm-up steps excluded from the loss.
      dtype, param_dtype: see `SysIdModel`.

    Returns (``model(params, u)``): ``((y [B, T, Cy], None), params)``. ``prev_state``
    must be ``None`` (the model keeps no state); ``is_reset`` is accepted for the
    recipes' common call and ignored.

    Parameters: the normalizers, ``<path>/tcn/...`` (`TCNBlocks`) and
    ``<path>/head/{kernel,bias}`` ``(C, Cy)``, ``(Cy,)``.

    >>> import blox as bx, jax.numpy as jnp
    >>> from blox.ts import TCN
    >>> g = bx.Graph('m'); rng = bx.Rng(g / 'rng')
    >>> model = TCN(g / 'tcn', ([0.0], [1.0]), ([0.0], [1.0]), rng, channels=8)
    >>> (y, state), params = model(rng.seed(bx.Params(), seed=0), jnp.ones((2, 50, 1)))
    >>> y.shape, state, model.receptive_field
    ((2, 50, 1), None, 61)
    """

    def __init__(
        self,
        graph: Graph,
        u_stats: Any,
        y_stats: Any,
        rng: Rng | None,
        *,
        channels: int = 32,
        kernel_size: int = 3,
        dilations: Sequence[int] = (1, 2, 4, 8),
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        n_skip: int = 0,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(
            graph, u_stats, y_stats, n_skip=n_skip, dtype=dtype, param_dtype=param_dtype
        )
        self.tcn = self._child(
            TCNBlocks,
            "tcn",
            channels,
            rng,
            kernel_size=kernel_size,
            dilations=dilations,
            activation=activation,
        )
        self.head = self._output_linear(rng)

    @property
    def receptive_field(self) -> int:
        """The receptive field of the convolution stack, in samples."""
        return self.tcn.receptive_field

    def _core(self, params, z, prev_state, is_reset):
        # ``is_reset`` is accepted for the recipes' common call and ignored.
        if prev_state is not None:
            raise TypeError(
                f"{self._where}: a TCN keeps no state between calls, got a prev_state of "
                f"type {type(prev_state).__name__}; pass None (truncated BPTT does not "
                "apply: give the TCN whole windows of at least receptive_field samples)."
            )
        h, params = self.tcn(params, z)
        out, params = self.head(params, h)
        return (out, None), params
