"""Recurrent layers next to `LSTM`: `GRU`, `SimpleRNN`, `MGU`, and `Bidirectional`.

The three cells share one parameter layout, PyTorch's split into an input part and a
recurrent part with the gates side by side in the columns (``k`` gates)::

    <path>/kernel            (F, kH)   input -> gates        = torch weight_ih.T
    <path>/recurrent_kernel  (H, kH)   hidden -> gates       = torch weight_hh.T
    <path>/bias              (kH,)                           = torch bias_ih
    <path>/recurrent_bias    (kH,)     (GRU, SimpleRNN only) = torch bias_hh

so weights port from ``torch.nn.GRU`` / ``torch.nn.RNN`` by transposing the two matrices.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from blox.core import Graph, Params, Rng, SequenceBase
from blox.core._sequence import (
    STATE_IS_PAIR,
    batch_size_of,
    check_is_reset,
    check_seq_lengths,
    check_sequence_rank,
    contains_params,
    sequence_length,
)
from blox.core._sharding import reshard_like
from blox.nn._cell import CellBase, StoredWeight
from blox.nn._cell import describe as _describe

__all__ = [
    "GRU",
    "GRUState",
    "MGU",
    "MGUState",
    "SimpleRNN",
    "SimpleRNNState",
    "Bidirectional",
]

_default_bias_init = jax.nn.initializers.zeros


def joint_lecun_normal(features: int, hidden_size: int) -> Callable:
    """The default input-kernel initializer of the split cells: LeCun normal over the
    joint fan-in ``F + H`` (variance ``1 / (F + H)``), the scale `LSTM`'s one kernel over
    ``[x, h]`` gets. Each gate's pre-activation sums F input and H recurrent terms; LeCun
    over F alone starts a cell on one input channel at standard deviation 1."""
    scale = features / (features + hidden_size)
    return jax.nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal")


class GRUState(NamedTuple):
    """The carried state of a `GRU`: ``hidden`` ``[B, H]``."""

    hidden: jax.Array


class SimpleRNNState(NamedTuple):
    """The carried state of a `SimpleRNN`: ``hidden`` ``[B, H]``."""

    hidden: jax.Array


class MGUState(NamedTuple):
    """The carried state of an `MGU`: ``hidden`` ``[B, H]``."""

    hidden: jax.Array


def orthogonal_per_gate(num_gates: int) -> Callable:
    """An initializer for ``(H, num_gates * H)`` recurrent kernels: one independent
    orthogonal ``(H, H)`` block per gate, side by side."""
    ortho = jax.nn.initializers.orthogonal()

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        rows, cols = shape
        keys = jax.random.split(key, num_gates)
        blocks = [ortho(k, (rows, cols // num_gates), dtype) for k in keys]
        return jnp.concatenate(blocks, axis=1)

    return init


class _GatedCell(CellBase):
    """Shared machinery of the single-state cells: the split parameter layout and the
    step; the checks and the state come from `CellBase`."""

    _GATES = 1
    _RECURRENT_BIAS = True
    _STATE: type = GRUState

    def __init__(
        self,
        graph: Graph,
        hidden_size: int,
        rng: Rng | None,
        is_static: bool = False,
        *,
        kernel_init: Callable | None = None,
        recurrent_kernel_init: Callable | None = None,
        bias_init: Callable | None = None,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph, hidden_size, is_static, dtype=dtype, param_dtype=param_dtype)
        self.rng = rng
        self.kernel_init = kernel_init  # None: joint_lecun_normal(F, H), F known at call
        self.recurrent_kernel_init = recurrent_kernel_init or orthogonal_per_gate(self._GATES)
        self.bias_init = bias_init or _default_bias_init

    # -- parameters ------------------------------------------------------------

    def _stored_weights(self, features: int) -> list[StoredWeight]:
        """The parameters, in creation order: kernel, recurrent_kernel, bias(es)."""
        hs, kh = self.hidden_size, self._GATES * self.hidden_size
        gates = "" if self._GATES == 1 else f"{self._GATES}"
        weights = [
            StoredWeight(self.param_path("kernel"), (features, kh), f"(F, {gates}H)", 0),
            StoredWeight(self.param_path("recurrent_kernel"), (hs, kh), f"(H, {gates}H)"),
            StoredWeight(self.param_path("bias"), (kh,), f"({gates}H,)"),
        ]
        if self._RECURRENT_BIAS:
            weights.append(StoredWeight(self.param_path("recurrent_bias"), (kh,), f"({gates}H,)"))
        return weights

    def _weights(self, params: Params, features: int) -> tuple[tuple[jax.Array, ...], Params]:
        kernel_init = self.kernel_init or joint_lecun_normal(features, self.hidden_size)
        inits = {"kernel": kernel_init, "recurrent_kernel": self.recurrent_kernel_init}
        weights = []
        for w in self._stored_weights(features):
            name = w.path[-1]
            init = inits.get(name, self.bias_init)
            value, params = self.get_param(
                params, name, w.shape, init, dtype=self.param_dtype, rng=self.rng
            )
            weights.append(value)
        return tuple(weights), params

    # -- one step --------------------------------------------------------------

    def __call__(
        self,
        params: Params,
        inputs: jax.Array,
        prev_state: Any = None,
        is_reset: jax.Array | None = None,
        is_training: bool = True,
    ) -> tuple[tuple[jax.Array, Any], Params]:
        """One step. ``inputs``: ``[B, F]``; ``prev_state.hidden``: ``[B, H]``;
        ``is_reset``: ``[B]`` (rows whose state is replaced by zeros first).

        Returns ``((h [B, H], state), params)``."""
        x = jnp.asarray(inputs)
        state = self._check_step(params, x, prev_state)
        h = self.maybe_reset_state(params, state, x, is_reset).hidden
        dt = self._state_dtype(params, x)
        weights, params = self._weights(params, x.shape[-1])
        weights = tuple(w.astype(dt) for w in weights)
        h_new = self._cell(x.astype(dt), h.astype(dt), *weights)
        # The carried state keeps its sharding type (lax.scan needs it; Explicit meshes).
        h = reshard_like(h_new, h)
        return (h, self._STATE(h)), params

    def _cell(self, x: jax.Array, h: jax.Array, *weights: jax.Array) -> jax.Array:
        raise NotImplementedError


_SHARED_ARGS = """
    Args:
      graph: this module's node.
      hidden_size: H.
      rng: the `Rng` for initialization.
      is_static: `apply` uses a Python loop (``True``) or ``lax.scan`` (``False``);
        both give the same numbers.
      kernel_init: for ``kernel`` (default LeCun normal over the joint fan-in F + H,
        `joint_lecun_normal`: the scale of `LSTM`'s kernel over ``[x, h]``).
      recurrent_kernel_init: for ``recurrent_kernel`` (default: an independent
        orthogonal ``(H, H)`` block per gate, `orthogonal_per_gate`).
      bias_init: for the biases (default zeros).
      dtype: compute dtype (default: promotion of the input and param dtypes, see
        `Linear`); the state has this dtype.
      param_dtype: dtype of the parameters (float32).

    Calls:
      ``state, params = layer.initial_state(params, x_t [B, F])``: zeros (a pair, like
      every blox call; pass ``state`` on, not the pair).
      ``layer(params, x_t [B, F], state, is_reset=None [B])`` -> ``((h [B, H], state),
      params)`` for one step; ``layer.apply(params, x [B, T, F], prev_state=None,
      is_reset=None [B, T], seq_lengths=None [B])`` -> ``((h [B, T, H], final state),
      params)``: see `RecurrenceBase.apply` for resets and lengths. ``apply`` needs
      rank-3 inputs, and a ``prev_state`` of the wrong type or shape raises an error that
      says what to pass; so does a stored weight whose shape cannot fit (e.g. a PyTorch
      weight copied without its transpose), naming its path and the expected shape.
"""


class GRU(_GatedCell):
    """Gated recurrent unit (Cho et al., 2014) with PyTorch's equations.

    Legend: B batch, T time, F input features, H ``hidden_size``.

    Shapes: one step ``x_t [B, F]`` -> ``h [B, H]``; a sequence (`apply`)
    ``x [B, T, F]`` -> ``[B, T, H]``, plus the final state.

    One step, with ``[r_i, z_i, n_i] = x @ kernel + bias`` and
    ``[r_h, z_h, n_h] = h @ recurrent_kernel + recurrent_bias``::

        r = sigmoid(r_i + r_h)
        z = sigmoid(z_i + z_h)
        n = tanh(n_i + r * n_h)          # r multiplies the hidden part *and* its bias
        h' = (1 - z) * n + z * h

    These are ``torch.nn.GRU``'s equations, so ported weights give PyTorch's numbers
    (jax-blox 0.1.6's ``GRU`` computes other ones: see docs/migrating.md).
    """

    __doc__ = (
        (__doc__ or "")
        + _SHARED_ARGS
        + """
    Parameters (gate columns in PyTorch's order r, z, n):
    ``<path>/kernel (F, 3H)`` = ``weight_ih_l0.T``, ``<path>/recurrent_kernel (H, 3H)`` =
    ``weight_hh_l0.T``, ``<path>/bias (3H,)`` = ``bias_ih_l0``, ``<path>/recurrent_bias
    (3H,)`` = ``bias_hh_l0``.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> gru = bx.GRU(g / 'gru', hidden_size=4, rng=rng)
    >>> (h, state), params = gru.apply(rng.seed(bx.Params(), seed=0), jnp.ones((2, 5, 3)))
    >>> h.shape, state.hidden.shape, params[('net', 'gru', 'recurrent_kernel')].value.shape
    ((2, 5, 4), (2, 4), (4, 12))
    """
    )

    _GATES = 3
    _STATE = GRUState

    def _cell(self, x, h, w, u, b, bu):
        gi = jnp.dot(x, w) + b[None, :]
        gh = jnp.dot(h, u) + bu[None, :]
        ri, zi, ni = jnp.split(gi, 3, axis=-1)
        rh, zh, nh = jnp.split(gh, 3, axis=-1)
        r = jax.nn.sigmoid(ri + rh)
        z = jax.nn.sigmoid(zi + zh)
        n = jnp.tanh(ni + r * nh)
        return (1 - z) * n + z * h


class SimpleRNN(_GatedCell):
    """The Elman recurrent cell, ``torch.nn.RNN``'s equations.

    Legend: B batch, T time, F input features, H ``hidden_size``.

    Shapes: one step ``x_t [B, F]`` -> ``h [B, H]``; a sequence (`apply`)
    ``x [B, T, F]`` -> ``[B, T, H]``, plus the final state.

    One step::

        h' = activation(x @ kernel + bias + h @ recurrent_kernel + recurrent_bias)

    ``activation`` is ``jnp.tanh`` by default (``torch.nn.RNN(nonlinearity='tanh')``);
    pass ``jax.nn.relu`` for ``nonlinearity='relu'``.
    """

    __doc__ = (
        (__doc__ or "")
        + _SHARED_ARGS
        + """
    Every argument after ``rng`` is keyword-only.

    Parameters: ``<path>/kernel (F, H)`` = ``weight_ih_l0.T``, ``<path>/recurrent_kernel
    (H, H)`` = ``weight_hh_l0.T``, ``<path>/bias (H,)`` = ``bias_ih_l0``,
    ``<path>/recurrent_bias (H,)`` = ``bias_hh_l0``.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> rnn = bx.SimpleRNN(g / 'rnn', hidden_size=4, rng=rng)
    >>> (h, state), params = rnn.apply(rng.seed(bx.Params(), seed=0), jnp.ones((2, 5, 3)))
    >>> h.shape, state.hidden.shape
    ((2, 5, 4), (2, 4))
    """
    )

    _GATES = 1
    _STATE = SimpleRNNState

    def __init__(
        self,
        graph: Graph,
        hidden_size: int,
        rng: Rng | None,
        *,
        is_static: bool = False,
        activation: Callable[[jax.Array], jax.Array] = jnp.tanh,
        kernel_init: Callable | None = None,
        recurrent_kernel_init: Callable | None = None,
        bias_init: Callable | None = None,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(
            graph,
            hidden_size,
            rng,
            is_static,
            kernel_init=kernel_init,
            recurrent_kernel_init=recurrent_kernel_init,
            bias_init=bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
        )
        self.activation = activation

    def _cell(self, x, h, w, u, b, bu):
        return self.activation(jnp.dot(x, w) + b[None, :] + jnp.dot(h, u) + bu[None, :])


class MGU(_GatedCell):
    """Minimal gated unit (Zhou et al., 2016): a GRU with one gate.

    Legend: B batch, T time, F input features, H ``hidden_size``.

    Shapes: one step ``x_t [B, F]`` -> ``h [B, H]``; a sequence (`apply`)
    ``x [B, T, F]`` -> ``[B, T, H]``, plus the final state.

    One step, with ``[f_i, n_i] = x @ kernel + bias`` and ``recurrent_kernel = [U_f,
    U_n]`` (each ``(H, H)``)::

        f = sigmoid(f_i + h @ U_f)
        n = tanh(n_i + (f * h) @ U_n)    # the gate multiplies h before the matmul
        h' = (1 - f) * h + f * n

    as in the paper (one bias per gate, no recurrent bias). PyTorch has no MGU; the
    tests check it against a NumPy transcription of these equations.
    """

    __doc__ = (
        (__doc__ or "")
        + _SHARED_ARGS
        + """
    Every argument after ``rng`` is keyword-only.

    Parameters (gate columns f, n): ``<path>/kernel (F, 2H)``, ``<path>/recurrent_kernel
    (H, 2H)``, ``<path>/bias (2H,)``.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> mgu = bx.MGU(g / 'mgu', hidden_size=4, rng=rng)
    >>> (h, state), params = mgu.apply(rng.seed(bx.Params(), seed=0), jnp.ones((2, 5, 3)))
    >>> h.shape, params[('net', 'mgu', 'kernel')].value.shape
    ((2, 5, 4), (3, 8))
    """
    )

    _GATES = 2
    _RECURRENT_BIAS = False
    _STATE = MGUState

    def __init__(
        self,
        graph: Graph,
        hidden_size: int,
        rng: Rng | None,
        *,
        is_static: bool = False,
        kernel_init: Callable | None = None,
        recurrent_kernel_init: Callable | None = None,
        bias_init: Callable | None = None,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(
            graph,
            hidden_size,
            rng,
            is_static,
            kernel_init=kernel_init,
            recurrent_kernel_init=recurrent_kernel_init,
            bias_init=bias_init,
            dtype=dtype,
            param_dtype=param_dtype,
        )

    def _cell(self, x, h, w, u, b):
        hs = self.hidden_size
        fi, ni = jnp.split(jnp.dot(x, w) + b[None, :], 2, axis=-1)
        f = jax.nn.sigmoid(fi + jnp.dot(h, u[:, :hs]))
        n = jnp.tanh(ni + jnp.dot(f * h, u[:, hs:]))
        return (1 - f) * h + f * n


# ---------------------------------------------------------------------------
# Bidirectional
# ---------------------------------------------------------------------------


def _reverse_index(lengths: jax.Array | None, steps: int) -> jax.Array | None:
    """``[B, T]`` gather indices that reverse each row within its length (identity on
    the padding); ``None`` (plain flip) without lengths."""
    if lengths is None:
        return None
    t = jnp.arange(steps, dtype=jnp.int32)[None, :]
    n = lengths[:, None]
    return jnp.where(t < n, n - 1 - t, t)


def _reverse(tree: Any, index: jax.Array | None) -> Any:
    if index is None:
        return jax.tree.map(lambda x: jnp.flip(x, axis=1), tree)

    def one(x):
        idx = index.reshape(index.shape + (1,) * (jnp.ndim(x) - 2))
        return jnp.take_along_axis(x, idx, axis=1)

    return jax.tree.map(one, tree)


_MERGES: dict[str, Callable[[Any, Any], Any]] = {
    "concat": lambda f, b: jnp.concatenate([f, b], axis=-1),
    "sum": lambda f, b: f + b,
}


class Bidirectional(SequenceBase):
    """Runs one recurrent layer forward and another backward in time, and merges them.

    Legend: B batch, T time, F features, H the layers' output width.

    Shapes: ``x [B, T, F]`` -> ``[B, T, H_f + H_b]`` (``merge='concat'``) or
    ``[B, T, H]`` (``'sum'``), plus the final states of both layers.

    The backward layer sees each row reversed *within its own length* (like PyTorch's
    packed sequences): with ``seq_lengths[b] = L`` it reads ``x[b, L-1], ..., x[b, 0]``,
    and its outputs are put back in the original time order. With ``merge='concat'``
    the output is ``[forward, backward]`` on the last axis, PyTorch's layout for
    ``bidirectional=True``.

    Reset flags mark independent segments: a flag at step ``t`` starts a new segment
    for the forward layer at ``t``; the backward layer runs every segment backwards from
    a fresh state (its state is reset at the segment's last step).

    Args:
      graph: this module's node (it creates no parameters of its own).
      forward: a recurrent layer (`LSTM`, `GRU`, `SimpleRNN`, `MGU`, ...) built on its
        own node, e.g. ``graph / 'fwd'``.
      backward: another one for the reverse direction (its own parameters).
      merge: ``'concat'`` (default, ``[B, T, H_f + H_b]``), ``'sum'`` or a function
        ``(out_forward, out_backward) -> out``.

    Calls: ``bi(params, x [B, T, F], prev_state=None, is_reset=None [B, T],
    seq_lengths=None [B])`` (same as ``bi.apply``) -> ``((out [B, T, ...], (state_fwd,
    state_bwd)), params)``. ``state_bwd`` is the backward layer's state after it reached
    step 0 (PyTorch's ``h_n[1]``). There is no one-step call: the backward direction
    needs the whole sequence.

    Parameters: those of ``forward`` and ``backward``, at their own paths.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> node = g / 'bi'
    >>> bi = bx.Bidirectional(node, bx.GRU(node / 'fwd', 4, rng), bx.GRU(node / 'bwd', 4, rng))
    >>> params = rng.seed(bx.Params(), seed=0)
    >>> (y, (s_f, s_b)), params = bi(params, jnp.ones((2, 5, 3)), seq_lengths=jnp.array([5, 3]))
    >>> y.shape, s_b.hidden.shape, float(abs(y[1, 3:]).max())
    ((2, 5, 8), (2, 4), 0.0)
    """

    def __init__(
        self,
        graph: Graph,
        forward: SequenceBase,
        backward: SequenceBase,
        *,
        merge: str | Callable[[Any, Any], Any] = "concat",
    ):
        super().__init__(graph)
        for role, layer in (("forward", forward), ("backward", backward)):
            if not isinstance(layer, SequenceBase):
                raise TypeError(
                    f"Bidirectional '{self.path_str}': {role} must be a recurrent layer "
                    f"(a SequenceBase such as bx.GRU), got {type(layer).__name__}."
                )
        if forward is backward:
            raise ValueError(
                f"Bidirectional '{self.path_str}': forward and backward are the same module "
                f"('{forward.path_str}'); build two layers on two nodes, e.g. "
                "bx.GRU(node / 'fwd', ...) and bx.GRU(node / 'bwd', ...)."
            )
        if isinstance(merge, str):
            if merge not in _MERGES:
                raise ValueError(
                    f"Bidirectional '{self.path_str}': merge must be one of "
                    f"{sorted(_MERGES)} or a function (fwd, bwd) -> out, got {merge!r}."
                )
            self._merge = _MERGES[merge]
        elif callable(merge):
            self._merge = merge
        else:
            raise TypeError(
                f"Bidirectional '{self.path_str}': merge must be a string or a function, got "
                f"{type(merge).__name__}."
            )
        self.forward = forward
        self.backward = backward
        self.merge = merge

    @property
    def is_static(self) -> bool:
        """Whether both directions use the Python loop (`static_scan`)."""
        return bool(getattr(self.forward, "is_static", False)) and bool(
            getattr(self.backward, "is_static", False)
        )

    @is_static.setter
    def is_static(self, value: bool) -> None:
        self.forward.is_static = value  # type: ignore[attr-defined]
        self.backward.is_static = value  # type: ignore[attr-defined]

    def initial_state(self, params: Params, inputs: Any) -> tuple[tuple[Any, Any], Params]:
        """Returns ``((state_fwd, state_bwd), params)`` for one step's inputs ``[B, F]``:
        the two layers' initial states, as a pair with the params. Unpack it, ``state,
        params = bi.initial_state(params, x_t)``, and pass ``state`` as ``prev_state``."""
        sf, params = self.forward.initial_state(params, inputs)
        sb, params = self.backward.initial_state(params, inputs)
        return (sf, sb), params

    def apply(
        self,
        params: Params,
        inputs: Any,
        prev_state: Any = None,
        is_reset: Any = None,
        is_training: bool = True,
        *,
        seq_lengths: Any = None,
    ) -> tuple[tuple[Any, tuple[Any, Any]], Params]:
        """Runs both directions over ``inputs`` ``[B, T, ...]``; see the class docstring.

        ``prev_state``: ``(state_fwd, state_bwd)`` or ``None`` (initial states)."""
        where = f"Bidirectional '{self.path_str}'"
        ranks = {
            getattr(m, "_sequence_rank", lambda: None)() for m in (self.forward, self.backward)
        }
        ranks.discard(None)
        if len(ranks) == 1:
            check_sequence_rank(inputs, ranks.pop(), where, None)
        steps = sequence_length(inputs, where)
        batch = batch_size_of(inputs)
        reset = check_is_reset(is_reset, batch, steps, where)
        valid = check_seq_lengths(seq_lengths, batch, steps, where)
        if contains_params(prev_state):
            raise TypeError(STATE_IS_PAIR.format(where=where, name="bi", out="y, state"))
        if prev_state is None:
            state_f = state_b = None
        elif isinstance(prev_state, tuple) and len(prev_state) == 2:
            state_f, state_b = prev_state
        else:
            raise ValueError(
                f"{where}: prev_state must be a pair (state_forward, state_backward) or None, "
                f"got {_describe(prev_state)}. Carry the pair returned by the last call, or "
                "build one with `state, params = bi.initial_state(params, x_t)`."
            )
        lengths = None
        if seq_lengths is not None:
            lengths = jnp.asarray(seq_lengths).astype(jnp.int32)
        index = _reverse_index(lengths, steps)

        (out_f, state_f), params = self.forward.apply(
            params, inputs, state_f, reset, is_training, seq_lengths=seq_lengths
        )
        reset_b = None
        if reset is not None:
            # A segment starting at t + 1 ends at t: the backward pass starts afresh there.
            ends = reset[:, 1:] if valid is None else reset[:, 1:] & valid[:, 1:]
            ends = jnp.concatenate([ends, jnp.zeros((batch, 1), jnp.bool_)], axis=1)
            reset_b = _reverse(ends, index)
        (out_b, state_b), params = self.backward.apply(
            params,
            _reverse(inputs, index),
            state_b,
            reset_b,
            is_training,
            seq_lengths=seq_lengths,
        )
        out = self._merge(out_f, _reverse(out_b, index))
        return (out, (state_f, state_b)), params

    def __call__(
        self,
        params: Params,
        inputs: Any,
        prev_state: Any = None,
        is_reset: Any = None,
        is_training: bool = True,
        *,
        seq_lengths: Any = None,
    ) -> tuple[tuple[Any, tuple[Any, Any]], Params]:
        """Same as `apply` (a whole sequence ``[B, T, ...]``)."""
        return self.apply(
            params, inputs, prev_state, is_reset, is_training, seq_lengths=seq_lengths
        )
