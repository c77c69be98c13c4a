"""The train step as small functions: split/grad/merge, accumulation, several steps per
dispatch.

Nothing here is jitted: every function returns a plain function the user wraps in
``jax.jit`` (with ``donate_argnums`` as they see fit).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.typing import ArrayLike

from blox.core import Params
from blox.core._guards import (
    check_no_new_params,
    check_placement,
    check_reduce_dtype,
    optimizer_update,
    to_reduce_dtype,
)
from blox.core._params import Path
from blox.train._precision import DynamicLossScale, LossScaleState, Policy, all_finite

__all__ = [
    "accumulate_gradients",
    "make_train_step",
    "stack_batches",
    "steps_per_dispatch",
    "value_and_grad",
    "weighted_mean",
    "weighted_terms",
]

Predicate = Callable[[Path, Any], bool]

#: The aux-dict key under which a loss reports its weight (see `accumulate_gradients`).
WEIGHT_KEY = "weight"

_BAD_RETURN = (
    "value_and_grad: loss_fn must return (loss, params){aux}, the params being those the "
    "forward pass returned (they carry the non-trainable state: RNG counters, BatchNorm "
    "statistics); got {got}. Write it as:\n"
    "    def loss_fn(params, x, y):\n"
    "        y_hat, params = model(params, x)\n"
    "        return {ret}, params"
)


def _check_params(where: str, params: Any) -> None:
    if not isinstance(params, Params):
        raise TypeError(
            f"{where}: the first argument must be the model's bx.Params, got "
            f"{type(params).__name__}. Call it as fn(params, *batch)."
        )


def _unpack(out: Any, has_aux: bool) -> tuple[jax.Array, Any, Params]:
    aux_txt = " (or ((loss, aux), params) with has_aux=True)" if not has_aux else ""
    ret = "(loss, aux)" if has_aux else "loss"
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], Params)):
        got = type(out).__name__
        if hasattr(out, "shape") and hasattr(out, "dtype"):
            got = f"an array of shape {tuple(out.shape)}"
        elif isinstance(out, tuple):
            got = f"a tuple of {len(out)} ({', '.join(type(o).__name__ for o in out)})"
        raise TypeError(_BAD_RETURN.format(aux=aux_txt, got=got, ret=ret))
    value, new_params = out
    if has_aux:
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(
                "value_and_grad(has_aux=True): loss_fn must return ((loss, aux), params); "
                f"got a first element of type {type(value).__name__}."
            )
        loss, aux = value
    else:
        loss, aux = value, None
    loss = jnp.asarray(loss)
    if loss.shape != () or not jnp.issubdtype(loss.dtype, jnp.floating):
        raise ValueError(
            f"value_and_grad: the loss must be a floating scalar, got {loss.dtype} of shape "
            f"{tuple(loss.shape)}. Reduce it, e.g. jnp.mean(...) (blox.train losses do)."
        )
    if isinstance(aux, dict) and WEIGHT_KEY in aux:
        aux = dict(aux)
        aux[WEIGHT_KEY] = _check_weight(aux[WEIGHT_KEY])
    return loss, aux, new_params


def _check_weight(weight: Any) -> jax.Array:
    w = jnp.asarray(weight)
    if w.shape != () or not (
        jnp.issubdtype(w.dtype, jnp.integer) or jnp.issubdtype(w.dtype, jnp.floating)
    ):
        raise ValueError(
            f"value_and_grad: aux['{WEIGHT_KEY}'] is the loss's weight (the number of real "
            "tokens or examples the loss averages over) and must be an integer or floating "
            f"scalar, got {w.dtype} of shape {tuple(w.shape)}. Return e.g. "
            f"{{'{WEIGHT_KEY}': jnp.sum(mask)}}, or rename the entry if it is another metric."
        )
    return w


def _loss_weight(value: Any) -> jax.Array | None:
    """The weight a loss reported: ``aux['weight']`` of a ``(loss, aux)`` value, else None."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        return value[1].get(WEIGHT_KEY)
    return None


def weighted_terms(value: Any, grads: Any) -> tuple[Any, Any, jax.Array]:
    """The terms whose sums over microbatches or devices give the (weighted) mean.

    The building block of `accumulate_gradients`, exposed for data-parallel steps: each
    device computes ``value, grads`` on its shard, the terms are summed over the devices
    with ``jax.lax.psum``, and `weighted_mean` divides. The result equals the full-batch
    loss and gradients also when shards hold different numbers of real tokens, as long as
    the loss reports its weight (``aux['weight']``, see `accumulate_gradients`)::

        # inside jax.shard_map, params replicated (P()), the batch split over 'data'
        params = jax.lax.pcast(params, 'data', to='varying')  # this device's own grads
        (loss, aux), grads, params = grad_fn(params, *shard)
        terms = jax.lax.psum(bx.weighted_terms((loss, aux), grads), 'data')
        (loss, aux), grads = bx.weighted_mean(*terms)

    (Without the ``pcast``, ``shard_map`` differentiates replicated params by summing
    their gradients over the devices itself, and the ``psum`` would count them again.)

    Without a weight the terms are ``value`` and ``grads`` themselves and the count is
    1 (an int32 scalar), which gives the plain mean over parts. With a weight ``w``, every
    floating leaf of the loss, of the aux (the weight excepted) and of the gradients is
    multiplied by ``w``, and the count is ``w``. A part of weight 0 contributes exactly 0,
    even if its loss is NaN (a mean over no tokens). Integer aux leaves, and the weight,
    are left as they are, so their sums are totals.

    Args:
      value: ``loss`` (a floating scalar) or ``(loss, aux)``, as a `value_and_grad`
        function returns it.
      grads: the gradients (any pytree, e.g. the `Params` `value_and_grad` returns).

    Returns:
      ``(value_terms, grads_terms, count)``, the same trees plus a scalar.

    >>> import jax.numpy as jnp
    >>> value = (jnp.float32(2.0), {'weight': jnp.int32(3)})
    >>> (loss, aux), grads, count = weighted_terms(value, {'w': jnp.ones(2)})
    >>> float(loss), grads['w'].tolist(), int(count), int(aux['weight'])
    (6.0, [3.0, 3.0], 3, 3)
    """
    w = _loss_weight(value)
    if w is None:
        return value, grads, jnp.ones((), jnp.int32)
    w = jnp.asarray(w)

    def weigh(x):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return x
        return jnp.where(w != 0, w.astype(x.dtype) * x, jnp.zeros((), x.dtype))

    return _map_value(weigh, value), jax.tree.map(weigh, grads), w


def weighted_mean(value_sum: Any, grads_sum: Any, count_sum: ArrayLike) -> tuple[Any, Any]:
    """Finishes a mean from summed `weighted_terms`: ``(value, grads)``.

    Every floating leaf (the weight excepted) is divided by `count_sum`, the total
    weight (or the number of parts, without a weight); integer leaves and the weight stay
    sums (totals). A total weight of 0 (every part empty) gives 0 for the loss, the
    floating aux and the gradients, not NaN.

    Args:
      value_sum: the summed value terms.
      grads_sum: the summed gradient terms.
      count_sum: the summed counts.

    Returns:
      ``(value, grads)`` with the structure `weighted_terms` was given.

    >>> import jax, jax.numpy as jnp
    >>> # two microbatches: mean loss 2.0 over 3 tokens, mean loss 5.0 over 1 token
    >>> t1 = weighted_terms((jnp.float32(2.0), {'weight': jnp.int32(3)}), jnp.ones(()))
    >>> t2 = weighted_terms((jnp.float32(5.0), {'weight': jnp.int32(1)}), jnp.ones(()))
    >>> (loss, aux), grads = weighted_mean(*jax.tree.map(jnp.add, t1, t2))
    >>> float(loss), int(aux['weight']), float(grads)  # loss: (3 * 2.0 + 1 * 5.0) / 4
    (2.75, 4, 1.0)
    """
    count = jnp.asarray(count_sum)
    zero = count == 0
    safe = jnp.where(zero, jnp.ones((), count.dtype), count)

    def div(x):
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            return x
        return jnp.where(zero, jnp.zeros((), x.dtype), x / safe.astype(x.dtype))

    weighted = _loss_weight(value_sum) is not None
    value = _map_value(div, value_sum) if weighted else jax.tree.map(div, value_sum)
    return value, jax.tree.map(div, grads_sum)


def _map_value(fn: Callable[[jax.Array], jax.Array], value: Any) -> Any:
    """Maps `fn` over the loss and aux leaves of a weighted value, the weight excepted."""
    loss, aux = value
    aux = {k: v if k == WEIGHT_KEY else jax.tree.map(fn, v) for k, v in aux.items()}
    return fn(loss), aux


def _restore_dtypes(new: Params, old: Params) -> Params:
    """Casts floating leaves of `new` back to the dtypes of `old` (same structure)."""
    if jax.tree.structure(new) != jax.tree.structure(old):
        return new

    def cast(n, o):
        if n.dtype != o.dtype and jnp.issubdtype(o.dtype, jnp.floating):
            return n.astype(o.dtype)
        return n

    return jax.tree.map(cast, new, old)


def _grad_fn(
    loss_fn: Callable[..., Any],
    has_aux: bool,
    predicate: Predicate | None,
    policy: Policy | None,
    where: str | None = None,
) -> Callable[..., Any]:
    """``f(params, scale, *args) -> ((loss, aux), grads, params)``; `scale` may be None.
    With `where` (a train step), a parameter created by `loss_fn` raises, naming it."""

    def inner(trainable, non_trainable, scale, args):
        if policy is not None:
            trainable = policy.cast_to_compute(trainable)
            args = policy.cast_to_compute(args)
        given = trainable.merge(non_trainable)
        loss, aux, new_params = _unpack(loss_fn(given, *args), has_aux)
        if where is not None:
            check_no_new_params(given, new_params, where)
        if policy is not None:
            loss = loss.astype(policy.output_dtype)
            if isinstance(aux, dict) and WEIGHT_KEY in aux:  # a count: keep it exact
                aux = {
                    k: v if k == WEIGHT_KEY else policy.cast_to_output(v) for k, v in aux.items()
                }
            else:
                aux = policy.cast_to_output(aux)
        new_nt = new_params.split(predicate)[1]
        new_nt = _restore_dtypes(new_nt, non_trainable)
        scaled = loss if scale is None else loss * scale.astype(loss.dtype)
        return scaled, (loss, aux, new_nt)

    grad = jax.grad(inner, has_aux=True)

    def f(params, scale, *args):
        _check_params("value_and_grad", params)
        trainable, non_trainable = params.split(predicate)
        if policy is not None:
            wrong = {
                str(v.dtype)
                for v in jax.tree.leaves(trainable)
                if jnp.issubdtype(v.dtype, jnp.floating) and v.dtype != policy.param_dtype
            }
            if wrong:
                raise ValueError(
                    f"value_and_grad: the policy keeps master params in {policy.param_dtype}, "
                    f"but trainable params are stored as {sorted(wrong)}. Initialize them in "
                    f"{policy.param_dtype} (param_dtype=...) or cast with "
                    "policy.cast_to_param(params)."
                )
        grads, (loss, aux, new_nt) = grad(trainable, non_trainable, scale, args)
        return (loss, aux), grads, trainable.merge(new_nt)

    return f


def value_and_grad(
    loss_fn: Callable[..., Any],
    *,
    has_aux: bool = False,
    predicate: Predicate | None = None,
    policy: Policy | None = None,
) -> Callable[..., Any]:
    """The split/grad/merge pattern as one function.

    ``loss_fn(params, *args)`` runs the forward pass and returns ``(loss, params)`` (or
    ``((loss, aux), params)`` with `has_aux`), the params being those the model returned.
    The result ``f(params, *args)`` returns::

        loss, grads, params = f(params, *args)            # has_aux=False
        (loss, aux), grads, params = f(params, *args)     # has_aux=True

    where ``grads`` is a `Params` holding only the trainable half
    (``params.split(predicate)[0]``: the tree Optax's ``tx.init`` / ``tx.update`` expect),
    and the returned ``params`` are the *input* trainable values merged with the
    non-trainable state the forward pass produced (advanced RNG counters, updated
    BatchNorm statistics). It is exactly this hand-written code::

        def inner(trainable, non_trainable, *args):
            loss, new_params = loss_fn(trainable.merge(non_trainable), *args)
            return loss, new_params.split()[1]

        trainable, non_trainable = params.split()
        (loss, non_trainable), grads = jax.value_and_grad(inner, has_aux=True)(
            trainable, non_trainable, *args)
        params = trainable.merge(non_trainable)

    Args:
      loss_fn: ``(params, *args) -> (loss, params)``; the loss a floating scalar.
      has_aux: `loss_fn` returns ``((loss, aux), params)``. A dict aux may report the
        loss's weight as ``aux['weight']`` (an integer or floating scalar: the real
        tokens or examples the loss averages over), which `accumulate_gradients` and
        data-parallel steps (`weighted_terms`) use to weight the mean; any other
        shape raises a `ValueError`.
      predicate: ``(path, Param) -> bool`` choosing what is differentiated (default: the
        trainable flag, as `Params.split`). Use it to freeze part of a model.
      policy: a mixed-precision `Policy` (see there for what is cast where).

    Returns:
      ``f(params, *args)`` as above; plain JAX, so call it inside your ``jax.jit``.

    >>> import blox as bx, jax, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> model = bx.Linear(g / 'fc', 1, rng)
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> _, params = model(rng.seed(bx.Params(), seed=0), x)
    >>> def loss_fn(params, x, y):
    ...     y_hat, params = model(params, x)
    ...     return bx.mse(y_hat, y), params
    >>> loss, grads, params = bx.value_and_grad(loss_fn)(params.locked(), x, y)
    >>> sorted('/'.join(p) for p in grads.keys())
    ['net/fc/bias', 'net/fc/kernel']
    """
    inner = _grad_fn(loss_fn, has_aux, predicate, policy)

    def f(params: Params, *args: Any):
        (loss, aux), grads, params = inner(params, None, *args)
        return ((loss, aux) if has_aux else loss), grads, params

    return f


def _split_microbatches(args: tuple, k: int, where: str) -> tuple:
    flat, treedef = jax.tree_util.tree_flatten_with_path(args)
    out = []
    for path, leaf in flat:
        shape = jnp.shape(leaf)
        if not shape:
            raise ValueError(
                f"{where}: batch leaf args{jax.tree_util.keystr(path)} is a scalar; every "
                "leaf of the batch arguments must have a leading batch axis to split into "
                "microbatches. Close over constants in loss_fn instead."
            )
        if shape[0] % k:
            raise ValueError(
                f"{where}: cannot split batch leaf args{jax.tree_util.keystr(path)} of shape "
                f"{tuple(shape)} into {k} equal microbatches ({shape[0]} is not divisible by "
                f"{k}). Use a batch size that is a multiple of {k}, or another count "
                f"(divisors of {shape[0]}: "
                f"{[d for d in range(1, shape[0] + 1) if shape[0] % d == 0]})."
            )
        out.append(jnp.reshape(leaf, (k, shape[0] // k) + tuple(shape[1:])))
    return jax.tree_util.tree_unflatten(treedef, out)


def _accumulate(
    fn: Callable[..., Any], k: int, where: str, reduce_dtype: Any = None
) -> Callable[..., Any]:
    """Wraps ``fn(params, *args) -> (value, grads, params)`` to average over k splits
    (weighted by the loss's weight when it reports one). The sums run in
    `reduce_dtype` (`reduce_dtype_of`: float32 for bf16/fp16 values by default); the
    gradients are returned in the dtypes `fn` gives them."""

    def terms(value, grads):
        return weighted_terms(
            to_reduce_dtype(value, reduce_dtype), to_reduce_dtype(grads, reduce_dtype)
        )

    def f(params, *args):
        micro = _split_microbatches(args, k, where)
        first = jax.tree.map(lambda x: x[0], micro)
        value_shape, grads_shape, _ = jax.eval_shape(fn, params, *first)
        terms_shape = jax.eval_shape(terms, value_shape, grads_shape)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), terms_shape)

        def body(carry, mb):
            sums, p = carry
            value, grads, p = fn(p, *mb)
            sums = jax.tree.map(jnp.add, sums, terms(value, grads))
            return (sums, p), None

        (sums, params), _ = jax.lax.scan(body, (zeros, params), micro)
        value, grads = weighted_mean(*sums)
        grads = jax.tree.map(lambda g, s: g.astype(s.dtype), grads, grads_shape)
        return value, grads, params

    return f


def accumulate_gradients(
    grad_fn: Callable[..., Any], num_microbatches: int, *, reduce_dtype: Any = None
) -> Callable[..., Any]:
    """Gradient accumulation: the same call as `grad_fn`, over `num_microbatches` splits.

    `grad_fn` is what `value_and_grad` returns. Every leaf of every argument after
    ``params`` is split along axis 0 into `num_microbatches` equal microbatches, which run
    one after the other in a ``jax.lax.scan`` (one compiled body, memory of one
    microbatch). The non-trainable state is threaded through the microbatches (the RNG
    counter advances once per microbatch).

    How the microbatches are combined (`weighted_terms`, then `weighted_mean`):

    * Unweighted (the default): the loss, the floating aux leaves and the gradients
      returned are the plain means over microbatches. They equal the full-batch values
      when the loss is a mean over examples and every microbatch holds as many of them.
    * Weighted: when `loss_fn` returns ``((loss, aux), params)`` (``has_aux=True``) with
      ``aux['weight']`` a scalar (the number of real tokens or examples its loss
      averages over, e.g. ``jnp.sum(mask)``), each microbatch counts in proportion to its
      weight: ``loss = sum_i w_i * loss_i / sum_i w_i``, the same for the gradients and
      the floating aux leaves, and ``aux['weight']`` is the total ``sum_i w_i``. For a
      masked mean ``loss_i = sum(mask_i * l_i) / sum(mask_i)`` this is exactly the
      full-batch masked mean, however unevenly padding falls on the microbatches. A
      microbatch of weight 0 contributes 0 (even a NaN loss from a mean over no tokens);
      if the total weight is 0, loss and gradients are 0.

    Integer aux leaves (counts) are summed in both cases. The key ``'weight'`` in an aux
    dict is reserved for this: name any other metric differently.

    The sums run in `reduce_dtype`: by default float32 for bf16/fp16 values (a sum of
    ``k`` bf16 gradients in bf16 loses about ``log2(k)`` bits) and the values' own dtype
    otherwise. The gradients are returned in the dtypes `grad_fn` gives them (their
    params' dtypes), the loss and floating aux in `reduce_dtype`.

    Args:
      grad_fn: ``(params, *batch) -> (value, grads, params)``.
      num_microbatches: ``k``; must divide the leading axis of every batch leaf.
      reduce_dtype: the floating dtype of the sums, or ``None`` (the rule above).

    Returns:
      ``f(params, *batch) -> (value, grads, params)``, the signature of `grad_fn`.

    >>> import blox as bx, jax.numpy as jnp
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> model = bx.Linear(g / 'fc', 1, rng)
    >>> x, y = jnp.ones((8, 3)), jnp.zeros((8, 1))
    >>> mask = jnp.array([1, 1, 1, 0, 0, 0, 0, 1], bool)  # microbatches of 2: 2, 1, 0, 1 real
    >>> params = model(rng.seed(bx.Params(), seed=0), x)[1].locked()
    >>> def loss_fn(params, x, y, mask):
    ...     y_hat, params = model(params, x)
    ...     per = bx.mse(y_hat, y, reduction='none')[:, 0]
    ...     n = jnp.sum(mask)
    ...     loss = jnp.sum(jnp.where(mask, per, 0.0)) / jnp.maximum(n, 1).astype(per.dtype)
    ...     return (loss, {'weight': n}), params
    >>> acc = bx.accumulate_gradients(bx.value_and_grad(loss_fn, has_aux=True), 4)
    >>> (loss, aux), grads, params = acc(params, x, y, mask)
    >>> int(aux['weight'])
    4
    """
    k = _check_count(num_microbatches, "accumulate_gradients", "num_microbatches")
    reduce_dtype = check_reduce_dtype(reduce_dtype, "accumulate_gradients")
    if k == 1:
        return grad_fn
    return _accumulate(grad_fn, k, "accumulate_gradients", reduce_dtype)


def _check_count(k: Any, where: str, name: str) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"{where}: {name} must be a positive int, got {k!r}.")
    return int(k)


def _metrics(loss: jax.Array, aux: Any, has_aux: bool) -> dict[str, Any]:
    metrics: dict[str, Any] = {"loss": loss}
    if has_aux:
        if isinstance(aux, dict):
            if "loss" in aux:
                raise ValueError(
                    "make_train_step: aux has a 'loss' entry, which would overwrite the loss "
                    "in the metrics; rename it (e.g. 'loss_unscaled')."
                )
            metrics.update(aux)
        else:
            metrics["aux"] = aux
    return metrics


def make_train_step(
    loss_fn: Callable[..., Any],
    tx: optax.GradientTransformation,
    *,
    has_aux: bool = False,
    predicate: Predicate | None = None,
    accumulation_steps: int = 1,
    policy: Policy | None = None,
    loss_scale: DynamicLossScale | None = None,
    reduce_dtype: Any = None,
) -> Callable[..., Any]:
    """Builds ``step(params, opt_state, *batch) -> (params, opt_state, metrics)``.

    The step is `value_and_grad` (optionally through `accumulate_gradients`), then
    ``tx.update`` and ``optax.apply_updates`` on the trainable half, then the merge with
    the new non-trainable state. The optimizer state is ``tx.init(params.split()[0])``
    (with the same `predicate`): a plain pytree that Optax produces. Clipping, NaN
    skipping, weight decay and schedules belong in `tx` (an ``optax.chain``).

    ``metrics`` is ``{'loss': loss}``, plus the entries of `aux` when it is a dict (else
    ``metrics['aux']``). With `accumulation_steps`, the loss and floating aux are the
    means over microbatches, weighted by ``aux['weight']`` when the loss reports one (see
    `accumulate_gradients`; ``metrics['weight']`` is then the batch's total). The step is
    not jitted: wrap it, e.g. ``jax.jit(step, donate_argnums=(0, 1))``.

    Dtype promotion: ``tx.update`` and ``optax.apply_updates`` run under
    ``jax.numpy_dtype_promotion('standard')``, because Optax itself mixes Python floats
    with int32 step counters (``b1 ** count`` in Adam), which strict promotion rejects.
    So the step works when traced under ``jax_numpy_dtype_promotion='strict'``; your
    `loss_fn` (the model) still runs under the mode you set.

    With ``loss_scale=DynamicLossScale(...)`` (for float16) the step threads its state::

        params, opt_state, ls_state, metrics = step(params, opt_state, ls_state, *batch)

    the loss is scaled before differentiation, the gradients unscaled, a step with
    non-finite gradients is skipped (params, non-trainable state and optimizer state all
    kept) and the scale adjusted; ``metrics`` gains ``'loss_scale'`` (the scale used) and
    ``'grads_finite'``.

    Args:
      loss_fn: ``(params, *batch) -> (loss, params)`` (``((loss, aux), params)`` with
        `has_aux`).
      tx: the Optax transformation.
      has_aux: see `value_and_grad`.
      predicate: what is trained (default: the trainable flag).
      accumulation_steps: split the batch into this many microbatches
        (`accumulate_gradients`).
      policy: a mixed-precision `Policy`.
      loss_scale: dynamic loss scaling (see above).
      reduce_dtype: the dtype of the sums over microbatches (default: float32 for
        bf16/fp16 gradients; see `accumulate_gradients`).

    Raises:
      ValueError: (at trace time) `loss_fn` creates a parameter the params passed to the
        step do not hold (a layer first called inside the loss would be re-initialized
        at every step and never trained): initialize the model and ``params.locked()``
        first.

    >>> import blox as bx, jax, jax.numpy as jnp, optax
    >>> g = bx.Graph('net'); rng = bx.Rng(g / 'rng')
    >>> model = bx.Linear(g / 'fc', 1, rng)
    >>> x, y = jnp.ones((4, 3)), jnp.zeros((4, 1))
    >>> params = model(rng.seed(bx.Params(), seed=0), x)[1].locked()
    >>> def loss_fn(params, x, y):
    ...     y_hat, params = model(params, x)
    ...     return bx.mse(y_hat, y), params
    >>> tx = optax.sgd(0.1)
    >>> step = jax.jit(bx.make_train_step(loss_fn, tx), donate_argnums=(0, 1))
    >>> opt_state = tx.init(params.split()[0])
    >>> params, opt_state, metrics = step(params, opt_state, x, y)
    >>> sorted(metrics)
    ['loss']
    """
    k = _check_count(accumulation_steps, "make_train_step", "accumulation_steps")
    reduce_dtype = check_reduce_dtype(reduce_dtype, "make_train_step")
    base = _grad_fn(loss_fn, has_aux, predicate, policy, where="make_train_step")

    def grads_of(params, scale, args):
        def fn(p, *a):
            return base(p, scale, *a)

        if k > 1:
            fn = _accumulate(fn, k, "make_train_step(accumulation_steps)", reduce_dtype)
        return fn(params, *args)

    def update(params, opt_state, grads):
        trainable, non_trainable = params.split(predicate)
        trainable, opt_state = optimizer_update(tx, grads, opt_state, trainable)
        return trainable.merge(non_trainable), opt_state

    if loss_scale is None:

        def step(params, opt_state, *batch):
            check_placement((params, opt_state, batch), "make_train_step")  # eager calls
            (loss, aux), grads, params = grads_of(params, None, batch)
            params, opt_state = update(params, opt_state, grads)
            return params, opt_state, _metrics(loss, aux, has_aux)

        return step

    def scaled_step(params, opt_state, ls_state, *batch):
        if not isinstance(ls_state, LossScaleState):
            raise TypeError(
                "make_train_step(loss_scale=...): the step is step(params, opt_state, "
                f"ls_state, *batch) with ls_state = loss_scale.init(); got "
                f"{type(ls_state).__name__} as the third argument."
            )
        check_placement((params, opt_state, batch), "make_train_step")  # eager calls
        (loss, aux), grads, new_params = grads_of(params, ls_state.scale, batch)
        grads = loss_scale.unscale(grads, ls_state)
        finite = all_finite(grads)
        new_params, new_opt = update(new_params, opt_state, grads)

        def keep(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        params = keep(new_params, params)
        opt_state = keep(new_opt, opt_state)
        metrics = _metrics(loss, aux, has_aux)
        metrics["loss_scale"] = ls_state.scale
        metrics["grads_finite"] = finite
        return params, opt_state, loss_scale.adjust(ls_state, finite), metrics

    return scaled_step


def steps_per_dispatch(
    step: Callable[..., Any], k: int, *, num_state: int = 2, unroll: int = 1
) -> Callable[..., Any]:
    """Runs `k` train steps in one call (one ``jax.jit`` dispatch) via ``jax.lax.scan``.

    ``step(*state, *batch) -> (*state, metrics)`` (e.g. from `make_train_step`, whose
    state is ``(params, opt_state)``: ``num_state=2``; 3 with a loss scale). The result
    ``multi(*state, *stacked_batch) -> (*state, metrics)`` takes batches whose every leaf
    has a leading axis of length `k` (`stack_batches` builds them) and returns the
    metrics of every step stacked along a leading axis ``(k, ...)``. Same params as `k`
    single steps; the dispatch and pytree flattening cost is paid once per `k` steps.

    ``unroll`` is passed to ``lax.scan``. Keep the default of 1 unless you have measured
    a gain: on a 2-core CPU, the tiny-MLP Adam step with ``k=10`` took 1.00x the time of
    ``unroll=1`` at ``unroll=2``, 1.34x at 5 and 1.50x at 10. Unrolling also makes the
    program longer to compile.

    >>> import blox as bx, jax, jax.numpy as jnp
    >>> def step(w, batch):
    ...     w = w - 0.1 * jnp.mean(batch)
    ...     return w, {'w': w}
    >>> multi = jax.jit(bx.steps_per_dispatch(step, 3, num_state=1))
    >>> w, metrics = multi(jnp.zeros(()), jnp.ones((3, 8)))
    >>> metrics['w'].shape
    (3,)
    """
    k = _check_count(k, "steps_per_dispatch", "k")
    if not isinstance(num_state, int) or num_state < 1:
        raise ValueError(f"steps_per_dispatch: num_state must be an int >= 1, got {num_state!r}.")

    def multi(*args):
        if len(args) <= num_state:
            raise TypeError(
                f"steps_per_dispatch: expected {num_state} state argument(s) followed by the "
                f"stacked batch, got {len(args)} argument(s)."
            )
        state, batch = args[:num_state], args[num_state:]
        for path, leaf in jax.tree_util.tree_flatten_with_path(batch)[0]:
            shape = jnp.shape(leaf)
            if not shape or shape[0] != k:
                raise ValueError(
                    f"steps_per_dispatch(k={k}): batch leaf "
                    f"batch{jax.tree_util.keystr(path)} has shape {tuple(shape)}; every leaf "
                    f"needs a leading axis of length {k} (one slice per step). Stack {k} "
                    "batches with bx.stack_batches([...])."
                )

        def body(carry, b):
            out = step(*carry, *b)
            return tuple(out[:num_state]), out[num_state]

        state, metrics = jax.lax.scan(body, tuple(state), batch, unroll=unroll)
        return (*state, metrics)

    return multi


def stack_batches(batches: Sequence[Any]) -> Any:
    """Stacks equal-structure batches along a new leading axis (NumPy, on the host).

    >>> import numpy as np
    >>> stack_batches([{'x': np.ones(2)}, {'x': np.zeros(2)}])['x'].shape
    (2, 2)
    """
    batches = list(batches)
    if not batches:
        raise ValueError("stack_batches: got no batches.")
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *batches)
