"""Scans over time and the base classes of recurrent modules.

Conventions: sequences are batch-major pytrees whose leaves are ``[B, T, ...]``
(time is axis 1); reset flags are ``[B, T]`` booleans. A *step function* has the
signature of a recurrent module's ``__call__``::

    step_fn(params, inputs_t, state, is_reset_t, is_training) -> ((outputs_t, state), params)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from blox.core._graph import Graph
from blox.core._module import Module
from blox.core._params import Params

__all__ = ["static_scan", "dynamic_scan", "SequenceBase", "RecurrenceBase"]

StepFn = Callable[..., tuple[tuple[Any, Any], Params]]


def _seq_len(inputs: Any, where: str) -> int:
    leaves = jax.tree.leaves(inputs)
    if not leaves:
        raise ValueError(f"{where}: inputs has no arrays; pass a [B, T, ...] array or pytree.")
    lengths = set()
    for leaf in leaves:
        if jnp.ndim(leaf) < 2:
            raise ValueError(
                f"{where}: input leaves must have rank >= 2 ([B, T, ...], time on axis 1), "
                f"got shape {jnp.shape(leaf)}. Add the time axis, e.g. x[:, None]."
            )
        lengths.add(jnp.shape(leaf)[1])
    if len(lengths) != 1:
        shapes = [jnp.shape(x) for x in leaves]
        raise ValueError(
            f"{where}: all input leaves must share the time length (axis 1); got shapes {shapes}."
        )
    return lengths.pop()


def _check_reset(is_reset: Any, batch: int | None, steps: int, where: str) -> Any:
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


def _batch_size(inputs: Any) -> int:
    return jnp.shape(jax.tree.leaves(inputs)[0])[0]


def static_scan(
    step_fn: StepFn,
    params: Params,
    inputs: Any,
    prev_state: Any,
    is_reset: Any = None,
    is_training: bool = True,
) -> tuple[tuple[Any, Any], Params]:
    """Runs `step_fn` over time with a Python loop (debuggable; unrolled under jit).

    Equivalent to::

        for t in range(T):
            (out[:, t], state), params = step_fn(params, inputs[:, t], state, is_reset[:, t],
                                                 is_training)

    Args:
      step_fn: see the module docstring.
      params: the current params (may be unlocked: parameters are created on step 0).
      inputs: pytree of ``[B, T, ...]`` arrays.
      prev_state: the state before step 0.
      is_reset: ``[B, T]`` booleans or ``None``.
      is_training: passed to every step.

    Returns:
      ``((outputs, final_state), params)`` with outputs ``[B, T, ...]``.
    """
    steps = _seq_len(inputs, "static_scan")
    is_reset = _check_reset(is_reset, _batch_size(inputs), steps, "static_scan")
    state = prev_state
    outs = []
    for t in range(steps):
        x_t = jax.tree.map(lambda x, t=t: x[:, t], inputs)
        r_t = None if is_reset is None else is_reset[:, t]
        (out, state), params = step_fn(params, x_t, state, r_t, is_training)
        outs.append(out)
    outputs = jax.tree.map(lambda *xs: jnp.stack(xs, axis=1), *outs)
    return (outputs, state), params


def _lax_scan(step_fn, params, inputs, state, is_reset, is_training):
    xs = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), inputs)
    rs = None if is_reset is None else jnp.swapaxes(is_reset, 0, 1)

    def body(carry, xr):
        state, params = carry
        x_t, r_t = xr
        (out, state), params = step_fn(params, x_t, state, r_t, is_training)
        return (state, params), out

    (state, params), outs = jax.lax.scan(body, (state, params), (xs, rs))
    return (jax.tree.map(lambda o: jnp.swapaxes(o, 0, 1), outs), state), params


def dynamic_scan(
    step_fn: StepFn,
    params: Params,
    inputs: Any,
    prev_state: Any,
    is_reset: Any = None,
    is_training: bool = True,
) -> tuple[tuple[Any, Any], Params]:
    """Runs `step_fn` over time with ``jax.lax.scan`` (fast to compile); same results as
    `static_scan`.

    ``(state, params)`` is the scan carry, so non-trainable state (RNG counters) is
    threaded through time. With *unlocked* params (initialization), step 0 runs in
    Python so parameters can be created, and the remaining steps run in ``lax.scan``.

    Args and returns: as `static_scan`.
    """
    steps = _seq_len(inputs, "dynamic_scan")
    is_reset = _check_reset(is_reset, _batch_size(inputs), steps, "dynamic_scan")
    if params.is_locked:
        return _lax_scan(step_fn, params, inputs, prev_state, is_reset, is_training)
    # Initialization: create parameters on step 0, then scan the rest with locked params.
    (out0, state), params = static_scan(
        step_fn,
        params,
        jax.tree.map(lambda x: x[:, :1], inputs),
        prev_state,
        None if is_reset is None else is_reset[:, :1],
        is_training,
    )
    if steps == 1:
        return (out0, state), params
    (rest, state), locked = _lax_scan(
        step_fn,
        params.locked(),
        jax.tree.map(lambda x: x[:, 1:], inputs),
        state,
        None if is_reset is None else is_reset[:, 1:],
        is_training,
    )
    outputs = jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=1), out0, rest)
    return (outputs, state), locked.unlocked()


class SequenceBase(Module):
    """Base class of modules that process sequences step by step.

    Subclasses implement ``initial_state(params, inputs) -> (state, params)`` and
    ``__call__(params, inputs_t, prev_state, is_reset=None, is_training=True) ->
    ((outputs_t, state), params)`` for one step, and ``apply`` over a whole sequence.
    """

    def initial_state(self, params: Params, inputs: Any) -> tuple[Any, Params]:
        raise NotImplementedError(f"{type(self).__name__} must implement initial_state.")

    def apply(
        self,
        params: Params,
        inputs: Any,
        prev_state: Any = None,
        is_reset: Any = None,
        is_training: bool = True,
    ) -> tuple[tuple[Any, Any], Params]:
        raise NotImplementedError(f"{type(self).__name__} must implement apply.")


class RecurrenceBase(SequenceBase):
    """A recurrent module: ``apply`` scans ``__call__`` over time.

    Args:
      graph: this module's node.
      is_static: ``True`` runs `static_scan` (Python loop), ``False`` `dynamic_scan`
        (``lax.scan``). Both give the same numbers on the same params.
    """

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

        Returns:
          ``((outputs [B, T, ...], final_state), params)``.
        """
        where = f"{type(self).__name__} '{self.path_str}'"
        _seq_len(inputs, where)
        if prev_state is None:
            x0 = jax.tree.map(lambda x: x[:, 0], inputs)
            prev_state, params = self.initial_state(params, x0)
        scan = static_scan if self._is_static else dynamic_scan
        return scan(self, params, inputs, prev_state, is_reset, is_training)

    def maybe_reset_state(
        self, params: Params, prev_state: Any, inputs: Any, is_reset: Any = None
    ) -> Any:
        """Replaces the state of the batch rows where ``is_reset`` ([B]) is true by a
        fresh initial state."""
        if is_reset is None:
            return prev_state
        is_reset = jnp.asarray(is_reset)
        batch = _batch_size(inputs)
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
