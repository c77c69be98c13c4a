"""blox training helpers: plain functions composed inside your own ``jax.jit``-ed step.

Losses, the split/grad/merge step (`value_and_grad`, `make_train_step`), gradient
accumulation, mixed precision (`Policy`, `DynamicLossScale`), schedules, EMA of weights,
several steps per dispatch, and an optional `fit` loop with loggers. Optax provides every
optimizer; nothing here owns state.
"""

from blox.train._ema import ema_init as ema_init
from blox.train._ema import ema_params as ema_params
from blox.train._ema import ema_update as ema_update
from blox.train._fit import Callback as Callback
from blox.train._fit import EarlyStopping as EarlyStopping
from blox.train._fit import FitResult as FitResult
from blox.train._fit import FitState as FitState
from blox.train._fit import fit as fit
from blox.train._logging import CSVLogger as CSVLogger
from blox.train._logging import History as History
from blox.train._logging import Logger as Logger
from blox.train._logging import StdoutLogger as StdoutLogger
from blox.train._logging import TensorBoardLogger as TensorBoardLogger
from blox.train._logging import plot_history as plot_history
from blox.train._losses import mae as mae
from blox.train._losses import mse as mse
from blox.train._losses import normalized_mae as normalized_mae
from blox.train._losses import normalized_mse as normalized_mse
from blox.train._losses import rmse as rmse
from blox.train._losses import sigmoid_binary_cross_entropy as sigmoid_binary_cross_entropy
from blox.train._losses import softmax_cross_entropy as softmax_cross_entropy
from blox.train._precision import DynamicLossScale as DynamicLossScale
from blox.train._precision import LossScaleState as LossScaleState
from blox.train._precision import Policy as Policy
from blox.train._precision import all_finite as all_finite
from blox.train._schedules import flat_cosine_schedule as flat_cosine_schedule
from blox.train._schedules import warmup_cosine_schedule as warmup_cosine_schedule
from blox.train._step import accumulate_gradients as accumulate_gradients
from blox.train._step import make_train_step as make_train_step
from blox.train._step import stack_batches as stack_batches
from blox.train._step import steps_per_dispatch as steps_per_dispatch
from blox.train._step import value_and_grad as value_and_grad
from blox.train._step import weighted_mean as weighted_mean
from blox.train._step import weighted_terms as weighted_terms

__all__ = sorted(n for n in dir() if not n.startswith("_"))
