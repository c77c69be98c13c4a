"""Exception types whose messages stay readable in a traceback."""

from __future__ import annotations

__all__ = ["BloxKeyError"]


class BloxKeyError(KeyError):
    """A ``KeyError`` whose message prints as written, newlines included.

    Python prints a ``KeyError``'s argument with ``repr`` (it is meant to be the missing
    key), so ``KeyError("line one\\n    fix()")`` shows as one quoted line with a literal
    ``\\n``. blox raises this subclass where a ``KeyError`` is expected (an unseeded
    `Rng`, a parameter missing from locked params, an unknown path): ``except KeyError``
    still catches it, and ``str(err)`` and the traceback show the message unquoted.

    >>> err = BloxKeyError("Rng 'net/rng' not initialized:\\n    params = rng.seed(params, seed=0)")
    >>> isinstance(err, KeyError)
    True
    >>> print(str(err))
    Rng 'net/rng' not initialized:
        params = rng.seed(params, seed=0)
    """

    def __str__(self) -> str:
        if len(self.args) == 1 and isinstance(self.args[0], str):
            return self.args[0]
        return super().__str__()
