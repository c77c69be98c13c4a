"""``examples/actor_learner.py`` from its command line, at tiny size (32 environments):

* it learns: the final ``mean_return`` is at least 3x the first update's return, and the
  ratio check holds (``ratio_err <= 1e-6``) at every update;
* Sebulba (``--actor-devices 1 --learner-devices 4``) at policy lag 1 prints
  ``update=<n> actor_version=<v>`` from the version carried with each trajectory:
  v = n - 1 (versions count from 1, the initial params; update 1 also trains on them,
  nothing older exists);
* a run killed with SIGKILL after a checkpoint and restarted continues bit-identically
  (its lines equal an uninterrupted run's, float bits and all).

The runs start side by side (2 cores) and share the suite's compile cache. The layouts'
equality with one device is checked in-process by ``test_actor_learner.py``.
"""

from __future__ import annotations

import re
import signal
import sys
import time

import pytest

from tests.scripts import finish, start, tail

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)

SCRIPT = "examples/actor_learner.py"
LINE = re.compile(r"^step=(\d+) loss=(\S+) ratio_err=(\S+) episode_return=(\S+)$", re.MULTILINE)
VERSION = re.compile(r"^update=(\d+) actor_version=(\d+)$", re.MULTILINE)
FINAL = re.compile(r"^seed=(\d+) env_steps=(\d+) mean_return=(\S+)$", re.MULTILINE)


def _lines(out: str) -> list[tuple[int, float, float, float]]:
    return [(int(n), float(a), float(b), float(c)) for n, a, b, c in LINE.findall(out)]


def test_tiny_learns_and_sebulba_lag_1_prints_the_actor_version():
    lag1 = ("--size", "tiny", "--steps", "4", "--actor-devices", "1", "--learner-devices", "4")
    outs = finish(
        {
            "learn": start(SCRIPT, "--size", "tiny"),
            "lag1": start(SCRIPT, *lag1, "--policy-lag", "1"),
        }
    )
    learn = _lines(outs["learn"])
    assert len(learn) == 30, tail(outs["learn"])
    assert max(r for _, _, r, _ in learn) <= 1e-6, learn
    ((seed, env_steps, mean_return),) = FINAL.findall(outs["learn"])
    assert (seed, env_steps) == ("0", str(30 * 32 * 32))
    assert float(mean_return) >= 3 * learn[0][3], (mean_return, learn[0])
    assert "env_steps_per_s=" in outs["learn"]
    versions = [(int(n), int(v)) for n, v in VERSION.findall(outs["lag1"])]
    assert versions == [(n, max(n - 1, 1)) for n in range(1, 5)], versions
    assert len(_lines(outs["lag1"])) == 4, tail(outs["lag1"])


SEBULBA_LAG_1 = ("--actor-devices", "2", "--learner-devices", "4", "--policy-lag", "1")


@pytest.mark.parametrize("layout", [(), SEBULBA_LAG_1], ids=["anakin", "sebulba_lag1"])
def test_sigkill_then_restart_continues_bit_identically(tmp_path, layout):
    """Anakin, and Sebulba at policy lag 1 with two actor devices (whose checkpoint
    holds the learner's state, each actor's runner and the rollout collected with the
    previous weights)."""
    steps = 10
    args = ("--size", "tiny", "--steps", str(steps), "--save-every", "2", *layout)
    full = start(SCRIPT, *args, "--ckpt-dir", str(tmp_path / "full"))
    killed = start(SCRIPT, *args, "--ckpt-dir", str(tmp_path / "killed"))
    try:
        # kill mid-run: once update 4 is printed (6 updates to go) and the checkpoint
        # of update 2 is committed
        for line in killed.stdout:
            if line.startswith("step=4 "):
                break
        deadline = time.monotonic() + 300
        while not (tmp_path / "killed" / "2").is_dir():
            assert killed.poll() is None, tail(*killed.communicate())
            assert time.monotonic() < deadline, "no checkpoint within 300 s"
            time.sleep(0.02)
        killed.send_signal(signal.SIGKILL)
        killed.communicate()
        assert killed.returncode == -signal.SIGKILL, (killed.returncode, "ended before")
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.communicate()
        if sys.exc_info()[0] is not None:  # failing: do not leave the other run behind
            full.kill()
            full.communicate()
    resumed = start(SCRIPT, *args, "--ckpt-dir", str(tmp_path / "killed"))
    outs = finish({"full": full, "resumed": resumed})
    assert "resumed from update" in outs["resumed"], tail(outs["resumed"])
    start_at = int(re.search(r"resumed from update (\d+)", outs["resumed"]).group(1))
    assert 2 <= start_at < steps, start_at
    full_lines = LINE.findall(outs["full"])
    assert len(full_lines) == steps, tail(outs["full"])
    # the same text: every float printed with repr, so equal text is equal bits
    assert LINE.findall(outs["resumed"]) == full_lines[start_at:], tail(outs["resumed"])
    versions = VERSION.findall(outs["full"])
    assert VERSION.findall(outs["resumed"]) == versions[start_at:]
    if layout:
        assert [(int(n), int(v)) for n, v in versions] == [
            (n, max(n - 1, 1)) for n in range(1, steps + 1)
        ], versions
    assert FINAL.findall(outs["resumed"]) == FINAL.findall(outs["full"])
