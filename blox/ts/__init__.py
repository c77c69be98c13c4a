"""blox ts: time-series system identification (seed 000's TSFast/tsjax recipes in blox).

Models are raw-in/raw-out (the normalization statistics live in their params):
`RNNModel` (GRU/LSTM/RNN), `TCN`, `CRNN`, `ARModel` (teacher forcing, free run,
prediction mode) and `EncoderModel` (encoder state initialization); a physics-informed
variant; recipes for truncated BPTT, noise/bias injection and early stopping on free-run
validation; free-run evaluation and metrics; simulated benchmark systems written to
HDF5; and the `ARX` least-squares baseline. See docs/sysid.md.
"""

from blox.ts._arx import ARX as ARX
from blox.ts._arx import fit_arx as fit_arx
from blox.ts._autoregressive import ARModel as ARModel
from blox.ts._autoregressive import ARState as ARState
from blox.ts._crnn import CRNN as CRNN
from blox.ts._encoder import EncoderModel as EncoderModel
from blox.ts._evaluate import evaluate_free_run as evaluate_free_run
from blox.ts._evaluate import free_run as free_run
from blox.ts._evaluate import make_simulator as make_simulator
from blox.ts._evaluate import plot_simulation as plot_simulation
from blox.ts._evaluate import sysid_metrics as sysid_metrics
from blox.ts._models import RNNModel as RNNModel
from blox.ts._models import RNNStack as RNNStack
from blox.ts._models import SysIdModel as SysIdModel
from blox.ts._physics import PINN as PINN
from blox.ts._physics import msd_residual as msd_residual
from blox.ts._physics import physics_loss as physics_loss
from blox.ts._physics import time_derivatives as time_derivatives
from blox.ts._recipes import SYSID_RECIPE as SYSID_RECIPE
from blox.ts._recipes import SysIdFit as SysIdFit
from blox.ts._recipes import fit_sysid as fit_sysid
from blox.ts._recipes import inject_noise as inject_noise
from blox.ts._recipes import make_sysid_step as make_sysid_step
from blox.ts._recipes import sysid_loss as sysid_loss
from blox.ts._systems import SILVERBOX_FS as SILVERBOX_FS
from blox.ts._systems import DatasetFiles as DatasetFiles
from blox.ts._systems import band_limited_noise as band_limited_noise
from blox.ts._systems import make_dataset as make_dataset
from blox.ts._systems import odd_multisine as odd_multisine
from blox.ts._systems import read_recordings as read_recordings
from blox.ts._systems import simulate_discrete as simulate_discrete
from blox.ts._systems import simulate_duffing as simulate_duffing
from blox.ts._systems import simulate_wiener_hammerstein as simulate_wiener_hammerstein
from blox.ts._systems import write_hdf5 as write_hdf5
from blox.ts._tcn import TCN as TCN
from blox.ts._tcn import TCNBlocks as TCNBlocks

__all__ = sorted(n for n in dir() if not n.startswith("_"))
