"""Many processes on this machine through ``python -m blox.launch``: the same numbers as one
process, rank-prefixed output, exit codes, and no process left behind when one fails.

References: the single-process run of the same script on 8 devices (parity), closed-form
row blocks (shards), and the operating system (``/proc``, ``os.kill(pid, 0)``) for
processes that must be gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import numpy as np
import pytest

from blox.distributed._launch import main as launch_main
from tests.scripts import LAUNCH, clean_env, run, start, tail

WORKER = "tests/distributed/_worker.py"
EXAMPLE = "examples/multiprocess_dp.py"


def _launch(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return run(*LAUNCH, *args, timeout=timeout, env=clean_env(**env))


def _alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (read from /proc where there is one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = f"/proc/{pid}/stat"
    if os.path.exists(stat):
        with open(stat) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def _lines(out: str, rank: int, prefix: str = "step=") -> list[str]:
    tag = f"[{rank}] "
    return [line[len(tag) :] for line in out.splitlines() if line.startswith(tag + prefix)]


def _losses(lines: list[str]) -> np.ndarray:
    return np.array([float(re.fullmatch(r"step=\d+ loss=(\S+)", s)[1]) for s in lines])


@pytest.mark.slow
def test_two_processes_match_one_process_on_eight_devices(tmp_path):
    one = run(EXAMPLE, "--size", "tiny", "--save-params", str(tmp_path / "one.npz"), timeout=120)
    assert one.returncode == 0, tail(one.stdout, one.stderr)
    # Without the launcher initialize() is a no-op that describes the lone process.
    assert "process 0 of 1 (single process): 8 local cpu devices" in one.stdout
    two = _launch(
        "-n", "2", "--devices-per-process", "4",
        EXAMPLE, "--size", "tiny", "--save-params", str(tmp_path / "two.npz"),
    )  # fmt: skip
    assert two.returncode == 0, tail(two.stdout, two.stderr)
    reference = [s for s in one.stdout.splitlines() if s.startswith("step=")]
    rank0, rank1 = _lines(two.stdout, 0), _lines(two.stdout, 1)
    assert len(reference) == 4 and len(rank0) == 4 and len(rank1) == 4, two.stdout
    assert "[1] process 1 of 2 (environment" in two.stdout
    np.testing.assert_allclose(_losses(rank0), _losses(reference), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(_losses(rank0), _losses(rank1))  # one replicated value
    a, b = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    assert sorted(a.files) == sorted(b.files) and len(a.files) >= 6
    for name in a.files:
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.slow
def test_shards_follow_the_mesh_across_processes():
    proc = _launch("-n", "2", "--devices-per-process", "2", WORKER, "shards", timeout=90)
    assert proc.returncode == 0, tail(proc.stdout, proc.stderr)
    for rank in (0, 1):
        (line,) = _lines(proc.stdout, rank, "shards=")
        got = json.loads(line[len("shards=") :])
        # 16 rows over a data axis of 4 devices, 2 per process: blocks of 8 in order.
        assert got["data"] == [[0, 2, 0, 8], [1, 2, 8, 16]]
        # The model axis spans the processes: both hold (and load) every row.
        assert got["model_across"] == [[0, 1, 0, 16], [0, 1, 0, 16]]
        assert got["mine"] == [rank, 2, 8 * rank, 8 * rank + 8]


def _start(*args: str, **env: str) -> subprocess.Popen:
    return start(*LAUNCH, *args, env=clean_env(**env))


def _read_pids(proc: subprocess.Popen, ranks: int, until: str) -> dict[int, int]:
    """Reads the launcher's stdout until every rank printed `until`; returns rank -> pid."""
    pids: dict[int, int] = {}
    ready: set[int] = set()
    deadline = time.monotonic() + 90
    while len(ready) < ranks:
        line = proc.stdout.readline()
        if not line or time.monotonic() > deadline:
            proc.kill()
            out, err = proc.communicate()
            pytest.fail(f"the group did not start:\n{out[-2000:]}\n{err[-3000:]}")
        if m := re.match(r"\[(\d+)\] pid=(\d+):(\d+)", line):
            pids[int(m[2])] = int(m[3])
        if m := re.match(rf"\[(\d+)\] {until}", line):
            ready.add(int(m[1]))
    return pids


def _finish(proc: subprocess.Popen, limit: float) -> tuple[int, str, str, float]:
    start = time.monotonic()
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the launcher did not exit within {limit} s:\n{err[-3000:]}")
    return proc.returncode, out, err, time.monotonic() - start


@pytest.mark.slow
@pytest.mark.parametrize("who_stops", ["launcher", "heartbeat"])
def test_a_killed_process_ends_the_group(who_stops):
    # 'launcher': it stops the survivor after --grace. 'heartbeat': the launcher waits
    # longer than the JAX heartbeat timeout, so the survivor must end on its own (JAX
    # declares process 1 dead, or Gloo's connection to it breaks), never hang.
    grace = "1" if who_stops == "launcher" else "55"
    proc = _start(
        "-n", "2", "--devices-per-process", "2", "--grace", grace, WORKER, "loop",
        BLOX_HEARTBEAT_TIMEOUT="5",
    )  # fmt: skip
    pids = _read_pids(proc, 2, "sum=")
    os.kill(pids[1], signal.SIGKILL)
    code, _, err, took = _finish(proc, 60)
    assert code == 128 + signal.SIGKILL, err[-3000:]
    assert "[launch] process 1 exited with signal SIGKILL" in err
    assert re.search(r"\[launch\] process 0 exited with (signal|code) \S+", err), err[-3000:]
    if who_stops == "heartbeat":
        assert "sending SIGTERM" not in err, err[-3000:]
    assert took < 60
    assert not any(_alive(p) for p in pids.values()), pids


@pytest.mark.slow
def test_a_process_that_raises_ends_the_group():
    proc = _start("-n", "2", "--devices-per-process", "2", "--grace", "1", WORKER, "raise", "1")
    pids = _read_pids(proc, 2, "joined")
    code, out, err, took = _finish(proc, 60)
    assert code == 1, err[-3000:]
    assert "[1] RuntimeError: boom from process 1" in err
    assert "[launch] process 1 exited with code 1" in err
    assert not any(_alive(p) for p in pids.values()), pids


@pytest.mark.slow
def test_first_nonzero_exit_code_is_returned_and_output_is_prefixed():
    proc = _launch("-n", "3", "--grace", "0.2", WORKER, "exit", "2", "7", timeout=60)
    assert proc.returncode == 7, proc.stderr
    starts = {line.split(":")[0] for line in proc.stdout.splitlines()}
    assert {f"[{r}] pid={r}" for r in range(3)} <= starts, proc.stdout
    assert "[launch] process 2 exited with code 7" in proc.stderr
    pids = [int(p) for p in re.findall(r"pid=\d+:(\d+)", proc.stdout)]
    assert len(pids) == 3 and not any(_alive(p) for p in pids)


@pytest.mark.slow
@pytest.mark.parametrize("joined", [0, 1])
def test_a_process_that_never_joins_is_named(joined):
    # A group of 2 in which only process `joined` starts (one launcher member).
    port = 20000 + os.getpid() % 20000
    proc = _launch(
        "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
        "--process-id", str(joined), WORKER, "loop",
        timeout=60, BLOX_INIT_TIMEOUT="2",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    if joined == 0:
        assert "TimeoutError: process 1 of 2 did not join within 2 s" in proc.stderr
    else:
        assert "TimeoutError: process 1: process 0 (the coordinator, 127.0.0.1:" in proc.stderr


@pytest.mark.parametrize(
    "args, match",
    [
        ([], "give SCRIPT"),
        (["-n", "2", "no_such_script.py"], "script 'no_such_script.py' not found"),
        (["--coordinator", "h:1", "x.py"], "go together"),
        (["-n", "0", WORKER], "must be >= 1"),
        (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2", WORKER], "fit"),
    ],
)
def test_launcher_misuse_is_reported(args, match, capsys):
    with pytest.raises(SystemExit) as exit_info:
        launch_main(args)
    assert exit_info.value.code == 2
    assert re.search(match, capsys.readouterr().err)
