"""Expert parallelism (EP): the experts of an `MoE` split over an ``expert`` mesh axis,
tokens moved to their experts and back with explicit all-to-all collectives inside the
user's ``jax.shard_map``.

Layout (as torchtitan and MaxText): the batch is split over ``(data, expert)`` (EP
borrows its devices from data parallelism), the expert kernels over ``expert`` on their
first dimension (`moe_ep_rules`), everything else replicated. Per MoE layer and step:

* **dense** dispatch (every backend): each device routes its tokens into a fixed
  ``(E, C, D)`` buffer (C per expert per device, the worst case ``C = tokens`` when the
  layer is dropless), one ``all_to_all`` sends expert ``e``'s rows to the device that
  holds ``e``, the local experts run, and one ``all_to_all`` brings the rows back: 2
  all-to-alls forward, 2 in backward.
* **ragged** dispatch (``dispatch='ragged'``, dropless only, backends with
  ``ragged_all_to_all``: GPU/TPU, not XLA:CPU): an ``all_gather`` of the ``(E,)``
  per-device token counts, then ``ragged_all_to_all`` of the rows sorted by expert
  (only the rows routed, no padding), the local experts as one grouped matmul, and a
  ``ragged_all_to_all`` back.

Gradients: `ep_value_and_grad` reduces the non-expert gradients over the data and
expert axes and the expert gradients over the data axes only (each expert shard lives
on one device per expert group; the all-to-all's transpose already brought it every
token's contribution).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from blox.core import Graph, Params, Rng
from blox.core._guards import check_reduce_dtype
from blox.core._params import Path, format_path
from blox.nn._moe import MoE, grouped_matmul
from blox.parallel._collectives import check_axis
from blox.parallel._dp import (
    _aux_finish,
    _check_rngs,
    _like,
    _settle_state,
    _to_varying,
    accumulate_microbatches,
)
from blox.parallel._mesh import bound_axes, check_vma_enabled, varying_axes
from blox.parallel._rng import fold_seeds, restore_seeds

__all__ = ["ExpertParallelMoE", "ep_value_and_grad", "moe_ep_rules", "ragged_dispatch_plan"]


def moe_ep_rules(axis: str = "expert", *, model_axis: str | None = None) -> list[tuple[str, tuple]]:
    """Sharding rules that split every `MoE`'s expert kernels over `axis` on their
    expert dimension: ``experts/gate`` and ``experts/up`` ``(E, D, F)`` and
    ``experts/down`` ``(E, F, D)`` get ``(axis, None, None)``. With `model_axis`
    (tensor parallelism inside each expert, `ExpertParallelMoE(model_axis=...)`) the
    hidden features F are also split over it: ``(axis, None, model_axis)`` and
    ``(axis, model_axis, None)``.

    Add rules for the rest of the model (e.g. a replicated catch-all ``('.*', None)``
    last); E must be divisible by the size of `axis` (and F by that of `model_axis`).

    >>> from blox import parallel as bp
    >>> bp.moe_ep_rules()
    [('experts/(gate|up|down)', ('expert', None, None))]
    >>> bp.moe_ep_rules(model_axis='model')
    [('experts/(gate|up)', ('expert', None, 'model')), ('experts/down', ('expert', 'model', None))]
    """
    for what, a in (("axis", axis), ("model_axis", model_axis)):
        if not isinstance(a, str) and not (what == "model_axis" and a is None):
            raise TypeError(f"moe_ep_rules: {what} must be a mesh-axis name, got {a!r}.")
    if model_axis is None:
        return [("experts/(gate|up|down)", (axis, None, None))]
    return [
        ("experts/(gate|up)", (axis, None, model_axis)),
        ("experts/down", (axis, model_axis, None)),
    ]


@functools.cache
def _ragged_supported(platform: str) -> bool:
    """Whether `platform` compiles ``ragged_all_to_all`` (probed once per platform:
    XLA:CPU answers UNIMPLEMENTED)."""
    device = next(d for d in jax.devices() if d.platform == platform)
    mesh = jax.sharding.Mesh(np.array([device]), ("probe",))
    one = jnp.ones((1,), jnp.int32)
    zero = jnp.zeros((1,), jnp.int32)

    def f(x):
        return jax.lax.ragged_all_to_all(
            x, jnp.zeros_like(x), zero, one, zero, one, axis_name="probe"
        )

    g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=P()))
    try:
        g.lower(jax.ShapeDtypeStruct((2,), jnp.float32)).compile()
    except Exception:  # noqa: BLE001 - any failure to compile means: not available
        return False
    return True


def ragged_dispatch_plan(counts: Any, me: Any) -> dict[str, Any]:
    """The offsets and sizes of the two ``ragged_all_to_all`` calls of ragged dispatch,
    for device `me` along the expert axis (N devices, E experts, ``L = E / N`` local
    experts; device ``j`` holds experts ``j L .. j L + L - 1``).

    Args:
      counts: ``(N, E)`` int, ``counts[i, e]`` = the rows device ``i`` sends to expert
        ``e`` (its tokens' choices of ``e``), the ``all_gather`` of every device's
        ``(E,)`` counts. Each device's rows are sorted by expert.
      me: this device's index along the axis.

    Returns:
      A dict of int32 arrays: ``'dispatch'`` and ``'combine'``, each the 4-tuple
      ``(input_offsets, send_sizes, output_offsets, recv_sizes)`` of length E (slot
      ``j L + l``: device ``j``, its local expert ``l``); ``'group_sizes'`` ``(L,)``, the
      rows this device receives per local expert. After dispatch, this device's rows
      are grouped by local expert, and within one expert by source device; combine
      sends them back to the positions they came from.

    Works on NumPy and traced values alike.

    >>> import numpy as np
    >>> from blox import parallel as bp
    >>> counts = np.array([[1, 2], [3, 0]])        # 2 devices, 2 experts (1 each)
    >>> plan = bp.ragged_dispatch_plan(counts, 1)
    >>> [np.asarray(a).tolist() for a in plan['dispatch']]
    [[0, 3], [3, 0], [1, 2], [2, 0]]
    """
    counts = jnp.asarray(counts, jnp.int32)
    n, e = counts.shape
    loc = e // n
    me = jnp.asarray(me, jnp.int32)
    mine = counts[me]  # (E,) rows I send to each expert
    input_offsets = jnp.cumsum(mine) - mine
    # On device j, the block of local expert l holds every source's rows for it: its
    # start is the rows of j's earlier local experts, plus the earlier sources' rows.
    per_dst = counts.reshape(n, n, loc)  # [src, dst, local]
    totals = jnp.sum(per_dst, axis=0)  # [dst, local]
    block_start = jnp.cumsum(totals, axis=1) - totals  # [dst, local]
    before_src = jnp.cumsum(per_dst, axis=0) - per_dst  # [src, dst, local]
    output_offsets = (block_start + before_src[me]).reshape(e)
    recv_sizes = per_dst[:, me, :].reshape(e)  # slot i L + l: from source i, my expert l
    dispatch = (input_offsets, mine, output_offsets, recv_sizes)
    # Combine: the same blocks in reverse. I send back, for each source i and local
    # expert l, the block where i's rows for l landed here, to where i took them from.
    my_block = block_start[me][None, :] + before_src[:, me, :]  # [src, local]
    src_offsets = jnp.cumsum(counts, axis=1) - counts  # [src, E]: each source's inputs
    back_out = src_offsets.reshape(n, n, loc)[:, me, :]  # [src, local]
    combine = (
        my_block.reshape(e),
        recv_sizes,
        back_out.reshape(e),
        mine,
    )
    as32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return {
        "dispatch": tuple(map(as32, dispatch)),
        "combine": tuple(map(as32, combine)),
        "group_sizes": as32(totals[me]),
    }


class ExpertParallelMoE(MoE):
    """An `MoE` whose experts are split over the mesh axis `axis` (expert parallelism).

    Shapes: ``x (..., D)`` -> ``(y (..., D), aux)``, as `MoE`; inside ``shard_map``
    ``x`` is this device's tokens.

    Same constructor, call, parameters (paths and full shapes) and ``aux`` as `MoE`, plus
    `axis` and `dispatch`, so one `Params` serves both. It runs in one of two modes,
    chosen by where it is called:

    * **Manual** (inside ``jax.shard_map`` with `axis` bound): the expert kernels are
      this device's ``E / N`` experts (pass them with ``in_specs`` from
      `moe_ep_rules`), the tokens are this device's shard of the batch, and the tokens
      travel to their experts and back with explicit all-to-alls (see the module
      docstring). Capacity is per device (the device's tokens are its ``groups``
      groups), so a one-device `MoE` with ``groups = N`` computes the same drops as EP
      over N devices with ``groups=1``. A dropless layer uses the worst-case capacity
      (``C`` = the device's tokens: nothing drops) with dense dispatch.
    * **Global** (no enclosing ``shard_map`` over `axis`): exactly `MoE`.

    Set ``token_axes`` to every axis the batch is split over (e.g. ``('data',
    'expert')``): the balancing loss, z-loss and loads are then global (``psum`` over
    them), as on one device.

    Args:
      graph, num_experts, hidden_size, rng: as `MoE`.
      axis: the expert mesh axis (keyword-only, as all that follow).
      model_axis: a mesh axis over which each expert's hidden features F are also split
        (tensor parallelism inside the experts: the tokens are replicated over it, the
        down projection's partial products summed with one ``psum``), or None. Use
        ``moe_ep_rules(axis, model_axis=...)``.
      dispatch: ``'dense'`` (all_to_all of fixed-size buffers, every backend) or
        ``'ragged'`` (``ragged_all_to_all`` of the routed rows only; dropless layers,
        on backends that implement it). ``'ragged'`` on a backend without it (XLA:CPU)
        raises a `ValueError` naming the backend, checked when the layer is traced.
      **kwargs: every `MoE` option.

    Parameters: as `MoE`; with `moe_ep_rules` the expert kernels are stored
    ``(E / N, D, F)`` / ``(E / N, F, D)`` per device.

    >>> import jax, jax.numpy as jnp, blox as bx
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> from blox import parallel as bp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> moe = bp.ExpertParallelMoE(g / 'moe', 8, 16, rng, top_k=2, token_axes='expert')
    >>> (y, aux), params = moe(rng.seed(bx.Params(), seed=0), jnp.ones((8, 4)))  # global
    >>> mesh = jax.make_mesh((8,), ('expert',))
    >>> rules = bp.moe_ep_rules() + [('.*', None)]
    >>> params = jax.device_put(params, bp.param_shardings(params, rules, mesh))
    >>> x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P('expert')))
    >>> run = jax.jit(jax.shard_map(lambda p, x: moe(p, x)[0][0], mesh=mesh,
    ...     in_specs=(bp.param_specs(params, rules, mesh), P('expert')), out_specs=P('expert')))
    >>> run(params, x).shape, params[('net', 'moe', 'experts', 'up')].value.sharding.spec
    ((8, 4), P('expert', None, None))
    """

    kind = "ExpertParallelMoE"

    def __init__(
        self,
        graph: Graph,
        num_experts: int,
        hidden_size: int,
        rng: Rng | None,
        *,
        axis: str = "expert",
        model_axis: str | None = None,
        dispatch: str = "dense",
        **kwargs: Any,
    ):
        super().__init__(graph, num_experts, hidden_size, rng, **kwargs)
        where = f"{self.kind} '{self.path_str}'"
        if not isinstance(axis, str):
            raise TypeError(f"{where}: axis must be a mesh-axis name, got {axis!r}.")
        if dispatch not in ("dense", "ragged"):
            raise ValueError(f"{where}: dispatch must be 'dense' or 'ragged', got {dispatch!r}.")
        if dispatch == "ragged" and self.capacity_factor is not None:
            raise ValueError(
                f"{where}: dispatch='ragged' moves only the routed rows and never drops; "
                "it needs capacity_factor=None. Use dispatch='dense' with a capacity."
            )
        if model_axis is not None and (not isinstance(model_axis, str) or model_axis == axis):
            raise ValueError(
                f"{where}: model_axis must be None or a mesh-axis name other than axis "
                f"{axis!r}, got {model_axis!r}."
            )
        self.axis = axis
        self.model_axis = model_axis
        self.dispatch = dispatch

    # -- mode ----------------------------------------------------------------------------

    def _manual(self) -> bool:
        if self.axis not in bound_axes():
            return False
        if not check_vma_enabled():
            raise ValueError(
                f"{self.kind} '{self.path_str}': expert parallelism needs "
                "jax.shard_map(..., check_vma=True) (the default), so that autodiff "
                "types the replicated parameters' gradients right. Remove check_vma=False."
            )
        return True

    def _size(self) -> int:
        return jax.lax.axis_size(self.axis)

    def _model_size(self) -> int:
        """The model-axis size (1 without tensor parallelism in the experts)."""
        if self.model_axis is None:
            return 1
        if self.model_axis not in bound_axes():
            raise ValueError(
                f"{self.kind} '{self.path_str}': model_axis {self.model_axis!r} is not bound "
                f"inside this shard_map (bound: {bound_axes()}). Add it to the mesh and the "
                "shard_map, or build the layer with model_axis=None."
            )
        return jax.lax.axis_size(self.model_axis)

    def _local_experts(self, w: dict, x: jax.Array, cd: Any, precision: Any, matmul: Callable):
        """This device's experts on their rows; with a model axis each device holds a
        slice of F, and the partial products of the down projection are summed over it
        (one psum, as a row-parallel layer)."""
        y = self._ffn(w, x, cd, precision, matmul)
        if self.model_axis is not None:
            y = jax.lax.psum(y, self.model_axis)
        return y

    def plan_capacity(self, num_tokens: int) -> int | None:
        if not self._manual():
            return super().plan_capacity(num_tokens)
        if self.capacity_factor is None:
            if self.dispatch == "ragged":
                self._check_ragged()
                return None
            return num_tokens // self.groups  # worst case: nothing drops
        return self.capacity(num_tokens)

    def _check_ragged(self) -> None:
        platform = jax.devices()[0].platform
        if not _ragged_supported(platform):
            raise ValueError(
                f"{self.kind} '{self.path_str}': dispatch='ragged' needs "
                f"jax.lax.ragged_all_to_all, which the {platform!r} backend does not "
                "implement (XLA:CPU answers UNIMPLEMENTED). Use dispatch='dense' (an "
                "all_to_all of fixed-size buffers, the same numbers)."
            )

    # -- parameters ----------------------------------------------------------------------

    def _expert_params(self, params: Params, d: int):
        if not self._manual():
            return super()._expert_params(params, d)
        n = self._size()
        m = self._model_size()
        where = f"{self.kind} '{self.path_str}'"
        if self.hidden_size % m:
            raise ValueError(
                f"{where}: hidden_size={self.hidden_size} is not divisible by the size {m} "
                f"of model axis {self.model_axis!r}. Use a hidden size divisible by {m}."
            )
        if self.num_experts % n:
            raise ValueError(
                f"{where}: num_experts={self.num_experts} is not divisible by the size "
                f"{n} of expert axis {self.axis!r}. Use a number of experts divisible by "
                f"{n}, or a smaller expert axis."
            )
        weights = {}
        for name, shape in self.expert_shapes(d).items():
            path = self.experts.param_path(name)
            value = params.value(path)
            local = (shape[0] // n,) + shape[1:]
            if m > 1:  # the hidden features F over the model axis
                f_dim = 1 if name == "down" else 2
                local = tuple(v // m if i == f_dim else v for i, v in enumerate(local))
            if value is None:
                raise ValueError(
                    f"{where}: parameter '{format_path(path)}' is missing inside shard_map. "
                    "Create the params outside (a global call) and pass them in with "
                    "in_specs=bp.param_specs(params, bp.moe_ep_rules() + ...)."
                )
            if tuple(value.shape) != local:
                raise ValueError(
                    f"{where}: inside shard_map '{format_path(path)}' has local shape "
                    f"{tuple(value.shape)}, expected {local} (full {shape}, split over "
                    f"{self.axis!r} ({n}) on dimension 0). Pass the params with "
                    "in_specs=bp.param_specs(params, bp.moe_ep_rules() + ...)."
                )
            weights[name] = value
        return weights, params

    # -- dense dispatch ------------------------------------------------------------------

    def expert_buffers(self, w: dict, buf: jax.Array, cd: Any, precision: Any) -> jax.Array:
        if not self._manual():
            return super().expert_buffers(w, buf, cd, precision)
        g, e, c, d = buf.shape
        rows = jnp.swapaxes(buf, 0, 1).reshape(e, g * c, d)  # (E, G C, D)
        # Dispatch: expert e's rows go to the device that holds e; each device then has
        # its E / N experts' rows from every device: (E / N, N G C, D).
        rows = jax.lax.all_to_all(rows, self.axis, 0, 1, tiled=True)

        def mm(a, b):
            return jnp.einsum("ecd,edf->ecf", a, b, precision=precision)

        out = self._local_experts(w, rows, cd, precision, mm)
        # Combine: each block of rows back to the device it came from: (E, G C, D).
        out = jax.lax.all_to_all(out, self.axis, 1, 0, tiled=True)
        return jnp.swapaxes(out.reshape(e, g, c, d), 0, 1)

    # -- ragged dispatch -----------------------------------------------------------------

    def _varying(self, buf: jax.Array) -> jax.Array:
        """An output buffer typed as varying over the expert axis (what
        ``ragged_all_to_all`` writes into it differs per device)."""
        if self.axis in varying_axes(buf):
            return buf
        return jax.lax.pcast(buf, (self.axis,), to="varying")

    def _dropless(self, w, xt, experts, gates, cd, precision):
        if not self._manual():
            return super()._dropless(w, xt, experts, gates, cd, precision)
        n, k = experts.shape
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        xs = xt[order // k]
        mine = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        counts = jax.lax.all_gather(mine, self.axis)  # (N, E)
        plan = ragged_dispatch_plan(counts, jax.lax.axis_index(self.axis))
        size = self._size()
        # The worst case: every device sends all its rows here.
        recv = self._varying(jnp.zeros((size * n * k, xs.shape[-1]), xs.dtype))
        recv = jax.lax.ragged_all_to_all(xs, recv, *plan["dispatch"], axis_name=self.axis)

        def mm(a, b):
            return grouped_matmul(a, b, plan["group_sizes"])

        ys = self._local_experts(w, recv, cd, precision, mm)
        back = jax.lax.ragged_all_to_all(
            ys, self._varying(jnp.zeros_like(xs)), *plan["combine"], axis_name=self.axis
        )
        out = jnp.zeros_like(back).at[order].set(back, unique_indices=True)
        y = jnp.sum(out.reshape(n, k, -1) * gates.astype(cd)[..., None], axis=1)
        return y, jnp.zeros((), jnp.int32)


def _as_axes(axes: Any, what: str) -> tuple[str, ...]:
    if axes is None:
        return ()
    names = axes if isinstance(axes, tuple) else (axes,)
    if not all(isinstance(a, str) for a in names):
        raise TypeError(f"ep_value_and_grad: {what} must be a mesh-axis name or tuple of names.")
    return names


def _psum(tree: Any, axes: tuple[str, ...]) -> Any:
    """`tree` summed over `axes` (none: unchanged)."""
    if not axes:
        return tree
    return jax.lax.psum(tree, axes if len(axes) > 1 else axes[0])


def _ep_gather(kp: Any, v: jax.Array, shards: dict) -> jax.Array:
    """A trainable leaf gathered whole where it is an FSDP shard (`shards`: path ->
    (axis, dim)), else unchanged."""
    hit = shards.get(kp[0].key)
    return v if hit is None else jax.lax.all_gather(v, hit[0], axis=hit[1], tiled=True)


def _ep_reduce_sharded(
    kp: Any, g: jax.Array, shards: dict, names: tuple, data: tuple, pattern: re.Pattern
) -> jax.Array:
    """An FSDP leaf's gradient: summed over the batch axes it is not split over (the data
    axes only for an expert kernel, matched by `pattern`), reduce-scattered over the one
    it is."""
    axis, dim = shards[kp[0].key]
    over = data if pattern.search(kp[0].key) else names
    g = _psum(g, tuple(a for a in over if a != axis))
    return jax.lax.psum_scatter(g, axis, scatter_dimension=dim, tiled=True)


def ep_value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    expert_axis: str = "expert",
    data_axes: str | tuple[str, ...] | None = "data",
    expert_pattern: str = r"(^|/)experts/(gate|up|down)$",
    specs: Params | None = None,
    microbatches: int = 1,
    has_aux: bool = False,
    predicate: Callable[[Path, Any], bool] | None = None,
    rngs: Sequence[Rng] = (),
    reduce_dtype: Any = None,
) -> Callable[..., Any]:
    """Gradients under expert parallelism, to call **inside** ``jax.shard_map`` with the
    batch split over ``data_axes + (expert_axis,)``: `blox.parallel.dp_value_and_grad`
    over those axes, but for the expert kernels.

    ``loss_fn(params, *batch)`` returns ``(loss, params)`` (or ``((loss, aux), params)``
    with `has_aux`), the loss a mean over this device's examples (plus, e.g., an
    `MoE`'s ``aux['aux_loss']``, which is the same on every device with ``token_axes``).
    The result::

        loss, grads, params = f(params, *batch)            # has_aux=False
        (loss, aux), grads, params = f(params, *batch)     # has_aux=True

    gives the loss over the whole global batch and its gradient for the trainable params
    (``params.split(predicate)[0]``), computed locally over `microbatches` splits of this
    device's batch, then reduced explicitly: a ``psum`` over ``data_axes +
    (expert_axis,)`` for every parameter that is not an expert kernel (with the loss, the
    aux and the weight, in one all-reduce), and over ``data_axes`` only for the expert
    kernels (each device holds other experts; the all-to-all's transpose has already
    brought them every token's contribution). Non-expert params are replicated over
    every one of those axes, expert kernels split over `expert_axis` (`moe_ep_rules`),
    unless `specs` makes them FSDP shards.

    EP x FSDP: with `specs` (the params' ``PartitionSpec`` tree, the shard_map's
    ``in_specs``), a trainable leaf whose spec splits one dimension over one of
    `data_axes` is a fully sharded (ZeRO-3) leaf: it is gathered over that axis
    (``all_gather``) once at the start of the step, and its gradient is reduce-scattered
    over it (``psum_scatter``) once at the end, so it comes back as this device's shard
    (leave the ``shard_map`` with `specs`' trainable part as out_specs). An expert
    kernel may be split over `expert_axis` on its expert dimension and over a data axis
    on another (``('expert', 'data', None)``): each expert group then holds 1/(data x
    expert) of the expert bytes between steps. During the step the gathered leaves are
    whole (``'per_step'`` in `fsdp_value_and_grad`'s terms).

    As `dp_value_and_grad`, over all the batch axes together:

    * weighting: the mean over microbatches and devices, or with ``aux['weight']`` the
      weighted mean (a part of weight 0 adds 0 to the loss, the aux and the non-expert
      gradients, even when its loss is NaN). The expert kernels' gradients arrive
      through the all-to-all's transpose, before the weight is known, so a NaN from an
      unguarded masked mean (``0 / 0``) would reach them: divide by
      ``jnp.maximum(count, 1)``. With that guard a part of weight 0 keeps the gradient
      that other devices' parts send it through a collective in the loss (an `MoE`'s
      global balancing and z losses, with ``token_axes``): only non-finite entries of
      a weight-0 part are dropped;
    * `rngs`: their seeds are folded with the indices along the batch axes (in the order
      ``data_axes + (expert_axis,)``) and restored after; an `Rng` that draws keys but
      is not listed raises, naming it;
    * non-trainable state written in the loss (BatchNorm statistics, a routing bias set
      from the loads): floating state that differs between the devices is averaged over
      the batch axes (over ``data_axes`` for expert-kernel leaves, which are split over
      `expert_axis`); integer state that differs raises, naming the leaf;
    * a parameter first created in `loss_fn` raises, naming it; `reduce_dtype` as there.

    Args:
      loss_fn: as above.
      expert_axis: the expert mesh axis.
      data_axes: the data axes the batch is also split over (None: EP alone).
      expert_pattern: a regular expression searched in each parameter's path
        (``'net/block/moe/experts/up'``) that marks the expert kernels.
      specs: None, or the params' ``PartitionSpec`` tree (``bp.param_specs(params,
        rules, mesh)``); trainable leaves split over a data axis are FSDP shards (above).
        Non-trainable leaves must not be split over a data axis.
      microbatches: ``k``; splits of this device's batch run one after the other in a
        ``jax.lax.scan``, the non-trainable state threaded through them.
      has_aux: `loss_fn` returns ``(loss, aux)``; aux is reduced as the loss (floating
        leaves averaged, weighted by ``aux['weight']`` when present; integer ones summed).
      predicate: ``(path, Param) -> bool`` choosing the differentiated params (default:
        the trainable flag).
      rngs: the `Rng` modules that draw keys in `loss_fn`.
      reduce_dtype: the dtype the gradients, the loss and the floating aux are summed in
        (default: float32 for bf16/fp16 values); gradients return in their params' dtypes.

    Returns:
      ``f(params, *batch)`` as above; grads hold the trainable params' paths.

    Raises:
      ValueError: an axis not bound, ``check_vma=False``, a batch not divisible by
        `microbatches`, an unlisted `Rng` that draws, a new parameter, integer state that
        differs between devices, a leaf split over a data axis on several dimensions or
        not as the last name of its entry (or a non-trainable one split over a data
        axis).
    """
    where = "ep_value_and_grad"
    data = _as_axes(data_axes, "data_axes")
    (expert,) = _as_axes(expert_axis, "expert_axis")
    pattern = re.compile(expert_pattern)
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"{where}: microbatches must be an int >= 1, got {microbatches!r}.")
    rngs = _check_rngs(rngs, where)
    reduce_dtype = check_reduce_dtype(reduce_dtype, where)

    def is_expert(path: Path, _: Any = None) -> bool:
        return pattern.search(format_path(path)) is not None

    def f(params: Params, *batch: Any):
        names = check_axis(data + (expert,), where)
        if not check_vma_enabled():
            raise ValueError(f"{where} needs jax.shard_map(..., check_vma=True) (the default).")
        if not isinstance(params, Params):
            raise TypeError(
                f"{where}: the first argument must be bx.Params, got {type(params).__name__}."
            )
        size = math.prod(jax.lax.axis_size(a) for a in names)
        params, seeds = fold_seeds(params, rngs, names)
        trainable, rest = params.split(predicate)
        experts = frozenset(key for key in trainable.keys() if is_expert(key))
        shards = _fsdp_shards(specs, trainable, rest, data, where)

        # Local gradients: every leaf varies over every axis, so autodiff inserts no
        # reduction; the reductions below are the only ones.
        sums, rest = accumulate_microbatches(
            loss_fn,
            _to_varying(
                jax.tree_util.tree_map_with_path(
                    functools.partial(_ep_gather, shards=shards), trainable
                ),
                names,
            ),
            rest,
            batch,
            k=microbatches,
            size=size,
            names=names,
            has_aux=has_aux,
            predicate=predicate,
            where=where,
            reduced_inside=experts,  # a weight-0 part keeps the other devices' share
            rngs=rngs,
            reduce_dtype=reduce_dtype,
        )
        grads, (loss, aux), w = sums
        sharded, grads = grads.split(lambda key, _: format_path(key) in shards)
        mine, shared = grads.split(is_expert)
        shared, loss, aux, w = _psum((shared, loss, aux, w), names)
        reduce = functools.partial(
            _ep_reduce_sharded, shards=shards, names=names, data=data, pattern=pattern
        )
        sharded = jax.tree_util.tree_map_with_path(reduce, sharded)
        grads = _psum(mine, data).merge(shared).merge(sharded)
        if w is not None:
            one = jnp.where(w > 0, w, jnp.ones((), w.dtype))
            loss, grads = jax.tree.map(lambda v: v / one.astype(v.dtype), (loss, grads))
            aux = _aux_finish(aux, one, w)
        experts_rest, rest = restore_seeds(rest, seeds).split(is_expert)
        rest = _settle_state(rest, names, where).merge(_settle_state(experts_rest, data, where))
        out = trainable.merge(rest)
        return ((loss, aux) if has_aux else loss), _like(grads, trainable), out

    return f


def _fsdp_shards(
    specs: Params | None, trainable: Params, rest: Params, data: tuple[str, ...], where: str
) -> dict[str, tuple[str, int]]:
    """``{'a/b/c': (data axis, dimension)}``: the trainable leaves `specs` splits over a
    data axis (the FSDP shards of `ep_value_and_grad`)."""
    if specs is None:
        return {}
    if not isinstance(specs, Params):
        raise TypeError(
            f"{where}: specs must be the params' PartitionSpec tree (bp.param_specs(params, "
            f"rules, mesh)), got {type(specs).__name__}."
        )
    out = {}
    for group, trained in ((trainable, True), (rest, False)):
        for key in group.keys():
            spec = specs.value(key)
            if spec is None:
                raise ValueError(
                    f"{where}: specs have no entry for '{format_path(key)}'. Build them from "
                    "these params: bp.param_specs(params, rules, mesh)."
                )
            hits = [
                (a, d)
                for d, entry in enumerate(spec)
                for a in (entry if isinstance(entry, tuple) else (entry,))
                if a in data
            ]
            if not hits:
                continue
            entry = spec[hits[0][1]]
            last = entry[-1] if isinstance(entry, tuple) else entry
            if len(hits) == 1 and trained and last != hits[0][0]:
                raise ValueError(
                    f"{where}: '{format_path(key)}' has spec {spec}: the data axis "
                    f"{hits[0][0]!r} must be the last name of its dimension's entry (the "
                    "step gathers each expert group's block over it), e.g. ('expert', "
                    f"{hits[0][0]!r}), or on a dimension of its own."
                )
            if len(hits) > 1 or not trained:
                what = "several data-axis splits" if trained else "a non-trainable leaf split"
                raise ValueError(
                    f"{where}: '{format_path(key)}' has spec {spec}: {what} over the data "
                    f"axes {data}. Split a trainable leaf over one data axis on one "
                    "dimension (as FSDP), and keep non-trainable state replicated over them."
                )
            out[format_path(key)] = hits[0]
    return out
