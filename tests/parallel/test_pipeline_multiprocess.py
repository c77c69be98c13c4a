"""Under ``python -m blox.launch -n 2
--devices-per-process 4`` (the data x stage mesh spans both processes), `unstack_stages`
splits the stage params (equal to the per-stage params put in) and a 1F1B pipeline step's
loss and per-stage gradients equal the one-process run on 8 simulated devices (the
reference); both ranks print the same values; each process's host rows passed as the
batch are refused with DP's error.
Worker: tests/parallel/pp_worker.py."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.scripts import LAUNCH, clean_env, finish, start

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)

WORKER = "tests/parallel/pp_worker.py"
LINE = re.compile(r"^(stage=\d+ params_equal=\w+ grad|loss)=(\S+)$")


def _env(**extra: str) -> dict[str, str]:
    env = clean_env()
    env.pop("XLA_FLAGS", None)
    env.update(extra)
    return env


def _values(out: str, tag: str = "") -> dict[str, float]:
    found = {}
    for line in out.splitlines():
        if line.startswith(tag) and (hit := LINE.match(line[len(tag) :])):
            found[hit[1]] = float(hit[2])
    return found


def test_two_processes_equal_one_process():
    one_env = _env(XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    launch = (*LAUNCH, "-n", "2", "--devices-per-process", "4")
    outs = finish({"one": start(WORKER, env=one_env), "two": start(*launch, WORKER, env=_env())})
    ref = _values(outs["one"])
    rank0, rank1 = _values(outs["two"], "[0] "), _values(outs["two"], "[1] ")
    assert len(ref) == 5 and sorted(ref) == sorted(rank0) == sorted(rank1), outs["two"][-3000:]
    assert all(f"stage={k} params_equal=True grad" in ref for k in range(4)), ref
    for key in ref:
        np.testing.assert_allclose(rank0[key], ref[key], rtol=1e-6, err_msg=key)
        assert rank1[key] == rank0[key], key
    for tag in ("[0] ", "[1] "):
        (msg,) = [
            json.loads(s[len(tag + "refused=") :])
            for s in outs["two"].splitlines()
            if s.startswith(tag + "refused=")
        ]
        assert msg is not None and "blox.distributed.global_batch" in msg, msg
        assert "batch[0]" in msg and "spans 2 processes" in msg, msg
        assert msg.startswith("pipeline_value_and_grad:"), msg
