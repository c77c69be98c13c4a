"""Dense layers: `Linear` and `MLP`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from blox.core import Graph, Module, Params, Rng
from blox.core._module import is_local_shard, stored_shape_error, torch_weight_hint
from blox.core._params import format_path
from blox.core._sharding import dot_out_sharding, reshard_dim, resolve_out_sharding
from blox.nn._dtype import compute_dtype

__all__ = ["Linear", "MLP"]

_default_kernel_init = jax.nn.initializers.lecun_normal()
_default_bias_init = jax.nn.initializers.zeros


class Linear(Module):
    """An affine map over the last axis: ``y = x @ kernel + bias``.

    Shapes: ``(..., D_in)`` -> ``(..., output_size)``; any number of leading axes.

    Args:
      graph: this module's node.
      output_size: ``D_out``.
      rng: the `Rng` that provides initialization keys.
      use_bias: add a bias.
      kernel_init: ``init(key, shape, dtype)``; default LeCun normal (fan-in).
      bias_init: default zeros.
      kernel_metadata: stored with the kernel, e.g. ``{'sharding': (None, 'model')}``.
      bias_metadata: stored with the bias.
      dtype: the compute dtype; default: the promotion of the input and param dtypes.
      param_dtype: the dtype parameters are created in (default float32).

    Call: ``layer(params, x, precision=None, *, out_sharding=None)``. On a sharded
    ``x``/kernel the layer computes the unsharded math. ``out_sharding`` (a
    ``NamedSharding``, or a ``PartitionSpec`` under ``jax.set_mesh``) places the output:
    on an *Explicit* mesh it is the matmul's ``out_sharding`` (the bias is resharded to
    its feature spec), on an *Auto* mesh a ``with_sharding_constraint``. When it is None
    and the contracting dimension is sharded in both ``x`` and the kernel on an Explicit
    mesh (row parallelism, e.g. kernel on ``P('model', None)`` and ``x`` on
    ``P('data', 'model')``), where JAX would raise ``ShardingTypeError``, the layer
    infers one: ``x``'s batch-dim spec kept, the features following the kernel's
    columns when those axes are free, else replicated (the compiler all-reduces). Off
    a mesh and on Auto meshes nothing is added.

    Parameters: ``<path>/kernel`` ``(D_in, D_out)``, ``<path>/bias`` ``(D_out,)``.
    PyTorch's ``nn.Linear.weight`` is ``(D_out, D_in)``: store ``weight.T``. A stored
    kernel whose shape cannot fit this layer (not ``(D_in, output_size)``) raises a
    ``ValueError`` that names its path, its shape and the expected one, and says when it
    is the transpose; a square kernel stored transposed cannot be detected.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> layer = bx.Linear(g / 'fc', 3, rng)
    >>> y, params = layer(rng.seed(bx.Params(), seed=0), jnp.ones((2, 5)))
    >>> y.shape, params[('net', 'fc', 'kernel')].value.shape
    ((2, 3), (5, 3))
    """

    def __init__(
        self,
        graph: Graph,
        output_size: int,
        rng: Rng | None,
        use_bias: bool = True,
        kernel_init: Callable = _default_kernel_init,
        bias_init: Callable = _default_bias_init,
        kernel_metadata: dict | None = None,
        bias_metadata: dict | None = None,
        *,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        if not isinstance(output_size, int) or output_size <= 0:
            raise ValueError(
                f"Linear '{self.path_str}': output_size must be a positive int, got "
                f"{output_size!r}."
            )
        self.output_size = output_size
        self.rng = rng
        self.use_bias = use_bias
        self.kernel_init = kernel_init
        self.bias_init = bias_init
        self.kernel_metadata = kernel_metadata
        self.bias_metadata = bias_metadata
        self.dtype = dtype
        self.param_dtype = param_dtype

    def __call__(
        self,
        params: Params,
        x: jax.Array,
        precision: Any = None,
        *,
        out_sharding: NamedSharding | PartitionSpec | None = None,
    ) -> tuple[jax.Array, Params]:
        """Applies the layer. ``x``: ``(..., D_in)``; returns ``((..., D_out), params)``.
        ``out_sharding``: the output's sharding (see the class docstring)."""
        x = jnp.asarray(x)
        if x.ndim == 0:
            raise ValueError(
                f"Linear '{self.path_str}': input must not be scalar; expected shape "
                "(..., in_features). Use x[None] for a single feature."
            )
        in_features = x.shape[-1]
        self._check_kernel(params, x)
        kernel, params = self.get_param(
            params,
            "kernel",
            (in_features, self.output_size),
            self.kernel_init,
            dtype=self.param_dtype,
            metadata=self.kernel_metadata,
            rng=self.rng,
        )
        cd = compute_dtype(x, kernel.dtype, self.dtype)
        if out_sharding is None:
            dot_sharding, constraint = dot_out_sharding(x, kernel), None
        else:
            dot_sharding, constraint = self._out_sharding(out_sharding, x.ndim)
        y = jnp.dot(x.astype(cd), kernel.astype(cd), precision=precision, out_sharding=dot_sharding)
        if self.use_bias:
            bias, params = self.get_param(
                params,
                "bias",
                (self.output_size,),
                self.bias_init,
                dtype=self.param_dtype,
                metadata=self.bias_metadata,
                rng=self.rng,
            )
            bias = bias.astype(cd)
            if dot_sharding is not None:
                bias = reshard_dim(bias, 0, dot_sharding, x.ndim - 1)
            y = y + jnp.expand_dims(bias, tuple(range(y.ndim - 1)))
        if constraint is not None:
            y = jax.lax.with_sharding_constraint(y, constraint)
        return y, params

    def _out_sharding(
        self, out_sharding: Any, ndim: int
    ) -> tuple[NamedSharding | None, NamedSharding | None]:
        """A user's ``out_sharding`` as ``(matmul out_sharding, sharding constraint)``:
        the first on a mesh with Explicit axes, the second on an Auto mesh."""
        where = f"Linear '{self.path_str}'"
        return resolve_out_sharding(where, out_sharding, ndim, f"(..., {self.output_size})")

    def _check_kernel(self, params: Params, x: jax.Array) -> None:
        """A stored kernel that cannot fit ``output_size`` is blamed, not the input."""
        path = self.param_path("kernel")
        stored = getattr(params.value(path), "shape", None)
        if stored is None:
            return
        stored = tuple(stored)
        expected = (x.shape[-1], self.output_size)
        # Inside jax.shard_map a column shard (output features split over manual axes)
        # is accepted: hand-written tensor parallelism computes the local slice.
        columns_ok = len(stored) == 2 and (
            stored[1] == self.output_size or is_local_shard(stored[1:], expected[1:])
        )
        if not columns_ok:
            raise ValueError(
                stored_shape_error(
                    self,
                    path,
                    stored,
                    expected,
                    f" = (D_in, D_out) for input shape {tuple(x.shape)} and output_size="
                    f"{self.output_size}",
                    torch_weight_hint(path),
                )
            )
        if stored[0] != x.shape[-1]:
            raise ValueError(
                f"Linear '{self.path_str}' expects inputs of shape (..., {stored[0]}) (kernel "
                f"{stored} = (D_in, D_out)), got input shape {tuple(x.shape)}. Fix the input's "
                f"last dimension; or, if '{format_path(path)}' was made for another input "
                f"size, replace it with a {expected} kernel or re-initialize."
            )


class MLP(Module):
    """A stack of `Linear` layers with an activation between them.

    Shapes: ``(..., D_in)`` -> ``(..., output_sizes[-1])``.

    Args:
      graph: this module's node.
      output_sizes: the width of each layer, e.g. ``(64, 64, 10)``.
      rng: the `Rng` for initialization.
      activation: applied after every layer but the last (default ``jax.nn.relu``).
        This and every argument below are keyword-only.
      activate_final: also apply it after the last layer.
      use_bias: biases in every layer.
      kernel_init, bias_init: passed to each `Linear`.
      dtype, param_dtype: passed to each `Linear`.

    Parameters: ``<path>/linear_<i>/kernel`` and ``<path>/linear_<i>/bias`` for each
    layer ``i``.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> mlp = bx.MLP(g / 'mlp', (8, 2), rng)
    >>> y, params = mlp(rng.seed(bx.Params(), seed=0), jnp.ones((4, 3)))
    >>> y.shape
    (4, 2)
    """

    def __init__(
        self,
        graph: Graph,
        output_sizes: Sequence[int],
        rng: Rng | None,
        *,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.relu,
        activate_final: bool = False,
        use_bias: bool = True,
        kernel_init: Callable = _default_kernel_init,
        bias_init: Callable = _default_bias_init,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        output_sizes = tuple(output_sizes)
        if not output_sizes:
            raise ValueError(f"MLP '{self.path_str}': output_sizes must not be empty.")
        self.output_sizes = output_sizes
        self.activation = activation
        self.activate_final = activate_final
        self.layers = [
            Linear(
                graph.child(f"linear_{i}"),
                size,
                rng,
                use_bias=use_bias,
                kernel_init=kernel_init,
                bias_init=bias_init,
                dtype=dtype,
                param_dtype=param_dtype,
            )
            for i, size in enumerate(output_sizes)
        ]

    def __call__(
        self,
        params: Params,
        x: jax.Array,
        precision: Any = None,
        *,
        out_sharding: NamedSharding | PartitionSpec | None = None,
    ) -> tuple[jax.Array, Params]:
        """Applies the MLP. ``x``: ``(..., D_in)``; returns ``((..., D_out), params)``.
        ``out_sharding`` places the output (the last `Linear`'s ``out_sharding``); the
        hidden layers infer theirs as `Linear` does."""
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            os_ = out_sharding if i == last else None
            x, params = layer(params, x, precision=precision, out_sharding=os_)
            if i < last or self.activate_final:
                x = self.activation(x)
        return x, params
