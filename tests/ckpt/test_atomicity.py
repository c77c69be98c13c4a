"""A training process saving asynchronously every step is killed with
SIGKILL at random moments and restarted each time. Every restart must restore the last
*committed* step (its state bit-identical to the uninterrupted run's state at that step,
never a partial one), and the final state must equal the uninterrupted run's.

The reference is an uninterrupted run of the same script in its own process, training the
same steps with no checkpointing at all. Kills land after a random number (1 to 4) of
reported steps plus a random delay (fixed seed), i.e. while saves are in flight and steps
remain, however loaded the machine is (with this seed the kills come after about 1 and 3
steps; TOTAL leaves the last run several steps to train). The worker runs under strict
dtype promotion, like the suite. The number of kills and steps is bounded to keep this
test short on 2 idle cores. After each kill every committed step must hold its checksums
(a restart restores it verified: `restore` raises on a step without them)."""

from __future__ import annotations

import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.scripts import ROOT, clean_env

pytestmark = pytest.mark.slow  # starts subprocesses (see tests/conftest.py)

WORKER = ROOT / "tests" / "ckpt" / "ckpt_worker.py"
TOTAL = 12
KILLS = 2


def _env():
    # One device; the faster-compiling CPU emitters of tests/conftest.py.
    return clean_env(
        JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_cpu_use_fusion_emitters=false", PYTHONPATH=str(ROOT)
    )


def _digests(text: str) -> dict[int, str]:
    return {int(s): d for s, d in re.findall(r"^step=(\d+) digest=(\w+)$", text, re.M)}


def _committed(directory: Path) -> list[int]:
    """Step directories Orbax has finished: a plain integer name (temporary ones carry a
    suffix until they are renamed)."""
    if not directory.exists():
        return []
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def test_sigkill_during_async_saves_never_corrupts(tmp_path):
    ref = subprocess.run(
        [sys.executable, str(WORKER), "-", str(TOTAL)],
        capture_output=True,
        text=True,
        timeout=120,
        env=_env(),
        cwd=ROOT,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    reference = _digests(ref.stdout)
    assert sorted(reference) == list(range(1, TOTAL + 1))
    final_ref = re.search(r"final digest=(\w+)", ref.stdout).group(1)

    rand = random.Random(14)
    directory = tmp_path / "run"
    restored_steps = []
    for attempt in range(KILLS + 1):
        committed_before = _committed(directory)
        proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(directory), str(TOTAL)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=ROOT,
        )
        out_lines = []
        if attempt < KILLS:
            # Wait until it has trained a random number (1 to 4) of steps, so that saves are
            # in flight and steps remain, whatever the machine's load; then kill it at a
            # random moment within the next steps.
            wait_steps, seen = rand.randint(1, 4), 0
            while seen < wait_steps:
                line = proc.stdout.readline()
                if not line:
                    break
                out_lines.append(line)
                seen += line.startswith("step=")
            time.sleep(rand.uniform(0.0, 0.1))
            proc.send_signal(signal.SIGKILL)
            rest, err = proc.communicate(timeout=60)
            assert proc.returncode == -signal.SIGKILL or "final digest" in rest, err[-2000:]
        else:
            rest, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-3000:]
        text = "".join(out_lines) + rest
        # Every step committed so far holds its checksums (written inside the commit),
        # so the next restart restores it verified, never unchecked.
        for s in _committed(directory):
            assert (directory / str(s) / "blox" / "checksums.json").exists(), (attempt, s)
        m = re.search(r"^restored step=(\d+) digest=(\w+)$", text, re.M)
        if committed_before:
            # The restart restored the newest committed step, and it is intact.
            assert m is not None, text[-2000:]
            step, dig = int(m.group(1)), m.group(2)
            assert step == committed_before[-1], (step, committed_before)
            assert dig == reference[step], f"restored step {step} differs from the reference"
            restored_steps.append(step)
        else:
            assert m is None
        # Every step the process reported matches the uninterrupted run.
        for s, d in _digests(text).items():
            assert d == reference[s], s
        if "final digest" in text:
            assert re.search(r"final digest=(\w+)", text).group(1) == final_ref
            break
    assert restored_steps, "no restart happened after a committed step"
    assert _committed(directory)[-1] == TOTAL
    # No leftover temporary directories once the last run closed cleanly.
    assert all(p.name.isdigit() for p in directory.iterdir() if not p.name.startswith("_")), [
        p.name for p in directory.iterdir()
    ]
