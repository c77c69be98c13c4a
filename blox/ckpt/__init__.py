"""Checkpoints with Orbax: save and restore a whole train state, exactly and atomically.

`CheckpointManager` is a thin layer over ``orbax.checkpoint.CheckpointManager``
(asynchronous saves, ``max_to_keep``, keep-best, save every k steps, a final save on exit)
that writes any pytree holding `blox.Params`, Optax state, arrays and Python numbers, plus
a Grain iterator position, into one step directory, with a description (`describe`) of
every leaf next to it. `restore` fills the structure you have (concrete or abstract) with
the shardings of the current mesh, explains any mismatch (`RestoreMismatchError`) and
checks every leaf against the checksum committed with it (`CheckpointError`); `verify`
(and ``python -m blox.ckpt verify DIR``) checks a checkpoint without a model.
`export_params` / `import_params` convert to and from nested dicts of NumPy arrays for
porting weights from PyTorch or Flax. `CheckpointCallback` checkpoints a `blox.fit` run
through a `CheckpointManager` and resumes it when the directory holds a checkpoint.
"""

from blox.ckpt._describe import RestoreMismatchError as RestoreMismatchError
from blox.ckpt._describe import compare as compare
from blox.ckpt._describe import describe as describe
from blox.ckpt._dicts import export_params as export_params
from blox.ckpt._dicts import import_params as import_params
from blox.ckpt._errors import CheckpointError as CheckpointError
from blox.ckpt._fit import CheckpointCallback as CheckpointCallback
from blox.ckpt._manager import CheckpointManager as CheckpointManager
from blox.ckpt._targets import abstract_target as abstract_target
from blox.ckpt._verify import StepCheck as StepCheck
from blox.ckpt._verify import verify as verify

__all__ = [
    "CheckpointCallback",
    "CheckpointError",
    "CheckpointManager",
    "RestoreMismatchError",
    "StepCheck",
    "abstract_target",
    "compare",
    "describe",
    "export_params",
    "import_params",
    "verify",
]
