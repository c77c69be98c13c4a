"""The RL example's modules (``examples/cartpole.py``, ``examples/actor_learner.py``),
imported once per test process from their files: `tests.scripts.load_example`."""

from tests.scripts import load_example as load

__all__ = ["load"]
