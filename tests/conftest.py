"""Strict test setup: 8 simulated CPU devices, strict dtype promotion, rank promotion raising.

The device count must be set before JAX is imported, so it is done here at import time
(pytest imports conftest.py before any test module).

Compile speed. The suite is compile-bound (thousands of small XLA CPU compilations, most of
them eager ops), so it compiles the way JAX's own test suite does, through the environment
(the scripts the tests run in subprocesses inherit it):

- `JAX_DISABLE_MOST_OPTIMIZATIONS=1`: XLA skips its expensive LLVM backend passes; the HLO
  passes still run, so the optimised HLO (its FLOPs, its memory analysis) is unchanged.
- `--xla_cpu_use_fusion_emitters=false`: the CPU backend emits fused loops with its older,
  faster-compiling emitter. This can move the optimised HLO a little, so a test that reads
  the compiled program's memory or FLOPs compiles it with
  `.compile(compiler_options={"xla_cpu_use_fusion_emitters": True})` and carries the
  `full_optimizations` marker (tests/parallel/test_pipeline.py's memory test).

Both change float rounding only, and every numerical test compares against a reference
with a tolerance. Set JAX_DISABLE_MOST_OPTIMIZATIONS=0 (or pass your own XLA_FLAGS with
--xla_cpu_use_fusion_emitters=true) to run the suite as users compile.

Scripts the tests start (examples, benchmarks, workers) also share one persistent
compilation cache, a temporary directory of this session removed at its end: a resumed or
restarted run and scripts that build the same programs load them instead of compiling
again. The test processes themselves do not use it (their programs rarely repeat across
processes, and writing every entry cost as much as it saved).
"""

import os
import shutil
import tempfile

_DEVICES = "--xla_force_host_platform_device_count=8"
_EMITTERS = "--xla_cpu_use_fusion_emitters="
_flags = os.environ.get("XLA_FLAGS", "").replace(_DEVICES, "").split()
if not any(f.startswith(_EMITTERS) for f in _flags):
    _flags.append(_EMITTERS + "false")
os.environ["XLA_FLAGS"] = " ".join([*_flags, _DEVICES])
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

# The subprocess cache: made by the first process of a session (the xdist controller, or
# the only process); its workers inherit the variables and keep them away from their
# own JAX, which reads them at import.
_CACHE_OWNER = "BLOX_TESTS_SUBPROCESS_CACHE"
_CACHE = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
}
_made_cache = None
if os.environ.get(_CACHE_OWNER):
    for _k in ("JAX_COMPILATION_CACHE_DIR", *_CACHE):
        os.environ.pop(_k, None)

import jax  # noqa: E402

if not os.environ.get(_CACHE_OWNER):
    _made_cache = tempfile.mkdtemp(prefix="blox-tests-jax-cache-")
    os.environ[_CACHE_OWNER] = _made_cache
os.environ.update(_CACHE, JAX_COMPILATION_CACHE_DIR=os.environ[_CACHE_OWNER])

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
        "full_optimizations: compile with jax_disable_most_optimizations off, as users "
        "do (see tests/conftest.py).",
    )


def pytest_collection_modifyitems(config, items):
    """The long tests first: the `slow` ones, then the doctests of the guides (docs/*.md,
    collected last otherwise), then the rest in their order. With `-n 2` the workers take
    tests in this order, so both end on short tests instead of one idling while the other
    runs a long one."""

    def rank(item):
        if item.get_closest_marker("slow"):
            return 0
        return 1 if item.path.suffix == ".md" else 2

    items.sort(key=rank)


def pytest_unconfigure(config):
    if _made_cache:
        shutil.rmtree(_made_cache, ignore_errors=True)


@pytest.fixture(autouse=True)
def _dtype_promotion(request):
    mode = "standard" if request.node.get_closest_marker("standard_promotion") else "strict"
    with jax.numpy_dtype_promotion(mode):
        yield


@pytest.fixture(autouse=True)
def _optimizations(request):
    """For a `full_optimizations` test: the setting is read at compile time and is not
    part of JAX's in-memory cache keys, so those caches are cleared first (nothing the
    test compiles comes from a less optimised compilation); restored after the test."""
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
