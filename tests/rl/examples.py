"""The RL example's modules (``examples/cartpole.py``, ``examples/actor_learner.py``),
imported once per test process from their files (``examples/`` is not a package)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from types import ModuleType

from tests.scripts import ROOT


@functools.cache
def load(name: str) -> ModuleType:
    """``examples/<name>.py`` as a module, registered under `name` (so the example's own
    ``import cartpole`` finds the same module)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
