"""blox layers: every layer is a `Module` returning ``(outputs, params)``."""

from blox.nn._dropout import Dropout as Dropout
from blox.nn._linear import MLP as MLP
from blox.nn._linear import Linear as Linear
from blox.nn._recurrent import LSTM as LSTM
from blox.nn._recurrent import LSTMState as LSTMState
from blox.nn._sequential import Sequential as Sequential

# One import line per public name; __all__ is every public name imported above.
__all__ = sorted(n for n in dir() if not n.startswith("_"))
