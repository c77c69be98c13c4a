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
from blox.core._sharding import (
    dot_out_sharding,
    reshard_dim,
    resolve_out_sharding,
    row_out_sharding,
)
from blox.nn._dtype import compute_dtype

__all__ = ["Linear", "MLP"]

_default_kernel_init = jax.nn.initializers.lecun_normal()
_default_bias_init = jax.nn.initializers.zeros

# The kernel dimension a tensor-parallel split shards: columns (output features), rows
# (input features), or none (every device holds the whole kernel).
TP_SPLITS = {"column": 1, "row": 0, "replicated": None}

_TP_AXIS_NOT_IN_MESH = (
    "{where}: tp_axis={axis!r} is not an axis of the enclosing jax.shard_map's mesh (axes "
    "{names}), so the layer cannot split its {what} over it. Build the layer with "
    "tp_axis set to the mesh's model axis (one of {names}), or call it inside a "
    "shard_map whose mesh has an axis {axis!r}; with tp_axis=None it computes unsharded."
)


def axis_is_bound(axis: str, error: str, **fields: Any) -> bool:
    """Whether an enclosing ``jax.shard_map`` binds the mesh axis `axis` (manual mode).
    Inside a ``shard_map`` whose mesh has no such axis at all, raises ``ValueError(
    error.format(axis=..., names=<the mesh's axes>, **fields))``: the layer would
    otherwise compute the unsharded math on a shard without a word."""
    from blox.parallel._mesh import bound_axes  # parallel imports nn

    if axis in bound_axes():
        return True
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.manual_axes and axis not in mesh.axis_names:
        raise ValueError(error.format(axis=axis, names=tuple(mesh.axis_names), **fields))
    return False


def tp_axis_size(axis: str | None, where: str, what: str = "parameters") -> int | None:
    """The size of the tensor-parallel axis `axis` where it is bound by an enclosing
    ``jax.shard_map`` (manual mode: parameters and activations are this device's
    shards), else None (global mode: the layer computes the unsharded math, e.g. under
    ``jax.jit`` on sharded arrays). Raises, naming `where`, the axis and the fix, when
    `axis` is not an axis of the enclosing ``shard_map``'s mesh at all, and under
    ``check_vma=False`` (autodiff would then not sum the gradient of a replicated input
    over the axis)."""
    if axis is None:
        return None
    from blox.parallel._mesh import check_vma_enabled  # parallel imports nn

    if not axis_is_bound(axis, _TP_AXIS_NOT_IN_MESH, where=where, what=what):
        return None
    if not check_vma_enabled():
        raise ValueError(
            f"{where}: tensor-parallel layers need jax.shard_map(..., check_vma=True) (the "
            "default): with check_vma=False autodiff does not sum the gradient of a "
            "replicated input over the model axis, and gradients come out wrong. Remove "
            "check_vma=False."
        )
    return jax.lax.axis_size(axis)


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
      tp_axis: the mesh axis of tensor parallelism (Megatron-style), or None (default).
      tp_split: with ``tp_axis``, which kernel dimension is split over it: ``'column'``
        (output features), ``'row'`` (input features) or ``'replicated'``.

    Tensor parallelism (``tp_axis`` set): inside a ``jax.shard_map`` that binds
    ``tp_axis`` (M devices) the parameters are this device's shards and the layer
    computes its part. Column: the full input ``(..., D_in)`` -> this device's slice
    ``(..., D_out / M)``, kernel ``(D_in, D_out / M)``, bias ``(D_out / M,)``; no
    communication in forward (autodiff sums the input's gradient over the axis in
    backward). Row: this device's input slice ``(..., D_in / M)`` (a column layer's
    output) -> ``(..., D_out)`` with **one** ``psum`` over the axis, kernel
    ``(D_in / M, D_out)``, the bias (replicated) added after it. Replicated: the whole
    kernel on every device, no communication. Outside such a ``shard_map`` (e.g. under
    ``jax.jit`` on arrays sharded by the rules) the layer computes the unsharded math; a
    row split on an Explicit mesh passes the matmul the ``out_sharding`` JAX needs (batch
    dims kept, features replicated). Parameter paths and global shapes do not change
    with the split; the rules (`blox.parallel.transformer_tp_rules`) say how they are
    sharded. `blox.parallel.ColumnParallelLinear` and
    `blox.parallel.RowParallelLinear` are this layer with the split fixed.

    Call: ``layer(params, x, precision=None, *, out_sharding=None, tp_split=None)``
    (``tp_split`` overrides the constructor's for this call, as `MultiHeadAttention`
    does for key/value heads that are replicated rather than split). On a sharded
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
        tp_axis: str | None = None,
        tp_split: str = "column",
    ):
        super().__init__(graph)
        where = self._where()
        if not isinstance(output_size, int) or isinstance(output_size, bool) or output_size <= 0:
            raise ValueError(f"{where}: output_size must be a positive int, got {output_size!r}.")
        if tp_axis is not None and not isinstance(tp_axis, str):
            raise TypeError(f"{where}: tp_axis must be a mesh-axis name or None, got {tp_axis!r}.")
        self._check_split(tp_split)
        self.tp_axis = tp_axis
        self.tp_split = tp_split
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
        tp_split: str | None = None,
    ) -> tuple[jax.Array, Params]:
        """Applies the layer. ``x``: ``(..., D_in)``; returns ``((..., D_out), params)``.
        ``out_sharding``: the output's sharding; ``tp_split``: this call's split (see the
        class docstring)."""
        x = jnp.asarray(x)
        if x.ndim == 0:
            raise ValueError(
                f"{self._where()}: input must not be scalar; expected shape "
                "(..., in_features). Use x[None] for a single feature."
            )
        split = self.tp_split if tp_split is None else self._check_split(tp_split)
        m = tp_axis_size(self.tp_axis, self._where())
        if m is not None:
            if out_sharding is not None:
                raise ValueError(
                    f"{self._where()}: out_sharding has no meaning inside jax.shard_map over "
                    f"tp_axis {self.tp_axis!r} (the output is this device's block); drop it."
                )
            return self._manual_call(params, x, precision, split, m)
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
        if out_sharding is not None:
            dot_sharding, constraint = self._out_sharding(out_sharding, x.ndim)
        elif self.tp_axis is not None and split == "row":
            dot_sharding, constraint = row_out_sharding(x, self.tp_axis), None
        else:
            dot_sharding, constraint = dot_out_sharding(x, kernel), None
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

    def _where(self) -> str:
        return f"{type(self).__name__} '{self.path_str}'"

    def _check_split(self, split: str) -> str:
        if split not in TP_SPLITS:
            raise ValueError(
                f"{self._where()}: tp_split must be one of {tuple(TP_SPLITS)}, got {split!r}."
            )
        return split

    def _manual_call(
        self, params: Params, x: jax.Array, precision: Any, split: str, m: int
    ) -> tuple[jax.Array, Params]:
        """Inside ``shard_map`` over ``tp_axis`` (size `m`): this device's part."""
        dim = TP_SPLITS[split]
        d_in = x.shape[-1] * m if split == "row" else x.shape[-1]
        kernel = self._local_param(params, "kernel", (d_in, self.output_size), dim, m)
        cd = compute_dtype(x, kernel.dtype, self.dtype)
        y = jnp.dot(x.astype(cd), kernel.astype(cd), precision=precision)
        if split == "row":
            y = jax.lax.psum(y, self.tp_axis)  # the one all-reduce of a row split
        if self.use_bias:
            bias_dim = 0 if split == "column" else None
            bias = self._local_param(params, "bias", (self.output_size,), bias_dim, m)
            y = y + jnp.expand_dims(bias.astype(cd), tuple(range(y.ndim - 1)))
        return y, params

    def _local_param(
        self, params: Params, name: str, shape: tuple, dim: int | None, m: int
    ) -> jax.Array:
        """This device's block of the parameter of global shape `shape`, split over
        ``tp_axis`` (size `m`) on `dim` (None: replicated), checked against what it must
        be."""
        where = self._where()
        path = self.param_path(name)
        value = params.value(path)
        if value is None:
            raise ValueError(
                f"{where}: parameter '{format_path(path)}' is missing inside shard_map. "
                "Create the params outside (a global init, e.g. jax.jit(init, out_shardings="
                "bp.param_shardings(...))) and pass them in with in_specs from "
                "bp.param_specs(params, rules)."
            )
        local = list(shape)
        if dim is not None:
            if shape[dim] % m:
                raise ValueError(
                    f"{where}: dimension {dim} of '{name}' {tuple(shape)} (size {shape[dim]}) "
                    f"is not divisible by the size {m} of model axis {self.tp_axis!r}. Choose "
                    f"sizes divisible by {m} or a smaller model axis."
                )
            local[dim] //= m
        if tuple(value.shape) != tuple(local):
            split = f"split over {self.tp_axis!r} ({m}) on dimension {dim}"
            split = "replicated" if dim is None else split
            raise ValueError(
                f"{where}: inside shard_map '{name}' has local shape {tuple(value.shape)}, "
                f"expected {tuple(local)} (full {tuple(shape)}, {split}). Pass the params "
                "with in_specs=bp.param_specs(params, bp.transformer_tp_rules(...)) (or "
                "rules that shard it this way)."
            )
        return value

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
      tp_axis: tensor parallelism over this mesh axis (Megatron-style; default None):
        the layers alternate column- and row-split (`Linear`'s ``tp_split``), so inside
        a ``jax.shard_map`` binding the axis each pair does one all-reduce in forward
        and the hidden activations never leave the device. Needs an even number of
        layers; `blox.parallel.ParallelMLP` is the two-layer case.

    Parameters: ``<path>/linear_<i>/kernel`` and ``<path>/linear_<i>/bias`` for each
    layer ``i`` (the same with or without ``tp_axis``).

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
        tp_axis: str | None = None,
    ):
        super().__init__(graph)
        output_sizes = tuple(output_sizes)
        where = f"{type(self).__name__} '{self.path_str}'"
        if not output_sizes:
            raise ValueError(f"{where}: output_sizes must not be empty.")
        if tp_axis is not None and len(output_sizes) % 2:
            raise ValueError(
                f"{where}: with tp_axis={tp_axis!r} the layers alternate column- and "
                f"row-split, so their number must be even; got output_sizes={output_sizes}. "
                "Add a layer, or keep the odd one outside the tensor-parallel MLP."
            )
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
                tp_axis=tp_axis,
                # (the split means nothing without an axis: the default then, so that
                # the layer reads as a plain Linear)
                tp_split=("column", "row")[i % 2] if tp_axis is not None else "column",
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
