"""The launcher ends a group promptly, with the failing
process's status, whatever way a process fails: it never joins, it calls ``sys.exit(3)``,
it raises while its peers are in a checkpoint save, or it raises outside the launcher
(its ``atexit`` handlers and buffered logs still run); and the launcher is safe to call
from a threaded program and never lets its coordinator port go before process 0 has it.

References: the operating system (exit statuses, ``/proc``, ``bind``), wall-clock bounds
generous for a loaded 2-core machine, and files the processes write.
"""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest

import blox.distributed._launch as launch_module
from blox.distributed._launch import free_port, launch
from blox.distributed._launch import main as launch_main
from blox.distributed._rendezvous import inherited_listener, listen, roll_call
from tests.distributed.test_launch import WORKER, _alive, _finish, _read_pids, _start
from tests.scripts import ROOT, clean_env, start

# --- a process that never joins ----------------------------------------------


def _run(*args: str, **kwargs) -> tuple[int, str, str, float]:
    """`launch` in this process on the worker (which imports no JAX in these modes)."""
    out, err = io.StringIO(), io.StringIO()
    start = time.monotonic()
    code = launch([WORKER, *args], stdout=out, stderr=err, env=clean_env(), **kwargs)
    return code, out.getvalue(), err.getvalue(), time.monotonic() - start


def test_a_process_that_exits_without_joining_fails_the_group(monkeypatch):
    monkeypatch.chdir(ROOT)
    code, _, err, _ = _run("noinit", "0", num_processes=2, grace=0.5)
    assert code == 1, err
    assert (
        "exited with code 0 without calling blox.distributed.initialize(): it ran alone "
        "instead of as process"
    ) in err, err


def test_a_process_that_runs_without_joining_is_stopped(monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, err, took = _run("noinit", "600", num_processes=2, join_timeout=2, grace=0.5)
    assert code == 1, err
    assert "has not called blox.distributed.initialize() 2 s after it started" in err, err
    assert "done without joining" not in out
    pids = [int(p) for p in re.findall(r"pid=\d+:(\d+)", out)]
    assert took < 30 and len(pids) == 2 and not any(_alive(p) for p in pids), (took, out)


def test_the_join_check_can_be_turned_off(monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    code, out, err, _ = _run("noinit", "0", num_processes=2, join_timeout=None)
    assert code == 0, err
    assert out.count("done without joining") == 2
    with pytest.raises(SystemExit):  # the command line's 0 means None
        launch_main(["-n", "1", "--join-timeout", "-1", WORKER, "noinit", "0"])
    assert "join_timeout=-1.0 must be positive" in capsys.readouterr().err


# --- sys.exit(3) in one process ----------------------------------------------


@pytest.mark.slow
def test_sys_exit_status_ends_the_group_within_seconds():
    # JAX's exit handler would hold process 1 at the shutdown barrier for 300 s (then
    # abort with 134); its status 3 must come back within seconds instead.
    proc = _start(
        "-n", "2", "--devices-per-process", "2", "--grace", "1", "--kill-after", "2",
        WORKER, "sysexit", "1", "3",
    )  # fmt: skip
    pids = _read_pids(proc, 2, "sum=")
    code, _, err, took = _finish(proc, 90)
    assert code == 3, err[-3000:]
    # The launcher sees either the exit marker (still exiting) or the exit itself first.
    assert re.search(
        r"\[launch\] process 1 (is exiting|exited) with code 3; stopping the others in 1 s", err
    ), err[-3000:]
    assert took < 20, (took, err[-3000:])
    assert not any(_alive(p) for p in pids.values()), pids


# --- a process raises while its peers are in a checkpoint save ---------------


@pytest.mark.slow
@pytest.mark.parametrize("how, status", [("raise", 1), ("exit", 4)])
def test_a_failure_during_a_peers_checkpoint_save_ends_the_group(tmp_path, how, status):
    # Process 0 waits in Orbax's save barrier for process 1, which fails instead: by an
    # exception, or by sys.exit(4) (which JAX's exit handler would hold at its own
    # shutdown barrier: both would wait 300 s).
    proc = _start(
        "-n", "2", "--devices-per-process", "2", "--grace", "1", "--kill-after", "2",
        WORKER, "ckpt", "1", str(tmp_path / "ckpt"), how,
    )  # fmt: skip
    pids = _read_pids(proc, 2, "sum=")
    code, out, err, took = _finish(proc, 90)
    assert code == status, err[-3000:]
    if how == "raise":
        assert "[1] RuntimeError: boom from process 1 before its save" in err
    else:
        assert "[1] exiting with 4 before the save" in out
    assert "[0] saving" in out and "[0] saved" not in out  # process 0 was in the save
    assert took < 25, (took, err[-3000:])
    assert not any(_alive(p) for p in pids.values()), pids


class _FakeProc:
    """A process the supervisor polls: running for `running` looks, then `code`."""

    def __init__(self, running: int, code: int):
        self.left, self.code = running, code

    def poll(self):
        self.left -= 1
        return None if self.left >= 0 else self.code


@pytest.mark.parametrize("ended_together", [False, True])
def test_the_first_report_is_the_cause_when_the_peers_report_in_the_same_look(
    tmp_path, ended_together
):
    # Process 1 reports exit status 4 and ends; process 0, which lost its collective
    # partner, reports 1 a moment later. Under load the supervisor can see both reports
    # in one look, before process 1 has ended (the flaky case of the test above), or
    # both processes ended at once: either way the group's status is process 1's.
    (tmp_path / "exit.1").write_text("4")
    os.utime(tmp_path / "exit.1", ns=(1_000_000_000, 1_000_000_000))
    (tmp_path / "exit.0").write_text("1")
    os.utime(tmp_path / "exit.0", ns=(2_000_000_000, 2_000_000_000))
    looks = 0 if ended_together else 3
    procs = {0: _FakeProc(looks, 1), 1: _FakeProc(looks, 4)}
    notes = []
    watch = launch_module._Watch(str(tmp_path), 2, None)
    first = launch_module._supervise(
        procs, 0.0, 0.0, [], notes.append, lambda sig, ranks: None, watch
    )
    assert first == (1, 4), notes
    assert notes[0].startswith("process 1 "), notes


# --- exit_on_error keeps atexit handlers and buffered logs -------------------


@pytest.mark.slow
def test_an_uncaught_exception_runs_atexit_and_flushes_logs_then_exits(tmp_path):
    # Two processes started by hand (no launcher): process 1 raises after joining.
    port = free_port()
    procs = {
        r: start(
            WORKER,
            "atexit",
            "1",
            str(tmp_path),
            env=clean_env(
                BLOX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                BLOX_NUM_PROCESSES="2",
                BLOX_PROCESS_ID=str(r),
                XLA_FLAGS="--xla_force_host_platform_device_count=2",
            ),
        )
        for r in (0, 1)
    }
    try:
        out, err = procs[1].communicate(timeout=90)
        assert procs[1].returncode == 1, err[-3000:]
        assert "RuntimeError: boom from process 1" in err
        assert (tmp_path / "atexit.1").read_text() == "ran"  # the user's atexit handler
        assert "buffered line from process 1" in (tmp_path / "log.1").read_text()
    finally:
        for p in procs.values():
            p.kill()
            p.communicate()


# --- no preexec_fn, the port held until process 0 takes it --------------------


def test_launch_holds_the_port_and_starts_without_preexec_fn(tmp_path, monkeypatch):
    script = tmp_path / "hello.py"
    script.write_text("print('hello')\n")
    seen = []
    real = subprocess.Popen

    def spy(args, **kwargs):
        env = kwargs["env"]
        port = int(env["BLOX_COORDINATOR_ADDRESS"].rsplit(":", 1)[1])
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
                held = False
            except OSError:
                held = True
        seen.append((env["BLOX_PROCESS_ID"], kwargs.get("preexec_fn"), held))
        return real(args, **kwargs)

    monkeypatch.setattr(launch_module.subprocess, "Popen", spy)
    out, err = io.StringIO(), io.StringIO()
    code = launch([str(script)], num_processes=2, join_timeout=None, stdout=out, stderr=err)
    assert code == 0, err.getvalue()
    assert sorted(out.getvalue().splitlines()) == ["[0] hello", "[1] hello"]
    assert seen == [("0", None, True), ("1", None, True)]


def test_launch_from_a_threaded_program(tmp_path):
    # launch() in a worker thread while the main thread keeps running (and holds locks).
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint('hello', sys.argv[1:])\n")
    results = {}
    busy = threading.Lock()

    def run():
        out, err = io.StringIO(), io.StringIO()
        results["code"] = launch(
            [str(script), "a"], num_processes=3, join_timeout=None, stdout=out, stderr=err
        )
        results["out"] = out.getvalue()

    with busy:
        t = threading.Thread(target=run)
        t.start()
        deadline = time.monotonic() + 60
        while t.is_alive() and time.monotonic() < deadline:
            sum(range(1000))
            time.sleep(0.001)
    t.join(5)
    assert results.get("code") == 0, results
    assert sorted(results["out"].splitlines()) == [f"[{r}] hello ['a']" for r in range(3)]


def test_processes_die_with_the_launcher():
    # The runner sets the parent-death signal itself (no preexec_fn): SIGKILL the launcher.
    proc = _start("-n", "2", WORKER, "noinit", "600")
    pids = _read_pids(proc, 2, "pid=")
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids.values()), pids


def test_process_0_serves_the_roll_call_on_the_handed_over_socket():
    server = listen(0)
    port = server.getsockname()[1]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other:
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # held: no other program can take it
    assert inherited_listener({"BLOX_ROLL_CALL_FD": str(server.fileno())}, port + 1) is None
    adopted = inherited_listener({"BLOX_ROLL_CALL_FD": str(server.fileno())}, port)
    assert adopted is not None and adopted.getsockname()[1] == port
    results = {}

    def member(i):
        try:
            roll_call(f"127.0.0.1:{port}", i, 3, 10, listener=adopted if i == 0 else None)
            results[i] = None
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            results[i] = e

    threads = [threading.Thread(target=member, args=(i,)) for i in (1, 2, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: None, 1: None, 2: None}
    assert adopted.fileno() == -1  # closed: JAX's coordinator binds the port next
    server.detach()  # the same descriptor, already closed through `adopted`
