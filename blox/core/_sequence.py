"""Scans over time and the base classes of recurrent modules.

Conventions: sequences are batch-major pytrees whose leaves are ``[B, T, ...]``
(time is axis 1); reset flags are ``[B, T]`` booleans; sequence lengths are ``[B]``
integers in ``[0, T]``. A *step function* has the signature of a recurrent module's
``__call__``::

    step_fn(params, inputs_t, state, is_reset_t, is_training) -> ((outputs_t, state), params)

With sequence lengths, the scans mask every step after the step function: for row ``b``
and step ``t >= seq_lengths[b]`` the state keeps its previous value (so the final state
is the state after the row's last valid step) and every output leaf is zero. State and
output leaves must therefore be batch-major (``[B, ...]``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from blox.core._graph import Graph
from blox.core._module import Module
from blox.core._params import Params
from blox.core._sharding import varying_axes

__all__ = ["static_scan", "dynamic_scan", "SequenceBase", "RecurrenceBase"]

StepFn = Callable[..., tuple[tuple[Any, Any], Params]]


def sequence_length(inputs: Any, where: str) -> int:
    """The time length (axis 1) shared by every leaf of `inputs` ``[B, T, ...]``; a
    `ValueError` naming `where` for no arrays, a leaf of rank < 2 or differing lengths."""
    leaves = jax.tree.leaves(inputs)
    if not leaves:
        raise ValueError(f"{where}: inputs has no arrays; pass a [B, T, ...] array or pytree.")
    lengths = set()
    for leaf in leaves:
        if jnp.ndim(leaf) < 2:
            raise ValueError(
                f"{where}: Input leaves must have rank >= 2 ([B, T, ...], time on axis 1), "
                f"got shape {jnp.shape(leaf)}. Add the time axis, e.g. x[:, None]."
            )
        lengths.add(jnp.shape(leaf)[1])
    if len(lengths) != 1:
        shapes = [jnp.shape(x) for x in leaves]
        raise ValueError(
            f"{where}: all input leaves must share the time length (axis 1); got shapes {shapes}."
        )
    return lengths.pop()


def check_is_reset(is_reset: Any, batch: int | None, steps: int, where: str) -> Any:
    """`is_reset` as a ``[B, T]`` bool array (trailing size-1 axes dropped), or None;
    a `ValueError` naming `where` and the expected shape otherwise."""
    if is_reset is None:
        return None
    is_reset = jnp.asarray(is_reset)
    shape = is_reset.shape
    if len(shape) > 2 and all(d == 1 for d in shape[2:]):
        is_reset = is_reset.reshape(shape[:2])
    if (
        is_reset.ndim != 2
        or is_reset.shape[1] != steps
        or (batch is not None and is_reset.shape[0] != batch)
    ):
        raise ValueError(
            f"{where}: is_reset must have shape [B, T] = {(batch, steps)} (one flag per "
            f"sequence and step), got {shape}."
        )
    if is_reset.dtype != jnp.bool_:
        is_reset = is_reset.astype(jnp.bool_)
    return is_reset


def check_sequence_rank(inputs: Any, rank: int | None, where: str, step_call: str | None) -> None:
    """Every leaf of a whole sequence must be ``rank`` = one step's rank + 1 (``[B, T, F]``).

    `step_call` shows the one-step call (``'lstm(params, x_t, state)'``), or ``None`` for
    modules without one.
    """
    if rank is None:
        return
    for leaf in jax.tree.leaves(inputs):
        if jnp.ndim(leaf) != rank:
            seq, step = ("B, T, F", "B, F") if rank == 3 else ("B, T, ...", "B, ...")
            single = f"For a single step [{step}] call {step_call}; to" if step_call else "To"
            raise ValueError(
                f"{where}: apply runs over a whole sequence and needs inputs of shape "
                f"[{seq}] (rank {rank}, time on axis 1), got shape {tuple(jnp.shape(leaf))}. "
                f"{single} run a [{step}] batch as a sequence of length 1, pass x[:, None]."
            )


def contains_params(state: Any) -> bool:
    """Whether `state` is a `Params` or a tuple/list holding one (the pair returned by
    ``initial_state`` passed as the state, see `STATE_IS_PAIR`)."""
    if isinstance(state, Params):
        return True
    return isinstance(state, (tuple, list)) and any(isinstance(s, Params) for s in state)


#: The message for a ``prev_state`` that is (or holds) a `Params`; format it with
#: ``where``, ``name`` (the module variable) and ``out`` (the outputs of ``apply``).
STATE_IS_PAIR = (
    "{where}: prev_state is (or contains) a Params. initial_state returns the pair "
    "(state, params), not the state alone; unpack it:\n"
    "    state, params = {name}.initial_state(params, x_t)\n"
    "    ({out}), params = {name}.apply(params, x, prev_state=state)"
)


def batch_size_of(inputs: Any) -> int:
    """The batch size: axis 0 of the first leaf of `inputs`."""
    return jnp.shape(jax.tree.leaves(inputs)[0])[0]


def check_seq_lengths(seq_lengths: Any, batch: int, steps: int, where: str) -> Any:
    """``[B]`` integer lengths -> the ``[B, T]`` boolean mask of valid steps (or None).

    Values are checked when they are concrete (NumPy, Python, or a ``jax.Array`` outside
    ``jit``); a traced length cannot be inspected, see `RecurrenceBase.apply`.
    """
    if seq_lengths is None:
        return None
    if not isinstance(seq_lengths, jax.Array):
        seq_lengths = np.asarray(seq_lengths)
    shape = tuple(seq_lengths.shape)
    if shape != (batch,):
        raise ValueError(
            f"{where}: seq_lengths must have shape [B] = ({batch},) (one length per "
            f"sequence), got {shape}; the inputs are [B, T] = ({batch}, {steps})."
        )
    if not jnp.issubdtype(seq_lengths.dtype, jnp.integer):
        raise TypeError(
            f"{where}: seq_lengths must be integers, got dtype {seq_lengths.dtype}. "
            "Cast them, e.g. seq_lengths.astype(jnp.int32)."
        )
    try:
        concrete = np.asarray(seq_lengths)
    except jax.errors.TracerArrayConversionError:
        concrete = None
    if concrete is not None:
        bad = np.flatnonzero((concrete < 0) | (concrete > steps))
        if bad.size:
            b = int(bad[0])
            raise ValueError(
                f"{where}: seq_lengths must be in [0, T] = [0, {steps}], got "
                f"seq_lengths[{b}] = {int(concrete[b])} (seq_lengths shape {shape}, inputs "
                f"[B, T] = ({batch}, {steps})). Pad the inputs along time to the longest "
                "sequence, or fix the lengths."
            )
    lengths = jnp.asarray(seq_lengths).astype(jnp.int32)
    return jnp.arange(steps, dtype=jnp.int32)[None, :] < lengths[:, None]


def _rows(mask: jax.Array, like: jax.Array) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (jnp.ndim(like) - 1))


def _masked(step_fn: StepFn) -> Callable[..., tuple[tuple[Any, Any], Params]]:
    """`step_fn` plus a ``[B]`` validity mask: invalid rows keep their state, output 0."""

    def step(params, x_t, state, r_t, is_training, v_t):
        (out, new_state), params = step_fn(params, x_t, state, r_t, is_training)
        if v_t is None:
            return (out, new_state), params
        new_state = jax.tree.map(
            lambda n, o: jnp.where(_rows(v_t, n), n, jnp.asarray(o).astype(n.dtype)),
            new_state,
            state,
        )
        out = jax.tree.map(lambda o: jnp.where(_rows(v_t, o), o, jnp.zeros_like(o)), out)
        return (out, new_state), params

    return step


def static_scan(
    step_fn: StepFn,
    params: Params,
    inputs: Any,
    prev_state: Any,
    is_reset: Any = None,
    is_training: bool = True,
    *,
    seq_lengths: Any = None,
) -> tuple[tuple[Any, Any], Params]:
    """Runs `step_fn` over time with a Python loop (debuggable; unrolled under jit).

    Equivalent to::

        for t in range(T):
            (out[:, t], new), params = step_fn(params, inputs[:, t], state, is_reset[:, t],
                                               is_training)
            valid = t < seq_lengths                    # [B]; all True without lengths
            state = where(valid, new, state)           # per row
            out[:, t] = where(valid, out[:, t], 0)

    Args:
      step_fn: see the module docstring.
      params: the current params (may be unlocked: parameters are created on step 0).
      inputs: pytree of ``[B, T, ...]`` arrays.
      prev_state: the state before step 0.
      is_reset: ``[B, T]`` booleans or ``None``.
      is_training: passed to every step.
      seq_lengths: ``[B]`` integers in ``[0, T]`` or ``None``: past its length a row's
        state is frozen and its outputs are zero (see the module docstring).

    Returns:
      ``((outputs, final_state), params)`` with outputs ``[B, T, ...]``.
    """
    steps = sequence_length(inputs, "static_scan")
    batch = batch_size_of(inputs)
    is_reset = check_is_reset(is_reset, batch, steps, "static_scan")
    valid = check_seq_lengths(seq_lengths, batch, steps, "static_scan")
    return _static_scan(step_fn, params, inputs, prev_state, is_reset, is_training, valid)


def _static_scan(step_fn, params, inputs, state, is_reset, is_training, valid):
    step = _masked(step_fn)
    outs = []
    for t in range(sequence_length(inputs, "static_scan")):
        x_t = jax.tree.map(lambda x, t=t: x[:, t], inputs)
        r_t = None if is_reset is None else is_reset[:, t]
        v_t = None if valid is None else valid[:, t]
        (out, state), params = step(params, x_t, state, r_t, is_training, v_t)
        outs.append(out)
    outputs = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *outs)
    return (outputs, state), params


def _lax_scan(step_fn, params, inputs, state, is_reset, is_training, valid):
    step = _masked(step_fn)
    xs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), inputs)
    rs = None if is_reset is None else jnp.swapaxes(is_reset, 0, 1)
    vs = None if valid is None else jnp.swapaxes(valid, 0, 1)
    leaves, tree = jax.tree.flatten(params)
    moves, widen = _moving_leaves(step, leaves, tree, state, (xs, rs, vs), is_training)

    def merge(carried):  # the carried leaves back into the params (all of them if None)
        if moves is None:
            return carried
        it = iter(carried)
        return jax.tree.unflatten(
            tree, [next(it) if m else v for v, m in zip(leaves, moves, strict=True)]
        )

    def pick(p):  # the leaves to carry
        if moves is None:
            return p
        return [v for v, m in zip(jax.tree.leaves(p), moves, strict=True) if m]

    def body(carry, xrv):
        state, carried = carry
        x_t, r_t, v_t = xrv
        (out, state), p = step(merge(carried), x_t, state, r_t, is_training, v_t)
        return (state, pick(p)), out

    carry = widen((state, pick(params)))
    (state, carried), outs = jax.lax.scan(body, carry, (xs, rs, vs))
    return (jax.tree.map(lambda o: jnp.swapaxes(o, 0, 1), outs), state), merge(carried)


def _moving_leaves(step, leaves, tree, state, xrv, is_training) -> tuple[list[bool] | None, Any]:
    """Which params leaves one step replaces (e.g. an Rng counter), found by tracing it once
    (`jax.eval_shape`, no computation); ``None`` if it returns params of another structure.
    Also returns ``widen(carry) -> carry``, which gives the initial scan carry (the state
    and those leaves) the varying manual axes of one step's outputs.

    Only those leaves ride in the ``lax.scan`` carry; the others are closed over, as in a
    hand-written scan. Carrying them all gives the same numbers (``lax.scan`` turns the
    carried leaves that come back unchanged into loop constants), but in the params'
    sorted-path order instead of the order of use: the gradient loop then accumulates the
    parameter gradients in another order, and XLA schedules its body differently from the
    hand-written scan's, with more cache misses (LSTM train step: 5 % more L1 data misses
    in the compiled code, 7 % more instruction-cache misses).

    Inside ``jax.shard_map`` (``check_vma=True``) ``lax.scan`` needs the carry to enter
    with the type it leaves with: a zero initial state is invariant over the data axis,
    but the state after one step varies with the batch shard (or with params made
    varying by `blox.parallel.dp_value_and_grad`). `widen` casts the initial carry
    (``jax.lax.pcast(..., to='varying')``) to the axes one step's outputs vary over, the
    cast a hand-written scan needs; off ``shard_map`` it returns the carry unchanged.
    """
    found: list[Any] = []

    def one(values, state, xrv):
        x_t, r_t, v_t = jax.tree.map(lambda a: a[0], xrv)
        (out, new_state), p = step(
            jax.tree.unflatten(tree, values), x_t, state, r_t, is_training, v_t
        )
        new, new_tree = jax.tree.flatten(p)
        moves = [a is not b for a, b in zip(new, values, strict=True)] if new_tree == tree else None
        carried = new if moves is None else [v for v, m in zip(new, moves, strict=True) if m]
        found.append((moves, [_varying(v) for v in jax.tree.leaves((new_state, carried))]))
        return out

    jax.eval_shape(one, leaves, state, xrv)
    moves, out_axes = found[0]

    def widen(carry: Any) -> Any:
        flat, carry_tree = jax.tree.flatten(carry)
        if len(flat) != len(out_axes):  # another state structure: lax.scan will say so
            return carry
        cast = [_cast_varying(v, axes) for v, axes in zip(flat, out_axes, strict=True)]
        return jax.tree.unflatten(carry_tree, cast)

    return moves, widen


def _varying(x: Any) -> frozenset:
    """The manual mesh axes `x` varies over inside ``jax.shard_map`` (empty elsewhere)."""
    return varying_axes(x) if hasattr(x, "dtype") else frozenset()


def vary_like(x: Any, like: Any) -> Any:
    """Every array of `x` cast to vary over the manual axes that `like` varies over (inside
    ``jax.shard_map``): a recurrent module's zero initial state next to its batch-sharded
    inputs, so that a ``lax.scan`` over steps (blox's or a hand-written one) gets a carry
    of the type its body returns. `x` itself off ``shard_map``."""
    axes = frozenset().union(*(_varying(v) for v in jax.tree.leaves(like)))
    if not axes:
        return x
    return jax.tree.map(lambda v: _cast_varying(v, axes), x)


def _cast_varying(v: Any, axes: frozenset) -> Any:
    """`v` made varying over those of `axes` it does not vary over yet."""
    missing = tuple(sorted(axes - _varying(v)))
    return jax.lax.pcast(v, missing, to="varying") if missing else v


def dynamic_scan(
    step_fn: StepFn,
    params: Params,
    inputs: Any,
    prev_state: Any,
    is_reset: Any = None,
    is_training: bool = True,
    *,
    seq_lengths: Any = None,
) -> tuple[tuple[Any, Any], Params]:
    """Runs `step_fn` over time with ``jax.lax.scan`` (fast to compile); same results as
    `static_scan`.

    The scan carry is the state and the params leaves that a step replaces (found by
    tracing one step with `jax.eval_shape`), so non-trainable state (RNG counters) is
    threaded through time; the other params are closed over, as in a hand-written
    ``lax.scan``. With *unlocked* params (initialization), step 0 runs in
    Python so parameters can be created, and the remaining steps run in ``lax.scan``.
    Inside ``jax.shard_map`` the initial carry is cast (``jax.lax.pcast(...,
    to='varying')``) to the manual axes one step's outputs vary over, so a state that is
    the same on every shard (zeros, or a state passed in replicated) needs no cast.

    Args and returns: as `static_scan`.
    """
    steps = sequence_length(inputs, "dynamic_scan")
    batch = batch_size_of(inputs)
    is_reset = check_is_reset(is_reset, batch, steps, "dynamic_scan")
    valid = check_seq_lengths(seq_lengths, batch, steps, "dynamic_scan")
    return _dynamic_scan(step_fn, params, inputs, prev_state, is_reset, is_training, valid)


def _dynamic_scan(step_fn, params, inputs, prev_state, is_reset, is_training, valid):
    steps = sequence_length(inputs, "dynamic_scan")
    if params.is_locked:
        return _lax_scan(step_fn, params, inputs, prev_state, is_reset, is_training, valid)

    def part(a, sl):
        return None if a is None else a[:, sl]

    # Initialization: create parameters on step 0, then scan the rest with locked params.
    (out0, state), params = _static_scan(
        step_fn,
        params,
        jax.tree.map(lambda x: x[:, :1], inputs),
        prev_state,
        part(is_reset, slice(None, 1)),
        is_training,
        part(valid, slice(None, 1)),
    )
    if steps == 1:
        return (out0, state), params
    (rest, state), locked = _lax_scan(
        step_fn,
        params.locked(),
        jax.tree.map(lambda x: x[:, 1:], inputs),
        state,
        part(is_reset, slice(1, None)),
        is_training,
        part(valid, slice(1, None)),
    )
    outputs = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), out0, rest)
    return (outputs, state), locked.unlocked()


class SequenceBase(Module):
    """Base class of modules that process sequences step by step.

    Subclasses implement ``initial_state(params, inputs) -> (state, params)`` and
    ``__call__(params, inputs_t, prev_state, is_reset=None, is_training=True) ->
    ((outputs_t, state), params)`` for one step, and ``apply`` over a whole sequence.

    ``initial_state`` returns a *pair*, as every blox call does: unpack it with
    ``state, params = layer.initial_state(params, x_t)`` and pass ``state`` on.
    """

    def initial_state(self, params: Params, inputs: Any) -> tuple[Any, Params]:
        """Returns ``(state, params)``: the state before the first step for one step's
        inputs (``inputs``: ``[B, ...]``; the batch size is read from it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement initial_state.")

    def apply(
        self,
        params: Params,
        inputs: Any,
        prev_state: Any = None,
        is_reset: Any = None,
        is_training: bool = True,
        *,
        seq_lengths: Any = None,
    ) -> tuple[tuple[Any, Any], Params]:
        raise NotImplementedError(f"{type(self).__name__} must implement apply.")


class RecurrenceBase(SequenceBase):
    """A recurrent module: ``apply`` scans ``__call__`` over time.

    Args:
      graph: this module's node.
      is_static: ``True`` runs `static_scan` (Python loop), ``False`` `dynamic_scan`
        (``lax.scan``). Both give the same numbers on the same params.

    ``apply`` checks a given ``prev_state`` before scanning: passing the ``(state,
    params)`` pair that ``initial_state`` returns raises a ``TypeError`` that shows how
    to unpack it. Subclasses refine the check by overriding ``_check_state(params,
    prev_state, inputs_t) -> state`` (the built-in cells check the state type and
    ``[B, H]`` shapes there), and set ``_STEP_INPUT_RANK`` (e.g. 2 for ``[B, F]``
    steps) so that ``apply`` requires inputs of that rank + 1 (``[B, T, F]``).
    """

    _STEP_INPUT_RANK: int | None = None

    def __init__(self, graph: Graph, is_static: bool = False):
        super().__init__(graph)
        self._is_static = bool(is_static)

    @property
    def is_static(self) -> bool:
        """Whether `apply` uses the Python loop (`static_scan`)."""
        return self._is_static

    @is_static.setter
    def is_static(self, value: bool) -> None:
        self._is_static = bool(value)

    def apply(
        self,
        params: Params,
        inputs: Any,
        prev_state: Any = None,
        is_reset: Any = None,
        is_training: bool = True,
        *,
        seq_lengths: Any = None,
    ) -> tuple[tuple[Any, Any], Params]:
        """Runs the module over a sequence.

        Args:
          params: the current params.
          inputs: ``[B, T, ...]`` array or pytree of them.
          prev_state: the carried state (e.g. from the previous chunk for truncated
            BPTT); ``None`` starts from `initial_state`.
          is_reset: ``[B, T]`` booleans; where true, the state is reset to the initial
            state *before* that step is processed (row ``b`` only).
          is_training: passed to every step.
          seq_lengths: ``[B]`` integers in ``[0, T]`` (like PyTorch's packed sequences):
            for steps ``t >= seq_lengths[b]`` row ``b``'s state is frozen and its
            outputs are zero, so the final state is the one after each row's last
            valid step. Lengths outside ``[0, T]`` raise a ``ValueError`` when they are
            concrete; a length traced under ``jax.jit`` cannot be checked and acts as
            if clipped to ``[0, T]``.

        Returns:
          ``((outputs [B, T, ...], final_state), params)``.
        """
        where = f"{type(self).__name__} '{self.path_str}'"
        name = type(self).__name__.lower()
        check_sequence_rank(inputs, self._sequence_rank(), where, f"{name}(params, x_t, state)")
        steps = sequence_length(inputs, where)
        batch = batch_size_of(inputs)
        is_reset = check_is_reset(is_reset, batch, steps, where)
        valid = check_seq_lengths(seq_lengths, batch, steps, where)
        x0 = jax.tree.map(lambda x: x[:, 0], inputs)
        if prev_state is None:
            prev_state, params = self.initial_state(params, x0)
        else:
            prev_state = self._check_state(params, prev_state, x0)
        scan = _static_scan if self._is_static else _dynamic_scan
        return scan(self, params, inputs, prev_state, is_reset, is_training, valid)

    def _sequence_rank(self) -> int | None:
        return None if self._STEP_INPUT_RANK is None else self._STEP_INPUT_RANK + 1

    def _check_state(self, params: Params, prev_state: Any, inputs: Any) -> Any:
        """Checks a carried state against one step's ``inputs``; returns the state to use.

        The base check rejects the ``(state, params)`` pair of ``initial_state``.
        """
        if contains_params(prev_state):
            name = type(self).__name__.lower()
            raise TypeError(
                STATE_IS_PAIR.format(
                    where=f"{type(self).__name__} '{self.path_str}'", name=name, out="y, state"
                )
            )
        return prev_state

    def maybe_reset_state(
        self, params: Params, prev_state: Any, inputs: Any, is_reset: Any = None
    ) -> Any:
        """Replaces the state of the batch rows where ``is_reset`` ([B]) is true by a
        fresh initial state."""
        if is_reset is None:
            return prev_state
        is_reset = jnp.asarray(is_reset)
        batch = batch_size_of(inputs)
        if is_reset.shape != (batch,):
            if is_reset.size == batch and all(d == 1 for d in is_reset.shape[1:]):
                is_reset = is_reset.reshape((batch,))
            else:
                raise ValueError(
                    f"{type(self).__name__} '{self.path_str}': is_reset for one step must "
                    f"have shape [B] = ({batch},), got {is_reset.shape}."
                )
        fresh, _ = self.initial_state(params, inputs)

        def pick(new, old):
            mask = is_reset.reshape((batch,) + (1,) * (jnp.ndim(old) - 1))
            return jnp.where(mask, new, old)

        return jax.tree.map(pick, fresh, prev_state)
