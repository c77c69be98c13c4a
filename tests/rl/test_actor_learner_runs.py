"""``examples/actor_learner.py`` from its command line, at tiny size (32 environments):

* it learns: the final ``mean_return`` is at least 3x the first update's return, and the
  ratio check holds (``ratio_err <= 1e-6``) at every update;
* Anakin over 8 devices (``--data-parallel 8``) prints the one-device lines (1e-5);
* a run killed with SIGKILL after a checkpoint and restarted continues bit-identically
  (its lines equal an uninterrupted run's, float bits and all).

The runs start side by side (2 cores) and share the suite's compile cache.
"""

from __future__ import annotations

import re
import signal
import time

import numpy as np
import pytest

from tests.scripts import finish, start, tail

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)

SCRIPT = "examples/actor_learner.py"
LINE = re.compile(r"^step=(\d+) loss=(\S+) ratio_err=(\S+) episode_return=(\S+)$", re.MULTILINE)
FINAL = re.compile(r"^seed=(\d+) env_steps=(\d+) mean_return=(\S+)$", re.MULTILINE)


def _lines(out: str) -> list[tuple[int, float, float, float]]:
    return [(int(n), float(a), float(b), float(c)) for n, a, b, c in LINE.findall(out)]


def test_tiny_learns_and_data_parallel_prints_the_one_device_lines():
    steps = "6"
    outs = finish(
        {
            "learn": start(SCRIPT, "--size", "tiny"),
            "one": start(SCRIPT, "--size", "tiny", "--steps", steps),
            "dp8": start(SCRIPT, "--size", "tiny", "--steps", steps, "--data-parallel", "8"),
        }
    )
    learn = _lines(outs["learn"])
    assert len(learn) == 30, tail(outs["learn"])
    assert max(r for _, _, r, _ in learn) <= 1e-6, learn
    ((seed, env_steps, mean_return),) = FINAL.findall(outs["learn"])
    assert (seed, env_steps) == ("0", str(30 * 32 * 32))
    assert float(mean_return) >= 3 * learn[0][3], (mean_return, learn[0])
    assert "env_steps_per_s=" in outs["learn"]

    one, dp = _lines(outs["one"]), _lines(outs["dp8"])
    assert len(one) == len(dp) == int(steps), tail(outs["dp8"])
    np.testing.assert_allclose(np.array(dp), np.array(one), rtol=1e-5, atol=1e-6)


def test_sigkill_then_restart_continues_bit_identically(tmp_path):
    args = ("--size", "tiny", "--steps", "6", "--save-every", "2")
    full = start(SCRIPT, *args, "--ckpt-dir", str(tmp_path / "full"))
    killed = start(SCRIPT, *args, "--ckpt-dir", str(tmp_path / "killed"))
    # kill as soon as the checkpoint of update 2 is committed (before the end)
    deadline = time.monotonic() + 300
    while not (tmp_path / "killed" / "2").is_dir():
        assert killed.poll() is None, tail(*killed.communicate())
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    assert killed.returncode == -signal.SIGKILL, killed.returncode
    resumed = start(SCRIPT, *args, "--ckpt-dir", str(tmp_path / "killed"))
    outs = finish({"full": full, "resumed": resumed})
    assert "resumed from update" in outs["resumed"], tail(outs["resumed"])
    start_at = int(re.search(r"resumed from update (\d+)", outs["resumed"]).group(1))
    assert 2 <= start_at < 6, start_at
    full_lines = LINE.findall(outs["full"])
    # the same text: every float printed with repr, so equal text is equal bits
    assert LINE.findall(outs["resumed"]) == full_lines[start_at:], tail(outs["resumed"])
    assert FINAL.findall(outs["resumed"]) == FINAL.findall(outs["full"])
