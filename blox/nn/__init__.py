"""blox layers: every layer is a `Module` returning ``(outputs, params)``."""

from blox.nn._activations import PReLU as PReLU
from blox.nn._activations import get_activation as get_activation
from blox.nn._activations import hard_shrink as hard_shrink
from blox.nn._activations import soft_shrink as soft_shrink
from blox.nn._activations import tanh_shrink as tanh_shrink
from blox.nn._attention import MultiHeadAttention as MultiHeadAttention
from blox.nn._batchnorm import BatchNorm as BatchNorm
from blox.nn._batchnorm import GroupNorm as GroupNorm
from blox.nn._conv import Conv as Conv
from blox.nn._conv import ConvTranspose as ConvTranspose
from blox.nn._dropout import Dropout as Dropout
from blox.nn._embed import Embed as Embed
from blox.nn._linear import MLP as MLP
from blox.nn._linear import Linear as Linear
from blox.nn._moe import MoE as MoE
from blox.nn._norm import LayerNorm as LayerNorm
from blox.nn._norm import RMSNorm as RMSNorm
from blox.nn._pool import avg_pool as avg_pool
from blox.nn._pool import global_avg_pool as global_avg_pool
from blox.nn._pool import global_max_pool as global_max_pool
from blox.nn._pool import max_pool as max_pool
from blox.nn._pool import min_pool as min_pool
from blox.nn._position import LearnedPositionalEmbedding as LearnedPositionalEmbedding
from blox.nn._position import SinusoidalPositionalEncoding as SinusoidalPositionalEncoding
from blox.nn._position import apply_rotary as apply_rotary
from blox.nn._position import sinusoidal_encoding as sinusoidal_encoding
from blox.nn._recurrent import LSTM as LSTM
from blox.nn._recurrent import LSTMState as LSTMState
from blox.nn._resize import resize as resize
from blox.nn._resize import upsample as upsample
from blox.nn._rnn import GRU as GRU
from blox.nn._rnn import MGU as MGU
from blox.nn._rnn import Bidirectional as Bidirectional
from blox.nn._rnn import GRUState as GRUState
from blox.nn._rnn import MGUState as MGUState
from blox.nn._rnn import SimpleRNN as SimpleRNN
from blox.nn._rnn import SimpleRNNState as SimpleRNNState
from blox.nn._running_stats import RunningMeanStd as RunningMeanStd
from blox.nn._sequential import Sequential as Sequential
from blox.nn._transformer import TransformerBlock as TransformerBlock
from blox.nn._transformer import TransformerLM as TransformerLM
from blox.nn._yolo import SPPF as SPPF
from blox.nn._yolo import Bottleneck as Bottleneck
from blox.nn._yolo import C2f as C2f
from blox.nn._yolo import ConvBNSiLU as ConvBNSiLU
from blox.nn._yolo import YOLOBackbone as YOLOBackbone
from blox.nn._yolo import YOLOBackboneNeck as YOLOBackboneNeck
from blox.nn._yolo import YOLONeck as YOLONeck

# One import line per public name; __all__ is every public name imported above.
__all__ = sorted(n for n in dir() if not n.startswith("_"))
