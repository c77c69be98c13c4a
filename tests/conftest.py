"""Strict test setup: 8 simulated CPU devices, strict dtype promotion, rank promotion raising.

The device count must be set before JAX is imported, so it is done here at import time
(pytest imports conftest.py before any test module).

The suite is compile-bound (thousands of small XLA CPU compilations), so it compiles with
`jax_disable_most_optimizations` (the setting JAX's own test suite uses): XLA still runs its
HLO passes (fusion, layout, buffer assignment: the optimised HLO, its FLOPs and memory
analysis are what users get) but skips the expensive LLVM backend passes. It is set
through the environment, so the scripts the tests run in subprocesses inherit it. Results
are compared against references with tolerances, which the backend passes do not move
past. A test marked `full_optimizations` compiles with every optimisation on.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

_CACHE_VARS = (
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES",
)
_inherited_cache = {k: os.environ.pop(k) for k in _CACHE_VARS if k in os.environ}

import jax  # noqa: E402

if os.environ.get("A_SUBPROC_CACHE") == "1":
    import tempfile

    if _inherited_cache:
        os.environ.update(_inherited_cache)
    else:
        os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="blox-tests-jax-cache-")
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "standard_promotion: run with standard dtype promotion (Optax itself is not "
        "strict-promotion clean, e.g. `b1 ** count` mixes float and int32).",
    )
    config.addinivalue_line(
        "markers",
        "slow: starts a subprocess or runs an example or benchmark script; "
        "`pytest -m 'not slow'` leaves these out for a quick loop (make test runs all).",
    )
    config.addinivalue_line(
        "markers",
        "full_optimizations: compile with every XLA optimisation on (the suite otherwise "
        "runs with jax_disable_most_optimizations, see tests/conftest.py).",
    )


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    mode = "standard" if request.node.get_closest_marker("standard_promotion") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield


@pytest.fixture(autouse=True)
def _optimizations(request):
    """For a `full_optimizations` test: the flag is read at compile time and is not part
    of JAX's in-memory cache keys, so those caches are cleared before the test (nothing it
    compiles comes from a less optimised compilation) and the setting restored after."""
    if not request.node.get_closest_marker("full_optimizations"):
        yield
        return
    before = jax.config.values["jax_disable_most_optimizations"]
    jax.config.update("jax_disable_most_optimizations", False)
    jax.clear_caches()
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", before)
