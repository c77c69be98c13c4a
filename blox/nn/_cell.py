"""`CellBase`: what the recurrent cells (`LSTM`, `GRU`, `MGU`, `SimpleRNN`) share.

One set of argument checks for the whole family, so every cell refuses the same misuse
with the same kind of error, naming the cell's path and the shapes:

- construction: ``hidden_size`` is a positive int (a bool is refused);
- a carried ``prev_state``: the cell's state type (or a plain tuple of its fields) of
  ``[B, H]`` arrays, not the ``(state, params)`` pair of ``initial_state``;
- one step: a ``prev_state`` is given and the input is ``[B, F]``;
- stored weights: a weight whose shape cannot fit the cell is blamed by path (with a
  transpose hint for PyTorch weights), and a kernel made for another input size names
  the input size it expects.

The sequence checks (``[B, T, F]`` inputs, ``is_reset`` ``[B, T]``, ``seq_lengths``
``[B]``) live in `RecurrenceBase.apply`, shared with every recurrent module. A cell
declares its state type (``_STATE``), its stored weights (``_stored_weights``) and the
kernel whose dtype sets the compute dtype (``_dtype_kernel_path``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from blox.core import Graph, Params, RecurrenceBase
from blox.core._module import stored_shape_error, torch_weight_hint
from blox.core._params import Path, format_path
from blox.core._sequence import vary_like
from blox.core._sharding import zeros_on_batch
from blox.nn._dtype import compute_dtype

__all__ = ["CellBase", "StoredWeight", "check_hidden_size", "describe"]


def describe(value: Any) -> str:
    """A short description of a value for error messages."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"array of shape {tuple(shape)}"
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__


def check_hidden_size(hidden_size: Any, where: str) -> int:
    """`hidden_size` as an int; a ``ValueError`` naming `where` unless it is a positive
    integer (``True`` is refused: it is an int to Python, never a width)."""
    if (
        not isinstance(hidden_size, (int, np.integer))
        or isinstance(hidden_size, (bool, np.bool_))
        or hidden_size <= 0
    ):
        raise ValueError(
            f"{where}: hidden_size must be a positive int, got {hidden_size!r}. Pass the "
            "width of the state, e.g. hidden_size=64."
        )
    return int(hidden_size)


class StoredWeight(NamedTuple):
    """One stored weight a cell checks before use.

    ``layout`` is the expected shape in the legend's letters (``'(F, 3H)'``);
    ``input_rows`` is, for a kernel whose rows are the input features plus a fixed
    number, that number (``0`` for ``(F, kH)``, ``H`` for LSTM's ``(F + H, 4H)``), or
    ``None`` for a weight that does not depend on the input.
    """

    path: Path
    shape: tuple[int, ...]
    layout: str
    input_rows: int | None = None


class CellBase(RecurrenceBase):
    """Base class of the recurrent cells: a state of ``[B, H]`` arrays, one step
    ``__call__(params, x_t [B, F], prev_state, is_reset=None)`` and its checks.

    Args:
      graph: this module's node.
      hidden_size: H, a positive int.
      is_static: `apply` uses a Python loop (``True``) or ``lax.scan`` (``False``).
      dtype: compute dtype (default: `compute_dtype` of the input and the stored kernel);
        the state has this dtype.
      param_dtype: dtype of the parameters.
    """

    _STATE: type  # a NamedTuple of [B, H] arrays, e.g. GRUState(hidden)
    _STATE_ARTICLE = "a"  # for messages: "a GRUState", "an LSTMState"
    _STEP_INPUT_RANK = 2

    def __init__(
        self,
        graph: Graph,
        hidden_size: int,
        is_static: bool = False,
        *,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph, is_static=is_static)
        self.hidden_size = check_hidden_size(hidden_size, self._where)
        self.dtype = dtype
        self.param_dtype = param_dtype

    # -- what a cell declares ------------------------------------------------------

    def _dtype_kernel_path(self) -> Path:
        """The path of the kernel whose stored dtype sets the compute dtype."""
        return self.param_path("kernel")

    def _stored_weights(self, features: int) -> list[StoredWeight]:
        """The weights checked before a step on inputs with `features` features."""
        return []

    # -- names for messages ----------------------------------------------------------

    @property
    def _where(self) -> str:
        return f"{type(self).__name__} '{self.path_str}'"

    @property
    def _call_name(self) -> str:
        return type(self).__name__.lower()

    # -- state -----------------------------------------------------------------------

    def _state_dtype(self, params: Params, x: jax.Array) -> Any:
        kernel = params.value(self._dtype_kernel_path())
        pdt = getattr(kernel, "dtype", None) or self.param_dtype
        return compute_dtype(x, pdt, self.dtype)

    def initial_state(self, params: Params, inputs: Any) -> tuple[Any, Params]:
        """Returns ``(state, params)``: the zero state for one step's inputs.

        Args:
          params: the current params (returned unchanged).
          inputs: one step's inputs ``[B, F]``; only B and the dtype are read.

        Returns:
          ``(state, params)``, a pair: every field of the state is zeros ``[B, H]`` in
          the compute dtype (see `Linear`). Unpack it, ``state, params =
          cell.initial_state(params, x_t)``, and pass ``state`` as ``prev_state``.
          On an Explicit mesh the zeros take the input's batch sharding; inside
          ``jax.shard_map`` they vary over the manual axes the input varies over, so
          a hand-written ``lax.scan`` over the cell's steps accepts them as its carry.
        """
        x = jnp.asarray(jax.tree.leaves(inputs)[0])
        shape = (x.shape[0], self.hidden_size)
        dt = self._state_dtype(params, x)
        # On an Explicit mesh the zeros take the batch sharding of the input; inside
        # shard_map they vary over the axes the input varies over (a lax.scan carry).
        state = self._STATE(
            *(vary_like(zeros_on_batch(shape, dt, x), x) for _ in self._STATE._fields)
        )
        return state, params

    def _check_state(self, params: Params, prev_state: Any, inputs: Any) -> Any:
        """`prev_state` as this cell's state type: its type (or a plain tuple of its
        fields, or a named tuple with the same fields) holding ``[B, H]`` arrays."""
        prev_state = super()._check_state(params, prev_state, inputs)
        fields = self._STATE._fields
        name = self._STATE.__name__
        expected = (jnp.shape(jax.tree.leaves(inputs)[0])[0], self.hidden_size)
        wanted = (
            f"{self._where}: prev_state must be {self._STATE_ARTICLE} {name}"
            + (f"({', '.join(fields)})" if len(fields) > 1 else "")
            + f" with {' and '.join(fields)} [B, H] = {expected}"
        )
        fix = (
            "Carry the state returned by the previous call, or build one with "
            f"`state, params = {self._call_name}.initial_state(params, x_t)`."
        )
        own_fields = getattr(prev_state, "_fields", None)
        if not (
            isinstance(prev_state, self._STATE)
            or own_fields == fields
            or (
                own_fields is None
                and isinstance(prev_state, (tuple, list))
                and len(prev_state) == len(fields)
            )
        ):
            raise TypeError(f"{wanted}, got {describe(prev_state)}. {fix}")
        values = tuple(prev_state)
        if any(tuple(getattr(v, "shape", ())) != expected for v in values):
            got = ", ".join(f"{f}: {describe(v)}" for f, v in zip(fields, values, strict=True))
            raise ValueError(f"{wanted}, got {type(prev_state).__name__} with {got}. {fix}")
        return self._STATE(*values)

    # -- one step ----------------------------------------------------------------------

    def _check_step(self, params: Params, x: jax.Array, prev_state: Any) -> Any:
        """Checks one step's inputs and the stored weights; returns the state as this
        cell's state type."""
        name = self._call_name
        if prev_state is None:
            raise ValueError(
                f"The {type(self).__name__} __call__ method requires a valid prev_state "
                f"('{self.path_str}' runs one step). Get one with `state, params = "
                f"{name}.initial_state(params, x_t)`, or run a whole sequence with "
                f"{name}.apply(params, x)."
            )
        if x.ndim != 2:
            raise ValueError(
                f"{self._where}: one step takes inputs of shape [B, F], got "
                f"{tuple(x.shape)}. For a sequence [B, T, F] use {name}.apply(params, x)."
            )
        self._check_stored(params, x)
        return self._check_state(params, prev_state, x)

    def _check_stored(self, params: Params, x: jax.Array) -> None:
        """Stored weights whose shapes cannot fit this cell are blamed, not the input; a
        kernel that fits the cell but not the input names the input size it expects."""
        hs, features = self.hidden_size, x.shape[-1]
        for w in self._stored_weights(features):
            stored = getattr(params.value(w.path), "shape", None)
            if stored is None:
                continue
            stored = tuple(stored)
            if (
                w.input_rows is not None
                and len(stored) == 2
                and stored[1] == w.shape[1]
                and stored[0] > w.input_rows
                and stored != w.shape
            ):
                name = format_path(w.path[len(self.graph.path) :])
                raise ValueError(
                    f"{self._where} expects inputs with {stored[0] - w.input_rows} features "
                    f"({name} {stored} = {w.layout} with H={hs}), got input shape "
                    f"{tuple(x.shape)}. Fix the input's last dimension; or, if "
                    f"'{format_path(w.path)}' was made for another input size, replace it "
                    "or re-initialize."
                )
            if stored != w.shape:
                why = f" = {w.layout} for F={features}, H={hs}"
                hint = torch_weight_hint(w.path)
                raise ValueError(stored_shape_error(self, w.path, stored, w.shape, why, hint))
