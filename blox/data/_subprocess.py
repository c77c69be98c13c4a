"""`call_in_subprocess`: run a function in a fresh interpreter and return its result."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
from collections.abc import Callable
from typing import Any

__all__ = ["call_in_subprocess"]


def call_in_subprocess(fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` run in a fresh (spawned) Python process; returns its result.

    For work whose native libraries should not share a process with the training loop.
    The known case (seed 000): scikit-learn's OpenMP runtime and Grain's index shuffle
    (abseil threading) crashed together in one process with ``mutex lock failed:
    Invalid argument`` (macOS, libomp). Loading data with scikit-learn through this
    function keeps scikit-learn out of the process that shuffles::

        def load():                      # module level, so the child can import it
            from sklearn.datasets import load_digits
            d = load_digits()
            return {'x': d.images, 'y': d.target}

        arrays = call_in_subprocess(load)

    `fn`, its arguments and its result are pickled; `fn` must be importable by name
    (a module-level function, not a lambda), and a script that calls this must guard
    its entry point with ``if __name__ == '__main__':`` (spawn re-imports it).

    Args:
      fn: a picklable callable.
      *args: positional arguments for `fn`.
      **kwargs: keyword arguments for `fn`.

    Returns:
      What `fn` returned. An exception raised by `fn` is raised again here.

    >>> import operator
    >>> call_in_subprocess(operator.add, 2, 3)
    5
    """
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args, **kwargs).result()
