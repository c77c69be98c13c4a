"""The DP step in a 2-process group (``python -m blox.launch -n 2``): each process's host
rows passed straight to the step would train on another batch without an error, so they
are refused with an error naming `blox.distributed.global_batch`; the global batch it
assembles trains as one process would over all rows (reference: plain
``jax.value_and_grad`` on one device, in the worker)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.scripts import LAUNCH, run_ok

WORKER = "tests/parallel/_dp_host_worker.py"


@pytest.mark.slow
def test_host_rows_are_refused_and_the_global_batch_trains_across_two_processes():
    out = run_ok(*LAUNCH, "-n", "2", "--devices-per-process", "2", WORKER, timeout=180)
    for rank in (0, 1):
        tag = f"[{rank}] result="
        (line,) = [s[len(tag) :] for s in out.splitlines() if s.startswith(tag)]
        got = json.loads(line)
        hows = ("jit_numpy", "eager_numpy", "jit_local_array", "auto_jit_numpy", "fsdp_jit_numpy")
        for how in hows:
            msg = got[how]
            assert msg is not None, f"rank {rank}: {how} was not refused"
            assert "blox.distributed.global_batch" in msg, msg
            assert "batch[0]" in msg and "spans 2 processes" in msg, msg
            builder = "make_fsdp_train_step" if how.startswith("fsdp") else "make_dp_train_step"
            assert msg.startswith(builder + ":"), msg
        np.testing.assert_allclose(got["loss"], got["ref_loss"], rtol=1e-5)
        np.testing.assert_allclose(got["kernel"], got["ref_kernel"], rtol=1e-5, atol=1e-6)
