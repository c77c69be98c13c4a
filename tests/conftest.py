"""Strict test setup: 8 simulated CPU devices, strict dtype promotion, rank promotion raising.

The device count must be set before JAX is imported, so it is done here at import time
(pytest imports conftest.py before any test module).
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "standard_promotion: run with standard dtype promotion (Optax itself is not "
        "strict-promotion clean, e.g. `b1 ** count` mixes float and int32).",
    )


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    mode = "standard" if request.node.get_closest_marker("standard_promotion") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield
