"""System-identification models with internal normalization: the shared base and `RNNModel`.

Every model takes raw physical inputs ``u`` ``[B, T, Cu]`` and returns raw outputs ``y``
``[B, T, Cy]``: a `blox.data.Normalize` for ``u`` and one for ``y`` hold the training
statistics as non-trainable params. Two calls are common to all of them:

- ``model.forward(params, u, y, prev_state=None, is_reset=None)`` -> ``((y_hat, state),
  params)``: what the training loss sees (teacher forcing for the autoregressive model,
  the encoder's window for the encoder model; other models ignore ``y``);
- ``model.simulate(params, u, y)`` -> ``(y_hat, params)``: free-run simulation over a whole
  sequence (measured ``y`` only where the model is allowed to see it: the warm-up of the
  autoregressive model, the encoder's window).

``model.n_skip`` leading steps are warm-up, excluded from losses and metrics.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from blox.core import Graph, Module, Params, Rng
from blox.data import Normalize
from blox.nn import GRU, LSTM, Linear, SimpleRNN

__all__ = ["RNNModel", "SysIdModel"]

_CELLS = {"gru": GRU, "lstm": LSTM, "rnn": SimpleRNN}


def _stats(where: str, name: str, stats: Any) -> tuple[Any, Any]:
    """``ChannelStats`` (anything with ``.mean``/``.std``) or a ``(mean, std)`` pair."""
    if hasattr(stats, "mean") and hasattr(stats, "std") and not hasattr(stats, "shape"):
        return stats.mean, stats.std
    if isinstance(stats, tuple | list) and len(stats) == 2:
        return stats[0], stats[1]
    raise TypeError(
        f"{where}: {name} must be a ChannelStats (from blox.data.channel_stats(train)['"
        f"{name[0]}']) or a (mean, std) pair, got {type(stats).__name__}."
    )


def check_sequence(where: str, name: str, x: ArrayLike, channels: int) -> jax.Array:
    """``x`` as an array ``[B, T, channels]``; a ``ValueError`` saying what to pass else."""
    a = jnp.asarray(x)
    if a.ndim != 3 or a.shape[-1] != channels:
        raise ValueError(
            f"{where}: {name} must be [B, T, {channels}] (batch, time, channels; the model "
            f"was built for {channels} {name} channel(s)), got shape {tuple(a.shape)}. A "
            f"single recording [T, {channels}] is x[None]."
        )
    return a


INITS = ("torch", "lecun")


def torch_uniform(bound: float, terms: int = 1) -> Any:
    """An initializer drawing ``U(-bound, bound)`` (the sum of `terms` independent draws):
    PyTorch's default for its recurrent cells (``bound = 1 / sqrt(H)`` for every weight
    and bias; an LSTM's one bias here is torch's ``bias_ih + bias_hh``, two draws) and
    for ``nn.Linear`` (``bound = 1 / sqrt(fan_in)``, kernel and bias).

    >>> import jax
    >>> w = torch_uniform(0.5)(jax.random.key(0), (1000,))
    >>> bool(w.min() >= -0.5 and w.max() <= 0.5)
    True
    """

    def init(key: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        keys = jax.random.split(key, terms)
        draws = [jax.random.uniform(k, shape, dtype, -bound, bound) for k in keys]
        return sum(draws[1:], draws[0])

    return init


def check_init(where: str, init: Any) -> str:
    if init not in INITS:
        raise ValueError(
            f"{where}: init must be one of {INITS} (PyTorch's default uniform, or blox.nn's "
            f"LeCun normal / orthogonal / zeros), got {init!r}."
        )
    return init


def check_head_scale(where: str, scale: Any) -> float:
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
        raise ValueError(
            f"{where}: head_scale must be a positive number (the output head's initial "
            f"size as a multiple of its init's draw, e.g. 1.0), got {scale!r}."
        )
    return float(scale)


def check_n_skip(where: str, n_skip: Any) -> int:
    if isinstance(n_skip, bool) or not isinstance(n_skip, int) or n_skip < 0:
        raise ValueError(f"{where}: n_skip must be a non-negative int, got {n_skip!r}.")
    return n_skip


class SysIdModel(Module):
    """Base class of the `blox.ts` models: internal normalization, ``n_skip``, and the
    ``forward`` / ``simulate`` / ``initial_state`` calls the recipes use.

    Shapes (B batch, T time, Cu input / Cy output channels): ``forward`` and
    ``simulate``: ``u [B, T, Cu]`` -> ``y_hat [B, T, Cy]``.

    Args:
      graph: this model's node.
      u_stats: input statistics: a `blox.data.ChannelStats` or a ``(mean, std)`` pair of
        ``(Cu,)`` arrays.
      y_stats: output statistics, the same for ``(Cy,)``.
      n_skip: warm-up steps excluded from losses and metrics.
      dtype: compute dtype (default: the input dtype promoted with float32).
      param_dtype: dtype of the parameters and statistics.

    Parameters: ``<path>/u_norm/{mean,std}`` ``(Cu,)`` and ``<path>/y_norm/{mean,std}``
    ``(Cy,)``, non-trainable.
    """

    def __init__(
        self,
        graph: Graph,
        u_stats: Any,
        y_stats: Any,
        *,
        n_skip: int = 0,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        where = f"{type(self).__name__} '{self.path_str}'"
        self.u_norm = Normalize(
            graph / "u_norm", *_stats(where, "u_stats", u_stats), dtype=dtype,
            param_dtype=param_dtype,
        )  # fmt: skip
        self.y_norm = Normalize(
            graph / "y_norm", *_stats(where, "y_stats", y_stats), dtype=dtype,
            param_dtype=param_dtype,
        )  # fmt: skip
        self.num_inputs = self.u_norm.num_channels
        self.num_outputs = self.y_norm.num_channels
        self.n_skip = check_n_skip(where, n_skip)
        self.dtype = dtype
        self.param_dtype = param_dtype

    @property
    def _where(self) -> str:
        return f"{type(self).__name__} '{self.path_str}'"

    def _u(self, u: ArrayLike) -> jax.Array:
        return check_sequence(self._where, "u", u, self.num_inputs)

    def _y(self, y: ArrayLike) -> jax.Array:
        return check_sequence(self._where, "y", y, self.num_outputs)

    def initial_state(self, params: Params, u_t: ArrayLike) -> tuple[Any, Params]:
        """``(state, params)``: the state before the first step, for one step's inputs
        ``u_t`` ``[B, Cu]`` (``None`` for stateless models)."""
        return None, params

    def forward(
        self,
        params: Params,
        u: ArrayLike,
        y: ArrayLike | None = None,
        prev_state: Any = None,
        is_reset: ArrayLike | None = None,
    ) -> tuple[tuple[jax.Array, Any], Params]:
        """The outputs the training loss sees: ``((y_hat [B, T, Cy], state), params)``.
        This model ignores ``y``."""
        return self(params, u, prev_state, is_reset)

    def simulate(
        self, params: Params, u: ArrayLike, y: ArrayLike | None = None
    ) -> tuple[jax.Array, Params]:
        """Free-run simulation from raw ``u`` ``[B, T, Cu]``: ``(y_hat [B, T, Cy],
        params)``. This model ignores ``y``."""
        (y_hat, _), params = self(params, u)
        return y_hat, params

    def __call__(
        self,
        params: Params,
        u: ArrayLike,
        prev_state: Any = None,
        is_reset: ArrayLike | None = None,
    ) -> tuple[tuple[jax.Array, Any], Params]:
        """Raw ``u`` ``[B, T, Cu]`` -> ``((y [B, T, Cy], state), params)``: ``u``
        normalized, the model's `_core` on it, its output denormalized."""
        z, params = self.u_norm(params, self._u(u))
        (out, state), params = self._core(params, z, prev_state, is_reset)
        y, params = self.y_norm.denormalize(params, out)
        return (y, state), params

    # -- for the subclasses ------------------------------------------------------

    def _core(
        self, params: Params, z: jax.Array, prev_state: Any, is_reset: ArrayLike | None
    ) -> tuple[tuple[jax.Array, Any], Params]:
        """Normalized ``z`` ``[B, T, Cu]`` -> ``((out [B, T, Cy], state), params)``,
        ``out`` in normalized units: what a model of raw ``u`` alone implements (models
        that also read ``y`` override ``__call__`` instead)."""
        raise NotImplementedError(
            f"{self._where}: {type(self).__name__} must implement _core(params, z, "
            "prev_state, is_reset) -> ((out, state), params) or override __call__."
        )

    def _child(self, cls: type, name: str, *args: Any, **kwargs: Any) -> Any:
        """``cls(<path>/<name>, *args, **kwargs)`` in this model's dtypes (its RNN stack,
        heads, convolutional front end, encoder)."""
        return cls(
            self.graph / name, *args, dtype=self.dtype, param_dtype=self.param_dtype, **kwargs
        )

    def _make_rnn(
        self,
        rng: Rng | None,
        hidden_size: int,
        num_layers: int,
        cell: str,
        is_static: bool,
        init: str = "lecun",
    ) -> RNNStack:
        """The `RNNStack` at ``<path>/rnn``, in this model's dtypes."""
        return self._child(
            RNNStack, "rnn", hidden_size, rng, num_layers=num_layers, cell=cell,
            is_static=is_static, init=init,
        )  # fmt: skip

    def _output_linear(
        self,
        rng: Rng | None,
        name: str = "head",
        *,
        fan_in: int | None = None,
        init: str = "lecun",
        scale: float = 1.0,
        **kwargs: Any,
    ) -> Linear:
        """A `Linear` at ``<path>/<name>`` to the Cy outputs, in this model's dtypes
        (``init='torch'``: kernel and bias ``U(+-1/sqrt(fan_in))``, as ``nn.Linear``),
        its initial kernel (and torch's bias) `scale` times the init's draw."""
        if init == "torch":
            bound = scale / float(fan_in) ** 0.5
            kwargs = dict(kwargs, kernel_init=torch_uniform(bound), bias_init=torch_uniform(bound))
        elif scale != 1.0:  # LeCun normal at `scale` times its standard deviation
            kwargs = dict(kwargs, kernel_init=jax.nn.initializers.variance_scaling(
                scale**2, "fan_in", "truncated_normal"))  # fmt: skip
        return self._child(Linear, name, self.num_outputs, rng, **kwargs)

    def _zero_rnn_state(self, params: Params, u_t: ArrayLike) -> tuple[Any, Params]:
        """Zeros for every layer of ``self.rnn``, for ``u_t`` ``[B, Cu]``."""
        z, params = self.u_norm(params, jnp.asarray(u_t))
        return self.rnn.initial_state(params, z)


class RNNStack(Module):
    """Stacked recurrent layers (GRU, LSTM or simple RNN), each feeding the next.

    Shapes: ``[B, T, F]`` -> ``[B, T, H]``; the state is a tuple with one layer state
    per layer. Parameters: ``<path>/layer_<i>/...`` as the chosen cell.

    ``init``: ``'lecun'`` (`blox.nn`'s cell defaults: LeCun-normal input kernels over
    the joint fan-in F + H, orthogonal recurrent kernels, zero biases) or ``'torch'``
    (PyTorch's default: every weight and bias ``U(+-1/sqrt(H))``).
    """

    def __init__(
        self,
        graph: Graph,
        hidden_size: int,
        rng: Rng | None,
        *,
        num_layers: int = 1,
        cell: str = "gru",
        is_static: bool = False,
        init: str = "lecun",
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(graph)
        check_init(f"RNNStack '{self.path_str}'", init)
        if cell not in _CELLS:
            raise ValueError(
                f"'{self.path_str}': cell must be one of {sorted(_CELLS)}, got {cell!r}."
            )
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(
                f"'{self.path_str}': num_layers must be a positive int, got {num_layers!r}."
            )
        self.cell = cell
        self.hidden_size = hidden_size
        self.init = init
        inits: dict[str, Any] = {}
        if init == "torch":
            bound = 1.0 / float(hidden_size) ** 0.5
            terms = 2 if cell == "lstm" else 1  # the LSTM's one bias: bias_ih + bias_hh
            inits = dict(kernel_init=torch_uniform(bound), bias_init=torch_uniform(bound, terms))
            if cell != "lstm":  # the LSTM's one kernel spans [x, h]
                inits["recurrent_kernel_init"] = torch_uniform(bound)
        self.layers = [
            _CELLS[cell](
                graph / f"layer_{i}",
                hidden_size=hidden_size,
                rng=rng,
                is_static=is_static,
                dtype=dtype,
                param_dtype=param_dtype,
                **inits,
            )
            for i in range(num_layers)
        ]

    def initial_state(self, params: Params, x_t: jax.Array) -> tuple[tuple, Params]:
        states = []
        for layer in self.layers:
            s, params = layer.initial_state(params, x_t)
            states.append(s)
        return tuple(states), params

    def __call__(self, params, x, prev_state=None, is_reset=None):
        """Whole sequence: ``x`` ``[B, T, F]`` -> ``((h [B, T, H], states), params)``."""
        states = []
        for i, layer in enumerate(self.layers):
            prev = None if prev_state is None else prev_state[i]
            (x, s), params = layer.apply(params, x, prev_state=prev, is_reset=is_reset)
            states.append(s)
        return (x, tuple(states)), params

    def step(self, params, x_t, state):
        """One step: ``x_t`` ``[B, F]`` -> ``((h_t [B, H], states), params)``."""
        states = []
        for layer, s in zip(self.layers, state, strict=True):
            (x_t, s), params = layer(params, x_t, s)
            states.append(s)
        return (x_t, tuple(states)), params


class RNNModel(SysIdModel):
    """A recurrent simulation model: raw ``u`` in, raw ``y`` out (GRU, LSTM or RNN).

    Legend: B batch, T time, Cu input channels, Cy output channels, H ``hidden_size``.

    Shapes: ``u [B, T, Cu]`` -> ``y_hat [B, T, Cy]``, plus the state (one per layer).

    ``y = denorm(head(rnn(norm(u))) + skip(norm(u)))``: the input normalized with the
    stored statistics, `num_layers` stacked recurrent layers, a linear head, an optional
    linear skip from the normalized input to the output, and the output denormalized.

    Args:
      graph: this model's node.
      u_stats, y_stats: the training statistics (see `SysIdModel`).
      rng: the `Rng` for initialization.
      hidden_size: H.
      num_layers: stacked recurrent layers.
      cell: ``'gru'``, ``'lstm'`` or ``'rnn'`` (`blox.nn.GRU`, `LSTM`, `SimpleRNN`).
      linear_skip: add a linear map of the normalized input to the output.
      n_skip: warm-up steps excluded from the loss (the state is still building up).
      is_static: Python-loop scan instead of ``lax.scan`` (same numbers).
      init: ``'lecun'`` (default: `blox.nn`'s cell and `Linear` defaults, input
        kernels LeCun normal over the joint fan-in F + H) or ``'torch'`` (PyTorch's: the
        cells' weights and biases ``U(+-1/sqrt(H))``, the head and skip
        ``U(+-1/sqrt(fan_in))``, e.g. to compare with a PyTorch model). docs/sysid.md
        gives the ablation of both.
      head_scale: the output head's initial kernel (and with ``init='torch'`` its bias)
        at this multiple of the init's draw; default (None) `DEFAULT_HEAD_SCALE` with
        ``init='lecun'``, 1 with ``'torch'`` (``nn.Linear``'s own). The outputs are in
        normalized units, so this is unit-free; a larger head makes each step of the
        recurrent layers move the output further (docs/sysid.md gives the ablation).
      dtype, param_dtype: see `SysIdModel`; the recurrent state has the compute dtype.

    Returns (``model(params, u, prev_state=None, is_reset=None)``):
      ``((y [B, T, Cy], state), params)``; ``state`` is a tuple of layer states to carry
      into the next chunk (truncated BPTT); ``is_reset`` ``[B, T]`` resets rows to zeros.

    Parameters: the normalizers (see `SysIdModel`), ``<path>/rnn/layer_<i>/...``
    (the cell's parameters), ``<path>/head/{kernel,bias}`` ``(H, Cy)``, ``(Cy,)`` and with
    `linear_skip` ``<path>/skip/kernel`` ``(Cu, Cy)``.

    >>> import blox as bx, jax.numpy as jnp
    >>> from blox.ts import RNNModel
    >>> g = bx.Graph('m'); rng = bx.Rng(g / 'rng')
    >>> model = RNNModel(g / 'gru', ([0.0], [2.0]), ([1.0, 0.0], [1.0, 3.0]), rng,
    ...                  hidden_size=8, linear_skip=True, n_skip=5)
    >>> (y, state), params = model(rng.seed(bx.Params(), seed=0), jnp.ones((4, 20, 1)))
    >>> y.shape, state[0].hidden.shape
    ((4, 20, 2), (4, 8))
    """

    DEFAULT_HEAD_SCALE = 10.0
    """``head_scale`` when none is given with ``init='lecun'``: the head drawn at 10 x
    LeCun normal, standard deviation ``10 / sqrt(H)`` (docs/sysid.md, "How the defaults
    were chosen", gives the ablation)."""

    def __init__(
        self,
        graph: Graph,
        u_stats: Any,
        y_stats: Any,
        rng: Rng | None,
        *,
        hidden_size: int = 64,
        num_layers: int = 1,
        cell: str = "gru",
        linear_skip: bool = False,
        n_skip: int = 0,
        is_static: bool = False,
        init: str = "lecun",
        head_scale: float | None = None,
        dtype: Any | None = None,
        param_dtype: Any = jnp.float32,
    ):
        super().__init__(
            graph, u_stats, y_stats, n_skip=n_skip, dtype=dtype, param_dtype=param_dtype
        )
        self.init = check_init(self._where, init)
        self.rnn = self._make_rnn(rng, hidden_size, num_layers, cell, is_static, init)
        if head_scale is None:
            head_scale = self.DEFAULT_HEAD_SCALE if init == "lecun" else 1.0
        self.head_scale = check_head_scale(self._where, head_scale)
        self.head = self._output_linear(rng, fan_in=hidden_size, init=init, scale=head_scale)
        self.skip = (
            self._output_linear(rng, "skip", fan_in=self.num_inputs, init=init, use_bias=False)
            if linear_skip
            else None
        )

    def initial_state(self, params: Params, u_t: ArrayLike) -> tuple[Any, Params]:
        """``(state, params)``: zeros for every layer, for ``u_t`` ``[B, Cu]``."""
        return self._zero_rnn_state(params, u_t)

    def _core(self, params, z, prev_state, is_reset):
        (h, state), params = self.rnn(params, z, prev_state, is_reset)
        out, params = self.head(params, h)
        if self.skip is not None:
            s, params = self.skip(params, z)
            out = out + s.astype(out.dtype)
        return (out, state), params
